"""What the engine does with a job that ran past its deadline, when it returns.

The real engine and its real effects over the scripted world of
test_engine_properties.py, one scenario at a time: which jobs it asks for, and
with what it starts them. (The driver-side half, on the driver double, is
test_late_locks.py.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace

import pytest

from kiwid.core.events import (
    ActivitySeen,
    ReleaseAsked,
    Released,
    TenantAttached,
    TenantFaulted,
    Tick,
)
from kiwid.core.model import GpuPolicy, Mode, SwapMode, TenantState
from kiwid.daemon.engine import mend_jobs
from kiwid.daemon.engine.executor import Job, Kind, Lanes
from kiwid.daemon.gating.cudagate import CudaLockGate
from kiwid.daemon.gating.record import GatedRecord
from tests.daemon.test_engine_properties import DEADLINE_S, GiB, Harness, ScriptedGate

GPU = frozenset({"0"})


@pytest.fixture
def h() -> Iterator[Harness]:
    policy = GpuPolicy(
        tq_s=300, idle_release_s=300, mode=Mode.EXCLUSIVE, capacity_bytes=40 * GiB,
        reserve_bytes=GiB, swap=SwapMode.NONE,
    )  # fmt: skip
    harness = Harness({"0": policy, "1": policy}, ["ok"], Lanes())
    started: list[tuple[Job, bool]] = []
    start = harness.runner.start

    def noting(job: Job) -> None:
        started.append((job, job.hold.is_set()))  # what it starts with
        start(job)

    harness.runner.start = noting  # type: ignore[method-assign]
    harness.started = started  # type: ignore[attr-defined]
    try:
        yield harness
    finally:
        harness.close()


def t1_waits_gated(h: Harness) -> None:
    """t0 holds GPU 0; t1 waits for it, gated."""
    for tenant in ("t0", "t1"):
        h.feed(TenantAttached(tenant, GPU))
        h.feed(ActivitySeen(tenant))
        h.drain([0])
    assert h.engine.scheduler.tenant_state("t1") is TenantState.WAITING
    assert "t1" in h.world.gated


def take(h: Harness, kind: Kind, tenant: str) -> Job:
    """Hand the pending ``kind`` job of ``tenant`` to the test (its call hangs)."""
    job = next(j for j in h.runner.pending if j.kind is kind and j.tenant == tenant)
    h.runner.pending.remove(job)
    h.start(job)
    h.hung.append(job)
    return job


def asked(h: Harness, kind: Kind, tenant: str) -> list[Job]:
    jobs = [*h.runner.pending, *h.engine.executor.queued]
    return [j for j in jobs if j.kind is kind and j.tenant == tenant]


def test_a_follow_past_its_deadline_on_a_gated_tenant_is_fenced(h: Harness) -> None:
    # The follow's fault is moot for a tenant gated already (its gate was answered),
    # so it is not stuck; its new process may run all the same: it is fenced.
    t1_waits_gated(h)
    h.engine.follow("t1", {4242: 0})
    take(h, Kind.FOLLOW, "t1")
    h.clock.advance(DEADLINE_S + 1)
    h.engine.expire()
    assert asked(h, Kind.FENCE, "t1"), h.engine.executor.queued
    h.drain([0])  # the fence (none here: the scripted gate has no freezer)
    # Its new process may run: t1 is stuck, never swapped or let go as if gated whole.
    assert h.engine.scheduler.tenant_state("t1") is TenantState.STUCK


def test_a_late_lock_is_settled_by_the_word_after_the_release_asked_before(h: Harness) -> None:
    # A follow of t1 hangs; then t1 is stuck, contained (a thaw refused), and the
    # operator releases it. The follow returns while the release is still to run:
    # the settle that follows must go by the release's outcome (t1 runs), not by
    # what the scheduler said as the follow returned (gated).
    t1_waits_gated(h)
    h.engine.follow("t1", {4242: 0})
    follow = take(h, Kind.FOLLOW, "t1")
    h.clock.advance(DEADLINE_S + 1)
    h.engine.expire()
    h.drain([0])
    h.engine.apply([TenantFaulted("t1", "ungate", "cgroup.freeze refused the thaw")])
    h.feed(ReleaseAsked("t1"))
    assert asked(h, Kind.RELEASE, "t1")
    assert h.engine.scheduler.gated("t1"), "the release has not run yet"
    h.end(follow)  # returns late, the release still to run
    assert asked(h, Kind.SETTLE, "t1")
    h.drain([0])
    assert h.engine.scheduler.tenant_state("t1") is TenantState.RELEASED
    started = h.started  # type: ignore[attr-defined]
    settle, held = next((j, held) for j, held in started if j.kind is Kind.SETTLE)
    assert settle.tenant == "t1" and not held, "settled as if kiwid held t1"


@pytest.mark.parametrize("late", [False, True])
def test_a_late_jobs_fault_is_not_written_into_the_record_that_stands_now(
    h: Harness, late: bool
) -> None:
    # A late gate's "gave up" fault landed in the healthy record a later gate wrote,
    # and a restarted kiwid brought the tenant back stuck.
    t1_waits_gated(h)
    job = Job(99, "t1", Kind.GATE, GPU)  # no info: it fails at once
    if late:
        job.given_up.set()
    (fault,) = h.effects.carry_out(job)
    assert isinstance(fault, TenantFaulted)
    recorded = h.effects.state.records["t1"].fault
    assert (recorded is None) == late, recorded


def test_a_release_keeps_a_fence_written_while_it_ran(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The release hung past its deadline, kiwid fenced the tenant (a record that
    # thaws it); when the release returned, it dropped that record: frozen for good.
    t1_waits_gated(h)
    state = h.effects.state
    fenced = replace(state.records["t1"], fenced=True)

    def fenced_meanwhile(record: object, undo: object, *args: object) -> None:
        state.put(fenced)  # what kiwid's fence wrote while the release hung
        return  # restored, unlocked and thawed what it read

    monkeypatch.setattr(mend_jobs.recovery, "release", fenced_meanwhile)
    job = Job(99, "t1", Kind.RELEASE, GPU, h.tracker.tenants["t1"])
    mend_jobs.release(h.effects.tools, job)
    assert state.records.get("t1") == fenced


def test_a_release_whose_restore_fails_names_the_command_that_tries_again(h: Harness) -> None:
    # The operator's release could not restore the tenant's memory, and told the
    # operator to run `kiwid recover` again: a command for when kiwid is stopped.
    t1_waits_gated(h)
    state, me = h.effects.state, os.getpid()  # a live process, as the release checks
    away = replace(state.records["t1"], pids=(me,), swapped={"0": GiB}, swap_method="checkpoint")
    state.put(away)
    h.world.out.add("t1")
    h.world.fates = ["fail"]  # the restore: out of memory
    job = Job(99, "t1", Kind.RELEASE, GPU, h.tracker.tenants["t1"])
    (released,) = mend_jobs.release(h.effects.tools, job)
    assert isinstance(released, Released) and not released.complete
    assert "run `kiwictl release t1` again" in released.note, released.note
    assert state.records["t1"] == away


class FencingGate(ScriptedGate, CudaLockGate):
    """The scripted gate with a freezer fence, as the CUDA lock gate has: a fenced
    tenant is held in the world until its fence is undone."""

    def fence(self, tenant: object, record: GatedRecord) -> GatedRecord:
        return replace(record, cgroup_v2=f"/kiwi/{record.tenant}", fenced=True)

    def freeze_fence(self, record: GatedRecord) -> None:
        self.world.gated.add(record.tenant)

    def unfence(self, record: GatedRecord) -> GatedRecord:
        return replace(record, fenced=False)

    def held(self, pids: object) -> list[int]:
        return [os.getpid()] if "t1" in self.world.gated else []


def loose_harness(fencing: bool = False) -> Harness:
    """TQ 5 s; ``fencing``: a gate with a freezer fence."""
    policy = GpuPolicy(
        tq_s=5, idle_release_s=300, mode=Mode.EXCLUSIVE, capacity_bytes=40 * GiB,
        reserve_bytes=GiB, swap=SwapMode.NONE,
    )  # fmt: skip
    h = Harness({"0": policy, "1": policy}, ["ok"], Lanes())
    if fencing:
        h.effects.tools.gate = FencingGate(h.world)  # type: ignore[assignment]
    return h


def t1_loose_its_gate_in_flight_and_released(fencing: bool = False) -> tuple[Harness, Job]:
    """t0 holds; t1 is stuck and may run; its gate, tried again, is in flight when the
    operator asks for its release (queued behind the gate)."""
    h = loose_harness(fencing)
    t1_waits_gated(h)
    h.world.gated.discard("t1")  # a hung checkpoint left it running
    h.engine.apply([TenantFaulted("t1", "swap-out", "checkpoint hung", contained=False)])
    h.clock.advance(5)  # a TQ
    h.feed(Tick())
    gate = take(h, Kind.GATE, "t1")
    h.hung.remove(gate)  # in flight: the test ends it
    h.feed(ReleaseAsked("t1"))
    assert asked(h, Kind.RELEASE, "t1")
    return h, gate


def released_and_running(h: Harness) -> None:
    assert h.engine.scheduler.tenant_state("t1") is TenantState.RELEASED
    assert "t1" not in h.world.gated, "released, yet held"
    assert "t1" not in h.effects.state.records


def test_a_gate_that_takes_before_the_release_runs_leaves_the_release_the_word() -> None:
    h, gate = t1_loose_its_gate_in_flight_and_released()
    try:
        h.end(gate)  # it takes; the release runs next (the check runs at every step)
        h.drain([0])
        released_and_running(h)
    finally:
        h.close()


def test_a_gate_that_fails_while_a_release_waits_asks_no_gate_behind_it() -> None:
    h, gate = t1_loose_its_gate_in_flight_and_released()
    try:
        h.world.fates = ["fail"]
        h.end(gate)
        h.world.fates = ["ok"]
        release = take(h, Kind.RELEASE, "t1")  # it restores the whole tenant: slow
        h.hung.remove(release)
        h.clock.advance(5 * 3)  # three TQs
        h.engine.expire()
        h.feed(Tick())
        assert not asked(h, Kind.GATE, "t1"), "a gate asked behind the release"
        h.end(release)
        h.drain([0])
        released_and_running(h)
    finally:
        h.close()


def test_a_gate_past_its_deadline_fences_nothing_that_the_release_let_go() -> None:
    # The gate hung past its deadline with the release queued: kiwid queued a fence
    # behind the release, and it froze the tenant the release had just let run.
    h, gate = t1_loose_its_gate_in_flight_and_released(fencing=True)
    try:
        h.hung.append(gate)
        h.clock.advance(DEADLINE_S + 1)
        h.engine.expire()
        assert asked(h, Kind.FENCE, "t1")  # behind the release
        h.drain([0])
        released_and_running(h)
        h.release_hung()  # the gate's call returns: what it did is settled
        h.drain([0])
        released_and_running(h)
    finally:
        h.close()


def release_past_its_deadline(h: Harness) -> Job:
    """t1 stuck (contained); the operator's first release hangs past its deadline."""
    t1_waits_gated(h)
    h.engine.apply([TenantFaulted("t1", "ungate", "cgroup.freeze refused the thaw")])
    h.feed(ReleaseAsked("t1"))
    first = take(h, Kind.RELEASE, "t1")
    h.clock.advance(DEADLINE_S + 1)
    h.engine.expire()  # its fence is asked
    return first


def second_release_runs_its_course(h: Harness) -> None:
    """The second release runs for a TQ (a slow restore), then ends: t1 is released."""
    second = take(h, Kind.RELEASE, "t1")
    h.hung.remove(second)
    h.clock.advance(5)
    h.feed(Tick())
    assert not asked(h, Kind.GATE, "t1"), "a gate asked behind the release"
    h.feed(ReleaseAsked("t1"))
    assert not asked(h, Kind.RELEASE, "t1"), "a third release taken while one runs"
    h.end(second)
    h.drain([0])
    released_and_running(h)


@pytest.mark.parametrize("fencing", [False, True])
def test_a_fence_told_while_a_second_release_waits_ends_not_that_release(fencing: bool) -> None:
    # A review found it: the first release ran past its deadline; the operator asked
    # again while its fence ran. The fence told the first release's fault again, and
    # that ended the second one's "under way": a gate was asked behind it.
    h = loose_harness(fencing)
    try:
        release_past_its_deadline(h)
        fence = take(h, Kind.FENCE, "t1")
        h.hung.remove(fence)
        h.feed(ReleaseAsked("t1"))
        assert asked(h, Kind.RELEASE, "t1")
        h.end(fence)
        second_release_runs_its_course(h)
    finally:
        h.close()


def test_a_release_returning_late_ends_not_the_release_asked_since() -> None:
    # The first release's hung call returned while the second ran: kiwid held t1
    # gated (fenced), so it made t1 free to run, and that fault ended the second
    # release's "under way": a gate was asked behind it, and locked t1 once released.
    h = loose_harness(fencing=True)
    try:
        first = release_past_its_deadline(h)
        h.drain([0])  # the fence
        h.feed(ReleaseAsked("t1"))
        h.end(first)  # returns late, while the second release waits its turn
        second_release_runs_its_course(h)
    finally:
        h.close()


def test_the_fence_of_a_gate_past_its_deadline_makes_its_tenant_contained() -> None:
    # The fence told the late gate's fault again, as an answer to a gate; the late
    # fault had answered that gate already, so the core took the fence's word for a
    # stale answer: t1 stayed "may run" (its gate tried every TQ, nobody else let go
    # on its GPU) though the freezer held it.
    h = loose_harness(fencing=True)
    try:
        h.feed(TenantAttached("t0", GPU))
        h.feed(ActivitySeen("t0"))
        h.drain([0])
        h.feed(TenantAttached("t1", GPU))
        h.feed(ActivitySeen("t1"))
        gate = take(h, Kind.GATE, "t1")
        h.clock.advance(DEADLINE_S + 1)
        h.engine.expire()
        h.drain([0])  # the fence
        assert "t1" in h.world.gated
        view = next(t for t in h.engine.scheduler.view(h.clock.now()).tenants if t.tenant == "t1")
        assert view.state is TenantState.STUCK and view.fault is not None
        assert view.fault.contained, view.fault
        h.end(gate)
        h.drain([0])
    finally:
        h.close()


def test_a_release_returning_after_its_deadline_lets_go_of_nothing_held_since() -> None:
    # The release's restore hung past its deadline; kiwid gave up on it and held t1
    # with its fence. When the call came back, the release went on: it unlocked and
    # thawed t1 behind kiwid's back, beside t0, which holds the GPU.
    h = loose_harness(fencing=True)
    try:
        first = release_past_its_deadline(h)
        h.drain([0])  # the fence
        assert "t1" in h.world.gated
        h.end(first)  # its call returns late
        assert "t1" in h.world.gated, "a release kiwid gave up on let t1 go"
        h.drain([0])
    finally:
        h.close()
