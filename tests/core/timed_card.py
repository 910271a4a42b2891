"""One GPU whose swaps take time, for the core's hand-over tests.

Like the shell, :class:`TimedCard` carries out what the scheduler asks for: a
gate or ungate at once, a swap through two lanes (one swap-out and one swap-in at
a time, concurrently: the link is full duplex) taking ``bytes / rate`` seconds of
a fake clock, reported with :class:`SwapFinished` and a fresh reading of the
card's free memory. The card's free memory is what is physically on it: a
restore takes its bytes when it starts, a checkpoint gives them back when it
ends, and ``foreign`` bytes belong to nobody the scheduler knows. Every running
tenant shows activity at every poll.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kiwid.core.actions import Action, Gate, SwapIn, SwapOut, Ungate
from kiwid.core.clock import FakeClock
from kiwid.core.events import (
    ActivitySeen,
    Event,
    FootprintRemembered,
    FootprintSeen,
    Gated,
    MemoryFreeSeen,
    SwapFinished,
    TenantAttached,
    TenantPolicySet,
    Tick,
    Ungated,
)
from kiwid.core.model import GpuPolicy, Newcomer, SwapMode, TenantPolicy
from kiwid.core.scheduler import Scheduler

GiB = 2**30
POLL_S = 0.5


@dataclass
class Swap:
    tenant: str
    direction: str
    nbytes: int
    started: float
    ends: float
    epoch: int = 0


@dataclass
class TimedCard:
    """A 140.4 GiB card, H200 swap rates, TQ 30 s, ``swap = "checkpoint"`` by default."""

    capacity_gib: float = 140.4
    tq: float = 30.0
    out_rate: float = 2.3e9
    in_rate: float = 6.3e9
    swap: SwapMode = SwapMode.CHECKPOINT
    newcomer: Newcomer = Newcomer.WHOLE_CARD
    foreign: int = 0
    """Bytes on the card that no tenant shows (the driver, another user)."""
    readings: bool = True
    """Whether the scheduler hears the card's free memory (``MemoryFreeSeen``)."""
    stuck: set[str] = field(default_factory=set)
    """Tenants whose restore never ends."""
    refuse: set[str] = field(default_factory=set)
    """Tenants whose checkpoint the driver refuses for good (``unswappable``)."""
    clock: FakeClock = field(default_factory=lambda: FakeClock(1000.0))
    log: list[tuple[float, Action]] = field(default_factory=list)
    on_ungate: Callable[[str], None] | None = None
    """Called with each tenant let go, the moment it is (a test's check of the card)."""
    watch_status: bool = False
    """Whether each poll reads the status view into :attr:`seen` (it costs most of a
    long run's time, so only the tests that read ``seen`` ask for it)."""

    def __post_init__(self) -> None:
        self.policy = GpuPolicy(
            tq_s=self.tq,
            idle_release_s=5,
            capacity_bytes=int(self.capacity_gib * GiB),
            reserve_bytes=GiB,
            swap=self.swap,
            newcomer=self.newcomer,
        )
        self.sched = Scheduler({"0": self.policy})
        self.sizes: dict[str, int] = {}
        self.on_card: dict[str, int] = {}
        self.running: set[str] = set()
        self.lanes: dict[str, list[Swap]] = {"out": [], "in": []}
        self.inflight: dict[str, Swap] = {}
        self.next_poll = self.clock.now()
        self.restores: list[tuple[str, int]] = []
        """(tenant, the card's free bytes just before its restore allocated)."""
        self.seen: list[str] = []
        """Every ``waiting_for`` the status showed at a poll (with ``watch_status``)."""
        self.declared: dict[str, int] = {}
        """What each tenant declared it needs (bytes), as its policy told the scheduler."""
        self.peaks: dict[str, int] = {}
        """The most each tenant was seen using (bytes), as its footprints told it."""

    # ------------------------------------------------------------ driving

    def do(self, event: Event) -> None:
        """Hand ``event`` to the scheduler and carry out what it asks for."""
        now = self.clock.now()
        gated: list[Gate] = []
        ungated: list[Ungate] = []
        for action in self.sched.handle(event, now):
            self.log.append((now, action))
            match action:
                case Gate(tenant=t):
                    self.running.discard(t)
                    gated.append(action)
                case Ungate(tenant=t):
                    self.running.add(t)
                    ungated.append(action)
                    if self.on_ungate is not None:
                        self.on_ungate(t)
                case SwapOut(tenant=t) | SwapIn(tenant=t):
                    direction = "out" if isinstance(action, SwapOut) else "in"
                    swap = Swap(t, direction, 0, math.inf, math.inf, action.epoch)
                    self.lanes[direction].append(swap)
        for gate in gated:  # a gate takes at once here
            self.do(Gated(gate.tenant, epoch=gate.epoch))
        for ungate in ungated:  # and so does an ungate
            self.do(Ungated(ungate.tenant, epoch=ungate.epoch))
        self._start_swaps()

    def join(
        self,
        name: str,
        gib: float,
        remembered: int | None = None,
        declared: float | None = None,
    ) -> None:
        """A tenant appears with ``gib`` of memory and starts a burst.

        ``remembered``: the peak its workload had in an earlier run, as the shell
        tells it right after the tenant appears; ``declared``: the GiB it declared it
        needs (its policy, resolved before its footprint and activity, as the shell
        does).
        """
        self.sizes[name] = self.on_card[name] = int(gib * GiB)
        self.do(TenantAttached(name, frozenset({"0"})))
        if declared is not None:
            self.declared[name] = int(declared * GiB)
            self.do(TenantPolicySet(name, TenantPolicy(memory_bytes=self.declared[name])))
        if remembered is not None:
            self.do(FootprintRemembered(name, remembered))
        self._footprint(name)
        self.do(ActivitySeen(name))
        if not any(a == Gate(name) for _, a in self.log):
            self.running.add(name)  # it holds at once, never gated

    def grow(self, name: str, gib: float) -> None:
        """A running tenant now uses ``gib`` (it allocated more, or freed some)."""
        assert name in self.running, f"{name} does not run: it cannot allocate"
        self.sizes[name] = self.on_card[name] = int(gib * GiB)
        self._footprint(name)

    def _footprint(self, name: str) -> None:
        self.peaks[name] = max(self.peaks.get(name, 0), self.sizes[name])
        self.do(FootprintSeen(name, "0", self.sizes[name]))

    def free(self) -> int:
        return self.policy.capacity_bytes - sum(self.on_card.values()) - self.foreign

    def run(self, seconds: float) -> None:
        """Let ``seconds`` pass, stopping at every deadline, swap end and poll."""
        end = self.clock.now() + seconds
        while self.clock.now() < end:
            now = self.clock.now()
            swap_end = min((s.ends for s in self.inflight.values()), default=math.inf)
            deadline = self.sched.next_deadline()
            at = min(end, swap_end, self.next_poll, deadline if deadline is not None else math.inf)
            self.clock.advance(max(0.0, at - now))
            self._finish_swaps()
            if self.clock.now() >= self.next_poll:
                self.next_poll = self.clock.now() + POLL_S
                self.poll()
            self.do(Tick())

    def poll(self) -> None:
        """What the daemon's poll reports: the card's free memory, who worked."""
        if self.readings:
            self.do(MemoryFreeSeen("0", self.free()))
        if self.watch_status:
            view = self.sched.view(self.clock.now())
            self.seen += [t.waiting_for for t in view.tenants if t.waiting_for]
        for name in sorted(self.running):
            self.do(ActivitySeen(name))

    # ------------------------------------------------------------ swaps

    def _start_swaps(self) -> None:
        now = self.clock.now()
        for direction, lane in self.lanes.items():
            if not lane or any(s.direction == direction for s in self.inflight.values()):
                continue
            swap = lane[0]
            if swap.tenant in self.inflight:
                continue  # one move of a tenant at a time
            lane.pop(0)
            swap.nbytes = self.sizes[swap.tenant]
            rate = self.out_rate if direction == "out" else self.in_rate
            swap.started = now
            swap.ends = (
                math.inf
                if swap.tenant in self.stuck and direction == "in"
                else now + swap.nbytes / rate
            )
            if direction == "in":
                self.restores.append((swap.tenant, self.free()))
                self.on_card[swap.tenant] = swap.nbytes  # a restore allocates as it starts
            self.inflight[swap.tenant] = swap

    def _finish_swaps(self) -> None:
        now = self.clock.now()
        for swap in sorted(self.inflight.values(), key=lambda s: s.ends):
            if swap.ends > now:
                continue
            del self.inflight[swap.tenant]
            if swap.direction == "out":
                self.on_card.pop(swap.tenant, None)
            seconds = swap.ends - swap.started
            if swap.direction == "out" and swap.tenant in self.refuse:
                self.on_card[swap.tenant] = swap.nbytes
                why = "the driver cannot checkpoint it"
                self.do(
                    SwapFinished(
                        swap.tenant,
                        "out",
                        False,
                        0,
                        seconds,
                        why,
                        unswappable=True,
                        epoch=swap.epoch,
                    )
                )
                continue
            if self.readings:
                self.do(MemoryFreeSeen("0", self.free()))
            done = SwapFinished(
                swap.tenant, swap.direction, True, swap.nbytes, seconds, epoch=swap.epoch
            )
            self.do(done)
            self._start_swaps()

    # ------------------------------------------------------------ reading the log

    def at(self, action: Action, after: float = -math.inf) -> float:
        """When ``action`` was first asked for after ``after``."""
        return next(t for t, a in self.log if a == action and t > after)

    def turns(self) -> list[tuple[str, float, float]]:
        """(tenant, let go, gated) for every run of a tenant, in order."""
        started: dict[str, float] = {}
        out: list[tuple[str, float, float]] = []
        for t, action in self.log:
            if isinstance(action, Ungate):
                started[action.tenant] = t
            elif isinstance(action, Gate) and action.tenant in started:
                out.append((action.tenant, started.pop(action.tenant), t))
        return out

    def stalls(self, since: float) -> list[float]:
        """Per hand-over after ``since``: from the last holder's gate to the next one's ungate."""
        turns = [turn for turn in self.turns() if turn[1] >= since]
        return [b[1] - a[2] for a, b in itertools.pairwise(turns)]
