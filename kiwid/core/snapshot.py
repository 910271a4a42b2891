"""Read-only snapshots of the scheduler's tables, for status displays.

Everything here reads the tables and copies what it shows; nothing decides.
"""

from __future__ import annotations

from kiwid.core import memory, parking, prefetch, quanta, room
from kiwid.core.model import GpuId, TenantId, TenantState
from kiwid.core.residency import Residency
from kiwid.core.table import TenantTable
from kiwid.core.tenant import TenantRecord
from kiwid.core.view import (
    FaultView,
    GpuView,
    HandoverView,
    SchedulerView,
    TenantView,
    WaiterView,
)

S = TenantState
R = Residency


def view(table: TenantTable, now: float) -> SchedulerView:
    """Everything a status display needs, at ``now`` (copies: nothing of the table leaks)."""
    gating = table.gating()
    queue = table.queue(gating)
    gpus: list[GpuView] = []
    for gpu, policy in sorted(table.policies.items(), key=lambda kv: _gpu_sort_key(kv[0])):
        on_gpu = table.members(gpu)
        holder = next((t for t in on_gpu if t.state is S.HOLDER and gpu in gating), None)
        waiters = [t for t in queue if gpu in t.gpus and t.state is S.WAITING]
        turns = [quanta.quantum(table, t, t.gpus & gating) for t in waiters]
        gpus.append(
            GpuView(
                gpu=gpu,
                policy=policy,
                gating=gpu in gating,
                holder=holder.id if holder else None,
                holder_since=holder.turn.granted_at if holder else None,
                preempt_at=_due(quanta.preempt_at(table, holder, gating)) if holder else None,
                holder_quantum_s=quanta.quantum(table, holder, holder.gpus & gating)
                if holder
                else None,
                waiters=tuple(
                    WaiterView(
                        t.id,
                        t.state_since,
                        position,
                        ahead_s=sum(turns[: position - 1]),
                        outranked=any(
                            o.cls.policy.priority > t.cls.policy.priority
                            for o in ([holder] if holder else []) + waiters[: position - 1]
                        ),
                    )
                    for position, t in enumerate(waiters, start=1)
                ),
                memory_in_use_bytes=memory.occupied(on_gpu, gpu, None),
                free_bytes=table.free_seen.get(gpu),
                handover_waits_for=_handover_waits_for(table, holder, gating, queue),
                stuck=tuple(sorted(t.id for t in on_gpu if t.state is S.STUCK)),
                blocked_by=next((t.id for t in on_gpu if t.loose and gpu in gating), None),
                held_back=tuple(
                    sorted(
                        t.id
                        for t in on_gpu
                        if t.gated and (gpu not in gating or t.state is S.STUCK)
                    )
                ),
                handover=_handover(table, gpu),
            )
        )
    tenants = tuple(
        TenantView(
            tenant=t.id,
            state=t.state,
            since=t.state_since,
            gpus=t.gpus,
            last_active=t.turn.last_active,
            footprint=dict(t.memory.footprint),
            ledger=t.ledger.view(t.state, t.state_since, now, t.entitled(now)),
            resident=t.memory.residency.on_card,
            peak=dict(t.memory.peak),
            residency=t.memory.residency,
            gated=t.gated,
            waiting_for=_waiting_for(t, now),
            swap_refusal=t.memory.unswappable or t.memory.swap_refusal,
            gate_failure=t.fault.cause.reason if t.loose and t.fault.cause else None,
            policy=t.cls.policy,
            quantum_s=quanta.quantum(table, t, t.gpus & gating) if t.gpus & gating else None,
            boosted=t.cls.boosted,
            entitled_share=t.cls.entitled_rate,
            last_preemption=t.turn.last_preemption,
            remembered=t.memory.remembered,
            fault=_fault(t),
            gate_pending=t.gate_pending,
            released_note=t.fault.released,
            foreign_short=_foreign_short(table, t),
            last_wake=t.turn.last_wake,
            parks=parking.unparkable(table, t),
        )
        for t in sorted(table.tenants.values(), key=lambda t: t.id)
    )
    return SchedulerView(
        now=now,
        gpus=tuple(gpus),
        tenants=tenants,
        wakes=dict(table.wakes),
        restores_wasted=table.restores_wasted,
    )


def _handover(table: TenantTable, gpu: GpuId) -> HandoverView | None:
    h = table.handovers.get(gpu)
    if h is None:
        return None
    return HandoverView(h.to, h.from_, h.since, h.phase.value if h.phase else None)


def _fault(tenant: TenantRecord) -> FaultView | None:
    fault = tenant.fault.cause
    if fault is None:
        return None
    return FaultView(
        fault.operation,
        fault.reason,
        fault.at,
        fault.contained,
        tenant.fault.mending,
        fault.pid,
        fault.answer,
    )


def _foreign_short(table: TenantTable, tenant: TenantRecord) -> str | None:
    """Why a gated tenant's restore waits on memory nobody kiwid knows holds (``None``: not so).

    Its restore would fit by the scheduler's count of the card, yet the driver's last
    reading of its free memory is short: something outside kiwid's tenants holds it.
    """
    if not tenant.gated or tenant.memory.residency is not R.HOST or tenant.state is S.STUCK:
        return None
    gpus = frozenset(g for g in tenant.gpus if g in table.policies)
    if room.shortfall(table, tenant, gpus, whole_card=False):
        return None
    return room.free_short(table, tenant, gpus)


def _handover_waits_for(
    table: TenantTable,
    holder: TenantRecord | None,
    gating: frozenset[GpuId],
    queue: list[TenantRecord],
) -> TenantId | None:
    """Whom a holder past its quantum keeps the GPU for while their memory comes back."""
    if holder is None or holder.gated:
        return None
    due = quanta.preempt_at(table, holder, gating)
    if due is None or due[1] != "quantum" or due[0] > table.now:
        return None
    if prefetch.deferred_until(table, holder, gating, queue, due[0]) is None:
        return None
    nxt = prefetch.next_in_line(holder, gating, queue)
    return nxt.id if nxt else None


def _waiting_for(tenant: TenantRecord, now: float) -> str | None:
    """Why a gated tenant is not let go although it may be next (``None``: it is not)."""
    if not tenant.gated:
        return None
    if tenant.turn.adopting_until > now:
        return (
            "re-adopted from a previous kiwid: it waits "
            f"{tenant.turn.adopting_until - now:.1f} s more for running tenants to show"
        )
    if tenant.turn.waiting_for is not None and (
        tenant.turn.retry_at > now or tenant.state is S.HOLDER or tenant.memory.residency is R.HOST
    ):
        return tenant.turn.waiting_for
    if tenant.memory.residency.moving:
        return f"its memory is moving ({tenant.memory.residency.value})"
    return None


def _due(preempt: tuple[float, str] | None) -> float | None:
    return None if preempt is None else preempt[0]


def _gpu_sort_key(gpu: GpuId) -> tuple[int, str]:
    return (int(gpu), gpu) if gpu.isdigit() else (1 << 30, gpu)
