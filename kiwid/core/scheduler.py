"""The scheduling core: events and ``now`` in, gate/ungate actions out.

Pure: no I/O, no clock, no threads. The daemon calls :meth:`Scheduler.handle`
for every event and wakes again at :meth:`Scheduler.next_deadline`.

Semantics (DESIGN.md, "Scheduling semantics"):

* A tenant starts a burst when GPU activity is seen while it is idle. If every
  GPU it needs is free it holds them at once; otherwise it is gated and queued.
* A holder keeps its GPUs while nobody waits for them. When someone waits, it is
  preempted at ``max(granted_at + TQ, now)`` and queued at the back (round-robin).
* A holder with no GPU activity for ``idle_release`` seconds (counted from its
  grant or its last activity) yields early and becomes idle; this also returns a
  granted waiter that does no GPU work in its turn to idle.
* Waiters are served first come, first served. A tenant on several GPUs is
  granted all of them or none; a waiter's GPUs are claimed for it so that later
  waiters cannot overtake it (no starvation, no deadlock).
* ``exclusive`` GPUs always gate, ``off`` GPUs never, ``auto`` GPUs gate only
  while the bursting tenants' memory does not fit the card minus its reserve.

Memory (``GpuPolicy.swap``, DESIGN.md "Memory"): a tenant whose memory is in
host RAM is not *resident*. Before a tenant is granted, the core makes room for
it: a tenant that never held the GPU (unknown footprint) needs the whole card,
a known one the peak it used before. Resident non-holders are swapped out,
least recently run first, until it fits; those go out *before* it is swapped
in. With ``checkpoint`` every other waiting tenant is swapped out too, but
*after* the new holder runs: it fits beside them, so it need not wait for them.
A failed swap-out leaves the memory where it was; a failed swap-in sends the
tenant to the back of the queue for one quantum, and the rotation goes on.

Prefetch: when the next tenant in line is in host RAM and fits beside everyone
resident, its memory is brought back (it stays gated) shortly before the
holder's quantum ends: early by the time its restore should take (its size at
the swap-in rate seen so far on that GPU, plus a second). The hand-over itself
then only moves the gate.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kiwid.core.events import (
    Action,
    ActivitySeen,
    Event,
    FootprintSeen,
    Gate,
    GpusConfigured,
    SwapFinished,
    SwapIn,
    SwapOut,
    TenantAttached,
    TenantDetached,
    TenantSwapped,
    Tick,
    Ungate,
    Ungated,
)
from kiwid.core.ledger import Ledger, LedgerView
from kiwid.core.model import GpuId, GpuPolicy, Mode, SwapMode, TenantId, TenantState
from kiwid.core.states import Trigger, transition
from kiwid.core.view import GpuView, SchedulerView, TenantView, WaiterView

S = TenantState
_NO_GPU: GpuId = ""  # index key for tenants attached to no GPU
DEFAULT_SWAP_IN_BYTES_PER_S = 5e9
"""Swap-in rate assumed until one is seen (the driver's restore on an H200: 5.5-7 GB/s)."""
PREFETCH_MARGIN_S = 1.0


@dataclass(frozen=True)
class Transition:
    """One tenant state change, for the daemon's log (the story of a rotation)."""

    tenant: TenantId
    old: TenantState
    new: TenantState
    trigger: Trigger
    at: float


@dataclass
class _Tenant:
    """The core's record of one tenant (mutable; never leaves the core)."""

    id: TenantId
    gpus: frozenset[GpuId]
    seq: int
    state: TenantState = S.IDLE
    state_since: float = 0.0
    last_active: float | None = None
    granted_at: float | None = None
    claim: int = -1
    """Order of its claim on the GPUs it holds now: its grant, or a later change of
    its GPUs (a counter, so that claims at the same instant are still ordered)."""
    footprint: dict[GpuId, int | None] = field(default_factory=dict)
    ledger: Ledger = field(default_factory=Ledger)
    resident: bool = True
    """Whether its memory is on the GPU (``False``: swapped out to host RAM)."""
    peak: dict[GpuId, int] = field(default_factory=dict)
    """The most memory it was seen using, per GPU (remembered while swapped)."""
    known: bool = False
    """Whether it held the GPU before, so that ``peak`` is its working set."""
    last_run: float = -math.inf
    """When it was last granted (least recently run is swapped out first)."""
    retry_at: float = -math.inf
    """After a failed swap-in: not granted again before this time."""
    swappable: bool = True
    """``False`` after a failed swap-out, until it runs again."""
    starting: bool = False
    """Granted, but its memory is still moving: its quantum starts at ``Ungated``."""
    swapping_in: bool = False
    """A swap-in was asked for and has not been reported done."""
    prefetched: bool = False
    """Brought back ahead of its turn: not swapped out again while it waits."""

    @property
    def bursting(self) -> bool:
        return self.state is not S.IDLE

    def size(self, gpu: GpuId) -> int:
        """The memory it takes on ``gpu`` when resident."""
        return max(self.peak.get(gpu, 0), self.footprint.get(gpu) or 0)


class Scheduler:
    """Round-robin arbitration of GPU bursts with a time quantum per GPU."""

    def __init__(
        self,
        policies: Mapping[GpuId, GpuPolicy] | None = None,
        default_policy: GpuPolicy | None = None,
    ) -> None:
        """Start with the given GPUs; ``default_policy`` serves tenants on none."""
        self._policies: dict[GpuId, GpuPolicy] = dict(policies or {})
        self._default = default_policy or GpuPolicy()
        self._tenants: dict[TenantId, _Tenant] = {}
        self._by_gpu: dict[GpuId, set[TenantId]] = {}
        # Bounded: a caller that never drains (a benchmark) must not grow it forever.
        self._transitions: deque[Transition] = deque(maxlen=4096)
        self._seq = itertools.count()
        self._claims = itertools.count()
        self._now = -math.inf
        # Per GPU, the earliest time one of its tenants needs a Tick. It may be
        # stale-early (activity moved a deadline later): that costs one scoped
        # reconcile, never a missed deadline.
        self._gpu_deadline: dict[GpuId, float] = {}
        self._swap_in_rate: dict[GpuId, float] = {}  # bytes/s, smoothed, per GPU

    # ------------------------------------------------------------ public API

    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply ``event`` at monotonic time ``now`` and return the actions to take.

        Time never goes back: a ``now`` older than the last one is treated as
        the last one.
        """
        now = max(now, self._now)
        self._now = now
        # The two events of every poll first, without allocation when nothing changes.
        kind = type(event)
        if kind is ActivitySeen:
            known = self._tenants.get(event.tenant)  # type: ignore[union-attr]
            if known is not None and known.state is not S.IDLE:
                known.last_active = now
                return []
        elif kind is FootprintSeen:
            known = self._tenants.get(event.tenant)  # type: ignore[union-attr]
            if known is None or known.footprint.get(event.gpu, -1) == event.used_bytes:  # type: ignore[union-attr]
                return []
        actions: list[Action] = []
        # Most events touch the GPUs of one tenant only: reconcile just those
        # (``scope``); ``None`` means every GPU. The two hot events of every
        # poll, activity of a running burst and an unchanged footprint, need
        # no reconciliation at all.
        scope: set[GpuId] | None = set()
        match event:
            case GpusConfigured(policies=policies):
                self._policies = dict(policies)
                scope = None
            case TenantAttached(tenant=tid, gpus=gpus):
                known = self._tenants.get(tid)
                if known is None:
                    known = _Tenant(tid, gpus, next(self._seq), state_since=now)
                    self._tenants[tid] = known
                    self._index(known)
                    scope = set(gpus)
                else:
                    scope = set(known.gpus | gpus)
                    if gpus - known.gpus:
                        known.claim = next(self._claims)  # the newest claim yields a conflict
                    self._unindex(known)
                    known.gpus = gpus
                    self._index(known)
            case TenantDetached(tenant=tid):
                gone = self._tenants.pop(tid, None)
                if gone is not None:
                    self._unindex(gone)
                    scope = set(gone.gpus)
            case ActivitySeen(tenant=tid):
                tenant = self._tenants.get(tid)
                if tenant is not None:
                    tenant.last_active = now
                    if tenant.state is S.IDLE:
                        self._start_burst(tenant, now, actions)
                        scope = set(tenant.gpus)
            case FootprintSeen(tenant=tid, gpu=gpu, used_bytes=used):
                tenant = self._tenants.get(tid)
                if tenant is not None and tenant.footprint.get(gpu, -1) != used:
                    tenant.footprint[gpu] = used
                    if used is not None and used > tenant.peak.get(gpu, 0):
                        tenant.peak[gpu] = used
                    policy = self._policies.get(gpu)
                    if policy is not None and policy.mode is Mode.AUTO:
                        scope = {gpu}
            case SwapFinished():
                scope = self._swap_finished(event, now)
            case Ungated(tenant=tid):
                tenant = self._tenants.get(tid)
                if tenant is not None and tenant.starting:
                    tenant.starting = False
                    if tenant.state is S.HOLDER:
                        tenant.granted_at = now
                        tenant.last_active = now
                    scope = set(tenant.gpus)
            case TenantSwapped(tenant=tid, footprint=footprint):
                tenant = self._tenants.get(tid)
                if tenant is not None:
                    tenant.resident = False
                    tenant.known = True
                    tenant.peak.update(footprint)
                    if tenant.state is S.IDLE:
                        self._set_state(tenant, Trigger.SWAPPED_OUT, now)
                        tenant.seq = next(self._seq)
                    scope = set(tenant.gpus)
            case Tick():
                scope = {g for g, d in self._gpu_deadline.items() if d <= now}
        if scope is None or scope:
            self._reconcile(now, actions, scope)
        return actions

    def next_deadline(self) -> float | None:
        """Return when the core next needs a ``Tick`` (monotonic s), or ``None``."""
        return min(self._gpu_deadline.values(), default=None)

    def drain_transitions(self) -> list[Transition]:
        """Return (and forget) the state changes since the last call, oldest first."""
        if not self._transitions:  # the common case, once per event on the poll path
            return []
        out = list(self._transitions)
        self._transitions.clear()
        return out

    def ledger(self, tenant: TenantId, now: float) -> LedgerView | None:
        """Return one tenant's ledger at ``now`` (``None``: unknown tenant)."""
        t = self._tenants.get(tenant)
        return None if t is None else t.ledger.view(t.state, t.state_since, now)

    def policy(self, gpu: GpuId) -> GpuPolicy | None:
        """Return the policy in force on ``gpu`` (``None``: not managed)."""
        return self._policies.get(gpu)

    def tenant_state(self, tenant: TenantId) -> TenantState | None:
        """Return a tenant's state (``None``: unknown tenant)."""
        known = self._tenants.get(tenant)
        return None if known is None else known.state

    def resident(self, tenant: TenantId) -> bool | None:
        """Whether a tenant's memory is on the GPU (``None``: unknown tenant)."""
        known = self._tenants.get(tenant)
        return None if known is None else known.resident

    def peak(self, tenant: TenantId) -> dict[GpuId, int]:
        """The most memory a tenant was seen using, per GPU (empty: unknown)."""
        known = self._tenants.get(tenant)
        return {} if known is None else dict(known.peak)

    def tenant_ids(self) -> frozenset[TenantId]:
        """Return every tenant the core knows."""
        return frozenset(self._tenants)

    def view(self, now: float) -> SchedulerView:
        """Return a read-only snapshot for status displays."""
        gating = self._gating()
        queue = self._queue(gating)
        gpus: list[GpuView] = []
        for gpu, policy in sorted(self._policies.items(), key=lambda kv: _gpu_sort_key(kv[0])):
            on_gpu = [t for t in self._tenants.values() if gpu in t.gpus]
            holder = next((t for t in on_gpu if t.state is S.HOLDER and gpu in gating), None)
            waiters = [t for t in queue if gpu in t.gpus and t.state is S.WAITING]
            gpus.append(
                GpuView(
                    gpu=gpu,
                    policy=policy,
                    gating=gpu in gating,
                    holder=holder.id if holder else None,
                    holder_since=holder.granted_at if holder else None,
                    preempt_at=self._preempt_at(holder, gating) if holder else None,
                    waiters=tuple(
                        WaiterView(t.id, t.state_since, position)
                        for position, t in enumerate(waiters, start=1)
                    ),
                    memory_in_use_bytes=sum(t.size(gpu) for t in on_gpu if t.resident),
                )
            )
        tenants = tuple(
            TenantView(
                tenant=t.id,
                state=t.state,
                since=t.state_since,
                gpus=t.gpus,
                last_active=t.last_active,
                footprint=dict(t.footprint),
                ledger=t.ledger.view(t.state, t.state_since, now),
                resident=t.resident,
                peak=dict(t.peak),
            )
            for t in sorted(self._tenants.values(), key=lambda t: t.id)
        )
        return SchedulerView(now=now, gpus=tuple(gpus), tenants=tenants)

    # ------------------------------------------------------------ internals

    def _index(self, tenant: _Tenant) -> None:
        for gpu in tenant.gpus or (_NO_GPU,):
            self._by_gpu.setdefault(gpu, set()).add(tenant.id)

    def _unindex(self, tenant: _Tenant) -> None:
        for gpu in tenant.gpus or (_NO_GPU,):
            members = self._by_gpu.get(gpu)
            if members is not None:
                members.discard(tenant.id)
                if not members:
                    del self._by_gpu[gpu]

    def _closure(self, gpus: set[GpuId]) -> list[_Tenant]:
        """Every tenant linked to ``gpus``, directly or through multi-GPU tenants."""
        seen_gpus: set[GpuId] = set()
        found: dict[TenantId, _Tenant] = {}
        todo = list(gpus)
        while todo:
            gpu = todo.pop()
            if gpu in seen_gpus:
                continue
            seen_gpus.add(gpu)
            for tid in self._by_gpu.get(gpu, ()):
                if tid not in found:
                    tenant = self._tenants[tid]
                    found[tid] = tenant
                    todo.extend(tenant.gpus - seen_gpus)
        return list(found.values())

    def _policy_of(self, tenant: _Tenant) -> GpuPolicy:
        """The policy that times a tenant: the strictest of its managed GPUs."""
        managed = [self._policies[g] for g in tenant.gpus if g in self._policies]
        if not managed:
            return self._default
        return min(managed, key=lambda p: p.idle_release_s)

    def _gating(
        self, gpus: Iterable[GpuId] | None = None, extra: _Tenant | None = None
    ) -> frozenset[GpuId]:
        """Which of ``gpus`` (default all) gate now (``extra`` counts as bursting)."""
        gating: set[GpuId] = set()
        for gpu in self._policies if gpus is None else gpus:
            policy = self._policies.get(gpu)
            if policy is None or policy.mode is Mode.OFF:
                continue
            if policy.mode is Mode.EXCLUSIVE:
                gating.add(gpu)
                continue
            demand = 0
            for tid in self._by_gpu.get(gpu, ()):
                t = self._tenants[tid]
                if t.bursting or t is extra:
                    demand += t.footprint.get(gpu) or 0
            if demand > policy.capacity_bytes - policy.reserve_bytes:
                gating.add(gpu)
        return frozenset(gating)

    def _queue(
        self, gating: frozenset[GpuId], among: Iterable[_Tenant] | None = None
    ) -> list[_Tenant]:
        """Tenants that want gated GPUs they do not hold, first come first."""
        wanting = [
            t
            for t in (self._tenants.values() if among is None else among)
            if t.state in (S.WAITING, S.CORUNNING) and t.gpus & gating
        ]
        return sorted(wanting, key=lambda t: t.seq)

    def _set_state(self, tenant: _Tenant, trigger: Trigger, now: float) -> None:
        new = transition(tenant.state, trigger)
        ledger = tenant.ledger
        ledger.close(tenant.state, tenant.state_since, now)
        if tenant.state is S.HOLDER:
            tenant.known = True  # one hold seen: its peak is its working set
        if new is S.HOLDER:
            ledger.quanta += 1
            tenant.last_run = now
            tenant.claim = next(self._claims)
            tenant.swappable = True
        elif trigger is Trigger.PREEMPTED:
            ledger.preempted += 1
        elif trigger is Trigger.IDLE_TIMEOUT and tenant.state is S.HOLDER:
            ledger.early_releases += 1
        self._transitions.append(Transition(tenant.id, tenant.state, new, trigger, now))
        tenant.state = new
        tenant.state_since = now

    def _start_burst(self, tenant: _Tenant, now: float, actions: list[Action]) -> None:
        gating = self._gating(tenant.gpus, extra=tenant)
        need = tenant.gpus & gating
        tenant.seq = next(self._seq)
        if not need:
            self._set_state(tenant, Trigger.BURST_UNGATED, now)
            return
        claimed = self._claimed(gating, self._closure(set(need)))
        if need & claimed:
            self._set_state(tenant, Trigger.BURST_BUSY, now)
            actions.append(Gate(tenant.id))
        else:
            self._set_state(tenant, Trigger.BURST_FREE, now)
            tenant.granted_at = now

    def _claimed(self, gating: frozenset[GpuId], among: Iterable[_Tenant]) -> set[GpuId]:
        """Gated GPUs that a holder holds or that an earlier burst is queued for."""
        claimed: set[GpuId] = set()
        for t in among:
            if t.state is not S.IDLE:
                claimed |= t.gpus & gating
        return claimed

    def _preempt_at(
        self,
        holder: _Tenant,
        gating: frozenset[GpuId],
        wanted: set[GpuId] | None = None,
    ) -> float | None:
        """When ``holder`` must yield: grant + the shortest TQ of its contested GPUs.

        ``wanted`` are the gated GPUs that waiters want (computed if not given).
        """
        assert holder.granted_at is not None
        if holder.starting:
            return None  # its quantum has not begun
        if wanted is None:
            wanted = self._wanted(gating, self._closure(set(holder.gpus)))
        contested = holder.gpus & gating & wanted
        if not contested:
            return None
        return holder.granted_at + min(self._policies[g].tq_s for g in contested)

    def _wanted(self, gating: frozenset[GpuId], among: Iterable[_Tenant]) -> set[GpuId]:
        wanted: set[GpuId] = set()
        for t in among:
            if t.state in (S.WAITING, S.CORUNNING):
                wanted |= t.gpus & gating
        return wanted

    def _idle_at(self, tenant: _Tenant) -> float:
        """When a holder or co-runner without further activity goes idle."""
        if tenant.starting:
            return math.inf  # not let go yet: it cannot have shown activity
        start = max(
            (t for t in (tenant.granted_at, tenant.last_active) if t is not None),
            default=self._now,  # e.g. a tenant queued from host RAM, never seen active
        )
        return start + self._policy_of(tenant).idle_release_s

    def _reconcile(self, now: float, actions: list[Action], scope: set[GpuId] | None) -> None:
        """Bring the tenants of ``scope`` (``None``: all) in line with the rules."""
        if scope is None:
            among = list(self._tenants.values())
            gating = self._gating()
        else:
            among = self._closure(scope)
            gpus: set[GpuId] = set(scope)
            for t in among:
                gpus |= t.gpus
            gating = self._gating(gpus)
        among.sort(key=lambda t: t.seq)
        # 1. Early release: bursts that went quiet.
        for t in among:
            if t.state in (S.HOLDER, S.CORUNNING) and now >= self._idle_at(t):
                self._set_state(t, Trigger.IDLE_TIMEOUT, now)
                t.granted_at = None
        if scope is not None:  # a release may change auto-mode gating
            gating = self._gating(gpus)
        # 2. GPUs that stopped gating free their holders and waiters.
        for t in among:
            if t.state in (S.HOLDER, S.WAITING) and not t.gpus & gating:
                if t.state is S.WAITING:
                    if not t.resident:
                        actions.append(SwapIn(t.id))
                        t.resident = True
                    actions.append(Ungate(t.id))
                    t.last_active = now  # a fresh window to show activity
                self._set_state(t, Trigger.GATING_STOPPED, now)
                t.granted_at = None
        # 2b. A GPU may have several holders: it started gating (a mode change)
        # under tenants granted while it did not, or a holder's process moved onto
        # it. The oldest claim keeps it; the others are gated and queued.
        held: set[GpuId] = set()
        holders = [t for t in among if t.state is S.HOLDER]
        for t in sorted(holders, key=lambda t: t.claim):
            mine = t.gpus & gating
            if mine & held:
                self._set_state(t, Trigger.PREEMPTED, now)
                t.granted_at = None
                t.seq = next(self._seq)
                actions.append(Gate(t.id))
            else:
                held |= mine
        # 3. Preemption: quantum over and someone waits.
        wanted = self._wanted(gating, among)
        for t in [t for t in among if t.state is S.HOLDER]:
            deadline = self._preempt_at(t, gating, wanted)
            if deadline is not None and now >= deadline:
                self._set_state(t, Trigger.PREEMPTED, now)
                t.granted_at = None
                t.seq = next(self._seq)
                actions.append(Gate(t.id))
        among.sort(key=lambda t: t.seq)
        # 4. Grants, first come first served, all GPUs or none.
        blocked: set[GpuId] = set()
        for t in among:
            if t.state is S.HOLDER:
                blocked |= t.gpus & gating
        for t in self._queue(gating, among):
            need = t.gpus & gating
            if t.retry_at > now:  # its memory could not come back lately: skip a turn
                continue
            if need & blocked:
                if t.state is S.CORUNNING:
                    self._set_state(t, Trigger.GATING_STARTED, now)
                    actions.append(Gate(t.id))
            else:
                planned = len(actions)
                self._make_room(t, gating, now, actions)
                if not t.resident:
                    actions.append(SwapIn(t.id))
                    t.resident = True
                    t.swapping_in = True
                moving = len(actions) > planned or t.swapping_in  # e.g. a prefetch still running
                t.starting = moving and t.state is S.WAITING
                t.prefetched = False
                if t.state is S.WAITING:
                    actions.append(Ungate(t.id))
                self._set_state(t, Trigger.GRANTED, now)
                t.granted_at = now
            blocked |= need
        # 5. Prefetch: the next in line comes back from host RAM before its turn.
        queue = self._queue(gating, among)
        for t in among:
            plan = self._prefetch(t, gating, queue)
            if plan is not None and now >= plan[1]:
                nxt = plan[0]
                actions.append(SwapIn(nxt.id))
                nxt.resident = nxt.swapping_in = nxt.prefetched = True
        # 6. ``checkpoint``: the other waiters' memory goes to host RAM, after the
        # new holders were let go (they fit beside it, so they need not wait).
        for t in among:
            if (
                t.state is S.WAITING
                and t.resident
                and not t.prefetched
                and t.swappable
                and any(self._swap_mode(g) is SwapMode.CHECKPOINT for g in t.gpus & gating)
            ):
                actions.append(SwapOut(t.id))
                t.resident = False
        self._update_deadlines(gating, among, scope)

    def _prefetch(
        self, holder: _Tenant, gating: frozenset[GpuId], queue: list[_Tenant]
    ) -> tuple[_Tenant, float] | None:
        """The tenant to bring back before ``holder``'s quantum ends, and when.

        Only the first in line on the holder's GPUs, only if it is in host RAM,
        its footprint is known, and it fits beside every resident tenant (a
        prefetch never evicts anyone).
        """
        if holder.state is not S.HOLDER or holder.starting or holder.granted_at is None:
            return None
        preempt = self._preempt_at(holder, gating)
        if preempt is None:
            return None
        gpus = holder.gpus & gating
        nxt = next((t for t in queue if t.gpus & gpus and t.state is S.WAITING), None)
        if nxt is None or nxt.resident or not nxt.known or nxt.retry_at > self._now:
            return None
        seconds = PREFETCH_MARGIN_S
        for gpu in nxt.gpus & gating:
            policy = self._policies[gpu]
            if policy.swap is SwapMode.NONE:
                return None
            room = policy.capacity_bytes - policy.reserve_bytes
            used = sum(
                self._tenants[tid].size(gpu)
                for tid in self._by_gpu.get(gpu, ())
                if self._tenants[tid].resident
            )
            if used + nxt.size(gpu) > room:
                return None
            rate = self._swap_in_rate.get(gpu, DEFAULT_SWAP_IN_BYTES_PER_S)
            seconds = max(seconds, nxt.size(gpu) / rate + PREFETCH_MARGIN_S)
        return nxt, preempt - seconds

    def _swap_mode(self, gpu: GpuId) -> SwapMode:
        policy = self._policies.get(gpu)
        return SwapMode.NONE if policy is None else policy.swap

    def _make_room(
        self, tenant: _Tenant, gating: frozenset[GpuId], now: float, actions: list[Action]
    ) -> None:
        """Swap out resident non-holders, least recently run first, until ``tenant`` fits.

        A tenant that never held the GPU gets the whole card (its footprint is
        unknown until its first turn): every other resident non-holder goes. A
        known one needs the peak it used before.
        Room is made only on GPUs that swap; without enough swappable tenants
        the grant goes ahead anyway (the reserve and the driver decide).
        """
        evicted: set[TenantId] = set()
        for gpu in sorted(tenant.gpus & gating):
            policy = self._policies[gpu]
            if policy.swap is SwapMode.NONE:
                continue
            room = policy.capacity_bytes - policy.reserve_bytes
            need = tenant.size(gpu) if tenant.known else room
            others = [
                self._tenants[tid]
                for tid in self._by_gpu.get(gpu, ())
                if tid != tenant.id and tid not in evicted and self._tenants[tid].resident
            ]
            used = sum(o.size(gpu) for o in others)
            candidates = sorted(
                (
                    o
                    for o in others
                    if o.state in (S.WAITING, S.IDLE) and o.swappable and o.size(gpu)
                ),  # (a tenant with no memory on the card has nothing to give)
                key=lambda o: (o.last_run, o.seq),
            )
            for victim in candidates:
                if tenant.known and need + used <= room:
                    break  # a newcomer gets the card to itself: everyone goes
                used -= victim.size(gpu)
                evicted.add(victim.id)
                if victim.state is S.IDLE:  # it must be gated before it can be swapped
                    actions.append(Gate(victim.id))
                    self._set_state(victim, Trigger.SWAPPED_OUT, now)
                    victim.seq = next(self._seq)
                actions.append(SwapOut(victim.id))
                victim.resident = False

    def _swap_finished(self, event: SwapFinished, now: float) -> set[GpuId]:
        tenant = self._tenants.get(event.tenant)
        if tenant is None:
            return set()
        ledger = tenant.ledger
        ledger.swap_s += max(0.0, event.seconds)
        if event.direction == "in":
            tenant.swapping_in = False
        if event.ok:
            if event.direction == "out":
                ledger.swapped_out_bytes += event.moved_bytes
            else:
                ledger.swapped_in_bytes += event.moved_bytes
                if event.seconds > 0 and event.moved_bytes > 0 and tenant.gpus:
                    rate = event.moved_bytes / event.seconds / len(tenant.gpus)
                    for gpu in tenant.gpus:
                        old = self._swap_in_rate.get(gpu)
                        self._swap_in_rate[gpu] = rate if old is None else (old + rate) / 2
            return set()
        if event.direction == "out":
            tenant.resident = True  # still on the card, gated: not chosen again for now
            tenant.swappable = False
            return set(tenant.gpus)
        tenant.resident = False
        tenant.starting = tenant.prefetched = False
        if tenant.state in (S.HOLDER, S.CORUNNING):
            self._set_state(tenant, Trigger.SWAP_IN_FAILED, now)
            tenant.granted_at = None
            tenant.seq = next(self._seq)
        tenant.retry_at = now + self._policy_of(tenant).tq_s
        return set(tenant.gpus)

    def _update_deadlines(
        self, gating: frozenset[GpuId], among: list[_Tenant], scope: set[GpuId] | None
    ) -> None:
        """Recompute the per-GPU deadlines of every GPU that ``among`` touches."""
        if scope is None:
            self._gpu_deadline.clear()
        else:
            for gpu in scope:
                self._gpu_deadline.pop(gpu, None)
            for t in among:
                for gpu in t.gpus or (_NO_GPU,):
                    self._gpu_deadline.pop(gpu, None)
        wanted = self._wanted(gating, among)
        queue = self._queue(gating, among)
        for t in among:
            plan = self._prefetch(t, gating, queue)
            if plan is not None and plan[1] > self._now:
                for gpu in t.gpus or (_NO_GPU,):
                    known = self._gpu_deadline.get(gpu)
                    if known is None or plan[1] < known:
                        self._gpu_deadline[gpu] = plan[1]
            if t.state is S.WAITING and t.retry_at > self._now:
                for gpu in t.gpus or (_NO_GPU,):
                    known = self._gpu_deadline.get(gpu)
                    if known is None or t.retry_at < known:
                        self._gpu_deadline[gpu] = t.retry_at
            if t.state not in (S.HOLDER, S.CORUNNING):
                continue
            deadline = self._idle_at(t)
            if t.state is S.HOLDER:
                preempt = self._preempt_at(t, gating, wanted)
                if preempt is not None:
                    deadline = min(deadline, preempt)
            if deadline == math.inf:  # a holder not let go yet: nothing to time
                continue
            for gpu in t.gpus or (_NO_GPU,):
                known = self._gpu_deadline.get(gpu)
                if known is None or deadline < known:
                    self._gpu_deadline[gpu] = deadline


def _gpu_sort_key(gpu: GpuId) -> tuple[int, str]:
    return (int(gpu), gpu) if gpu.isdigit() else (1 << 30, gpu)
