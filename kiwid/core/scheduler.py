"""The scheduling core: events and ``now`` in, gate/ungate/swap actions out.

Pure: no I/O, no clock, no threads. The daemon calls :meth:`Scheduler.handle`
for every event and wakes again at :meth:`Scheduler.next_deadline`.

Semantics (docs/scheduling in the README, DESIGN "Scheduling semantics"):

* A tenant starts a burst when GPU activity is seen while it is idle. If every
  GPU it needs is free it holds them at once; otherwise it is gated and queued.
* A holder keeps its GPUs while nobody waits for them. When someone waits, it is
  preempted at ``max(quantum start + TQ, now)`` and queued at the back.
* A holder with no GPU activity for ``idle_release`` seconds (counted from its
  quantum's start or its last activity) yields early and becomes idle; this also
  returns a granted waiter that does no GPU work in its turn to idle.
* Waiters are served first come, first served. A tenant on several GPUs is
  granted all of them or none; a waiter's GPUs are claimed for it so that later
  waiters cannot overtake it (no starvation, no deadlock).
* ``exclusive`` GPUs always gate, ``off`` GPUs never, ``auto`` GPUs gate only
  while the bursting tenants' memory does not fit the card minus its reserve.

The rules live in :mod:`kiwid.core.rotation`, the tables in :mod:`kiwid.core.table`.

Memory (:mod:`kiwid.core.residency`, :mod:`kiwid.core.memory`): a granted holder
is let go only once its memory is on the card, and (if it needs room) once the
tenants making room for it have left; its quantum starts then. A tenant that
never held the GPU needs the whole card, one that declared its memory what it
declared, a known one the peak it used before (the largest of these).
Resident non-holders are swapped out, least recently run first, to make room; a
restore is asked for only when it fits beside everything on the card or moving.
With ``checkpoint`` every other waiter's memory goes to host RAM too, once the new
holder runs. A failed swap-out keeps the memory on the card (not tried again
until that tenant runs); a failed restore, or no room that can be made, sends the
tenant back to the queue for one quantum, and the rotation goes on.

Prefetch: when the next tenant in line is in host RAM and fits beside everyone on
the card, its memory comes back (it stays gated) shortly before the holder's
quantum ends: early by the time its restore should take (its size at the restore
rate seen so far on that GPU, plus a second). The hand-over then moves the gate.
"""

from __future__ import annotations

from collections.abc import Mapping

from kiwid.core import faults, memory, rotation, snapshot
from kiwid.core.events import (
    Action,
    ActivitySeen,
    Admitted,
    Event,
    FootprintRemembered,
    FootprintSeen,
    Gated,
    GpusConfigured,
    HostMemorySeen,
    MemoryFreeSeen,
    Mended,
    Release,
    ReleaseAsked,
    Released,
    RetryAsked,
    SwapFinished,
    TenantAdopted,
    TenantAttached,
    TenantDetached,
    TenantFaulted,
    TenantPolicySet,
    TenantUnswappable,
    Tick,
    Ungated,
)
from kiwid.core.ledger import LedgerView
from kiwid.core.model import GpuId, GpuPolicy, Mode, TenantId, TenantState
from kiwid.core.residency import Move, Residency, move
from kiwid.core.states import Trigger
from kiwid.core.table import TenantTable, Transition
from kiwid.core.tenant import TenantRecord
from kiwid.core.view import SchedulerView

__all__ = ["Scheduler", "Transition"]

S = TenantState
R = Residency
_TIME_OR_MEMORY = frozenset({Tick, SwapFinished, HostMemorySeen, MemoryFreeSeen, Gated, Ungated})
"""Events after which entitlements change only if a tenant changed state."""


class Scheduler:
    """Round-robin arbitration of GPU bursts with a time quantum per GPU."""

    def __init__(
        self,
        policies: Mapping[GpuId, GpuPolicy] | None = None,
        default_policy: GpuPolicy | None = None,
    ) -> None:
        """Start with the given GPUs; ``default_policy`` serves tenants on none."""
        self._t = TenantTable(dict(policies or {}), default_policy or GpuPolicy())

    # ------------------------------------------------------------ public API

    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply ``event`` at monotonic time ``now`` and return the actions to take.

        Time never goes back: a ``now`` older than the last one is treated as
        the last one.
        """
        table = self._t
        now = max(now, table.now)
        table.now = now
        # The two events of every poll first, without allocation when nothing changes.
        kind = type(event)
        if kind is ActivitySeen:
            known = table.tenants.get(event.tenant)  # type: ignore[union-attr]
            if known is not None and known.state is not S.IDLE:
                known.turn.last_active = now
                return []
        elif kind is FootprintSeen:
            known = table.tenants.get(event.tenant)  # type: ignore[union-attr]
            if known is None or known.memory.footprint.get(event.gpu, -1) == event.used_bytes:  # type: ignore[union-attr]
                return []
        actions: list[Action] = []
        # Most events touch the GPUs of one tenant only: reconcile just those
        # (``scope``); ``None`` means every GPU.
        scope: set[GpuId] | None = set()
        match event:
            case GpusConfigured(policies=policies, host_floor_bytes=floor):
                table.policies = dict(policies)
                table.host = memory.HostMemory(table.host.available, floor)
                self._clear_floor_refusals()
                scope = None
            case TenantAttached(tenant=tid, gpus=gpus):
                scope = self._attach(tid, gpus, now)
            case TenantDetached(tenant=tid):
                gone = table.tenants.pop(tid, None)
                if gone is not None:
                    table.unindex(gone)
                    scope = set(gone.gpus)
            case ActivitySeen(tenant=tid):
                tenant = table.tenants.get(tid)
                if tenant is not None:
                    tenant.turn.last_active = now
                    if tenant.state is S.IDLE:
                        rotation.start_burst(table, tenant, now, actions)
                        scope = set(tenant.gpus)
            case FootprintSeen(tenant=tid, gpu=gpu, used_bytes=used):
                tenant = table.tenants.get(tid)
                if tenant is not None:
                    tenant.memory.footprint[gpu] = used
                    if used is not None and used > tenant.memory.peak.get(gpu, 0):
                        tenant.memory.peak[gpu] = used
                    policy = table.policies.get(gpu)
                    if policy is not None and (policy.mode is Mode.AUTO or tenant.turn.waiting_for):
                        scope = {gpu}
            case SwapFinished():
                scope = self._swap_finished(event, now)
            case Gated(tenant=tid):
                scope = faults.gated(self._t, tid, now)
            case Ungated(tenant=tid):
                scope = faults.ungated(self._t, tid, now)
            case TenantFaulted():
                scope = faults.faulted(self._t, event, now)
            case RetryAsked(tenant=tid):
                scope = faults.retry_asked(self._t, tid, now, actions)
            case Mended(tenant=tid, memory=found):
                scope = faults.mended(self._t, tid, found, now)
            case ReleaseAsked(tenant=tid):
                tenant = table.tenants.get(tid)
                if tenant is not None and tenant.state is S.STUCK and not tenant.fault.mending:
                    tenant.fault.mending = True
                    actions.append(Release(tid))
            case Released():
                scope = faults.released(self._t, event, now)
            case TenantAdopted(tenant=tid, swapped=swapped):
                scope = self._adopt(tid, swapped, now)
            case TenantPolicySet(tenant=tid, policy=tenant_policy):
                tenant = table.tenants.get(tid)
                if tenant is not None and tenant.cls.policy != tenant_policy:
                    tenant.cls.set_policy(tenant_policy)
                    scope = set(tenant.gpus)
            case Admitted(tenant=tid):
                tenant = table.tenants.get(tid)
                if tenant is not None and tenant.state is S.IDLE and self.would_wait(tid):
                    rotation.start_burst(table, tenant, now, actions)
                    scope = set(tenant.gpus)
            case HostMemorySeen(available_bytes=available):
                before = table.host.available
                table.host = memory.HostMemory(available, table.host.floor)
                if before is None or available > before:
                    scope = self._clear_floor_refusals()
            case MemoryFreeSeen(gpu=gpu, free_bytes=free):
                before = table.free_seen.get(gpu)
                table.free_seen[gpu] = free
                if before is None or free > before:  # a restore may wait for it
                    scope = {gpu} if self._restore_waits(gpu) else set()
            case FootprintRemembered(tenant=tid, peak_bytes=peak):
                tenant = table.tenants.get(tid)
                if tenant is not None and peak > 0:
                    tenant.memory.remembered = peak
                    tenant.memory.known = True
                    scope = set(tenant.gpus)
            case TenantUnswappable(tenant=tid, reason=reason):
                tenant = table.tenants.get(tid)
                if tenant is not None and tenant.memory.unswappable is None:
                    tenant.memory.unswappable = reason
                    scope = set(tenant.gpus)
            case Tick():
                scope = {g for g, d in table.deadlines.items() if d <= now}
        if scope is None or scope:
            members_changed = kind not in _TIME_OR_MEMORY
            rotation.reconcile(table, now, actions, scope, members_changed=members_changed)
        return actions

    def next_deadline(self) -> float | None:
        """Return when the core next needs a ``Tick`` (monotonic s), or ``None``."""
        return min(self._t.deadlines.values(), default=None)

    def drain_transitions(self) -> list[Transition]:
        """Return (and forget) the state changes since the last call, oldest first."""
        transitions = self._t.transitions
        if not transitions:  # the common case, once per event on the poll path
            return []
        out = list(transitions)
        transitions.clear()
        return out

    def drain_notices(self) -> list[tuple[TenantId, str]]:
        """Return (and forget) decisions worth a log line that changed no state."""
        notices = self._t.notices
        if not notices:
            return []
        out = list(notices)
        notices.clear()
        return out

    def ledger(self, tenant: TenantId, now: float) -> LedgerView | None:
        """Return one tenant's ledger at ``now`` (``None``: unknown tenant)."""
        t = self._t.tenants.get(tenant)
        return None if t is None else t.ledger.view(t.state, t.state_since, now, t.entitled(now))

    def policies(self) -> dict[GpuId, GpuPolicy]:
        """Return the policy in force on every managed GPU."""
        return dict(self._t.policies)

    def policy(self, gpu: GpuId) -> GpuPolicy | None:
        """Return the policy in force on ``gpu`` (``None``: not managed)."""
        return self._t.policies.get(gpu)

    def tenant_state(self, tenant: TenantId) -> TenantState | None:
        """Return a tenant's state (``None``: unknown tenant)."""
        known = self._t.tenants.get(tenant)
        return None if known is None else known.state

    def residency(self, tenant: TenantId) -> Residency | None:
        """Where a tenant's memory is (``None``: unknown tenant)."""
        known = self._t.tenants.get(tenant)
        return None if known is None else known.memory.residency

    def gated(self, tenant: TenantId) -> bool:
        """Whether the scheduler has a tenant gated (asked, and not let go since)."""
        known = self._t.tenants.get(tenant)
        return known is not None and known.gated

    def peak(self, tenant: TenantId) -> dict[GpuId, int]:
        """The most memory a tenant was seen using, per GPU (empty: unknown)."""
        known = self._t.tenants.get(tenant)
        return {} if known is None else dict(known.memory.peak)

    def tenant_ids(self) -> frozenset[TenantId]:
        """Return every tenant the core knows."""
        return frozenset(self._t.tenants)

    def would_wait(self, tenant: TenantId) -> bool:
        """Whether a burst of ``tenant`` now would wait: a GPU it needs is held or claimed."""
        table = self._t
        t = table.tenants.get(tenant)
        if t is None:
            return False
        gating = table.gating(t.gpus, extra=t)
        need = t.gpus & gating
        return bool(need & table.claimed(gating, table.closure(set(need)), exclude=t))

    def view(self, now: float) -> SchedulerView:
        """Return a read-only snapshot for status displays."""
        return snapshot.view(self._t, now)

    # ------------------------------------------------------------ events

    def _attach(self, tid: TenantId, gpus: frozenset[GpuId], now: float) -> set[GpuId]:
        table = self._t
        known = table.tenants.get(tid)
        if known is None:
            known = TenantRecord(tid, gpus, table.next_seq(), state_since=now)
            table.tenants[tid] = known
            table.index(known)
            return set(gpus)
        scope = set(known.gpus | gpus)
        if gpus - known.gpus:
            known.turn.claim = table.next_claim()  # the newest claim yields a conflict
        table.unindex(known)
        known.gpus = gpus
        table.index(known)
        return scope

    def _adopt(self, tid: TenantId, swapped: Mapping[GpuId, int] | None, now: float) -> set[GpuId]:
        table = self._t
        tenant = table.tenants.get(tid)
        if tenant is None or tenant.state is not S.IDLE:
            return set()
        tenant.gated = True
        if swapped is not None:
            tenant.memory.residency = move(tenant.memory.residency, Move.ADOPTED_SWAPPED)
            tenant.memory.known = True
            tenant.memory.peak.update(swapped)
        table.set_state(tenant, Trigger.ADOPTED, now)
        tenant.seq = table.next_seq()
        tenant.turn.adopting_until = now + table.policy_of(tenant).idle_release_s
        return set(tenant.gpus)

    def _swap_finished(self, event: SwapFinished, now: float) -> set[GpuId]:
        table = self._t
        tenant = table.tenants.get(event.tenant)
        if tenant is None:
            return set()
        ledger = tenant.ledger
        if event.direction == "out":
            if tenant.memory.residency is not R.SWAPPING_OUT:
                return set()  # not asked for (a stale report): nothing to learn
            ledger.swap_s += max(0.0, event.seconds)
            if event.ok:
                tenant.memory.residency = move(tenant.memory.residency, Move.OUT_DONE)
                ledger.swapped_out_bytes += event.moved_bytes
            else:
                tenant.memory.residency = move(tenant.memory.residency, Move.OUT_FAILED)
                why = event.reason or "unknown error"
                if event.unswappable:
                    tenant.memory.unswappable = why
                else:
                    tenant.memory.swap_refusal = f"its swap-out failed: {why}"
                    tenant.memory.refused_until_run = True
            return set(tenant.gpus)
        if tenant.memory.residency not in (R.SWAPPING_IN, R.PREFETCHING):
            return set()
        ledger.swap_s += max(0.0, event.seconds)
        if event.ok:
            tenant.memory.residency = move(tenant.memory.residency, Move.IN_DONE)
            ledger.swapped_in_bytes += event.moved_bytes
            self._learn_restore_rate(tenant, event)
            return set(tenant.gpus)
        if event.deferred:  # not started: it waits for a reading that shows the room
            tenant.memory.residency = move(tenant.memory.residency, Move.IN_DEFERRED)
            tenant.turn.waiting_for = event.reason or "waiting for free memory"
            return set(tenant.gpus)
        tenant.memory.residency = move(tenant.memory.residency, Move.IN_FAILED)
        tq = table.policy_of(tenant).tq_s
        tenant.turn.retry_at = now + tq
        tenant.turn.waiting_for = (
            f"its restore failed ({event.reason or 'unknown error'}); it tries again "
            f"at its turn after {tq:g} s"
        )
        if tenant.state is S.HOLDER:
            table.requeue(tenant, Trigger.SWAP_IN_FAILED, now)
        return set(tenant.gpus)

    def _learn_restore_rate(self, tenant: TenantRecord, event: SwapFinished) -> None:
        if event.seconds > 0 and event.moved_bytes > 0 and tenant.gpus:
            rate = event.moved_bytes / event.seconds / len(tenant.gpus)
            rates = self._t.restore_rate
            for gpu in tenant.gpus:
                old = rates.get(gpu)
                rates[gpu] = rate if old is None else (old + rate) / 2

    def _restore_waits(self, gpu: GpuId) -> bool:
        """Whether a tenant on ``gpu`` is in host RAM, gated: more free memory may let it back."""
        return any(t.memory.residency is R.HOST and t.gated for t in self._t.members(gpu))

    def _clear_floor_refusals(self) -> set[GpuId]:
        """Forget host-floor refusals (the floor or the reading changed): plan again."""
        scope: set[GpuId] = set()
        for t in self._t.tenants.values():
            if t.memory.swap_refusal is not None and not t.memory.refused_until_run:
                t.memory.swap_refusal = None
                scope |= t.gpus
        return scope
