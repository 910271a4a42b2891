"""The executor's lanes: a checkpoint and a restore side by side, one tenant's moves in order."""

from __future__ import annotations

from kiwid.core.events import SwapIn, SwapOut
from kiwid.daemon.engine.executor import Executor, Kind, Lanes

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
