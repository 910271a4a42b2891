"""The executor's lanes: a checkpoint and a restore side by side, one tenant's moves in order.

And a follow (a gated tenant's new processes) that moves memory: a checkpoint too.
"""

from __future__ import annotations

from pathlib import Path

from kiwid.adapters.cudalock import CudaLock
from kiwid.core.events import SwapIn, SwapOut
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


def test_a_follow_that_moves_memory_takes_the_checkpoint_lane_and_one_that_locks_does_not() -> None:
    ex = Executor()
    ex.job(SwapOut("a"), "a", GPU0)
    ex.job(Kind.FOLLOW, "b", GPU0, sizes={"0": 2**30})  # b is in host RAM: a checkpoint
    ex.job(Kind.FOLLOW, "c", GPU0, pids={7: 0})  # c's memory is on the card: a lock
    assert kinds(ex.startable()) == [("a", Kind.SWAP_OUT), ("c", Kind.FOLLOW)]
    [a] = [j for j in ex.running if j.tenant == "a"]
    ex.finish(a)
    assert kinds(ex.startable()) == [("b", Kind.FOLLOW)]


def test_a_follow_that_moves_memory_has_its_checkpoint_in_its_deadline(
    cuda_library: Path,
) -> None:
    swapper = CheckpointSwapper(CudaLock(str(cuda_library)))
    deadline_s = deadlines(lambda: 2.0, lambda: 1.0, swapper)
    ex = Executor()
    locks = ex.job(Kind.FOLLOW, "c", GPU0, pids={7: 0})
    moves = ex.job(Kind.FOLLOW, "b", GPU0, sizes={"0": 8 * 2**30})
    assert deadline_s(locks, 0) == 2 * 2.0 + 1.0
    checkpoint = swapper.expected_s(8 * 2**30, "out")
    assert deadline_s(moves, moves.nbytes) == 2 * 2.0 + 1.0 + 2 * checkpoint
