"""Hand-overs that only move the gate: the next one back early, the holder kept for it.

Two promises, beside :mod:`kiwid.core.room`'s:

* the next in line comes back before the holder's quantum ends whenever it fits
  beside the tenants on the card (a prefetch never evicts anyone), so that a
  hand-over only moves the gate;
* a holder whose quantum is over keeps the GPU while the next one's memory is on
  its way (at most one more TQ): the GPU works instead of waiting for a restore.
"""

from __future__ import annotations

from kiwid.core import memory, quanta, room
from kiwid.core.actions import Action, SwapIn
from kiwid.core.model import GpuId, SwapMode, TenantState
from kiwid.core.residency import Move, Residency, move
from kiwid.core.table import TenantTable
from kiwid.core.tenant import TenantRecord

S = TenantState
R = Residency


# ---------------------------------------------------------------- hand-overs


def next_in_line(
    holder: TenantRecord, gating: frozenset[GpuId], queue: list[TenantRecord]
) -> TenantRecord | None:
    """The first waiter on the holder's GPUs (the one its hand-over goes to)."""
    gpus = holder.gpus & gating
    return next((t for t in queue if t.gpus & gpus and t.state is S.WAITING), None)


def prefetch(
    table: TenantTable,
    holder: TenantRecord,
    gating: frozenset[GpuId],
    queue: list[TenantRecord],
    due: float,
) -> tuple[TenantRecord, float] | None:
    """The tenant to bring back before ``holder``'s quantum ends at ``due``, and when.

    Only the first in line on the holder's GPUs, only if it is in host RAM, its
    footprint is known, it fits beside everything on the card (a prefetch never
    evicts anyone) and the driver's free memory takes it.
    """
    nxt = next_in_line(holder, gating, queue)
    if nxt is None or nxt.memory.residency is not R.HOST or not _may_return(table, nxt):
        return None
    seconds = room.PREFETCH_MARGIN_S
    for gpu in nxt.gpus & gating:
        policy = table.policies[gpu]
        if policy.swap is SwapMode.NONE:
            return None
        used = memory.occupied(table.members(gpu), gpu, nxt)
        if used + nxt.size(gpu) > memory.room(policy):
            return None
        rate = table.restore_rate.get(gpu) or room.link_rate(table, gpu, "in")
        seconds = max(seconds, nxt.held(gpu) / rate + room.PREFETCH_MARGIN_S)
    if room.free_short(table, nxt, nxt.gpus & gating) is not None:
        return None
    return nxt, due - seconds


def deferred_until(
    table: TenantTable,
    holder: TenantRecord,
    gating: frozenset[GpuId],
    queue: list[TenantRecord],
    due: float,
) -> float | None:
    """Until when ``holder`` keeps the GPU past its quantum's end ``due`` (``None``: it does not).

    While the next one's memory is on its way back (a restore in flight, or one
    that only waits for swap-outs in flight to make room beside the holder), the
    hand-over waits for it: the holder works on instead of the GPU waiting for a
    restore. At most one more TQ, so that a stuck swap cannot keep the GPU.
    """
    nxt = next_in_line(holder, gating, queue)
    if nxt is None or not _arriving(table, nxt, gating):
        return None
    gpus = holder.gpus & gating
    return due + min((table.policies[g].tq_s for g in gpus), default=0.0)


def _arriving(table: TenantTable, nxt: TenantRecord, gating: frozenset[GpuId]) -> bool:
    if nxt.memory.residency is R.PREFETCHING:
        return True
    if nxt.memory.residency not in (R.HOST, R.SWAPPING_OUT) or not _may_return(table, nxt):
        return False
    leaving = nxt.memory.residency is R.SWAPPING_OUT
    for gpu in nxt.gpus & gating:
        policy = table.policies[gpu]
        if policy.swap is SwapMode.NONE:
            return False
        members = table.members(gpu)
        going = sum(
            o.size(gpu) for o in members if o is not nxt and o.memory.residency is R.SWAPPING_OUT
        )
        if memory.occupied(members, gpu, nxt) - going + nxt.size(gpu) > memory.room(policy):
            return False
        leaving |= going > 0
    # Nothing on its way out: it must be able to start now, else it waits on memory
    # nobody here frees (the driver's reading), which is no reason to hold the GPU.
    return leaving or room.free_short(table, nxt, nxt.gpus & gating) is None


def _may_return(table: TenantTable, t: TenantRecord) -> bool:
    """Whether ``t`` may come back ahead of its turn: its size is known or declared."""
    return t.sized and t.turn.retry_at <= table.now and t.turn.adopting_until <= table.now


def prefetch_next(
    table: TenantTable,
    among: list[TenantRecord],
    gating: frozenset[GpuId],
    wanted: dict[GpuId, tuple[float, int]],
    actions: list[Action],
) -> None:
    """6. Prefetch: the next in line comes back from host RAM before its turn."""
    queue = table.queue(gating, among)
    for t in among:
        plan = prefetch_plan(table, t, gating, queue, wanted)
        if plan is not None and table.now >= plan[1]:
            nxt = plan[0]
            nxt.memory.residency = move(nxt.memory.residency, Move.PREFETCH)
            nxt.turn.waiting_for = None
            room.moving(table, nxt, "in")
            actions.append(SwapIn(nxt.id, epoch=nxt.epoch))


def prefetch_plan(
    table: TenantTable,
    holder: TenantRecord,
    gating: frozenset[GpuId],
    queue: list[TenantRecord],
    wanted: dict[GpuId, tuple[float, int]],
) -> tuple[TenantRecord, float] | None:
    """Whom to bring back before ``holder`` yields, and when (see :func:`prefetch`)."""
    if holder.state is not S.HOLDER or holder.gated:
        return None
    due = quanta.preempt_at(table, holder, gating, wanted)
    if due is None:
        return None
    return prefetch(table, holder, gating, queue, due[0])
