"""The engine: the scheduler's actions, carried out in order, off the event loop.

:meth:`Engine.apply` feeds events to the scheduler and queues the actions it
returns; it never waits. A runner carries the jobs out — on threads in the
daemon (:class:`~kiwid.daemon.engine.runner.ThreadRunner`), inline in tests —
in the order the executor allows (:mod:`kiwid.daemon.engine.executor`: one
serial lane per tenant), and each job's outcome goes back to the scheduler
through :meth:`Engine.finished` as events (``Gated``, ``SwapFinished``,
``TenantFaulted``...), each echoing the epoch its action was asked in. So a
30-second checkpoint, a slow freeze or a stuck lock never holds up a poll, a
``kiwictl`` answer or the watchdog's ping, and nothing the scheduler decides is
ever carried out out of order.

A job that runs past its deadline is not given up on: its call goes on and keeps
its tenant's lane; the scheduler hears ``JobOverdue`` (the tenant is stuck, and
fenced where the call may leave it running). When the call returns, what it says
is of an epoch the tenant left: the scheduler asks a converge, which reads the
truth and drives it to what is wanted then. The engine decides nothing of its own.

Everything here runs on the loop's thread; only :meth:`Effects.carry_out
<kiwid.daemon.engine.effects.Effects.carry_out>` runs elsewhere.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Protocol

from kiwid.core.actions import Action, Converge, Fence
from kiwid.core.events import ActivitySeen, Event, TenantDetached, Tick
from kiwid.core.model import TenantState
from kiwid.core.scheduler import Scheduler, Transition
from kiwid.core.states import Trigger
from kiwid.daemon.engine.deadlines import overdue
from kiwid.daemon.engine.effects import Effects
from kiwid.daemon.engine.executor import TIMELESS, Executor, Job, Kind, Lanes
from kiwid.daemon.engine.records import Departed, Histogram, SwapProgress
from kiwid.daemon.tenants.tracker import TenantInfo, TenantTracker

log = logging.getLogger("kiwid.engine")

DEPARTED_GRACE_S = 300.0
"""How long a gone tenant's ledger stays in status and metrics (bounds label cardinality)."""
_DEDUPED = (Converge, Fence)
"""Actions that read what is wanted as they start: one queued of a tenant is enough."""


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
        self.deadline_s: Callable[[Job, int], float] = deadline_s or (lambda job, nbytes: math.inf)
        self.failed: Exception | None = None
        """What made the scheduler fail, once it did (a bug): nothing is applied since."""
        self.on_failure: Callable[[Exception], None] = lambda err: None
        """Told once the scheduler failed (the daemon stops)."""
        self._departed: dict[str, Departed] = {}
        self._granted: dict[str, float] = {}  # tenant -> when it was granted, until let go
        self._rates: dict[str, float] = {}  # direction -> bytes/s of the last swap
        self._idle: list[Callable[[], None]] = []

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
        if isinstance(event, TenantDetached):
            self._depart(event.tenant, now)
        epoch = getattr(event, "epoch", None)
        tenant = getattr(event, "tenant", None)
        if epoch is not None and tenant is not None and epoch != self.scheduler.epoch(tenant):
            log.debug("Old news of %s (epoch %d): %s", tenant, epoch, type(event).__name__)
        actions = self.scheduler.handle(event, now)
        transitions = self.scheduler.drain_transitions()
        if actions or transitions or not isinstance(event, ActivitySeen):
            self.generation += 1
        for change in transitions:
            self._log_transition(change)
        for key, notice in self.scheduler.drain_notices():
            who = _who(self.tracker.tenants.get(key), key)
            log.warning("Swap out of %s not done: %s", who, notice)
        if isinstance(event, TenantDetached):
            self._leave(event.tenant)
        for action in actions:
            self._submit(action)

    def _leave(self, tenant: str) -> None:
        """A tenant left: its queued jobs are moot; a forget undoes what may remain."""
        for job in self.executor.drop_queued_of(tenant):
            log.debug("Not carrying out the %s of %s: it left", job.kind.value, tenant)
        self.executor.never_due(tenant)  # a call on processes that are gone hurts nobody
        gone = self._departed.get(tenant)
        info = gone.info if gone else None
        self.executor.job(Kind.FORGET, tenant, info.gpus if info else frozenset(), info=info)

    def tick(self) -> None:
        """Let the scheduler act on deadlines that have passed."""
        self.apply([Tick()])

    # ------------------------------------------------------------ jobs

    def _submit(self, action: Action) -> None:
        tenant = action.tenant
        if isinstance(action, _DEDUPED):
            kind = Kind.CONVERGE if isinstance(action, Converge) else Kind.FENCE
            if self.executor.pending(tenant, kind, started=False):
                return  # one queued reads what is wanted as it starts: enough
        info = self.tracker.tenants.get(tenant)
        gpus = info.gpus if info else frozenset()
        sizes = dict(action.sizes) if hasattr(action, "sizes") else {}
        self.executor.job(action, tenant, gpus, info=info, sizes=sizes)

    def follow(self, tenant: str, pids: dict[int, int]) -> None:
        """Look at the processes (pid -> start time) of a tenant the core holds gated.

        Under the CUDA lock, each poll asks this for every gated tenant: the follow
        locks those that run (beside the tenant's lane), and says those on the card
        if its memory is in host RAM. One at a time per tenant.
        """
        want = self.scheduler.want(tenant)
        info = self.tracker.tenants.get(tenant)
        if want is None or info is None or not want.gated:
            return
        if self.executor.pending(tenant, Kind.FOLLOW):
            return  # the last one has not ended: the next poll asks again
        self.executor.job(
            Kind.FOLLOW, tenant, info.gpus, epoch=want.epoch, info=info, pids=pids, want=want
        )
        self._kick()

    def _followable(self, job: Job) -> dict[int, int]:
        """The processes a follow starting now may ask the driver about.

        The driver serialises the calls on one process, and a call waits there as
        long as the operation before it lasts: on an H200 a state asked while the
        process was being checkpointed returned with the checkpoint, tens of seconds
        later. While the tenant's lane has a job, that job works on the processes its
        record names (it locks, checkpoints or restores them): the follow leaves them
        to it and looks at the others, the processes kiwid does not hold (new ones,
        and those with no CUDA context yet). With the lane empty it looks at all.
        """
        if not self.executor.lane_busy(job.tenant):
            return job.pids
        record = self.effects.state.records.get(job.tenant)
        held = set(record.pids) if record is not None else set()
        return {pid: start for pid, start in job.pids.items() if pid not in held}

    def _moot(self, job: Job) -> bool:
        """Whether ``job`` was asked in an epoch its tenant has left (rule 5)."""
        return job.kind not in TIMELESS and job.epoch != self.scheduler.epoch(job.tenant)

    def _kick(self) -> None:
        if self.runner is None or self.stopping:
            return
        for job in self.executor.startable(self._moot):
            if job.kind is Kind.CONVERGE:  # level-triggered: what is wanted now
                job.want = self.scheduler.want(job.tenant)
                job.info = self.tracker.tenants.get(job.tenant) or job.info
                job.epoch = job.want.epoch if job.want is not None else job.epoch
            if job.kind is Kind.FOLLOW:
                job.pids = self._followable(job)
            now = self._clock()
            nbytes = job.nbytes or sum(self.scheduler.peak(job.tenant).values())
            self.executor.start(job, now, now + self.deadline_s(job, nbytes))
            self.runner.start(job)

    # ------------------------------------------------------------ deadlines

    def next_deadline(self) -> float | None:
        """When the first running job runs past its deadline (``None``: no job can)."""
        return self.executor.next_due()

    def expire(self) -> None:
        """Jobs past their deadline: their tenants are stuck, their lanes kept.

        Their threads go on in the driver call that hangs; when one returns, what
        it says is old news to the scheduler (:meth:`finished`).
        """
        now = self._clock()
        for job, run in self.executor.overdue(now):
            self.generation += 1
            log.error(
                "The %s of %s ran past its deadline (%.0f s; gpu.driver_timeout): its "
                "tenant is stuck and its next jobs wait for the call; the others rotate on",
                job.kind.value,
                job.tenant,
                now - run.started,
            )
            if job.tenant in self.tracker.tenants:
                self.apply(overdue(job, now - run.started))
        self._kick()

    def hung(self, tenant: str) -> tuple[Job, float] | None:
        """A job of ``tenant`` past its deadline whose call has not returned, and its start."""
        return self.executor.hung(tenant)

    def finished(self, job: Job, events: Iterable[Event]) -> None:
        """A runner is done with ``job``; ``events`` are what it found out."""
        run = self.executor.finish(job)
        now = self._clock()
        if run is not None and run.overdue:
            log.warning(
                "The %s of %s that ran past its deadline returned after %.1f s",
                job.kind.value,
                job.tenant,
                now - run.started,
            )
        swap = job.kind in (Kind.SWAP_OUT, Kind.SWAP_IN)
        if swap and run is not None and job.nbytes and now > run.started:
            self._rates[job.kind.value] = job.nbytes / (now - run.started)
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
        for job in self.executor.running:
            run = self.executor.run_of(job)
            if run is not None and job.kind in (Kind.SWAP_OUT, Kind.SWAP_IN):
                direction = "out" if job.kind is Kind.SWAP_OUT else "in"
                nbytes = job.nbytes or sum(self.scheduler.peak(job.tenant).values())
                rate = self._rates.get(job.kind.value)
                out[job.tenant] = SwapProgress(
                    job.tenant, direction, nbytes, run.started, job.gpus, rate
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
