"""Benchmark: gate switch latency of the cgroup freezer, as kiwid does it.

Freeze (write cgroup.freeze / freezer.state, wait until the kernel reports the
cgroup frozen) and thaw of one cgroup holding 1, 16 and 256 busy processes, for
cgroup v2 and the v1 freezer. Prints p50/p99 per case and the machine.
Target: p99 < 5 ms for a freeze + thaw at 16 processes. Needs root.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from kiwid.adapters.cgroups import CgroupLayout, CgroupRef, Freezer

ROUNDS = 200


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run_case(layout: CgroupLayout, hierarchy: str, count: int) -> tuple[list[float], list[float]]:
    name = f"/kiwi-bench-{uuid.uuid4().hex[:8]}"
    ref = CgroupRef(v2=name, v1_freezer=None) if hierarchy == "v2" else CgroupRef(None, name)
    v2_dir, v1_dir = layout.dirs(ref)
    directory = v2_dir or v1_dir
    assert directory is not None
    directory.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    freezer = Freezer(layout, timeout_s=5.0)
    try:
        for _ in range(count):
            # One busy process, the rest asleep: with 2 cores, hundreds of busy loops
            # would starve this measuring process rather than load the freezer.
            code = "while True: pass" if not procs else "import time; time.sleep(3600)"
            proc = subprocess.Popen([sys.executable, "-S", "-c", code])
            (directory / "cgroup.procs").write_text(str(proc.pid))
            procs.append(proc)
        freezes, thaws = [], []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            freezer.freeze(ref)
            mid = time.perf_counter()
            freezer.thaw(ref)
            end = time.perf_counter()
            freezes.append((mid - start) * 1000)
            thaws.append((end - mid) * 1000)
        return freezes, thaws
    finally:
        with contextlib.suppress(Exception):
            freezer.thaw(ref)
        for proc in procs:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            directory.rmdir()


def main() -> None:
    if os.geteuid() != 0:
        sys.exit("gate_latency needs root (it creates cgroups)")
    layout = CgroupLayout.detect()
    print(
        f"machine: {platform.node()} {cpu_model()}, {os.cpu_count()} cores, "
        f"kernel {platform.release()}, python {platform.python_version()}"
    )
    print(f"{ROUNDS} freeze+thaw rounds per case; one process busy, the others asleep")
    print(
        f"{'hierarchy':<10}{'procs':>6}  {'freeze p50':>10} {'p99':>7}  {'thaw p50':>9} {'p99':>7}"
        f"  {'switch p99 (ms)':>15}"
    )
    hierarchies = [
        h for h, root in (("v2", layout.v2_root), ("v1", layout.v1_freezer_root)) if root
    ]
    for hierarchy in hierarchies:
        for count in (1, 16, 256):
            freezes, thaws = run_case(layout, hierarchy, count)
            switch = [f + t for f, t in zip(freezes, thaws, strict=True)]
            print(
                f"{hierarchy:<10}{count:>6}  {statistics.median(freezes):10.3f} "
                f"{percentile(freezes, 0.99):7.3f}  {statistics.median(thaws):9.3f} "
                f"{percentile(thaws, 0.99):7.3f}  {percentile(switch, 0.99):15.3f}"
            )
    print("target: freeze + thaw p99 < 5 ms at 16 processes")


if __name__ == "__main__":
    main()
