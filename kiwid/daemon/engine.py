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

from kiwid.core.events import Action, Event, Gate, TenantDetached, Tick
from kiwid.core.scheduler import Scheduler
from kiwid.daemon.gates import GateError, TenantGate
from kiwid.daemon.state import GatedRecord, StateFile
from kiwid.daemon.tenants import TenantInfo, TenantTracker

log = logging.getLogger("kiwid.engine")


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

    async def apply(self, events: Iterable[Event]) -> None:
        """Feed ``events`` to the scheduler and carry out its actions, in order."""
        async with self._lock:
            for event in events:
                self.generation += 1
                actions = self.scheduler.handle(event, self._clock())
                if isinstance(event, TenantDetached):
                    await self._forget(event.tenant)
                for action in actions:
                    await self._act(action)

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
                log.info("Gated %s (%s): waiting for its turn", tenant, name)
        else:
            self.gate_failures.pop(tenant, None)
            record = self.state.records.get(tenant)
            if record is not None and await self._ungate(record):
                info = self.tracker.tenants.get(tenant)
                name = info.identity.name if info else tenant
                log.info("Ungated %s (%s): its turn", tenant, name)

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
