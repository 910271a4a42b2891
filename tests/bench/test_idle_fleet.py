"""The idle-fleet bench's figures (bench/_idle_fleet_report.py) on made-up records: no kiwid."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is no package: its modules import each other

import _idle_fleet_report as rep  # noqa: E402

S1 = "cgroup:/kiwi-if-1/s1"
S2 = "cgroup:/kiwi-if-1/s2"
TRAINER = "cgroup:/kiwi-if-1/trainer"
GIB = 2**30


def line(direction: str, key: str, nbytes: int = 3 * GIB, name: str | None = None) -> str:
    who = key if name is None else f"{name} ({key})"
    return f"[INFO] Swapped {direction} {who}: {nbytes} bytes in 0.56 s (5.74 GB/s)"


def test_a_swap_line_gives_its_direction_tenant_key_bytes_and_seconds() -> None:
    swap = rep.parse_swap(line("in", S1, name="/kiwi-if-1/s1"))
    assert swap == rep.Swap("in", S1, 3 * GIB, 0.56)
    assert rep.parse_swap(line("out", S2)) == rep.Swap("out", S2, 3 * GIB, 0.56)
    assert rep.parse_swap("[INFO] Grant: s1 (cgroup:/kiwi-if-1/s1) holds GPU 0") is None
    assert rep.parse_swap("[ERROR] Swap failed: in of s1: no room") is None


def test_restores_count_in_lines_of_one_tenant_within_the_window_and_after_parking() -> None:
    lines = [
        (1.0, line("in", S2)),  # before the window
        (5.0, line("out", S2)),
        (6.0, line("in", S2, name="s2")),
        (7.0, "[INFO] Early release: s2 yields GPU 0"),
        (8.0, line("in", S1)),
        (12.0, line("in", S2)),
        (30.0, line("in", S2)),  # after the window
    ]
    found = rep.swaps(lines, 2.0, 20.0)
    assert rep.restores(found, S2) == 2
    assert rep.restores(found, S2, after=10.0) == 1
    assert rep.restores(found, S1) == 1
    assert rep.moved(found, "in") == 9 * GIB
    assert rep.moved(found, "out") == 3 * GIB


def sample(t: float, runs: bool, s2: str = "parked") -> rep.Sample:
    return rep.Sample(t, TRAINER if runs else S1, runs, {S2: s2, TRAINER: "holder"}, 0)


def test_the_trainers_share_leaves_out_the_time_requests_are_served() -> None:
    samples = [sample(t, runs=not 10 <= t < 20) for t in range(0, 40)]
    share, counted = rep.trainer_share(samples, 0, 40, [])
    assert share == pytest.approx(0.75)
    assert counted == 40
    requests = [rep.Request(10.0, 2.0, "parked")]
    windows = rep.busy_windows(requests, tail=8.0)  # answered at 12, the GPU back at 20
    assert windows == [(10.0, 20.0)]
    share, counted = rep.trainer_share(samples, 0, 40, windows)
    assert share == pytest.approx(1.0)
    assert counted == pytest.approx(30)
    failed = rep.busy_windows([rep.Request(30.0, None, "parked", error="timed out")], 0)
    assert failed == [(30.0, math.inf)]
    assert rep.trainer_share(samples, 0, 40, failed)[1] == pytest.approx(30)


def test_first_in_state_and_state_at() -> None:
    samples = [sample(0, True, "idle"), sample(1, True, "waiting"), sample(2, True, "parked")]
    assert rep.first_in_state(samples, S2, "parked") == 2
    assert rep.first_in_state(samples, S1, "parked") is None
    at = rep.state_at(samples, 1.5)
    assert at is not None and at.states[S2] == "waiting"
    assert rep.state_at(samples, -1) is None


def test_nearest_rank_percentiles() -> None:
    values = [float(v) for v in range(1, 101)]
    assert rep.percentiles(values, (50, 99, 100)) == [50.0, 99.0, 100.0]
    assert rep.percentiles([3.0], (50, 99)) == [3.0, 3.0]
    assert all(math.isnan(v) for v in rep.percentiles([], (50, 99)))


def test_the_bound_of_a_parked_servers_first_request() -> None:
    card, server, reserve = 10 * GIB, 3 * GIB, GIB
    assert rep.room_bytes(4 * GIB, server, reserve, card, server) == 0
    # 1 GiB short: a whole server leaves.
    assert rep.room_bytes(7 * GIB, server, reserve, card, server) == server
    bound = rep.restore_bound(
        poll=0.5, gate=0.001, size=server, room=server, in_rate=6e9, out_rate=2.2e9
    )
    assert bound == pytest.approx(0.5 + 0.001 + server / 6e9 + server / 2.2e9 + 1)
    assert rep.verdict(True) == "PASS" and rep.verdict(False) == "FAIL"
    assert rep.verdict(None) == "n/a"
