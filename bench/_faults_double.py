"""The fault matrix on the driver double: a real kiwid on its GPU path (bench/driver_faults.py).

A real ``python -m kiwid`` with ``backend = "nvml"``, ``gate = "cuda-lock"`` and
``swap = "checkpoint"`` runs on the stand-in ``libcuda.so.1`` and pynvml of
``tests/stand_ins`` (:class:`~tests.stand_ins.cudadouble.DriverDouble`). Its
tenants are ``cuda_tenant.py`` programs, each in a cgroup2 of its own: three
single processes of 1 GiB and one tenant of two processes of 0.5 GiB each. The
5 GiB card also holds 1.5 GiB that no process shows (another job), so the
tenants (4 GiB) do not all fit: every waiter's memory goes to host RAM. Before
``kiwid recover`` that other job ends, so that recover can bring everyone back
and the bench can check that it did.

A tenant runs when one of its processes is RUNNING in the double and its cgroup
is not frozen (a fence); its progress is the iterations its processes did.

Not a benchmark itself.
"""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from _faults_rig import (
    GIB,
    PREFIX,
    ROOT,
    V2,
    Daemon,
    Snapshot,
    Tenant,
    make_cgroup,
    settle,
    signal_all,
    thaw,
    thaw_and_remove,
    wait_until,
)

if str(ROOT) not in sys.path:  # the driver double lives with the tests
    sys.path.insert(0, str(ROOT))

from tests.stand_ins import cudadir
from tests.stand_ins.cudadouble import CudaTenant, DriverDouble

OPS = ("lock", "unlock", "checkpoint", "restore", "state")
KINDS = ("fail-999", "fail-2", "hang-s", "hang-clear", "stuck", "oom", "multi", "gpu-lost")
OPERATOR_KINDS = ("hang-retry", "hang-release")
"""A call hangs until cleared, and the operator's retry (or release) comes while it
hangs: it waits behind the call, and runs once the bench clears the fault."""
ESCAPES = (("checkpoint", "newproc"), ("lock", "newproc"), ("admission", "late-context"))
"""The processes kiwid did not lock once: a process a tenant starts while a call of it
hangs (the follow waited behind it), and a container held at admission before its
first CUDA call (the lock had nothing to hold)."""
PERSIST = 1_000_000
"""``times`` of a fault that lasts until it is cleared."""
CAPACITY = 5 * GIB
FOREIGN = 3 * GIB // 2
NEWCOMER = GIB // 8
"""A process or container a run starts: small, so that it fits beside the others."""
TENANTS = (("m", GIB // 2, 2), ("t1", GIB, 1), ("t2", GIB, 1), ("t3", GIB, 1))
"""name, memory per process, processes: ``m`` is the multi-process tenant."""

CONFIG = """\
[scheduler]
tq = {tq}
idle_release = 0.5
[gpu]
backend = "nvml"
poll_interval = 0.05
gate = "cuda-lock"
gate_timeout = {gate_timeout}
driver_timeout = {driver_timeout}
[memory]
swap = "checkpoint"
reserve_mib = 256
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
    """(operation, kind) of the matrix: every kind against every operation.

    ``oom`` is a restore's (the driver answers it to a restore that finds no room),
    and a lost GPU fails every operation at once: one row each.
    """
    out = [(op, kind) for op in OPS for kind in KINDS if kind not in ("oom", "gpu-lost")]
    out += [(op, kind) for op in OPS for kind in OPERATOR_KINDS]
    return [*out, ("restore", "oom"), ("any", "gpu-lost"), *ESCAPES]


@dataclass
class DoubleRig:
    """kiwid, the driver double and four CUDA tenants in cgroups of their own."""

    d: Path
    tq: float = 1.0
    driver_timeout: float = 2.0
    gate_timeout: float = 0.5
    name: str = "double"
    daemon: Daemon = field(init=False)
    double: DriverDouble = field(init=False)
    parent: Path = field(default_factory=lambda: V2 / f"{PREFIX}{uuid.uuid4().hex[:8]}")
    tenants: list[Tenant] = field(default_factory=list)
    cuda: dict[str, CudaTenant] = field(default_factory=dict)
    injected: set[tuple[int, str]] = field(default_factory=set)
    extra: dict[str, list[CudaTenant]] = field(default_factory=dict)
    """Processes a run started in a tenant's cgroup (newproc), ended with the run."""
    transient: list[tuple[Tenant, CudaTenant, str]] = field(default_factory=list)
    """A container a run announced (late-context): tenant, process, its container id."""

    def __post_init__(self) -> None:
        self.double = DriverDouble(
            self.d / "cuda",
            CAPACITY,
            checkpoint_bytes_per_s=4 * GIB,
            restore_bytes_per_s=8 * GIB,
        )
        self.daemon = Daemon(self.d, self.double.env())

    # ------------------------------------------------------------ set-up

    def start(self) -> None:
        """kiwid, then the tenants one by one (each once the card has room), then the rotation."""
        self.daemon.write_config(
            CONFIG.format(
                d=self.d,
                tq=self.tq,
                driver_timeout=self.driver_timeout,
                gate_timeout=self.gate_timeout,
            )
        )
        make_cgroup(self.parent)
        self.daemon.start(ready="Gate: the CUDA driver's process lock")
        self.double.set_foreign(FOREIGN)
        for name, memory, processes in TENANTS:
            cgroup = make_cgroup(self.parent / name)
            spawn = lambda m=memory, n=processes, c=cgroup: self._spawn(m, n, c)  # noqa: E731
            tenant = wait_until(spawn, 30, 0.1)
            if tenant is None:
                raise RuntimeError(f"tenant {name} found no room on the card in 30 s")
            self.cuda[name] = tenant
            self.tenants.append(Tenant(name, cgroup, lambda n=name: self._pids(n)))
        if not self.establish():
            raise RuntimeError("kiwid did not set up the rotation in 30 s")

    def _pids(self, name: str) -> list[int]:
        """A tenant's processes with a context: its own, and those a run started in it."""
        pids = list(self.cuda[name].pids())
        for extra in self.extra.get(name, []):
            pids += [p for p in extra.pids() if p not in pids]
        return sorted(pids)

    def _spawn(self, memory: int, processes: int, cgroup: Path) -> CudaTenant | None:
        try:
            return self.double.spawn_tenant(memory, processes=processes, cgroup=cgroup)
        except RuntimeError:  # out of memory: kiwid has not swapped a waiter out yet
            return None

    def establish(self, timeout: float = 30) -> bool:
        """Wait until kiwid gates all but one tenant and the waiters' memory left the card."""

        def settled() -> bool:
            status = self.daemon.status()
            if status is None:
                return False
            states = [t["state"] for t in status["gpus"][0]["tenants"]]
            snap = self.snapshot()
            on_card = self.double.resident_bytes() + FOREIGN
            return (
                len(states) == len(self.tenants)
                and states.count("holder") <= 1
                and all(s in ("holder", "waiting", "stuck") for s in states)
                and len(snap.running) <= 1
                and on_card <= CAPACITY
            )

        return settle(settled, self.memory_problems, timeout)

    # ------------------------------------------------------------ what it shows

    def snapshot(self) -> Snapshot:
        """Who runs now, each tenant's progress, and whether the GPU is lost."""
        procs = self.double.processes()
        running, detail = set(), []
        names = {cudadir.RUNNING: "RUNNING", cudadir.LOCKED: "LOCKED"}
        for tenant in self.tenants:
            states = [procs[p].state for p in tenant.pids() if p in procs]
            frozen = tenant.frozen()
            if cudadir.RUNNING in states and not frozen:
                running.add(tenant.name)
            pids = [p for p in tenant.pids() if p in procs]
            each = [f"{p}={names.get(procs[p].state, 'CHECKPOINTED')}" for p in pids]
            detail.append(f"{tenant.name} {','.join(each)}{' frozen' if frozen else ''}")
        progress = {n: float(c.progress()) for n, c in self.cuda.items()}
        return Snapshot(running, progress, cudadir.lost(self.double.directory), "; ".join(detail))

    # ------------------------------------------------------------ faults

    def inject(self, op: str, kind: str, tenant: Tenant, rng: random.Random) -> str:
        """Inject one fault of ``kind`` into ``op`` of ``tenant``; say what was done."""
        if kind == "gpu-lost":
            self.double.lose_gpu()
            return "the GPU is lost"
        if kind == "late-context":
            return self._admit_late(rng)
        if kind == "newproc":
            pid = tenant.pids()[0]
            self.double.fault(pid, op, "hang", 0)
            self.injected.add((pid, op))
            time.sleep(rng.uniform(0, 2 * self.driver_timeout))  # into the hang, maybe past it
            started = wait_until(lambda: self._spawn(NEWCOMER, 1, tenant.cgroup), 10, 0.1)
            if started is None:
                return f"{op} of pid {pid} hangs; no room on the card for a new process"
            self.extra.setdefault(tenant.name, []).append(started)
            return f"{op} of pid {pid} hangs; a new process {started.pid} in {tenant.name}"
        pids = tenant.pids()
        pid = pids[-1] if kind == "multi" else rng.choice(pids)
        times = rng.choice((1, PERSIST))
        if kind in ("fail-999", "fail-2", "multi"):
            code = 2 if kind == "fail-2" else 999
            self.double.fault(pid, op, "fail", code, times=times)
            what = f"fail {code}"
        elif kind == "hang-s":
            seconds = round(rng.uniform(0.5, 2.5 * self.driver_timeout), 2)
            self.double.fault(pid, op, "hang", seconds)
            what, times = f"hang {seconds} s", 1
        elif kind in ("hang-clear", *OPERATOR_KINDS):
            self.double.fault(pid, op, "hang", 0)
            what, times = "hang until cleared", 1
        elif kind == "oom":
            self.double.fault(pid, op, "oom", times=times)
            what = "oom"
        else:
            self.double.fault(pid, op, kind)
            what, times = kind, 1
        self.injected.add((pid, op))
        return f"{what} x {'until cleared' if times == PERSIST else times} on pid {pid}"

    def end_loss(self) -> None:
        """The GPU answers again."""
        self.double.restore_gpu()

    def pending(self) -> bool:
        """Whether an injected fault is still in force (not spent, or a process stuck)."""
        if cudadir.lost(self.double.directory):
            return True
        faults = self.double.faults()
        procs = self.double.processes()
        for pid, op in self.injected:
            text = faults.get(f"{pid}.{op}", "none")
            if text != "none" or (pid in procs and procs[pid].stuck):
                return True
        return False

    def clear(self) -> None:
        """End every injected fault (a hang returns, a stuck process un-sticks).

        The processes and containers a run started end too (the rotation goes on
        with the four tenants it began with).
        """
        self.double.restore_gpu()
        for pid, op in sorted(self.injected):
            self.double.clear(pid, op)
        self.injected.clear()
        # A process started in a tenant's cgroup ends alone (not the cgroup's others).
        started = [replace(p, cgroup=None) for procs in self.extra.values() for p in procs]
        self.extra.clear()
        for tenant, proc, cid in self.transient:
            self.tenants = [t for t in self.tenants if t is not tenant]
            with contextlib.suppress(OSError, RuntimeError):
                self.daemon.call("unregister", {"id": cid})
            started.append(proc)
        if started:
            self.double.close(started)
        for tenant, _, _ in self.transient:
            with contextlib.suppress(OSError):
                tenant.cgroup.rmdir()
        self.transient.clear()

    def _admit_late(self, rng: random.Random) -> str:
        """A container announced with admission hold before its first CUDA call; then the call.

        It is one more tenant for the run (the judge watches it as the target), and
        ends with the run.
        """
        name = f"adm{uuid.uuid4().hex[:4]}"
        cgroup = make_cgroup(self.parent / name)
        first_call = self.d / f"{name}.first-call"
        proc = self.double.spawn_tenant(NEWCOMER, cgroup=cgroup, context_when=first_call)
        tenant = Tenant(name, cgroup, proc.pids)
        cid = uuid.uuid4().hex + uuid.uuid4().hex
        self.transient.append((tenant, proc, cid))
        self.tenants = [*self.tenants, tenant]
        key = f"/{cgroup.relative_to(V2)}"
        answer = self.daemon.call(
            "register", {"id": cid, "cgroup_v2": key, "pid": proc.pid, "hold": True}
        )
        time.sleep(rng.uniform(0, self.tq))
        first_call.touch()
        held = answer.get("held")
        return f"container {name} (pid {proc.pid}) registered, held {held}; then its first call"

    # ------------------------------------------------------------ checks

    def memory_problems(self) -> list[str]:
        """Each process whose memory is off the card, or locked, with no record to undo it.

        The state file is read before and after the driver's view: a record dropped
        in between (a restore and an ungate) still counts.
        """
        before = self.daemon.recorded_pids()
        procs = self.double.processes()
        recorded = before | self.daemon.recorded_pids()
        problems = []
        for tenant in self.tenants:
            for pid in tenant.pids():
                proc = procs.get(pid)
                if proc is None:
                    problems.append(f"{tenant.name} pid {pid}: no CUDA context")
                elif proc.state == cudadir.CHECKPOINTED and pid not in recorded:
                    problems.append(f"{tenant.name} pid {pid}: in host RAM, no record")
                elif proc.state == cudadir.LOCKED and pid not in recorded:
                    problems.append(f"{tenant.name} pid {pid}: locked, no record")
            if tenant.frozen() and not set(tenant.pids()) & recorded:
                problems.append(f"{tenant.name}: frozen (a fence), no record")
        return problems

    def prepare_recover(self) -> None:
        """The other job ends: now every tenant fits, and recover can bring all back."""
        self.double.set_foreign(0)

    def recovered_problems(self) -> list[str]:
        """After ``kiwid recover``: every process RUNNING, all its memory on the card."""
        procs = self.double.processes()
        problems = []
        for tenant in self.tenants:
            for pid in tenant.pids():
                proc = procs.get(pid)
                if proc is None or proc.state != cudadir.RUNNING or not proc.resident:
                    state = "gone" if proc is None else f"state {proc.state}"
                    problems.append(f"{tenant.name} pid {pid}: {state} after recover")
            if tenant.frozen():
                problems.append(f"{tenant.name}: frozen after recover")
        memory = sum(len(self.cuda[n].pids()) * m for n, m, _ in TENANTS)
        if self.double.resident_bytes() != memory:
            problems.append(f"{self.double.resident_bytes()} of {memory} bytes on the card")
        return problems

    def repair(self) -> list[str]:
        """With no kiwid: unlock and thaw by hand what no record names (as ``cuda-checkpoint
        --toggle`` and ``echo 0 > cgroup.freeze`` would), so that the matrix can go on.

        Returns what it did.
        """
        recorded = self.daemon.recorded_pids()
        done = []
        with cudadir.locked(self.double.directory):
            for tenant in self.tenants:
                for pid in tenant.pids():
                    proc = cudadir.read_proc(self.double.directory, pid)
                    if proc is None or proc.state == cudadir.RUNNING or pid in recorded:
                        continue
                    cudadir.write_proc(
                        self.double.directory, replace(proc, state=cudadir.RUNNING, stuck=False)
                    )
                    done.append(f"{tenant.name} pid {pid} (state {proc.state}) unlocked by hand")
        for tenant in self.tenants:
            if tenant.frozen() and not set(tenant.pids()) & recorded:
                (tenant.cgroup / "cgroup.freeze").write_text("0")
                done.append(f"{tenant.name} thawed by hand")
        return done

    def hold(self, stop: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) every tenant process."""
        pids = {p for t in self.tenants for p in t.pids()} | {c.pid for c in self.cuda.values()}
        signal_all(sorted(pids), signal.SIGSTOP if stop else signal.SIGCONT)

    def after_restart(self) -> bool:
        """kiwid runs again: the rotation, then the other job again."""
        ok = self.establish()
        self.double.set_foreign(FOREIGN)
        return ok

    # ------------------------------------------------------------ clean-up

    def cleanup(self) -> list[str]:
        """End kiwid (SIGTERM), undo what it left, kill the tenants, remove the cgroups."""
        problems = []
        with contextlib.suppress(OSError):
            self.clear()
            self.double.set_foreign(0)
        self.daemon.stop()
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if self.daemon.state_dir.exists():
                out = self.daemon.recover()
                if out.returncode != 0:
                    problems.append(f"recover at clean-up exited {out.returncode}")
        pids = {p for t in self.tenants for p in t.pids()} | {c.pid for c in self.cuda.values()}
        thaw(self.parent, pids)  # a frozen process may not die (the v1 freezer)
        self.double.close()
        problems += thaw_and_remove(self.parent, pids)
        return problems
