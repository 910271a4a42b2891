"""The fault matrix's judge (bench/_faults_judge.py) on made-up samples: no kiwid, no GPU.

The matrix (tests/daemon/test_fault_matrix.py) asserts that the judge counted
nothing; these show that it counts what it must: two tenants running in two
samples in a row, a healthy tenant without progress past the bound. And what
it must not: one sample of overlap at a hand-over, a released tenant, a paused
judge, the fault's own target.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is no package: its modules import each other

import driver_faults  # noqa: E402
from _faults_judge import Judge  # noqa: E402
from _faults_rig import Snapshot  # noqa: E402


@dataclass
class Rig:
    """Nothing to sample: the tests call the judge with their own snapshots."""

    daemon: object = None
    tenants: list[object] = field(default_factory=list)


def judge(bound_s: float = 10.0) -> Judge:
    j = Judge(Rig(), bound_s)  # type: ignore[arg-type]
    j.begin("lock/fail-999", "c")
    j.states = {"a": "holder", "b": "waiting", "c": "waiting"}
    return j


def feed(j: Judge, samples: list[tuple[float, set[str], dict[str, float]]]) -> None:
    for now, running, progress in samples:
        j._judge(Snapshot(running, progress), now)


ZERO = {"a": 0.0, "b": 0.0, "c": 0.0}


def test_two_tenants_running_in_two_samples_in_a_row_is_one_window_violation() -> None:
    j = judge()
    feed(j, [(t, {"a", "b"}, ZERO) for t in (0.0, 0.05, 0.1, 0.15)])
    assert j.counts["lock/fail-999"].window == 1, "one episode, counted once"
    assert "['a', 'b'] ran together" in j.details[0]
    feed(j, [(0.2, {"a"}, ZERO), (0.25, {"a", "b"}, ZERO), (0.3, {"a", "b"}, ZERO)])
    assert j.counts["lock/fail-999"].window == 2


def test_a_hand_over_seen_in_one_sample_is_no_violation() -> None:
    j = judge()
    feed(j, [(0.0, {"a"}, ZERO), (0.05, {"a", "b"}, ZERO), (0.1, {"b"}, ZERO)])
    feed(j, [(0.15, {"b", "c"}, ZERO), (0.2, {"c", "a"}, ZERO), (0.25, {"a"}, ZERO)])
    assert j.counts["lock/fail-999"].window == 0
    assert j.counts["lock/fail-999"].handovers == 2


def test_a_released_tenant_and_a_paused_judge_count_no_window() -> None:
    j = judge()
    j.set_released("b", True)
    feed(j, [(t, {"a", "b"}, ZERO) for t in (0.0, 0.05, 0.1)])
    j.set_released("b", False)
    j.pause("kiwid")
    feed(j, [(t, {"a", "b"}, ZERO) for t in (0.15, 0.2, 0.25)])
    assert j.counts["lock/fail-999"].window == 0
    # Resumed: judged again once at most one runs (kiwid gated the others).
    j.resume("kiwid", grace_s=60)
    feed(j, [(0.3, {"a", "b"}, ZERO), (0.35, {"a", "b"}, ZERO)])
    assert j.counts["lock/fail-999"].window == 0
    feed(j, [(0.4, {"a"}, ZERO), (0.45, {"a", "b"}, ZERO), (0.5, {"a", "b"}, ZERO)])
    assert j.counts["lock/fail-999"].window == 1


def test_a_lost_gpu_pauses_the_judge_until_kiwid_gates_again() -> None:
    j = judge()
    lost = [Snapshot({"a", "b"}, ZERO, lost=True) for _ in range(3)]
    for i, snap in enumerate(lost):
        j._judge(snap, i * 0.05)
    feed(j, [(0.2, {"a", "b"}, ZERO), (0.25, {"a", "b"}, ZERO), (0.3, {"b"}, ZERO)])
    assert j.counts["lock/fail-999"].window == 0
    feed(j, [(0.35, {"a", "b"}, ZERO), (0.4, {"a", "b"}, ZERO)])
    assert j.counts["lock/fail-999"].window == 1


def test_a_healthy_tenant_without_progress_past_the_bound_is_a_rotation_violation() -> None:
    j = judge(bound_s=10)
    # a progresses; b does not for 12 s; c is the fault's target (not judged).
    feed(j, [(float(t), {"a"}, {"a": float(t), "b": 1.0, "c": 0.0}) for t in range(13)])
    assert j.counts["lock/fail-999"].rotation == 1
    assert "b made no progress for 11.0 s" in j.details[0]
    feed(j, [(13.0, {"b"}, {"a": 12.0, "b": 2.0, "c": 0.0})])
    feed(j, [(float(t), {"b"}, {"a": 12.0, "b": float(t), "c": 0.0}) for t in range(14, 20)])
    assert j.counts["lock/fail-999"].rotation == 1, "a waits less than the bound"


def test_stuck_and_released_tenants_are_not_judged_by_the_rotation() -> None:
    j = judge(bound_s=5)
    j.states = {"a": "holder", "b": "stuck", "c": "released"}
    j.begin("state/stuck", None)
    feed(j, [(float(t), {"a"}, {"a": float(t), "b": 0.0, "c": 0.0}) for t in range(20)])
    assert j.counts["state/stuck"].rotation == 0


def test_error_kinds_take_out_tenants_pids_and_numbers() -> None:
    text = (
        "[ERROR] /kiwi-df-1/t1 (cgroup:/kiwi-df-1/t1) is stuck: swap in: restore of pid 12: "
        "CUDA_ERROR_UNKNOWN (999): cuCheckpointProcessRestore\n"
        "[ERROR] /kiwi-df-1/t2 (cgroup:/kiwi-df-1/t2) is stuck: swap in: restore of pid 34: "
        "CUDA_ERROR_UNKNOWN (999): cuCheckpointProcessRestore\n"
        "[INFO] Grant: x\n"
    )
    kind = "T is stuck: swap in: restore of pid N: CUDA_ERROR_UNKNOWN (N): "
    kind += "cuCheckpointProcessRestore"
    assert driver_faults.error_kinds([text]) == {kind: 2}


def test_cells_are_chosen_by_pattern_and_a_pattern_that_matches_none_is_refused() -> None:
    cells = driver_faults.all_cells(sim=False)
    assert ("restore", "oom") in cells and ("any", "gpu-lost") in cells
    # every operation x every kind, the two faults of their own, a retry and a release
    # during each operation's hang, and the three escapes of issue 25
    assert len(cells) == 5 * 6 + 2 + 5 * 2 + 3
    assert {("checkpoint", "newproc"), ("lock", "newproc"), ("admission", "late-context")} <= set(
        cells
    )
    assert driver_faults.select(cells, "restore/*,lock/stuck") == [
        *(c for c in cells if c[0] == "restore"),
        ("lock", "stuck"),
    ]
    with pytest.raises(ValueError, match="'lock/nothing' matches no cell"):
        driver_faults.select(cells, "lock/nothing")
    assert driver_faults.all_cells(sim=True) == [
        (op, kind) for op in ("checkpoint", "restore") for kind in ("fail", "hang", "stuck")
    ]


def test_the_table_has_a_row_per_cell_the_restarts_and_the_totals() -> None:
    row = {
        "runs": 2,
        "window": 1,
        "memory": 0,
        "rotation": 3,
        "tracebacks": 0,
        "operator": 0,
        "endings": {e: 1 if e == "mended" else 0 for e in driver_faults.ENDINGS},
        "seconds": 10.0,
    }
    rep = {
        "cells": {"lock/fail-999": row, driver_faults.RESTARTS: {**row, "window": 0}},
        "totals": {"window": 1, "memory": 0, "rotation": 6, "tracebacks": 0, "operator": 0},
        "set_up": {"window": 0, "rotation": 0},
        "cleanup": [],
        "bench_errors": [],
    }
    lines = driver_faults.table(rep).splitlines()
    assert lines[0].split()[:7] == [
        "cell",
        "runs",
        "window",
        "memory",
        "rotation",
        "tracebac",
        "operator",
    ]
    # runs, the five violations, the five endings (absorbed, mended, ...), s/run
    assert " ".join(lines[1].split()) == "lock/fail-999 2 1 0 3 0 0 0 1 0 0 0 5.0"
    assert lines[2].startswith("restart/tenants-at-work ")
    assert " ".join(lines[3].split()) == "total 4 1 0 6 0 0"
    assert driver_faults.violations(rep) == 7
