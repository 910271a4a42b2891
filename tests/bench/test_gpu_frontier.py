"""bench/gpu/frontier.py's plan and summary table, on made-up results: no GPU."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

GPU_BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu"
sys.path.insert(0, str(GPU_BENCH))  # bench/gpu is no package: its modules import each other

import frontier  # noqa: E402


def args(**over: object) -> argparse.Namespace:
    base = {
        "total": 350.0,
        "lanes_gib": 3.0,
        "lanes_seconds": 40.0,
        "run2_budget": 80.0,
        "state_dir": Path("/tmp/kiwi-bench/state-frontier"),
        "checkpoint_lanes": None,
        "newcomer": None,
        "rehearse": False,
    }
    return argparse.Namespace(**{**base, **over})


def test_the_plan_fits_in_six_minutes_and_shares_the_state_dir(tmp_path):
    plan = frontier.steps(args(), tmp_path)
    assert [name for name, _, _ in plan] == [
        "run 1 (newcomers)",
        "run 2 (known, --keep-state)",
        "lanes",
    ]
    run1, run2 = plan[0][1], plan[1][1]
    assert plan[0][2] + plan[1][2] + 40 <= 350
    assert "--keep-state" not in run1 and "--keep-state" in run2
    for argv in (run1, run2):
        assert argv[argv.index("--state-dir") + 1] == "/tmp/kiwi-bench/state-frontier"
        assert {"--torch-tenant", "--tenants", "2"} <= set(argv)
        assert "--checkpoint-lanes=2" not in argv
    plan = frontier.steps(args(checkpoint_lanes=2, newcomer="free", rehearse=True), tmp_path)
    assert "--checkpoint-lanes=2" in plan[1][1] and "--newcomer=free" in plan[0][1]
    assert "--rehearse" in plan[0][1] and "--dry-run" in plan[2][1]


def run(steady: float | None, p50: float | None, turns: list[dict], bad: int = 0) -> dict:
    return {
        "summary": {
            "steady_useful": steady,
            "steady_p50_s": p50,
            "steady_window_s": 40.0,
            "steady_handovers": [p50] if p50 is not None else [],
            "steady_why_not": None if steady is not None else "t2 never held the GPU",
            "first_turns": turns,
            "bad_bytes": bad,
            "loss_identical": True,
            "loss_failed": False,
            "loss_steps": 900,
            "loss_swap_ins": 2,
            "loss_verdict": "bit-identical over 900 steps",
            "loss_fallback": False,
            "whole_useful": 0.7,
            "window_s": 125.0,
        }
    }


def turn(tenant: str, kind: str, stall: float, after: str | None = "w0", **kw: object) -> dict:
    return {"tenant": tenant, "kind": kind, "stall_s": stall, "after": after, **kw}


def test_summary_against_the_targets():
    lanes = {
        "solo_gbps": {"checkpoint": 2.3, "restore": 6.3},
        "cases": [{"name": "checkpoint x1", "gbps": 2.3}, {"name": "checkpoint x2", "gbps": 3.6}],
    }
    run1 = run(0.93, 2.1, [turn("w0", "newcomer", 0.0, None), turn("w1", "newcomer", 24.0)])
    run2 = run(None, None, [turn("w1", "known", 0.8), turn("t2", "known", 11.0, "w1")])
    rows = {r[0]: r for r in frontier.summary_rows(lanes, run1, run2)}
    assert rows["steady useful GPU time"][2:] == ("93% over 40 s", "ok")
    assert rows["steady hand-over p50"][2:] == ("2.1 s (n=1)", "ok")
    assert rows["known workload's first turn"][2:] == ("11.0 s (t2); w1 0.8, t2 11.0", "ok")
    assert rows["bad bytes (runs 1 and 2)"][2:] == ("0 + 0", "ok")
    assert rows["loss curve bit-identical"][2:] == (
        "run 1: identical over 900 steps, 2 swap-in(s); run 2: identical over 900 steps, "
        "2 swap-in(s)",
        "ok",
    )
    assert rows["checkpoint lanes"][2].startswith("out x1/x2/x3 2.3/3.6/-")
    assert rows["run 1: first turns"][2] == "w1 newcomer 24.0 s"
    text = frontier.render(list(rows.values()), ["machine: test"])
    assert "== issue 13 frontier" in text and "machine: test" in text


def test_summary_says_what_was_missed_or_missing():
    run1 = run(None, None, [], bad=5)
    run2 = run(None, None, [turn("t2", "known", 40.0, "w1", still_waiting=True)])
    run2["summary"].update(loss_identical=False, loss_swap_ins=0)  # never swapped: not judged
    rows = {r[0]: r for r in frontier.summary_rows(None, run1, run2)}
    assert rows["loss curve bit-identical"][3] == "ok"  # run 1's stands
    run1["summary"].update(loss_identical=False, loss_failed=True)
    rows = {r[0]: r for r in frontier.summary_rows(None, run1, run2)}
    assert rows["loss curve bit-identical"][2].startswith("run 1: DIFFERENT over 900 steps")
    assert rows["loss curve bit-identical"][3] == "MISSED"
    assert rows["steady useful GPU time"][2:] == ("t2 never held the GPU", "-")
    assert rows["known workload's first turn"][2:] == ("> 40.0 s (t2); t2 40.0", "MISSED")
    run2["summary"]["never_held"] = ["w2"]
    rows = {r[0]: r for r in frontier.summary_rows(None, run1, run2)}
    assert rows["known workload's first turn"][2].endswith("(w2: no turn in run 2's window)")
    assert rows["bad bytes (runs 1 and 2)"][2:] == ("5 + 0", "MISSED")
    assert rows["checkpoint lanes"][2] == "no figures"
    rows = {r[0]: r for r in frontier.summary_rows(None, None, None)}
    assert rows["steady useful GPU time"][2] == "run 1 has no figures"
    assert rows["known workload's first turn"][2] == "no known first turn in run 2"


def test_the_exit_code_follows_the_targets():
    ok = [("steady useful GPU time", ">= 90 %", "93%", "ok"), ("lanes", "-", "x", "-")]
    assert frontier.exit_code(ok, {"run 1": 0, "run 2": 1, "lanes": 0}) == 0
    missed = [*ok, ("known workload's first turn", "<= 15 s", "20 s", "MISSED")]
    assert frontier.exit_code(missed, {"run 1": 0}) == 1
    unmeasured = [*ok, ("steady hand-over p50", "<= 3 s", "no grant", "-")]
    assert frontier.exit_code(unmeasured, {"run 1": 0}) == 1
    assert frontier.exit_code(ok, {"run 1": 0, "run 2": None}) == 1  # cut off
    assert frontier.exit_code(ok, {"run 1": 137}) == 1
