"""The scheduler's rules: one pass that brings a set of GPUs in line with them.

:func:`reconcile` runs after every event that may change who should hold, wait or
move memory, over the GPUs it touched (and any linked through multi-GPU tenants).
Its steps, in order: early release, GPUs that stopped gating, one holder per GPU,
boosts, preemption, grants (first come, first served), starting holders (room,
restore, let go), prefetch, and checkpoint swap-outs. Then it recomputes the
deadlines. The memory moves themselves are :mod:`kiwid.core.room`'s.
"""

from __future__ import annotations

from kiwid.core import room
from kiwid.core.events import Action, SwapIn
from kiwid.core.model import GpuId, SwapMode, TenantState
from kiwid.core.residency import Move, Residency, move
from kiwid.core.states import Trigger
from kiwid.core.table import NO_GPU, TenantTable
from kiwid.core.tenant import TenantRecord

S = TenantState
R = Residency


def start_burst(
    table: TenantTable, tenant: TenantRecord, now: float, actions: list[Action]
) -> None:
    """An idle tenant showed GPU work: it holds at once if it may, else it waits, gated."""
    gating = table.gating(tenant.gpus, extra=tenant)
    need = tenant.gpus & gating
    tenant.seq = table.next_seq()
    if not need:
        table.set_state(tenant, Trigger.BURST_UNGATED, now)
        return
    claimed = table.claimed(gating, table.closure(set(need)), exclude=tenant)
    if need & claimed:
        table.set_state(tenant, Trigger.BURST_BUSY, now)
        table.gate(tenant, actions)
    else:
        table.set_state(tenant, Trigger.BURST_FREE, now)
        tenant.granted_at = now


def reconcile(
    table: TenantTable,
    now: float,
    actions: list[Action],
    scope: set[GpuId] | None,
    *,
    members_changed: bool = True,
) -> None:
    """Bring the tenants of ``scope`` (``None``: all) in line with the rules.

    ``members_changed``: tenants, their GPUs or policies changed (else only time
    passed, or memory moved): entitlements are then counted again only if a
    tenant changed state.
    """
    changes = table.changes
    if scope is None:
        among = list(table.tenants.values())
        gpus: set[GpuId] | None = None
    else:
        among = table.closure(scope)
        gpus = set(scope)
        for t in among:
            gpus |= t.gpus
    among.sort(key=lambda t: t.seq)
    # 1. Early release: bursts that went quiet.
    for t in among:
        if t.state in _RUNNING and not t.gated and now >= table.idle_at(t):
            table.set_state(t, Trigger.IDLE_TIMEOUT, now)
            t.granted_at = None
    gating = table.gating(gpus)  # after the releases: they may change auto-mode gating
    policies = [table.policies[g] for g in gating]
    swapping = any(p.swap is not SwapMode.NONE for p in policies)
    waits = {g: table.policies[g].max_wait_s for g in gating if table.policies[g].max_wait_s}
    # 2. GPUs that stopped gating free their holders and waiters.
    for t in among:
        if t.state not in _HOLDING_OR_WAITING or t.gpus & gating:
            continue
        if t.gated:
            room.release_ungated(table, t, now, actions)
        else:
            table.set_state(t, Trigger.GATING_STOPPED, now)
            t.granted_at = None
    # 2b. A GPU may have several holders: it started gating (a mode change) under
    # tenants granted while it did not, or a holder's process moved onto it. The
    # oldest claim keeps it; the others are gated and queued.
    holders = [t for t in among if t.state is S.HOLDER]
    if len(holders) > 1:
        held: set[GpuId] = set()
        for t in sorted(holders, key=lambda t: t.claim):
            mine = t.gpus & gating
            if mine & held:
                table.requeue(t, Trigger.PREEMPTED, now)
                table.gate(t, actions)
            else:
                held |= mine
    # 3. A waiter that waited max_wait behind higher classes is first for one quantum.
    if waits:
        for t in among:
            if t.state is S.WAITING and not t.boosted:
                limit = _max_wait(waits, t)
                if limit is not None and now - t.state_since >= limit:
                    t.set_boost(True)
    # 3b. Preemption: quantum over and someone waits (unless the next one's memory
    # is on its way back), or a higher class waits.
    wanted = table.wanted(gating, among)
    if wanted:
        queue: list[TenantRecord] | None = None
        for t in [t for t in among if t.state is S.HOLDER]:
            due = table.preempt_at(t, gating, wanted)
            if due is None or now < due[0]:
                continue
            if swapping and due[1] == "quantum":
                queue = table.queue(gating, among) if queue is None else queue
                until = room.deferred_until(table, t, gating, queue, due[0])
                if until is not None and now < until:
                    continue
            _preempt(table, t, due[1], gating=gating, among=among, now=now)
            table.gate(t, actions)
        among.sort(key=lambda t: t.seq)
        # 4. Grants: the highest class first, each first come first served, all
        # GPUs or none.
        blocked: set[GpuId] = set()
        for t in among:
            if t.state is S.HOLDER:
                blocked |= t.gpus & gating
        for t in table.queue(gating, among):
            need = t.gpus & gating
            if t.retry_at > now or t.adopting_until > now:
                continue  # its memory could not come back lately, or it is re-adopted
            if need & blocked:
                if t.state is S.CORUNNING:
                    table.set_state(t, Trigger.GATING_STARTED, now)
                    table.gate(t, actions)
            else:
                _grant(table, t, now)
            blocked |= need
    # 5. Granted holders still gated: make room, bring their memory back, let go.
    for t in among:
        if t.state is S.HOLDER and t.gated and t.gpus & gating:
            room.start_holder(table, t, gating, now, actions)
    if table.changes != changes:
        wanted = table.wanted(gating, among)  # preemptions and grants changed who waits
    if swapping:
        # 6. Prefetch: the next in line comes back from host RAM before its turn.
        queue = table.queue(gating, among)
        for t in among:
            plan = _prefetch(table, t, gating, queue, wanted)
            if plan is not None and now >= plan[1]:
                nxt = plan[0]
                nxt.residency = move(nxt.residency, Move.PREFETCH)
                nxt.waiting_for = None
                actions.append(SwapIn(nxt.id))
        # 7. ``checkpoint``: the other waiters' memory goes to host RAM, after the new
        # holders were let go (they fit beside it, so they need not wait).
        for t in among:
            if (
                t.state is S.WAITING
                and t.gated
                and t.residency is R.RESIDENT
                and t.movable
                and any(table.policies[g].swap is SwapMode.CHECKPOINT for g in t.gpus & gating)
            ):
                room.swap_out(table, t, actions)
    if members_changed or table.changes != changes:
        _entitle(gating, among, now)
    _update_deadlines(table, gating, among, scope, wanted=wanted, waits=waits, swapping=swapping)


_RUNNING = (S.HOLDER, S.CORUNNING)
_HOLDING_OR_WAITING = (S.HOLDER, S.WAITING)


def _max_wait(waits: dict[GpuId, float | None], t: TenantRecord) -> float | None:
    """The longest ``t`` may wait on its gated GPUs before it is boosted (``None``: any)."""
    limits = [limit for g in t.gpus if (limit := waits.get(g)) is not None]
    return min(limits) if limits else None


def _preempt(
    table: TenantTable,
    t: TenantRecord,
    reason: str,
    *,
    gating: frozenset[GpuId],
    among: list[TenantRecord],
    now: float,
) -> None:
    """A holder yields, and goes back to its class's queue.

    At its quantum's end it goes to the back; for a higher class, to the front,
    with the rest of its quantum.
    """
    by = None
    if reason == "priority":  # whom it yields to: the first of the highest class waiting
        mine = t.gpus & gating
        by = max(
            (o for o in among if o.state is S.WAITING and o.gpus & mine),
            key=lambda o: (o.rank, -o.seq),
            default=None,
        )
    if reason == "priority" and t.granted_at is not None:
        rest = table.quantum(t, t.gpus & gating) - (now - t.granted_at)
        table.set_state(t, Trigger.PREEMPTED_PRIORITY, now)
        t.granted_at = None
        t.seq = table.front_seq()
        t.remaining_s = rest if rest > 0 else None
    else:
        table.requeue(t, Trigger.PREEMPTED, now)
    t.last_preemption = (now, reason, by.id if by else None)


def _entitle(gating: frozenset[GpuId], among: list[TenantRecord], now: float) -> None:
    """Set each tenant's entitled share of GPU time from now.

    On each of its gated GPUs: its weight over the weights of the bursting tenants
    of the highest class there (0 outside that class); the least of its GPUs'
    shares (it needs them all). What the old share earned until now is booked first.
    """
    top: dict[GpuId, tuple[int, float]] = {}
    bursting = [t for t in among if t.state is S.HOLDER or t.state is S.WAITING]
    for t in bursting:
        priority, weight = t.policy.priority, t.policy.weight
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
        priority, weight = t.policy.priority, t.policy.weight
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
        if rate != t.entitled_rate:
            t.ledger.entitled_s = t.entitled(now)
            t.entitled_rate = rate
            t.accounted_at = now


def _grant(table: TenantTable, t: TenantRecord, now: float) -> None:
    """Its turn: it holds its GPUs (a gated one is let go once its memory is there)."""
    table.set_state(t, Trigger.GRANTED, now)
    t.granted_at = None if t.gated else now  # a co-runner already runs
    if t.residency is R.PREFETCHING:
        t.residency = move(t.residency, Move.GRANTED)


def _update_deadlines(
    table: TenantTable,
    gating: frozenset[GpuId],
    among: list[TenantRecord],
    scope: set[GpuId] | None,
    *,
    wanted: dict[GpuId, tuple[float, int]],
    waits: dict[GpuId, float | None],
    swapping: bool,
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
    queue = table.queue(gating, among) if swapping else []

    def wake(t: TenantRecord, at: float) -> None:
        for gpu in t.gpus or (NO_GPU,):
            known = deadlines.get(gpu)
            if known is None or at < known:
                deadlines[gpu] = at

    for t in among:
        state = t.state
        if state is S.IDLE:
            continue
        if t.gated:
            for timer in (t.retry_at, t.adopting_until):
                if timer > now:
                    wake(t, timer)
            if t.free_wait_since is not None:
                wake(t, t.free_wait_since + table.policy_of(t).tq_s)
            if waits and state is S.WAITING and not t.boosted:
                limit = _max_wait(waits, t)
                if limit is not None:
                    wake(t, t.state_since + limit)
            continue
        if state not in _RUNNING:
            continue
        deadline = table.idle_at(t)
        if state is S.HOLDER:
            due = table.preempt_at(t, gating, wanted)
            if due is not None:
                at = due[0]
                if swapping and due[1] == "quantum" and at <= now:
                    # Past its quantum: it holds on while the next one comes back.
                    at = room.deferred_until(table, t, gating, queue, at) or at
                deadline = min(deadline, at)
            if swapping:
                plan = _prefetch(table, t, gating, queue, wanted)
                if plan is not None and plan[1] > now:
                    deadline = min(deadline, plan[1])
        wake(t, deadline)


def _prefetch(
    table: TenantTable,
    holder: TenantRecord,
    gating: frozenset[GpuId],
    queue: list[TenantRecord],
    wanted: dict[GpuId, tuple[float, int]],
) -> tuple[TenantRecord, float] | None:
    """Whom to bring back before ``holder`` yields, and when (see :func:`room.prefetch`)."""
    if holder.state is not S.HOLDER or holder.gated:
        return None
    due = table.preempt_at(holder, gating, wanted)
    if due is None:
        return None
    return room.prefetch(table, holder, gating, queue, due[0])
