"""bench/gpu/host_copy_probe.py's readers of /proc and cgroup v2, on this process: no GPU."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

GPU_BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu"
sys.path.insert(0, str(GPU_BENCH))  # bench/gpu is no package

import host_copy_probe  # noqa: E402


def test_it_reads_where_a_process_keeps_its_memory() -> None:
    before = host_copy_probe.status(os.getpid())["RssAnon"]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # private: charged as RssAnon
    block = mmap.mmap(-1, 64 * 2**20, flags=flags)  # 64 MiB, touched below
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    try:
        after = host_copy_probe.status(os.getpid())
        assert after["RssAnon"] - before >= 60 * 1024, (before, after)
        assert set(after) >= {"VmRSS", "RssAnon", "VmLck", "VmPin"}
        biggest = host_copy_probe.big_mappings(os.getpid())
        assert biggest[0][0] >= 60 * 1024, biggest
    finally:
        block.close()


def test_its_cgroup_and_charge_are_found() -> None:
    cgroup = host_copy_probe.cgroup_dir(os.getpid())
    assert cgroup is not None and cgroup.is_dir()
    charge = host_copy_probe.current(cgroup)
    assert charge is None or charge > 0  # None where the memory controller is off


def test_the_dry_run_says_the_plan() -> None:
    out = subprocess.run(
        [sys.executable, str(GPU_BENCH / "host_copy_probe.py"), "--dry-run", "--gib", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "memory.reclaim of 2 GiB" in out.stdout
