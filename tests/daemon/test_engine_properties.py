"""Property tests of the real engine: scheduler, executor and the order jobs finish in.

The engine runs as in the daemon, but its runner hands each job to the test
instead of a thread, and the test finishes them in an order hypothesis draws
(several jobs are in flight at once, as on the daemon's threads). A model of the
world (who is gated, whose memory is in host RAM, which jobs run) carries each
job out, with swaps failing as hypothesis says, and checks every step:

* a tenant's jobs never run two at once, and its memory moves only while gated;
* a tenant is let go only with its memory on the card (never from host RAM);
* an ungate never starts before a gate asked for earlier on a GPU it shares;
* a tenant the driver cannot checkpoint (told, or a refused checkpoint) is never
  swapped out again;
* on a gating GPU, at most one bursting tenant runs once the jobs are done;
* nothing stays gated that the scheduler does not want gated, once quiet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kiwid.core.clock import FakeClock
from kiwid.core.events import (
    ActivitySeen,
    Event,
    FootprintRemembered,
    FootprintSeen,
    GateFailed,
    GpusConfigured,
    MemoryFreeSeen,
    SwapFinished,
    TenantAttached,
    TenantDetached,
    TenantPolicySet,
    TenantUnswappable,
    Tick,
)
from kiwid.core.model import (
    GpuPolicy,
    Mode,
    Newcomer,
    SwapMode,
    TenantPolicy,
    TenantState,
    TenantSwap,
)
from kiwid.core.residency import Residency
from kiwid.core.scheduler import Scheduler
from kiwid.daemon.engine.effects import Effects
from kiwid.daemon.engine.engine import Engine
from kiwid.daemon.engine.executor import Job, Kind, Lanes
from kiwid.daemon.gating.gates import NullGate
from kiwid.daemon.gating.state import StateFile
from kiwid.daemon.tenants.tracker import Identity, TenantInfo, TenantTracker
from tests.helpers import steps as clock_steps

GiB = 2**30
GPUS = ("0", "1")
TENANTS = tuple(f"t{i}" for i in range(5))
S = TenantState


@dataclass
class World:
    """What is true of the tenants, as the jobs leave it."""

    gated: set[str] = field(default_factory=set)
    out: set[str] = field(default_factory=set)
    running: list[Job] = field(default_factory=list)
    pinned: dict[str, int] = field(default_factory=dict)
    """Tenants that may never be swapped out, with the first job seq asked after."""


class InlineRunner:
    """Hands the engine's jobs to the test instead of threads."""

    def __init__(self) -> None:
        self.pending: list[Job] = []

    def start(self, job: Job) -> None:
        self.pending.append(job)


class Harness:
    def __init__(self, policies: dict[str, GpuPolicy], fates: list[str], lanes: Lanes) -> None:
        self.clock = FakeClock()
        self.tracker = TenantTracker(lambda pid: None, alive=lambda pid, start: True)
        # Effects are not used: the world model below carries the jobs out.
        effects = Effects(NullGate(), StateFile("/nonexistent"), None, self.clock.now)
        self.engine = Engine(Scheduler(), self.tracker, effects, self.clock.now, lanes=lanes)
        self.runner = InlineRunner()
        self.engine.runner = self.runner
        self.world = World()
        self.fates = fates
        self.swaps = 0
        self.next_seq = 0
        submit = self.engine.executor.job

        def job(*args: object, **kwargs: object) -> Job:
            made = submit(*args, **kwargs)  # type: ignore[arg-type]
            self.next_seq = made.seq + 1
            return made

        self.engine.executor.job = job  # type: ignore[method-assign]
        self.engine.apply([GpusConfigured(policies)])

    # ---- events in ------------------------------------------------------------

    def feed(self, event: Event) -> None:
        if isinstance(event, TenantAttached):
            info = self.tracker.tenants.get(event.tenant)
            if info is None:
                ident = Identity(event.tenant, "cgroup", event.tenant, dedicated=True)
                info = self.tracker.tenants[event.tenant] = TenantInfo(ident)
            info.gpus = event.gpus
        elif isinstance(event, TenantDetached):
            gone = self.tracker.tenants.pop(event.tenant, None)
            if gone is None:
                return
            self.tracker.gone[event.tenant] = gone
            self.world.pinned.pop(event.tenant, None)
        elif isinstance(
            event, FootprintSeen | ActivitySeen | TenantPolicySet | FootprintRemembered
        ):
            info = self.tracker.tenants.get(event.tenant)
            if info is None or (isinstance(event, FootprintSeen) and event.gpu not in info.gpus):
                return
        elif isinstance(event, TenantUnswappable):
            if event.tenant not in self.tracker.tenants:
                return
            self.world.pinned.setdefault(event.tenant, self.next_seq)

        self.engine.apply([event])

    # ---- jobs out ------------------------------------------------------------

    def finish_one(self, pick: int) -> None:
        job = self.runner.pending.pop(pick % len(self.runner.pending))
        self.carry_out_start(job)
        self.engine.finished(job, self.carry_out_end(job))

    def carry_out_start(self, job: Job) -> None:
        world = self.world
        for other in world.running:
            assert other.tenant != job.tenant, f"two jobs of {job.tenant} at once"
        if job.kind is Kind.UNGATE:
            unfinished = [*self.runner.pending, *world.running, *self.engine.executor.queued]
            for earlier in unfinished:
                if earlier.kind is Kind.GATE and earlier.seq < job.seq and earlier.gpus & job.gpus:
                    raise AssertionError(f"{job} started before the earlier {earlier}")
        if job.kind is Kind.SWAP_OUT and job.tenant in world.pinned:
            assert job.seq < world.pinned[job.tenant], f"{job.tenant} swapped out though pinned"
        world.running.append(job)

    def carry_out_end(self, job: Job) -> list[Event]:
        world = self.world
        world.running.remove(job)
        t = job.tenant
        gone = t not in self.tracker.tenants
        if job.kind is Kind.GATE:
            world.gated.add(t)
            return []
        if job.kind is Kind.UNGATE:
            assert t not in world.out, f"{t} let go while its memory is in host RAM"
            world.gated.discard(t)
            return []
        if job.kind is Kind.FORGET:
            world.gated.discard(t)
            world.out.discard(t)
            return []
        direction = "out" if job.kind is Kind.SWAP_OUT else "in"
        if gone:
            return [SwapFinished(t, direction, ok=False, reason="gone")]
        assert t in world.gated, f"{job.kind.value} of {t}, which runs"
        assert (t in world.out) == (direction == "in"), f"{job.kind.value} of {t} twice"
        fate = self.fates[self.swaps % len(self.fates)]
        self.swaps += 1
        if fate == "ok":
            (world.out.add if direction == "out" else world.out.discard)(t)
            return [SwapFinished(t, direction, True, GiB, 0.5)]
        if fate == "refused" and direction == "out":  # the driver cannot checkpoint it
            world.pinned.setdefault(t, self.next_seq)
            return [SwapFinished(t, "out", False, reason="NCCL", unswappable=True)]
        if fate == "refused":  # the shell's fresh reading: too little free memory
            return [
                *(MemoryFreeSeen(g, 0) for g in sorted(job.gpus)),
                SwapFinished(t, "in", False, reason="free memory", deferred=True),
            ]
        return [SwapFinished(t, direction, False, reason="fate")]

    def drain(self, picks: list[int]) -> None:
        """Finish every job in flight, in the drawn order (new ones join as they come)."""
        i = 0
        while self.runner.pending:
            self.finish_one(picks[i % len(picks)] if picks else 0)
            i += 1
        self.check_quiet()

    def check_quiet(self) -> None:
        view = self.engine.scheduler.view(self.clock.now())
        wanted = {t.tenant for t in view.tenants if t.gated}
        present = {t.tenant for t in view.tenants}
        assert self.world.gated & present == wanted, (self.world.gated, wanted)
        host = {t.tenant for t in view.tenants if t.residency is Residency.HOST}
        assert self.world.out & present == host
        for gpu in view.gpus:
            if not gpu.gating:
                continue
            running = [
                t.tenant
                for t in view.tenants
                if gpu.gpu in t.gpus
                and t.state in (S.HOLDER, S.CORUNNING)
                and t.tenant not in self.world.gated
            ]
            assert len(running) <= 1, (gpu.gpu, running)

    def pass_time(self, seconds: float, picks: list[int], busy: frozenset[str]) -> None:
        """Time passes, a second at a time at most; ``busy`` tenants work whenever let go."""
        next_deadline = self.engine.scheduler.next_deadline
        for step in clock_steps(self.clock.now, next_deadline, seconds, max_step=1.0):
            self.clock.advance(step)
            self.feed(Tick())
            for tenant in sorted(busy):
                if tenant in self.tracker.tenants and tenant not in self.world.gated:
                    self.feed(ActivitySeen(tenant))
            self.drain(picks)


policies = st.builds(
    GpuPolicy,
    tq_s=st.sampled_from([1.0, 5.0]),
    idle_release_s=st.sampled_from([0.5, 5.0]),
    mode=st.sampled_from([Mode.EXCLUSIVE, Mode.EXCLUSIVE, Mode.AUTO, Mode.OFF]),
    capacity_bytes=st.just(40 * GiB),
    reserve_bytes=st.just(GiB),
    swap=st.sampled_from([SwapMode.CHECKPOINT, SwapMode.AUTO, SwapMode.NONE]),
    newcomer=st.sampled_from(list(Newcomer)),
)
tenants = st.sampled_from(TENANTS)
gpu_sets = st.frozensets(st.sampled_from(GPUS), min_size=1, max_size=2)
events = st.one_of(
    st.builds(TenantAttached, tenants, gpu_sets),
    st.builds(TenantDetached, tenants),
    st.builds(ActivitySeen, tenants),
    st.builds(ActivitySeen, tenants),
    st.builds(
        FootprintSeen, tenants, st.sampled_from(GPUS), st.integers(0, 30).map(lambda g: g * GiB)
    ),
    st.builds(GpusConfigured, st.fixed_dictionaries(dict.fromkeys(GPUS, policies))),
    st.builds(GateFailed, tenants, st.just("the freezer timed out")),
    st.builds(MemoryFreeSeen, st.sampled_from(GPUS), st.integers(0, 40).map(lambda g: g * GiB)),
    st.builds(FootprintRemembered, tenants, st.integers(0, 30).map(lambda g: g * GiB)),
    st.builds(TenantUnswappable, tenants, st.just("it uses NCCL across processes")),
    st.builds(
        TenantPolicySet,
        tenants,
        st.builds(
            TenantPolicy,
            weight=st.sampled_from([0.5, 1.0, 2.0]),
            priority=st.integers(0, 2),
            swap=st.sampled_from(list(TenantSwap)),
        ),
    ),
)
# Either an event, with the order in which the jobs it causes finish, or time passing
# while some tenants are busy (they show activity whenever they are let go).
picks = st.lists(st.integers(0, 7), max_size=6)
script_steps = st.one_of(
    st.tuples(events, picks, st.just(frozenset())),
    st.tuples(st.floats(0.05, 12.0), picks, st.frozensets(tenants, min_size=1)),
)
lanes = st.builds(Lanes, out=st.integers(1, 3), in_=st.integers(1, 2), shared=st.booleans())


@settings(max_examples=250, deadline=None)
@given(
    st.fixed_dictionaries(dict.fromkeys(GPUS, policies)),
    st.lists(st.builds(TenantAttached, tenants, gpu_sets), min_size=2, max_size=5),
    st.lists(script_steps, min_size=5, max_size=60),
    st.lists(st.sampled_from(["ok", "ok", "ok", "failed", "refused"]), min_size=1, max_size=6),
    lanes,
)
def test_the_engine_keeps_order_and_memory_safe_whatever_finishes_first(
    initial, opening, script, fates, lanes
) -> None:
    h = Harness(initial, fates, lanes)
    for event in opening:
        h.feed(event)
    for what, order, busy in script:
        if isinstance(what, float):
            h.pass_time(what, order, busy)
        else:
            # Activity only shows while a tenant runs (a gated one makes none).
            if isinstance(what, ActivitySeen) and what.tenant in h.world.gated:
                continue
            h.feed(what)
            # A few jobs may stay in flight across the next event, as on threads.
            for pick in order[: len(order) // 2]:
                if h.runner.pending:
                    h.finish_one(pick)
    h.drain([0])
