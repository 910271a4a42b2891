"""What the shell answers: a gate or an ungate took, a swap ended, a converge found.

The handlers of :class:`~kiwid.core.scheduler.Scheduler` for ``Gated``,
``Ungated``, ``SwapFinished``, ``Converged`` and ``MemorySplit``. Each counts
only at the tenant's current epoch (:meth:`TenantTable.answering
<kiwid.core.table.TenantTable.answering>`): an answer to a job asked before a
let-go, a fault or an operator's word changes nothing, and a converge is asked
instead. Each changes the table and returns the GPUs whose rotation must be
looked at again.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kiwid.core import parking
from kiwid.core.actions import Action, Converge
from kiwid.core.events import Converged, MemorySplit, SwapFinished
from kiwid.core.lever import Pull, pull
from kiwid.core.model import GpuId, TenantId, TenantState
from kiwid.core.residency import Move, Residency, move, settle
from kiwid.core.states import Trigger
from kiwid.core.table import TenantTable
from kiwid.core.tenant import TenantRecord

S = TenantState
R = Residency


def gated(
    table: TenantTable, tid: TenantId, epoch: int, now: float, actions: list[Action]
) -> set[GpuId]:
    """A gate took: the tenant no longer runs (and a loose stuck one is mended)."""
    tenant = table.answering(tid, epoch, actions)
    if tenant is None:
        return set()
    tenant.lever = pull(tenant.lever, Pull.GATED)
    cause = tenant.fault.cause
    # An operator's release or retry under way decides, not a gate asked before it.
    if tenant.state is S.STUCK and cause is not None and not cause.contained:
        if tenant.fault.mending:
            return set(tenant.gpus)
        if tenant.memory.residency is R.UNKNOWN:
            # Gated now, but only a retry finds where its memory is: it stays stuck,
            # contained (never let go with its memory nowhere known).
            tenant.fault.cause = replace(cause, contained=True)
            tenant.fault.regate_at = math.inf
            return set(tenant.gpus)
        table.set_state(tenant, Trigger.GATE_MENDED, now)
        tenant.fault.cause = None
        tenant.fault.regate_at = math.inf
        tenant.seq = table.next_seq()
    return set(tenant.gpus)


def ungated(
    table: TenantTable, tid: TenantId, epoch: int, now: float, actions: list[Action]
) -> set[GpuId]:
    """An ungate took: the tenant runs; its quantum and its window to show work start now.

    Until then it holds on (neither idle nor preempted): it cannot run yet, and a gate
    asked meanwhile would wait behind the unlock anyway. Its deadline bounds the wait.
    """
    tenant = table.answering(tid, epoch, actions)
    if tenant is None:
        return set()
    tenant.lever = pull(tenant.lever, Pull.UNGATED)
    if tenant.running:  # not gated again since it was let go
        tenant.turn.window_at = now
        if tenant.state is S.HOLDER:
            tenant.turn.granted_at = now
            table.end_handover(tenant)  # it runs: the hand-over is done
    return set(tenant.gpus)


def converged(
    table: TenantTable, event: Converged, now: float, actions: list[Action]
) -> set[GpuId]:
    """A converge (or a fence) found the tenant as it now is.

    A stuck tenant is contained or not by what it found, and its memory is where
    the driver says. Any other tenant was driven to what the core wanted: its memory
    is settled where found, unless a move asked since will say (``moving``).
    """
    tenant = table.answering(event.tenant, event.epoch, actions)
    if tenant is None:
        return set()
    mem = tenant.memory
    for gpu, nbytes in (event.host_bytes or {}).items():
        if nbytes > mem.peak.get(gpu, 0):  # what a follow moved: the core counts it too
            mem.peak[gpu] = nbytes
    cause = tenant.fault.cause
    if tenant.state is S.STUCK and cause is not None:
        if event.memory is not None:
            mem.residency = settle(mem.residency, event.memory)
        contained = not event.runs
        tenant.lever = pull(tenant.lever, Pull.LOOSE if event.runs else Pull.HELD)
        tenant.fault.cause = replace(cause, contained=contained)
        tq = table.policy_of(tenant).tq_s
        tenant.fault.regate_at = math.inf if contained else now + tq
        return set(tenant.gpus)
    if not mem.residency.moving and event.memory in (R.RESIDENT, R.HOST):
        mem.residency = settle(mem.residency, event.memory)
    return set(tenant.gpus)


def memory_split(
    table: TenantTable, event: MemorySplit, now: float, actions: list[Action]
) -> set[GpuId]:
    """Processes of a tenant in host RAM are on the card: a converge moves them there."""
    tenant = table.answering(event.tenant, event.epoch, actions)
    if tenant is not None and tenant.gated and tenant.memory.residency is R.HOST:
        actions.append(Converge(tenant.id, epoch=tenant.epoch))
    return set()


def swap_finished(
    table: TenantTable, event: SwapFinished, now: float, actions: list[Action]
) -> set[GpuId]:
    """A swap ended (or did not start): where the tenant's memory is now."""
    tenant = table.answering(event.tenant, event.epoch, actions)
    if tenant is None:
        return set()
    mem, ledger = tenant.memory, tenant.ledger
    if event.direction == "out":
        if mem.residency is not R.SWAPPING_OUT:
            return set()  # not asked for (a stale report): nothing to learn
        mem.move_due = math.inf
        ledger.swap_s += max(0.0, event.seconds)
        if event.ok:
            mem.residency = move(mem.residency, Move.OUT_DONE)
            ledger.swapped_out_bytes += event.moved_bytes
            _learn_rate(table.checkpoint_rate, tenant, event)
        else:
            mem.residency = move(mem.residency, Move.OUT_FAILED)
            why = event.reason or "unknown error"
            if event.unswappable:
                mem.unswappable = why
            else:
                mem.swap_refusal = f"its swap-out failed: {why}"
                mem.refused_until_run = True
            parking.unpark_resident(table, tenant, now, actions)
        return set(tenant.gpus)
    if mem.residency not in (R.SWAPPING_IN, R.PREFETCHING):
        return set()
    mem.move_due = math.inf
    ledger.swap_s += max(0.0, event.seconds)
    if event.ok:
        mem.residency = move(mem.residency, Move.IN_DONE)
        mem.restored_for_turn = True
        ledger.swapped_in_bytes += event.moved_bytes
        _learn_rate(table.restore_rate, tenant, event)
        return set(tenant.gpus)
    if event.deferred:  # not started: it waits for a reading that shows the room
        mem.residency = move(mem.residency, Move.IN_DEFERRED)
        tenant.turn.waiting_for = event.reason or "waiting for free memory"
        return set(tenant.gpus)
    mem.residency = move(mem.residency, Move.IN_FAILED)
    tq = table.policy_of(tenant).tq_s
    tenant.turn.retry_at = now + tq
    tenant.turn.waiting_for = (
        f"its restore failed ({event.reason or 'unknown error'}); it tries again "
        f"at its turn after {tq:g} s"
    )
    if tenant.state is S.HOLDER:
        table.requeue(tenant, Trigger.SWAP_IN_FAILED, now)
    return set(tenant.gpus)


def _learn_rate(rates: dict[GpuId, float], tenant: TenantRecord, event: SwapFinished) -> None:
    """Smooth the rate a swap of ``tenant`` ran at into the per-GPU ``rates`` (bytes/s)."""
    if event.seconds > 0 and event.moved_bytes > 0 and tenant.gpus:
        rate = event.moved_bytes / event.seconds / len(tenant.gpus)
        for gpu in tenant.gpus:
            old = rates.get(gpu)
            rates[gpu] = rate if old is None else (old + rate) / 2
