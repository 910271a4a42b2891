"""The fault matrix's moving parts that do not depend on the backend (bench/driver_faults.py).

:class:`Daemon` is one kiwid at a time on a scratch directory: started, asked
(its socket), killed with SIGKILL, ``kiwid recover`` run after it, its logs kept
one file per start. :class:`Tenant` is one tenant as the bench sees it: a name,
kiwid's key for it, its cgroup (cgroup2, one of its own) and how to read its
processes, whether it runs and how much work it has done. The cgroup helpers
thaw and remove what a run made, also what an earlier run that was killed left.

Not a benchmark itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiwid.adapters.control import ControlError, DaemonUnreachable, request

ROOT = Path(__file__).resolve().parents[1]
KIWID = [sys.executable, "-m", "kiwid"]
KIWICTL = [sys.executable, "-m", "kiwid.cli.kiwictl"]
V2 = (
    Path("/sys/fs/cgroup/unified")
    if Path("/sys/fs/cgroup/unified/cgroup.procs").exists()
    else Path("/sys/fs/cgroup")
)
V1_FREEZER = Path("/sys/fs/cgroup/freezer")
PREFIX = "kiwi-df-"
"""The parent cgroup of a run's tenants is PREFIX + a random suffix, under the v2 root."""
GIB = 2**30


def wait_until(predicate: Callable[[], Any], timeout: float, step: float = 0.05) -> Any:
    """Poll ``predicate`` until it is truthy (return it) or ``timeout`` passes (return it)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(step)


def settle(
    ready: Callable[[], bool],
    stranded: Callable[[], list[str]],
    timeout: float = 30.0,
    patience: float = 3.0,
) -> bool:
    """Wait until ``ready()``; give up early once ``stranded()`` says something for a while.

    A tenant gated with no record does not come right by waiting (kiwid sees it
    idle): no point waiting the whole ``timeout`` for it.
    """
    deadline = time.monotonic() + timeout
    since: float | None = None
    while time.monotonic() < deadline:
        if ready():
            return True
        now = time.monotonic()
        if not stranded():
            since = None
        elif since is None:
            since = now
        elif now - since > patience:
            return False
        time.sleep(0.1)
    return False


@dataclass(frozen=True)
class Snapshot:
    """One sample: who runs (by name), each tenant's progress, whether the GPU is lost."""

    running: set[str]
    progress: dict[str, float]
    lost: bool = False
    detail: str = ""
    """What each tenant's processes were, for the report of a violation."""


@dataclass
class Tenant:
    """One tenant of the run: its name, kiwid's key for it and its cgroup."""

    name: str
    cgroup: Path
    pids: Callable[[], list[int]]
    """Its live processes now."""

    @property
    def key(self) -> str:
        """kiwid's tenant id: its cgroup2 path."""
        return f"cgroup:/{self.cgroup.relative_to(V2)}"

    def frozen(self) -> bool:
        """Whether its cgroup is frozen (the freezer gate, or a fence)."""
        try:
            return "frozen 1" in (self.cgroup / "cgroup.events").read_text().splitlines()
        except OSError:
            return False

    def cpu_s(self) -> float:
        """CPU seconds its cgroup used so far."""
        try:
            for line in (self.cgroup / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
        except OSError:
            pass
        return 0.0


@dataclass
class Daemon:
    """One kiwid at a time in directory ``d``: start, status, kill -9, recover."""

    d: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)
    recover_logs: list[Path] = field(default_factory=list)

    @property
    def sock(self) -> Path:
        return self.d / "kiwid.sock"

    @property
    def state_dir(self) -> Path:
        return self.d / "state"

    @property
    def config(self) -> Path:
        """kiwid's config, alone in its directory (kiwid watches it; the logs are beside)."""
        return self.d / "etc" / "kiwi.toml"

    def write_config(self, text: str) -> None:
        self.config.parent.mkdir(exist_ok=True)
        self.config.write_text(text)

    def start(self, ready: str | None = None, timeout: float = 20.0) -> None:
        """Start kiwid; return once it answers (and ``ready`` is in its log).

        Raises:
            RuntimeError: it exited or did not answer in time.
        """
        log = self.d / f"kiwid-{len(self.logs)}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [*KIWID, "--config", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            )

        def up() -> bool:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"kiwid exited at start: {self.tail(log)}")
            return self.answers() and (ready is None or ready in log.read_text(errors="replace"))

        if not wait_until(up, timeout):
            raise RuntimeError(f"kiwid did not come up in {timeout:.0f} s: {self.tail(log)}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def answers(self) -> bool:
        try:
            request(self.sock, "ping", timeout_s=2)
        except (DaemonUnreachable, ControlError):
            return False
        return True

    def call(self, cmd: str, args: dict[str, Any] | None = None, timeout: float = 5) -> Any:
        """One request (raises ControlError / DaemonUnreachable)."""
        return request(self.sock, cmd, args, timeout_s=timeout)

    def status(self, timeout: float = 2.0) -> dict[str, Any] | None:
        """kiwid's status, or ``None`` if it does not answer now."""
        if not self.alive():
            return None
        try:
            return request(self.sock, "status", timeout_s=timeout)
        except (DaemonUnreachable, ControlError, ValueError):
            return None

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run kiwictl on this kiwid's socket, as an operator would."""
        return subprocess.run(
            [*KIWICTL, "--socket", str(self.sock), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=ROOT,
            env={**os.environ, **self.env},
        )

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM (it ungates everyone), SIGKILL if it does not stop in time."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            return None

    def recover(self) -> subprocess.CompletedProcess[str]:
        """``kiwid recover`` on the state directory, as systemd's ExecStopPost= runs it."""
        out = subprocess.run(
            [*KIWID, "recover", "--state-dir", str(self.state_dir)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=ROOT,
            env={**os.environ, **self.env},
        )
        log = self.d / f"recover-{len(self.recover_logs)}.log"
        log.write_text(out.stdout + out.stderr)
        self.recover_logs.append(log)
        return out

    def records(self) -> dict[str, dict[str, Any]]:
        """The state file's records by tenant key ({} if none or unreadable)."""
        try:
            doc = json.loads((self.state_dir / "state.json").read_text())
        except (OSError, ValueError):
            return {}
        gated = doc.get("gated") if isinstance(doc, dict) else None
        return gated if isinstance(gated, dict) else {}

    def recorded_pids(self) -> set[int]:
        """Every process that a record of the state file names."""
        return {int(p[0]) for rec in self.records().values() for p in rec.get("pids", [])}

    @staticmethod
    def tail(log: Path, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"


def signal_all(pids: list[int], sig: int) -> None:
    """Send ``sig`` to each of ``pids`` that still lives."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def make_cgroup(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _groups(parent: Path, pids: set[int] | None) -> list[Path]:
    groups = [*sorted((p for p in parent.rglob("*") if p.is_dir()), reverse=True), parent]
    for pid in pids or ():
        for root in (V2, V1_FREEZER):
            groups += list(root.glob(f"kiwi/pid-{pid}"))
    return groups


def thaw(parent: Path, pids: set[int] | None = None) -> None:
    """Thaw every cgroup under ``parent`` (and kiwid's isolation cgroups of ``pids``)."""
    for group in _groups(parent, pids):
        for control, value in (("cgroup.freeze", "0"), ("freezer.state", "THAWED")):
            with contextlib.suppress(OSError):
                (group / control).write_text(value)


def thaw_and_remove(parent: Path, pids: set[int] | None = None) -> list[str]:
    """Thaw every cgroup under ``parent`` (and kiwid's isolation cgroups of ``pids``).

    Kills what is left in them, then removes them, deepest first. Returns what
    could not be done (empty: all gone).
    """
    problems: list[str] = []
    thaw(parent, pids)
    groups = _groups(parent, pids)
    for group in groups:
        with contextlib.suppress(OSError):
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
    for group in groups:
        if not group.exists():
            continue
        ok = wait_until(lambda g=group: _rmdir(g), 5, 0.02)
        if not ok:
            problems.append(f"could not remove {group}")
    return problems


def _rmdir(group: Path) -> bool:
    try:
        group.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def sweep_leftovers() -> list[str]:
    """Thaw and remove the cgroups of an earlier run that was killed outright (SIGKILL).

    A run with a live process left in its cgroups is left alone: it may be
    another bench running now.
    """
    removed = []
    for parent in V2.glob(f"{PREFIX}*"):
        groups = [parent, *(p for p in parent.rglob("*") if p.is_dir())]
        with contextlib.suppress(OSError):
            if any((g / "cgroup.procs").read_text().strip() for g in groups):
                continue
            thaw_and_remove(parent)
            removed.append(str(parent))
    return removed


def exit_on_signals() -> dict[int, Any]:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so that every ``finally`` cleans up.

    Returns the handlers they had, for :func:`restore_signals`.
    """

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    return {sig: signal.signal(sig, _exit) for sig in (signal.SIGTERM, signal.SIGHUP)}


def restore_signals(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
