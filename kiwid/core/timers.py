"""What a pass of the rules leaves behind: entitled shares and the next deadlines.

:func:`entitle` books each tenant's entitled GPU time at its old share and sets its
new one; :func:`update_deadlines` tells the scheduler when it must look again
(a quantum's end, an idle release, a retry, a prefetch, a ``max_wait``).
"""

from __future__ import annotations

import math

from kiwid.core import prefetch, quanta
from kiwid.core.model import GpuId, SwapMode, TenantState
from kiwid.core.table import NO_GPU, TenantTable
from kiwid.core.tenant import TenantRecord

S = TenantState
_RUNNING = (S.HOLDER, S.CORUNNING)


def max_wait(waits: dict[GpuId, float | None], t: TenantRecord) -> float | None:
    """The longest ``t`` may wait on its gated GPUs before it is boosted (``None``: any)."""
    limits = [limit for g in t.gpus if (limit := waits.get(g)) is not None]
    return min(limits) if limits else None


def entitle(gating: frozenset[GpuId], among: list[TenantRecord], now: float) -> None:
    """Set each tenant's entitled share of GPU time from now.

    On each of its gated GPUs: its weight over the weights of the bursting tenants
    of the highest class there (0 outside that class); the least of its GPUs'
    shares (it needs them all). What the old share earned until now is booked first.
    """
    top: dict[GpuId, tuple[int, float]] = {}
    bursting = [t for t in among if t.state is S.HOLDER or t.state is S.WAITING]
    for t in bursting:
        priority, weight = t.cls.policy.priority, t.cls.policy.weight
        for gpu in t.gpus:
            if gpu not in gating:
                continue
            known = top.get(gpu)
            if known is None or priority > known[0]:
                top[gpu] = (priority, weight)
            elif priority == known[0]:
                top[gpu] = (priority, known[1] + weight)
    rates: dict[int, float] = {}
    for t in bursting:
        priority, weight = t.cls.policy.priority, t.cls.policy.weight
        rate = None
        for gpu in t.gpus:
            known = top.get(gpu)
            if known is not None:
                share = weight / known[1] if known[0] == priority else 0.0
                rate = share if rate is None or share < rate else rate
        if rate is not None:
            rates[id(t)] = rate
    for t in among:
        rate = rates.get(id(t), 0.0)
        if rate != t.cls.entitled_rate:
            t.ledger.entitled_s = t.entitled(now)
            t.cls.entitled_rate = rate
            t.cls.accounted_at = now


def update_deadlines(
    table: TenantTable,
    gating: frozenset[GpuId],
    among: list[TenantRecord],
    scope: set[GpuId] | None,
    *,
    wanted: dict[GpuId, tuple[float, int]],
    waits: dict[GpuId, float | None],
) -> None:
    """Recompute the per-GPU deadlines of every GPU that ``among`` touches."""
    deadlines = table.deadlines
    if scope is None:
        deadlines.clear()
    else:
        for gpu in scope:
            deadlines.pop(gpu, None)
        for t in among:
            for gpu in t.gpus or (NO_GPU,):
                deadlines.pop(gpu, None)
    now = table.now
    swapping = any(table.policies[g].swap is not SwapMode.NONE for g in gating)
    queue = table.queue(gating, among) if swapping else []

    def wake(t: TenantRecord, at: float) -> None:
        for gpu in t.gpus or (NO_GPU,):
            known = deadlines.get(gpu)
            if known is None or at < known:
                deadlines[gpu] = at

    for t in among:
        state = t.state
        if state is S.IDLE or state is S.PARKED:
            continue
        if t.loose and not t.gated:
            if not t.fault.mending:  # (a release in flight: its answer wakes the core)
                wake(t, t.fault.regate_at)
            continue
        if t.gated:
            for timer in (t.turn.retry_at, t.turn.adopting_until):
                if timer > now:
                    wake(t, timer)
            if t.memory.residency.moving and now < t.memory.move_due < math.inf:
                wake(t, t.memory.move_due)  # past it, it is passed over for its turn
            if t.turn.free_wait_since is not None:
                wake(t, t.turn.free_wait_since + table.policy_of(t).tq_s)
            if waits and state is S.WAITING and not t.cls.boosted:
                limit = max_wait(waits, t)
                if limit is not None:
                    wake(t, t.state_since + limit)
            continue
        if state not in _RUNNING:
            continue
        deadline = quanta.idle_at(table, t)
        if state is S.HOLDER:
            due = quanta.preempt_at(table, t, gating, wanted)
            if due is not None:
                at = due[0]
                if swapping and due[1] == "quantum" and at <= now:
                    # Past its quantum: it holds on while the next one comes back.
                    at = prefetch.deferred_until(table, t, gating, queue, at) or at
                deadline = min(deadline, at)
            if swapping:
                plan = prefetch.prefetch_plan(table, t, gating, queue, wanted)
                if plan is not None and plan[1] > now:
                    deadline = min(deadline, plan[1])
        wake(t, deadline)
