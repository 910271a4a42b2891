"""bench/gpu/swap.py's run: tenants, kiwid, the release of the tenants one by one, clean-up.

Every wait is bounded and :meth:`Run.close` undoes everything on every path.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import enforcement as enf
from enforcement import (
    SOCK,
    BenchError,
    Kiwid,
    Layout,
    Worker,
    kiwid_recover,
    log,
    stale_cgroups,
)
from swap_analysis import Analysis, analyse
from swap_args import LEAD_S
from swap_host import GIB, HERE, GpuMemory, calm, holder_of, host_available, swap_of
from swap_logs import GAP_S, parse_kiwid, read_worker_log, who_is
from swap_reference import CUBLAS_WORKSPACE, run_references
from swap_state import identity, listing, read_ledger, record

SWAP_WORKER = HERE / "swap_worker.py"
TRAIN_WORKER = HERE / "train_worker.py"

# --------------------------------------------------------------------- the run


class Run:
    """Workers, kiwid and the rotation; every wait is bounded, ``close`` undoes everything."""

    def __init__(self, args: argparse.Namespace, layout: Layout, outdir: Path) -> None:
        self.args = args
        self.layout = layout
        self.outdir = outdir
        self.sim = args.rehearse or args.dry_run
        self.workers: list[Worker] = []
        self.kiwid: Kiwid | None = None
        self.kiwid_lines: list[tuple[float, str]] = []
        self.kiwid_log: Path | None = None
        self.memory = GpuMemory()
        self.t_rot0: float | None = None
        self.t_end: float | None = None
        self.released: dict[str, float] = {}
        self.allocated: dict[str, float] = {}
        self.forced: list[str] = []
        self.exited: dict[str, int] = {}
        self.samples: list[tuple[float, int, int, int | None]] = []  # t, used, free, host avail
        self.status_polls: list[dict[str, Any]] = []
        self.ready_lines: list[str] = []
        self.gate_line: str | None = None
        self.errors: list[str] = []
        self.seen_lines = 0
        self.state_dir: Path = args.state_dir
        self.gib_of: dict[str, float] = {}  # tenant -> its ballast, GiB
        self.identities: dict[str, str] = {}  # tenant -> exe and arguments (kiwid's key)
        self.known: dict[str, bool] = {}  # tenant -> an earlier run with this state_dir ran it
        self.reference_log: Path | None = None
        self.reference_log_2: Path | None = None
        self.state_before: list[str] = []  # the state_dir's files before kiwid started
        self.state_removed: list[str] = []

    @property
    def names(self) -> dict[str, str]:
        return {w.cgroup.name: w.label for w in self.workers}

    # set-up -------------------------------------------------------------
    def spawn(self) -> None:
        """The tenants: ``--tenants`` ballast ones, then the trainer (``--torch-tenant``).

        Their command lines are the same in every run (what changes goes by environment):
        kiwid knows a bare process's workload by its executable and arguments.
        """
        a = self.args
        seconds = a.budget + 300.0  # a safety cap: the bench kills them long before
        kinds = [(SWAP_WORKER, f"w{i}", a.gib, {}) for i in range(a.tenants)]
        if a.torch_tenant:
            cublas = {"CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE}
            kinds.append((TRAIN_WORKER, f"t{a.tenants}", a.torch_gib, cublas))
        for i, (script, label, gib, env) in enumerate(kinds):
            with contextlib.suppress(FileNotFoundError):  # an earlier run's
                (self.outdir / f"progress-{i}.txt").unlink()
            extra = ["--gib", f"{gib:g}", "--seed", str(i), "--alloc-timeout", "120"]
            w = Worker(
                i,
                self.layout,
                self.outdir,
                seconds,
                dry_run=self.sim,
                script=script,
                gap_s=GAP_S,
                extra_args=extra,
                stable_argv=True,
                env_extra=env,
                label=label,
            )
            self.workers.append(w)
            self.gib_of[label] = gib
        ledger = read_ledger(self.state_dir)
        for w in self.workers:
            ident = identity(w.pid)
            self.identities[w.label] = ident or "?"
            self.known[w.label] = ident is not None and ident in ledger
        if a.keep_state:
            known = [lb for lb, k in self.known.items() if k] or ["none"]
            log(f"  known workloads (an earlier run with {self.state_dir}): {', '.join(known)}")

    def reference(self, timeout_s: float) -> None:
        """The trainer's unswapped references (swap_reference.py), before kiwid starts."""
        trainer = next((w for w in self.workers if w.label.startswith("t")), None)
        if trainer is not None:
            self.reference_log, self.reference_log_2 = run_references(
                trainer.argv, self.outdir, timeout_s
            )

    def init_workers(self, timeout_s: float) -> None:
        """Each worker: into its cgroup (done by Worker), then CUDA set-up, before kiwid."""
        for w in self.workers:
            if not w.cgroup.holds(w.pid):
                raise BenchError(f"worker {w.pid} is not in {w.cgroup.name}")
            w.send(b"i")
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            line = w.expect("ready", max(1.0, deadline - time.monotonic()))
            self.ready_lines.append(f"{w.label}: {line}")
            log(f"  {w.label} (pid {w.pid}, cgroup {w.cgroup.name}): {line}")

    def start_kiwid(self, config: Path) -> None:
        self.kiwid_log = self.outdir / "kiwid.log"
        self.state_before = listing(self.state_dir)
        self.kiwid = Kiwid(config, self.kiwid_log)
        ready = self.kiwid.wait_ready(60)
        log(f"  kiwid: {ready}")
        gate = [line for _, line in self.kiwid.lines if "Gate:" in line]
        self.gate_line = gate[0] if gate else None
        log(f"  kiwid: {self.gate_line or 'no [INFO] Gate: line'}")
        if not self.sim and (self.gate_line is None or "CUDA" not in self.gate_line):
            log("  WARNING: kiwid does not gate with the CUDA lock; swapping needs it")
        if self.sim:  # as on the GPU, kiwid knows the idle tenants (their contexts) at once
            for w in self.workers:
                self._sim_attach(w, int(self.args.overhead_gib * GIB))

    def _sim_attach(self, w: Worker, nbytes: int) -> None:
        from kiwid.adapters.control import request  # noqa: PLC0415 - needs the repo path

        args = {"pid": w.pid, "gpu": 0, "memory_bytes": nbytes, "activity": "cpu"}
        request(SOCK, "sim-attach", args, timeout_s=5.0)
        self.memory.resident[w.label] = nbytes

    # the rotation -------------------------------------------------------
    def rotate(self) -> None:
        a = self.args
        assert self.kiwid is not None
        self.t_rot0 = t0 = time.monotonic()
        hard_end = enf.T0 + a.max_total - a.cleanup_reserve
        rot_end = min(t0 + a.budget, hard_end - a.settle)
        log(
            f"rotation: {a.budget:g} s budget (until +{rot_end - enf.T0:.0f} s), then up to "
            f"{a.settle:g} s for a swap in flight to end; a tenant's release needs its "
            f"footprint plus {a.margin_gib:.2g} GiB free"
        )
        pending = list(self.workers)
        last_release = t0
        free_ok_since: float | None = None
        next_sample = next_status = next_line = t0
        status: dict[str, Any] = {}
        settling = False
        settle_end = math.inf
        while True:
            now = time.monotonic()
            self._read_workers()
            self._read_kiwid()
            if self.kiwid.proc.poll() is not None:
                raise BenchError(
                    f"kiwid exited ({self.kiwid.proc.returncode}):\n{self.kiwid.tail()}"
                )
            alive = [w for w in self.workers if w.label not in self.exited]
            if not alive:
                raise BenchError("every worker exited")
            if now >= next_sample:
                next_sample = now + 0.5
                used, free = self.memory.used_free()
                self.samples.append((now, used, free, host_available()))
                need = self._need(pending[0]) if pending else 0
                free_ok_since = (free_ok_since or now) if free >= need else None
            if now >= next_status:
                next_status = now + 2.0
                status = self._status(now)
            if pending:
                w = pending[0]
                prev = self.workers[self.workers.index(w) - 1] if self.released else None
                prev_done = (
                    prev is None or prev.label in self.allocated or prev.label in self.exited
                )
                quiet = calm(status, min(LEAD_S, 0.3 * a.tq))
                room = free_ok_since is not None and now - free_ok_since >= 1.0
                forced = bool(self.released) and now - last_release > a.force_after and room
                if (prev_done and room and quiet) or not self.released or forced:
                    if forced and not (prev_done and quiet):
                        log(
                            f"  WARNING: releasing {w.label} after {a.force_after:g} s although "
                            f"kiwid is not calm ({quiet}) or {prev.label if prev else '-'} has "
                            f"not allocated ({prev_done})"
                        )
                        self.forced.append(w.label)
                    self._release(w)
                    pending.pop(0)
                    last_release = now
                    free_ok_since = None
            if now >= next_line:
                next_line = now + 15.0
                self._progress_line(status)
            if not settling and now >= rot_end:
                settling = True
                settle_end = min(now + a.settle, hard_end)
                log(f"rotation over (+{now - t0:.0f} s); waiting for a swap in flight to end")
            if settling:
                swap = swap_of(status)
                if swap is None or now >= settle_end:
                    if swap is not None:
                        log(f"  a swap is still in flight ({swap}); stopping anyway")
                    break
                next_status = min(next_status, now + 1.0)
            time.sleep(0.25)
        self.t_end = time.monotonic()

    def _need(self, w: Worker) -> int:
        """Free GPU memory before ``w`` may allocate: its footprint plus the margin."""
        a = self.args
        return int((self.gib_of[w.label] + a.overhead_gib + a.margin_gib) * GIB)

    def _release(self, w: Worker) -> None:
        if self.sim and w.label in self.memory.resident:  # its footprint grows as it allocates
            self._sim_attach(w, int((self.gib_of[w.label] + self.args.overhead_gib) * GIB))
        elif self.sim:  # swapped out while idle: attaching again would bring it back in the sim
            log(f"  (rehearsal: {w.label} is swapped out; its simulated footprint stays small)")
        try:
            w.send(b"a")
        except OSError as exc:
            log(f"  WARNING: cannot release {w.label}: {exc}")
        self.released[w.label] = time.monotonic()
        used, free = self.memory.used_free()
        log(
            f"  released {w.label} to allocate {self.gib_of[w.label]:g} GiB "
            f"(GPU: {used / GIB:.1f} GiB used, {free / GIB:.1f} GiB free)"
        )

    def _read_workers(self) -> None:
        for w in self.workers:
            for line in w.poll_lines():
                if line.startswith("allocated"):
                    self.allocated[w.label] = time.monotonic()
                    took = self.allocated[w.label] - self.released.get(w.label, math.nan)
                    size = line.split()[1] if len(line.split()) > 1 else "?"
                    log(f"  {w.label} allocated ({size} bytes) {took:.1f} s after release")
                elif line.startswith("error"):
                    log(f"  {w.label}: {line}")
            if w.label not in self.exited and w.proc.poll() is not None:
                self.exited[w.label] = w.proc.returncode
                log(f"  WARNING: {w.label} exited ({w.proc.returncode}){w.err_tail()}")

    def _read_kiwid(self) -> None:
        assert self.kiwid is not None
        lines = list(self.kiwid.lines)
        new, self.seen_lines = lines[self.seen_lines :], len(lines)
        self.kiwid_lines += new
        events = parse_kiwid(new, self.names)
        for e in events:
            if e.kind in ("swap-out", "swap-in"):
                if e.kind == "swap-out":
                    self.memory.resident.pop(e.who, None)
                elif self.sim:
                    self.memory.resident[e.who] = e.nbytes
            if e.kind != "queue":
                text = e.line.split("] ", 1)[-1]
                log(f"  kiwid: {text}")

    def _status(self, now: float) -> dict[str, Any]:
        assert self.kiwid is not None
        t = time.perf_counter()
        status = self.kiwid.status()
        rtt = (time.perf_counter() - t) * 1e3
        gpu = (status.get("gpus") or [{}])[0] if isinstance(status, dict) else {}
        self.status_polls.append(
            {
                "t": round(now - (self.t_rot0 or now), 2),
                "rtt_ms": round(rtt, 1),
                "error": status.get("error") if isinstance(status, dict) else "?",
                "holder": (gpu.get("holder") or {}).get("tenant"),
                "remaining_s": (gpu.get("holder") or {}).get("remaining_s"),
                "swap": gpu.get("swap"),
            }
        )
        return status

    def _progress_line(self, status: Mapping[str, Any]) -> None:
        now = time.monotonic()
        parts = []
        for w in self.workers:
            wl = read_worker_log(w.progress)
            if w.label in self.exited:
                parts.append(f"{w.label} exited")
            elif not wl.points:
                parts.append(f"{w.label} -")
            else:
                t, n = wl.points[-1]
                state = "running" if now - t < 2 * GAP_S else f"stalled {now - t:.0f} s"
                parts.append(f"{w.label} {n} it ({state})")
        used, _ = self.memory.used_free()
        avail = host_available()
        holder = holder_of(status)
        swap = swap_of(status)
        log(
            f"  +{now - (self.t_rot0 or now):5.0f} s  holder {who_is(holder or '-', self.names)}; "
            + ", ".join(parts)
            + f"; GPU {used / GIB:.1f} GiB used; host {(avail or 0) / GIB:.0f} GiB available"
            + (f"; swap {swap}" if swap else "")
        )

    # clean-up -----------------------------------------------------------
    def close(self) -> None:
        """SIGKILL the workers, stop kiwid, ``kiwid recover``, remove the cgroups."""
        t = time.monotonic()
        for w in self.workers:
            if w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
        deadline = time.monotonic() + 30.0
        for w in self.workers:
            try:
                w.kill(hard=True, wait_s=max(0.5, deadline - time.monotonic()))
            except Exception as exc:
                log(f"warning: killing {w.label} failed: {exc}")
            if w.proc.poll() is None:
                log(f"warning: {w.label} (pid {w.pid}) did not exit within 30 s of SIGKILL")
        for step in (self._stop_kiwid, self._recover, self._remove_cgroups, self._note_state):
            try:
                step()
            except Exception as exc:
                log(f"warning: clean-up step {step.__name__} failed: {exc}")
        if self.memory.nvml is not None:
            with contextlib.suppress(Exception):
                self.memory.nvml.nvmlShutdown()
        took = time.monotonic() - t
        log(f"cleaned up in {took:.1f} s: workers killed, kiwid stopped, recover ran")

    def _recover(self) -> None:
        try:
            kiwid_recover(self.state_dir)
        except subprocess.TimeoutExpired:
            log("warning: kiwid recover took over 60 s")

    def _note_state(self) -> None:
        """After kiwid and ``kiwid recover``: were the state_dir's other files left alone?

        Then add the tenants that allocated (kiwid saw their footprint) to the bench's list.
        """
        if self.args.dry_run or not self.workers:
            return
        kiwid_owns = {"state.json", "kiwid.lock", "sim.json"}
        gone = [n for n in self.state_before if n not in listing(self.state_dir)]
        if [n for n in gone if n not in kiwid_owns]:
            self.state_removed = gone
            log(f"WARNING: kiwid or kiwid recover removed {gone} from {self.state_dir}")
        seen = [
            (self.identities[w.label], int(self.gib_of[w.label] * GIB))
            for w in self.workers
            if w.label in self.allocated and self.identities.get(w.label, "?") != "?"
        ]
        record(self.state_dir, seen)
        log(
            f"state dir {self.state_dir}: {', '.join(listing(self.state_dir))} "
            f"({len(seen)} workload(s) noted for a later --keep-state run)"
        )

    def _stop_kiwid(self) -> None:
        if self.kiwid is None:
            return
        rc = self.kiwid.stop()
        self._read_kiwid()
        if rc not in (0, None):
            log(f"warning: kiwid exited {rc}:\n{self.kiwid.tail(8)}")
        self.kiwid = None

    def _remove_cgroups(self) -> None:
        for w in self.workers:
            if not w.cgroup.remove(3.0):
                log(f"warning: could not remove cgroup {w.cgroup.name}")
        for cgroup in stale_cgroups(self.layout):
            if not cgroup.remove(1.0):
                log(f"warning: cgroup {cgroup.name} still busy; left in place")

    # results ------------------------------------------------------------
    def analysis(self) -> Analysis:
        logs = {w.label: read_worker_log(w.progress) for w in self.workers}
        events = parse_kiwid(self.kiwid_lines, self.names)
        lo = self.t_rot0 if self.t_rot0 is not None else time.monotonic()
        hi = self.t_end if self.t_end is not None else time.monotonic()
        refs = [
            read_worker_log(p) if p else None for p in (self.reference_log, self.reference_log_2)
        ]
        result = analyse(
            logs, events, lo, hi, known=self.known, reference=refs[0], reference_2=refs[1]
        )
        if self.forced:
            result.notes.append(f"released before kiwid was calm: {', '.join(self.forced)}")
        never = [w.label for w in self.workers if w.label not in self.released]
        if never and self.samples:
            most = max(s[2] for s in self.samples) / GIB
            result.notes.append(
                f"never let allocate: {', '.join(never)} (no room and calm together; the most "
                f"free GPU memory seen: {most:.1f} GiB)"
            )
        return result
