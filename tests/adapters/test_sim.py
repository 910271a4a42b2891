"""The simulated GPU backend, driven by real child processes and a real cgroup freezer."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kiwid.adapters.gpu import GpuBackendError, GpuLost, GpuProcess
from kiwid.adapters.sim.backend import GIB, SimAttachment, SimBackend
from tests.helpers import wait_for

Spawn = Callable[[list[str]], subprocess.Popen[bytes]]
BUSY = [sys.executable, "-c", "while True: pass"]
SLEEP = ["sleep", "60"]
WINDOW_S = 0.05


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    children: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str]) -> subprocess.Popen[bytes]:
        child = subprocess.Popen(argv)
        children.append(child)
        if argv == SLEEP:  # attach only once start-up is over and it really sleeps
            wait_for(lambda: _state(child.pid) == "S", 2, "the child to sleep")
        return child

    try:
        yield start
    finally:
        for child in children:
            child.kill()
            child.wait()


@pytest.fixture
def sim() -> Iterator[SimBackend]:
    backend = SimBackend(devices=2, memory_bytes=4 * GIB)
    try:
        yield backend
    finally:
        backend.close()


def _mount_point(fstype: str, option: str | None = None) -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        kind, _, options = right.split(" ", 2)
        if kind == fstype and (option is None or option in options.split(",")):
            return Path(left.split(" ")[4])
    return None


class Freezer:
    """A real child cgroup with the v2 (cgroup.freeze) or v1 (freezer.state) freezer."""

    def __init__(self, version: str) -> None:
        self.version = version
        root = _mount_point("cgroup2") if version == "v2" else _mount_point("cgroup", "freezer")
        if root is None:
            pytest.skip(f"no cgroup {version} freezer mounted")
        self.root = root
        self.group = root / f"kiwi-test-{uuid.uuid4().hex[:8]}"

    def add(self, pid: int) -> None:
        (self.group / "cgroup.procs").write_text(str(pid))

    def freeze(self, frozen: bool) -> None:
        if self.version == "v2":
            (self.group / "cgroup.freeze").write_text("1" if frozen else "0")
            state, want = self.group / "cgroup.events", f"frozen {int(frozen)}"
        else:
            want = "FROZEN" if frozen else "THAWED"
            state = self.group / "freezer.state"
            state.write_text(want)
        wait_for(lambda: want in state.read_text().splitlines(), 2, f"{want!r} in {state}")


@pytest.fixture(params=["v2", "v1"])
def freezer(request: pytest.FixtureRequest) -> Iterator[Freezer]:
    cgroup = Freezer(request.param)
    cgroup.group.mkdir()
    try:
        yield cgroup
    finally:  # thaw, move anything left back to the root, remove
        cgroup.freeze(False)
        for pid in (cgroup.group / "cgroup.procs").read_text().split():
            (cgroup.root / "cgroup.procs").write_text(pid)
        cgroup.group.rmdir()


def test_devices_are_stable_and_deterministic() -> None:
    first, second = SimBackend(devices=2), SimBackend(devices=2)
    assert first.devices() == second.devices()
    assert [d.uuid for d in first.devices()] == ["GPU-sim-000000000000", "GPU-sim-000000000001"]
    assert {d.name for d in first.devices()} == {"Kiwi simulated GPU"}
    assert first.devices()[0].memory_total_bytes == 80 * GIB
    assert SimBackend(devices=0).devices() == []


def test_busy_process_is_active_and_sleeping_one_is_not(sim: SimBackend, spawn: Spawn) -> None:
    busy, sleeper = spawn(BUSY), spawn(SLEEP)
    sim.attach(busy.pid, 0, 2 * GIB)
    sim.attach(sleeper.pid, 0, GIB)
    seen: list[frozenset[int]] = []

    def busy_seen() -> bool:
        seen.append(sim.active_pids(0, WINDOW_S))
        return busy.pid in seen[-1]

    wait_for(busy_seen, 2)
    assert all(sleeper.pid not in active for active in seen)
    assert sim.processes(0) == sorted(
        [GpuProcess(busy.pid, 2 * GIB), GpuProcess(sleeper.pid, GIB)], key=lambda p: p.pid
    )
    assert sim.processes(1) == []
    assert sim.active_pids(1, WINDOW_S) == frozenset()


def test_forced_activity_overrides_cpu_use(sim: SimBackend, spawn: Spawn) -> None:
    busy, sleeper = spawn(BUSY), spawn(SLEEP)
    sim.attach(busy.pid, 0, GIB, activity="idle")
    sim.attach(sleeper.pid, 0, GIB, activity="active")
    assert sim.active_pids(0, WINDOW_S) == {sleeper.pid}
    sim.set_activity(sleeper.pid, "idle")
    sim.set_activity(busy.pid, "cpu")
    wait_for(lambda: sim.active_pids(0, WINDOW_S) == {busy.pid}, 2)
    assert {a.pid: a.activity for a in sim.attached()} == {busy.pid: "cpu", sleeper.pid: "idle"}


def test_frozen_process_shows_no_activity(sim: SimBackend, spawn: Spawn, freezer: Freezer) -> None:
    busy, forced = spawn(BUSY), spawn(SLEEP)
    for child in (busy, forced):
        freezer.add(child.pid)
    sim.attach(busy.pid, 0, GIB)
    sim.attach(forced.pid, 0, GIB, activity="active")
    wait_for(lambda: sim.active_pids(0, WINDOW_S) == {busy.pid, forced.pid}, 2)
    freezer.freeze(True)
    sim.active_pids(0, WINDOW_S)  # may still see the CPU time spent before the freeze
    wait_for(lambda: sim.active_pids(0, WINDOW_S) == frozenset(), 2)
    assert {p.pid for p in sim.processes(0)} == {busy.pid, forced.pid}  # NVML still lists them
    freezer.freeze(False)
    wait_for(lambda: sim.active_pids(0, WINDOW_S) == {busy.pid, forced.pid}, 2)


def test_dead_and_zombie_processes_vanish(sim: SimBackend, spawn: Spawn) -> None:
    reaped, zombie = spawn(SLEEP), spawn(SLEEP)
    sim.attach(reaped.pid, 0, GIB)
    sim.attach(zombie.pid, 1, GIB)
    reaped.kill()
    reaped.wait()
    zombie.kill()  # not reaped: it stays a zombie until the fixture waits for it
    wait_for(lambda: _state(zombie.pid) == "Z", 2)
    assert sim.processes(0) == []
    assert sim.processes(1) == []
    assert sim.attached() == []
    assert sim.active_pids(0, WINDOW_S) == frozenset()


def test_attach_detach_and_status(sim: SimBackend, spawn: Spawn) -> None:
    child = spawn(SLEEP)
    sim.attach(child.pid, 1, GIB, activity="idle")
    sim.attach(child.pid, 0, 2 * GIB)
    sim.attach(child.pid, 0, 3 * GIB)  # again: updates
    assert sim.attached() == [
        SimAttachment(child.pid, 0, 3 * GIB, "cpu"),
        SimAttachment(child.pid, 1, GIB, "idle"),
    ]
    assert sim.detach(child.pid) is True
    assert sim.detach(child.pid) is False
    assert sim.attached() == []
    with pytest.raises(ValueError, match="not attached"):
        sim.set_activity(child.pid, "cpu")


@pytest.mark.parametrize(
    ("pid", "index", "memory", "activity", "message"),
    [
        (None, 2, GIB, "cpu", "no simulated GPU"),
        (None, -1, GIB, "cpu", "no simulated GPU"),
        (None, 0, -1, "cpu", "used_memory_bytes"),
        (None, 0, 1.5, "cpu", "used_memory_bytes"),
        (None, 0, GIB, "busy", "activity"),
        (0, 0, GIB, "cpu", "no running process"),
        (-5, 0, GIB, "cpu", "no running process"),
        (2**22 + 1, 0, GIB, "cpu", "no running process"),
    ],
)
def test_bad_attach_raises_value_error(
    sim: SimBackend,
    spawn: Spawn,
    pid: int | None,
    index: int,
    memory: int,
    activity: str,
    message: str,
) -> None:
    real = spawn(SLEEP).pid if pid is None else pid
    with pytest.raises(ValueError, match=message):
        sim.attach(real, index, memory, activity)
    assert sim.attached() == []


def test_bad_arguments_elsewhere(sim: SimBackend) -> None:
    with pytest.raises(ValueError, match="activity"):
        sim.set_activity(os.getpid(), "sometimes")
    with pytest.raises(ValueError, match="negative"):
        SimBackend(devices=-1)
    with pytest.raises(GpuBackendError, match="no simulated GPU"):
        sim.processes(7)
    with pytest.raises(GpuBackendError, match="no simulated GPU"):
        sim.active_pids(7, WINDOW_S)


def test_lost_gpu_raises_and_leaves_the_list(sim: SimBackend) -> None:
    sim.lose(1)
    assert [d.index for d in sim.devices()] == [0]
    with pytest.raises(GpuLost) as caught:
        sim.processes(1)
    assert caught.value.index == 1
    with pytest.raises(GpuLost):
        sim.active_pids(1, WINDOW_S)
    assert sim.processes(0) == []
    with pytest.raises(ValueError, match="no simulated GPU"):
        sim.lose(5)


def test_attachments_leave_descriptors_for_everything_else(spawn: Spawn) -> None:
    # Two descriptors per attachment once took every one kiwid had (~500 tenants at
    # Debian's stock 1024), and it could accept no kiwictl connection any more. In
    # a child whose soft limit is 256, 200 attachments (one sleeper on 200 GPUs).
    sleeper = spawn(SLEEP)
    code = (
        "import os, resource, sys\n"
        "from kiwid.adapters.sim.backend import GIB, SimBackend\n"
        "_soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "pid, count = int(sys.argv[1]), 200\n"
        "sim = SimBackend(devices=count, memory_bytes=4 * GIB)\n"
        "for index in range(count):\n"
        "    sim.attach(pid, index, GIB)\n"
        "listed = sum(pid in {p.pid for p in sim.processes(i)} for i in range(count))\n"
        "free = []\n"
        "try:\n"
        "    while len(free) < 256:\n"
        "        free.append(os.open('/dev/null', os.O_RDONLY))\n"
        "except OSError:\n"
        "    pass\n"
        "sim.close()\n"
        "print(listed, len(free))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(sleeper.pid)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    listed, free = map(int, done.stdout.split())
    assert listed == 200, "every attachment is followed, held descriptor or not"
    assert free >= 100, f"only {free} of 256 descriptors left for anything else"
