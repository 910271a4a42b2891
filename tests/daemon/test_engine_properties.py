"""Property tests of the real engine and its real effects, against a scripted driver.

The engine runs as in the daemon, with its real :class:`Effects` (the gate, swap,
mend and release jobs and a real state file), but its runner hands each job to
the test instead of a thread, and the test carries jobs out in an order
hypothesis draws, several in flight at once. The gate and the swapper are a
scripted world (a driver) whose calls succeed, fail, fail half-way or hang as
hypothesis says; a job left hanging runs past its deadline and is abandoned,
and returns later. Checked at every step:

* a tenant's jobs never run two at once, and its memory moves only while gated;
* a tenant is let go only with its memory on the card (never from host RAM), and
  never while another bursting tenant on its GPUs may run;
* the core never believes a tenant gated while the world has it running;
* the state file's ``swapped`` and the core's residency agree (one owner);
* a tenant the driver cannot checkpoint is never swapped out again;
* a stuck tenant's memory is never moved, and it is never let go, until an
  operator's retry or release.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiwid.core.clock import FakeClock
from kiwid.core.events import (
    ActivitySeen,
    Event,
    FootprintRemembered,
    FootprintSeen,
    GpusConfigured,
    MemoryFreeSeen,
    ReleaseAsked,
    RetryAsked,
    TenantAttached,
    TenantDetached,
    TenantPolicySet,
    TenantUnswappable,
    Tick,
)
from kiwid.core.model import GpuPolicy, Mode, Newcomer, SwapMode, TenantPolicy, TenantState
from kiwid.core.residency import Residency
from kiwid.core.scheduler import Scheduler
from kiwid.daemon.engine.effects import Effects
from kiwid.daemon.engine.engine import Engine
from kiwid.daemon.engine.executor import Job, Kind, Lanes
from kiwid.daemon.gating.gates import GateError, never
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.gating.state import StateFile
from kiwid.daemon.gating.swap import Placement, SwapError
from kiwid.daemon.tenants.tracker import Identity, TenantInfo, TenantTracker
from tests.helpers import steps as clock_steps

GiB = 2**30
GPUS = ("0", "1")
TENANTS = tuple(f"t{i}" for i in range(5))
S = TenantState
R = Residency
DEADLINE_S = 30.0
FATES = ("ok", "ok", "ok", "ok", "fail", "refused", "half", "hang")


@dataclass
class World:
    """What the scripted driver holds to be true of the tenants."""

    gated: set[str] = field(default_factory=set)
    out: set[str] = field(default_factory=set)
    split: set[str] = field(default_factory=set)
    """Part of its memory in host RAM, part on the card."""
    pinned: dict[str, int] = field(default_factory=dict)
    """Tenants that may never be swapped out, with the first job seq asked after."""
    fates: list[str] = field(default_factory=lambda: ["ok"])
    calls: int = 0
    wrong: list[str] = field(default_factory=list)
    """What the driver was asked that it must never be (the effects catch exceptions,
    so the test collects them here and fails on them)."""

    late: bool = False
    """The call being made is an abandoned job's, returning late: the engine no longer
    stands behind it, so the driver refuses what is illegal instead of the test failing."""

    def expect(self, truth: bool, what: str) -> None:
        if truth:
            return
        if self.late:
            raise SwapError(f"the driver refuses: {what}", answer="CUDA_ERROR_ILLEGAL_STATE (401)")
        self.wrong.append(what)

    def fate(self) -> str:
        fate = self.fates[self.calls % len(self.fates)]
        self.calls += 1
        return fate


class ScriptedGate:
    """A gate over the world: each call succeeds or fails as the fates say."""

    method = "none"

    def __init__(self, world: World) -> None:
        self.world = world

    def prepare(self, tenant: TenantInfo) -> GatedRecord:
        return GatedRecord(tenant.key, self.method, None, None, tuple(sorted(tenant.pids)))

    def gate(self, record: GatedRecord, cancelled: Callable[[], bool] = never) -> None:
        if self.world.fate() in ("fail", "half"):
            raise GateError(f"{record.tenant}: the freezer timed out", answer="ETIMEDOUT")
        self.world.gated.add(record.tenant)

    def ungate(self, record: GatedRecord) -> None:
        world = self.world
        world.expect(
            record.tenant not in world.out | world.split, f"{record.tenant} let go from host RAM"
        )
        if self.world.fate() == "fail" and record.tenant in self.world.gated:
            raise GateError(f"{record.tenant}: cgroup.freeze refused", answer="EACCES")
        self.world.gated.discard(record.tenant)

    def forget(self, tenant: str) -> None:
        """Nothing to drop."""

    def holds(self, tenant: TenantInfo) -> bool:
        return tenant.key in self.world.gated


class ScriptedSwapper:
    """A swapper over the world: a swap succeeds, fails cleanly, is refused for good,
    or fails half-way (part of the memory left in host RAM)."""

    method = "checkpoint"

    def __init__(self, world: World) -> None:
        self.world = world

    def swap_out(self, record: GatedRecord) -> None:
        t, world = record.tenant, self.world
        world.expect(t in world.gated, f"swap-out of {t}, which runs")
        world.expect(t not in world.out | world.split, f"swap-out of {t} twice")
        fate = world.fate()
        if fate == "fail":
            raise SwapError("checkpoint: out of host memory", 1, "OOM", transient=True)
        if fate == "refused":
            raise SwapError("checkpoint: not supported", 1, "NOT_SUPPORTED", unsupported=True)
        if fate == "half":
            world.split.add(t)
            raise SwapError("checkpoint of pid 2: out of memory; rollback failed", 2, "OOM")
        world.out.add(t)

    def swap_in(self, record: GatedRecord) -> None:
        t, world = record.tenant, self.world
        world.expect(t in world.gated, f"swap-in of {t}, which runs")
        fate = world.fate()
        if fate == "fail":
            raise SwapError("restore: out of memory", 1, "OOM", transient=True)
        if fate in ("refused", "half"):  # issue 44: stuck in host RAM for good
            raise SwapError("restore: CUDA_ERROR_OPERATING_SYSTEM", 1, "304")
        world.out.discard(t)
        world.split.discard(t)

    def placement(self, record: GatedRecord) -> Placement:
        t = record.tenant
        runs = t not in self.world.gated
        if t in self.world.split:
            return Placement(R.UNKNOWN, runs, "split")
        return Placement(R.HOST if t in self.world.out else R.RESIDENT, runs)

    def expected_s(self, nbytes: int, direction: str) -> float:
        return 1.0


class InlineRunner:
    """Hands the engine's jobs to the test instead of threads."""

    def __init__(self) -> None:
        self.pending: list[Job] = []

    def start(self, job: Job) -> None:
        self.pending.append(job)


class Harness:
    def __init__(self, policies: dict[str, GpuPolicy], fates: list[str], lanes: Lanes) -> None:
        self.dir = tempfile.mkdtemp(prefix="kiwi-engine-", dir="/dev/shm")
        self.clock = FakeClock(1000.0)
        self.world = World(fates=fates)
        self.tracker = TenantTracker(lambda pid: None, alive=lambda pid, start=None: True)
        self.effects = Effects(
            ScriptedGate(self.world),  # type: ignore[arg-type]
            StateFile(self.dir),
            ScriptedSwapper(self.world),  # type: ignore[arg-type]
            self.clock.now,
        )
        self.engine = Engine(
            Scheduler(),
            self.tracker,
            self.effects,
            self.clock.now,
            lanes=lanes,
            deadline_s=lambda job, nbytes: DEADLINE_S,
        )
        self.runner = InlineRunner()
        self.engine.runner = self.runner
        self.hung: list[Job] = []
        self.ghosts: set[Job] = set()
        self.running: list[Job] = []
        self.next_seq = 0
        submit = self.engine.executor.job

        def job(*args: object, **kwargs: object) -> Job:
            made = submit(*args, **kwargs)  # type: ignore[arg-type]
            self.next_seq = made.seq + 1
            return made

        self.engine.executor.job = job  # type: ignore[method-assign]
        self.engine.apply([GpusConfigured(policies)])

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- events in ------------------------------------------------------------

    def feed(self, event: Event) -> None:
        if isinstance(event, TenantAttached):
            info = self.tracker.tenants.get(event.tenant)
            if info is None:
                ident = Identity(event.tenant, "cgroup", event.tenant, dedicated=True)
                # A live process: a release asks /proc whether the tenant's processes
                # live (the world's live while attached), or drops its record as gone.
                info = self.tracker.tenants[event.tenant] = TenantInfo(ident, {os.getpid()})
            info.gpus = event.gpus
        elif isinstance(event, TenantDetached):
            gone = self.tracker.tenants.pop(event.tenant, None)
            if gone is None:
                return
            self.tracker.gone[event.tenant] = gone
            # Its processes are gone: what its jobs in flight do touches nothing.
            self.ghosts |= {
                j for j in [*self.runner.pending, *self.running] if j.tenant == event.tenant
            }
            self.world.pinned.pop(event.tenant, None)
            self.world.gated.discard(event.tenant)  # its processes are gone
            self.world.out.discard(event.tenant)
            self.world.split.discard(event.tenant)
        elif isinstance(event, TenantUnswappable):
            if event.tenant not in self.tracker.tenants:
                return
            self.world.pinned.setdefault(event.tenant, self.next_seq)
        elif isinstance(event, FootprintSeen | ActivitySeen | TenantPolicySet):
            info = self.tracker.tenants.get(event.tenant)
            if info is None or (isinstance(event, FootprintSeen) and event.gpu not in info.gpus):
                return
            if isinstance(event, ActivitySeen) and event.tenant in self.world.gated:
                return  # a gated tenant shows no activity
        elif (
            isinstance(event, FootprintRemembered | RetryAsked | ReleaseAsked)
            and event.tenant not in self.tracker.tenants
        ):
            return
        self.engine.apply([event])
        self.check()

    # ---- jobs out ------------------------------------------------------------

    def finish_one(self, pick: int) -> None:
        job = self.runner.pending.pop(pick % len(self.runner.pending))
        self.start(job)
        fates = self.world.fates
        if job.kind is not Kind.FORGET and fates[self.world.calls % len(fates)] == "hang":
            self.world.calls += 1
            self.hung.append(job)  # its call never returns (until the end)
            return
        self.end(job)

    def start(self, job: Job) -> None:
        for other in self.running:
            if other.tenant == job.tenant and other not in self.hung:
                raise AssertionError(f"two jobs of {job.tenant} at once: {other}, {job}")
        if job.kind is Kind.UNGATE:
            unfinished = [*self.runner.pending, *self.running, *self.engine.executor.queued]
            for earlier in unfinished:
                ahead = earlier.kind is Kind.GATE and earlier.seq < job.seq
                if ahead and earlier.gpus & job.gpus and earlier not in self.engine.abandoned:
                    raise AssertionError(f"{job} started before the earlier {earlier}")
        if job.kind is Kind.SWAP_OUT and job.tenant in self.world.pinned:
            assert job.seq < self.world.pinned[job.tenant], f"{job.tenant} swapped though pinned"
        if job.kind in (Kind.SWAP_OUT, Kind.SWAP_IN, Kind.UNGATE):
            state = self.engine.scheduler.tenant_state(job.tenant)
            assert state is not S.STUCK, f"{job.kind.value} of {job.tenant}, which is stuck"
        self.running.append(job)

    def end(self, job: Job) -> None:
        self.running.remove(job)
        if job in self.hung:
            self.hung.remove(job)
        self.world.late = job in self.engine.abandoned
        events = [] if job in self.ghosts else self.effects.carry_out(job)
        self.world.late = False
        for event in events:
            if getattr(event, "unswappable", False) and job.tenant in self.tracker.tenants:
                self.world.pinned.setdefault(job.tenant, self.next_seq)
        self.engine.finished(job, events)
        self.check()

    def drain(self, picks: list[int]) -> None:
        """Finish every job in flight but the hung ones, in the drawn order."""
        i = 0
        while self.runner.pending:
            self.finish_one(picks[i % len(picks)] if picks else 0)
            i += 1
        self.check()

    def release_hung(self) -> None:
        """The hung calls return at last (their jobs were abandoned, or are late)."""
        for job in list(self.hung):
            self.end(job)

    # ---- checks ------------------------------------------------------------

    def check(self) -> None:
        view = self.engine.scheduler.view(self.clock.now())
        world = self.world
        assert not world.wrong, world.wrong
        records = self.effects.state.records
        busy = {j.tenant for j in self.running} | {j.tenant for j in self.runner.pending}
        busy |= {j.tenant for j in self.engine.executor.queued}
        busy |= {j.tenant for j in self.engine.abandoned}
        for t in view.tenants:
            # The core never believes a tenant gated while the world has it running.
            if t.gated and not t.gate_pending and t.tenant not in busy:
                assert t.tenant in world.gated, f"{t.tenant} runs, the core has it gated"
            # Nor does the world hold one gated that the core lets run (a stuck one
            # whose gate did not take may run, or not): a gate that kiwid gave up on
            # does nothing when it comes back, or is settled; and no gate is asked of
            # a tenant while an operator's release of it runs.
            settled = t.state is not S.STUCK
            if not t.gated and settled and t.tenant not in busy:
                assert t.tenant not in world.gated, f"{t.tenant} gated, the core lets it run"
            # One owner of residency: the record says host RAM iff the core does.
            if t.tenant in busy or not t.gated:
                continue
            record = records.get(t.tenant)
            away = t.residency not in (R.RESIDENT, R.PREFETCHED)
            if record is not None and t.residency is not R.UNKNOWN:  # unknown: ask the driver
                assert (record.swapped is not None) == away, (t.tenant, t.residency, record)
            if t.tenant in world.out | world.split:
                assert away, f"{t.tenant}'s memory is off the card, the core says {t.residency}"
        for gpu in view.gpus:
            if not gpu.gating:
                continue
            running = [
                t.tenant
                for t in view.tenants
                if gpu.gpu in t.gpus
                and t.state in (S.HOLDER, S.CORUNNING)
                and not t.gated
                and t.tenant not in world.gated
            ]
            assert len(running) <= 1, (gpu.gpu, running)

    def pass_time(self, seconds: float, picks: list[int], busy: frozenset[str]) -> None:
        """Time passes, a second at a time at most; ``busy`` tenants work whenever let go."""

        def next_deadline() -> float | None:
            found = (self.engine.scheduler.next_deadline(), self.engine.next_deadline())
            return min((d for d in found if d is not None), default=None)

        for step in clock_steps(self.clock.now, next_deadline, seconds, max_step=1.0):
            self.clock.advance(step)
            self.engine.expire()
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
    st.builds(MemoryFreeSeen, st.sampled_from(GPUS), st.integers(0, 40).map(lambda g: g * GiB)),
    st.builds(FootprintRemembered, tenants, st.integers(0, 30).map(lambda g: g * GiB)),
    st.builds(TenantUnswappable, tenants, st.just("it uses NCCL across processes")),
    st.builds(RetryAsked, tenants),
    st.builds(ReleaseAsked, tenants),
    st.builds(
        TenantPolicySet,
        tenants,
        st.builds(
            TenantPolicy, weight=st.sampled_from([0.5, 1.0, 2.0]), priority=st.integers(0, 2)
        ),
    ),
)
# Either an event, with the order in which the jobs it causes finish, or time passing
# while some tenants are busy (they show activity whenever they are let go).
picks = st.lists(st.integers(0, 7), max_size=6)
script_steps = st.one_of(
    st.tuples(events, picks, st.just(frozenset())),
    st.tuples(st.floats(0.05, 40.0), picks, st.frozensets(tenants, min_size=1)),
)
lanes = st.builds(Lanes, out=st.integers(1, 3), in_=st.integers(1, 2), shared=st.booleans())


@pytest.fixture
def harnesses() -> Iterator[list[Harness]]:
    made: list[Harness] = []
    yield made
    for h in made:
        h.close()


@settings(max_examples=200, deadline=None, report_multiple_bugs=False)
@given(
    st.fixed_dictionaries(dict.fromkeys(GPUS, policies)),
    st.lists(st.builds(TenantAttached, tenants, gpu_sets), min_size=2, max_size=5),
    st.lists(script_steps, min_size=5, max_size=50),
    st.lists(st.sampled_from(FATES), min_size=1, max_size=8),
    lanes,
)
def test_the_engine_keeps_order_memory_and_windows_whatever_the_driver_does(
    initial, opening, script, fates, lanes
) -> None:
    h = Harness(initial, fates, lanes)
    try:
        for event in opening:
            h.feed(event)
        for what, order, busy in script:
            if isinstance(what, float):
                h.pass_time(what, order, busy)
            else:
                h.feed(what)
                # A few jobs may stay in flight across the next event, as on threads.
                for pick in order[: len(order) // 2]:
                    if h.runner.pending:
                        h.finish_one(pick)
        h.world.fates = ["ok"]  # the driver mends: what was asked settles
        h.pass_time(DEADLINE_S * 2, [0], frozenset())
        h.release_hung()
        h.drain([0])
    finally:
        h.close()
