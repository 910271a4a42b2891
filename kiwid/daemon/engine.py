"""The engine: applies scheduler actions to real tenants, one at a time.

Every change of the scheduler goes through :meth:`Engine.apply`, under one
lock, so that a poll, a control command and a reload never interleave.

Carrying the actions out blocks (a freeze waits for the cgroup to report
frozen; a checkpoint of 47 GiB takes half a minute), so it happens off the event
loop, in two lanes:

* a **gate** of a tenant with nothing queued runs at once, inside
  :meth:`Engine.apply`, on a thread of its own: stopping someone is always safe
  and never waits behind a swap;
* everything else (swaps, ungates, forgetting a tenant that left) is queued in
  batches, one per event, and carried out by workers on other threads while the
  loop keeps polling, applying activity and answering ``kiwictl`` (status shows
  a swap in progress, :attr:`Engine.swaps`). A worker per GPU: batches on
  different GPUs run at once (a 30-second swap on GPU 0 does not delay a
  hand-over on GPU 1); batches that share a GPU run in the order they were made,
  so a tenant's own actions never overtake each other.

What the worker did goes back to the scheduler as events: ``SwapFinished`` (a
failure changes the plan: the rotation goes on without that tenant) and
``Ungated`` (a holder whose memory had to move starts its quantum when it is
let go, not when it was granted).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from kiwid.adapters import procs
from kiwid.core.events import (
    Action,
    ActivitySeen,
    Event,
    Gate,
    SwapFinished,
    SwapIn,
    SwapOut,
    TenantDetached,
    Tick,
    Ungate,
    Ungated,
)
from kiwid.core.ledger import LedgerView
from kiwid.core.model import TenantState
from kiwid.core.scheduler import Scheduler, Transition
from kiwid.core.states import Trigger
from kiwid.daemon.gates import GateError, TenantGate
from kiwid.daemon.state import GatedRecord, StateFile
from kiwid.daemon.swap import SwapError, Swapper, restore_record
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


@dataclass(frozen=True)
class _Forget:
    """A tenant left: ungate and drop what may remain of it (after its queued actions)."""

    tenant: str


_Job = Action | _Forget


@dataclass
class _Batch:
    """The queued actions of one event, and the GPUs they touch."""

    since: float
    jobs: list[_Job]
    gpus: frozenset[str]


@dataclass
class SwapProgress:
    """A swap being carried out (for status: what, how big, since when)."""

    tenant: str
    direction: str
    """``"out"`` (to host RAM) or ``"in"`` (back to the GPU)."""
    bytes: int
    started: float
    gpus: frozenset[str]
    expected_rate: float | None
    """Bytes per second of the last swap in this direction (``None``: first one)."""


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
        *,
        swapper: Swapper | None = None,
        host_memory: Callable[[], int] | None = None,
        host_floor_bytes: int = 0,
    ) -> None:
        """Wire the parts; nothing runs until :meth:`apply`.

        ``swapper`` moves memory (``None``: swapping unavailable, every swap the
        scheduler asks for fails); ``host_memory`` reads the available host RAM,
        below ``host_floor_bytes`` of which no swap-out goes.
        """
        self.scheduler = scheduler
        self.tracker = tracker
        self.gate = gate
        self.state = state
        self._clock = clock
        self.swapper = swapper
        self._host_memory = host_memory
        self.host_floor_bytes = host_floor_bytes
        self.swaps: dict[str, SwapProgress] = {}
        """Swaps in progress, by tenant (read by status while the loop is free)."""
        self.swap_refusals: dict[str, str] = {}
        """Tenants whose last swap could not be done, and why (e.g. the host floor)."""
        self._rates: dict[str, float] = {}
        self._lock = asyncio.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kiwid-work")
        self._fast = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiwid-gate")
        self._jobs: list[_Batch] = []  # queued, not started, oldest first
        self._running: dict[asyncio.Task[None], _Batch] = {}
        self._pending: dict[str, int] = {}  # queued or running jobs per tenant
        self._stopping = False
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
                if not actions and not isinstance(event, TenantDetached):
                    continue  # the poll's usual event: nothing to carry out
                batch: list[_Job] = []
                if isinstance(event, TenantDetached):
                    batch.append(_Forget(event.tenant))
                for action in actions:
                    tenant = action.tenant
                    if (
                        isinstance(action, Gate)
                        and not self._pending.get(tenant)
                        and all(job.tenant != tenant for job in batch)
                    ):
                        await self._act(action, self._fast)
                    else:
                        batch.append(action)
                if batch:
                    self._enqueue(now, batch)

    def _enqueue(self, since: float, jobs: list[_Job]) -> None:
        gpus: set[str] = set()
        for job in jobs:
            self._pending[job.tenant] = self._pending.get(job.tenant, 0) + 1
            gpus |= self._gpus_of(job.tenant)
        if self._stopping:
            return
        self._jobs.append(_Batch(since, jobs, frozenset(gpus or {""})))
        self._dispatch()

    def _gpus_of(self, tenant: str) -> frozenset[str]:
        info = self.tracker.tenants.get(tenant)
        if info is None:
            gone = self._departed.get(tenant)
            info = gone.info if gone else None
        return info.gpus if info else frozenset()

    def _dispatch(self) -> None:
        """Start every queued batch whose GPUs no earlier batch still works on."""
        busy: set[str] = set()
        for running in self._running.values():
            busy |= running.gpus
        loop = asyncio.get_running_loop()
        for batch in list(self._jobs):
            if not batch.gpus & busy:
                self._jobs.remove(batch)
                self._running[loop.create_task(self._work(batch))] = batch
            busy |= batch.gpus  # later batches on these GPUs wait for this one

    async def _work(self, batch: _Batch) -> None:
        """A worker: carry out one batch in order, reporting back as it goes."""
        stuck: set[str] = set()  # its swap-in failed: it stays gated
        try:
            for job in batch.jobs:
                try:
                    if not self._stopping:
                        await self._do(job, stuck)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug must not stop the rotation for good
                    log.exception("Carrying out %s failed", job)
                finally:
                    left = self._pending.get(job.tenant, 1) - 1
                    if left > 0:
                        self._pending[job.tenant] = left
                    else:
                        self._pending.pop(job.tenant, None)
            actions = [job for job in batch.jobs if not isinstance(job, _Forget)]
            if actions:
                self._record_handover(actions, self._clock() - batch.since)
            self.generation += 1
        finally:
            self._running = {t: b for t, b in self._running.items() if b is not batch}
            if self._jobs:
                self._dispatch()

    async def _do(self, job: _Job, stuck: set[str]) -> None:
        if isinstance(job, _Forget):
            await self._forget(job.tenant)
        elif isinstance(job, SwapOut | SwapIn):
            result = await self._swap(job)
            if not result.ok and isinstance(job, SwapIn):
                stuck.add(job.tenant)
            await self.apply([result])  # at once: the plan may change
        elif isinstance(job, Ungate) and job.tenant in stuck:
            log.debug("Not ungating %s: its memory could not come back", job.tenant)
        else:
            await self._act(job, self._pool)
            if isinstance(job, Ungate):
                await self.apply([Ungated(job.tenant)])

    async def idle(self) -> None:
        """Wait until every queued job is done."""
        while self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

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
        who = _who(info, change.tenant)
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
        """Ungate every tenant this daemon gated; return those that failed.

        Swapped tenants are restored first, after the resident ones are let go,
        as long as they fit; the others stay in host RAM, gated, and recorded
        (``kiwid recover`` or the next start brings them back).
        """
        failed: list[str] = []
        # Queued work is moot now that everyone is let go; work in progress (a
        # checkpoint on a thread) must end before its tenant is touched again.
        self._stopping = True
        self._jobs.clear()
        await self.idle()
        async with self._lock:
            records = sorted(self.state.records.values(), key=lambda r: bool(r.swapped))
            for record in records:
                if record.swapped and not await self._restore_for_exit(record):
                    failed.append(record.tenant)
                    continue
                if not await self._ungate(self.state.records.get(record.tenant, record)):
                    failed.append(record.tenant)
        return failed

    async def _restore_for_exit(self, record: GatedRecord) -> bool:
        if not any(map(procs.alive, record.pids)):  # gone: its host memory went with it
            self.state.drop(record.tenant)
            self.tracker.swapped.pop(record.tenant, None)
            return True
        swapper = self.swapper
        state_dir = self.state.path.parent

        def restore(_: object) -> None:
            if swapper is not None and swapper.method == record.swap_method:
                swapper.swap_in(record)
            else:
                restore_record(record, state_dir)

        try:
            await self._run(restore, None)
        except SwapError as err:
            log.warning(
                "Kept swapped: %s: its %d bytes stay in host RAM, gated (%s). "
                "`kiwid recover` restores it and lets it go once the GPU has room; "
                "the next kiwid start queues it again",
                record.tenant,
                sum((record.swapped or {}).values()),
                err,
            )
            return False
        self.state.put(replace(record, swapped=None, swap_method=None))
        self.tracker.swapped.pop(record.tenant, None)
        return True

    async def release(self, record: GatedRecord) -> bool:
        """Ungate one recorded tenant (one this daemon did not gate itself)."""
        async with self._lock:
            self.generation += 1
            return await self._ungate(record)

    def close(self) -> None:
        """Stop the worker threads (after :meth:`ungate_all`)."""
        self._pool.shutdown(wait=True)
        self._fast.shutdown(wait=True)

    async def _act(self, action: Action, pool: ThreadPoolExecutor) -> None:
        tenant = action.tenant
        if isinstance(action, Gate):
            info = self.tracker.tenants.get(tenant)
            if info is None:  # pragma: no cover - the core only acts on known tenants
                return
            name = info.identity.name
            try:
                await self._run(self._gate_sync, info, pool)
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

    async def _swap(self, action: SwapOut | SwapIn) -> SwapFinished:
        """Carry out one swap on the worker thread; say how it went."""
        tenant = action.tenant
        direction = "out" if isinstance(action, SwapOut) else "in"
        info = self.tracker.tenants.get(tenant)
        record = self.state.records.get(tenant)
        who = _who(info, tenant)
        failed = SwapFinished(tenant, direction, ok=False)
        if self.swapper is None or record is None or info is None:
            why = "swapping is unavailable" if self.swapper is None else "it is not gated"
            log.warning("Swap %s of %s not done: %s", direction, who, why)
            self.swap_refusals[tenant] = why
            return failed
        if direction == "in" and not record.swapped:
            # Its swap-out (queued before) failed: the memory never left.
            return SwapFinished(tenant, direction, ok=True)
        peak = self.scheduler.peak(tenant)
        if direction == "out":
            sizes = {g: info.footprint.get(g) or peak.get(g, 0) for g in info.gpus}
        else:
            sizes = dict(record.swapped or {g: peak.get(g, 0) for g in info.gpus})
        nbytes = sum(sizes.values())
        if direction == "out" and self._host_memory is not None:
            available = self._host_memory()
            if available - nbytes < self.host_floor_bytes:
                why = (
                    f"host RAM floor: {nbytes} bytes would leave {available - nbytes} of "
                    f"the {self.host_floor_bytes} bytes memory.host_floor_mib keeps available"
                )
                log.warning("Swap out of %s not done: %s; it stays on the GPU, gated", who, why)
                self.swap_refusals[tenant] = why
                return failed
        progress = SwapProgress(
            tenant, direction, nbytes, self._clock(), info.gpus, self._rates.get(direction)
        )
        self.swaps[tenant] = progress
        self.generation += 1
        swapper = self.swapper
        try:
            if direction == "out":
                swapped = replace(record, swapped=sizes, swap_method=swapper.method)
                self.state.put(swapped)  # write-ahead: recovery restores it if we die
                # Kept before it vanishes from the GPU's process list: a poll
                # taken meanwhile must not see it as gone.
                self.tracker.keep_swapped(info)
                try:
                    await self._run(lambda _: swapper.swap_out(swapped), None)
                except SwapError:
                    self.tracker.swapped.pop(tenant, None)
                    self.state.put(record)
                    raise
            else:
                await self._run(lambda _: swapper.swap_in(record), None)
                self.state.put(replace(record, swapped=None, swap_method=None))
                self.tracker.swapped.pop(tenant, None)
        except SwapError as err:
            log.error(
                "Swap failed: %s of %s: %s; it %s, gated; the rotation goes on",
                direction,
                who,
                err,
                "keeps its memory on the GPU" if direction == "out" else "stays in host RAM",
            )
            self.swap_refusals[tenant] = str(err)
            return failed
        finally:
            self.swaps.pop(tenant, None)
        seconds = self._clock() - progress.started
        if seconds > 0 and nbytes:
            self._rates[direction] = nbytes / seconds
        self.swap_refusals.pop(tenant, None)
        log.info(
            "Swapped %s %s: %d bytes in %.2f s (%.2f GB/s)",
            direction,
            who,
            nbytes,
            seconds,
            nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        )
        return SwapFinished(tenant, direction, ok=True, moved_bytes=nbytes, seconds=seconds)

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

    async def _run(
        self, fn: Callable[[object], None], arg: object, pool: ThreadPoolExecutor | None = None
    ) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(pool or self._pool, fn, arg)


def _who(info: TenantInfo | None, tenant: str) -> str:
    """A tenant as log lines name it: ``name (key)``, or the key alone."""
    name = info.identity.name if info else tenant
    return f"{name} ({tenant})" if name != tenant else tenant
