"""What a follow asks the driver about, beside its tenant's lane.

The driver serialises the calls on one process: on an H200 a state asked while
the process was being checkpointed returned with the checkpoint
(``bench/gpu/concurrent_calls_probe.py``), and kiwid's follow, asking the state of
a waiting tenant's process as its checkpoint began, ran past its deadline; its
fence then froze the process mid-checkpoint. So while the tenant's lane has a job,
the follow leaves the processes that job works on (those its record names) to it.
"""

from __future__ import annotations

from pathlib import Path

from kiwid.core.actions import SwapOut
from kiwid.core.scheduler import Scheduler
from kiwid.daemon.engine.effects import Effects
from kiwid.daemon.engine.engine import Engine
from kiwid.daemon.engine.executor import Kind
from kiwid.daemon.gating.gates import NullGate
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.gating.state import StateFile
from kiwid.daemon.tenants.tracker import TenantTracker

HELD, NEW, NO_CONTEXT = 101, 102, 103


def engine(tmp_path: Path) -> Engine:
    state = StateFile(tmp_path)
    state.put(GatedRecord("t", "cuda-lock", None, None, (HELD,), starts=(7,)))
    tracker = TenantTracker(lambda pid: None, alive=lambda pid, start=None: True)
    return Engine(Scheduler(), tracker, Effects(NullGate(), state), lambda: 0.0)


def follow_pids(e: Engine) -> dict[int, int]:
    job = e.executor.job(Kind.FOLLOW, "t", frozenset(), pids={HELD: 7, NEW: 8, NO_CONTEXT: 9})
    return e._followable(job)


def test_with_its_lane_empty_a_follow_looks_at_every_process(tmp_path: Path) -> None:
    assert follow_pids(engine(tmp_path)) == {HELD: 7, NEW: 8, NO_CONTEXT: 9}


def test_beside_a_lane_job_a_follow_looks_only_at_what_kiwid_does_not_hold(
    tmp_path: Path,
) -> None:
    e = engine(tmp_path)
    e.executor.job(SwapOut("t", (("0", 1),), epoch=0), "t", frozenset({"0"}))  # queued
    assert follow_pids(e) == {NEW: 8, NO_CONTEXT: 9}
    (swap,) = [j for j in e.executor.startable() if j.kind is Kind.SWAP_OUT]  # and running
    assert follow_pids(e) == {NEW: 8, NO_CONTEXT: 9}
    e.executor.finish(swap)
    assert follow_pids(e) == {HELD: 7, NEW: 8, NO_CONTEXT: 9}


def test_another_tenants_lane_does_not_narrow_the_follow(tmp_path: Path) -> None:
    e = engine(tmp_path)
    e.executor.job(SwapOut("u", (("0", 1),), epoch=0), "u", frozenset({"0"}))
    assert follow_pids(e) == {HELD: 7, NEW: 8, NO_CONTEXT: 9}
