"""Stuck tenants: a fault that makes one, a gate that mends one, an operator's word.

The handlers of :class:`~kiwid.core.scheduler.Scheduler` for ``Gated``,
``Ungated``, ``TenantFaulted``, ``RetryAsked``, ``Mended`` and ``Released``. Each changes the
table and returns the GPUs whose rotation must be looked at again.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kiwid.core.events import Action, Released, Retry, TenantFaulted
from kiwid.core.model import GpuId, TenantId, TenantState
from kiwid.core.residency import Residency, settle
from kiwid.core.states import Trigger
from kiwid.core.table import TenantTable
from kiwid.core.tenant import OPERATORS_JOBS, Fault

S = TenantState
R = Residency


def gated(table: TenantTable, tid: TenantId, now: float) -> set[GpuId]:
    """A gate took: the tenant no longer runs (and a loose stuck one is mended)."""
    tenant = table.tenants.get(tid)
    if tenant is None:
        return set()
    if not tenant.answer_gate():  # stale, or superseded by a later let-go
        return set(tenant.gpus)  # it may no longer be in the way of anyone
    answered = tenant.gates_done == tenant.gates_asked
    # An operator's release or retry under way decides, not a gate asked before it.
    mends = not tenant.fault.mending
    if tenant.state is S.STUCK and tenant.loose and tenant.gated and answered and mends:
        if tenant.memory.residency is R.UNKNOWN and tenant.fault.cause is not None:
            # Gated now, but only a retry finds where its memory is: it stays stuck,
            # contained (never let go with its memory nowhere known).
            tenant.fault.cause = replace(tenant.fault.cause, contained=True)
            tenant.fault.regate_at = math.inf
            return set(tenant.gpus)
        table.set_state(tenant, Trigger.GATE_MENDED, now)
        tenant.fault.cause = None
        tenant.fault.regate_at = math.inf
        tenant.seq = table.next_seq()
    return set(tenant.gpus)


def ungated(table: TenantTable, tid: TenantId, now: float) -> set[GpuId]:
    """An ungate took: the tenant runs; its quantum and its window to show work start now.

    Until then it holds on (neither idle nor preempted): it cannot run yet, and a gate
    asked meanwhile would wait behind the unlock anyway. Its deadline bounds the wait.
    """
    tenant = table.tenants.get(tid)
    if tenant is None or not tenant.ungate_pending:
        return set()  # a stale answer (it got stuck since)
    tenant.ungates_done += 1
    last = tenant.ungates_done == tenant.ungates_asked  # not one asked again since
    if last and tenant.running:
        tenant.turn.window_at = now
        if tenant.state is S.HOLDER:
            tenant.turn.granted_at = now
    return set(tenant.gpus)


def faulted(table: TenantTable, event: TenantFaulted, now: float) -> set[GpuId]:
    """An operation on the tenant failed for good: it is stuck (unless the gate is moot)."""
    tenant = table.tenants.get(event.tenant)
    if tenant is None or tenant.state is S.RELEASED:
        return set()  # (released: the answer to a job asked before the operator's word)
    if event.operation == "gate" and event.answers and not tenant.answer_gate():
        return set(tenant.gpus)  # a gate it no longer needs (let go since) failed
    fault = Fault(event.operation, event.reason, now, event.contained, event.pid, event.answer)
    table.fault(tenant, fault, event.memory, now)
    if event.operation in OPERATORS_JOBS and event.answers:
        tenant.fault.mending = False  # the operator's job answered (any other fault: it still runs)
    return set(tenant.gpus)


def retry_asked(table: TenantTable, tid: TenantId, now: float, actions: list[Action]) -> set[GpuId]:
    """An operator asks to try a stuck (or released) tenant again."""
    tenant = table.tenants.get(tid)
    if tenant is None or tenant.fault.mending:
        return set()
    if tenant.state is S.RELEASED:
        table.set_state(tenant, Trigger.RETRIED, now)
        tenant.fault.released = None
        return set(tenant.gpus)
    if tenant.state is not S.STUCK:
        return set()
    if tenant.loose:  # its gate did not take: try it now rather than at regate_at
        tenant.fault.regate_at = now
        return set(tenant.gpus)
    tenant.fault.mending = True
    actions.append(Retry(tid))
    return set()


def mended(table: TenantTable, tid: TenantId, found: Residency, now: float) -> set[GpuId]:
    """The retry worked: the tenant is gated, its memory where the driver found it, and queued."""
    tenant = table.tenants.get(tid)
    if tenant is None or tenant.state is not S.STUCK:
        return set()
    tenant.memory.residency = settle(tenant.memory.residency, found)
    table.set_state(tenant, Trigger.RETRIED, now)
    tenant.fault.cause = None
    tenant.fault.mending = False
    tenant.gated = True
    tenant.fault.regate_at = math.inf
    tenant.turn.retry_at = -math.inf
    tenant.seq = table.next_seq()
    return set(tenant.gpus)


def released(table: TenantTable, event: Released, now: float) -> set[GpuId]:
    """An operator's release ended: the tenant runs ungated, or stays stuck if it was not whole."""
    tenant = table.tenants.get(event.tenant)
    if tenant is None or tenant.state is not S.STUCK:
        return set()
    tenant.fault.mending = False
    if not event.complete:
        fault = Fault("release", event.note, now, event.contained)
        table.fault(tenant, fault, None, now)
        return set(tenant.gpus)
    tenant.memory.residency = settle(tenant.memory.residency, R.RESIDENT)
    table.set_state(tenant, Trigger.RELEASED, now)
    tenant.void_answers()
    tenant.fault.cause = None
    tenant.gated = False
    tenant.fault.regate_at = math.inf
    tenant.fault.released = event.note or None
    tenant.turn.last_active = now
    return set(tenant.gpus)
