"""Concurrent checkpoints and restores on one GPU: 1 vs 2 vs 3 at once, and one of each way.

Run as root on the GPU machine with the system ``python3`` (torch and nvidia-ml-py)::

    python3 bench/gpu/checkpoint_lanes.py                  # 3 x 16 GiB, ~1.5 min on an H200
    python3 bench/gpu/checkpoint_lanes.py --gib 4 --max-seconds 60   # frontier.py's short one
    python3 bench/gpu/checkpoint_lanes.py --dry-run        # no CUDA: the table on made-up timings

Three CUDA processes each hold ``--gib`` GiB of patterned memory (``swap_worker``'s
ballast). Through kiwid's own adapter (``kiwid/adapters/cudalock.py``: lock,
checkpoint, restore, unlock) this process locks them, then times 1, 2 and 3
checkpoints started together (threads behind a barrier) and as many restores, then
one checkpoint during one restore (is the link used both ways at once?). It prints
the aggregate GB/s of each case, checks every holder's memory afterwards, and saves
``lanes-table.txt`` and ``results.json`` (to ``$OUT/kiwi-lanes`` when ``$OUT`` is set).

On every path (end, error, Ctrl-C, SIGTERM): whatever is checkpointed is restored,
whatever is locked is unlocked, and the holders are killed (they also die with this
process). ``--gib`` shrinks to what the card's free memory and the host's available
RAM hold for three, and a case that would end after ``--max-seconds`` is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import enforcement as enf  # puts the repo on sys.path (kiwid's adapter)
from enforcement import WORK, BenchError, log
from lanes_analysis import GIB, Case, Op, findings, solo_rate, synthetic, table
from swap_host import host_available, machine_line

HOLDERS = 3
EST_GBPS = {"checkpoint": 2.3, "restore": 6.3}  # the H200's single-call rates (2026-11-30)
CONTEXT_GIB = 1.0  # a holder's CUDA context, operands and check buffer beyond its ballast


def hold(args: argparse.Namespace) -> int:
    """Child: hold ``--gib`` GiB of patterned device memory; ``v`` checks it; EOF ends it."""
    from swap_worker import GpuTenant  # noqa: PLC0415
    from worker import _die_with_parent  # noqa: PLC0415

    if args.parent:
        _die_with_parent(args.parent)
    import torch  # noqa: PLC0415

    tenant = GpuTenant(torch, args.gib, args.seed, 256)
    size = tenant.allocate()
    print(f"ready {size}", flush=True)
    for line in sys.stdin:
        if line.strip() == "v":
            bad, checked, ok = tenant.verify()
            print(f"verify {bad} {checked} {int(ok)}", flush=True)
    return 0


class Holder:
    def __init__(self, index: int, gib: float, outdir: Path) -> None:
        self.index = index
        self.errfile = outdir / f"holder-{index}.err"
        argv = [sys.executable, str(Path(__file__).resolve()), "--hold", "--gib", f"{gib:g}"]
        argv += ["--seed", str(index), "--parent", str(os.getpid())]
        with open(self.errfile, "wb") as err:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        self.pid = self.proc.pid
        self.nbytes = 0

    def expect(self, word: str, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    break
                if line.startswith(word):
                    return line.strip()
        tail = self.errfile.read_text(errors="replace")[-600:] if self.errfile.exists() else ""
        raise BenchError(f"holder {self.pid}: no '{word}' within {timeout_s:g} s: {tail}")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, OSError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(20)


class Probe:
    """The driver calls, with every holder's state kept so that clean-up can undo them."""

    def __init__(self, lock: Any, holders: Sequence[Holder]) -> None:
        self.lock = lock
        self.holders = {h.pid: h for h in holders}
        self.state = dict.fromkeys(self.holders, "running")
        self.rates = dict(EST_GBPS)

    def lock_all(self) -> None:
        for pid in self.holders:
            self.lock.lock(pid, 20_000)
            self.state[pid] = "locked"

    def run(self, name: str, calls: Sequence[tuple[str, int]]) -> Case:
        case = Case(name)
        barrier = threading.Barrier(len(calls))
        done: list[Op] = []

        def one(kind: str, pid: int) -> None:
            barrier.wait()
            t0 = time.monotonic()
            error = None
            try:
                (self.lock.checkpoint if kind == "checkpoint" else self.lock.restore)(pid)
            except Exception as exc:
                error = str(exc)
            done.append(Op(kind, pid, self.holders[pid].nbytes, t0, time.monotonic(), error))

        threads = [threading.Thread(target=one, args=c, daemon=True) for c in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for op in done:
            if op.error is None:
                self.state[op.pid] = "checkpointed" if op.kind == "checkpoint" else "locked"
            else:
                self.state[op.pid] = self._driver_state(op.pid)
        case.ops = sorted(done, key=lambda o: (o.kind, o.pid))
        if case.ok and len(calls) == 1:
            self.rates[calls[0][0]] = case.gbps or self.rates[calls[0][0]]
        log(f"  {name}: " + ", ".join(f"{o.kind} {o.pid} {o.t1 - o.t0:.2f} s" for o in case.ops))
        return case

    def _driver_state(self, pid: int) -> str:
        try:
            return self.lock.state(pid).name.lower()
        except Exception:
            return "unknown"

    def predict_s(self, calls: Sequence[tuple[str, int]]) -> float:
        """One after the other at the single-call rates: an upper bound, give or take."""
        return sum(self.holders[p].nbytes / (self.rates[k] * 1e9) for k, p in calls)

    def undo(self) -> None:
        """Restore what is checkpointed, unlock what is locked; errors are logged."""
        for pid in list(self.state):
            try:
                if self.state[pid] in ("checkpointed", "unknown"):
                    self.lock.restore(pid)
                    self.state[pid] = "locked"
                if self.state[pid] == "locked":
                    self.lock.unlock(pid)
                    self.state[pid] = "running"
            except Exception as exc:
                log(f"warning: could not give {pid} back ({self.state[pid]}): {exc}")


def plan(pids: Sequence[int]) -> list[list[tuple[str, list[tuple[str, int]]]]]:
    """Units of cases that leave every holder as they found it (locked, on the card)."""
    p0, p1, _ = pids
    units = []
    for n in (1, 2, 3):
        units.append(
            [
                (f"checkpoint x{n}", [("checkpoint", p) for p in pids[:n]]),
                (f"restore x{n}", [("restore", p) for p in pids[:n]]),
            ]
        )
    units.append(
        [
            ("checkpoint x1 again", [("checkpoint", p0)]),
            ("checkpoint + restore", [("restore", p0), ("checkpoint", p1)]),
            ("restore x1 again", [("restore", p1)]),
        ]
    )
    return units


def fit_gib(want: float, gpu_free: int | None, host_avail: int | None) -> tuple[float, str]:
    """The largest ballast <= want such that three fit on the card and in host RAM."""
    limits = [want]
    if gpu_free is not None:
        limits.append(gpu_free / GIB / HOLDERS - CONTEXT_GIB - 1.0)
    if host_avail is not None:
        limits.append((host_avail / GIB - 8.0) / HOLDERS - CONTEXT_GIB)
    gib = max(0.0, min(limits))
    why = "" if gib >= want else f" (asked {want:g}; what the card and host RAM hold for three)"
    return round(gib, 1), why


def measure(args: argparse.Namespace, outdir: Path, machine: list[str]) -> list[Case]:
    import pynvml  # noqa: PLC0415 - only on the GPU machine

    from kiwid.adapters.cudalock import CudaLock  # noqa: PLC0415 - needs the repo path

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    name = pynvml.nvmlDeviceGetName(handle)
    driver = pynvml.nvmlSystemGetDriverVersion()
    machine.append(
        f"GPU 0: {name.decode() if isinstance(name, bytes) else name}, "
        f"{info.total / GIB:.1f} GiB ({info.free / GIB:.1f} free), driver "
        f"{driver.decode() if isinstance(driver, bytes) else driver}; host RAM "
        f"{(host_available() or 0) / GIB:.0f} GiB available"
    )
    gib, why = fit_gib(args.gib, int(info.free), host_available())
    if gib < 1.0:
        raise BenchError(f"no room for three holders: {gib:g} GiB each{why}")
    log(f"3 holders x {gib:g} GiB{why}")
    lock = CudaLock()
    if not lock.can_swap:
        raise BenchError("this driver has the CUDA lock but no checkpoint/restore")
    deadline = enf.T0 + args.max_seconds
    holders: list[Holder] = []
    probe: Probe | None = None
    cases: list[Case] = []
    try:
        holders = [Holder(i, gib, outdir) for i in range(HOLDERS)]
        for h in holders:
            h.expect("ready", 180)
        used = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        for h in holders:
            h.nbytes = int(used.get(h.pid) or (gib + CONTEXT_GIB) * GIB)
        log("holders: " + ", ".join(f"{h.pid} {h.nbytes / GIB:.1f} GiB" for h in holders))
        probe = Probe(lock, holders)
        probe.lock_all()
        for unit in plan([h.pid for h in holders]):
            need = sum(probe.predict_s(calls) for _, calls in unit) + 5.0
            if time.monotonic() + need > deadline:
                cases += [Case(n, skipped=f"~{need:.0f} s left no room") for n, _ in unit]
                continue
            want = {"checkpoint": "locked", "restore": "checkpointed"}
            for name, planned in unit:
                calls = [(k, p) for k, p in planned if probe.state[p] == want[k]]
                if calls:
                    cases.append(probe.run(name, calls))
        probe.undo()
        machine.append(_verify(holders))
    finally:
        if probe is not None:
            probe.undo()
        for h in holders:
            h.kill()
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return cases


def _verify(holders: Sequence[Holder]) -> str:
    bad = []
    for h in holders:
        assert h.proc.stdin is not None
        h.proc.stdin.write("v\n")
        h.proc.stdin.flush()
    for h in holders:
        _, nbad, _, ok = h.expect("verify", 60).split()
        if nbad != "0" or ok != "1":
            bad.append(f"{h.pid}: {nbad} bad bytes, operands {'ok' if ok == '1' else 'changed'}")
    return "data after the cases: " + ("intact in all 3 holders" if not bad else "; ".join(bad))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gib", type=float, default=16.0, help="ballast per holder, GiB")
    parser.add_argument("--max-seconds", type=float, default=150.0, help="whole run, s")
    parser.add_argument("--out", type=Path, help="output folder (default $OUT/kiwi-lanes)")
    parser.add_argument("--dry-run", action="store_true", help="made-up timings, no CUDA")
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--parent", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hold:
        return hold(args)

    def _sigterm(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _sigterm)
    outdir = args.out or (
        Path(os.environ["OUT"]) / "kiwi-lanes" if os.environ.get("OUT") else WORK / "out-lanes"
    )
    outdir.mkdir(parents=True, exist_ok=True)
    machine = [machine_line()]
    if args.dry_run:
        from kiwid.adapters.cudalock import probe  # noqa: PLC0415 - needs the repo path

        cases = synthetic()
        machine.append(f"GPU: none (DRY RUN: made-up timings); CUDA lock here: {probe().reason}")
    else:
        if os.geteuid() != 0:
            log("WARNING: not root: the driver may refuse to lock other processes")
        try:
            cases = measure(args, outdir, machine)
        except BenchError as exc:
            log(f"ERROR: {exc}")
            return 1
        except KeyboardInterrupt:
            log("interrupted; cleaned up")
            return 130
    text = table(cases, machine)
    print(text, flush=True)
    (outdir / "lanes-table.txt").write_text(text + "\n")
    dump = {
        "machine": machine,
        "cases": [{**asdict(c), "gbps": c.gbps, "wall_s": c.wall_s} for c in cases],
        "solo_gbps": {k: solo_rate(cases, k) for k in ("checkpoint", "restore")},
        "findings": findings(cases),
        "dry_run": args.dry_run,
    }
    (outdir / "results.json").write_text(json.dumps(dump, indent=1))
    log(f"results: {outdir}")
    ok = all(c.ok or c.skipped for c in cases) and not any("bad bytes" in m for m in machine)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
