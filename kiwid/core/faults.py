"""Stuck tenants: a fault or an overdue job that makes one, and an operator's word.

The handlers of :class:`~kiwid.core.scheduler.Scheduler` for ``TenantFaulted``,
``JobOverdue``, ``RetryAsked``, ``Mended``, ``ReleaseAsked`` and ``Released``.
A fault moves the tenant's epoch (what was asked of it before is old news) and
asks for a converge, which contains it. Each handler changes the table and
returns the GPUs whose rotation must be looked at again.
"""

from __future__ import annotations

import math

from kiwid.core.actions import Action, Release, Retry
from kiwid.core.events import JobOverdue, Mended, Released, TenantFaulted
from kiwid.core.lever import Pull, pull
from kiwid.core.model import GpuId, TenantId, TenantState
from kiwid.core.residency import Residency, settle
from kiwid.core.states import Trigger
from kiwid.core.table import TenantTable
from kiwid.core.tenant import Fault

S = TenantState
R = Residency


def faulted(
    table: TenantTable, event: TenantFaulted, now: float, actions: list[Action]
) -> set[GpuId]:
    """An operation on the tenant failed for good: it is stuck."""
    tenant = table.answering(event.tenant, event.epoch, actions)
    if tenant is None or tenant.state is S.RELEASED:
        return set()  # old news, or released: the operator's word stands
    fault = Fault(event.operation, event.reason, now, event.contained, event.pid, event.answer)
    table.fault(tenant, fault, event.memory, now, actions)
    return set(tenant.gpus)


def overdue(table: TenantTable, event: JobOverdue, now: float, actions: list[Action]) -> set[GpuId]:
    """A job ran past its deadline: its tenant is stuck, whatever epoch the job was of.

    Its call keeps the tenant's lane until it returns (nothing else of the tenant
    runs meanwhile). One that may leave it running is fenced with the freezer.
    """
    tenant = table.tenants.get(event.tenant)
    if tenant is None:
        return set()
    fault = Fault(event.operation, event.reason, now, not event.may_run)
    found = R.UNKNOWN if event.moving else None
    table.fault(tenant, fault, found, now, actions, fence=event.may_run)
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
    actions.append(Retry(tid, epoch=table.new_epoch(tenant)))
    return set()


def release_asked(
    table: TenantTable, tid: TenantId, now: float, actions: list[Action]
) -> set[GpuId]:
    """An operator asks to let a stuck tenant run ungated, outside the rotation."""
    tenant = table.tenants.get(tid)
    if tenant is not None and tenant.state is S.STUCK and not tenant.fault.mending:
        tenant.fault.mending = True
        actions.append(Release(tid, epoch=table.new_epoch(tenant)))
    return set()


def mended(table: TenantTable, event: Mended, now: float, actions: list[Action]) -> set[GpuId]:
    """The retry worked: the tenant is gated, its memory where the driver found it, and queued."""
    tenant = table.answering(event.tenant, event.epoch, actions)
    if tenant is None or tenant.state is not S.STUCK:
        return set()
    tenant.memory.residency = settle(tenant.memory.residency, event.memory)
    table.set_state(tenant, Trigger.RETRIED, now)
    tenant.fault.cause = None
    tenant.fault.mending = False
    tenant.lever = pull(tenant.lever, Pull.HELD)
    tenant.fault.regate_at = math.inf
    tenant.turn.retry_at = -math.inf
    tenant.seq = table.next_seq()
    return set(tenant.gpus)


def released(table: TenantTable, event: Released, now: float, actions: list[Action]) -> set[GpuId]:
    """An operator's release ended: the tenant runs ungated, or stays stuck if it was not whole."""
    tenant = table.answering(event.tenant, event.epoch, actions)
    if tenant is None or tenant.state is not S.STUCK:
        return set()
    tenant.fault.mending = False
    if not event.complete:
        fault = Fault("release", event.note, now, event.contained)
        table.fault(tenant, fault, None, now, actions)
        return set(tenant.gpus)
    tenant.memory.residency = settle(tenant.memory.residency, R.RESIDENT)
    table.set_state(tenant, Trigger.RELEASED, now)
    tenant.fault.cause = None
    tenant.lever = pull(tenant.lever, Pull.LOOSE)
    tenant.fault.regate_at = math.inf
    tenant.fault.released = event.note or None
    tenant.turn.last_active = now
    return set(tenant.gpus)
