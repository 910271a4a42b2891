"""Benchmark: an idle fleet of inference servers beside a trainer, memory.park "off" against "idle".

A trainer (4 GiB, always at GPU work, priority 0) and N real HTTP servers (3 GiB
each, priority 1; each a process in a cgroup of its own on its own port, ~0.3 s
of GPU work per request) share one card that holds the trainer and only a few
servers, with ``memory.swap = "checkpoint"`` at an H200's link rates (out 2.2 GB/s,
in 6 GB/s). Only server s1 gets requests (every ``--period`` s); the others never
do. For each backend (the simulated GPU, and the driver double with the CUDA
lock) and each N, it runs ``memory.park = "off"`` then ``"idle"`` and prints:
restores of the servers that got no request (kiwid's ``Swapped in`` lines, all of
them and those after the server first parked), bytes moved each way, the
trainer's share of the GPU, s1's latency (p50/p99, from the bench's client), and
the latency of each request that found s1 parked beside the bound it should
meet (one poll + the trainer's gate + s1's restore + the room that restore needs
+ 1 s). Then the goals, PASS or FAIL, for the simulated GPU with park "idle".

Needs root (cgroups, kiwid's gate) and, for the driver double, a C compiler.
Prints the machine and the commit first. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import _idle_fleet_report as rep
from _faults_rig import GIB, ROOT, exit_on_signals
from _idle_fleet_rig import PARK_KEY, Fleet, Options, sweep_leftovers
from _kiwid import machine

GATE_S = {"sim": 0.001, "double": 0.02}
"""The holder's gate as the bound counts it: a freeze (~1 ms), a CUDA lock (16-19 ms on an H200)."""


def commit() -> str:
    """The commit the bench runs from (``+dirty`` with uncommitted changes)."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return out.stdout.strip()

    head = git("log", "-1", "--format=%h %s") or "unknown"
    return head[:90] + (" +dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def card_gib(servers: int, opts: Options) -> float:
    """The trainer and two servers (N=4), one more server per 4 beyond 8."""
    return opts.trainer_gib + opts.server_gib * max(2, servers // 4)


def summarize(fleet: Fleet) -> dict[str, Any]:
    """The figures of one configuration."""
    o = fleet.opts
    start, end = fleet.start_t, fleet.end_t
    found = rep.swaps(fleet.lines, start, end)
    every = rep.swaps(fleet.lines, 0, end)
    quiet = [s.key for s in fleet.servers[1:]]
    parked_at = {k: rep.first_in_state(fleet.samples, k, "parked") for k in quiet}
    after = {k: rep.restores(found, k, parked_at[k]) for k in quiet if parked_at[k] is not None}
    answered = [r for r in fleet.requests if r.latency is not None]
    lat = [r.latency for r in answered if r.latency is not None]
    p50, p99 = rep.percentiles(lat, (50, 99))
    strict = rep.busy_windows(fleet.requests, 0.0)
    tail = o.idle_release + o.trainer_gib * GIB / (o.in_gbps * 1e9) + o.poll
    served = rep.busy_windows(fleet.requests, tail)
    share_all, _ = rep.trainer_share(fleet.samples, start, end, [])
    share_strict, _ = rep.trainer_share(fleet.samples, start, end, strict)
    share_quiet, counted = rep.trainer_share(fleet.samples, start, end, served)
    size = int(o.server_gib * GIB)
    parked = []
    for r in fleet.requests:
        if r.state != "parked":
            continue
        card = int(o.card_gib * GIB)
        room = rep.room_bytes(r.resident_bytes, size, o.reserve_mib * 2**20, card, size)
        bound = rep.restore_bound(
            poll=o.poll,
            gate=GATE_S[o.backend],
            size=size,
            room=room,
            in_rate=o.in_gbps * 1e9,
            out_rate=o.out_gbps * 1e9,
        )
        parked.append(
            {
                "latency": r.latency,
                "restore_s": size / (o.in_gbps * 1e9),
                "room_s": room / (o.out_gbps * 1e9),
                "bound": bound,
            }
        )
    scheduler = (fleet.last_status or {}).get("scheduler") or {}
    return {
        "backend": o.backend,
        "servers": o.servers,
        "park": o.park if PARK_KEY else f"{o.park} (no key)",
        "card_gib": o.card_gib,
        "seconds": round(end - start, 1),
        "settled": fleet.settled,
        "restores_quiet": sum(rep.restores(found, k) for k in quiet),
        "restores_quiet_before": sum(rep.restores(every, k) for k in quiet)
        - sum(rep.restores(found, k) for k in quiet),
        "quiet_parked": len(after),
        "restores_after_parked": sum(after.values()) if after else None,
        "restores_s1": rep.restores(found, fleet.servers[0].key),
        "restores_trainer": rep.restores(found, fleet.trainer_key),
        "bytes_in": rep.moved(found, "in"),
        "bytes_out": rep.moved(found, "out"),
        "trainer_share": share_all,
        "trainer_share_no_request": share_strict,
        "trainer_share_quiet": share_quiet,
        "quiet_counted_s": counted,
        "tail_s": tail,
        "requests": len(fleet.requests),
        "failed": len(fleet.requests) - len(answered),
        "errors": sorted({r.error for r in fleet.requests if r.error}),
        "p50": p50,
        "p99": p99,
        "parked_requests": parked,
        "wakes": scheduler.get("wakes"),
        "restores_wasted": scheduler.get("restores_wasted"),
    }


def run_one(opts: Options) -> dict[str, Any]:
    """Run one configuration and return its figures."""
    label = f"{opts.backend} N={opts.servers} park={opts.park}"
    print(f"... {label}: card {opts.card_gib:g} GiB, {opts.seconds:g} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="kiwi-idle-fleet-") as tmp:
        d = Path(tmp)
        d.chmod(0o755)
        with Fleet(opts, d) as fleet:
            fleet.run()
            result = summarize(fleet)
        problems = fleet.cleanup()
        if problems:
            print(f"    clean-up: {'; '.join(problems)}")
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    """One row per configuration."""
    head = (
        f"{'backend':7} {'N':>3} {'park':10} {'quiet restores':>14} {'after park':>10} "
        f"{'GB in':>7} {'GB out':>7} {'trainer':>8} {'no req':>7} {'quiet':>7} "
        f"{'reqs':>5} {'p50 s':>6} {'p99 s':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        after = "-" if r["restores_after_parked"] is None else str(r["restores_after_parked"])
        print(
            f"{r['backend']:7} {r['servers']:>3} {r['park']:10} {r['restores_quiet']:>14} "
            f"{after:>10} {r['bytes_in'] / 1e9:>7.1f} {r['bytes_out'] / 1e9:>7.1f} "
            f"{r['trainer_share']:>8.1%} {r['trainer_share_no_request']:>7.1%} "
            f"{r['trainer_share_quiet']:>7.1%} {r['requests'] - r['failed']:>2}/{r['requests']:<2} "
            f"{rep.fmt_s(r['p50']):>6} {rep.fmt_s(r['p99']):>6}"
        )
    print(
        "quiet restores: restores of the servers that got no request during the window "
        "(kiwid's 'Swapped in' lines); after park: those after the server was first seen "
        "parked (- : none parked); trainer: its share of the window; no req: of the time no "
        "request was pending (sent to answered); quiet: outside each request's service "
        "(sent to answered + idle_release + the trainer's restore + one poll)"
    )


def print_details(results: list[dict[str, Any]]) -> None:
    for r in results:
        label = f"{r['backend']} N={r['servers']} park={r['park']}"
        extra = [f"s1 restores {r['restores_s1']}", f"trainer restores {r['restores_trainer']}"]
        extra.append(f"quiet servers' restores during set-up {r['restores_quiet_before']}")
        if r["wakes"] is not None:
            extra.append(f"wakes {json.dumps(r['wakes'])}")
        if r["restores_wasted"] is not None:
            extra.append(f"restores wasted {r['restores_wasted']}")
        if not r["settled"]:
            extra.append("the trainer did not run before the window began")
        if r["errors"]:
            extra.append(f"failed requests: {'; '.join(r['errors'])}")
        print(f"{label}: {', '.join(extra)}")
        for p in r["parked_requests"]:
            print(
                f"    request to parked s1: answered in {rep.fmt_s(p['latency'])} s; its restore "
                f"{p['restore_s']:.2f} s + room {p['room_s']:.2f} s; bound {p['bound']:.2f} s"
            )


def print_goals(results: list[dict[str, Any]]) -> None:
    """The goals, on the simulated GPU with park "idle"."""
    print("goals (simulated GPU at H200 rates, park = idle):")
    for r in results:
        if r["backend"] != "sim" or not str(r["park"]).startswith("idle"):
            continue
        n = r["servers"]
        after = r["restores_after_parked"]
        ok = None if after is None else after == 0
        print(
            f"  N={n}: servers with no request have 0 restores once parked: "
            f"{'-' if after is None else after} ({r['quiet_parked']} of {n - 1} parked) "
            f"{rep.verdict(ok)}"
        )
        share = r["trainer_share_quiet"]
        print(
            f"  N={n}: the trainer holds the GPU >= 95% of the time no request is served: "
            f"{share:.1%} {rep.verdict(share >= 0.95)} (strictly outside sent-to-answered: "
            f"{r['trainer_share_no_request']:.1%}; s1 keeps the GPU idle_release after its answer)"
        )
        lats = [p["latency"] for p in r["parked_requests"] if p["latency"] is not None]
        bounds = [p["bound"] for p in r["parked_requests"]]
        if r["parked_requests"] and len(lats) < len(r["parked_requests"]):
            lats.append(float("inf"))  # a failed request counts as too slow
        p50 = rep.percentiles(lats, (50,))[0]
        bound = rep.percentiles(bounds, (50,))[0]
        ok = None if not lats else p50 <= bound
        print(
            f"  N={n}: a request to a parked server is answered within poll + gate + restore "
            f"+ room + 1 s (p50 of {len(lats)}): {rep.fmt_s(p50)} s <= {rep.fmt_s(bound)} s "
            f"{rep.verdict(ok)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="4,16", help="fleet sizes, comma-separated")
    parser.add_argument("--seconds", type=float, default=120.0, help="window per configuration")
    parser.add_argument("--backend", choices=("sim", "double", "both"), default="sim")
    parser.add_argument("--period", type=float, default=20.0, help="s between requests to s1")
    parser.add_argument("--tq", type=float, default=30.0)
    parser.add_argument("--idle-release", type=float, default=5.0)
    parser.add_argument("--poll", type=float, default=0.5, help="gpu.poll_interval")
    parser.add_argument("--card-gib", type=float, help="the card (default: trainer + N/4 servers)")
    parser.add_argument("--park", default="off,idle", help="park settings, comma-separated")
    parser.add_argument("--out", type=Path, help="write every figure here as JSON")
    args = parser.parse_args()
    previous = exit_on_signals()
    print(machine())
    print(f"commit: {commit()}")
    if not PARK_KEY:
        print("note: this kiwid has no memory.park key: both runs use its default behaviour")
    print("driver double: checkpoint and restore take size / rate (its swap-rate model)")
    for leftover in sweep_leftovers():
        print(f"removed the cgroups of an earlier run: {leftover}")
    backends = ["sim", "double"] if args.backend == "both" else [args.backend]
    base = Options(
        seconds=args.seconds,
        period=args.period,
        first_after=min(10.0, args.period / 2),
        tq=args.tq,
        idle_release=args.idle_release,
        poll=args.poll,
    )
    results = []
    started = time.monotonic()
    try:
        for backend in backends:
            for n in (int(x) for x in args.servers.split(",")):
                card = args.card_gib or card_gib(n, base)
                for park in args.park.split(","):
                    opts = replace(base, backend=backend, servers=n, park=park, card_gib=card)
                    results.append(run_one(opts))
    finally:
        print(f"\n{len(results)} configurations in {time.monotonic() - started:.0f} s")
        print(f"TQ {args.tq:g} s, idle_release {args.idle_release:g} s, poll {args.poll:g} s")
        if results:
            print_table(results)
            print_details(results)
            print_goals(results)
        if args.out and results:
            args.out.write_text(json.dumps({"options": asdict(base), "results": results}, indent=1))
        for sig, handler in previous.items():
            import signal  # noqa: PLC0415

            signal.signal(sig, handler)


if __name__ == "__main__":
    main()
