"""bench/gpu/swap.py --dry-run: the parsing and the analysis on a made-up rotation, then
real (host-memory) tenants in their cgroups, frozen by hand, and kiwid on its simulated GPU.
"""

from __future__ import annotations

import os
import time

from enforcement import (
    WORK,
    BenchError,
    Kiwid,
    Layout,
    check_config,
    log,
    missing_kiwid_deps,
    stale_cgroups,
)
from swap_analysis import analyse
from swap_host import config_text
from swap_logs import KEvent, WorkerLog, parse_kiwid, read_worker_log, stalls_of
from swap_losses import compare_losses
from swap_report import report
from swap_run import Run

# --------------------------------------------------------------------- dry run


SYNTH_NAMES = {"kiwigpu-bench-0": "w0", "kiwigpu-bench-1": "w1", "kiwigpu-bench-2": "w2"}


def synthetic() -> tuple[dict[str, WorkerLog], list[KEvent], float, float]:
    """A made-up rotation: w0 holds, w1 and w2 arrive and are swapped out, then w0 -> w1 -> w2.

    Times are seconds; each hand-over moves 10 GB out in 5 s and 10 GB in in 2 s.
    """
    gb = 10 * 10**9

    def pts(*spans: tuple[float, float]) -> list[tuple[float, int]]:
        out, n = [], 0
        for a, b in spans:
            out.append((a, n))
            t = a
            while t + 0.5 <= b:
                t += 0.5
                n += 50
                out.append((t, n))
        return out

    logs = {
        "w0": WorkerLog(points=pts((0, 30), (67, 80)), alloc=(0, 0, gb, 0)),
        "w1": WorkerLog(points=pts((5, 6), (37, 60)), alloc=(4, 5, gb, 0)),
        "w2": WorkerLog(points=pts((40, 41), (67.5, 70)), alloc=(39, 40, gb, 2)),
    }
    logs["w0"].verifies = [(0, 0.1, 0, gb, True), (67, 67.2, 0, gb, True)]
    logs["w1"].verifies = [(5, 5.1, 0, gb, True), (37, 37.1, 0, gb, True)]
    logs["w2"].verifies = [(40, 40.1, 0, gb, True), (67.5, 67.6, 5, gb, True)]
    k = "kiwigpu-bench-"
    moved = "10000000000 bytes in"
    raw = [
        (0.5, f"[INFO] Grant: {k}0 (cgroup:/{k}0) holds GPU 0 (burst)"),
        (13.0, f"[INFO] Swapped out {k}1 (cgroup:/{k}1): {moved} 5.0 s (2.0 GB/s)"),
        (30.0, f"[INFO] Preempt: {k}0 (cgroup:/{k}0) yields GPU 0: quantum over and someone waits"),
        (30.1, f"[INFO] Grant: {k}1 (cgroup:/{k}1) holds GPU 0 (turn)"),
        (32.1, f"[INFO] Swapped in cgroup:/{k}1: {moved} 2.0 s (5.0 GB/s)"),
        (37.0, f"[INFO] Swapped out cgroup:/{k}0: {moved} 5.0 s (2.0 GB/s)"),
        (46.0, f"[INFO] Swapped out cgroup:/{k}2: {moved} 5.0 s (2.0 GB/s)"),
        (60.0, f"[INFO] Grant: cgroup:/{k}2 holds GPU 0 (turn)"),
        (62.0, f"[INFO] Swapped in cgroup:/{k}2: {moved} 2.0 s (5.0 GB/s)"),
        (67.0, f"[INFO] Swapped out cgroup:/{k}1: {moved} 5.0 s (2.0 GB/s)"),
        (66.0, f"[INFO] Swapped in cgroup:/{k}0: {moved} 4.0 s (2.5 GB/s)"),
        (66.5, f"[ERROR] Swap failed: in of /{k}9 (cgroup:/{k}9): CUDA_ERROR_OUT_OF_MEMORY; it"),
        (66.6, f"[WARNING] Swap out of /{k}2 (cgroup:/{k}2) not done: host RAM floor: ..."),
    ]
    return logs, parse_kiwid(raw, SYNTH_NAMES), 0.0, 80.0


def dry_run(run: Run, layout: Layout) -> tuple[int, int]:
    """Checks without CUDA; returns (errors, warnings)."""
    errors = warnings = 0

    def check(name: str, ok: bool, detail: str = "") -> None:
        nonlocal errors
        errors += 0 if ok else 1
        log(f"  {'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")

    logs, events, lo, hi = synthetic()
    kinds = [e.kind for e in events]
    check(
        "kiwid line parsing",
        kinds.count("swap-out") == 4
        and kinds.count("swap-in") == 3
        and kinds.count("grant") == 3
        and kinds.count("swap-failed") == 1
        and kinds.count("swap-refused") == 1
        and all(e.who in ("w0", "w1", "w2") for e in events if e.kind != "swap-failed"),
        f"{kinds}",
    )
    a = analyse(logs, events, lo, hi)
    h = a.handovers
    check(
        "hand-overs from grants and swap lines",
        len(h) == 3
        and (h[1].frm, h[1].to, h[1].out_s, h[1].in_s) == ("w0", "w1", 5.0, 2.0)
        and h[1].gap_s == 7.0
        and (h[2].frm, h[2].to, h[2].out_s, h[2].in_s) == ("w1", "w2", 5.0, 2.0)
        and h[2].gap_s == 7.5,
        "; ".join(f"{x.frm}->{x.to} out {x.out_s} in {x.in_s} gap {x.gap_s}" for x in h),
    )
    check(
        "other swaps (newcomers) kept apart",
        [(e.kind, e.who) for e in a.other_swaps]
        == [("swap-out", "w1"), ("swap-out", "w2"), ("swap-in", "w0")],
        f"{[(e.kind, e.who) for e in a.other_swaps]}",
    )
    shares = {t.label: round(t.useful_s, 2) for t in a.tenants}
    check(
        "useful time (minus stalls and checks)",
        shares == {"w0": 42.7, "w1": 23.8, "w2": 3.3},
        f"{shares}",
    )
    check(
        "integrity verdicts",
        a.integrity.startswith("FAIL")
        and "w2" in a.integrity
        and a.tenants[1].swap_ins_checked == 1,
        a.integrity,
    )
    log("  the synthetic table:\n" + report(a, ["machine: synthetic"]))

    if os.geteuid() != 0:
        log("  warning: not root: worker and kiwid checks skipped (the real run needs root)")
        return errors, warnings + 1
    run.args.tenants, run.args.torch_tenant = 2, True  # w0, w1 and the trainer t2
    run.spawn()
    for w in run.workers:
        check(f"{w.label} (pid {w.pid}) in {w.cgroup.name} before release", w.cgroup.holds(w.pid))
        ident = run.identities[w.label]
        run_specific = [str(run.outdir), f" {os.getpid()} ", "--out", "--go-fd", "--seconds"]
        check(
            f"{w.label}'s command line is the same in every run",
            not any(x in f"{ident} " for x in run_specific),
            ident,
        )
    run.reference(60)
    assert run.reference_log is not None
    assert run.reference_log_2 is not None
    ref, ref_2 = read_worker_log(run.reference_log), read_worker_log(run.reference_log_2)
    check(
        "the trainer's two unswapped references agree",
        len(ref.losses) == ref.cycle and ref.losses[-1][2] == ref_2.losses[-1][2],
        f"{ref.model}",
    )
    run.init_workers(60)
    w0, w1, t2 = run.workers
    for w in (w0, w1, t2):
        w.send(b"a")
    t_go = time.monotonic()
    time.sleep(1.5)
    for w in (w1, t2):
        w.cgroup.freeze()  # as kiwid's gate would
    time.sleep(1.6)
    t_in = time.monotonic()
    for w in (w1, t2):
        w.cgroup.thaw()
    time.sleep(1.0)
    tl = read_worker_log(t2.progress)
    swapped_in = [KEvent(t_in, "swap-in", "t2")]
    losses = compare_losses(
        "t2", tl, ref, swapped_in, stalls_of(tl.points, time.monotonic()), ref_2
    )
    check(
        "a frozen trainer: its loss curve goes on, equal to the reference's",
        losses.ok and losses.mid_cycle_stalls == 1,
        losses.verdict,
    )
    for w in (w0, w1):
        lines = w.poll_lines()
        check(
            f"{w.label} says allocated", any(x.startswith("allocated") for x in lines), f"{lines}"
        )
    wl = read_worker_log(w1.progress)
    stalls = stalls_of(wl.points)
    check(
        "a frozen tenant: one stall, then a check",
        len(stalls) == 1
        and any(v[0] >= stalls[0][0] for v in wl.verifies)
        and all(v[2] == 0 and v[4] for v in wl.verifies),
        f"stalls {[(round(s - t_go, 2), round((r or 0) - t_go, 2)) for s, r in stalls]}, "
        f"{len(wl.verifies)} checks",
    )
    run.close()
    check("workers killed", all(w.proc.poll() is not None for w in run.workers))
    check("cgroups removed", not stale_cgroups(layout))
    run.workers = []

    missing = missing_kiwid_deps()
    if missing:
        log("  warning: kiwid checks skipped (missing " + ", ".join(missing) + ")")
        return errors, warnings + 1
    WORK.mkdir(parents=True, exist_ok=True)
    for backend, gate in (("nvml", "cuda-lock"), ("sim", None)):
        path = WORK / f"kiwid-swap-{backend}.toml"
        path.write_text(config_text(run.args.tq, backend=backend, gate=gate))
        rc, text = check_config(path)
        check(f"kiwid check-config ({backend})", rc == 0, text.splitlines()[-1] if text else "")
    path = WORK / "kiwid-swap-lanes.toml"
    path.write_text(
        config_text(run.args.tq, backend="sim", gate=None, checkpoint_lanes=2, newcomer="free")
    )
    rc, text = check_config(path)
    if rc == 0:
        log("  ok   this kiwid accepts memory.checkpoint_lanes and memory.newcomer")
    else:
        warnings += 1
        log(
            "  warning: this kiwid rejects memory.checkpoint_lanes / memory.newcomer (it "
            f"predates issue 13): --checkpoint-lanes and --newcomer would stop a run: {text}"
        )
    kiwid = run.kiwid = Kiwid(WORK / "kiwid-swap-sim.toml", run.outdir / "kiwid-dry-run.log")
    try:
        check("kiwid starts (sim backend)", True, kiwid.wait_ready(30))
        status = kiwid.status()
        check("kiwid answers status", "error" not in status, str(status)[:100])
    except BenchError as exc:
        check("kiwid starts (sim backend)", False, str(exc))
    run.close()
    check("kiwid stopped, recover ran", kiwid.proc.returncode == 0, f"exit {kiwid.proc.returncode}")
    return errors, warnings
