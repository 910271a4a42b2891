"""The scheduler's rules: one pass that brings a set of GPUs in line with them.

:func:`reconcile` runs after every event that may change who should hold, wait or
move memory, over the GPUs it touched (and any linked through multi-GPU tenants).
Its steps, in order: early release, GPUs that stopped gating, one holder per GPU,
preemption, grants (first come, first served), starting holders (room, restore,
let go), prefetch, and checkpoint swap-outs. Then it recomputes the deadlines.
"""

from __future__ import annotations

from kiwid.core import memory
from kiwid.core.events import Action, SwapIn, SwapOut
from kiwid.core.model import GpuId, SwapMode, TenantState
from kiwid.core.residency import Move, Residency, move
from kiwid.core.states import Trigger
from kiwid.core.table import NO_GPU, TenantTable
from kiwid.core.tenant import TenantRecord

S = TenantState
R = Residency
PREFETCH_MARGIN_S = 1.0
DEFAULT_RESTORE_BYTES_PER_S = 5e9
"""Restore rate assumed until one is seen (the driver's restore on an H200: 5.5-7 GB/s)."""


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
            _release_ungated(table, t, now, actions)
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
    # 3b. Preemption: quantum over and someone waits, or a higher class waits.
    wanted = table.wanted(gating, among)
    if wanted:
        for t in [t for t in among if t.state is S.HOLDER]:
            due = table.preempt_at(t, gating, wanted)
            if due is not None and now >= due[0]:
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
            _start_holder(table, t, gating, now, actions)
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
                _swap_out(table, t, actions)
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


def _release_ungated(
    table: TenantTable, t: TenantRecord, now: float, actions: list[Action]
) -> None:
    """A gated tenant whose GPUs stopped gating: let go once its memory is on the card."""
    if t.residency.on_card:
        table.set_state(t, Trigger.GATING_STOPPED, now)
        t.granted_at = None
        table.let_go(t, now, actions)
    elif t.residency is R.HOST and t.retry_at <= now:
        short = _shortfall(table, t, t.gpus, whole_card=False)
        if not short:
            t.residency = move(t.residency, Move.SWAP_IN)
            t.waiting_for = None
            actions.append(SwapIn(t.id))
        else:
            t.waiting_for = _no_room(table, t, short)


def _start_holder(
    table: TenantTable,
    t: TenantRecord,
    gating: frozenset[GpuId],
    now: float,
    actions: list[Action],
) -> None:
    """A granted holder, still gated: room first, then its memory, then let it go."""
    if t.residency.moving:
        return  # its own swap ends first (a SwapFinished brings us back)
    gpus = t.gpus & gating
    missing = _shortfall(table, t, gpus, whole_card=True)
    if missing:
        planned = False
        for gpu, nbytes in sorted(missing.items()):
            planned |= _make_room(table, t, gpu, nbytes, now=now, actions=actions)
        leaving = [o.id for g in gpus for o in table.members(g) if o.residency is R.SWAPPING_OUT]
        if planned or leaving:
            t.waiting_for = f"room being made on GPU {','.join(sorted(gpus))}: " + (
                f"{', '.join(sorted(set(leaving)))} swapping out" if leaving else "swap-outs asked"
            )
            return
    if t.residency is R.HOST:
        short = _shortfall(table, t, gpus, whole_card=False)
        if not short:
            t.residency = move(t.residency, Move.SWAP_IN)
            t.waiting_for = None
            actions.append(SwapIn(t.id))
            return
        tq = table.policy_of(t).tq_s
        t.retry_at = now + tq
        t.waiting_for = (
            f"{_no_room(table, t, short)}; the rest cannot leave. It tries again at its "
            f"turn after {tq:g} s"
        )
        table.requeue(t, Trigger.SWAP_IN_FAILED, now)
        return
    table.let_go(t, now, actions)


def _shortfall(
    table: TenantTable, t: TenantRecord, gpus: frozenset[GpuId] | set[GpuId], *, whole_card: bool
) -> dict[GpuId, int]:
    """Bytes missing on each of ``gpus`` for ``t`` beside everything else on them.

    ``whole_card``: what it needs to run (the whole card if it never ran), else
    what its restore needs (its own size). Only GPUs that swap count: elsewhere
    nothing can be done about it, and the reserve and the driver decide.
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


def _no_room(table: TenantTable, t: TenantRecord, short: dict[GpuId, int]) -> str:
    gpu = min(short)
    policy = table.policies[gpu]
    free = memory.room(policy) - memory.occupied(table.members(gpu), gpu, t)
    return (
        f"no room on GPU {gpu}: its {memory.gib(t.size(gpu))} do not fit in the "
        f"{memory.gib(max(0, free))} free"
    )


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
    planned = False
    for victim in memory.victims(t, gpu, table.members(gpu), missing, modes):
        if _floor_refusal(table, victim):
            continue
        if victim.state is S.IDLE:  # it must be gated before it can be swapped
            table.gate(victim, actions)
            table.set_state(victim, Trigger.SWAPPED_OUT, now)
            victim.seq = table.next_seq()
        _swap_out(table, victim, actions)
        planned = True
    return planned


def _floor_refusal(table: TenantTable, t: TenantRecord) -> str | None:
    """Refuse (and say why) a swap-out that would leave host RAM below the floor."""
    leaving = sum(
        o.size(g) for o in table.tenants.values() if o.residency is R.SWAPPING_OUT for g in o.gpus
    )
    why = table.host.refusal(sum(t.size(g) for g in t.gpus), leaving)
    if why is not None and why != t.swap_refusal:
        t.swap_refusal = why
        table.notices.append((t.id, f"its memory stays on the GPU, gated: {why}"))
    return why


def _swap_out(table: TenantTable, t: TenantRecord, actions: list[Action]) -> None:
    if _floor_refusal(table, t) is not None:
        return
    t.residency = move(t.residency, Move.SWAP_OUT)
    actions.append(SwapOut(t.id))


def _prefetch(
    table: TenantTable,
    holder: TenantRecord,
    gating: frozenset[GpuId],
    queue: list[TenantRecord],
    wanted: dict[GpuId, tuple[float, int]],
) -> tuple[TenantRecord, float] | None:
    """The tenant to bring back before ``holder``'s quantum ends, and when.

    Only the first in line on the holder's GPUs, only if it is in host RAM, its
    footprint is known, and it fits beside everything on the card (a prefetch
    never evicts anyone).
    """
    if holder.state is not S.HOLDER or holder.gated:
        return None
    due = table.preempt_at(holder, gating, wanted)
    if due is None:
        return None
    preempt = due[0]
    gpus = holder.gpus & gating
    nxt = next((t for t in queue if t.gpus & gpus and t.state is S.WAITING), None)
    if (
        nxt is None
        or nxt.residency is not R.HOST
        or not nxt.known
        or nxt.retry_at > table.now
        or nxt.adopting_until > table.now
    ):
        return None
    seconds = PREFETCH_MARGIN_S
    for gpu in nxt.gpus & gating:
        policy = table.policies[gpu]
        if policy.swap is SwapMode.NONE:
            return None
        used = memory.occupied(table.members(gpu), gpu, nxt)
        if used + nxt.size(gpu) > memory.room(policy):
            return None
        rate = table.restore_rate.get(gpu, DEFAULT_RESTORE_BYTES_PER_S)
        seconds = max(seconds, nxt.size(gpu) / rate + PREFETCH_MARGIN_S)
    return nxt, preempt - seconds


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
                deadline = min(deadline, due[0])
            if swapping:
                plan = _prefetch(table, t, gating, queue, wanted)
                if plan is not None and plan[1] > now:
                    deadline = min(deadline, plan[1])
        wake(t, deadline)
