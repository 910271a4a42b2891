"""The engine: the scheduler's actions, carried out in order, off the event loop.

:meth:`Engine.apply` feeds events to the scheduler and queues the actions it
returns; it never waits. A runner carries the jobs out — on threads in the
daemon (:class:`~kiwid.daemon.engine.runner.ThreadRunner`), inline in tests —
in the order the executor allows
(:mod:`kiwid.daemon.engine.executor`), and each job's outcome goes back to the scheduler
through :meth:`Engine.finished` as events (``SwapFinished``, ``GateFailed``). So a
30-second checkpoint, a slow freeze or a stuck lock never holds up a poll, a
``kiwictl`` answer or the watchdog's ping, and nothing the scheduler decides is
ever carried out out of order.

Everything here runs on the loop's thread; only :meth:`Effects.carry_out
<kiwid.daemon.effects.Effects.carry_out>` runs elsewhere.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Protocol

from kiwid.core.events import (
    Action,
    ActivitySeen,
    Event,
    Released,
    SwapFinished,
    SwapOut,
    TenantDetached,
    TenantFaulted,
    Tick,
)
from kiwid.core.model import TenantState
from kiwid.core.residency import Residency
from kiwid.core.scheduler import Scheduler, Transition
from kiwid.core.states import Trigger
from kiwid.daemon.engine.deadlines import LOCKING, MAY_RUN, late
from kiwid.daemon.engine.effects import Effects
from kiwid.daemon.engine.executor import OPERATIONS, Executor, Job, Kind, Lanes
from kiwid.daemon.engine.records import Departed, Histogram, SwapProgress
from kiwid.daemon.tenants.tracker import TenantInfo, TenantTracker

log = logging.getLogger("kiwid.engine")

DEPARTED_GRACE_S = 300.0
"""How long a gone tenant's ledger stays in status and metrics (bounds label cardinality)."""


class Runner(Protocol):
    """Carries jobs out and reports each through :meth:`Engine.finished`."""

    def start(self, job: Job) -> None:
        """Begin ``job``; report it when done (now, or later on the loop's thread)."""
        ...


class EngineFailed(Exception):
    """The scheduler failed on an event (a bug): kiwid stops and lets every tenant go."""


class Engine:
    """Scheduler + tenant table + executor, kept consistent."""

    def __init__(
        self,
        scheduler: Scheduler,
        tracker: TenantTracker,
        effects: Effects,
        clock: Callable[[], float],
        *,
        lanes: Lanes | None = None,
        deadline_s: Callable[[Job, int], float] | None = None,
    ) -> None:
        """Wire the parts; jobs are started once a :attr:`runner` is set.

        ``deadline_s``: how long a job (and the bytes it moves) may take before its
        tenant is stuck (default: for ever).
        """
        self.scheduler = scheduler
        self.tracker = tracker
        self.effects = effects
        self.executor = Executor(lanes)
        self.runner: Runner | None = None
        self._clock = clock
        self.generation = 0
        """Bumped by every change (event, job done, reload), so that readers can cache."""
        self.handovers: dict[str, Histogram] = {}
        """Per GPU, from a grant to the moment the new holder runs (its stall)."""
        self.stopping = False
        """Set at shutdown: nothing new is started."""
        self._departed: dict[str, Departed] = {}
        self._started: dict[Job, float] = {}
        self._granted: dict[str, float] = {}  # tenant -> when it was granted, until let go
        self._rates: dict[str, float] = {}  # direction -> bytes/s of the last swap
        self._idle: list[Callable[[], None]] = []
        self.deadline_s: Callable[[Job, int], float] = deadline_s or (lambda job, nbytes: math.inf)
        self._due: dict[Job, float] = {}
        self._orphaned: set[Job] = set()  # running jobs of tenants that left since
        self.failed: Exception | None = None
        """What made the scheduler fail, once it did (a bug): nothing is applied since."""
        self.on_failure: Callable[[Exception], None] = lambda err: None
        """Told once the scheduler failed (the daemon stops)."""
        self.abandoned: dict[Job, float] = {}
        """Jobs that ran past their deadline and whose thread has not returned (a driver
        call that hangs), with when they started: their tenant is stuck, and a retry
        waits until they return."""

    # ------------------------------------------------------------ events in

    def apply(self, events: Iterable[Event]) -> None:
        """Feed ``events`` to the scheduler and queue the actions it returns.

        Raises:
            EngineFailed: the scheduler failed on one (a bug); :attr:`failed` says
                which, and nothing is applied any more: kiwid stops and lets every
                tenant go, rather than go on from tables a failure left half-done.
        """
        if self.failed is not None:
            raise EngineFailed(f"the engine failed before: {self.failed!r}")
        for event in events:
            try:
                self._apply_one(event)
            except Exception as err:
                self.failed = err
                self.stopping = True
                log.exception(
                    "The scheduler failed on %s; kiwid stops and lets go of every tenant", event
                )
                self.on_failure(err)
                raise EngineFailed(f"the scheduler failed on {event}: {err!r}") from err
        self._kick()

    def _apply_one(self, event: Event) -> None:
        """Apply one event: the scheduler, its log lines, the jobs it asks for."""
        now = self._clock()
        detached = isinstance(event, TenantDetached)
        if detached:
            self._depart(event.tenant, now)  # type: ignore[union-attr]
        actions = self.scheduler.handle(event, now)
        transitions = self.scheduler.drain_transitions()
        if actions or transitions or not isinstance(event, ActivitySeen):
            self.generation += 1
        for change in transitions:
            self._log_transition(change)
        for tenant, notice in self.scheduler.drain_notices():
            who = _who(self.tracker.tenants.get(tenant), tenant)
            log.warning("Swap out of %s not done: %s", who, notice)
        if detached:
            self._leave(event.tenant)  # type: ignore[union-attr]
            self._submit(None, event.tenant)  # type: ignore[union-attr]
        if isinstance(event, TenantFaulted | Released):
            self._stuck(event.tenant)
        for action in actions:
            self._submit(action, action.tenant)

    def _leave(self, tenant: str) -> None:
        """A tenant left: its queued jobs are moot, its running ones speak for nobody.

        A tenant may come back under the same key (a container restarted in the same
        cgroup); what a job of the one that left says must not be taken for it.
        """
        for job in self.executor.drop_queued_of(tenant, keep=()):
            log.debug("Not carrying out the %s of %s: it left", job.kind.value, tenant)
        running = {job for job in self._started if job.tenant == tenant}
        self._orphaned |= running | {job for job in self.abandoned if job.tenant == tenant}
        for job in running:  # no deadline: a call on processes that are gone hurts nobody
            self._due.pop(job, None)

    def _stuck(self, tenant: str) -> None:
        """What was queued for a tenant that just got stuck is moot (its undo is not)."""
        if self.scheduler.tenant_state(tenant) is not TenantState.STUCK:
            return
        undone: list[Event] = []
        for job in self.executor.drop_queued_of(tenant):
            log.info("Not carrying out the %s of %s: it is stuck", job.kind.value, tenant)
            if job.kind in (Kind.SWAP_OUT, Kind.SWAP_IN):  # its memory did not move
                direction = "out" if job.kind is Kind.SWAP_OUT else "in"
                undone.append(SwapFinished(tenant, direction, ok=False, reason="it is stuck"))
        self.apply(undone)

    def tick(self) -> None:
        """Let the scheduler act on deadlines that have passed."""
        self.apply([Tick()])

    # ------------------------------------------------------------ jobs

    def _submit(self, action: Action | None, tenant: str) -> None:
        info = self.tracker.tenants.get(tenant)
        if info is None and action is None:
            gone = self._departed.get(tenant)
            info = gone.info if gone else None
        gpus = info.gpus if info else frozenset()
        sizes = dict(action.sizes) if isinstance(action, SwapOut) else {}
        self.executor.job(action, tenant, gpus, info=info, sizes=sizes)

    def follow(self, tenant: str, pids: dict[int, int]) -> None:
        """Lock the processes (pid -> start time) a gated tenant started since its gate.

        Where the scheduler has the tenant's memory in host RAM, theirs goes there
        too (the job's sizes: what the card holds of the tenant now, theirs).
        """
        info = self.tracker.tenants.get(tenant)
        if info is None or self.executor.busy(tenant):
            return  # gone, or a job of it runs: the next poll looks again
        sizes = None
        if self.scheduler.residency(tenant) is Residency.HOST:
            sizes = {gpu: info.footprint.get(gpu) or 0 for gpu in info.gpus}
        self.executor.job(Kind.FOLLOW, tenant, info.gpus, info=info, pids=pids, sizes=sizes)
        self._kick()

    def _kick(self) -> None:
        if self.runner is None or self.stopping:
            return
        for job in self.executor.startable():
            # kiwid's word after every job asked before it (a release, say)
            if job.kind is Kind.SETTLE and self.scheduler.gated(job.tenant):
                job.hold.set()
            if job.kind is Kind.FENCE and self._holds(job.tenant):
                job.hold.set()
            now = self._clock()
            self._started[job] = now
            nbytes = job.nbytes or sum(self.scheduler.peak(job.tenant).values())
            self._due[job] = now + self.deadline_s(job, nbytes)
            self.runner.start(job)

    # ------------------------------------------------------------ deadlines

    def next_deadline(self) -> float | None:
        """When the first running job runs past its deadline (``None``: no job runs)."""
        return min(self._due.values(), default=None)

    def expire(self) -> None:
        """Give up on the jobs past their deadline: their tenants are stuck.

        Their threads go on in the driver call that hangs; when one returns, what
        it says is logged and no more (:meth:`finished`).
        """
        now = self._clock()
        for job in [j for j, due in self._due.items() if due <= now]:
            del self._due[job]
            started = self._started.pop(job, now)
            self.executor.finish(job)
            self.abandoned[job] = started
            job.given_up.set()
            self.generation += 1
            log.error(
                "The %s of %s ran past its deadline (%.0f s; gpu.driver_timeout): its "
                "tenant is stuck, the others rotate on",
                job.kind.value,
                job.tenant,
                now - started,
            )
            events = late(job, now - started)
            self.apply(events)
            # It may run: fence it, if kiwid holds it (stuck, or gated: a follow's
            # fault is moot for a tenant gated already, its new process is not);
            # never one released or let go since, nor by the time the fence starts.
            if job.kind in MAY_RUN and events and self._holds(job.tenant):
                info = job.info or self.tracker.tenants.get(job.tenant)
                fault = events[0] if isinstance(events[0], TenantFaulted) else None
                self.executor.job(Kind.FENCE, job.tenant, job.gpus, info=info, fault=fault)
        self._kick()

    def _holds(self, tenant: str) -> bool:
        """Whether kiwid holds ``tenant``: stuck, or gated (not released, nor let go)."""
        stuck = self.scheduler.tenant_state(tenant) is TenantState.STUCK
        return stuck or self.scheduler.gated(tenant)

    def _returned_late(self, job: Job, started: float, events: list[Event]) -> None:
        """A call that ran past its deadline returned: what it says is old news.

        What it did is not: an ungate (or release) that went through late may have
        let a tenant run that kiwid holds gated, so it counts as running again.
        """
        seconds = self._clock() - started
        log.warning(
            "The %s of %s that ran past its deadline returned after %.1f s (%s)",
            job.kind.value,
            job.tenant,
            seconds,
            ", ".join(type(e).__name__ for e in events) or "nothing to say",
        )
        self.generation += 1
        if job in self._orphaned:  # its tenant left meanwhile
            self._orphaned.discard(job)
            return
        if job.kind in LOCKING:  # a lock in flight may have taken after kiwid gave up
            info = self.tracker.tenants.get(job.tenant) or job.info
            self.executor.job(Kind.SETTLE, job.tenant, job.gpus, info=info)
            self._kick()
        undid = job.kind is Kind.SETTLE and not job.hold.is_set()  # it unlocked
        let_go = job.kind in (Kind.UNGATE, Kind.RELEASE) or undid
        if let_go and self.scheduler.gated(job.tenant):
            reason = (
                f"its {job.kind.value}, {seconds:.0f} s late, may have let it run: kiwid "
                "holds it gated again"
            )
            operation = OPERATIONS[job.kind]  # (it answers no job: a release asked since runs)
            fault = TenantFaulted(job.tenant, operation, reason, contained=False, answers=False)
            self.apply([fault])

    def hung(self, tenant: str) -> tuple[Job, float] | None:
        """A job of ``tenant`` past its deadline whose call has not returned, and its start."""
        return next(((j, s) for j, s in self.abandoned.items() if j.tenant == tenant), None)

    def finished(self, job: Job, events: Iterable[Event]) -> None:
        """A runner is done with ``job``; ``events`` are what it found out."""
        started_late = self.abandoned.pop(job, None)
        if started_late is not None:
            self._returned_late(job, started_late, list(events))
            return
        self._due.pop(job, None)
        self.executor.finish(job)
        started = self._started.pop(job, None)
        now = self._clock()
        if job in self._orphaned:  # its tenant left while it ran
            self._orphaned.discard(job)
            events = [e for e in events if not hasattr(e, "tenant")]
        swap = job.kind in (Kind.SWAP_OUT, Kind.SWAP_IN)
        if swap and started is not None and job.nbytes and now > started:
            self._rates[job.kind.value] = job.nbytes / (now - started)
        if job.kind is Kind.UNGATE:
            granted = self._granted.pop(job.tenant, None)
            if granted is not None:
                for gpu in job.gpus:
                    self.handovers.setdefault(gpu, Histogram()).observe(now - granted)
        self.generation += 1
        self.apply(events)
        if not self.executor.running:
            waiting, self._idle = self._idle, []
            for wake in waiting:
                wake()

    def on_idle(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (once) when the last running job finishes."""
        self._idle.append(callback)

    @property
    def swaps(self) -> dict[str, SwapProgress]:
        """Swaps in progress, by tenant (derived from the running jobs)."""
        out: dict[str, SwapProgress] = {}
        for job, started in self._started.items():
            if job.kind in (Kind.SWAP_OUT, Kind.SWAP_IN):
                direction = "out" if job.kind is Kind.SWAP_OUT else "in"
                nbytes = job.nbytes or sum(self.scheduler.peak(job.tenant).values())
                rate = self._rates.get(job.kind.value)
                out[job.tenant] = SwapProgress(
                    job.tenant, direction, nbytes, started, job.gpus, rate
                )
        return out

    # ------------------------------------------------------------ departures

    def departed(self, now: float) -> list[Departed]:
        """Tenants gone less than DEPARTED_GRACE_S ago (older ones are dropped)."""
        for key in [k for k, d in self._departed.items() if now - d.gone_at > DEPARTED_GRACE_S]:
            del self._departed[key]
        return list(self._departed.values())

    def _depart(self, tenant: str, now: float) -> None:
        ledger = self.scheduler.ledger(tenant, now)
        info = self.tracker.gone.pop(tenant, None)
        self._granted.pop(tenant, None)
        if ledger is not None:
            self._departed[tenant] = Departed(tenant, info, ledger, now)
        name = info.identity.name if info else tenant
        log.info("Gone: %s (%s) left the GPU", name, tenant)

    def _log_transition(self, change: Transition) -> None:
        info = self.tracker.tenants.get(change.tenant)
        who = _who(info, change.tenant)
        gpus = ",".join(sorted(info.gpus)) if info else "?"
        trigger = change.trigger
        if change.new is TenantState.HOLDER:
            if change.old is TenantState.WAITING:  # gated: timed until it is let go
                self._granted[change.tenant] = change.at
            log.info("Grant: %s holds GPU %s (%s)", who, gpus, trigger.value)
        elif trigger is Trigger.PREEMPTED:
            log.info("Preempt: %s yields GPU %s: quantum over and someone waits", who, gpus)
        elif trigger is Trigger.IDLE_TIMEOUT and change.old is TenantState.HOLDER:
            log.info("Early release: %s yields GPU %s: no GPU work for idle_release", who, gpus)
        elif change.new is TenantState.WAITING:
            self._granted.pop(change.tenant, None)
            log.info("Queue: %s waits for GPU %s (%s)", who, gpus, trigger.value)
        else:
            log.debug("%s: %s -> %s (%s)", who, change.old.value, change.new.value, trigger.value)


def _who(info: TenantInfo | None, tenant: str) -> str:
    """A tenant as log lines name it: ``name (key)``, or the key alone."""
    name = info.identity.name if info else tenant
    return f"{name} ({tenant})" if name != tenant else tenant
