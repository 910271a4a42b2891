"""The fault matrix on the simulated GPU, with the cgroup freezer (bench/driver_faults.py --sim).

A real kiwid with ``backend = "sim"``, ``gate = "freeze"`` and ``swap =
"checkpoint"`` (the sim's swapper) gates four busy processes, each in a cgroup2
of its own, attached with 2 GiB each on a 10 GiB card of which 3 GiB are taken
by memory no process shows (``sim-foreign``): they do not all fit (11 GiB), yet
a released tenant, the holder and the next fit beside the reserve. Faults come
through ``sim-fault`` (checkpoint and restore; fail, hang until cleared,
stuck). A tenant runs when its cgroup is not frozen; its progress is its
cgroup's CPU time. The simulated GPU keeps its memory in ``state/sim.json``,
which ``kiwid recover`` reads too; ``sim-foreign`` is not kept across a restart,
so after a kill -9 every tenant fits.

Not a benchmark itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from _faults_rig import (
    GIB,
    PREFIX,
    V2,
    Daemon,
    Snapshot,
    Tenant,
    make_cgroup,
    settle,
    signal_all,
    thaw,
    thaw_and_remove,
)

from kiwid.adapters.control import ControlError, DaemonUnreachable

OPS = ("checkpoint", "restore")
KINDS = ("fail", "hang", "stuck")
MEMORY = 2 * GIB
FOREIGN = 3 * GIB
NAMES = ("s1", "s2", "s3", "s4")

CONFIG = """\
[scheduler]
tq = {tq}
idle_release = 0.5
[gpu]
backend = "sim"
poll_interval = 0.05
gate = "freeze"
gate_timeout = {gate_timeout}
driver_timeout = {driver_timeout}
[gpu.sim]
devices = 1
memory_gib = 10
swap_out_gbps = 16
swap_in_gbps = 32
[memory]
swap = "checkpoint"
reserve_mib = 1024
host_floor_mib = 0
[control]
socket = "{d}/kiwid.sock"
[daemon]
state_dir = "{d}/state"
shutdown_timeout = 20
[kubernetes]
cdi_dir = ""
"""


def cells() -> list[tuple[str, str]]:
    """(operation, kind): checkpoint and restore, each failed, hung and stuck."""
    return [(op, kind) for op in OPS for kind in KINDS]


@dataclass
class SimRig:
    """kiwid on the simulated GPU and four busy tenants in cgroups of their own."""

    d: Path
    tq: float = 1.0
    driver_timeout: float = 2.0
    gate_timeout: float = 0.5
    name: str = "sim"
    daemon: Daemon = field(init=False)
    parent: Path = field(default_factory=lambda: V2 / f"{PREFIX}{uuid.uuid4().hex[:8]}")
    tenants: list[Tenant] = field(default_factory=list)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    injected: list[tuple[int, str, str, int]] = field(default_factory=list)
    log_mark: int = 0

    def __post_init__(self) -> None:
        self.daemon = Daemon(self.d)

    # ------------------------------------------------------------ set-up

    def start(self) -> None:
        """kiwid, the tenants, the other job's memory, then the rotation."""
        self.daemon.write_config(
            CONFIG.format(
                d=self.d,
                tq=self.tq,
                driver_timeout=self.driver_timeout,
                gate_timeout=self.gate_timeout,
            )
        )
        make_cgroup(self.parent)
        self.daemon.start()
        for name in NAMES:
            cgroup = make_cgroup(self.parent / name)
            self.procs[name] = _busy(cgroup)
            pid = self.procs[name].pid
            self.tenants.append(Tenant(name, cgroup, lambda pid=pid: _live([pid])))
        self.attach()
        if not self.establish():
            raise RuntimeError("kiwid did not set up the rotation in 30 s")

    def attach(self) -> None:
        """Attach every tenant (again: the sim's processes are the daemon's to know)."""
        for tenant in self.tenants:
            with contextlib.suppress(ControlError, DaemonUnreachable):
                self.daemon.call(
                    "sim-attach",
                    {"pid": tenant.pids()[0], "gpu": 0, "memory_bytes": MEMORY, "activity": "cpu"},
                )
        self.daemon.call("sim-foreign", {"gpu": 0, "memory_bytes": FOREIGN})

    def establish(self, timeout: float = 30) -> bool:
        """Wait until kiwid gates all but one tenant."""

        def settled() -> bool:
            status = self.daemon.status()
            if status is None:
                return False
            states = [t["state"] for t in status["gpus"][0]["tenants"]]
            return (
                len(states) == len(self.tenants)
                and states.count("holder") <= 1
                and all(s in ("holder", "waiting", "stuck") for s in states)
                and len(self.snapshot().running) <= 1
            )

        return settle(settled, self.memory_problems, timeout)

    # ------------------------------------------------------------ what it shows

    def snapshot(self) -> Snapshot:
        running = {t.name for t in self.tenants if not t.frozen()}
        frozen = sorted({t.name for t in self.tenants} - running)
        progress = {t.name: t.cpu_s() for t in self.tenants}
        return Snapshot(running, progress, detail=f"frozen {frozen}")

    # ------------------------------------------------------------ faults

    def inject(self, op: str, kind: str, tenant: Tenant, rng: random.Random) -> str:
        pid = tenant.pids()[0]
        times = rng.choice((1, 3)) if kind == "fail" else 1
        self.log_mark = self._log_size()
        self.daemon.call("sim-fault", {"pid": pid, "op": op, "fault": kind, "times": times})
        self.injected.append((pid, op, kind, times))
        return f"{kind} x {times} on pid {pid}"

    def end_loss(self) -> None:
        """No lost GPU on the sim."""

    def pending(self) -> bool:
        """A hang or stuck lasts until cleared; a fail until kiwid met it as often as told."""
        text = self._log_since(self.log_mark)
        for pid, op, kind, times in self.injected:
            if kind != "fail":
                return True
            if text.count(f"injected fault (sim-fault): {op} of pid {pid}: fail") < times:
                return True
        return False

    def clear(self) -> None:
        for pid, op, _, _ in self.injected:
            with contextlib.suppress(ControlError, DaemonUnreachable):
                self.daemon.call("sim-fault", {"pid": pid, "op": op, "fault": "none"})
        self.injected.clear()

    def _log_size(self) -> int:
        return sum(log.stat().st_size for log in self.daemon.logs if log.exists())

    def _log_since(self, mark: int) -> str:
        text = b"".join(log.read_bytes() for log in self.daemon.logs if log.exists())
        return text[mark:].decode(errors="replace")

    # ------------------------------------------------------------ checks

    def sim_memory(self) -> dict[int, bool]:
        """pid -> whether the simulated GPU has its memory in host RAM."""
        try:
            doc = json.loads((self.daemon.state_dir / "sim.json").read_text())
        except (OSError, ValueError):
            return {}
        return {int(e[0]): bool(e[5]) for e in doc["entries"]}

    def memory_problems(self) -> list[str]:
        """Each tenant in host RAM, or frozen, that no record would let go."""
        before = self.daemon.recorded_pids()
        swapped = self.sim_memory()
        frozen = {t.name for t in self.tenants if t.frozen()}
        recorded = before | self.daemon.recorded_pids()
        problems = []
        for tenant in self.tenants:
            (pid,) = tenant.pids() or (0,)
            if swapped.get(pid) and pid not in recorded:
                problems.append(f"{tenant.name} pid {pid}: in host RAM, no record")
            if tenant.name in frozen and pid not in recorded:
                problems.append(f"{tenant.name} pid {pid}: frozen, no record")
        return problems

    def prepare_recover(self) -> None:
        """Nothing: the other job's memory was kiwid's (sim-foreign), gone with it."""

    def recovered_problems(self) -> list[str]:
        swapped = self.sim_memory()
        problems = []
        for tenant in self.tenants:
            pids = tenant.pids()
            if not pids:
                problems.append(f"{tenant.name}: gone")
            elif swapped.get(pids[0]):
                problems.append(f"{tenant.name} pid {pids[0]}: in host RAM after recover")
            if tenant.frozen():
                problems.append(f"{tenant.name}: frozen after recover")
        return problems

    def repair(self) -> list[str]:
        """With no kiwid: thaw by hand a frozen tenant that no record names."""
        recorded = self.daemon.recorded_pids()
        done = []
        for tenant in self.tenants:
            if tenant.frozen() and not set(tenant.pids()) & recorded:
                (tenant.cgroup / "cgroup.freeze").write_text("0")
                done.append(f"{tenant.name} thawed by hand")
        return done

    def hold(self, stop: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) every tenant process."""
        signal_all([p.pid for p in self.procs.values()], signal.SIGSTOP if stop else signal.SIGCONT)

    def after_restart(self) -> bool:
        self.attach()
        return self.establish()

    # ------------------------------------------------------------ clean-up

    def cleanup(self) -> list[str]:
        problems = []
        self.clear()
        self.daemon.stop()
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if self.daemon.state_dir.exists():
                out = self.daemon.recover()
                if out.returncode != 0:
                    problems.append(f"recover at clean-up exited {out.returncode}")
        pids = {p.pid for p in self.procs.values()}
        thaw(self.parent, pids)
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        problems += thaw_and_remove(self.parent, pids)
        return problems


def _busy(cgroup: Path) -> subprocess.Popen[bytes]:
    """A busy Python loop that starts only once it is in ``cgroup``."""
    r, w = os.pipe()
    code = f"import os\nos.read({r}, 1)\nwhile True: pass"
    proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(r,), start_new_session=True)
    os.close(r)
    try:
        (cgroup / "cgroup.procs").write_text(str(proc.pid))
    finally:
        os.write(w, b"x")
        os.close(w)
    return proc


def _live(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX":
                out.append(pid)
    return out
