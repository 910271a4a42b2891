"""The driver double from a test or a bench: build it, run tenants on it, inject faults.

A :class:`DriverDouble` is one simulated card: a directory (layout in
:mod:`tests.stand_ins.cudadir`), the stand-in ``libcuda.so.1`` built from
``libcuda_standin.c`` into it, and a machine file for the stand-in pynvml whose
one device is that card. :meth:`DriverDouble.env` is what a ``python -m kiwid``
(or ``kiwid recover``) needs to run its real GPU path on it: ``backend =
"nvml"``, ``gate = "cuda-lock"``, ``swap = "checkpoint"``::

    double = DriverDouble(workdir / "cuda", capacity_bytes=12 * GiB)
    tenant = double.spawn_tenant(memory=3 * GiB, cgroup=path)
    subprocess.Popen([sys.executable, "-m", "kiwid", ...], env={**os.environ, **double.env()})
    double.fault(tenant.pid, "restore", "fail", 2)

:meth:`DriverDouble.close` ends the tenants it started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.stand_ins import DIRECTORY, NVML_MACHINE, cudadir, write_machine

SOURCE = DIRECTORY / "libcuda_standin.c"
TENANT = DIRECTORY / "cuda_tenant.py"
UUID = "GPU-d0b1e000-0000-4000-8000-000000000001"
KINDS = ("fail", "hang", "stuck", "oom")


class NoCompiler(RuntimeError):
    """No C compiler here to build the stand-in libcuda (tests skip)."""


def build_library(out_dir: Path) -> Path:
    """Compile ``libcuda_standin.c`` to ``out_dir/libcuda.so.1``; return its path.

    Raises:
        NoCompiler: neither ``cc`` nor ``gcc`` is on the PATH.
    """
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NoCompiler("no C compiler (cc or gcc) to build the stand-in libcuda.so.1")
    out_dir.mkdir(parents=True, exist_ok=True)
    library = out_dir / "libcuda.so.1"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-o", str(library), str(SOURCE)],
        check=True,
    )
    return library


@dataclass(frozen=True)
class Fault:
    """A fault of one driver call (see :meth:`DriverDouble.fault`).

    ``process``: which of a tenant's processes it is for, when given at its start
    (:meth:`DriverDouble.spawn_tenant`): 0 the first (``CudaTenant.pid``), then its
    children in the order they start.
    """

    op: str
    kind: str
    arg: float | None = None
    times: int = 1
    process: int = 0

    def text(self) -> str:
        """The fault file's line, as the stand-in libcuda reads it."""
        if self.op not in cudadir.OPS or self.kind not in KINDS or self.times < 1:
            what = f"fault({self.op!r}, {self.kind!r}, times={self.times})"
            raise ValueError(f"{what}: see cudadir.py")
        if self.kind == "fail":
            if self.arg is None:
                raise ValueError("a fail fault needs the CUresult to return")
            return f"fail {int(self.arg)} {self.times}"
        if self.kind == "hang":
            return f"hang {float(self.arg or 0):g} {self.times}"
        return f"{self.kind} {self.times}"


@dataclass
class CudaTenant:
    """A running ``cuda_tenant.py``: its first process, its cgroup, its processes."""

    proc: subprocess.Popen[str]
    directory: Path
    cgroup: Path | None = None

    @property
    def pid(self) -> int:
        """The first process (the one started; the others are its children)."""
        return self.proc.pid

    def pids(self) -> list[int]:
        """Its processes that have a context now."""
        procs = cudadir.read_procs(self.directory)
        return sorted(p for p in procs if p == self.pid or _parent(p) == self.pid)

    def progress(self) -> int:
        """Iterations of GPU work done, all its processes together."""
        return sum(cudadir.read_progress(self.directory, p)[0] for p in self.pids())


def _procs_of(cgroup: Path) -> list[str]:
    try:
        return (cgroup / "cgroup.procs").read_text().split()
    except OSError:
        return []


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


class DriverDouble:
    """One simulated card, shared by every process through its directory."""

    def __init__(
        self,
        directory: Path,
        capacity_bytes: int,
        *,
        foreign_bytes: int = 0,
        checkpoint_bytes_per_s: int = 0,
        restore_bytes_per_s: int = 0,
        oom_sticks: bool = False,
        library: Path | None = None,
    ) -> None:
        """Make the card in ``directory`` (created); build the library unless given one.

        Raises:
            NoCompiler: ``library`` is ``None`` and there is no C compiler.
        """
        self.directory = directory
        for sub in ("procs", "faults", "progress"):
            (directory / sub).mkdir(parents=True, exist_ok=True)
        self.library = library or build_library(directory / "lib")
        cudadir.write_config(
            directory,
            capacity=capacity_bytes,
            foreign=foreign_bytes,
            checkpoint_rate=checkpoint_bytes_per_s,
            restore_rate=restore_bytes_per_s,
            oom_sticks=int(oom_sticks),
        )
        self.machine = directory / "nvml.json"
        device = {"uuid": UUID, "name": "NVIDIA H200 (driver double)", "cuda": str(directory)}
        write_machine(self.machine, {"devices": [device]})
        self.tenants: list[CudaTenant] = []

    def env(self) -> dict[str, str]:
        """The environment a kiwid (or ``kiwid recover``) needs to use this card."""

        def first(path: Path, variable: str) -> str:
            return os.pathsep.join(filter(None, [str(path), os.environ.get(variable)]))

        return {
            "LD_LIBRARY_PATH": first(self.library.parent, "LD_LIBRARY_PATH"),
            cudadir.ENVIRONMENT: str(self.directory),
            "PYTHONPATH": first(DIRECTORY, "PYTHONPATH"),
            NVML_MACHINE: str(self.machine),
        }

    # -- the card

    def set_foreign(self, nbytes: int) -> None:
        """Memory on the card that no process shows (another job, the display)."""
        self.configure(foreign=nbytes)

    def configure(self, **values: int) -> None:
        """Change keys of the card's ``config`` (capacity, checkpoint_rate, oom_sticks...)."""
        unknown = set(values) - set(cudadir.read_config(self.directory))
        if unknown:
            raise ValueError(f"no such config key: {', '.join(sorted(unknown))}")
        cudadir.write_config(self.directory, **values)

    def lose_gpu(self) -> None:
        """The GPU falls off the bus: every driver call fails, NVML says GPU_IS_LOST."""
        (self.directory / "lost").touch()

    def restore_gpu(self) -> None:
        """The GPU answers again."""
        (self.directory / "lost").unlink(missing_ok=True)

    # -- faults

    def fault(self, pid: int, op: str, kind: str, arg: float | None = None, times: int = 1) -> None:
        """Make the next ``times`` calls of ``op`` on ``pid`` fail, hang, stick or run out.

        ``arg``: the CUresult for ``fail`` (required), the seconds for ``hang``
        (``None`` or 0: until :meth:`clear`).
        """
        self._write_fault(pid, op, Fault(op, kind, arg, times).text())

    def clear(self, pid: int, op: str) -> None:
        """End the fault of ``op`` on ``pid`` (a hang returns; a stuck process un-sticks)."""
        self._write_fault(pid, op, "none")

    def _write_fault(self, pid: int, op: str, text: str) -> None:
        with cudadir.locked(self.directory):  # not between a call's read and countdown
            cudadir.write_atomic(self.directory / "faults" / f"{pid}.{op}", text + "\n")

    def faults(self) -> dict[str, str]:
        """The fault files now, by ``PID.OP``."""
        with cudadir.locked(self.directory):
            return {
                f.name: f.read_text().strip()
                for f in sorted((self.directory / "faults").iterdir())
                if not f.name.endswith(".tmp")
            }

    # -- what the card holds

    def processes(self) -> dict[int, cudadir.Proc]:
        """Every CUDA process, read under the lock: one consistent snapshot."""
        with cudadir.locked(self.directory):
            return cudadir.read_procs(self.directory)

    def state(self, pid: int) -> int | None:
        """``CUprocessState`` of ``pid`` (``None``: no CUDA process)."""
        proc = cudadir.read_proc(self.directory, pid)
        return None if proc is None else proc.state

    def resident_bytes(self) -> int:
        """The memory of the processes on the card (not counting the foreign)."""
        return cudadir.resident_bytes(self.processes())

    # -- tenants

    def spawn_tenant(
        self,
        memory: int,
        *,
        processes: int = 1,
        spawn_later: float | None = None,
        cgroup: Path | None = None,
        faults: tuple[Fault, ...] = (),
        timeout: float = 10.0,
        context_when: Path | None = None,
        serve: Path | None = None,
    ) -> CudaTenant:
        """Start ``cuda_tenant.py``; return once its ``processes`` have a context.

        ``faults`` are in place before the driver lists the process they are for
        (each process writes its own as it creates its context): kiwid cannot call
        the driver on it first, as it could between a start and :meth:`fault`.
        ``context_when``: its contexts come only once that file exists (its first
        CUDA call, late); it returns once the process runs, with no context yet.
        ``serve``: it works only for requests, on the port it writes to that file
        (``cuda_tenant.py --serve``).

        Raises:
            RuntimeError: it exited first (e.g. out of memory) or took too long; what
                it started is ended.
        """
        argv = [sys.executable, str(TENANT), "--memory", str(memory)]
        argv += ["--processes", str(processes)]
        if spawn_later is not None:
            argv += ["--spawn-later", str(spawn_later)]
        if cgroup is not None:
            argv += ["--cgroup", str(cgroup)]
        for fault in faults:
            argv += ["--fault", f"{fault.process}:{fault.op}:{fault.text()}"]
        if context_when is not None:
            argv += ["--context-when", str(context_when)]
        if serve is not None:
            argv += ["--serve", str(serve)]
        env = {**os.environ, cudadir.ENVIRONMENT: str(self.directory)}
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, text=True)
        tenant = CudaTenant(proc, self.directory, cgroup)
        self.tenants.append(tenant)
        deadline = time.monotonic() + timeout
        if context_when is not None:  # in its cgroup once it looks for the file
            while cgroup is not None and str(proc.pid) not in _procs_of(cgroup):
                if proc.poll() is not None or time.monotonic() > deadline:
                    self.close([tenant])
                    raise RuntimeError(f"cuda_tenant: exited (code {proc.poll()})")
                time.sleep(0.01)
            return tenant
        while len(tenant.pids()) < processes:
            if proc.poll() is not None or time.monotonic() > deadline:
                self.close([tenant])
                raise RuntimeError(
                    f"cuda_tenant: {len(tenant.pids())} of {processes} processes have a "
                    f"context (exit code {proc.poll()}; out of memory?)"
                )
            time.sleep(0.01)
        return tenant

    def close(self, tenants: list[CudaTenant] | None = None) -> None:
        """End the tenants (default: every one started here); wait until they are gone."""
        for tenant in self.tenants if tenants is None else tenants:
            pids = {tenant.pid, *tenant.pids()}
            if tenant.cgroup is not None:
                with contextlib.suppress(OSError):
                    pids |= {int(p) for p in (tenant.cgroup / "cgroup.procs").read_text().split()}
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            tenant.proc.wait()
            deadline = time.monotonic() + 5
            while any(map(cudadir.start_ticks, pids)) and time.monotonic() < deadline:
                time.sleep(0.01)  # the children: reaped by init once dead
