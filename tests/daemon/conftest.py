"""Fixtures that run a real kiwid (sim backend) with real tenant processes.

``wait_for`` is re-exported from :mod:`tests.helpers` for the daemon tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kiwid.adapters.control import ControlError, DaemonUnreachable, request
from tests.helpers import wait_for
from tests.stand_ins.cudadouble import CudaTenant, DriverDouble

REPO = Path(__file__).resolve().parents[2]
KIWID = [sys.executable, "-m", "kiwid"]
KIWICTL = [sys.executable, "-m", "kiwid.cli.kiwictl"]
V2_ROOT = (
    Path("/sys/fs/cgroup/unified")
    if Path("/sys/fs/cgroup/unified/cgroup.procs").exists()
    else Path("/sys/fs/cgroup")
)
V1_FREEZER = Path("/sys/fs/cgroup/freezer")

BASE_CONFIG = """\
[scheduler]
tq = {tq}
idle_release = {idle_release}
[gpu]
backend = "sim"
poll_interval = {poll}
[gpu.sim]
devices = {devices}
[control]
socket = "{socket}"
[daemon]
state_dir = "{state}"
shutdown_timeout = 5
[kubernetes]
cdi_dir = "{cdi}"
"""


@dataclass
class Kiwid:
    """A running kiwid subprocess and its files."""

    dir: Path
    config: Path
    socket: Path
    log: Path
    proc: subprocess.Popen[bytes]
    extra: dict[str, Any] = field(default_factory=dict)

    def call(self, cmd: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        return request(self.socket, cmd, args)

    def answers(self) -> bool:
        """Whether it serves its control socket yet (it re-adopts before it does)."""
        if self.proc.poll() is not None:
            pytest.fail(f"kiwid exited with {self.proc.returncode}:\n{self.log_text()}")
        try:
            self.call("ping")
        except (DaemonUnreachable, ControlError):
            return False
        return True

    def wait_answering(self, timeout: float = 10) -> None:
        """Wait until it serves its control socket."""
        wait_for(self.answers, timeout, "kiwid to answer on its socket")

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_log(self, text: str, timeout: float = 5.0) -> None:
        try:
            wait_for(lambda: text in self.log_text(), timeout, f"{text!r} in kiwid's log")
        except pytest.fail.Exception as failed:  # what it logged instead tells why
            pytest.fail(f"{failed}; it logged:\n{self.log_text()}")

    def ctl(self, *args: str, user: int | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*KIWICTL, "--socket", str(self.socket), *args],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )

    def write_config(self, text: str) -> None:
        """Save like Ansible's template module and editors: temp file, then rename."""
        tmp = self.config.with_name(f".{self.config.name}.{uuid.uuid4().hex}")
        tmp.write_text(text)
        os.replace(tmp, self.config)

    def attach(self, pid: int, gpu: int = 0, memory: int = 2**30, activity: str = "cpu") -> None:
        self.call(
            "sim-attach", {"pid": pid, "gpu": gpu, "memory_bytes": memory, "activity": activity}
        )

    def tenant(self, key: str) -> dict[str, Any]:
        """One tenant as ``tenants`` lists it (empty: kiwid does not know it, yet)."""
        return next((t for t in self.call("tenants")["tenants"] if t["id"] == key), {})

    def until(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """``wait_for``, with the end of kiwid's log in the failure (what it did instead)."""
        try:
            return wait_for(predicate, timeout, what)
        except BaseException:
            print(self.log_text()[-6000:])
            raise

    def tenant_states(self) -> dict[str, str]:
        return {t["id"]: t["state"] for t in self.call("tenants")["tenants"]}

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=20)


def config_text(d: Path, **kw: Any) -> str:
    values = {"tq": 30, "idle_release": 5, "poll": 0.1, "devices": 1, **kw}
    return BASE_CONFIG.format(socket=d / "kiwid.sock", state=d / "state", cdi=d / "cdi", **values)


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A directory any user can traverse (pytest's tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="kiwi-test-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start_kiwid(workdir: Path) -> Iterator[Callable[..., Kiwid]]:
    """Start kiwid with a sim config; always stopped (and ``recover`` run) afterwards."""
    started: list[Kiwid] = []

    def start(env: dict[str, str] | None = None, wait_ready: bool = True, **kw: Any) -> Kiwid:
        config = workdir / "kiwi.toml"
        if not config.exists():
            config.write_text(config_text(workdir, **kw))
        log = workdir / f"kiwid-{len(started)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*KIWID, "--config", str(config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                cwd=REPO,
            )
        k = Kiwid(workdir, config, workdir / "kiwid.sock", log, proc)
        started.append(k)
        if wait_ready:
            k.wait_answering()
        return k

    yield start
    for k in started:
        with contextlib.suppress(subprocess.TimeoutExpired):
            k.stop()
        if k.proc.poll() is None:
            k.proc.kill()
            k.proc.wait()
    subprocess.run(
        [*KIWID, "recover", "--state-dir", str(workdir / "state")],
        check=False,
        capture_output=True,
        timeout=60,
    )


@dataclass
class Tenant:
    """A real process in a cgroup of its own (a stand-in for a container)."""

    name: str
    proc: subprocess.Popen[bytes]
    v2: Path
    v1: Path | None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def key(self) -> str:
        return f"cgroup:/{self.v2.relative_to(V2_ROOT)}"

    def frozen(self) -> bool:
        return "frozen 1" in (self.v2 / "cgroup.events").read_text()

    def cpu_ticks(self) -> int:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])


@pytest.fixture
def tenants() -> Iterator[Callable[..., Tenant]]:
    """Spawn busy or sleeping processes, each in its own v2 cgroup (and v1 freezer).

    Always thawed, killed and removed afterwards, whatever happened.
    """
    parent = f"kiwi-test-{uuid.uuid4().hex[:8]}"
    made: list[Tenant] = []

    def spawn(
        name: str,
        busy: bool = True,
        v2: bool = True,
        *,
        workload: str | None = None,
        maps: Path | None = None,
        work: str | None = None,
    ) -> Tenant:
        """A tenant; with ``v2=False`` it stays in our cgroup2 and has only a v1 freezer one.

        Its command line is the same for every tenant of one ``workload`` (default:
        its name), as a job's is when it runs again; ``maps``: a file it maps;
        ``work``: Python code it runs once started instead of a busy or sleeping loop
        (with ``busy=False``, it is started once it sleeps, e.g. in ``accept``).
        """
        in_v2 = v2
        v2 = V2_ROOT / parent / name
        v2.mkdir(parents=True)
        v1 = V1_FREEZER / parent / name if V1_FREEZER.exists() else None
        if v1 is not None:
            v1.mkdir(parents=True)
        # The child waits on a pipe until it is in its cgroups, and a sleeper
        # says when its start-up (CPU work the sim would see) is over.
        go_r, go_w = os.pipe()
        ready_r, ready_w = os.pipe()
        work = work or ("while True: pass" if busy else "import time\ntime.sleep(3600)")
        mapping = (
            "import mmap, sys\nf = open(os.environ['KIWI_TEST_MAP'], 'r+b')\n"
            "m = mmap.mmap(f.fileno(), 0)\n"
            if maps is not None
            else ""
        )
        code = (
            "import os\nos.read(int(os.environ['KIWI_TEST_GO']), 1)\n"
            f"{mapping}os.write(int(os.environ['KIWI_TEST_READY']), b'r')\n{work}"
        )
        env = {**os.environ, "KIWI_TEST_GO": str(go_r), "KIWI_TEST_READY": str(ready_w)}
        if maps is not None:
            env["KIWI_TEST_MAP"] = str(maps)
        proc = subprocess.Popen(
            [sys.executable, "-c", code, workload or name], pass_fds=(go_r, ready_w), env=env
        )
        os.close(go_r)
        os.close(ready_w)
        if in_v2:
            (v2 / "cgroup.procs").write_text(str(proc.pid))
        if v1 is not None:
            (v1 / "cgroup.procs").write_text(str(proc.pid))
        os.write(go_w, b"x")
        os.close(go_w)
        os.read(ready_r, 1)
        os.close(ready_r)
        if not busy:
            wait_for(lambda: _stat_state(proc.pid) == "S", 5, "the sleeper to sleep")
        t = Tenant(name, proc, v2, v1)
        made.append(t)
        return t

    yield spawn
    for t in made:
        with contextlib.suppress(OSError):
            (t.v2 / "cgroup.freeze").write_text("0")
        if t.v1 is not None:
            with contextlib.suppress(OSError):
                (t.v1 / "freezer.state").write_text("THAWED")
        t.proc.kill()
        t.proc.wait()
    for root in (V2_ROOT, V1_FREEZER):
        base = root / parent
        if base.exists():
            for child in sorted(base.iterdir(), reverse=True):
                if child.is_dir():
                    with contextlib.suppress(OSError):
                        child.rmdir()
            with contextlib.suppress(OSError):
                base.rmdir()


def _stat_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def notify_socket(workdir: Path) -> Iterator[tuple[str, socket.socket]]:
    """A bound datagram socket standing in for systemd's NOTIFY_SOCKET."""
    path = workdir / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(10)
    yield str(path), sock
    sock.close()


def next_message(sock: socket.socket) -> dict[str, str]:
    data = sock.recv(65536).decode()
    return dict(line.split("=", 1) for line in data.splitlines() if "=" in line)


def status_json(k: Kiwid) -> dict[str, Any]:
    out = k.ctl("status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# ---- the driver double: kiwid's real GPU path on a card of its own ----------------

DOUBLE_CAPACITY = 4 * 2**30
DOUBLE_FOREIGN = 3 * 2**30 // 2  # three 1 GiB tenants and it do not fit (4.5 > 4)


@dataclass
class Card:
    """The double's card and the cgroups its tenants run in."""

    double: DriverDouble
    parent: Path

    def arrive(self, name: str, memory: int = 2**30, **kw) -> CudaTenant:
        """Start a tenant in cgroup ``name`` once the card has room for it.

        A job that starts on a full card fails to allocate (the double says out
        of memory), as it would on a real one: it is started again.
        """
        cgroup = self.parent / name
        cgroup.mkdir(exist_ok=True)

        def started() -> CudaTenant | None:
            try:
                return self.double.spawn_tenant(memory, cgroup=cgroup, **kw)
            except RuntimeError:
                return None

        return wait_for(started, 15, f"{name} to find room on the card")

    def key(self, tenant: CudaTenant) -> str:
        assert tenant.cgroup is not None
        return f"cgroup:/{tenant.cgroup.relative_to(V2_ROOT)}"


@pytest.fixture
def card(workdir: Path, cuda_library: Path) -> Iterator[Card]:
    """A 4 GiB card with 1.5 GiB taken by another job; swaps at 2 GB/s out, 4 in.

    On the stand-in libcuda built once per session (``cuda_library``, which skips
    without a C compiler).
    """
    double = DriverDouble(
        workdir / "cuda",
        DOUBLE_CAPACITY,
        foreign_bytes=DOUBLE_FOREIGN,
        checkpoint_bytes_per_s=2 * 2**30,
        restore_bytes_per_s=4 * 2**30,
        library=cuda_library,
    )
    parent = V2_ROOT / f"kiwi-test-{uuid.uuid4().hex[:8]}"
    parent.mkdir()
    try:
        yield Card(double, parent)
    finally:
        double.close()
        for cgroup in [*parent.iterdir(), parent]:
            if cgroup.is_dir():
                with contextlib.suppress(OSError):
                    cgroup.rmdir()
