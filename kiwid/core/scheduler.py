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

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from kiwid.core import answers, faults, memory, parking, rotation
from kiwid.core.actions import Action
from kiwid.core.events import (
    ActivitySeen,
    Admitted,
    Converged,
    Event,
    FootprintRemembered,
    FootprintSeen,
    Gated,
    GpusConfigured,
    HostMemorySeen,
    JobOverdue,
    MemoryFreeSeen,
    MemorySplit,
    Mended,
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
    WakeAsked,
)
from kiwid.core.lever import Pull, pull
from kiwid.core.model import GpuId, GpuPolicy, Mode, TenantId, TenantState
from kiwid.core.queries import SchedulerQueries
from kiwid.core.residency import Move, Residency, move
from kiwid.core.states import Trigger
from kiwid.core.table import TenantTable, Transition
from kiwid.core.tenant import TenantRecord

__all__ = ["Scheduler", "Transition"]

S = TenantState
R = Residency
_TIME_OR_MEMORY = frozenset(
    {Tick, SwapFinished, HostMemorySeen, MemoryFreeSeen, Gated, Ungated, Converged, MemorySplit}
)
"""Events after which entitlements change only if a tenant changed state."""
Scope = set[GpuId] | None
"""The GPUs whose rotation an event makes the core look at again (``None``: every one)."""


class Scheduler(SchedulerQueries):
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
        scope = self._HANDLERS[kind](self, event, now, actions)
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

    # ------------------------------------------------------------ events
    # One handler per kind of event: it changes the table and returns the GPUs whose
    # rotation must be looked at again (``None``: every GPU).

    def _configured(self, e: GpusConfigured, now: float, actions: list[Action]) -> Scope:
        table = self._t
        table.policies = dict(e.policies)
        table.host = memory.HostMemory(table.host.available, e.host_floor_bytes)
        self._clear_floor_refusals()
        return None

    def _attach(self, e: TenantAttached, now: float, actions: list[Action]) -> Scope:
        table = self._t
        tid, gpus = e.tenant, e.gpus
        known = table.tenants.get(tid)
        if known is None:
            known = TenantRecord(tid, gpus, table.next_seq(), state_since=now)
            table.new_epoch(known)
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

    def _detach(self, e: TenantDetached, now: float, actions: list[Action]) -> Scope:
        gone = self._t.tenants.pop(e.tenant, None)
        if gone is None:
            return set()
        self._t.end_handover(gone)
        self._t.unindex(gone)
        return set(gone.gpus)

    def _activity(self, e: ActivitySeen, now: float, actions: list[Action]) -> Scope:
        tenant = self._t.tenants.get(e.tenant)
        if tenant is None:
            return set()
        tenant.turn.last_active = now
        if tenant.state is not S.IDLE:
            return set()
        rotation.start_burst(self._t, tenant, now, actions)
        return set(tenant.gpus)

    def _footprint(self, e: FootprintSeen, now: float, actions: list[Action]) -> Scope:
        tenant = self._t.tenants.get(e.tenant)
        if tenant is None:
            return set()
        mem = tenant.memory
        mem.footprint[e.gpu] = e.used_bytes
        if e.used_bytes is not None and e.used_bytes > mem.peak.get(e.gpu, 0):
            mem.peak[e.gpu] = e.used_bytes
        policy = self._t.policies.get(e.gpu)
        if policy is not None and (policy.mode is Mode.AUTO or tenant.turn.waiting_for):
            return {e.gpu}
        return set()

    def _swap_finished(self, e: SwapFinished, now: float, actions: list[Action]) -> Scope:
        return answers.swap_finished(self._t, e, now, actions)

    def _gated(self, e: Gated, now: float, actions: list[Action]) -> Scope:
        return answers.gated(self._t, e.tenant, e.epoch, now, actions)

    def _ungated(self, e: Ungated, now: float, actions: list[Action]) -> Scope:
        return answers.ungated(self._t, e.tenant, e.epoch, now, actions)

    def _converged(self, e: Converged, now: float, actions: list[Action]) -> Scope:
        return answers.converged(self._t, e, now, actions)

    def _split(self, e: MemorySplit, now: float, actions: list[Action]) -> Scope:
        return answers.memory_split(self._t, e, now, actions)

    def _faulted(self, e: TenantFaulted, now: float, actions: list[Action]) -> Scope:
        return faults.faulted(self._t, e, now, actions)

    def _overdue(self, e: JobOverdue, now: float, actions: list[Action]) -> Scope:
        return faults.overdue(self._t, e, now, actions)

    def _retry_asked(self, e: RetryAsked, now: float, actions: list[Action]) -> Scope:
        return faults.retry_asked(self._t, e.tenant, now, actions)

    def _mended(self, e: Mended, now: float, actions: list[Action]) -> Scope:
        return faults.mended(self._t, e, now, actions)

    def _release_asked(self, e: ReleaseAsked, now: float, actions: list[Action]) -> Scope:
        return faults.release_asked(self._t, e.tenant, now, actions)

    def _released(self, e: Released, now: float, actions: list[Action]) -> Scope:
        return faults.released(self._t, e, now, actions)

    def _adopt(self, e: TenantAdopted, now: float, actions: list[Action]) -> Scope:
        table = self._t
        tenant = table.tenants.get(e.tenant)
        if tenant is None or tenant.state is not S.IDLE:
            return set()
        tenant.lever = pull(tenant.lever, Pull.HELD)
        if e.swapped is not None:
            tenant.memory.residency = move(tenant.memory.residency, Move.ADOPTED_SWAPPED)
            tenant.memory.known = True
            tenant.memory.peak.update(e.swapped)
        table.set_state(tenant, Trigger.ADOPTED, now)
        tenant.seq = table.next_seq()
        tenant.turn.adopting_until = now + table.policy_of(tenant).idle_release_s
        return set(tenant.gpus)

    def _policy_set(self, e: TenantPolicySet, now: float, actions: list[Action]) -> Scope:
        tenant = self._t.tenants.get(e.tenant)
        if tenant is None or tenant.cls.policy == e.policy:
            return set()
        tenant.cls.set_policy(e.policy)
        return set(tenant.gpus)

    def _wake(self, e: WakeAsked, now: float, actions: list[Action]) -> Scope:
        tenant = self._t.tenants.get(e.tenant)
        if tenant is None or not parking.wake(self._t, tenant, e.reason, e.detail, now):
            return set()
        return set(tenant.gpus)

    def _admitted(self, e: Admitted, now: float, actions: list[Action]) -> Scope:
        tenant = self._t.tenants.get(e.tenant)
        if tenant is None or tenant.state is not S.IDLE or not self.would_wait(e.tenant):
            return set()
        rotation.start_burst(self._t, tenant, now, actions)
        return set(tenant.gpus)

    def _host_memory(self, e: HostMemorySeen, now: float, actions: list[Action]) -> Scope:
        table = self._t
        before = table.host.available
        table.host = memory.HostMemory(e.available_bytes, table.host.floor)
        if before is None or e.available_bytes > before:
            return self._clear_floor_refusals()
        return set()

    def _free_memory(self, e: MemoryFreeSeen, now: float, actions: list[Action]) -> Scope:
        before = self._t.free_seen.get(e.gpu)
        self._t.free_seen[e.gpu] = e.free_bytes
        if before is None or e.free_bytes > before:  # a restore may wait for it
            return {e.gpu} if self._restore_waits(e.gpu) else set()
        return set()

    def _remembered(self, e: FootprintRemembered, now: float, actions: list[Action]) -> Scope:
        tenant = self._t.tenants.get(e.tenant)
        if tenant is None or e.peak_bytes <= 0:
            return set()
        tenant.memory.remembered = e.peak_bytes
        tenant.memory.known = True
        return set(tenant.gpus)

    def _unswappable(self, e: TenantUnswappable, now: float, actions: list[Action]) -> Scope:
        tenant = self._t.tenants.get(e.tenant)
        if tenant is None or tenant.memory.unswappable is not None:
            return set()
        tenant.memory.unswappable = e.reason
        return set(tenant.gpus)

    def _tick(self, e: Tick, now: float, actions: list[Action]) -> Scope:
        return {g for g, d in self._t.deadlines.items() if d <= now}

    _HANDLERS: ClassVar[dict[type, Callable[[Scheduler, Any, float, list[Action]], Scope]]] = {
        GpusConfigured: _configured,
        TenantAttached: _attach,
        TenantDetached: _detach,
        ActivitySeen: _activity,
        FootprintSeen: _footprint,
        SwapFinished: _swap_finished,
        Gated: _gated,
        Ungated: _ungated,
        Converged: _converged,
        MemorySplit: _split,
        TenantFaulted: _faulted,
        JobOverdue: _overdue,
        RetryAsked: _retry_asked,
        Mended: _mended,
        ReleaseAsked: _release_asked,
        Released: _released,
        TenantAdopted: _adopt,
        TenantPolicySet: _policy_set,
        WakeAsked: _wake,
        Admitted: _admitted,
        HostMemorySeen: _host_memory,
        MemoryFreeSeen: _free_memory,
        FootprintRemembered: _remembered,
        TenantUnswappable: _unswappable,
        Tick: _tick,
    }

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
