"""Can a checkpointed process's host copy be paged out? (A question for a later disk tier.)

Run as root on a GPU machine with the system ``python3`` (torch or cupy)::

    python3 bench/gpu/host_copy_probe.py --gib 8 2>&1 | tee "${OUT:-/tmp}/host_copy.log"
    python3 bench/gpu/host_copy_probe.py --dry-run     # no GPU: the plan only

A worker allocates ``--gib`` of device memory and fills it. The probe locks and
checkpoints it with kiwid's own driver adapter (``cuCheckpointProcessLock`` and
``Checkpoint``), then reads where the host copy lives, from the kernel:

* the worker's ``VmRSS``, ``RssAnon``, ``RssShmem``, ``VmLck`` and ``VmPin`` before
  and after (``/proc/PID/status``): is the copy charged to the process, and is it
  locked or pinned (then it cannot be paged out);
* its largest new mappings (``/proc/PID/smaps``): anonymous, shared memory or a
  driver device mapping;
* its cgroup's ``memory.current`` before and after, then after asking the kernel to
  reclaim the copy's size (``memory.reclaim``, cgroup v2): if the charge drops and
  the copy still restores bit-exact, the host copy can be paged out (to swap or
  zswap; without either, the figure says so: anonymous memory is then unreclaimable).

Then it restores, unlocks and checks the data. It prints one table and the machine,
and always restores and unlocks what it checkpointed, also on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WORKER = r"""
import sys, time, torch
n = int(sys.argv[1]) // 4
x = torch.arange(n, dtype=torch.int32, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
for line in sys.stdin:  # "check": the data survived?
    ok = bool((x == torch.arange(n, dtype=torch.int32, device="cuda")).all())
    print("ok" if ok else "bad", flush=True)
"""

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin")


def status(pid: int) -> dict[str, int]:
    """The memory fields of ``/proc/PID/status``, in KiB."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in FIELDS:
            out[key] = int(value.split()[0])
    return out


def big_mappings(pid: int, top: int = 4) -> list[tuple[int, str]]:
    """The largest mappings of ``pid`` (KiB, name) by Rss."""
    found: list[tuple[int, str]] = []
    name = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            parts = line.split(maxsplit=5)
            name = parts[5].strip() if len(parts) > 5 else "[anon]"
        elif line.startswith("Rss:"):
            found.append((int(line.split()[1]), name))
    return sorted(found, reverse=True)[:top]


def cgroup_dir(pid: int) -> Path | None:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return Path("/sys/fs/cgroup") / line[3:].lstrip("/")
    return None


def current(cgroup: Path | None) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int((cgroup / "memory.current").read_text()) if cgroup else None
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0, help="device memory to checkpoint")
    parser.add_argument("--dry-run", action="store_true", help="print the plan only")
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30)
    if args.dry_run:
        print(f"plan: a {args.gib:g} GiB CUDA worker, lock + checkpoint (kiwid's adapter),")
        print("      /proc status + smaps + cgroup memory.current before/after,")
        print(f"      memory.reclaim of {args.gib:g} GiB, restore + unlock + bit check")
        return 0
    from kiwid.adapters.cudalock import CudaLock, ProcessState  # noqa: PLC0415

    lock = CudaLock()
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    rows: list[tuple[str, object]] = []
    checkpointed = locked = False
    try:
        assert worker.stdout is not None
        assert worker.stdin is not None
        if worker.stdout.readline().strip() != "ready":
            print("the worker did not start", file=sys.stderr)
            return 1
        pid = worker.pid
        cgroup = cgroup_dir(pid)
        before, charge_before = status(pid), current(cgroup)
        lock.lock(pid, 10_000)
        locked = True
        started = time.monotonic()
        lock.checkpoint(pid)
        checkpointed = True
        rows.append(("checkpoint s", round(time.monotonic() - started, 2)))
        after, charge_after = status(pid), current(cgroup)
        for key in FIELDS:
            rows.append((f"{key} KiB before -> after", f"{before.get(key)} -> {after.get(key)}"))
        rows.append(("largest mappings after (KiB, name)", big_mappings(pid)))
        rows.append(("cgroup memory.current before -> after", f"{charge_before} -> {charge_after}"))
        reclaimed: object = "no cgroup v2 memory.reclaim here"
        if cgroup is not None and (cgroup / "memory.reclaim").exists():
            try:
                (cgroup / "memory.reclaim").write_text(str(nbytes))
                reclaimed = current(cgroup)
            except OSError as err:
                reclaimed = f"refused: {err.strerror}"
        rows.append(("memory.current after reclaim", reclaimed))
        rows.append(("status after reclaim", status(pid)))
        swaps = Path("/proc/swaps").read_text().splitlines()[1:]
        rows.append(("swap devices", len(swaps)))
        started = time.monotonic()
        lock.restore(pid)
        checkpointed = False
        rows.append(("restore s", round(time.monotonic() - started, 2)))
        lock.unlock(pid)
        locked = False
        worker.stdin.write("check\n")
        worker.stdin.flush()
        rows.append(("data after restore", worker.stdout.readline().strip()))
    finally:
        with contextlib.suppress(Exception):
            if checkpointed or lock.state(worker.pid) is ProcessState.CHECKPOINTED:
                lock.restore(worker.pid)
            if locked or lock.state(worker.pid) is ProcessState.LOCKED:
                lock.unlock(worker.pid)
        worker.kill()
        worker.wait()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print(json.dumps({"machine": os.uname().nodename, "kernel": os.uname().release}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
