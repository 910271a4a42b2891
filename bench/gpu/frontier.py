"""Issue 13's frontier on one GPU machine: one command, under 6 minutes, one summary table.

Run as root from the repo root with the system ``python3`` (torch, nvidia-ml-py)::

    python3 bench/gpu/frontier.py 2>&1 | tee "${OUT:-/tmp}/frontier.log"
    python3 bench/gpu/frontier.py --rehearse   # no GPU: the same steps on kiwid's simulated GPU
    python3 bench/gpu/frontier.py --dry-run    # no GPU, ~10 s: the plan, the table on made-up data

Three steps, each a child with its own hard time cap, inside ``--total`` (350) seconds:

1. ``swap.py --tenants 2 --torch-tenant``: 3 tenants of 47.5 GiB (one of them the
   PyTorch trainer) on the 140.4 GiB card, TQ 30 s, ``swap = "checkpoint"``, kiwid's
   state_dir emptied first (every tenant a newcomer); it gets what the other two
   steps leave (cap 180 s: about 125 s of rotation). ``--newcomer`` defaults to
   ``free`` here: the bench's tenants allocate all they will use before their first
   turn, so that is safe for them, and with kiwid's default (``whole-card``) the two
   newcomers' first turns (~85 s together) leave no steady rotation inside 6 minutes.
2. The same tenants again with ``--keep-state`` on that state_dir: kiwid knows their
   footprints from step 1; a known workload's first turn (cap 130 s, 80 s of rotation).
3. ``checkpoint_lanes.py --gib 3``: 1 vs 2 vs 3 concurrent checkpoints and restores,
   and one of each at once (aggregate GB/s), with what is left (at least 40 s).

Then the summary against the issue's targets: steady useful time >= 90 %, steady
hand-over p50 <= 3 s, a known workload's first turn <= 15 s, 0 bad bytes, a
bit-identical loss curve; and the lanes' GB/s. Results under ``$OUT/kiwi-frontier``
(or ``/tmp/kiwi-bench/out-frontier``): ``summary.txt``, ``summary.json`` and each
step's folder. A step that fails or runs out of time still leaves its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORK = Path("/tmp/kiwi-bench")
STATE_DIR = WORK / "state-frontier"
SETUP_S = 20.0  # a swap.py run before its rotation: torch imports, the reference, CUDA set-up
CLEANUP_S = 20.0  # swap.py's --cleanup-reserve here (tenants killed, kiwid stopped, recover)
TARGETS = {"steady_useful": 0.90, "steady_p50_s": 3.0, "known_first_turn_s": 15.0}
_child: subprocess.Popen[bytes] | None = None


def log(message: str) -> None:
    print(f"[frontier {time.strftime('%H:%M:%S')}] {message}", flush=True)


def steps(args: argparse.Namespace, outdir: Path) -> list[tuple[str, list[str], float]]:
    """(name, argv, hard cap in s) in order: run 1, run 2, then the lanes with what is left.

    Run 1 gets what run 2 and the lanes' share leave; a cap becomes the child's own
    ``--max-total`` (swap.py, 5 s less) or ``--max-seconds`` (the lanes, 10 s less).
    """
    py = sys.executable
    mode = ["--rehearse", "--sim-gbps", "0.22,0.55"] if args.rehearse else []
    swap = [py, str(HERE / "swap.py"), *mode, "--tenants", "2", "--torch-tenant", "--tq", "30"]
    swap += ["--state-dir", str(args.state_dir), "--cleanup-reserve", f"{CLEANUP_S:g}"]
    swap += [f"--checkpoint-lanes={args.checkpoint_lanes}"] if args.checkpoint_lanes else []
    swap += [f"--newcomer={args.newcomer}"] if args.newcomer else []
    lanes = [py, str(HERE / "checkpoint_lanes.py"), "--gib", f"{args.lanes_gib:g}"]
    lanes += ["--out", str(outdir / "lanes")] + (["--dry-run"] if args.rehearse else [])
    run2 = SETUP_S + args.run2_budget + 5 + CLEANUP_S + 5
    known = [*swap, "--keep-state", "--budget", f"{args.run2_budget:g}", "--settle", "5"]
    run1 = args.total - run2 - args.lanes_seconds
    return [
        (
            "run 1 (newcomers)",
            [*swap, "--budget", "330", "--settle", "10", "--out", str(outdir / "run1")],
            run1,
        ),
        (
            "run 2 (known, --keep-state)",
            [*known, "--out", str(outdir / "run2")],
            run2,
        ),
        ("lanes", lanes, args.total),  # whatever is left
    ]


def run_step(name: str, argv: list[str], cap_s: float, deadline: float) -> int | None:
    """Run one child within min(cap, the time left); SIGTERM it (it cleans up) if late."""
    global _child  # noqa: PLW0603 - the signal handler forwards to it
    cap = min(cap_s, deadline - time.monotonic())
    if cap < 25:
        log(f"{name}: skipped, {cap:.0f} s left")
        return None
    if "swap.py" in argv[1]:
        argv = [*argv, "--max-total", f"{cap - 5:.0f}"]
    elif "--max-seconds" not in argv:
        argv = [*argv, "--max-seconds", f"{cap - 10:.0f}"]
    log(f"{name}: {' '.join(argv[1:])}  (cap {cap:.0f} s)")
    t = time.monotonic()
    _child = subprocess.Popen(argv, start_new_session=True)
    try:
        rc = _child.wait(cap)
    except subprocess.TimeoutExpired:
        log(f"{name}: over {cap:.0f} s; SIGTERM (it cleans up)")
        _child.terminate()
        try:
            rc = _child.wait(90)
        except subprocess.TimeoutExpired:
            _child.kill()
            rc = _child.wait()
    _child = None
    log(f"{name}: exit {rc} after {time.monotonic() - t:.0f} s")
    return rc


def _load(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _ok(good: bool | None) -> str:
    return "-" if good is None else ("ok" if good else "MISSED")


def summary_rows(
    lanes: Mapping[str, Any] | None, run1: Mapping[str, Any] | None, run2: Mapping[str, Any] | None
) -> list[tuple[str, str, str, str]]:
    """(measure, target, measured, verdict) from the steps' results.json."""
    s1 = (run1 or {}).get("summary") or {}
    s2 = (run2 or {}).get("summary") or {}
    rows = []
    useful, p50 = s1.get("steady_useful"), s1.get("steady_p50_s")
    why = s1.get("steady_why_not") or "run 1 has no figures"
    rows.append(
        (
            "steady useful GPU time",
            ">= 90 %",
            f"{useful:.0%} over {s1.get('steady_window_s', 0):.0f} s"
            if useful is not None
            else why,
            _ok(None if useful is None else useful >= TARGETS["steady_useful"]),
        )
    )
    gaps = s1.get("steady_handovers") or []
    rows.append(
        (
            "steady hand-over p50",
            "<= 3 s",
            f"{p50:.1f} s (n={len(gaps)})" if p50 is not None else why,
            _ok(None if p50 is None else p50 <= TARGETS["steady_p50_s"]),
        )
    )
    known = [f for f in s2.get("first_turns", []) if f.get("kind") == "known" and f.get("after")]
    worst = max(known, key=lambda f: f.get("stall_s") or 0.0) if known else None
    if worst is not None:
        stall = worst.get("stall_s") or 0.0
        text = f"{'> ' if worst.get('still_waiting') else ''}{stall:.1f} s ({worst['tenant']})"
        text += "; " + ", ".join(f"{f['tenant']} {f.get('stall_s') or 0:.1f}" for f in known)
        verdict = _ok(stall <= TARGETS["known_first_turn_s"] and not worst.get("still_waiting"))
    else:
        text, verdict = "no known first turn in run 2", "-"
    if s2.get("never_held"):
        text += f" ({', '.join(s2['never_held'])}: no turn in run 2's window)"
    rows.append(("known workload's first turn", "<= 15 s", text, verdict))
    bad = [s.get("bad_bytes") for s in (s1, s2) if s.get("bad_bytes") is not None]
    rows.append(
        (
            "bad bytes (runs 1 and 2)",
            "0",
            " + ".join(str(b) for b in bad) if bad else "-",
            _ok(None if not bad else sum(bad) == 0),
        )
    )
    parts, same, differ = [], [], []
    for k, s in ((1, s1), (2, s2)):
        if s.get("loss_verdict") is None:
            continue
        same.append(bool(s.get("loss_identical")))
        differ.append(bool(s.get("loss_failed")))
        what = "DIFFERENT" if s.get("loss_failed") else "identical"
        parts.append(
            f"run {k}: {what} over {s.get('loss_steps')} steps, {s.get('loss_swap_ins')} swap-in(s)"
        )
    fallback = any(s.get("loss_fallback") for s in (s1, s2))
    verdict = "MISSED" if any(differ) else "ok" if any(same) else "-"
    rows.append(
        (
            "loss curve bit-identical",
            "yes, across swaps",
            "; ".join(parts) + (" (FALLBACK: pure-Python model)" if fallback else "") or "-",
            verdict,
        )
    )
    solo = (lanes or {}).get("solo_gbps") or {}
    cases = {c["name"]: c.get("gbps") for c in (lanes or {}).get("cases", [])}

    def rate(name: str) -> str:
        value = cases.get(name)
        return "-" if value is None else f"{value:.1f}"

    lanes_text = (
        f"out x1/x2/x3 {rate('checkpoint x1')}/{rate('checkpoint x2')}/{rate('checkpoint x3')}, "
        f"in x1/x2/x3 {rate('restore x1')}/{rate('restore x2')}/{rate('restore x3')}, "
        f"out+in {rate('checkpoint + restore')} GB/s"
        + (" (made-up: dry run)" if (lanes or {}).get("dry_run") else "")
    )
    rows.append(("checkpoint lanes", "-", lanes_text if solo else "no figures", "-"))
    whole = s1.get("whole_useful")
    news = [f for f in s1.get("first_turns", []) if f.get("after")]
    rows.append(
        (
            "run 1: whole window useful",
            "-",
            "-" if whole is None else f"{whole:.0%} over {s1.get('window_s', 0):.0f} s",
            "-",
        )
    )
    rows.append(
        (
            "run 1: first turns",
            "-",
            ", ".join(f"{f['tenant']} {f.get('kind')} {f.get('stall_s') or 0:.1f} s" for f in news)
            or "-",
            "-",
        )
    )
    return rows


def render(rows: Sequence[tuple[str, str, str, str]], head: Sequence[str]) -> str:
    table = [("measure", "target", "measured", "verdict"), *rows]
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(["", "== issue 13 frontier", *head, *lines])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--total", type=float, default=350.0, help="hard cap on it all, s")
    parser.add_argument("--lanes-gib", type=float, default=3.0, help="lanes probe: GiB each")
    parser.add_argument(
        "--lanes-seconds", type=float, default=40.0, help="kept for the lanes probe (last), s"
    )
    parser.add_argument("--run2-budget", type=float, default=80.0, help="run 2's rotation, s")
    parser.add_argument("--state-dir", type=Path, default=STATE_DIR, help="shared by the runs")
    parser.add_argument("--checkpoint-lanes", type=int, help="kiwid's memory.checkpoint_lanes")
    parser.add_argument(
        "--newcomer",
        choices=("whole-card", "free"),
        default="free",
        help="memory.newcomer (default free: the bench's tenants allocate before their turn)",
    )
    parser.add_argument("--out", type=Path, help="output folder (default $OUT/kiwi-frontier)")
    parser.add_argument("--rehearse", action="store_true", help="kiwid's simulated GPU")
    parser.add_argument("--dry-run", action="store_true", help="the plan and a made-up table")
    args = parser.parse_args()
    outdir = args.out or (
        Path(os.environ["OUT"]) / "kiwi-frontier"
        if os.environ.get("OUT")
        else WORK / "out-frontier"
    )
    outdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    deadline = t0 + args.total
    plan = steps(args, outdir)
    if args.dry_run:
        return dry_run(plan, outdir, args.total)

    def _forward(signum: int, frame: object) -> None:
        if _child is not None and _child.poll() is None:
            _child.terminate()  # the child cleans up; we wait for it below
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _forward)
    signal.signal(signal.SIGINT, _forward)
    mode = "REHEARSAL (simulated GPU, lanes made up)" if args.rehearse else "GPU"
    log(f"{mode}; {args.total:g} s in all; output {outdir}")
    codes: dict[str, int | None] = {}
    try:
        for name, argv, cap in plan:
            codes[name] = run_step(name, argv, cap, deadline)
    except KeyboardInterrupt:
        log("interrupted")
        if _child is not None:
            _child.wait(120)
        return 130
    results = [_load(outdir / d / "results.json") for d in ("lanes", "run1", "run2")]  # table order
    machine = ((results[1] or results[2] or {}).get("machine") or [""])[:2]
    head = [*machine, f"{mode}; {time.monotonic() - t0:.0f} s in all; exits {codes}"]
    text = render(summary_rows(*results), head)
    print(text, flush=True)
    (outdir / "summary.txt").write_text(text + "\n")
    (outdir / "summary.json").write_text(
        json.dumps({"rows": summary_rows(*results), "exits": codes, "head": head}, indent=1)
    )
    return exit_code(summary_rows(*results), codes)


def exit_code(rows: Sequence[tuple[str, str, str, str]], codes: Mapping[str, int | None]) -> int:
    """0 when every target was measured and met and no step crashed, else 1.

    A step's exit 1 is its own verdict (e.g. a tenant not checked after a swap-in in a
    short window) and the table already shows it; a step that was cut off or crashed
    (any other code, or none) fails the run.
    """
    targets_met = all(verdict == "ok" for _, target, _, verdict in rows if target != "-")
    steps_ran = all(code in (0, 1) for code in codes.values())
    return 0 if targets_met and steps_ran else 1


def dry_run(plan: Sequence[tuple[str, list[str], float]], outdir: Path, budget: float) -> int:
    """The plan, the lanes' dry run, and the summary of made-up runs."""
    sys.path.insert(0, str(HERE))
    from swap_analysis import analyse  # noqa: PLC0415
    from swap_dry import synthetic  # noqa: PLC0415
    from swap_report import summary  # noqa: PLC0415

    total = sum(cap for _, _, cap in plan[:-1])
    for name, argv, cap in plan:
        shown = cap if name != "lanes" else budget - total
        log(f"plan: {name}, cap {shown:.0f} s: {' '.join(argv[1:])}")
    log(f"plan: runs 1 and 2 {total:.0f} s at most; the lanes get what is left of --total")
    lanes_rc = run_step("lanes (dry run)", [*plan[-1][1], "--dry-run"], 60, time.monotonic() + 60)
    logs, events, lo, hi = synthetic()
    made_up = {"summary": summary(analyse(logs, events, lo, hi, known={"w2": True}))}
    text = render(
        summary_rows(_load(outdir / "lanes" / "results.json"), made_up, made_up),
        ["DRY RUN: made-up runs (swap_dry.synthetic), lanes made up"],
    )
    print(text, flush=True)
    return 0 if lanes_rc == 0 and budget < 360 and total < budget - 25 else 1


if __name__ == "__main__":
    sys.exit(main())
