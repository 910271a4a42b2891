"""GPU tenant for ``bench/gpu/swap.py``: a patterned ballast plus matmuls, checked after stalls.

The ballast is ``--gib`` GiB of device memory in rows of 64 MiB; byte ``c`` of row
``r`` holds ``(c * 131 + 7 + r * 37 + seed * 101 + 11) mod 256``, so every byte is
known, rows differ, and two tenants (different ``--seed``) hold different data: a
restore that brought back the wrong rows, the wrong tenant's memory or nothing at
all is seen. The matmul operands are checked too (exact integer sums of their bits).

Its log (``--out``, line-buffered; every time is CLOCK_MONOTONIC):

* ``alloc T0 T1 BYTES OOM_RETRIES``: the ballast was allocated and written.
* ``p T ITERATIONS``: progress, every ``--every-ms``, at the first iteration, and
  around every stall (the last iteration before it and the first after it).
* ``verify T0 T1 BAD_BYTES CHECKED_BYTES OPERANDS_OK``: one check of the whole
  ballast and the operands, after allocation and after every iteration slower
  than ``--gap-ms`` (a stall: the tenant was locked, frozen or swapped out).
* ``oom T``: the allocation ran out of memory and is retried; ``error T TEXT``.

Protocol with the bench (``--go-fd`` is the read end of a pipe):

1. Started: imports torch (no CUDA yet), prints ``imported``, blocks on the pipe.
2. The bench moves it into its cgroup, writes ``i``: it initialises CUDA and the
   small matmul operands, prints ``ready BYTES DEVICE``, blocks again.
3. The bench writes ``a`` when the card has room: it allocates and writes the
   ballast (retrying on out-of-memory until ``--alloc-timeout``), prints
   ``allocated BYTES``, and runs matmuls (one sync each) for ``--seconds``.

The bench passes what changes from run to run (``--out``, ``--seconds``,
``--go-fd``, ``--parent``) as ``KIWI_BENCH_OUT``, ``KIWI_BENCH_SECONDS``,
``KIWI_BENCH_GO_FD`` and ``KIWI_BENCH_PARENT``, so that a tenant's command line is the
same in every run: kiwid remembers a bare process's footprint by its executable and
arguments. End of file on the pipe before ``a`` makes it exit; it asks the kernel to SIGKILL
it when the bench dies. ``--dry-run`` uses host memory (``--dry-mib``) and 5 ms of
busy CPU per iteration instead of the GPU, and never imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from worker import _die_with_parent, _say, _wait_for

ROW = 64 * 2**20  # bytes per ballast row on the GPU
DRY_ROW = 2**20  # bytes per row in a dry run (host memory)
BLOCK_ROWS = 4  # rows checked at once: a 256 MiB scratch buffer on the GPU
MAX_VERIFY_TRIES = 3


def row_value(row: int, seed: int) -> int:
    return (row * 37 + seed * 101 + 11) % 256


class Log:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.last_count = -1

    def line(self, text: str) -> None:
        self.out.write(text + "\n")

    def progress(self, when: float, count: int) -> None:
        self.line(f"p {when:.6f} {count}")
        self.last_count = count


class HostTenant:
    """Dry run: the same life cycle on host memory and CPU time."""

    def __init__(self, mib: float, seed: int) -> None:
        self.seed = seed
        self.rows = max(1, int(mib * 2**20) // DRY_ROW)
        self.col = bytes((c * 131 + 7) % 256 for c in range(256)) * (DRY_ROW // 256)
        self.ballast: list[bytearray] = []

    def _row(self, r: int) -> bytes:
        shift = row_value(r, self.seed)
        return self.col.translate(bytes((i + shift) % 256 for i in range(256)))

    def allocate(self) -> int:
        self.ballast = [bytearray(self._row(r)) for r in range(self.rows)]
        return self.rows * DRY_ROW

    def verify(self) -> tuple[int, int, bool]:
        bad = 0
        for r, data in enumerate(self.ballast):
            if data != self._row(r):
                want = self._row(r)
                bad += sum(1 for x, y in zip(data, want, strict=True) if x != y)
        return bad, self.rows * DRY_ROW, True

    def step(self) -> None:
        end = time.monotonic() + 0.005
        while time.monotonic() < end:  # busy: the simulated GPU counts CPU time as activity
            pass


class GpuTenant:
    """The real thing: torch on CUDA device 0."""

    def __init__(self, torch: Any, gib: float, seed: int, n: int, device: str = "cuda") -> None:
        self.torch = torch
        self.dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
        self.cuda = device == "cuda"
        self.rows = max(1, round(gib * 2**30 / ROW))
        self.seed = seed
        gen = torch.Generator(device=self.dev)
        gen.manual_seed(1000 + seed)
        bf16 = torch.bfloat16
        self.a = torch.randn(n, n, device=self.dev, dtype=bf16, generator=gen)
        self.b = torch.randn(n, n, device=self.dev, dtype=bf16, generator=gen)
        self.c = torch.empty(n, n, device=self.dev, dtype=bf16)
        for _ in range(3):
            torch.matmul(self.a, self.b, out=self.c)
        self.sync()
        self.sums = self._operand_sums()
        self.ballast: Any = None
        self.col: Any = None
        self.rowvals: Any = None
        self.scratch: Any = None

    def _operand_sums(self) -> tuple[int, int]:
        i64 = self.torch.int64
        return (
            int(self.a.view(self.torch.int16).sum(dtype=i64)),
            int(self.b.view(self.torch.int16).sum(dtype=i64)),
        )

    def allocate(self) -> int:
        torch = self.torch
        u8 = torch.uint8
        self.ballast = torch.empty((self.rows, ROW), dtype=u8, device=self.dev)
        self.scratch = torch.empty((BLOCK_ROWS, ROW), dtype=u8, device=self.dev)
        cols = torch.arange(ROW, device=self.dev, dtype=torch.int32)
        self.col = ((cols * 131 + 7) % 256).to(u8)
        del cols
        rows = torch.arange(self.rows, device=self.dev, dtype=torch.int64)
        self.rowvals = ((rows * 37 + self.seed * 101 + 11) % 256).to(u8)
        for r0 in range(0, self.rows, BLOCK_ROWS):
            r1 = min(self.rows, r0 + BLOCK_ROWS)
            torch.add(self.col, self.rowvals[r0:r1, None], out=self.ballast[r0:r1])
        self.sync()
        if self.cuda:
            torch.cuda.empty_cache()  # the pattern's temporaries: not part of the footprint
        return int(self.ballast.numel())

    def verify(self) -> tuple[int, int, bool]:
        torch = self.torch
        bad = torch.zeros((), dtype=torch.int64, device=self.dev)
        for r0 in range(0, self.rows, BLOCK_ROWS):
            r1 = min(self.rows, r0 + BLOCK_ROWS)
            diff = self.scratch[: r1 - r0]
            torch.sub(self.ballast[r0:r1], self.col, out=diff)
            bad += diff.ne(self.rowvals[r0:r1, None]).sum()
        operands_ok = self._operand_sums() == self.sums
        return int(bad), int(self.ballast.numel()), operands_ok

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def step(self) -> None:
        self.torch.matmul(self.a, self.b, out=self.c)
        self.sync()


def allocate(tenant: HostTenant | GpuTenant, log: Log, timeout_s: float, oom: type) -> int:
    """Allocate and write the ballast, retrying on out-of-memory; return its bytes."""
    t0 = time.monotonic()
    retries = 0
    while True:
        try:
            size = tenant.allocate()
        except oom:
            retries += 1
            tenant.ballast = None
            if isinstance(tenant, GpuTenant):
                tenant.scratch = None
            if isinstance(tenant, GpuTenant) and tenant.cuda:
                tenant.torch.cuda.empty_cache()
            now = time.monotonic()
            log.line(f"oom {now:.6f}")
            if now - t0 > timeout_s:
                raise
            time.sleep(1.0)
            continue
        log.line(f"alloc {t0:.6f} {time.monotonic():.6f} {size} {retries}")
        return size


def verify(tenant: HostTenant | GpuTenant, log: Log, gap_s: float, oom: type) -> None:
    """Check the ballast; again if a stall hit the check itself (it may have hidden a swap)."""
    for _ in range(MAX_VERIFY_TRIES):
        t0 = time.monotonic()
        try:
            bad, checked, operands_ok = tenant.verify()
        except oom:
            log.line(f"error {time.monotonic():.6f} out of memory during the check")
            return
        t1 = time.monotonic()
        log.line(f"verify {t0:.6f} {t1:.6f} {bad} {checked} {int(operands_ok)}")
        if t1 - t0 <= gap_s:
            return


def run_loop(
    step: Callable[[], None],
    check: Callable[[], None],
    seconds: float,
    log: Log,
    every_s: float,
    gap_s: float,
) -> int:
    count = 0
    t_prev = time.monotonic()
    t_end = t_prev + seconds
    log.progress(t_prev, 0)
    next_report = t_prev + every_s
    while t_prev < t_end:
        step()
        count += 1
        now = time.monotonic()
        if now - t_prev > gap_s:  # stalled: pin both edges, then check the memory
            if log.last_count != count - 1:
                log.progress(t_prev, count - 1)
            log.progress(now, count)
            check()
            now = time.monotonic()
            log.progress(now, count)
            next_report = now + every_s
        elif now >= next_report or count == 1:  # the first iteration is pinned too
            log.progress(now, count)
            next_report = now + every_s
        t_prev = now
    if log.last_count != count:
        log.progress(t_prev, count)
    return count


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """What changes from run to run comes by environment, so that argv stays the same.

    kiwid remembers a bare process's footprint by its executable and arguments; a
    second run of the same tenant must look the same to it (no paths, times, fds).
    """
    env = os.environ
    parser.add_argument(
        "--out", default=env.get("KIWI_BENCH_OUT"), help="log file ($KIWI_BENCH_OUT)"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=env.get("KIWI_BENCH_SECONDS"),
        help="run time after 'a' ($KIWI_BENCH_SECONDS)",
    )
    parser.add_argument(
        "--go-fd",
        type=int,
        default=env.get("KIWI_BENCH_GO_FD"),
        help="read end of the go pipe ($KIWI_BENCH_GO_FD)",
    )
    parser.add_argument(
        "--parent",
        type=int,
        default=env.get("KIWI_BENCH_PARENT", 0),
        help="PID of the bench ($KIWI_BENCH_PARENT)",
    )
    # What every rotated tenant takes, the swap pattern and the trainer alike.
    parser.add_argument("--gap-ms", type=float, default=1000.0, help="an iteration this slow")
    parser.add_argument("--gib", type=float, default=47.5, help="GPU ballast, GiB")
    parser.add_argument("--every-ms", type=float, default=500.0, help="progress line period")
    parser.add_argument("--alloc-timeout", type=float, default=120.0, help="OOM retries, s")
    parser.add_argument("--dry-mib", type=float, default=8.0, help="dry run: host ballast MiB")


def parse_bench_args(parser: argparse.ArgumentParser, *, need_go: bool = True) -> Any:
    args = parser.parse_args()
    missing = [k for k in ("out", "seconds", "go_fd") if getattr(args, k) is None]
    if not need_go:
        missing = [k for k in missing if k == "out"]
    if missing:
        parser.error("missing " + ", ".join(f"--{k.replace('_', '-')}" for k in missing))
    return args


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_bench_args(parser)
    parser.add_argument("--seed", type=int, default=0, help="pattern seed (one per tenant)")
    parser.add_argument("--n", type=int, default=8192, help="matrix size (n x n, bf16)")
    parser.add_argument("--dry-run", action="store_true", help="host memory and CPU, no torch")
    parser.add_argument(
        "--device", default="cuda", help="torch device (cpu: tries this code on a CPU torch)"
    )
    args = parse_bench_args(parser)
    if args.parent:
        _die_with_parent(args.parent)

    torch: Any = None
    if not args.dry_run:
        import torch  # noqa: PLC0415 - after the PDEATHSIG, and never in a dry run

    _say("imported")
    _wait_for(args.go_fd, b"i")
    tenant: HostTenant | GpuTenant
    if torch is None:
        tenant = HostTenant(args.dry_mib, args.seed)
        oom: type = MemoryError
        _say("ready 0 host-memory")
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            print("swap_worker: torch sees no CUDA device", file=sys.stderr, flush=True)
            return 4
        tenant = GpuTenant(torch, args.gib, args.seed, args.n, args.device)
        oom = torch.cuda.OutOfMemoryError
        if tenant.cuda:
            name = torch.cuda.get_device_name(0).replace(" ", "_")
            reserved = torch.cuda.memory_reserved(0)
        else:
            name, reserved = args.device, 0
        _say(f"ready {reserved} {name} torch-{torch.__version__}")
    _wait_for(args.go_fd, b"a")
    gap_s = args.gap_ms / 1e3
    with open(args.out, "w", buffering=1) as out:
        log = Log(out)
        try:
            size = allocate(tenant, log, args.alloc_timeout, oom)
        except oom:
            log.line(f"error {time.monotonic():.6f} out of memory for {args.alloc_timeout:g} s")
            _say("error out of memory")
            return 5
        _say(f"allocated {size}")
        verify(tenant, log, gap_s, oom)
        count = run_loop(
            tenant.step,
            lambda: verify(tenant, log, gap_s, oom),
            args.seconds,
            log,
            args.every_ms / 1e3,
            gap_s,
        )
    _say(f"done {count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
