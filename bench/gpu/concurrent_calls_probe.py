"""Which driver calls wait for a checkpoint or a restore in flight, of the same process or another?

Run as root on a GPU machine with the system ``python3`` (torch)::

    python3 bench/gpu/concurrent_calls_probe.py --gib 16 2>&1 | tee "${OUT:-/tmp}/calls.log"
    python3 bench/gpu/concurrent_calls_probe.py --dry-run     # no GPU: the plan only

Why: kiwid's follow asks the driver the state of a gated tenant's processes, and
locks those that run, beside the tenant's lane, where a checkpoint of the same
tenant may be in flight. On an H200 (driver 580.159.04) a follow's call waited for
such a checkpoint past its deadline, and the fence that followed froze the process
mid-checkpoint. This probe times each call kiwid makes beside a move, with kiwid's
own adapter: A (``--gib`` of device memory) is locked and checkpointed (then
restored) on a thread; meanwhile the state of A, and the state, lock and unlock of
B (another process, 1 GiB), each on a thread of its own, so that one call that
waits holds up no other. Prints one row per call: when it started and ended
against the move's own start and end. Always restores and unlocks what it moved.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WORKER = r"""
import sys, torch
n = int(sys.argv[1]) // 4
x = torch.arange(n, dtype=torch.int32, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
for line in sys.stdin:  # "check": the data survived?
    ok = bool((x == torch.arange(n, dtype=torch.int32, device="cuda")).all())
    print("ok" if ok else "bad", flush=True)
"""


def spawn(nbytes: int) -> subprocess.Popen[str]:
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert worker.stdout is not None
    if worker.stdout.readline().strip() != "ready":
        raise RuntimeError("a worker did not start")
    return worker


class Timed(threading.Thread):
    """One call on a thread of its own: when it started and ended, what it said."""

    def __init__(self, name: str, call: Callable[[], object], t0: float) -> None:
        super().__init__(daemon=True)
        self.label, self.call, self.t0 = name, call, t0
        self.start_s = self.end_s = float("nan")
        self.said: object = None

    def run(self) -> None:
        self.start_s = time.monotonic() - self.t0
        try:
            self.said = self.call()
        except Exception as err:  # the driver's answer is the finding
            self.said = f"{type(err).__name__}: {err}"
        self.end_s = time.monotonic() - self.t0


def during(move: Timed, calls: list[tuple[str, Callable[[], object]]], t0: float) -> list[Timed]:
    """Start ``move``, then each call 1 s into it; wait for all (60 s at most)."""
    move.start()
    time.sleep(1.0)
    threads = [Timed(name, call, t0) for name, call in calls]
    for t in threads:
        t.start()
    for t in [move, *threads]:
        t.join(60)
    return threads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=16.0, help="A's device memory")
    parser.add_argument("--dry-run", action="store_true", help="print the plan only")
    args = parser.parse_args()
    if args.dry_run:
        print(f"plan: A ({args.gib:g} GiB) and B (1 GiB), CUDA workers; lock A;")
        print("      checkpoint A on a thread, and 1 s in: state(A), state(B), lock(B), unlock(B);")
        print("      restore A on a thread, and 1 s in: state(A), state(B); unlock A, check data")
        return 0
    from kiwid.adapters.cudalock import CudaLock, ProcessState  # noqa: PLC0415

    lock = CudaLock()

    def lock_unlock(pid: int) -> str:
        started = time.monotonic()
        lock.lock(pid, 10_000)
        locked = time.monotonic() - started
        lock.unlock(pid)
        return f"locked after {locked:.2f} s, unlocked after {time.monotonic() - started:.2f} s"

    a = spawn(int(args.gib * 2**30))
    b = spawn(2**30)
    rows: list[tuple[str, str, float, float, object]] = []
    try:
        lock.lock(a.pid, 10_000)
        moves: tuple[tuple[str, Callable[[int], None]], ...] = (
            ("checkpoint", lock.checkpoint),
            ("restore", lock.restore),
        )
        for phase, op in moves:
            t0 = time.monotonic()
            move = Timed(f"{phase} A", functools.partial(op, a.pid), t0)
            calls: list[tuple[str, Callable[[], object]]] = [
                ("state A", lambda: lock.state(a.pid).name),
                ("state B", lambda: lock.state(b.pid).name),
            ]
            if phase == "checkpoint":
                calls.append(("lock B, then unlock B", lambda: lock_unlock(b.pid)))
            threads = during(move, calls, t0)
            rows.append((phase, move.label, move.start_s, move.end_s, move.said))
            rows += [(phase, t.label, t.start_s, t.end_s, t.said) for t in threads]
        lock.unlock(a.pid)
        assert a.stdin is not None
        assert a.stdout is not None
        a.stdin.write("check\n")
        a.stdin.flush()
        data = a.stdout.readline().strip()
    finally:
        with contextlib.suppress(Exception):
            if lock.state(a.pid) is ProcessState.CHECKPOINTED:
                lock.restore(a.pid)
            if lock.state(a.pid) is ProcessState.LOCKED:
                lock.unlock(a.pid)
        with contextlib.suppress(Exception):
            if lock.state(b.pid) is ProcessState.LOCKED:
                lock.unlock(b.pid)
        for w in (a, b):
            w.kill()
            w.wait()
    print(f"{'during':<11} {'call':<22} {'start s':>8} {'end s':>8}  answer")
    for phase, name, s, e, said in rows:
        print(f"{phase:<11} {name:<22} {s:>8.2f} {e:>8.2f}  {said}")
    print(f"A's data after restore: {data}")
    print(json.dumps({"machine": os.uname().nodename, "kernel": os.uname().release}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
