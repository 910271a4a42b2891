"""GPU memory oversubscription check: three tenants larger than the card together, swapped by kiwid.

Run as root on a machine with an NVIDIA GPU, with the system ``python3`` (it needs
torch and nvidia-ml-py; kiwid needs psutil, sdnotify, watchdog, prometheus_client,
from ``bench/gpu/_deps`` where the machine lacks them)::

    python3 bench/gpu/swap.py               # ~7 minutes on an H200 (3 x 47.5 GiB, TQ 30 s)
    python3 bench/gpu/swap.py --dry-run     # no GPU: checks, analysis on synthetic data, plan
    python3 bench/gpu/swap.py --rehearse    # no GPU: the whole flow on kiwid's simulated GPU

Each tenant (``swap_worker.py``, in a cgroup of its own) holds a patterned ballast of
``--gib`` GiB and runs bf16 matmuls; after every stall (it was locked and swapped out)
it checks its whole ballast and its operands. kiwid runs with ``[memory] swap =
"checkpoint"`` and ``[gpu] gate = "cuda-lock"`` at TQ ``--tq``, so waiting tenants'
memory goes to host RAM through the driver's checkpoint API. The tenants are let
allocate one after the other, each only when NVML shows room for it. With
``--torch-tenant`` one more tenant is a PyTorch training loop (``train_worker.py``)
whose loss curve must equal an unswapped run's to the bit; ``--state-dir DIR
--keep-state`` reuses an earlier run's kiwid state_dir, so that kiwid knows the
tenants' footprints (their command lines are the same in every run).

Printed at the end, also when something failed half-way: per hand-over, the bytes,
swap-out and swap-in seconds and GB/s (kiwid's ``Swapped out``/``Swapped in`` lines)
and the hand-over time on the tenants' own clocks; useful GPU time over the whole
window and over the steady rotation, with the steady hand-overs' p50; each tenant's
first turn, newcomer or known; the trainer's loss curve; the integrity result; the
machine. Clean-up on every path: workers SIGKILLed, kiwid stopped, ``kiwid
recover``, cgroups removed. The modules beside it: swap_args (options), swap_run
(the run), swap_logs, swap_analysis, swap_losses, swap_report, swap_state,
swap_reference, swap_host, swap_dry.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import enforcement as enf
from enforcement import (
    WORK,
    BenchError,
    Layout,
    check_config,
    clean_start,
    log,
)
from swap_analysis import Analysis
from swap_args import H200_GIB, parse, plan_lines
from swap_dry import dry_run
from swap_host import GIB, GpuMemory, config_text, host_available, host_total, machine_line
from swap_report import report, summary
from swap_run import Run
from swap_state import StateDirError, prepare


def main() -> int:
    args = parse()
    if args.deps.is_dir():
        enf.EXTRA_PATHS.append(str(args.deps))
        sys.path.insert(0, str(args.deps))

    def _sigterm(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    outdir = args.out or (
        Path(os.environ["OUT"]) / "kiwi-swap" if os.environ.get("OUT") else WORK / "out-swap"
    )
    outdir.mkdir(parents=True, exist_ok=True)
    mode = " (DRY RUN)" if args.dry_run else " (REHEARSAL: simulated GPU)" if args.rehearse else ""
    log(f"kiwi GPU swap check{mode}: python {sys.version.split()[0]} ({sys.executable})")
    log(f"repo {enf.REPO}; output {outdir}; work dir {WORK}")
    for line in plan_lines(args):
        log("plan: " + line)
    layout = Layout.detect()
    avail, total = host_available(), host_total()
    log(
        f"cgroups: {layout}; root: {os.geteuid() == 0}; host RAM {(total or 0) / GIB:.0f} GiB, "
        f"{(avail or 0) / GIB:.0f} GiB available"
    )
    if not enf.preflight(args, layout):
        return 2
    sizes = sorted([args.gib] * args.tenants + ([args.torch_gib] if args.torch_tenant else []))
    swapped = sum(sizes[:-1]) * GIB + (len(sizes) - 1) * args.overhead_gib * GIB
    if not args.dry_run and avail is not None and avail < swapped + args.host_floor_mib * 2**20:
        log(
            f"WARNING: {avail / GIB:.0f} GiB of host RAM available, the swapped tenants need "
            f"~{swapped / GIB:.0f} GiB plus the {args.host_floor_mib} MiB floor: kiwid may "
            "refuse swap-outs"
        )

    run = Run(args, layout, outdir)
    machine = [machine_line()]
    finished: list[Analysis | None] = []
    interrupted = False
    try:
        if os.geteuid() == 0:
            clean_start(layout, args.state_dir)
            if not args.dry_run:
                for line in prepare(args.state_dir, keep=args.keep_state, bench_root=WORK):
                    log(line)
        if args.dry_run:
            errors, warnings = dry_run(run, layout)
            log(
                f"dry run {'OK' if not errors else 'FAILED'}: "
                f"{errors} failure(s), {warnings} warning(s)"
            )
            return 1 if errors else 0
        _real(run, args, machine)
    except StateDirError as exc:
        log(f"ERROR: {exc}")
        return 2
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        interrupted = True
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the clean-up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if run.t_end is None and run.t_rot0 is not None:
            run.t_end = time.monotonic()
        run.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if not args.dry_run and run.workers:
            finished.append(_finish(run, args, outdir, machine))
    if interrupted:
        return 130
    result = finished[0] if finished else None
    return 0 if result is not None and result.integrity_ok and not run.errors else 1


def _real(run: Run, args: argparse.Namespace, machine: list[str]) -> None:
    """Set up and rotate; a BenchError is recorded, the verdict comes after the clean-up."""
    try:
        if args.rehearse:
            sim_gib = round(H200_GIB * args.scale, 2)
            run.memory = GpuMemory(total=int(sim_gib * GIB))
            machine.append(
                f"GPU: none (rehearsal: kiwid's simulated GPU, {sim_gib:g} GiB, swaps at "
                f"{args.sim_gbps[0]:g} GB/s out, {args.sim_gbps[1]:g} GB/s in)"
            )
        else:
            import pynvml  # noqa: PLC0415 - only on the GPU machine

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            run.memory = GpuMemory(pynvml, handle, total)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            driver = pynvml.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else driver
            machine.append(f"GPU 0: {name}, {total / GIB:.1f} GiB, driver {driver}")
            used, _ = run.memory.used_free()
            procs = run.memory.processes()
            log(f"{machine[-1]}; {used / GIB:.1f} GiB used by {procs} process(es) before the run")
            if procs:
                log("WARNING: the GPU already has processes: they take room from the tenants")
        host = host_total()
        machine.append(f"host RAM {(host or 0) / GIB:.0f} GiB; {run.layout}")
        WORK.mkdir(parents=True, exist_ok=True)
        backend = "sim" if args.rehearse else "nvml"
        gate = None if args.rehearse else "cuda-lock"
        config = WORK / f"kiwid-swap-{backend}.toml"
        config.write_text(
            config_text(
                args.tq,
                backend=backend,
                gate=gate,
                host_floor_mib=args.host_floor_mib,
                sim_gib=round(H200_GIB * args.scale, 2),
                sim_gbps=args.sim_gbps,
                state_dir=args.state_dir,
                checkpoint_lanes=args.checkpoint_lanes,
                newcomer=args.newcomer,
                declared=declarations(args),
            )
        )
        run.spawn()  # torch imports overlap the config check
        checked_config(config)
        run.reference(120)  # the trainer alone, before any tenant starts CUDA
        run.init_workers(120)
        machine += run.ready_lines
        run.start_kiwid(config)
        run.rotate()
    except BenchError as exc:
        run.errors.append(str(exc))
        log(f"ERROR: {exc}")


def declarations(args: argparse.Namespace) -> dict[str, int] | None:
    """With ``--declare``: each tenant's cgroup, with its ballast plus its overhead in bytes."""
    if not args.declare:
        return None
    sizes = [args.gib] * args.tenants + ([args.torch_gib] if args.torch_tenant else [])
    return {
        f"/{enf.CG_PREFIX}{i}": int((gib + args.overhead_gib) * GIB) for i, gib in enumerate(sizes)
    }


def checked_config(config: Path) -> None:
    rc, text = check_config(config)
    if rc != 0:
        raise BenchError(f"kiwid check-config {config} failed ({rc}): {text}")
    log(f"kiwid config {config}: OK")


def _finish(
    run: Run, args: argparse.Namespace, outdir: Path, machine: list[str]
) -> Analysis | None:
    analysis = None
    text = ""
    try:
        if run.t_rot0 is not None:
            analysis = run.analysis()
            text = report(analysis, machine)
        else:
            text = "\n== no rotation took place\n" + "\n".join(machine)
        if run.identities:
            text += "\ntenants as kiwid knows them (executable and arguments):\n" + "\n".join(
                f"  {lb} ({'known' if run.known.get(lb) else 'newcomer'}): {ident}"
                for lb, ident in run.identities.items()
            )
        if run.state_removed:
            text += (
                f"\nWARNING: kiwid or kiwid recover removed {run.state_removed} from the state dir"
            )
        if run.errors:
            text += "\nerrors:\n" + "\n".join("  " + e for e in run.errors)
        polls = run.status_polls
        during = [p for p in polls if p["swap"]]
        if polls:
            rtts = sorted(p["rtt_ms"] for p in polls)
            text += (
                f"\nkiwictl status: {len(polls)} queries, {sum(1 for p in polls if p['error'])} "
                f"failed, max {rtts[-1]:.0f} ms; {len(during)} answered during a swap"
            )
        if run.samples:
            text += (
                f"\nGPU memory used: max {max(s[1] for s in run.samples) / GIB:.1f} GiB of "
                f"{run.memory.total / GIB:.1f}; host RAM available: min "
                f"{min((s[3] or 0) for s in run.samples) / GIB:.1f} GiB"
            )
        print(text, flush=True)
        (outdir / "swap-table.txt").write_text(text + "\n")
    except Exception as exc:
        log(f"ERROR: the analysis failed: {exc!r}; raw logs are in {outdir}")
    dump = {
        "machine": machine,
        "args": {k: str(v) for k, v in vars(args).items()},
        "elapsed_s": round(time.monotonic() - enf.T0, 1),
        "errors": run.errors,
        "gate_line": run.gate_line,
        "released_s": {k: round(v - (run.t_rot0 or v), 2) for k, v in run.released.items()},
        "allocated_s": {k: round(v - (run.t_rot0 or v), 2) for k, v in run.allocated.items()},
        "forced": run.forced,
        "exited": run.exited,
        "status_polls": run.status_polls,
        "nvml_errors": run.memory.errors[:20],
        "kiwid_log": str(run.kiwid_log) if run.kiwid_log else None,
        "state_dir": str(args.state_dir),
        "state_before": run.state_before,
        "state_removed": run.state_removed,
        "identities": run.identities,
        "known": run.known,
        "reference_log": str(run.reference_log) if run.reference_log else None,
    }
    if analysis is not None:
        dump["integrity"] = analysis.integrity
        dump["integrity_ok"] = analysis.integrity_ok
        dump["handovers"] = [
            {**asdict(h), "gap_s": h.gap_s, "floor_s": h.floor_s} for h in analysis.handovers
        ]
        dump["other_swaps"] = [asdict(e) for e in analysis.other_swaps]
        dump["failed_swaps"] = [asdict(e) for e in analysis.failed_swaps]
        dump["tenants"] = [asdict(t) for t in analysis.tenants]
        dump["notes"] = analysis.notes
        dump["summary"] = summary(analysis)
        dump["first_turns"] = [asdict(f) for f in analysis.first_turns]
        dump["steady"] = asdict(analysis.steady)
        if analysis.losses is not None:
            dump["losses"] = asdict(analysis.losses)
    with contextlib.suppress(OSError, TypeError, ValueError):
        (outdir / "results.json").write_text(json.dumps(dump, indent=1, default=str))
    log(f"results: {outdir}; total {time.monotonic() - enf.T0:.0f} s")
    return analysis


if __name__ == "__main__":
    sys.exit(main())
