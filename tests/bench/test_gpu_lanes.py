"""bench/gpu/checkpoint_lanes.py's figures and its plan, on made-up timings: no GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

GPU_BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu"
sys.path.insert(0, str(GPU_BENCH))  # bench/gpu is no package: its modules import each other

import checkpoint_lanes  # noqa: E402
import lanes_analysis  # noqa: E402
from lanes_analysis import GIB, Case, Op  # noqa: E402


def test_aggregate_rates_of_the_made_up_cases():
    cases = {c.name: c for c in lanes_analysis.synthetic()}
    assert cases["checkpoint x1"].gbps == pytest.approx(2.3)
    assert cases["checkpoint x2"].gbps == pytest.approx(3.6)  # 2 x 16 GiB at 1.8 each
    assert cases["checkpoint x3"].gbps == pytest.approx(4.2)
    assert cases["restore x2"].gbps == pytest.approx(6.3)
    assert cases["checkpoint + restore"].wall_s == pytest.approx(16 * GIB / 2.3e9)
    assert cases["restore x1 again"].gbps is None  # skipped
    assert lanes_analysis.solo_rate(list(cases.values()), "restore") == pytest.approx(6.3)


def test_findings_and_table_say_what_concurrency_gained():
    cases = lanes_analysis.synthetic()
    found = lanes_analysis.findings(cases)
    assert found[0] == "2 checkpoints at once: 3.60 GB/s together, 1.57x one alone (2.30 GB/s)"
    assert found[1].startswith("3 checkpoints at once: 4.20 GB/s together, 1.83x")
    assert found[2].startswith("2 restores at once: 6.30 GB/s together, 1.00x")
    duplex = found[-1]
    assert "checkpoint 2.30 GB/s (100% of alone), restore 6.30 GB/s (100% of alone)" in duplex
    # both ways at once: 32 GiB in the checkpoint's time, against both one after the other
    assert f"{2 * 16 * GIB / (16 * GIB / 2.3e9) / 1e9:.2f} GB/s together" in duplex
    text = lanes_analysis.table(cases, ["machine: test"])
    assert "checkpoint x3        | 3     | 48.0 | 12.27  | 4.20          | c 1.40, c 1.40" in text
    assert (
        "restore x1 again     | -     | -    | -      | -             | skipped: time budget"
        in text
    )


def test_a_failed_call_is_shown_and_gives_no_rate():
    case = Case(
        "checkpoint x2", [Op("checkpoint", 1, GIB, 0, 1), Op("checkpoint", 2, GIB, 0, 1, "OOM")]
    )
    assert not case.ok and case.gbps is None
    text = lanes_analysis.table([case], [])
    assert "c ERROR" in text and "checkpoint of 2: OOM" in text


def test_the_plan_leaves_every_holder_restored():
    units = checkpoint_lanes.plan([1, 2, 3])
    assert [name for unit in units for name, _ in unit] == [
        "checkpoint x1",
        "restore x1",
        "checkpoint x2",
        "restore x2",
        "checkpoint x3",
        "restore x3",
        "checkpoint x1 again",
        "checkpoint + restore",
        "restore x1 again",
    ]
    for unit in units:
        out = [p for _, calls in unit for k, p in calls if k == "checkpoint"]
        back = [p for _, calls in unit for k, p in calls if k == "restore"]
        assert sorted(out) == sorted(back)


def test_ballast_shrinks_to_what_three_holders_fit():
    assert checkpoint_lanes.fit_gib(16, 140 * GIB, 120 * GIB) == (16, "")
    gib, why = checkpoint_lanes.fit_gib(16, 40 * GIB, 120 * GIB)
    assert gib == pytest.approx(40 / 3 - 2, abs=0.05) and "asked 16" in why
    gib, _ = checkpoint_lanes.fit_gib(16, 140 * GIB, 23 * GIB)  # this 23 GiB machine
    assert gib == pytest.approx((23 - 8) / 3 - 1, abs=0.05)


class FakeLock:
    """kiwid's CudaLock as the probe uses it, keeping each process's state."""

    def __init__(self, fail: set[tuple[str, int]] | None = None) -> None:
        self.states: dict[int, str] = {}
        self.fail = fail or set()
        self.calls: list[tuple[str, int]] = []

    def _do(self, what: str, pid: int, before: str, after: str) -> None:
        self.calls.append((what, pid))
        assert self.states.get(pid, "running") == before, (what, pid, self.states)
        if (what, pid) in self.fail:
            raise RuntimeError(f"{what} refused")
        self.states[pid] = after

    def lock(self, pid, timeout_ms):
        self._do("lock", pid, "running", "locked")

    def unlock(self, pid):
        self._do("unlock", pid, "locked", "running")

    def checkpoint(self, pid):
        self._do("checkpoint", pid, "locked", "checkpointed")

    def restore(self, pid):
        self._do("restore", pid, "checkpointed", "locked")

    def state(self, pid):
        class State:
            name = self.states.get(pid, "running").upper()

        return State()


class FakeHolder:
    def __init__(self, pid: int) -> None:
        self.pid, self.nbytes = pid, GIB


def test_the_probe_undoes_everything_even_after_a_failed_call():
    lock = FakeLock(fail={("checkpoint", 2)})
    probe = checkpoint_lanes.Probe(lock, [FakeHolder(p) for p in (1, 2, 3)])
    probe.lock_all()
    case = probe.run("checkpoint x3", [("checkpoint", p) for p in (1, 2, 3)])
    assert not case.ok and [o.error for o in case.ops] == [None, "checkpoint refused", None]
    assert probe.state == {1: "checkpointed", 2: "locked", 3: "checkpointed"}
    probe.undo()
    assert lock.states == {1: "running", 2: "running", 3: "running"}
    assert probe.state == dict.fromkeys((1, 2, 3), "running")
