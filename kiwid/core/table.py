"""The scheduler's tables and the primitives every rule uses.

:class:`TenantTable` owns the tenants (:class:`~kiwid.core.tenant.TenantRecord`),
the per-GPU index, the policies, the FIFO counters and the log of transitions. The
rules that change them live in :mod:`kiwid.core.rotation`; the public API in
:mod:`kiwid.core.scheduler`.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kiwid.core.actions import Action, Converge, Fence, Gate, Ungate
from kiwid.core.handover import Handover, Phase, step
from kiwid.core.lever import Pull, pull
from kiwid.core.memory import HostMemory
from kiwid.core.model import GpuId, GpuPolicy, Mode, TenantId, TenantState
from kiwid.core.residency import Move, Residency, move, settle
from kiwid.core.states import Trigger, transition
from kiwid.core.tenant import Fault, TenantRecord

S = TenantState
NO_GPU: GpuId = ""  # index key for tenants attached to no GPU


@dataclass(frozen=True)
class Transition:
    """One tenant state change, for the daemon's log (the story of a rotation)."""

    tenant: TenantId
    old: TenantState
    new: TenantState
    trigger: Trigger
    at: float


class TenantTable:
    """Tenants, policies and the bookkeeping shared by the scheduler's rules."""

    def __init__(self, policies: dict[GpuId, GpuPolicy], default: GpuPolicy) -> None:
        """Start empty, with ``policies`` per GPU and ``default`` for tenants on none."""
        self.policies = policies
        self.default = default
        self.tenants: dict[TenantId, TenantRecord] = {}
        self.by_gpu: dict[GpuId, set[TenantId]] = {}
        # Bounded: a caller that never drains (a benchmark) must not grow it forever.
        self.transitions: deque[Transition] = deque(maxlen=4096)
        self.notices: deque[tuple[TenantId, str]] = deque(maxlen=4096)
        """Decisions worth a log line that are no state change (a refused swap)."""
        self.now = -math.inf
        # Per GPU, the earliest time one of its tenants needs a Tick. It may be
        # stale-early (activity moved a deadline later): that costs one scoped
        # reconcile, never a missed deadline.
        self.deadlines: dict[GpuId, float] = {}
        self.restore_rate: dict[GpuId, float] = {}  # bytes/s, smoothed, per GPU
        self.checkpoint_rate: dict[GpuId, float] = {}  # bytes/s, smoothed, per GPU
        self.free_seen: dict[GpuId, int] = {}
        """Per GPU, its free memory by the driver's last reading (bytes)."""
        self.host = HostMemory()
        self.handovers: dict[GpuId, Handover] = {}
        """Per GPU, the hand-over under way: granted, not running yet."""
        self.last_holder: dict[GpuId, TenantId] = {}
        """Per GPU, who held it last (the one a hand-over is from)."""
        self.wakes: dict[str, int] = {}
        """Parked tenants woken since start, by reason (:mod:`kiwid.core.parking`)."""
        self.restores_wasted = 0
        """Restores since start after which the tenant did no GPU work in its turn."""
        self.changes = 0
        """Bumped by every state change: a pass that saw none can reuse what it counted."""
        self._seq = itertools.count()
        self._front = itertools.count(-1, -1)
        self._claims = itertools.count()
        self._epochs = itertools.count(1)

    # ------------------------------------------------------------ membership

    def next_seq(self) -> int:
        """A new queue position, after every one drawn before (FIFO)."""
        return next(self._seq)

    def front_seq(self) -> int:
        """A queue position before every one drawn so far (front of its class)."""
        return next(self._front)

    def next_claim(self) -> int:
        """A new claim order, after every one drawn before."""
        return next(self._claims)

    def new_epoch(self, tenant: TenantRecord) -> int:
        """Move ``tenant`` to a new epoch: what was asked of it before is old news.

        Drawn from one counter for every tenant, so that a tenant that leaves and
        comes back under the same key never meets an epoch of the one before.
        """
        tenant.epoch = next(self._epochs)
        return tenant.epoch

    def answering(self, tid: TenantId, epoch: int, actions: list[Action]) -> TenantRecord | None:
        """The tenant a result of ``epoch`` answers for, or ``None`` if it answers nothing.

        A result of another epoch (its job was asked before a let-go, a fault or an
        operator's word) is old news: it changes nothing, and a :class:`Converge`
        is asked, which reads the truth and drives it to what is wanted now.
        """
        tenant = self.tenants.get(tid)
        if tenant is None:
            return None
        if epoch != tenant.epoch:
            actions.append(Converge(tid, epoch=tenant.epoch))
            return None
        return tenant

    def index(self, tenant: TenantRecord) -> None:
        """Add ``tenant`` to the per-GPU index."""
        for gpu in tenant.gpus or (NO_GPU,):
            self.by_gpu.setdefault(gpu, set()).add(tenant.id)

    def unindex(self, tenant: TenantRecord) -> None:
        """Remove ``tenant`` from the per-GPU index."""
        for gpu in tenant.gpus or (NO_GPU,):
            members = self.by_gpu.get(gpu)
            if members is not None:
                members.discard(tenant.id)
                if not members:
                    del self.by_gpu[gpu]

    def members(self, gpu: GpuId) -> list[TenantRecord]:
        """The tenants on ``gpu``."""
        return [self.tenants[tid] for tid in self.by_gpu.get(gpu, ())]

    def closure(self, gpus: set[GpuId]) -> list[TenantRecord]:
        """Every tenant linked to ``gpus``, directly or through multi-GPU tenants."""
        seen_gpus: set[GpuId] = set()
        found: dict[TenantId, TenantRecord] = {}
        todo = list(gpus)
        while todo:
            gpu = todo.pop()
            if gpu in seen_gpus:
                continue
            seen_gpus.add(gpu)
            for tid in self.by_gpu.get(gpu, ()):
                if tid not in found:
                    tenant = self.tenants[tid]
                    found[tid] = tenant
                    todo.extend(tenant.gpus - seen_gpus)
        return list(found.values())

    # ------------------------------------------------------------ policy

    def policy_of(self, tenant: TenantRecord) -> GpuPolicy:
        """The policy that times a tenant: the strictest of its managed GPUs."""
        managed = [self.policies[g] for g in tenant.gpus if g in self.policies]
        if not managed:
            return self.default
        return min(managed, key=lambda p: p.idle_release_s)

    def gating(
        self, gpus: Iterable[GpuId] | None = None, extra: TenantRecord | None = None
    ) -> frozenset[GpuId]:
        """Which of ``gpus`` (default all) gate now (``extra`` counts as bursting)."""
        gating: set[GpuId] = set()
        for gpu in self.policies if gpus is None else gpus:
            policy = self.policies.get(gpu)
            if policy is None or policy.mode is Mode.OFF:
                continue
            if policy.mode is Mode.EXCLUSIVE:
                gating.add(gpu)
                continue
            demand = 0
            for tid in self.by_gpu.get(gpu, ()):
                t = self.tenants[tid]
                if t.bursting or t is extra:
                    # What it declared counts before it shows it: it will use that much.
                    demand += max(t.memory.footprint.get(gpu) or 0, t.cls.policy.memory_bytes or 0)
            if demand > policy.capacity_bytes - policy.reserve_bytes:
                gating.add(gpu)
        return frozenset(gating)

    # ------------------------------------------------------------ queue

    def queue(
        self, gating: frozenset[GpuId], among: Iterable[TenantRecord] | None = None
    ) -> list[TenantRecord]:
        """Tenants that want gated GPUs they do not hold, in the order they are served.

        The highest class first, each class first come first (a tenant preempted
        for a higher class at its front).
        """
        wanting = [
            t
            for t in (self.tenants.values() if among is None else among)
            if t.state in (S.WAITING, S.CORUNNING) and t.gpus & gating
        ]
        return sorted(wanting, key=lambda t: (-t.cls.rank, t.seq))

    def claimed(
        self,
        gating: frozenset[GpuId],
        among: Iterable[TenantRecord],
        exclude: TenantRecord | None = None,
    ) -> set[GpuId]:
        """Gated GPUs that a holder holds or that an earlier burst is queued for.

        A tenant re-adopted from a previous kiwid claims nothing until its patience
        is over: a tenant that runs ungated keeps the GPU it was given.
        """
        claimed: set[GpuId] = set()
        for t in among:
            if t is exclude or t.state is S.IDLE or t.holds_nothing:
                continue
            if t.turn.adopting_until <= self.now:
                claimed |= t.gpus & gating
        return claimed

    def wanted(
        self, gating: frozenset[GpuId], among: Iterable[TenantRecord]
    ) -> dict[GpuId, tuple[float, int]]:
        """Gated GPUs that a waiting or co-running tenant wants, with what it weighs.

        Per GPU: the highest rank and the highest priority among those that may be
        granted now (a retry or a re-adoption waits aside and contests nothing).
        """
        wanted: dict[GpuId, tuple[float, int]] = {}
        now = self.now
        for t in among:
            state = t.state
            if state is not S.WAITING and state is not S.CORUNNING:
                continue
            if t.turn.retry_at > now or t.turn.adopting_until > now or self.overdue(t):
                continue
            rank, priority = t.cls.rank, t.cls.policy.priority
            for gpu in t.gpus:
                if gpu not in gating:
                    continue
                known = wanted.get(gpu)
                if known is None:
                    wanted[gpu] = (rank, priority)
                elif rank > known[0] or priority > known[1]:
                    wanted[gpu] = (rank if rank > known[0] else known[0], max(priority, known[1]))
        return wanted

    def overdue(self, tenant: TenantRecord) -> bool:
        """Whether a move of ``tenant``'s memory runs past the time it should take.

        Its size at the rate seen so far (``move_due``): a checkpoint or restore that
        hangs must not keep the GPU idle behind it, so such a tenant is passed over
        for its turn until its move ends (or its deadline makes it stuck).
        """
        return tenant.memory.residency.moving and self.now >= tenant.memory.move_due

    # ------------------------------------------------------------ changes

    def set_state(self, tenant: TenantRecord, trigger: Trigger, now: float) -> None:
        """Move ``tenant`` through the state table, booking the time in its ledger."""
        new = transition(tenant.state, trigger)
        ledger = tenant.ledger
        ledger.close(tenant.state, tenant.state_since, now)
        leaving_hold = tenant.state is S.HOLDER
        if leaving_hold and tenant.turn.granted_at is not None:
            tenant.memory.known = True  # one hold seen: its peak is its working set
        if new is S.HOLDER:
            ledger.quanta += 1
            tenant.turn.last_run = now
            tenant.turn.claim = self.next_claim()
        elif trigger in (Trigger.PREEMPTED, Trigger.PREEMPTED_PRIORITY):
            ledger.preempted += 1
            if trigger is Trigger.PREEMPTED_PRIORITY:
                ledger.preempted_priority += 1
        elif trigger is Trigger.IDLE_TIMEOUT and leaving_hold:
            ledger.early_releases += 1
        if leaving_hold:
            self._count_restore(tenant)
            self.end_handover(tenant)
            for gpu in tenant.gpus:
                self.last_holder[gpu] = tenant.id
            if tenant.cls.boosted:
                tenant.cls.set_boost(False)  # a boost is worth one quantum
            if trigger is not Trigger.PREEMPTED_PRIORITY:
                tenant.turn.remaining_s = None
        if tenant.running and new not in (S.HOLDER, S.CORUNNING):
            # Its turn ends: carry the silence at its end into the next one.
            began = tenant.turn.began
            if began is not None:
                if tenant.turn.silent():
                    tenant.turn.quiet_s += now - began
                else:
                    tenant.turn.quiet_s = now - (tenant.turn.last_active or now)
        if new is S.IDLE:
            tenant.memory.restored_for_turn = False
            tenant.turn.window_at = None  # its burst is over
            tenant.turn.quiet_s = 0.0
        self.transitions.append(Transition(tenant.id, tenant.state, new, trigger, now))
        self.changes += 1
        tenant.state = new
        tenant.state_since = now

    def _count_restore(self, tenant: TenantRecord) -> None:
        """A holder's turn ends: was the restore that brought it back wasted?

        Wasted if it was let go and did no GPU work since (counted for everyone,
        parked or not: the cost that parking saves).
        """
        if tenant.memory.restored_for_turn and tenant.running and tenant.turn.silent():
            tenant.ledger.restores_wasted += 1
            self.restores_wasted += 1
        tenant.memory.restored_for_turn = False

    def begin_handover(self, tenant: TenantRecord, gpus: Iterable[GpuId], now: float) -> None:
        """``tenant`` was granted ``gpus`` while gated: their hand-overs to it begin."""
        for gpu in gpus:
            before = self.last_holder.get(gpu)
            self.handovers[gpu] = Handover(
                gpu, tenant.id, before if before != tenant.id else None, now
            )

    def handover_phase(self, tenant: TenantRecord, phase: Phase) -> None:
        """The hand-overs to ``tenant`` wait for ``phase`` now."""
        for handover in self.handovers.values():
            if handover.to == tenant.id:
                step(handover, phase)

    def end_handover(self, tenant: TenantRecord) -> None:
        """The hand-overs to ``tenant`` are over (it runs, or it gave up its turn)."""
        for gpu in [g for g, h in self.handovers.items() if h.to == tenant.id]:
            del self.handovers[gpu]

    def gate(self, tenant: TenantRecord, actions: list[Action]) -> None:
        """Ask for ``tenant`` to be gated (once: a gated tenant is not asked again).

        It counts as running until the shell confirms the gate (``Gated``).
        """
        if not tenant.gated:
            tenant.lever = pull(tenant.lever, Pull.GATE)
            actions.append(Gate(tenant.id, epoch=tenant.epoch))

    def in_the_way(self, tenant: TenantRecord, gpus: Iterable[GpuId]) -> TenantRecord | None:
        """Another tenant on ``gpus`` that may run now: ``tenant`` must not be let go there."""
        for gpu in gpus:
            for other in self.members(gpu):
                if other is not tenant and other.may_run:
                    return other
        return None

    def fault(
        self,
        tenant: TenantRecord,
        fault: Fault,
        found: Residency | None,
        now: float,
        actions: list[Action],
        *,
        fence: bool = False,
    ) -> None:
        """``tenant`` is stuck: it holds nothing, and is gated unless its gate did not take.

        ``found``: where the driver says its memory is (``None``: as the table has it).
        Its epoch moves (an operator's job under way answers nothing any more), and a
        :class:`Converge` is asked, which contains it; ``fence``: a driver call of it
        hangs, so the freezer holds it meanwhile (:class:`Fence`).
        """
        if found is not None:
            tenant.memory.residency = settle(tenant.memory.residency, found)
        self.set_state(tenant, Trigger.FAULTED, now)
        tenant.fault.cause = fault
        tenant.fault.mending = False
        tenant.lever = pull(tenant.lever, Pull.HELD if fault.contained else Pull.LOOSE)
        epoch = self.new_epoch(tenant)
        tenant.turn.granted_at = None
        tenant.turn.remaining_s = None
        tenant.turn.free_wait_since = None
        tenant.turn.waiting_for = None
        if tenant.cls.boosted:
            tenant.cls.set_boost(False)
        tenant.memory.move_due = math.inf
        tenant.memory.restored_for_turn = False
        tq = self.policy_of(tenant).tq_s
        tenant.fault.regate_at = math.inf if fault.contained else now + tq
        if fence:
            actions.append(Fence(tenant.id, epoch=epoch))
        actions.append(Converge(tenant.id, epoch=epoch))

    def let_go(self, tenant: TenantRecord, now: float, actions: list[Action]) -> None:
        """Ungate a tenant whose memory is on the card; a holder's quantum starts."""
        assert tenant.memory.residency.on_card, f"{tenant.id} let go from {tenant.memory.residency}"
        if tenant.memory.residency is Residency.PREFETCHED:
            tenant.memory.residency = move(tenant.memory.residency, Move.GRANTED)
        tenant.lever = pull(tenant.lever, Pull.UNGATE)
        epoch = self.new_epoch(tenant)
        tenant.turn.waiting_for = None
        if tenant.memory.refused_until_run and tenant.state is not S.IDLE:
            # A turn: its swap-out may be tried again (not an idle one let go after
            # its swap-out failed, which would be taken for room again at once).
            tenant.memory.swap_refusal = None
            tenant.memory.refused_until_run = False
        actions.append(Ungate(tenant.id, epoch=epoch))
        if tenant.state is S.HOLDER:
            tenant.turn.granted_at = now
        tenant.turn.window_at = now  # its window to show activity

    def requeue(self, tenant: TenantRecord, trigger: Trigger, now: float) -> None:
        """A holder goes back to the queue (preempted, or its memory cannot come back)."""
        self.set_state(tenant, trigger, now)
        tenant.turn.granted_at = None
        tenant.seq = self.next_seq()
