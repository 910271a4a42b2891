"""The engine: applies scheduler actions to real tenants, one at a time.

Every change of the scheduler goes through :meth:`Engine.apply`, under one
lock, so that a poll, a control command and a reload never interleave. Gate
operations block (a freeze waits for the cgroup to report frozen), so they run
on one worker thread; the event loop keeps answering ``kiwictl`` meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kiwid.core.events import Action, ActivitySeen, Event, Gate, TenantDetached, Tick
from kiwid.core.ledger import LedgerView
from kiwid.core.model import TenantState
from kiwid.core.scheduler import Scheduler, Transition
from kiwid.core.states import Trigger
from kiwid.daemon.gates import GateError, TenantGate
from kiwid.daemon.state import GatedRecord, StateFile
from kiwid.daemon.tenants import TenantInfo, TenantTracker

log = logging.getLogger("kiwid.engine")

DEPARTED_GRACE_S = 300.0
"""How long a gone tenant's ledger stays in status and metrics (bounds label cardinality)."""
HANDOVER_BUCKETS_S = (0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


@dataclass(frozen=True)
class Departed:
    """A tenant that left, kept a while for its ledger."""

    tenant: str
    info: TenantInfo | None
    ledger: LedgerView
    gone_at: float


@dataclass
class Histogram:
    """Cumulative-bucket histogram (Prometheus style) of durations in seconds."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(HANDOVER_BUCKETS_S) + 1))
    total_s: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        """Count one observation."""
        self.count += 1
        self.total_s += seconds
        for i, bound in enumerate(HANDOVER_BUCKETS_S):
            if seconds <= bound:
                self.counts[i] += 1
        self.counts[-1] += 1

    def as_json(self) -> dict[str, object]:
        """The histogram as the status object shows it."""
        bounds: list[object] = [*HANDOVER_BUCKETS_S, "+Inf"]
        return {
            "buckets": [[b, c] for b, c in zip(bounds, self.counts, strict=True)],
            "sum": self.total_s,
            "count": self.count,
        }


class Engine:
    """Scheduler + tenant table + gate + state file, kept consistent."""

    def __init__(
        self,
        scheduler: Scheduler,
        tracker: TenantTracker,
        gate: TenantGate,
        state: StateFile,
        clock: Callable[[], float],
    ) -> None:
        """Wire the parts; nothing runs until :meth:`apply`."""
        self.scheduler = scheduler
        self.tracker = tracker
        self.gate = gate
        self.state = state
        self._clock = clock
        self._lock = asyncio.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiwid-gate")
        self.generation = 0
        """Bumped by every change (event or reload), so that readers can cache."""
        self.gate_failures: dict[str, str] = {}
        """Tenants the scheduler wanted gated but that could not be: they run on."""
        self.handovers: dict[str, Histogram] = {}
        """Per GPU, how long carrying out a hand-over's gate/ungate actions took."""
        self._departed: dict[str, Departed] = {}

    async def apply(self, events: Iterable[Event]) -> None:
        """Feed ``events`` to the scheduler and carry out its actions, in order."""
        async with self._lock:
            for event in events:
                now = self._clock()
                if isinstance(event, TenantDetached):
                    self._depart(event.tenant, now)
                actions = self.scheduler.handle(event, now)
                transitions = self.scheduler.drain_transitions()
                if actions or transitions or not isinstance(event, ActivitySeen):
                    self.generation += 1
                for change in transitions:
                    self._log_transition(change)
                if isinstance(event, TenantDetached):
                    await self._forget(event.tenant)
                if actions:
                    started = self._clock()
                    for action in actions:
                        await self._act(action)
                    self._record_handover(actions, self._clock() - started)

    def departed(self, now: float) -> list[Departed]:
        """Tenants gone less than DEPARTED_GRACE_S ago (older ones are dropped)."""
        for key in [k for k, d in self._departed.items() if now - d.gone_at > DEPARTED_GRACE_S]:
            del self._departed[key]
        return list(self._departed.values())

    def _depart(self, tenant: str, now: float) -> None:
        ledger = self.scheduler.ledger(tenant, now)
        info = self.tracker.gone.pop(tenant, None)
        if ledger is not None:
            self._departed[tenant] = Departed(tenant, info, ledger, now)
        name = info.identity.name if info else tenant
        log.info("Gone: %s (%s) left the GPU", name, tenant)

    def _record_handover(self, actions: list[Action], seconds: float) -> None:
        gpus: set[str] = set()
        for action in actions:
            if not isinstance(action, Gate):
                info = self.tracker.tenants.get(action.tenant)
                if info is not None:
                    gpus |= info.gpus
        for gpu in gpus:
            self.handovers.setdefault(gpu, Histogram()).observe(seconds)

    def _log_transition(self, change: Transition) -> None:
        info = self.tracker.tenants.get(change.tenant)
        name = info.identity.name if info else change.tenant
        who = f"{name} ({change.tenant})" if name != change.tenant else change.tenant
        gpus = ",".join(sorted(info.gpus)) if info else "?"
        trigger = change.trigger
        if change.new is TenantState.HOLDER:
            log.info("Grant: %s holds GPU %s (%s)", who, gpus, trigger.value)
        elif trigger is Trigger.PREEMPTED:
            log.info("Preempt: %s yields GPU %s: quantum over and someone waits", who, gpus)
        elif trigger is Trigger.IDLE_TIMEOUT and change.old is TenantState.HOLDER:
            log.info("Early release: %s yields GPU %s: no GPU work for idle_release", who, gpus)
        elif change.new is TenantState.WAITING:
            log.info("Queue: %s waits for GPU %s (%s)", who, gpus, trigger.value)
        else:
            log.debug("%s: %s -> %s (%s)", who, change.old.value, change.new.value, trigger.value)

    async def tick(self) -> None:
        """Let the scheduler act on deadlines that have passed."""
        await self.apply([Tick()])

    async def ungate_all(self) -> list[str]:
        """Ungate every tenant this daemon gated; return those that failed."""
        failed: list[str] = []
        async with self._lock:
            for record in self.state.records.values():
                if not await self._ungate(record):
                    failed.append(record.tenant)
        return failed

    async def release(self, record: GatedRecord) -> bool:
        """Ungate one recorded tenant (one this daemon did not gate itself)."""
        async with self._lock:
            self.generation += 1
            return await self._ungate(record)

    def close(self) -> None:
        """Stop the worker thread (after :meth:`ungate_all`)."""
        self._pool.shutdown(wait=True)

    async def _act(self, action: Action) -> None:
        tenant = action.tenant
        if isinstance(action, Gate):
            info = self.tracker.tenants.get(tenant)
            if info is None:  # pragma: no cover - the core only acts on known tenants
                return
            name = info.identity.name
            try:
                await self._run(self._gate_sync, info)
            except GateError as err:
                self.gate_failures[tenant] = str(err)
                log.warning(
                    "Could not gate %s (%s): %s; it runs on, the rotation goes on",
                    tenant,
                    name,
                    err,
                )
            else:
                self.gate_failures.pop(tenant, None)
                log.debug("Gated %s (%s)", tenant, name)
        else:
            self.gate_failures.pop(tenant, None)
            record = self.state.records.get(tenant)
            if record is not None and await self._ungate(record):
                info = self.tracker.tenants.get(tenant)
                name = info.identity.name if info else tenant
                log.debug("Ungated %s (%s)", tenant, name)

    def _gate_sync(self, info: object) -> None:
        assert isinstance(info, TenantInfo)
        record = self.gate.prepare(info)
        self.state.put(record)  # write-ahead: recorded before it is frozen
        try:
            self.gate.gate(record)
        except GateError:
            self.state.drop(record.tenant)
            raise

    async def _ungate(self, record: GatedRecord) -> bool:
        try:
            await self._run(self._ungate_sync, record)
        except GateError as err:
            log.error(
                "Could not ungate %s: %s (kept in %s for kiwid recover)",
                record.tenant,
                err,
                self.state.path,
            )
            return False
        return True

    def _ungate_sync(self, record: object) -> None:
        assert isinstance(record, GatedRecord)
        self.gate.ungate(record)
        self.state.drop(record.tenant)

    async def _forget(self, tenant: str) -> None:
        """A tenant left: ungate what may remain of it (its cgroup may be gone)."""
        self.gate_failures.pop(tenant, None)
        record = self.state.records.get(tenant)
        if record is not None:
            await self._ungate(record)
        await self._run(lambda _: self.gate.forget(tenant), None)

    async def _run(self, fn: Callable[[object], None], arg: object) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, fn, arg)
