"""Property tests of the real engine and its real effects, against a scripted driver.

The engine runs as in the daemon, with its real :class:`Effects` (the gate, swap,
mend, release, converge and fence jobs and a real state file), but its runner
hands each job to the test instead of a thread, and the test carries jobs out in
an order hypothesis draws, several in flight at once. The gate and the swapper
are a scripted world (a driver, and a freezer that never hangs) whose calls
succeed, fail, fail half-way or hang as hypothesis says; a job left hanging runs
past its deadline, keeps its tenant's lane, and returns at a moment hypothesis
draws. Checked at every step:

* two jobs that call the driver for one tenant never run at once, overdue ones
  included (only the freezer's fence runs beside a hung call); its memory moves
  only while gated;
* at most one tenant runs on a gating GPU, by the world's truth, whenever the core
  let one go there, whatever returns late;
* a tenant is let go only with its memory on the card (never from host RAM);
* the core never believes a tenant gated while the world has it running;
* the state file's ``swapped`` and the core's residency agree (one owner);
* a tenant the driver cannot checkpoint is never swapped out again;
* a stuck tenant's memory is never moved, and it is never let go, until an
  operator's retry or release.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiwid.adapters.cudalock import ProcessState
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
from kiwid.daemon.gating.cudagate import CudaLockGate
from kiwid.daemon.gating.gates import GateError, Guard, always, make_record
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
    """What the scripted driver (and the freezer) hold to be true of the tenants.

    A tenant runs unless the driver has it locked or the freezer has it fenced: the
    CUDA lock's world, where a hung driver call may return at any moment, and the
    freezer is the lever that never waits on the driver.
    """

    locked: set[str] = field(default_factory=set)
    fenced: set[str] = field(default_factory=set)
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
    pids: dict[int, str] = field(default_factory=dict)
    """Each tenant's process (a real one, so that /proc says it lives)."""

    def held(self, tenant: str) -> bool:
        """Whether it does not run: locked, or fenced."""
        return tenant in self.locked or tenant in self.fenced

    def expect(self, truth: bool, what: str) -> None:
        if not truth:
            self.wrong.append(what)

    hang: tuple[threading.Event, threading.Event] | None = None
    """The next call fated to hang: (returns, entered). It blocks until ``returns``."""

    def fate(self) -> str:
        fate = self.fates[self.calls % len(self.fates)]
        self.calls += 1
        if fate == "hang" and self.hang is not None:
            returns, entered = self.hang
            self.hang = None
            entered.set()
            returns.wait()  # the call hangs here, in its job's thread, then goes through
        return fate


class ScriptedGate(CudaLockGate):
    """The CUDA-lock gate over the world, with a freezer fence: each driver call
    succeeds or fails as the fates say; the freezer always takes."""

    method = "cuda-lock"

    def __init__(self, world: World) -> None:  # (no libcuda: the world is the driver)
        self.world = world

    def prepare(self, tenant: TenantInfo) -> GatedRecord:
        return make_record(tenant, self.method, None, None)

    def gate(self, record: GatedRecord) -> frozenset[int]:
        if self.world.fate() in ("fail", "half"):
            raise GateError(f"{record.tenant}: the lock timed out", answer="TIMEOUT")
        self.world.locked.add(record.tenant)
        return frozenset(record.pids)

    def ungate(self, record: GatedRecord, guard: Guard = always) -> None:
        world, t = self.world, record.tenant
        world.expect(t not in world.out | world.split, f"{t} let go from host RAM")
        if world.fate() == "fail" and t in world.locked:
            raise GateError(f"{t}: the unlock was refused", answer="ILLEGAL_STATE")
        world.locked.discard(t)
        if record.fenced:
            with guard(record) as current:
                if current:
                    world.fenced.discard(t)

    def state_of(self, pid: int) -> ProcessState | None:
        t = self.world.pids.get(pid)
        if t is None:
            return None
        if t in self.world.out:
            return ProcessState.CHECKPOINTED
        return ProcessState.LOCKED if t in self.world.locked else ProcessState.RUNNING

    def lock_one(self, pid: int) -> bool:
        if self.world.fate() in ("fail", "half"):
            raise GateError(f"cannot lock pid {pid}: timed out", pid, "TIMEOUT")
        self.world.locked.add(self.world.pids[pid])
        return True

    def fence(self, tenant: TenantInfo, record: GatedRecord) -> GatedRecord:
        return replace(record, cgroup_v2=f"/kiwi-test/{record.tenant}", fenced=True)

    def freeze_fence(self, record: GatedRecord) -> None:
        self.world.fenced.add(record.tenant)

    def unfence(self, record: GatedRecord) -> GatedRecord:
        self.world.fenced.discard(record.tenant)
        return replace(record, fenced=False)

    def forget(self, tenant: str) -> None:
        """Nothing to drop."""

    def holds(self, tenant: TenantInfo) -> bool:
        return self.world.held(tenant.key)

    def held(self, pids: Iterable[int]) -> list[int]:
        return [p for p in pids if self.world.held(self.world.pids.get(p, ""))]


class ScriptedSwapper:
    """A swapper over the world: a swap succeeds, fails cleanly, is refused for good,
    or fails half-way (part of the memory left in host RAM)."""

    method = "checkpoint"

    def __init__(self, world: World) -> None:
        self.world = world

    def swap_out(self, record: GatedRecord) -> None:
        t, world = record.tenant, self.world
        world.expect(t in world.locked, f"swap-out of {t}, which is not locked")
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
        if t not in world.out | world.split:
            return  # nothing checkpointed: the driver is not asked (restore_checkpointed)
        world.expect(t in world.locked, f"swap-in of {t}, which is not locked")
        fate = world.fate()
        if fate == "fail":
            raise SwapError("restore: out of memory", 1, "OOM", transient=True)
        if fate in ("refused", "half"):  # issue 44: stuck in host RAM for good
            raise SwapError("restore: CUDA_ERROR_OPERATING_SYSTEM", 1, "304")
        world.out.discard(t)
        world.split.discard(t)

    def placement(self, record: GatedRecord) -> Placement:
        t = record.tenant
        runs = t not in self.world.locked  # the driver's word: unlocked (fenced or not)
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
    def __init__(
        self,
        policies: dict[str, GpuPolicy],
        fates: list[str],
        lanes: Lanes,
        pids: dict[str, int],
    ) -> None:
        self.dir = tempfile.mkdtemp(prefix="kiwi-engine-", dir="/dev/shm")
        self.clock = FakeClock(1000.0)
        self.pids = pids
        self.world = World(fates=fates, pids={pid: t for t, pid in pids.items()})
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
        self.threads: dict[Job, tuple[threading.Thread, threading.Event, list[list[Event]]]] = {}
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
        for _, returns, _ in self.threads.values():  # a failed example leaves none hanging
            returns.set()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- events in ------------------------------------------------------------

    def feed(self, event: Event) -> None:
        if isinstance(event, TenantAttached):
            info = self.tracker.tenants.get(event.tenant)
            if info is None:
                ident = Identity(event.tenant, "cgroup", event.tenant, dedicated=True)
                # A live process: a release asks /proc whether the tenant's processes
                # live (the world's live while attached), or drops its record as gone.
                pid = self.pids[event.tenant]
                info = self.tracker.tenants[event.tenant] = TenantInfo(ident, {pid})
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
            self.world.locked.discard(event.tenant)  # its processes are gone
            self.world.fenced.discard(event.tenant)
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
            if isinstance(event, ActivitySeen) and self.world.held(event.tenant):
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
        never_hang = (Kind.FORGET, Kind.FENCE)  # the freezer does not wait on the driver
        if job in self.ghosts:  # its processes are gone: its calls touch nothing
            self.end(job, [])
            return
        if job.kind not in never_hang and fates[self.world.calls % len(fates)] == "hang":
            # Its job runs on a thread of its own, as in the daemon: it reads what it
            # reads now, and its call hangs in the driver until the test lets it
            # return (which may be long after its deadline), then it goes on.
            returns, entered = threading.Event(), threading.Event()
            self.world.hang = (returns, entered)
            out: list[list[Event]] = []
            thread = threading.Thread(target=lambda: out.append(self.effects.carry_out(job)))
            thread.start()
            while not entered.wait(0.01) and thread.is_alive():
                pass
            self.world.hang = None
            if entered.is_set():
                self.hung.append(job)
                self.threads[job] = (thread, returns, out)
                return
            thread.join()  # it called no driver on the way: it did not hang
            self.end(job, out[0])
            return
        self.end(job)

    def start(self, job: Job) -> None:
        for other in self.running:  # hung ones included: only the freezer runs beside
            if other.tenant == job.tenant and Kind.FENCE not in (other.kind, job.kind):
                raise AssertionError(f"two jobs of {job.tenant} at once: {other}, {job}")
        if job.kind is Kind.UNGATE:
            unfinished = [*self.runner.pending, *self.running, *self.engine.executor.queued]
            for earlier in unfinished:
                ahead = earlier.kind is Kind.GATE and earlier.seq < job.seq
                run = self.engine.executor.run_of(earlier)
                hung = run is not None and run.overdue
                if ahead and earlier.gpus & job.gpus and not hung:
                    raise AssertionError(f"{job} started before the earlier {earlier}")
        if job.kind is Kind.SWAP_OUT and job.tenant in self.world.pinned:
            assert job.seq < self.world.pinned[job.tenant], f"{job.tenant} swapped though pinned"
        if job.kind in (Kind.SWAP_OUT, Kind.SWAP_IN, Kind.UNGATE):
            state = self.engine.scheduler.tenant_state(job.tenant)
            assert state is not S.STUCK, f"{job.kind.value} of {job.tenant}, which is stuck"
        self.running.append(job)

    def end(self, job: Job, done: list[Event] | None = None) -> None:
        self.running.remove(job)
        if job in self.hung:
            self.hung.remove(job)
            thread, returns, out = self.threads.pop(job)
            returns.set()
            thread.join()
            done = out[0]
        if done is None:  # (a ghost's calls touch processes that are gone: nothing)
            done = [] if job in self.ghosts else self.effects.carry_out(job)
        events = [] if job in self.ghosts else done
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
        """The hung calls return at last (their jobs are overdue, or late)."""
        for job in list(self.hung):
            self.end(job)

    def ghost_tenants(self) -> list[str]:
        """Tenants with a hung call (it holds their lane)."""
        return [j.tenant for j in self.hung]

    def return_one(self, pick: int) -> None:
        """One hung call returns, at whatever moment this is."""
        if self.hung:
            self.end(self.hung[pick % len(self.hung)])

    # ---- checks ------------------------------------------------------------

    def check(self) -> None:
        view = self.engine.scheduler.view(self.clock.now())
        world = self.world
        assert not world.wrong, world.wrong
        records = self.effects.state.records
        busy = {j.tenant for j in self.running} | {j.tenant for j in self.runner.pending}
        busy |= {j.tenant for j in self.engine.executor.queued}
        busy |= set(self.ghost_tenants())
        for t in view.tenants:
            # The core never believes a tenant gated while the world has it running.
            if t.gated and not t.gate_pending and t.tenant not in busy:
                assert world.held(t.tenant), f"{t.tenant} runs, the core has it gated"
            # Nor does the world hold one gated that the core lets run (a stuck one
            # whose gate did not take may run, or not): a gate that kiwid gave up on
            # does nothing when it comes back, or is settled; and no gate is asked of
            # a tenant while an operator's release of it runs.
            settled = t.state is not S.STUCK
            if not t.gated and settled and t.tenant not in busy:
                assert not world.held(t.tenant), f"{t.tenant} gated, the core lets it run"
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
            # By the world's truth: the tenants in a burst that it has running there,
            # whatever is in flight or returns late. One the core let go must be the
            # only one, but for a tenant the core knows may run (its gate asked and not
            # answered: it ran before its burst was seen; or stuck, its gate not taken):
            # the core lets nobody go beside those, and this check sees to that too.
            here = [t for t in view.tenants if gpu.gpu in t.gpus]
            runs = [
                t.tenant
                for t in here
                if t.state not in (S.IDLE, S.RELEASED)
                and not world.held(t.tenant)
                and not t.gate_pending
                and not (t.fault is not None and not t.fault.contained)
            ]
            let_go = [t.tenant for t in here if t.state in (S.HOLDER, S.CORUNNING) and not t.gated]
            if any(name in runs for name in let_go):
                assert len(runs) <= 1, f"{runs} run on GPU {gpu.gpu}, {let_go} let go"

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
                if tenant in self.tracker.tenants and not self.world.held(tenant):
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


@dataclass(frozen=True)
class Returns:
    """A hung driver call returns (which one: an index into those hung)."""

    pick: int


script_steps = st.one_of(
    st.tuples(events, picks, st.just(frozenset())),
    st.tuples(st.floats(0.05, 40.0), picks, st.frozensets(tenants, min_size=1)),
    st.tuples(st.builds(Returns, st.integers(0, 5)), picks, st.just(frozenset())),
)
lanes = st.builds(Lanes, out=st.integers(1, 3), in_=st.integers(1, 2), shared=st.booleans())


@pytest.fixture(scope="module")
def tenant_pids() -> Iterator[dict[str, int]]:
    """A real process for each tenant (a release asks /proc whether it lives)."""
    procs = {t: subprocess.Popen(["sleep", "3600"]) for t in TENANTS}
    try:
        yield {t: p.pid for t, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


@pytest.fixture
def harnesses() -> Iterator[list[Harness]]:
    made: list[Harness] = []
    yield made
    for h in made:
        h.close()


@pytest.mark.timeout(600)  # hypothesis shrinks a failure within this: a bug is shown whole
@settings(max_examples=200, deadline=None, report_multiple_bugs=False)
@given(
    st.fixed_dictionaries(dict.fromkeys(GPUS, policies)),
    st.lists(st.builds(TenantAttached, tenants, gpu_sets), min_size=2, max_size=5),
    st.lists(script_steps, min_size=5, max_size=50),
    st.lists(st.sampled_from(FATES), min_size=1, max_size=8),
    lanes,
)
def test_the_engine_keeps_order_memory_and_windows_whatever_the_driver_does(
    tenant_pids, initial, opening, script, fates, lanes
) -> None:
    h = Harness(initial, fates, lanes, tenant_pids)
    try:
        for event in opening:
            h.feed(event)
        for what, order, busy in script:
            if isinstance(what, float):
                h.pass_time(what, order, busy)
            elif isinstance(what, Returns):
                h.return_one(what.pick)
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
