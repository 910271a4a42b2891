"""In which order the scheduler's actions may be carried out, and which at once.

Pure bookkeeping (no threads, no I/O): the engine submits jobs as the scheduler
asks for them and starts whatever :meth:`Executor.startable` hands out; a runner
carries each out (on a thread in the daemon, inline in tests) and reports it
with :meth:`Executor.finish`. The rules:

1. A tenant's jobs run one at a time, in the order they were asked for: its
   memory never moves while it is being gated, and never two ways at once.
2. An ungate waits for every gate asked for before it on a GPU it shares: the
   previous holder is stopped before the next one runs.
3. Swaps (and a follow that moves memory) go through lanes per GPU: at most
   ``lanes.out`` swap-outs and
   ``lanes.in_`` swap-ins at once on one GPU, the two directions side by side (the
   host link is full duplex: a checkpoint and a restore do not slow each other),
   or, with ``lanes.shared``, one lane for both. Within a lane, swaps start in the
   order they were asked for. A gate or ungate never waits behind another
   tenant's swap.

The scheduler already keeps memory safe (a restore is asked for only when the
card has room for it, a tenant is let go only with its memory on the card); the
executor keeps the order of what it asked for.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from kiwid.core.events import (
    Action,
    Gate,
    Release,
    Retry,
    SwapIn,
    SwapOut,
    TenantFaulted,
    Ungate,
)
from kiwid.daemon.tenants.tracker import TenantInfo


class Kind(enum.StrEnum):
    """What a job does."""

    GATE = "gate"
    UNGATE = "ungate"
    SWAP_OUT = "swap-out"
    SWAP_IN = "swap-in"
    FORGET = "forget"
    """The tenant left: undo what may remain of its gate, drop its record."""
    RETRY = "retry"
    """Mend a stuck tenant (an operator asked): gate it whole, find its memory."""
    RELEASE = "release"
    """Let a stuck tenant run on an operator's word: restore, unlock, thaw."""
    FENCE = "fence"
    """Freeze a tenant whose CUDA lock cannot be trusted (a call that never returned)."""
    FOLLOW = "follow"
    """Lock the processes a gated tenant started since it was gated; with sizes (its
    memory is in host RAM), move theirs there too, in the GPU's swap-out lane."""
    SETTLE = "settle"
    """A gate or follow returned after kiwid gave up on it: a lock it took late is
    recorded (kiwid holds the tenant gated) or undone (kiwid lets it run)."""


_KINDS: dict[type, Kind] = {
    Gate: Kind.GATE,
    Ungate: Kind.UNGATE,
    SwapOut: Kind.SWAP_OUT,
    SwapIn: Kind.SWAP_IN,
    Retry: Kind.RETRY,
    Release: Kind.RELEASE,
}
OPERATIONS = {
    Kind.GATE: "gate",
    Kind.UNGATE: "ungate",
    Kind.FOLLOW: "gate",
    Kind.FENCE: "gate",
    Kind.SWAP_OUT: "swap-out",
    Kind.SWAP_IN: "swap-in",
    Kind.RETRY: "retry",
    Kind.RELEASE: "release",
    Kind.SETTLE: "ungate",
}
"""The operation a job's fault names (a fence and a follow belong to the gate, a
settle undoes a lock that kiwid did not want)."""
UNDO_KINDS = frozenset({Kind.FORGET, Kind.FENCE, Kind.RETRY, Kind.RELEASE, Kind.SETTLE})
"""What still runs for a stuck tenant: what keeps it safe or mends it."""


@dataclass(frozen=True)
class Lanes:
    """How many swaps may run at once on one GPU."""

    out: int = 1
    """Swap-outs (``memory.checkpoint_lanes``)."""
    in_: int = 1
    shared: bool = False
    """One lane for both directions (``out`` swaps of either kind at once)."""


@dataclass(frozen=True, eq=False)
class Job:
    """One action to carry out, with what it needs to know of its tenant (each job unique)."""

    seq: int
    tenant: str
    kind: Kind
    gpus: frozenset[str]
    info: TenantInfo | None = None
    """The tenant as the tracker knew it when the job was asked for."""
    nbytes: int = 0
    """For a swap: the bytes it moves (per the scheduler's accounting)."""
    sizes: dict[str, int] = field(default_factory=dict)
    """For a swap-out: bytes per GPU (what the state file records); for a follow,
    the new processes' (empty: they stay on the card)."""
    pids: dict[int, int] = field(default_factory=dict)
    """For a follow: the new processes to lock (pid -> start time)."""
    fault: TenantFaulted | None = None
    """For a fence: the fault that made it stuck (told again once it is fenced)."""
    hold: threading.Event = field(default_factory=threading.Event)
    """For a settle: set as it starts if kiwid holds the tenant gated then; for a
    fence: if kiwid holds it (stuck or gated) then. Its earlier jobs, a release
    say, have run and been heard by then."""
    given_up: threading.Event = field(default_factory=threading.Event)
    """Set when it ran past its deadline: kiwid (a fence, an operator) deals with its
    tenant since, and a call that returns late must not fence it on its own."""


class Executor:
    """Hands out jobs in an order that keeps each tenant's and each GPU's rules."""

    def __init__(self, lanes: Lanes | None = None) -> None:
        """Start empty with ``lanes`` per GPU (default: one swap each way at a time)."""
        self.lanes = lanes or Lanes()
        self._seq = itertools.count()
        self._queued: list[Job] = []
        self._running: set[Job] = set()

    def job(
        self,
        action: Action | Kind | None,
        tenant: str,
        gpus: frozenset[str],
        *,
        info: TenantInfo | None = None,
        sizes: dict[str, int] | None = None,
        pids: dict[int, int] | None = None,
        fault: TenantFaulted | None = None,
    ) -> Job:
        """Queue the job that carries out ``action``.

        ``None``: forget ``tenant``; a :class:`Kind`: a job of the shell's own, a
        fence or a follow.
        """
        if isinstance(action, Kind):
            kind = action
        else:
            kind = Kind.FORGET if action is None else _KINDS[type(action)]
        sizes = dict(sizes or {})
        job = Job(
            next(self._seq),
            tenant,
            kind,
            gpus,
            info,
            sum(sizes.values()),
            sizes,
            dict(pids or {}),
            fault,
        )
        self._queued.append(job)
        return job

    @property
    def running(self) -> frozenset[Job]:
        """The jobs handed out and not finished."""
        return frozenset(self._running)

    @property
    def queued(self) -> tuple[Job, ...]:
        """The jobs not handed out yet, oldest first."""
        return tuple(self._queued)

    def busy(self, tenant: str) -> bool:
        """Whether ``tenant`` has a job queued or running."""
        return any(j.tenant == tenant for j in itertools.chain(self._queued, self._running))

    def startable(self) -> list[Job]:
        """Hand out every queued job that may start now (they count as running)."""
        blocked_tenants = {j.tenant for j in self._running}
        gating: list[Job] = [j for j in self._running if j.kind is Kind.GATE]
        in_lane: dict[tuple[str, str], int] = {}
        for j in self._running:
            for key in self._lane_keys(j):
                in_lane[key] = in_lane.get(key, 0) + 1
        waiting_lanes: set[tuple[str, str]] = set()  # a lane whose head is still queued
        started: list[Job] = []
        for job in list(self._queued):
            ok = job.tenant not in blocked_tenants
            if ok and job.kind is Kind.UNGATE:
                ok = not any(g.gpus & job.gpus and g.seq < job.seq for g in gating)
            keys = self._lane_keys(job)
            if keys:
                ok = ok and all(
                    key not in waiting_lanes and in_lane.get(key, 0) < self._capacity(key)
                    for key in keys
                )
                if not ok:
                    waiting_lanes.update(keys)  # later swaps in its lanes wait behind it
            blocked_tenants.add(job.tenant)
            if job.kind is Kind.GATE:
                gating.append(job)
            if not ok:
                continue
            for key in keys:
                in_lane[key] = in_lane.get(key, 0) + 1
            self._queued.remove(job)
            self._running.add(job)
            started.append(job)
        return started

    def finish(self, job: Job) -> None:
        """A job handed out is done (whatever its outcome)."""
        self._running.discard(job)

    def drop_queued_of(self, tenant: str, keep: Iterable[Kind] = UNDO_KINDS) -> list[Job]:
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
        kind = Kind.SWAP_OUT if job.kind is Kind.FOLLOW and job.sizes else job.kind
        if kind not in (Kind.SWAP_OUT, Kind.SWAP_IN):
            return []
        direction = "swap" if self.lanes.shared else kind.value
        return [(gpu, direction) for gpu in sorted(job.gpus or {""})]

    def _capacity(self, key: tuple[str, str]) -> int:
        if key[1] == "swap":
            return self.lanes.out
        return self.lanes.out if key[1] == Kind.SWAP_OUT.value else self.lanes.in_
