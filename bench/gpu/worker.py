"""GPU tenant for ``bench/gpu/enforcement.py``: bf16 matmuls, one sync per iteration.

Writes ``<monotonic_time> <iterations_done>`` lines to ``--out`` every ~0.1 s, and
also around every iteration slower than ``--gap-ms``: the line of the last
iteration that completed before the stall and the line of the first one after it.
So a gate (freeze or CUDA lock) shows in the file as two consecutive lines whose
iteration counts differ by exactly one and whose times differ by more than the gap.
Both times are CLOCK_MONOTONIC, the same clock as every other process here.

Protocol with the bench (``--go-fd`` is the read end of a pipe):

1. Started: imports torch (no CUDA yet), prints ``imported``, blocks on the pipe.
2. The bench moves it into its cgroup, then writes ``i``: it initialises CUDA,
   allocates, warms up, prints ``ready <bytes allocated>``, blocks again.
3. The bench writes ``g``: it runs for ``--seconds``, prints ``done <iterations>``.

End of file on the pipe (the bench died or gave up) makes it exit at once, and it
asks the kernel to SIGKILL it when the bench dies. ``--dry-run`` replaces the GPU
work with 2 ms sleeps and never imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TextIO

PR_SET_PDEATHSIG = 1
MAX_MEM_GIB = 10.0


def _die_with_parent(parent: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the bench died before prctl took effect
        sys.exit(1)


def _wait_for(fd: int, want: bytes) -> None:
    got = os.read(fd, 1)
    if got != want:
        sys.exit(0 if not got else 3)  # EOF: the bench is gone or gave up


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class Progress:
    """The ``<time> <iterations>`` file."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.last_count = -1

    def write(self, when: float, count: int) -> None:
        self.out.write(f"{when:.6f} {count}\n")  # line-buffered: one write per line
        self.last_count = count


def run_loop(
    step: Callable[[], None], seconds: float, progress: Progress, every_s: float, gap_s: float
) -> int:
    """Run ``step`` (one synchronised iteration) for ``seconds``; return iterations."""
    count = 0
    t_prev = time.monotonic()
    t_end = t_prev + seconds
    progress.write(t_prev, 0)
    next_report = t_prev + every_s
    while True:
        step()
        count += 1
        now = time.monotonic()
        if now - t_prev > gap_s:  # stalled (gated): pin down both edges of the stall
            if progress.last_count != count - 1:
                progress.write(t_prev, count - 1)
            progress.write(now, count)
            next_report = now + every_s
        elif now >= next_report:
            progress.write(now, count)
            next_report = now + every_s
        t_prev = now
        if now >= t_end:
            break
    if progress.last_count != count:
        progress.write(t_prev, count)
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True, help="progress file to write")
    parser.add_argument("--seconds", type=float, required=True, help="run time after 'g'")
    parser.add_argument("--go-fd", type=int, required=True, help="read end of the go pipe")
    parser.add_argument("--parent", type=int, default=0, help="PID of the bench")
    parser.add_argument("--n", type=int, default=8192, help="matrix size (n x n, bf16)")
    parser.add_argument("--mem-gib", type=float, default=0.0, help="extra GPU ballast, GiB")
    parser.add_argument("--every-ms", type=float, default=100.0, help="progress line period")
    parser.add_argument(
        "--gap-ms", type=float, default=50.0, help="an iteration this slow is a stall"
    )
    parser.add_argument("--dry-run", action="store_true", help="sleep instead of GPU work")
    args = parser.parse_args()
    if args.parent:
        _die_with_parent(args.parent)
    if args.mem_gib > MAX_MEM_GIB:
        parser.error(f"--mem-gib at most {MAX_MEM_GIB:g}")

    torch = None
    if not args.dry_run:
        import torch  # noqa: PLC0415 - after the PDEATHSIG, and never in a dry run

    _say("imported")
    _wait_for(args.go_fd, b"i")

    if torch is None:
        allocated = 0

        def step() -> None:
            time.sleep(0.002)

    else:
        if not torch.cuda.is_available():
            print("worker: torch sees no CUDA device", file=sys.stderr, flush=True)
            return 4
        dev = torch.device("cuda", 0)
        a = torch.randn(args.n, args.n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(args.n, args.n, device=dev, dtype=torch.bfloat16)
        c = torch.empty(args.n, args.n, device=dev, dtype=torch.bfloat16)
        ballast = None
        if args.mem_gib > 0:
            ballast = torch.empty(int(args.mem_gib * 2**30), dtype=torch.uint8, device=dev)
            ballast.fill_(1)
        for _ in range(5):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated(dev)  # the ballast stays referenced till exit

        def step() -> None:
            torch.matmul(a, b, out=c)
            torch.cuda.synchronize()

    _say(f"ready {allocated}")
    _wait_for(args.go_fd, b"g")
    with open(args.out, "w", buffering=1) as out:
        count = run_loop(step, args.seconds, Progress(out), args.every_ms / 1e3, args.gap_ms / 1e3)
    _say(f"done {count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
