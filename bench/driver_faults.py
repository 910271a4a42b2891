"""The fault matrix: every driver fault against every driver operation, on a real kiwid.

A real kiwid with ``backend = "nvml"``, ``gate = "cuda-lock"`` and ``swap =
"checkpoint"`` runs on the driver double (``tests/stand_ins``): four real CUDA
tenant programs, each in a cgroup2 of its own, one of them two processes, on a
card they do not all fit (their memory rotates through host RAM), TQ 1 s and
``gpu.driver_timeout`` 2 s. Then every fault kind (``fail`` with CUresult 999
and 2, ``hang`` for N s and until cleared, ``stuck``, ``oom`` on a restore, one
process of the multi-process tenant failing, the GPU lost and back) against every
operation (lock, unlock, checkpoint, restore, state), ``--runs-per-cell`` times
each, at random moments (a random tenant, a random delay into the rotation;
``--seed``). After each fault the operator deals with a stuck tenant:
``kiwictl retry`` after clearing the fault and ``kiwictl release`` in turn;
every ``--kill-every``-th run kiwid is killed with SIGKILL instead, ``kiwid
recover`` runs, and kiwid starts again (bench/_faults_runs.py).

Judged from samples every 50 ms (bench/_faults_judge.py): **windows** (never two
tenants running in two samples in a row, outside an operator's release and a
lost GPU), **memory** (after each fault every process's memory is on the card
or recorded in the state file; after ``kiwid recover`` every tenant runs with
all its memory on the card), **rotation** (every healthy tenant makes progress
within tenants x TQ x 3 + driver_timeout), **tracebacks** (none in any kiwid or
recover log), **operator** (a stuck tenant that the operator's word does not
bring back once every fault is cleared). Every ``[ERROR]`` line kind is listed.

Prints a table per (operation, kind), the figures and the machine; exits 0 only
when every count of violations is 0. ``--sim``: the same on the simulated GPU
with ``sim-fault`` and the cgroup freezer (checkpoint and restore x fail, hang,
stuck). Needs root (cgroups). Always cleans up, also on Ctrl-C or SIGTERM::

    PYTHONPATH=$PWD .venv/bin/python bench/driver_faults.py [--seed 7] [--runs-per-cell 20]
        [--cells 'restore/*,lock/hang-s'] [--sim] [--kill-every 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _faults_double
import _faults_sim
from _faults_judge import Judge
from _faults_rig import Daemon, exit_on_signals, restore_signals, sweep_leftovers
from _faults_runs import ENDINGS, Matrix
from _kiwid import machine

VIOLATIONS = ("window", "memory", "rotation", "tracebacks", "operator")
RESTARTS = "restart/tenants-at-work"
"""The table's last row: kiwid started again after a kill -9 and ``kiwid recover``
while its tenants work (``memory``: restarts that left one gated with no record)."""


@dataclass
class Options:
    """What to run (the command line's options)."""

    seed: int = 7
    runs_per_cell: int = 20
    cells: str = "*"
    sim: bool = False
    kill_every: int = 5
    tq: float = 1.0
    driver_timeout: float = 2.0
    react_s: tuple[float, float] | None = None
    """The operator's reaction time, drawn between the two (default: from the bound)."""
    keep_logs: bool = False
    """Keep kiwid's logs (they are kept anyway when something was found)."""
    budget_s: float = 0.0
    """Start no run after this many seconds (0: no limit); the runs left out are counted."""


def all_cells(sim: bool) -> list[tuple[str, str]]:
    return _faults_sim.cells() if sim else _faults_double.cells()


def select(cells: list[tuple[str, str]], patterns: str) -> list[tuple[str, str]]:
    """The cells that match one of the comma-separated ``op/kind`` patterns.

    Raises:
        ValueError: a pattern matches no cell.
    """
    chosen = []
    for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
        matched = [c for c in cells if fnmatch.fnmatchcase(f"{c[0]}/{c[1]}", pattern)]
        if not matched:
            names = ", ".join(f"{op}/{kind}" for op, kind in cells)
            raise ValueError(f"--cells {pattern!r} matches no cell (cells: {names})")
        chosen += [c for c in matched if c not in chosen]
    return chosen


def make_rig(opts: Options, d: Path) -> Any:
    kind = _faults_sim.SimRig if opts.sim else _faults_double.DoubleRig
    return kind(d, tq=opts.tq, driver_timeout=opts.driver_timeout)


def run_matrix(opts: Options, say: Any = print) -> dict[str, Any]:
    """Run the matrix; always clean up. Returns the report (see :func:`table`)."""
    cells = select(all_cells(opts.sim), opts.cells)
    rng = random.Random(opts.seed)
    d = Path(tempfile.mkdtemp(prefix="kiwi-df-", dir="/tmp"))
    d.chmod(0o755)
    started = time.monotonic()
    rig = judge = matrix = None
    cleanup: list[str] = []
    interrupted = None
    skipped = 0
    failed_runs: list[str] = []
    try:
        rig = make_rig(opts, d)
        rig.start()
        bound = len(rig.tenants) * rig.tq * 3 + rig.driver_timeout
        judge = Judge(rig, bound)
        judge.start()
        matrix = Matrix(rig, judge, rng, kill_every=opts.kill_every, react_s=opts.react_s)
        try:
            for round_ in range(opts.runs_per_cell):
                order = list(cells)
                rng.shuffle(order)
                for op, kind in order:
                    if opts.budget_s and time.monotonic() - started > opts.budget_s:
                        skipped += 1
                        continue
                    try:
                        matrix.run(op, kind)
                    except Exception as err:  # say it, set the rig right, go on
                        failed_runs.append(f"{op}/{kind}: {type(err).__name__}: {err}")
                        say(f"run of {op}/{kind} failed: {failed_runs[-1]}")
                        matrix.kill_and_recover()  # if this fails too, the matrix stops
                took = time.monotonic() - started
                say(f"round {round_ + 1}/{opts.runs_per_cell} done ({took:.0f} s)")
        except (KeyboardInterrupt, SystemExit) as stop:  # Ctrl-C, SIGTERM: report what ran
            interrupted = f"interrupted ({type(stop).__name__} {stop})"
            say(interrupted)
        figures = matrix.finish()
    finally:
        if judge is not None:
            judge.stop()
        if rig is not None:
            cleanup = rig.cleanup()
        logs = _logs(rig.daemon) if rig is not None else []
        errors = error_kinds(logs)
        shutil.rmtree(d / "cuda", ignore_errors=True)
        shutil.rmtree(d / "state", ignore_errors=True)
    assert rig is not None
    assert judge is not None
    assert matrix is not None
    rep = report(opts, cells, matrix, judge, figures, errors, cleanup, started)
    rep["interrupted"] = interrupted
    rep["skipped"] = skipped
    rep["bench_errors"] = failed_runs
    rep["cgroup"] = str(rig.parent)
    if violations(rep) == 0 and not opts.keep_logs:
        shutil.rmtree(d, ignore_errors=True)
    else:
        rep["logs"] = str(d)
    return rep


def _logs(daemon: Daemon) -> list[str]:
    texts = []
    for log in [*daemon.logs, *daemon.recover_logs]:
        try:
            texts.append(log.read_text(errors="replace"))
        except OSError:
            continue
    return texts


def error_kinds(texts: list[str]) -> dict[str, int]:
    """Every ``[ERROR]`` line, its tenants, pids, numbers and times taken out, counted."""
    kinds: collections.Counter[str] = collections.Counter()
    for text in texts:
        for line in text.splitlines():
            if not line.startswith("[ERROR]"):
                continue
            kind = re.sub(r"(\S+ \()?cgroup:/\S+?(\)|(?=[:\s]|$))", "T", line[8:])
            kind = re.sub(r"\d{1,2}:\d{2}:\d{2}", "HH:MM:SS", kind)
            kind = re.sub(r"\d+(\.\d+)?", "N", kind)
            kinds[kind[:160]] += 1
    return dict(kinds.most_common())


def report(
    opts: Options,
    cells: list[tuple[str, str]],
    matrix: Matrix,
    judge: Judge,
    figures: dict[str, Any],
    errors: dict[str, int],
    cleanup: list[str],
    started: float,
) -> dict[str, Any]:
    rows = {}
    for op, kind in cells:
        key = f"{op}/{kind}"
        result, seen = matrix.results[key], judge.counts[key]
        rows[key] = {
            "runs": result.runs,
            "window": seen.window,
            "memory": result.memory,
            "rotation": seen.rotation + result.rotation,
            "tracebacks": result.tracebacks,
            "operator": result.operator,
            "endings": {e: result.endings[e] for e in ENDINGS},
            "handovers": seen.handovers,
            "seconds": round(result.seconds, 1),
        }
    restarts = matrix.restarts
    rows[RESTARTS] = {
        "runs": restarts.runs,
        "window": 0,
        "memory": restarts.memory,
        "rotation": 0,
        "tracebacks": 0,
        "operator": 0,
        "endings": dict.fromkeys(ENDINGS, 0),
        "handovers": 0,
        "seconds": 0.0,
    }
    setup = judge.counts["set-up"]
    stuck = [s for _, s in matrix.stuck_for]
    seconds = time.monotonic() - started
    progress = judge.summary()["progress"]
    return {
        "backend": "sim" if opts.sim else "double",
        "options": vars(opts),
        "cells": rows,
        "set_up": {"window": setup.window, "rotation": setup.rotation},
        "totals": {v: sum(r[v] for r in rows.values()) for v in VIOLATIONS},
        "errors": errors,
        "details": judge.details,
        "cleanup": cleanup,
        "figures": {
            "seconds": round(seconds, 1),
            "samples": judge.samples,
            "kills": figures["kills"],
            "to_stuck_s": _spread([s for _, s in matrix.to_stuck]),
            "stuck_s": _spread(stuck),
            "operator_s": {
                e: _spread([s for _, a, s in matrix.acted if a == e])
                for e in ("mended", "released")
            },
            "rotation_bound_s": judge.bound_s,
            "handovers_seen": sum(r["handovers"] for r in rows.values()) + setup.handovers,
            "kiwid_handovers": figures["handover_stats"],
            "progress_unit": "CPU seconds" if opts.sim else "iterations of GPU work",
            "progress": {n: round(v) for n, v in sorted(progress.items())},
            "progress_per_s": {n: round(v / seconds, 1) for n, v in sorted(progress.items())},
        },
    }


def _spread(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "min": round(min(values), 2),
        "median": round(statistics.median(values), 2),
        "max": round(max(values), 2),
    }


def violations(rep: dict[str, Any]) -> int:
    """Every count of violations together, the set-up's and the clean-up's included."""
    return (
        sum(rep["totals"].values())
        + rep["set_up"]["window"]
        + rep["set_up"]["rotation"]
        + len(rep["cleanup"])
        + len(rep.get("bench_errors", []))
    )


def table(rep: dict[str, Any]) -> str:
    head = f"{'cell':24s}{'runs':>5s}" + "".join(f"{v[:8]:>9s}" for v in VIOLATIONS)
    head += "".join(f"{e[:9]:>10s}" for e in ENDINGS) + f"{'s/run':>7s}"
    lines = [head]
    for key, row in rep["cells"].items():
        line = f"{key:24s}{row['runs']:5d}" + "".join(f"{row[v]:9d}" for v in VIOLATIONS)
        line += "".join(f"{row['endings'][e]:10d}" for e in ENDINGS)
        lines.append(line + f"{row['seconds'] / max(row['runs'], 1):7.1f}")
    totals = rep["totals"]
    lines.append(
        f"{'total':24s}{sum(r['runs'] for r in rep['cells'].values()):5d}"
        + "".join(f"{totals[v]:9d}" for v in VIOLATIONS)
    )
    return "\n".join(lines)


def describe(rep: dict[str, Any]) -> str:
    fig = rep["figures"]
    out = [
        f"runs left out (budget spent): {rep['skipped']}; interrupted: {rep['interrupted']}; "
        f"runs that failed in the bench: {rep['bench_errors'] or 'none'}",
        f"set-up: window {rep['set_up']['window']}, rotation {rep['set_up']['rotation']}; "
        f"clean-up problems: {rep['cleanup'] or 'none'}",
        f"{fig['seconds']:.0f} s, {fig['samples']} samples, {fig['kills']} kill -9 + recover",
        f"from the fault to a stuck tenant (s): {fig['to_stuck_s']}",
        f"stuck until the operator acted (s): {fig['stuck_s']}",
        f"the operator's action took (s): {fig['operator_s']}",
        f"rotation bound (s): {fig['rotation_bound_s']}",
        f"hand-overs seen on the card: {fig['handovers_seen']}; kiwid's own "
        f"(count, sum s) per kiwid: {fig['kiwid_handovers']}",
        f"progress per tenant ({fig['progress_unit']}): {fig['progress']} "
        f"({fig['progress_per_s']} per s)",
        "[ERROR] line kinds:",
        *(f"  {n:5d}  {kind}" for kind, n in rep["errors"].items()),
    ]
    if rep.get("logs"):
        out.append(f"kiwid's and recover's logs: {rep['logs']}")
    if rep["details"]:
        out += ["what was seen:", *(f"  {line}" for line in rep["details"])]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--runs-per-cell", type=int, default=20)
    parser.add_argument("--cells", default="*", help="op/kind patterns, comma-separated")
    parser.add_argument("--sim", action="store_true", help="the simulated GPU and sim-fault")
    parser.add_argument(
        "--kill-every", type=int, default=5, help="kill -9 kiwid every Nth run (0: never)"
    )
    parser.add_argument(
        "--react",
        type=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
        help="the operator acts on a stuck tenant after LOW to HIGH s "
        "(default: 0.5 to 1.2 times the rotation's bound)",
    )
    parser.add_argument(
        "--budget", type=float, default=0.0, help="start no run after SECONDS (0: no limit)"
    )
    parser.add_argument("--tq", type=float, default=1.0)
    parser.add_argument("--driver-timeout", type=float, default=2.0)
    parser.add_argument("--out", type=Path, help="write the report as JSON too")
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep kiwid's logs (kept anyway on a finding)"
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("driver_faults.py needs root (it makes and freezes cgroups)")
    if args.runs_per_cell < 1:
        parser.error("--runs-per-cell must be at least 1")
    opts = Options(
        args.seed,
        args.runs_per_cell,
        args.cells,
        args.sim,
        args.kill_every,
        args.tq,
        args.driver_timeout,
        tuple(args.react) if args.react else None,
        args.keep_logs,
        args.budget,
    )
    try:
        select(all_cells(opts.sim), opts.cells)
    except ValueError as err:
        parser.error(str(err))
    previous = exit_on_signals()
    try:
        for parent in sweep_leftovers():
            print(f"removed {parent}, left by a run that was killed")
        print(machine())
        print(f"command: {' '.join([sys.executable, *sys.argv])}", flush=True)
        rep = run_matrix(opts, say=lambda line: print(line, flush=True))
    finally:
        restore_signals(previous)
    print(table(rep))
    print(describe(rep))
    print(machine())
    if args.out is not None:
        args.out.write_text(json.dumps(rep, indent=1, sort_keys=True))
    if rep["interrupted"]:
        return 130
    if rep["skipped"]:
        print(f"{rep['skipped']} runs left out: --budget spent")
        return 1
    return 0 if violations(rep) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
