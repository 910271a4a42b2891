"""Memory moves: room for a holder, restores that cannot run out, swap-outs.

The rules of :mod:`kiwid.core.rotation` that move memory, kept apart from the ones
that decide who holds. Three promises:

* a restore starts only when the card has room for it by the scheduler's count
  (everything on the card or moving onto or off it) *and* by the driver's last
  reading of its free memory (what nobody the scheduler knows took), less the
  restores in flight and ``memory.reserve_mib``. A restore that runs out of device
  memory can leave a process stuck in host RAM for good, so it waits instead;
* the next in line comes back before the holder's quantum ends, and a holder keeps
  the GPU while that memory is on its way: :mod:`kiwid.core.prefetch`.
"""

from __future__ import annotations

import math

from kiwid.core import memory, parking
from kiwid.core.actions import Action, SwapIn, SwapOut
from kiwid.core.handover import Phase
from kiwid.core.model import GpuId, SwapMode, TenantState
from kiwid.core.residency import Move, Residency, move
from kiwid.core.states import Trigger
from kiwid.core.table import TenantTable
from kiwid.core.tenant import TenantRecord

S = TenantState
R = Residency
PREFETCH_MARGIN_S = 1.0
"""Seconds of slack on a move's expected time: a prefetch is asked that much earlier,
and a move is overdue that much later."""
DEFAULT_RESTORE_BYTES_PER_S = 5e9
"""Restore rate assumed until one is seen (the driver's restore on an H200: 5.5-7 GB/s)."""
DEFAULT_CHECKPOINT_BYTES_PER_S = 2e9
"""Checkpoint rate assumed until one is seen (the driver's checkpoint on an H200: 2.2 GB/s);
a move is overdue only past twice its size at the rate, so this errs on the safe side."""


# ---------------------------------------------------------------- holders


def release_ungated(table: TenantTable, t: TenantRecord, now: float, actions: list[Action]) -> None:
    """A gated tenant whose GPUs stopped gating: let go once its memory is on the card."""
    if t.memory.residency.on_card:
        table.set_state(t, Trigger.GATING_STOPPED, now)
        t.turn.granted_at = None
        table.let_go(t, now, actions)
    elif t.memory.residency is R.HOST and t.turn.retry_at <= now:
        short = shortfall(table, t, t.gpus, whole_card=False)
        if short:
            parked = [_park_idle(table, t, s, now=now, actions=actions) for s in short.items()]
            if not any(parked):  # (idle tenants that may not park): look again each TQ
                t.turn.waiting_for = _no_room(table, t, short)
                t.turn.retry_at = now + table.policy_of(t).tq_s
            return
        low = free_short(table, t, t.gpus)
        if low is not None:
            t.turn.waiting_for = low
            return
        _restore(table, t, actions)


def _park_idle(
    table: TenantTable,
    t: TenantRecord,
    short: tuple[GpuId, int],
    *,
    now: float,
    actions: list[Action],
) -> bool:
    """Park idle tenants on ``gpu`` to make room for ``t``'s restore where nothing gates.

    Nobody takes turns there, so no grant makes room; without this, ``t`` would wait in
    host RAM beside idle tenants for ever. Only tenants that may park go: one that
    may not would be queued in host RAM in its turn, and two such would take each
    other's room for ever. Whether any was asked to leave (a ``SwapFinished`` brings
    ``t`` back here).
    """
    gpu, missing = short
    modes = {g: p.swap for g, p in table.policies.items()}
    idle = [
        v
        for v in memory.victims(t, gpu, table.members(gpu), missing, modes, everyone=False)
        if v.state is S.IDLE and parking.may_park(table, v) and floor_refusal(table, v) is None
    ]
    for victim in idle:
        table.gate(victim, actions)
        table.set_state(victim, Trigger.PARKED_IDLE, now)
        swap_out(table, victim, actions)
    return bool(idle)


def start_holder(
    table: TenantTable,
    t: TenantRecord,
    gating: frozenset[GpuId],
    now: float,
    actions: list[Action],
) -> None:
    """A granted holder, still gated: room first, then its memory, then let it go.

    Each step names the phase of its hand-over (:mod:`kiwid.core.handover`).
    """
    if table.overdue(t):  # its own move hangs: the next one goes first
        late = now - t.memory.move_due
        t.turn.waiting_for = (
            f"its memory is still moving ({t.memory.residency.value}), {late:.0f} s past the "
            "time its size takes at the rate seen so far: the next one goes first"
        )
        table.requeue(t, Trigger.PASSED_OVER, now)
        t.seq = table.front_seq()  # first again once its move ends
        return
    if t.memory.residency.moving:
        table.handover_phase(t, Phase.RESTORING)
        return  # its own swap ends first (a SwapFinished brings us back)
    gpus = t.gpus & gating
    missing = shortfall(table, t, gpus, whole_card=True)
    if missing:
        planned = False
        for gpu, nbytes in sorted(missing.items()):
            # What swap-outs in flight will free counts already: never evict twice.
            going = sum(
                o.size(gpu) for o in table.members(gpu) if o.memory.residency is R.SWAPPING_OUT
            )
            if nbytes > going:
                planned |= _make_room(table, t, gpu, nbytes - going, now=now, actions=actions)
        leaving = [
            o.id for g in gpus for o in table.members(g) if o.memory.residency is R.SWAPPING_OUT
        ]
        if planned or leaving:
            table.handover_phase(t, Phase.ROOM)
            t.turn.waiting_for = f"room being made on GPU {','.join(sorted(gpus))}: " + (
                f"{', '.join(sorted(set(leaving)))} swapping out" if leaving else "swap-outs asked"
            )
            return
    if t.memory.residency is R.HOST:
        short = shortfall(table, t, gpus, whole_card=False)
        if short:
            _step_aside(table, t, f"{_no_room(table, t, short)}; the rest cannot leave", now)
            return
        table.handover_phase(t, Phase.RESTORING)
        low = free_short(table, t, gpus)
        if low is None:
            _restore(table, t, actions)
            return
        tq = table.policy_of(t).tq_s
        since = t.turn.free_wait_since = (
            t.turn.free_wait_since if t.turn.free_wait_since is not None else now
        )
        if now - since >= tq:
            _step_aside(table, t, f"{low} for {tq:g} s", now)
        else:
            t.turn.waiting_for = low
        return
    t.turn.free_wait_since = None
    other = table.in_the_way(t, gpus)
    if other is not None:  # never two at once: it goes once the other one is gated
        table.handover_phase(t, Phase.GATING)
        t.turn.waiting_for = _in_the_way(other, gpus)
        return
    table.handover_phase(t, Phase.LETTING_GO)
    table.let_go(t, now, actions)


def _in_the_way(other: TenantRecord, gpus: frozenset[GpuId]) -> str:
    where = f"GPU {','.join(sorted(other.gpus & gpus))}"
    if other.loose and other.fault.cause is not None:
        return (
            f"{other.id} may still run on {where}: kiwid could not gate it "
            f"({other.fault.cause.reason}); it is tried again every TQ, or see "
            f"`kiwictl release {other.id}`"
        )
    return f"{other.id} is being gated on {where}"


def _restore(table: TenantTable, t: TenantRecord, actions: list[Action]) -> None:
    t.memory.residency = move(t.memory.residency, Move.SWAP_IN)
    t.turn.waiting_for = None
    t.turn.free_wait_since = None
    moving(table, t, "in")
    actions.append(SwapIn(t.id, epoch=t.epoch))


def moving(table: TenantTable, t: TenantRecord, direction: str) -> None:
    """A move of ``t`` was just asked: by when it should be done (``move_due``).

    Twice its size at the rate seen so far on its GPUs (or the link's expected
    rate, before one is seen), after the moves the same way already on their way
    there (its lane may make it wait for them), plus a margin: a move past that
    hangs, and its tenant is passed over for its turn rather than idle the GPU.
    """
    rates = table.restore_rate if direction == "in" else table.checkpoint_rate
    same = (R.SWAPPING_IN, R.PREFETCHING) if direction == "in" else (R.SWAPPING_OUT,)
    start = table.now
    seconds = 0.0
    for gpu in t.gpus:
        for other in table.members(gpu):
            if other is not t and other.memory.residency in same:
                start = max(start, other.memory.move_due)
        rate = rates.get(gpu) or link_rate(table, gpu, direction)
        seconds = max(seconds, 2 * t.held(gpu) / rate)
    if start == math.inf:  # one ahead of it is overdue itself: count from now
        start = table.now
    t.memory.move_due = start + seconds + PREFETCH_MARGIN_S


def link_rate(table: TenantTable, gpu: GpuId, direction: str) -> float:
    """The rate a swap ``direction`` is expected to run at on ``gpu`` before one is seen."""
    policy = table.policies.get(gpu)
    link = policy.link_bytes_per_s if policy is not None else None
    if link is not None:
        return link[1] if direction == "in" else link[0]
    return DEFAULT_RESTORE_BYTES_PER_S if direction == "in" else DEFAULT_CHECKPOINT_BYTES_PER_S


def _step_aside(table: TenantTable, t: TenantRecord, why: str, now: float) -> None:
    """A granted holder whose memory cannot come back: the next one runs instead."""
    tq = table.policy_of(t).tq_s
    t.turn.retry_at = now + tq
    t.turn.free_wait_since = None
    t.turn.waiting_for = f"{why}. It tries again at its turn after {tq:g} s"
    table.requeue(t, Trigger.SWAP_IN_FAILED, now)


# ---------------------------------------------------------------- counting room


def shortfall(
    table: TenantTable, t: TenantRecord, gpus: frozenset[GpuId] | set[GpuId], *, whole_card: bool
) -> dict[GpuId, int]:
    """Bytes missing on each of ``gpus`` for ``t`` beside everything else on them.

    ``whole_card``: what it needs to run (the whole card for a newcomer, by
    policy), else what its restore needs (its own size). Only GPUs that swap
    count: elsewhere nothing can be done about it, and the reserve and the driver
    decide.
    """
    missing: dict[GpuId, int] = {}
    for gpu in gpus:
        policy = table.policies.get(gpu)
        if policy is None or (policy.swap is SwapMode.NONE and whole_card):
            continue
        need = memory.need(t, gpu, policy) if whole_card else t.size(gpu)
        short = memory.occupied(table.members(gpu), gpu, t) + need - memory.room(policy)
        if short > 0:
            missing[gpu] = short
    return missing


def free_short(
    table: TenantTable, t: TenantRecord, gpus: frozenset[GpuId] | set[GpuId]
) -> str | None:
    """Why the driver's free memory cannot take ``t``'s restore now (``None``: it can).

    Its bytes, plus ``memory.reserve_mib``, plus every restore in flight on the
    card (counted whole), must be free by the last reading.
    """
    for gpu in sorted(gpus):
        free = table.free_seen.get(gpu)
        policy = table.policies.get(gpu)
        if free is None or policy is None:
            continue
        size = t.size(gpu)
        inflight = memory.restoring(table.members(gpu), gpu, t)
        if free < size + policy.reserve_bytes + inflight:
            also = f" and {memory.gib(inflight)} of restores in flight" if inflight else ""
            return (
                f"waiting for free memory on GPU {gpu}: the driver reports {memory.gib(free)} "
                f"free, its restore needs {memory.gib(size)} plus memory.reserve_mib "
                f"({memory.gib(policy.reserve_bytes)}){also}"
            )
    return None


def _no_room(table: TenantTable, t: TenantRecord, short: dict[GpuId, int]) -> str:
    gpu = min(short)
    policy = table.policies[gpu]
    free = memory.room(policy) - memory.occupied(table.members(gpu), gpu, t)
    return (
        f"no room on GPU {gpu}: its {memory.gib(t.size(gpu))} do not fit in the "
        f"{memory.gib(max(0, free))} free"
    )


# ---------------------------------------------------------------- swap-outs


def _make_room(
    table: TenantTable,
    t: TenantRecord,
    gpu: GpuId,
    missing: int,
    *,
    now: float,
    actions: list[Action],
) -> bool:
    """Swap out resident non-holders on ``gpu`` for ``t``; whether any was asked for."""
    modes = {g: p.swap for g, p in table.policies.items()}
    everyone = memory.wants_whole_card(t, table.policies[gpu])
    planned = False
    for victim in memory.victims(t, gpu, table.members(gpu), missing, modes, everyone=everyone):
        if floor_refusal(table, victim):
            continue
        if victim.state is S.IDLE:  # it must be gated before it can be swapped
            table.gate(victim, actions)
            if parking.may_park(table, victim):  # no turn for it until it is asked for
                table.set_state(victim, Trigger.PARKED_IDLE, now)
            else:
                table.set_state(victim, Trigger.SWAPPED_OUT, now)
                victim.seq = table.next_seq()
        swap_out(table, victim, actions)
        planned = True
    return planned


def floor_refusal(table: TenantTable, t: TenantRecord) -> str | None:
    """Refuse (and say why) a swap-out that would leave host RAM below the floor."""
    leaving = sum(
        o.held(g)
        for o in table.tenants.values()
        if o.memory.residency is R.SWAPPING_OUT
        for g in o.gpus
    )
    why = table.host.refusal(sum(t.held(g) for g in t.gpus), leaving)
    if why is not None and why != t.memory.swap_refusal:
        t.memory.swap_refusal = why
        table.notices.append((t.id, f"its memory stays on the GPU, gated: {why}"))
    return why


def swap_out(table: TenantTable, t: TenantRecord, actions: list[Action]) -> None:
    """Send a gated tenant's memory to host RAM, unless the host RAM floor forbids it."""
    if floor_refusal(table, t) is not None:
        return
    t.memory.residency = move(t.memory.residency, Move.SWAP_OUT)
    moving(table, t, "out")
    sizes = tuple((g, t.held(g)) for g in sorted(t.gpus))
    actions.append(SwapOut(t.id, sizes, epoch=t.epoch))


# ---------------------------------------------------------------- step 7 of a pass


def checkpoint_waiters(
    table: TenantTable,
    among: list[TenantRecord],
    gating: frozenset[GpuId],
    actions: list[Action],
) -> None:
    """7. ``checkpoint``: the other waiters' memory goes to host RAM.

    After the new holders were let go: they fit beside it, so they need not wait.
    """
    for t in among:
        if (
            t.state is S.WAITING
            and t.gated
            and t.memory.residency is R.RESIDENT
            and t.movable
            and any(table.policies[g].swap is SwapMode.CHECKPOINT for g in t.gpus & gating)
        ):
            swap_out(table, t, actions)
