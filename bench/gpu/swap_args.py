"""bench/gpu/swap.py's options and the plan it prints."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import enforcement as enf
from enforcement import STATE

H200_GIB, H200_BALLAST_GIB = 140.4, 47.5  # the card and the by-hand reference's tenants
OVERHEAD_GIB = 1.5  # per tenant beyond the ballast: CUDA context, operands, check buffers
LEAD_S = 2.0  # release a tenant only this long before a hand-over is due, at the latest
NEWCOMER = ("whole-card", "free")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="GPU memory oversubscription check: tenants larger than the card "
        "together, swapped by kiwid."
    )
    p.add_argument("--gib", type=float, help="ballast per tenant, GiB (47.5; rehearse 4.75)")
    p.add_argument("--tenants", type=int, default=3, help="ballast tenants (3)")
    p.add_argument(
        "--torch-tenant",
        action="store_true",
        help="one more tenant: a PyTorch training loop (train_worker.py) whose loss curve "
        "must equal an unswapped run's to the bit (pure-Python fallback without torch)",
    )
    p.add_argument("--torch-gib", type=float, help="the trainer's ballast, GiB (as --gib)")
    p.add_argument("--tq", type=float, help="kiwid's TQ, s (30; rehearse 5)")
    p.add_argument("--budget", type=float, help="rotation seconds (330; rehearse 45)")
    p.add_argument("--settle", type=float, default=45.0, help="wait for a swap in flight")
    p.add_argument("--max-total", type=float, default=470.0, help="hard cap on the run, s")
    p.add_argument("--cleanup-reserve", type=float, default=60.0, help="kept for the clean-up, s")
    p.add_argument("--margin-gib", type=float, default=4.0, help="free memory margin")
    p.add_argument(
        "--force-after", type=float, default=120.0, help="release the next tenant anyway after"
    )
    p.add_argument("--host-floor-mib", type=int, default=4096, help="kiwid's host RAM floor")
    p.add_argument(
        "--checkpoint-lanes",
        type=int,
        help="kiwid's memory.checkpoint_lanes (written only when given)",
    )
    p.add_argument(
        "--newcomer", choices=NEWCOMER, help="kiwid's memory.newcomer (written only when given)"
    )
    p.add_argument(
        "--declare",
        action="store_true",
        help="each tenant declares its GPU memory (its ballast plus the context overhead) "
        "through a [[tenants]] rule on its cgroup: kiwid sizes a newcomer's first turn by it",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=STATE,
        help="kiwid's state_dir (default %(default)s); emptied at the start unless --keep-state",
    )
    p.add_argument(
        "--keep-state",
        action="store_true",
        help="keep --state-dir as an earlier run left it: its workloads are known to kiwid",
    )
    p.add_argument(
        "--sim-gbps",
        default="2.2,5.5",
        help="rehearsal: the simulated GPU's swap-out,swap-in rates in GB/s (the H200's "
        "driver: 2.2,5.5); default %(default)s",
    )
    p.add_argument("--out", type=Path, help="output folder (default $OUT/kiwi-swap)")
    p.add_argument("--deps", type=Path, default=enf.DEPS_DIR, help="kiwid's dependencies")
    p.add_argument("--dry-run", action="store_true", help="no CUDA: checks and the plan")
    p.add_argument(
        "--rehearse", action="store_true", help="no CUDA: the whole run on kiwid's simulated GPU"
    )
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    args.tq = args.tq if args.tq is not None else (5.0 if args.rehearse else 30.0)
    args.gib = args.gib if args.gib is not None else (4.75 if args.rehearse else H200_BALLAST_GIB)
    args.torch_gib = args.torch_gib if args.torch_gib is not None else args.gib
    # A rehearsal is a model of the H200 run at gib / 47.5 scale: the simulated card, the
    # tenants' overhead and the margin shrink with it (kiwid's host floor checks real RAM).
    args.scale = args.gib / H200_BALLAST_GIB if args.rehearse else 1.0
    args.overhead_gib = OVERHEAD_GIB * args.scale
    args.margin_gib *= args.scale
    args.budget = args.budget if args.budget is not None else (45.0 if args.rehearse else 330.0)
    if args.tenants < 0 or args.tenants + args.torch_tenant < 1 or args.gib <= 0:
        p.error("at least one tenant (--tenants, --torch-tenant) and --gib > 0")
    if args.checkpoint_lanes is not None and args.checkpoint_lanes < 1:
        p.error("--checkpoint-lanes >= 1")
    try:
        out_gbps, in_gbps = (float(x) for x in args.sim_gbps.split(","))
    except ValueError:
        p.error("--sim-gbps OUT,IN, e.g. 2.2,5.5")
    args.sim_gbps = (out_gbps, in_gbps)
    return args


def plan_lines(args: argparse.Namespace) -> list[str]:
    sizes = [args.gib] * args.tenants + ([args.torch_gib] if args.torch_tenant else [])
    total = sum(sizes) + len(sizes) * args.overhead_gib
    est = 30 + args.budget + 0.5 * args.settle + 30
    trainer = (
        f" + a PyTorch trainer with {args.torch_gib:g} GiB of ballast" if args.torch_tenant else ""
    )
    extra = [
        f"memory.{key} = {value!r}"
        for key, value in (("checkpoint_lanes", args.checkpoint_lanes), ("newcomer", args.newcomer))
        if value is not None
    ]
    if args.declare:
        extra.append(f"each tenant declares {args.gib + args.overhead_gib:.3g} GiB")
    return [
        f"{args.tenants} tenants x {args.gib:g} GiB ballast{trainer} (~{total:.0f} GiB with "
        f"contexts), kiwid TQ {args.tq:g} s, swap = checkpoint, gate = "
        + ("the sim's" if args.rehearse else "cuda-lock")
        + (f", {', '.join(extra)}" if extra else ""),
        f"rotation {args.budget:g} s, settle <= {args.settle:g} s, hard cap {args.max_total:g} s "
        f"in all; expected ~{est:.0f} s",
        f"tenant i+1 allocates once NVML shows its footprint + {args.margin_gib:.2g} GiB "
        f"free and kiwid is not swapping in nor handing over within {LEAD_S:g} s (once "
        f"{args.force_after:g} s have passed, room is enough)",
        f"kiwid's state_dir {args.state_dir}: "
        + ("kept from an earlier run" if args.keep_state else "emptied first (newcomers)"),
    ]
