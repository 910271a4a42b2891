"""Shared fixtures for adapter tests: real cgroups and real child processes.

``double`` is a fresh card of the driver double (``tests/stand_ins/cudadouble.py``)
on the stand-in libcuda, built once per session (``cuda_library``, in
tests/conftest.py); it ends the tenants it started.

``sandbox`` gives each test a private top cgroup ``/kiwi-test-<random>`` in the
cgroup2 hierarchy and in the v1 freezer hierarchy (where mounted), and spawns
child processes. Whatever happens in the test, teardown thaws every cgroup under
the top one, kills and reaps every child, and removes the cgroups bottom-up.

``lab`` starts programs holding real sockets for the sock_diag tests
(``socket_lab.py``) and kills them after the test, whatever happened.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import tests.conftest
from kiwid.adapters.cgroups import CgroupLayout, CgroupRef
from tests.adapters.socket_lab import Lab
from tests.helpers import wait_for
from tests.stand_ins import cudadir
from tests.stand_ins.cudadouble import DriverDouble

# The session's stand-in libcuda (tests/conftest.py), also for the daemon tests that
# import it from here.
cuda_library = tests.conftest.cuda_library
BUSY = [sys.executable, "-c", "while True: pass"]
SLEEP = ["sleep", "300"]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 2.0, what: str = "") -> None:
    """Poll real state until ``predicate`` holds; fail the test at the deadline."""
    wait_for(predicate, timeout_s, what or str(predicate), max_delay=0.02)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` from /proc/PID/stat, in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Sandbox:
    """A test's private cgroups and children."""

    def __init__(self, layout: CgroupLayout) -> None:
        self.layout = layout
        self.top = f"/kiwi-test-{secrets.token_hex(4)}"
        self.children: list[subprocess.Popen[bytes]] = []

    @property
    def parent(self) -> str:
        """The top cgroup without the leading slash (for ``isolate_process``)."""
        return self.top.lstrip("/")

    def roots(self) -> list[Path]:
        return [r for r in (self.layout.v2_root, self.layout.v1_freezer_root) if r is not None]

    def cgroup(self, name: str, *, v2: bool = True, v1: bool = True) -> CgroupRef:
        """Create ``<top>/<name>`` in the chosen hierarchies and return its ref."""
        path = f"{self.top}/{name}"
        ref = CgroupRef(
            v2=path if v2 and self.layout.v2_root else None,
            v1_freezer=path if v1 and self.layout.v1_freezer_root else None,
        )
        for directory in self.layout.dirs(ref):
            if directory is not None:
                directory.mkdir(parents=True)
        return ref

    def spawn(self, argv: list[str] | None = None, **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start a child (a sleeper by default) that teardown will kill."""
        child: subprocess.Popen[bytes] = subprocess.Popen(argv or SLEEP, **kwargs)
        self.children.append(child)
        return child

    def move(self, pid: int, ref: CgroupRef) -> None:
        """Move a process into ``ref`` in each of its hierarchies."""
        for directory in self.layout.dirs(ref):
            if directory is not None:
                (directory / "cgroup.procs").write_text(str(pid))

    def teardown(self) -> None:
        trees = [root / self.parent for root in self.roots() if (root / self.parent).is_dir()]
        dirs = [d for tree in trees for d in sorted(tree.glob("**/"), reverse=True)]
        for directory in dirs:  # thaw first: a v1-frozen child cannot die
            for name, value in (("cgroup.freeze", "0"), ("freezer.state", "THAWED")):
                if (directory / name).exists():
                    (directory / name).write_text(value)
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGKILL)
            child.wait(timeout=5)
        for directory in dirs:  # deepest first; an exiting process may linger briefly
            wait_until(lambda d=directory: _rmdir(d), what=f"rmdir {directory}")


def _rmdir(directory: Path) -> bool:
    try:
        directory.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


@pytest.fixture(scope="session")
def layout() -> CgroupLayout:
    found = CgroupLayout.detect()
    if os.geteuid() != 0 or found.v2_root is None:
        pytest.skip("needs root and a cgroup2 hierarchy")
    return found


@pytest.fixture
def sandbox(layout: CgroupLayout) -> Iterator[Sandbox]:
    box = Sandbox(layout)
    try:
        yield box
    finally:
        box.teardown()


@pytest.fixture
def double(
    tmp_path: Path, cuda_library: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[DriverDouble]:
    """A 10 GiB card of the driver double, instant swaps; this process sees it too."""
    card = DriverDouble(tmp_path / "cuda", 10 * 2**30, library=cuda_library)
    monkeypatch.setenv(cudadir.ENVIRONMENT, str(card.directory))
    try:
        yield card
    finally:
        card.close()


@pytest.fixture
def lab() -> Iterator[Lab]:
    """Programs with sockets and client sockets (socket_lab.py), all ended after the test."""
    box = Lab()
    try:
        yield box
    finally:
        box.close()
