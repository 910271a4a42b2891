"""bench/gpu/swap.py's steady-rotation, first-turn and loss-curve figures, on made-up logs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

GPU_BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu"
sys.path.insert(0, str(GPU_BENCH))  # bench/gpu is no package: its modules import each other

import swap_analysis  # noqa: E402
import swap_logs  # noqa: E402
import swap_report  # noqa: E402
from swap_logs import KEvent, WorkerLog  # noqa: E402

GB = 10**9


def points(*spans: tuple[float, float], step: float = 0.5) -> list[tuple[float, int]]:
    """Progress every ``step`` s through each (start, end) span, 50 iterations a step."""
    out: list[tuple[float, int]] = []
    n = 0
    for a, b in spans:
        out.append((a, n))
        t = a
        while t + step <= b + 1e-9:
            t += step
            n += 50
            out.append((t, n))
    return out


def rotation() -> tuple[dict[str, WorkerLog], list[KEvent]]:
    """Three tenants, TQ 10 s, hand-overs of 2 s after the first turns.

    w0 holds 0-10; w1 (newcomer) granted at 10, runs from 15 (5 s first turn); w2
    (known) granted at 25, runs from 28 (3 s); then steady: w0 at 38 (runs from 40),
    w1 at 50 (from 52), w2 at 62 (from 64) until the end at 74.
    """
    logs = {
        "w0": WorkerLog(points=points((0, 10), (40, 50)), alloc=(0, 0, GB, 0)),
        "w1": WorkerLog(points=points((3, 4), (15, 25), (52, 62)), alloc=(3, 3, GB, 0)),
        "w2": WorkerLog(points=points((18, 19), (28, 38), (64, 74)), alloc=(18, 18, GB, 0)),
    }
    logs["w0"].verifies = [(0, 0.1, 0, GB, True), (40, 40.1, 0, GB, True)]
    logs["w1"].verifies = [(3, 3.1, 0, GB, True), (15, 15.1, 0, GB, True), (52, 52.1, 0, GB, True)]
    logs["w2"].verifies = [
        (18, 18.1, 0, GB, True),
        (28, 28.1, 0, GB, True),
        (64, 64.1, 0, GB, True),
    ]
    events = []
    for t, who, frm in (
        (0.0, "w0", None),
        (10.0, "w1", "w0"),
        (25.0, "w2", "w1"),
        (38.0, "w0", "w2"),
        (50.0, "w1", "w0"),
        (62.0, "w2", "w1"),
    ):
        events.append(KEvent(t, "grant", who))
        if frm is not None:
            events.append(KEvent(t + 0.5, "swap-in", who, GB, 1.5, 1 / 1.5))
            events.append(KEvent(t + 3.0, "swap-out", frm, GB, 2.5, 0.4))
    return logs, events


def test_steady_rotation_starts_at_the_first_grant_after_everyone_held():
    logs, events = rotation()
    a = swap_analysis.analyse(logs, events, 0.0, 74.0, known={"w2": True})
    assert [h.kind for h in a.handovers] == [
        "newcomer",
        "newcomer",
        "known",
        "steady",
        "steady",
        "steady",
    ]
    assert a.steady.start == 38.0
    assert a.steady.window_s == 36.0
    assert a.steady.gaps == pytest.approx([2.0, 2.0, 2.0])
    assert a.steady.p50_s == pytest.approx(2.0)
    # 30 s of running in 36 s, minus three 0.1 s checks
    assert a.steady.share == pytest.approx((30 - 0.3) / 36)
    # w1 and w2 also ran 1 s each before kiwid first gated them; 8 checks of 0.1 s
    assert a.useful_share == pytest.approx((62 - 0.8) / 74)


def test_first_turns_are_labelled_and_timed_from_the_grant():
    logs, events = rotation()
    a = swap_analysis.analyse(logs, events, 0.0, 74.0, known={"w2": True})
    turns = {(f.label, f.label_kind, f.after): f.stall_s for f in a.first_turns}
    assert turns == {
        ("w0", "newcomer", None): 0.0,  # it held first, running at its grant
        ("w1", "newcomer", "w0"): pytest.approx(5.0),
        ("w2", "known", "w1"): pytest.approx(3.0),
    }
    assert [f.label for f in a.known_first_turns] == ["w2"]
    text = swap_report.report(a, ["machine: test"])
    assert "steady rotation:  82% useful of 36 s; hand-over p50 2.0 s over 3 (2.0-2.0 s)" in text
    assert "w2   known    at +  25.0 s (after w1): 3.0 s" in text
    assert "known workloads' first turn: max 3.0 s (w2), n=1" in text
    s = swap_report.summary(a)
    assert (s["steady_p50_s"], s["known_first_turn_s"], s["bad_bytes"]) == (2.0, 3.0, 0)


def test_no_steady_rotation_when_a_tenant_never_held():
    logs, events = rotation()
    events = [e for e in events if not (e.kind == "grant" and e.who == "w2")]
    a = swap_analysis.analyse(logs, events, 0.0, 74.0)
    assert a.steady.start is None
    assert a.steady.why_not == "w2 never held the GPU"
    assert "steady rotation: none (w2 never held the GPU)" in swap_report.report(a, [])
    assert swap_report.summary(a)["known_first_turn_s"] is None


def test_first_turn_still_waiting_at_the_end_is_a_lower_bound():
    pts = points((0, 5))
    stall, waiting = swap_analysis.first_turn_stall(pts, swap_logs.stalls_of(pts, 20), 8.0, 20.0)
    assert (stall, waiting) == (12.0, True)
    # a tenant whose loop starts after its grant: to its first iteration
    pts = points((11, 13))
    stall, waiting = swap_analysis.first_turn_stall(pts, [], 8.0, 20.0)
    assert (stall, waiting) == (pytest.approx(3.5), False)


def trainer_log(losses: list[float], times: list[float], cycle: int) -> WorkerLog:
    text = f"model torch-transformer layers=2 cycle={cycle}\n"
    for step, (loss, t) in enumerate(zip(losses, times, strict=True)):
        text += f"loss {step} {t:.6f} {loss.hex()} ;\n"
        text += f"p {t:.6f} {step + 1}\n"
    return swap_logs.parse_worker_log(text + "loss 99 1.0 0x1.8")  # the last line cut short


def test_loss_curve_compared_cycle_by_cycle_across_swaps():
    ref_losses = [1.0, 0.5, 0.25]
    ref = trainer_log(ref_losses, [0.0, 0.1, 0.2], 3)
    times = [10.0, 10.1, 20.0, 20.1, 20.2, 20.3, 20.4]  # a 9.9 s stall after step 1
    run = trainer_log([*ref_losses, *ref_losses, 1.0], times, 3)
    assert len(run.losses) == 7 and run.cycle == 3
    swaps = [KEvent(15.0, "swap-out", "t2", GB, 1, 1), KEvent(19.0, "swap-in", "t2", GB, 1, 1)]
    stalls = swap_logs.stalls_of(run.points)
    check = swap_analysis.compare_losses("t2", run, ref, swaps, stalls)
    assert check.ok and not check.failed, check.verdict
    assert (check.compared, check.cycles, check.swap_ins, check.mid_cycle_stalls) == (7, 3, 1, 1)
    assert check.verdict.startswith("bit-identical over 7 steps")

    bad = trainer_log([*ref_losses, 1.0, 0.5 + 2**-40, 0.25, 0.5], times, 3)
    check = swap_analysis.compare_losses("t2", bad, ref, swaps, swap_logs.stalls_of(bad.points))
    assert check.failed and check.first_mismatch == (4, (0.5 + 2**-40).hex(), (0.5).hex())
    assert check.mismatches == 2

    check = swap_analysis.compare_losses("t2", run, ref, [], stalls)
    assert not check.ok and not check.failed
    assert "never swapped in" in check.verdict
    assert "no reference" in swap_analysis.compare_losses("t2", run, None, swaps, stalls).verdict
    other = trainer_log([1.0, 0.5, 0.25 + 2**-30], [0.0, 0.1, 0.2], 3)  # a second unswapped run
    check = swap_analysis.compare_losses("t2", run, ref, swaps, stalls, other)
    assert not check.ok and not check.failed
    assert "the two unswapped runs differ (at step 2" in check.verdict
    assert swap_analysis.compare_losses("t2", run, ref, swaps, stalls, ref).ok


def test_the_fallback_trainer_is_labelled_and_its_curve_joins_the_verdict():
    logs, events = rotation()
    ref = trainer_log([2.0, 1.0], [0.0, 0.1], 2)
    text = "model pure-python linear-regression cycle=2\nalloc 18 18 1000000000 0\n"
    t = 18.0
    for step in range(20):
        t += 0.5 if step != 3 else 10.0
        text += f"p {t:.6f} {step}\nloss {step} {t:.6f} {[2.0, 1.0][step % 2].hex()} ;\n"
    logs["w2"] = swap_logs.parse_worker_log(text)
    logs["w2"].verifies = [(18, 18.1, 0, GB, True), (30, 30.1, 0, GB, True)]
    a = swap_analysis.analyse(logs, events, 0.0, 74.0, reference=ref)
    assert a.losses is not None and a.losses.fallback
    assert "FALLBACK" in a.losses.verdict
    assert a.integrity_ok, a.integrity
    assert "loss curve bit-identical" in a.integrity
    assert "== loss curve of w2 (pure-python linear-regression cycle=2)" in swap_report.report(
        a, []
    )
    s = swap_report.summary(a)
    assert s["loss_identical"] is True and s["loss_fallback"] is True
