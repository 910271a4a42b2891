"""The scheduler's rules: one pass that brings a set of GPUs in line with them.

:func:`reconcile` runs after every event that may change who should hold, wait or
move memory, over the GPUs it touched (and any linked through multi-GPU tenants).
Its steps, in order: early release, gates tried again for stuck tenants that may
run, GPUs that stopped gating, one holder per GPU,
boosts, preemption, grants (first come, first served), starting holders (room,
restore, let go), prefetch, and checkpoint swap-outs, one function each. Then it
counts entitlements and recomputes the deadlines (:mod:`kiwid.core.timers`). The
memory moves themselves are :mod:`kiwid.core.room`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiwid.core import parking, prefetch, quanta, room, timers
from kiwid.core.actions import Action
from kiwid.core.model import GpuId, SwapMode, TenantState
from kiwid.core.residency import Move, Residency, move
from kiwid.core.states import Trigger
from kiwid.core.table import TenantTable
from kiwid.core.tenant import TenantRecord
from kiwid.core.timers import max_wait

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
        tenant.turn.granted_at = now


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
    tenant changed state. The steps run in the order of their numbers.
    """
    changes = table.changes
    among, gpus = _scope(table, scope)
    release_quiet(table, among, now, actions)  # 1
    parking.wake_unparkable(table, among, now)  # 1a
    # After the releases: they may change auto-mode gating.
    p = Pass(table, among, table.gating(gpus), now, actions)
    regate_loose(p)  # 1b
    free_ungated(p)  # 2
    one_holder_per_gpu(p)  # 2b
    boost_long_waiters(p)  # 3
    wanted = table.wanted(p.gating, among)
    if wanted:
        preempt_due(p, wanted)  # 3b
        among.sort(key=lambda t: t.seq)
        grant_in_turn(p)  # 4
    start_holders(p)  # 5
    if table.changes != changes:
        wanted = table.wanted(p.gating, among)  # preemptions and grants changed who waits
    if p.swapping:
        prefetch.prefetch_next(table, among, p.gating, wanted, actions)  # 6
        room.checkpoint_waiters(table, among, p.gating, actions)  # 7
    if members_changed or table.changes != changes:
        timers.entitle(p.gating, among, now)
    timers.update_deadlines(table, p.gating, among, scope, wanted=wanted, waits=p.waits)


@dataclass
class Pass:
    """What the steps of one :func:`reconcile` share."""

    table: TenantTable
    among: list[TenantRecord]
    """The tenants of the GPUs in scope, in queue order."""
    gating: frozenset[GpuId]
    """Which of their GPUs gate now."""
    now: float
    actions: list[Action]
    """Where the steps put the actions they ask for."""
    waits: dict[GpuId, float | None] = field(init=False)
    """Per gating GPU, its ``max_wait`` (only those that have one)."""
    swapping: bool = field(init=False)
    """Whether memory may move on any of the gating GPUs."""

    def __post_init__(self) -> None:
        """Read the gating GPUs' policies."""
        policies = {g: self.table.policies[g] for g in self.gating}
        self.waits = {g: p.max_wait_s for g, p in policies.items() if p.max_wait_s}
        self.swapping = any(p.swap is not SwapMode.NONE for p in policies.values())


def _scope(
    table: TenantTable, scope: set[GpuId] | None
) -> tuple[list[TenantRecord], set[GpuId] | None]:
    """The tenants a pass looks at (in queue order) and their GPUs (``None``: all)."""
    if scope is None:
        among = list(table.tenants.values())
        gpus: set[GpuId] | None = None
    else:
        among = table.closure(scope)
        gpus = set(scope)
        for t in among:
            gpus |= t.gpus
    among.sort(key=lambda t: t.seq)
    return among, gpus


def release_quiet(
    table: TenantTable, among: list[TenantRecord], now: float, actions: list[Action]
) -> None:
    """1. Early release: running bursts that went quiet for ``idle_release`` go idle.

    A holder woken from parked that did no GPU work in all of its turn parks again
    instead, where it may (:mod:`kiwid.core.parking`): gated, its memory to host RAM,
    out of the queue. A holder that came in a burst of its own goes idle, ungated,
    even if its turn showed no work: it had work when it queued, and a turn that
    shows none may be a reading that came late (after a retry, on a loaded host).
    Idle and ungated, its next work is seen and queues it again; parked, gated, it
    could show none and would wait for a request that may never come.
    """
    for t in among:
        if t.state in _RUNNING and not t.gated and now >= quanta.idle_at(table, t):
            quiet = t.turn.silent() and t.turn.idle_since_woken()
            if t.state is S.HOLDER and quiet and _parks(table, t):
                parking.park_unused(table, t, now, actions)
                room.swap_out(table, t, actions)
                continue
            table.set_state(t, Trigger.IDLE_TIMEOUT, now)
            t.turn.granted_at = None


def _parks(table: TenantTable, t: TenantRecord) -> bool:
    return parking.may_park(table, t) and room.floor_refusal(table, t) is None


def regate_loose(p: Pass) -> None:
    """1b. A stuck tenant whose gate did not take (it may run) has it tried again when due.

    Until it takes, nobody else is let go on its GPUs; once it takes (``Gated``), the
    tenant waits for its turn like any other. Not while an operator's release of it
    runs: a gate asked then would run after the release (a tenant's jobs run in
    order) and hold a tenant the release let go for good; the release's answer
    decides (a release that fails leaves it stuck, and its gate due again).
    """
    for t in p.among:
        if t.loose and not t.gated and not t.fault.mending and p.now >= t.fault.regate_at:
            t.fault.regate_at = p.now + p.table.policy_of(t).tq_s
            p.table.gate(t, p.actions)


def free_ungated(p: Pass) -> None:
    """2. GPUs that stopped gating free their holders and waiters."""
    for t in p.among:
        if t.state not in _HOLDING_OR_WAITING or t.gpus & p.gating:
            continue
        if t.gated:
            room.release_ungated(p.table, t, p.now, p.actions)
        else:
            p.table.set_state(t, Trigger.GATING_STOPPED, p.now)
            t.turn.granted_at = None


def one_holder_per_gpu(p: Pass) -> None:
    """2b. One holder per GPU: the oldest claim keeps it, the others are gated and queued.

    A GPU may have several holders when it started gating (a mode change) under
    tenants granted while it did not, or when a holder's process moved onto it.
    """
    holders = [t for t in p.among if t.state is S.HOLDER]
    if len(holders) <= 1:
        return
    held: set[GpuId] = set()
    for t in sorted(holders, key=lambda t: t.turn.claim):
        mine = t.gpus & p.gating
        if mine & held:
            p.table.requeue(t, Trigger.PREEMPTED, p.now)
            p.table.gate(t, p.actions)
        else:
            held |= mine


def boost_long_waiters(p: Pass) -> None:
    """3. A waiter that waited ``max_wait`` behind higher classes is first for one quantum."""
    if not p.waits:
        return
    for t in p.among:
        if t.state is S.WAITING and not t.cls.boosted:
            limit = max_wait(p.waits, t)
            if limit is not None and p.now - t.state_since >= limit:
                t.cls.set_boost(True)


def preempt_due(p: Pass, wanted: dict[GpuId, tuple[float, int]]) -> None:
    """3b. Preemption: quantum over and someone waits, or a higher class waits.

    At the quantum's end the hand-over waits while the next one's memory is on its
    way back (at most one more TQ, :func:`prefetch.deferred_until`).
    """
    table, gating, now = p.table, p.gating, p.now
    queue: list[TenantRecord] | None = None
    for t in [t for t in p.among if t.state is S.HOLDER]:
        due = quanta.preempt_at(table, t, gating, wanted)
        if due is None or now < due[0]:
            continue
        if p.swapping and due[1] == "quantum":
            queue = table.queue(gating, p.among) if queue is None else queue
            until = prefetch.deferred_until(table, t, gating, queue, due[0])
            if until is not None and now < until:
                continue
        _preempt(table, t, due[1], gating=gating, among=p.among, now=now)
        table.gate(t, p.actions)


def grant_in_turn(p: Pass) -> None:
    """4. Grants: the highest class first, each first come first served, all GPUs or none."""
    table, gating, now = p.table, p.gating, p.now
    blocked: set[GpuId] = set()
    for t in p.among:
        if t.state is S.HOLDER or t.loose:  # a stuck tenant that may run holds its GPUs
            blocked |= t.gpus & gating
    for t in table.queue(gating, p.among):
        need = t.gpus & gating
        if t.turn.retry_at > now or t.turn.adopting_until > now:
            continue  # its memory could not come back lately, or it is re-adopted
        if table.overdue(t):
            continue  # its move hangs: passed over, it keeps its place
        if need & blocked:
            if t.state is S.CORUNNING:
                table.set_state(t, Trigger.GATING_STARTED, now)
                table.gate(t, p.actions)
        else:
            _grant(table, t, now)
        blocked |= need


def start_holders(p: Pass) -> None:
    """5. Granted holders still gated: make room, bring their memory back, let go."""
    for t in p.among:
        if t.state is S.HOLDER and t.gated and t.gpus & p.gating:
            room.start_holder(p.table, t, p.gating, p.now, p.actions)


_RUNNING = (S.HOLDER, S.CORUNNING)
_HOLDING_OR_WAITING = (S.HOLDER, S.WAITING)


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
            key=lambda o: (o.cls.rank, -o.seq),
            default=None,
        )
    if reason == "priority" and t.turn.granted_at is not None:
        rest = quanta.quantum(table, t, t.gpus & gating) - (now - t.turn.granted_at)
        table.set_state(t, Trigger.PREEMPTED_PRIORITY, now)
        t.turn.granted_at = None
        t.seq = table.front_seq()
        t.turn.remaining_s = rest if rest > 0 else None
    else:
        table.requeue(t, Trigger.PREEMPTED, now)
    t.turn.last_preemption = (now, reason, by.id if by else None)


def _grant(table: TenantTable, t: TenantRecord, now: float) -> None:
    """Its turn: it holds its GPUs (a gated one is let go once its memory is there)."""
    table.set_state(t, Trigger.GRANTED, now)
    t.turn.granted_at = None if t.gated else now  # a co-runner already runs
    if t.gated:
        table.begin_handover(t, t.gpus & table.gating(t.gpus), now)
    if t.memory.residency is R.PREFETCHING:
        t.memory.residency = move(t.memory.residency, Move.GRANTED)
