"""Benchmark: kiwid's own CPU and memory with 8 simulated GPUs x 64 idle tenants.

512 real processes (``sleep 3600``) are attached round-robin to 8 simulated GPUs
with 1 GiB each (activity "cpu": a sleeping process is idle). Once kiwid lists all
512 tenants, its CPU use (utime + stime from /proc/PID/stat over 20 s of wall
time, in % of one core) and its RSS (VmRSS) are measured. Targets: < 1% of a
core, < 60 MB. Then the round trip of kiwictl-style pings (no target here: see
control_rtt.py). With ``--busy N``, a second phase replaces N of the sleepers (the
first N, so one per GPU while N <= 8) by busy loops and measures again.
Prints the machine it ran on.
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time
import urllib.request
from pathlib import Path

from _kiwid import (
    GIB,
    Kiwid,
    Tenants,
    cpu_seconds,
    exit_on_sigterm,
    machine,
    percentiles,
    raise_nofile,
    rss_bytes,
)

TARGET_CPU_PCT = 1.0
TARGET_RSS_MB = 60.0


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def wait_for(kiwid: Kiwid, count: int, busy: int, timeout_s: float) -> float:
    """Wait until kiwid lists ``count`` tenants, ``busy`` of them not idle; return the wait."""
    start = time.monotonic()
    while True:
        tenants = kiwid.request("tenants")["tenants"]
        assert isinstance(tenants, list)
        active = sum(1 for t in tenants if t["state"] != "idle")
        if len(tenants) == count and active >= busy:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(
                f"kiwid lists {len(tenants)} tenants ({active} not idle) after {timeout_s:g} s; "
                f"expected {count} ({busy} not idle)"
            )
        time.sleep(0.25)


def measure(kiwid: Kiwid, seconds: float, label: str) -> None:
    """Print kiwid's CPU use over ``seconds`` of wall time and its RSS at the end."""
    cpu0, t0 = cpu_seconds(kiwid.pid), time.monotonic()
    time.sleep(seconds)
    cpu1, t1 = cpu_seconds(kiwid.pid), time.monotonic()
    pct = 100 * (cpu1 - cpu0) / (t1 - t0)
    rss_mb = rss_bytes(kiwid.pid) / 1e6
    print(
        f"{label}: kiwid CPU {pct:.2f}% of one core over {t1 - t0:.1f} s "
        f"(target < {TARGET_CPU_PCT:g}%: {_verdict(pct < TARGET_CPU_PCT)}); "
        f"RSS {rss_mb:.1f} MB (target < {TARGET_RSS_MB:g} MB: {_verdict(rss_mb < TARGET_RSS_MB)})"
    )


def ping_latency(kiwid: Kiwid, count: int, label: str) -> None:
    """Print the round trip of ``count`` pings, one connection each (as kiwictl)."""
    ms: list[float] = []
    for _ in range(count):
        t0 = time.perf_counter()
        kiwid.request("ping")
        ms.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.02)
    p50, p99, top = percentiles(ms, (50, 99, 100))
    print(f"{label}: kiwictl-style ping round trip ms: p50 {p50:.1f}  p99 {p99:.1f}  max {top:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--per-gpu", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0, help="measuring window")
    parser.add_argument("--poll", type=float, default=0.5, help="kiwid's gpu.poll_interval")
    parser.add_argument("--busy", type=int, default=0, help="second phase: N busy tenants")
    parser.add_argument("--pings", type=int, default=40, help="pings after each window")
    parser.add_argument(
        "--activity",
        choices=("cpu", "idle"),
        default="cpu",
        help='sim activity of the idle tenants: "cpu" (the sim reads each one\'s CPU time '
        'every poll) or "idle" (no samples, as NVML has none for an idle process: '
        "what is left is kiwid's own cost)",
    )
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="enable kiwid's Prometheus endpoint and scrape it while measuring",
    )
    parser.add_argument(
        "--scrape-every", type=float, default=15.0, help="seconds between scrapes (default 15)"
    )
    parser.add_argument(
        "--profile", type=Path, help="run kiwid under cProfile, write its profile here"
    )
    args = parser.parse_args()
    exit_on_sigterm()
    count = args.gpus * args.per_gpu
    raise_nofile(count + 1024)
    print(machine())
    port = None
    if args.metrics:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    daemon = Kiwid(args.gpus, poll_interval=args.poll, profile=args.profile, metrics_port=port)
    with Tenants() as tenants, daemon as kiwid:
        start = time.monotonic()
        slots: list[tuple[int, int]] = []  # (pid, gpu), tenant i on GPU i % gpus
        for i in range(count):
            pid = tenants.spawn()
            slots.append((pid, i % args.gpus))
            args_ = {"pid": pid, "gpu": i % args.gpus, "memory_bytes": GIB}
            args_["activity"] = args.activity
            kiwid.request("sim-attach", args_)
        attached = time.monotonic() - start
        seen = wait_for(kiwid, count, 0, 120.0)
        print(
            f"kiwid: {args.gpus} simulated GPUs x {args.per_gpu} tenants = {count} idle "
            f"tenants (sleep 3600, sim activity {args.activity!r}), 1 GiB each, "
            f"poll every {args.poll:g} s, TQ 30 s; "
            f"attached in {attached:.1f} s, all listed {seen:.1f} s later"
        )
        scraper = Scraper(port, args.scrape_every, kiwid.pid) if port else None
        if scraper:
            scraper.start()
        measure(
            kiwid,
            args.seconds,
            f"idle, {count} tenants"
            + (f", metrics scraped every {args.scrape_every:g} s" if port else ""),
        )
        if scraper:
            scraper.stop()
            scraper.report()
        ping_latency(kiwid, args.pings, f"idle, {count} tenants")
        if args.busy:
            for i in range(min(args.busy, count)):
                old_pid, gpu = slots[i]
                kiwid.request("sim-detach", {"pid": old_pid})
                tenants.kill(old_pid)
                pid = tenants.spawn(busy=True)
                slots[i] = (pid, gpu)
                args_ = {"pid": pid, "gpu": gpu, "memory_bytes": GIB, "activity": "cpu"}
                kiwid.request("sim-attach", args_)
            seen = wait_for(kiwid, count, min(args.busy, count), 60.0)
            gpus = len({gpu for _, gpu in slots[: args.busy]})
            label = f"busy, {count} tenants of which {args.busy} busy on {gpus} GPUs"
            if args.busy >= len(os.sched_getaffinity(0)):
                print(
                    f"note: {args.busy} busy loops on {len(os.sched_getaffinity(0))} cores: "
                    "kiwid competes with them for CPU, so its share (and poll rate) is capped"
                )
            measure(kiwid, args.seconds, label)
            ping_latency(kiwid, args.pings, label)


class Scraper(threading.Thread):
    """Scrapes kiwid's /metrics every ``every`` seconds, as Prometheus would.

    Each scrape's cost is kiwid's CPU time (utime + stime) from just before the
    request to just after the answer: it includes whatever else kiwid did in those
    milliseconds, so it is an upper bound of the exposition's own cost.
    """

    def __init__(self, port: int, every: float, pid: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.every = every
        self.pid = pid
        self.halt = threading.Event()
        self.scrapes = 0
        self.series = 0
        self.cpu_ms: list[float] = []
        self.wall_ms: list[float] = []

    def run(self) -> None:
        while not self.halt.is_set():
            cpu0, t0 = cpu_seconds(self.pid), time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=10) as resp:
                body = resp.read().decode()
            self.wall_ms.append((time.perf_counter() - t0) * 1000)
            self.cpu_ms.append((cpu_seconds(self.pid) - cpu0) * 1000)
            self.scrapes += 1
            self.series = sum(1 for line in body.splitlines() if line and not line.startswith("#"))
            self.halt.wait(self.every)

    def report(self) -> None:
        """Print the scrapes' count, size and cost (per scrape, and per core at the interval)."""
        print(f"  metrics: {self.scrapes} scrapes, {self.series} series in the last one")
        if not self.cpu_ms:
            return
        cpu50, cpu_max = percentiles(self.cpu_ms, (50, 100))
        wall50, wall_max = percentiles(self.wall_ms, (50, 100))
        share = 100 * cpu50 / 1000 / self.every
        print(
            f"  per scrape: kiwid CPU p50 {cpu50:.1f} ms, max {cpu_max:.1f} ms; "
            f"answer in p50 {wall50:.1f} ms, max {wall_max:.1f} ms; at one scrape every "
            f"{self.every:g} s that is {share:.2f}% of one core "
            f"(target < {TARGET_CPU_PCT:g}%: {_verdict(share < TARGET_CPU_PCT)})"
        )

    def stop(self) -> None:
        self.halt.set()
        self.join(15)


if __name__ == "__main__":
    main()
