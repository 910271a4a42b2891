"""The executor's lanes: one serial lane per tenant (kept past a deadline), jobs beside it,
the GPUs' swap lanes, and jobs of an epoch their tenant left, dropped.
"""

from __future__ import annotations

from pathlib import Path

from kiwid.adapters.cudalock import CudaLock
from kiwid.core.actions import Converge, Fence, Gate, SwapIn, SwapOut, Ungate
from kiwid.daemon.engine.deadlines import deadlines
from kiwid.daemon.engine.executor import Executor, Kind, Lanes
from kiwid.daemon.gating.swap import CheckpointSwapper
from tests.adapters.conftest import cuda_library

__all__ = ["cuda_library"]  # the fixture, shared with the adapter tests

GPU0 = frozenset({"0"})


def kinds(jobs: list) -> list[tuple[str, Kind]]:
    return [(j.tenant, j.kind) for j in jobs]


def test_a_checkpoint_and_a_restore_of_two_tenants_run_at_once() -> None:
    ex = Executor()
    ex.job(SwapOut("a"), "a", GPU0)
    ex.job(SwapIn("b"), "b", GPU0)
    assert kinds(ex.startable()) == [("a", Kind.SWAP_OUT), ("b", Kind.SWAP_IN)]


def test_one_tenants_moves_never_overlap_whatever_the_lanes() -> None:
    for lanes in (Lanes(), Lanes(out=3, in_=2), Lanes(shared=True, out=2)):
        ex = Executor(lanes)
        ex.job(SwapOut("a"), "a", GPU0)
        ex.job(SwapIn("a"), "a", GPU0)
        [first] = ex.startable()
        assert (first.tenant, first.kind) == ("a", Kind.SWAP_OUT)
        assert ex.startable() == []  # its restore waits for its checkpoint
        ex.finish(first)
        assert kinds(ex.startable()) == [("a", Kind.SWAP_IN)]


def test_checkpoint_lanes_bound_the_checkpoints_at_once() -> None:
    one, two = Executor(Lanes(out=1)), Executor(Lanes(out=2))
    for ex in (one, two):
        for t in ("a", "b", "c"):
            ex.job(SwapOut(t), t, GPU0)
    assert kinds(one.startable()) == [("a", Kind.SWAP_OUT)]
    assert kinds(two.startable()) == [("a", Kind.SWAP_OUT), ("b", Kind.SWAP_OUT)]


def test_a_shared_lane_runs_one_swap_of_either_kind() -> None:
    ex = Executor(Lanes(out=1, shared=True))
    ex.job(SwapOut("a"), "a", GPU0)
    ex.job(SwapIn("b"), "b", GPU0)
    assert kinds(ex.startable()) == [("a", Kind.SWAP_OUT)]


def test_other_gpus_have_lanes_of_their_own() -> None:
    ex = Executor()
    ex.job(SwapOut("a"), "a", GPU0)
    ex.job(SwapOut("b"), "b", frozenset({"1"}))
    assert len(ex.startable()) == 2


def test_an_overdue_job_keeps_its_tenants_lane_and_leaves_its_gpus_swap_lane() -> None:
    ex = Executor()
    out = ex.job(SwapOut("a", epoch=1), "a", GPU0)
    ex.job(SwapIn("a", epoch=1), "a", GPU0)
    ex.job(SwapOut("b", epoch=1), "b", GPU0)
    assert ex.startable() == [out]
    ex.start(out, now=0.0, due=10.0)
    assert ex.overdue(9.0) == [] and ex.next_due() == 10.0
    [(late, run)] = ex.overdue(10.0)
    assert late is out and run.overdue and ex.next_due() is None
    # a's restore waits for the hung checkpoint; b's checkpoint does not.
    assert kinds(ex.startable()) == [("b", Kind.SWAP_OUT)]
    assert ex.hung("a") == (out, 0.0)
    ex.finish(out)  # the call returned at last
    assert kinds(ex.startable()) == [("a", Kind.SWAP_IN)]


def test_a_follow_runs_beside_its_tenants_checkpoint_and_a_fence_beside_anything() -> None:
    ex = Executor()
    ex.job(SwapOut("a", epoch=1), "a", GPU0)
    ex.job(Kind.FOLLOW, "a", GPU0, epoch=1, pids={7: 0})
    ex.job(Kind.FOLLOW, "a", GPU0, epoch=1, pids={7: 0})  # one at a time
    ex.job(Fence("a", epoch=2), "a", GPU0)
    assert kinds(ex.startable()) == [
        ("a", Kind.SWAP_OUT),
        ("a", Kind.FOLLOW),
        ("a", Kind.FENCE),
    ]


def test_a_follow_is_not_overdue_before_the_lane_job_beside_it() -> None:
    # On an H200 a follow's state query waited in the driver for the checkpoint of
    # its process; past its own deadline it made the tenant stuck and fenced it,
    # and the freezer stalled the checkpoint it was waiting for.
    ex = Executor()
    follow = ex.job(Kind.FOLLOW, "a", GPU0, pids={7: 0})
    ex.job(Kind.FOLLOW, "b", GPU0, pids={8: 0})
    for job in ex.startable():
        ex.start(job, 0.0, 22.0)
    swap = ex.job(SwapOut("a"), "a", GPU0)
    assert ex.startable() == [swap]
    ex.start(swap, 3.0, 120.0)  # a's checkpoint starts beside its follow
    assert [(j.tenant, j.kind) for j, _ in ex.overdue(60.0)] == [("b", Kind.FOLLOW)]
    assert {j for j, _ in ex.overdue(121.0)} == {swap, follow}
    # and a follow that starts beside a lane job gets its deadline
    ex = Executor()
    swap = ex.job(SwapOut("a"), "a", GPU0)
    follow = ex.job(Kind.FOLLOW, "a", GPU0, pids={7: 0})
    for job in ex.startable():
        ex.start(job, 0.0, 22.0 if job is follow else 120.0)
    assert ex.next_due() == 120.0


def test_a_follow_never_runs_beside_or_after_a_job_that_may_let_its_tenant_go() -> None:
    for kind in (Kind.UNGATE, Kind.CONVERGE, Kind.RELEASE):
        ex = Executor()
        first = ex.job(kind, "a", GPU0)
        ex.job(Kind.FOLLOW, "a", GPU0, pids={7: 0})
        assert ex.startable() == [first], kind  # the follow waits for it
        ex.finish(first)
        assert kinds(ex.startable()) == [("a", Kind.FOLLOW)]
    # and a job that may let it go waits for a follow that runs
    ex = Executor()
    follow = ex.job(Kind.FOLLOW, "a", GPU0, pids={7: 0})
    assert ex.startable() == [follow]
    ex.job(Ungate("a"), "a", GPU0)
    assert ex.startable() == []
    ex.finish(follow)
    assert kinds(ex.startable()) == [("a", Kind.UNGATE)]


def test_a_job_of_an_epoch_its_tenant_left_is_dropped_when_its_turn_comes() -> None:
    ex = Executor()
    ex.job(Gate("a", epoch=1), "a", GPU0)
    ex.job(Converge("a", epoch=1), "a", GPU0)  # never moot: it reads the want as it starts
    ex.job(Ungate("a", epoch=2), "a", GPU0)
    started = ex.startable(moot=lambda job: job.epoch != 2)
    assert kinds(started) == [("a", Kind.CONVERGE)]
    assert kinds(ex.queued) == [("a", Kind.UNGATE)]


def test_an_ungate_waits_for_the_gates_asked_before_it_unless_they_hang() -> None:
    ex = Executor()
    gate = ex.job(Gate("a", epoch=1), "a", GPU0)
    assert ex.startable() == [gate]
    ex.start(gate, now=0.0, due=5.0)
    ex.job(Ungate("b", epoch=1), "b", GPU0)
    assert ex.startable() == []  # the previous holder is stopped first
    ex.overdue(5.0)  # its gate hangs: a is stuck and fenced; b need not wait for ever
    assert kinds(ex.startable()) == [("b", Kind.UNGATE)]


def test_deadlines_give_a_restore_twice_its_size_at_the_slowest_rate(
    cuda_library: Path,
) -> None:
    swapper = CheckpointSwapper(CudaLock(str(cuda_library)))
    deadline_s = deadlines(lambda: 2.0, lambda: 1.0, swapper)
    ex = Executor()
    follow = ex.job(Kind.FOLLOW, "c", GPU0, pids={7: 0})
    converge = ex.job(Kind.CONVERGE, "b", GPU0)
    assert deadline_s(follow, 0) == 2 * 2.0 + 1.0
    restore = swapper.expected_s(8 * 2**30, "in")
    assert deadline_s(converge, 8 * 2**30) == 2 * 2.0 + 2 * restore
