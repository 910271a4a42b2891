"""In which order the scheduler's actions may be carried out, and which at once.

Pure bookkeeping (no threads, no I/O): the engine submits jobs as the scheduler
asks for them and starts whatever :meth:`Executor.startable` hands out; a runner
carries each out (on a thread in the daemon, inline in tests) and reports it
with :meth:`Executor.finish`. The rules:

1. **One serial lane per tenant.** A tenant's jobs run one at a time, in the
   order they were asked for, also past a deadline: a job whose driver call hangs
   (overdue) keeps its tenant's lane until the call returns. Its memory never
   moves while it is being gated, and never two ways at once.
2. **Two jobs run beside the lane**, each one at a time per tenant: a *follow*,
   which locks the processes of a gated tenant that run (it must not wait behind
   a 30-second checkpoint of the others, and a lock of one process does not
   conflict with a checkpoint of another), but never beside a job that may let
   the tenant go (an ungate, a release, a converge, a forget) and never before one
   asked earlier; and a *fence*, the cgroup freezer, which never calls the driver
   and is the one thing that runs beside a hung driver call.
3. An ungate waits for every gate asked before it on a GPU it shares (unless that
   gate is overdue: its tenant is stuck and fenced meanwhile): the previous
   holder is stopped before the next one runs.
4. Swaps go through lanes per GPU: at most ``lanes.out`` swap-outs and
   ``lanes.in_`` swap-ins at once on one GPU, the two directions side by side (the
   host link is full duplex), or, with ``lanes.shared``, one lane for both. Within
   a lane, swaps start in the order they were asked for. An overdue swap leaves its
   GPU's lane (a hung call moves no bytes).
5. A job the scheduler asked for in an epoch the tenant has left since is moot
   (``moot``): it is dropped when its turn comes, never carried out.
6. A follow is not overdue before the lane job beside it: the driver serialises
   the calls on one process, and a follow's call may wait there behind the lane
   job's (a state asked during a checkpoint of its process returned with the
   checkpoint on an H200). Overdue, it would make its tenant stuck and fence it,
   and the freezer stalls the very checkpoint it waits for.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kiwid.core.actions import (
    Action,
    Converge,
    Fence,
    Gate,
    Release,
    Retry,
    SwapIn,
    SwapOut,
    Ungate,
    Want,
)
from kiwid.daemon.tenants.tracker import TenantInfo


class Kind(enum.StrEnum):
    """What a job does."""

    GATE = "gate"
    UNGATE = "ungate"
    SWAP_OUT = "swap-out"
    SWAP_IN = "swap-in"
    RETRY = "retry"
    """Mend a stuck tenant (an operator asked): gate it whole, find its memory."""
    RELEASE = "release"
    """Let a stuck tenant run on an operator's word: restore, unlock, thaw."""
    CONVERGE = "converge"
    """Read the truth of a tenant and drive it to what the core wants as it starts."""
    FORGET = "forget"
    """The tenant left: undo what may remain of its gate, drop its record."""
    FOLLOW = "follow"
    """Beside the lane: lock the processes of a lock-gated tenant that run."""
    FENCE = "fence"
    """Beside the lane: freeze a tenant whose driver call hangs and may let it run."""


_KINDS: dict[type, Kind] = {
    Gate: Kind.GATE,
    Ungate: Kind.UNGATE,
    SwapOut: Kind.SWAP_OUT,
    SwapIn: Kind.SWAP_IN,
    Retry: Kind.RETRY,
    Release: Kind.RELEASE,
    Converge: Kind.CONVERGE,
    Fence: Kind.FENCE,
}
SIDE = frozenset({Kind.FOLLOW, Kind.FENCE})
"""Jobs that run beside the tenant's lane (rule 2)."""
LETS_GO = frozenset({Kind.UNGATE, Kind.RELEASE, Kind.CONVERGE, Kind.FORGET})
"""Lane jobs that may unlock the tenant: no follow runs beside them or after them."""
TIMELESS = frozenset({Kind.CONVERGE, Kind.FORGET})
"""Jobs that are never moot: a converge reads what is wanted as it starts; a forget
undoes what a tenant that left may have left behind."""
OPERATIONS = {
    Kind.GATE: "gate",
    Kind.UNGATE: "ungate",
    Kind.FOLLOW: "gate",
    Kind.FENCE: "gate",
    Kind.CONVERGE: "converge",
    Kind.SWAP_OUT: "swap-out",
    Kind.SWAP_IN: "swap-in",
    Kind.RETRY: "retry",
    Kind.RELEASE: "release",
}
"""The operation a job's fault names (a follow and a fence belong to the gate)."""


@dataclass(frozen=True)
class Lanes:
    """How many swaps may run at once on one GPU."""

    out: int = 1
    """Swap-outs (``memory.checkpoint_lanes``)."""
    in_: int = 1
    shared: bool = False
    """One lane for both directions (``out`` swaps of either kind at once)."""


@dataclass(eq=False)
class Job:
    """One action to carry out, with what it needs to know of its tenant (each job unique)."""

    seq: int
    tenant: str
    kind: Kind
    gpus: frozenset[str]
    epoch: int = 0
    """The tenant's epoch it was asked in (a converge's: the want's, as it starts)."""
    info: TenantInfo | None = None
    """The tenant as the tracker knew it when the job was asked for."""
    nbytes: int = 0
    """For a swap: the bytes it moves (per the scheduler's accounting)."""
    sizes: dict[str, int] = field(default_factory=dict)
    """For a swap-out: bytes per GPU (what the state file records)."""
    pids: dict[int, int] = field(default_factory=dict)
    """For a follow: the tenant's processes to look at (pid -> start time)."""
    want: Want | None = None
    """For a converge: what the core wants, read as it starts; for a follow, as asked."""


@dataclass
class Run:
    """A job handed out: when it started, when it is overdue, whether it is."""

    started: float
    due: float
    overdue: bool = False
    """It ran past ``due``: its call hangs; its tenant is stuck, its lane kept."""


class Executor:
    """Hands out jobs in an order that keeps each tenant's and each GPU's rules."""

    def __init__(self, lanes: Lanes | None = None) -> None:
        """Start empty with ``lanes`` per GPU (default: one swap each way at a time)."""
        self.lanes = lanes or Lanes()
        self._seq = itertools.count()
        self._queued: list[Job] = []
        self._running: dict[Job, Run] = {}

    def job(
        self,
        action: Action | Kind,
        tenant: str,
        gpus: frozenset[str],
        *,
        epoch: int | None = None,
        info: TenantInfo | None = None,
        sizes: dict[str, int] | None = None,
        pids: dict[int, int] | None = None,
        want: Want | None = None,
    ) -> Job:
        """Queue the job that carries out ``action`` (or a job of the shell's own kind)."""
        if isinstance(action, Kind):
            kind = action
        else:
            kind = _KINDS[type(action)]
            epoch = action.epoch if epoch is None else epoch
        sizes = dict(sizes or {})
        job = Job(
            next(self._seq),
            tenant,
            kind,
            gpus,
            epoch or 0,
            info,
            sum(sizes.values()),
            sizes,
            dict(pids or {}),
            want,
        )
        self._queued.append(job)
        return job

    @property
    def running(self) -> frozenset[Job]:
        """The jobs handed out and not finished (overdue ones too)."""
        return frozenset(self._running)

    @property
    def queued(self) -> tuple[Job, ...]:
        """The jobs not handed out yet, oldest first."""
        return tuple(self._queued)

    def run_of(self, job: Job) -> Run | None:
        """How ``job`` runs (``None``: it does not)."""
        return self._running.get(job)

    def busy(self, tenant: str) -> bool:
        """Whether ``tenant`` has a job queued or running."""
        return any(j.tenant == tenant for j in itertools.chain(self._queued, self._running))

    def lane_busy(self, tenant: str) -> bool:
        """Whether ``tenant``'s lane has a job queued or running (a follow or fence aside)."""
        jobs = itertools.chain(self._queued, self._running)
        return any(j.tenant == tenant and j.kind not in SIDE for j in jobs)

    def pending(self, tenant: str, kind: Kind, *, started: bool = True) -> bool:
        """Whether a ``kind`` job of ``tenant`` is queued (or, with ``started``, running)."""
        jobs = itertools.chain(self._queued, self._running if started else ())
        return any(j.tenant == tenant and j.kind is kind for j in jobs)

    def hung(self, tenant: str) -> tuple[Job, float] | None:
        """``tenant``'s lane job that is overdue (its call hangs), and when it started."""
        for job, run in self._running.items():
            if job.tenant == tenant and run.overdue and job.kind not in SIDE:
                return job, run.started
        return None

    def startable(self, moot: Callable[[Job], bool] = lambda job: False) -> list[Job]:
        """Hand out every queued job that may start now: they count as running.

        ``moot`` jobs are dropped as their turn comes (rule 5). :meth:`start` says
        when each began and when it is due (until then: never).
        """
        lane_busy = {j.tenant for j in self._running if j.kind not in SIDE}
        lets_go = {j.tenant for j in self._running if j.kind in LETS_GO}
        side_busy = {(j.tenant, j.kind) for j in self._running if j.kind in SIDE}
        gating = [j for j, run in self._running.items() if j.kind is Kind.GATE and not run.overdue]
        in_lane: dict[tuple[str, str], int] = {}
        for j, run in self._running.items():
            if not run.overdue:
                for key in self._lane_keys(j):
                    in_lane[key] = in_lane.get(key, 0) + 1
        waiting_lanes: set[tuple[str, str]] = set()  # a lane whose head is still queued
        started: list[Job] = []
        for job in list(self._queued):
            if job.kind not in TIMELESS and moot(job):
                self._queued.remove(job)
                continue
            if job.kind in SIDE:
                ok = (job.tenant, job.kind) not in side_busy
                if job.kind is Kind.FOLLOW:
                    ok = ok and job.tenant not in lets_go
                side_busy.add((job.tenant, job.kind))
            else:
                ok = job.tenant not in lane_busy
                if job.kind in LETS_GO:
                    ok = ok and (job.tenant, Kind.FOLLOW) not in side_busy
                    lets_go.add(job.tenant)  # a follow asked after it waits for it
                if ok and job.kind is Kind.UNGATE:
                    ok = not any(g.gpus & job.gpus and g.seq < job.seq for g in gating)
                lane_busy.add(job.tenant)
                if job.kind is Kind.GATE:
                    gating.append(job)
            keys = self._lane_keys(job)
            if keys:
                ok = ok and all(
                    key not in waiting_lanes and in_lane.get(key, 0) < self._capacity(key)
                    for key in keys
                )
                if not ok:
                    waiting_lanes.update(keys)  # later swaps in its lanes wait behind it
            if not ok:
                continue
            for key in keys:
                in_lane[key] = in_lane.get(key, 0) + 1
            self._queued.remove(job)
            self._running[job] = Run(float("nan"), float("inf"))
            started.append(job)
        return started

    def start(self, job: Job, now: float, due: float) -> None:
        """``job``, handed out by :meth:`startable`, runs from ``now``; overdue at ``due``.

        A follow is not overdue before the lane job of its tenant that runs beside it
        (rule 6): the driver serialises the calls on one process, and the follow's may
        wait there behind that job's (a checkpoint of tens of seconds on an H200).
        """
        beside = [
            (j, r)
            for j, r in self._running.items()
            if j.tenant == job.tenant and j is not job and not r.overdue
        ]
        if job.kind is Kind.FOLLOW:
            due = max([due, *(r.due for j, r in beside if j.kind not in SIDE)])
        elif job.kind not in SIDE:
            for j, r in beside:
                if j.kind is Kind.FOLLOW:
                    r.due = max(r.due, due)
        self._running[job] = Run(now, due)

    def finish(self, job: Job) -> Run | None:
        """A job handed out is done (whatever its outcome); how it ran."""
        return self._running.pop(job, None)

    def next_due(self) -> float | None:
        """When the first running job runs past its deadline (``None``: none can)."""
        return min((r.due for r in self._running.values() if not r.overdue), default=None)

    def overdue(self, now: float) -> list[tuple[Job, Run]]:
        """The jobs that ran past their deadline by ``now`` (each once): they stay running."""
        late = [(j, r) for j, r in self._running.items() if not r.overdue and r.due <= now]
        for _, run in late:
            run.overdue = True
        return late

    def never_due(self, tenant: str) -> None:
        """``tenant`` left: its running jobs act on processes that are gone; no deadline."""
        for job, run in self._running.items():
            if job.tenant == tenant and not run.overdue:
                run.due = float("inf")

    def drop_queued_of(self, tenant: str, keep: Iterable[Kind] = ()) -> list[Job]:
        """Forget ``tenant``'s queued jobs but those of the ``keep`` kinds; return the dropped."""
        kinds = set(keep)
        dropped = [j for j in self._queued if j.tenant == tenant and j.kind not in kinds]
        self._queued = [j for j in self._queued if j not in dropped]
        return dropped

    def drop_queued(self, keep: Iterable[Kind] = ()) -> list[Job]:
        """Forget every queued job but those of the ``keep`` kinds; return the dropped."""
        kinds = set(keep)
        dropped = [j for j in self._queued if j.kind not in kinds]
        self._queued = [j for j in self._queued if j.kind in kinds]
        return dropped

    def _lane_keys(self, job: Job) -> list[tuple[str, str]]:
        if job.kind not in (Kind.SWAP_OUT, Kind.SWAP_IN):
            return []
        direction = "swap" if self.lanes.shared else job.kind.value
        return [(gpu, direction) for gpu in sorted(job.gpus or {""})]

    def _capacity(self, key: tuple[str, str]) -> int:
        if key[1] == "swap":
            return self.lanes.out
        return self.lanes.out if key[1] == Kind.SWAP_OUT.value else self.lanes.in_
