"""Shared helpers for the benchmarks that run a real kiwid (simulated GPU backend).

Not a benchmark itself. Starts kiwid as a child process with a throw-away config,
socket and state directory, spawns tenant processes, and cleans all of it up.
"""

from __future__ import annotations

import contextlib
import grp
import math
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kiwid.adapters.control import ControlError, DaemonUnreachable, request

KIWID = Path(sys.executable).with_name("kiwid")
GIB = 2**30
CGROUP_ROOT = Path("/sys/fs/cgroup")


def machine() -> str:
    """One line naming the machine the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    cores = os.cpu_count()
    affinity = len(os.sched_getaffinity(0))
    return (
        f"machine: {platform.node()}, {cpu}, {cores} cores ({affinity} usable), "
        f"{platform.system()} {platform.release()}, python {platform.python_version()}, "
        f"{_busy_pct():.0f}% CPU busy in the second before the run"
    )


def _busy_pct(seconds: float = 1.0) -> float:
    """How busy all CPUs were over ``seconds`` (other load skews every figure)."""

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields[:8]), fields[3] + fields[4]  # total, idle + iowait

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 100 * (1 - (idle1 - idle0) / max(total1 - total0, 1))


def raise_nofile(want: int) -> None:
    """Raise this process's open-file limit to ``want`` (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= want:
        return
    new_hard = hard if hard == resource.RLIM_INFINITY or hard >= want else want
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, new_hard))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _own_group() -> str:
    """Our primary group's name: kiwid lets it use sim-attach without root."""
    try:
        return grp.getgrgid(os.getgid()).gr_name
    except KeyError:
        return "kiwi"


class Kiwid:
    """A kiwid child process on a private socket; use as a context manager."""

    def __init__(
        self,
        devices: int,
        *,
        tq: float = 30,
        poll_interval: float = 0.5,
        profile: Path | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kiwi-bench-"))
        self.sock = self.dir / "kiwid.sock"
        self.config = self.dir / "kiwi.toml"
        self.log = self.dir / "kiwid.log"
        self.config.write_text(
            f"[scheduler]\ntq = {tq}\n"
            f'[gpu]\nbackend = "sim"\npoll_interval = {poll_interval}\n'
            f"[gpu.sim]\ndevices = {devices}\nmemory_gib = 80\n"
            f'[control]\nsocket = "{self.sock}"\nadmin_group = "{_own_group()}"\n'
            f'[daemon]\nstate_dir = "{self.dir / "state"}"\n'
            '[kubernetes]\ncdi_dir = ""\n'  # no CDI spec on the machine for a benchmark
            + (f'[metrics]\nlisten = "127.0.0.1:{metrics_port}"\n' if metrics_port else "")
        )
        self._profile = profile
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> Kiwid:
        if self._profile is None:
            cmd = [str(KIWID), "--config", str(self.config)]
        else:  # under cProfile (main thread only); written when kiwid stops on SIGTERM
            cmd = [sys.executable, "-m", "cProfile", "-o", str(self._profile)]
            cmd += ["-m", "kiwid", "--config", str(self.config)]
        try:
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=log, stdout=log)
            self._wait_ready(15.0)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiwid exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                request(self.sock, "ping", timeout_s=1.0)
            except (DaemonUnreachable, ControlError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kiwid did not answer ping: {self.log_tail()}") from None
                time.sleep(0.05)
            else:
                return

    def request(self, cmd: str, args: dict[str, object] | None = None) -> dict[str, object]:
        return request(self.sock, cmd, args, timeout_s=30.0)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM kiwid and wait; SIGKILL if it does not stop within 20 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Tenants:
    """Child processes to attach as simulated tenants; all killed on exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, busy: bool = False) -> int:
        argv = [sys.executable, "-c", "while True: pass"] if busy else ["sleep", "3600"]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C in the terminal reaches only us
        )
        self.procs.append(proc)
        return proc.pid

    def kill(self, pid: int) -> None:
        for proc in self.procs:
            if proc.pid == pid and proc.poll() is None:
                proc.kill()
                proc.wait()

    def __enter__(self) -> Tenants:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            _remove_kiwi_cgroups(proc.pid)
        self.procs.clear()


def _remove_kiwi_cgroups(pid: int) -> None:
    """Remove the empty ``/kiwi/pid-N`` cgroups kiwid made to gate bare process ``pid``."""
    for directory in CGROUP_ROOT.glob(f"*/kiwi/pid-{pid}"):
        with contextlib.suppress(OSError):
            directory.rmdir()


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU time of a process so far (its threads, not its children)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """Resident set size (VmRSS) of a process, bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def percentiles(samples: list[float], qs: tuple[float, ...]) -> list[float]:
    """Nearest-rank percentiles of ``samples`` (not empty); 100 is the maximum."""
    ordered = sorted(samples)
    n = len(ordered)
    return [ordered[min(n - 1, max(0, math.ceil(q / 100 * n) - 1))] for q in qs]


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that the ``finally`` clean-ups run."""

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
