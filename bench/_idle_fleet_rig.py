"""One configuration of bench/idle_fleet.py: kiwid, a trainer and N HTTP servers, recorded.

:class:`Fleet` starts a real kiwid on a scratch directory (``memory.swap =
"checkpoint"``, ``memory.park`` as asked), a trainer (4 GiB, always at GPU work)
and N servers (``_idle_fleet_server.py``, 3 GiB each), each a real process in a
cgroup of its own, on a card that holds the trainer and only a few servers.
``[[tenants]]`` rules give the servers priority 1 and the trainer 0, and declare
their memory. Then it records for ``seconds``: kiwid's status every 0.2 s, its log
lines (stamped when read) and the requests of its client, which asks server s1
every ``period`` seconds; the others are never asked.

* ``sim``: the simulated GPU (``[gpu.sim]``, the cgroup freezer as root). The
  servers are attached with ``activity = "cpu"`` (a request's CPU work is GPU
  work), the trainer (a sleeping process) with ``"active"``: always at GPU work
  unless frozen, and no CPU taken from kiwid. The servers come first, idle; the
  trainer's first turn then makes its room.
* ``double``: kiwid's NVML path on the driver double of ``tests/stand_ins``
  (``backend = "nvml"``, ``gate = "cuda-lock"``), whose checkpoint and restore take
  size / rate. Its tenants make their CUDA context at start, which the double
  refuses when the card is full: they start on a card the size of all of them,
  which then shrinks to the card asked for before kiwid starts (as if they had
  loaded while the card was free); the trainer's first turn makes its room.

Everything is undone on the way out, also on Ctrl-C: kiwid stopped (it ungates
everyone), ``kiwid recover`` run on its state, every process killed, every cgroup
thawed and removed.

Not a benchmark itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from _faults_rig import GIB, ROOT, V1_FREEZER, V2, Daemon, thaw_and_remove, wait_until
from _idle_fleet_report import Request, Sample

if str(ROOT) not in sys.path:  # the driver double lives with the tests
    sys.path.insert(0, str(ROOT))

from kiwid.config.schema import MemorySettings
from tests.stand_ins.cudadouble import CudaTenant, DriverDouble

SERVER = Path(__file__).resolve().with_name("_idle_fleet_server.py")
PREFIX = "kiwi-if-"
SAMPLE_S = 0.2
PARK_KEY = "park" in {f.name for f in dataclasses.fields(MemorySettings)}
"""Whether this kiwid knows ``memory.park`` (without it, it is left out of the config)."""


@dataclasses.dataclass(frozen=True)
class Options:
    """One configuration: the card, the fleet, kiwid's settings and the run's length."""

    backend: str = "sim"
    servers: int = 4
    park: str = "idle"
    seconds: float = 120.0
    period: float = 20.0
    first_after: float = 10.0
    tq: float = 30.0
    idle_release: float = 5.0
    poll: float = 0.5
    work: float = 0.3
    trainer_gib: float = 4.0
    server_gib: float = 3.0
    card_gib: float = 10.0
    out_gbps: float = 2.2
    in_gbps: float = 6.0
    reserve_mib: int = 1024
    settle: float = 30.0

    def config(self, d: Path) -> str:
        """kiwid's config for this configuration, its files under ``d``."""
        sim = self.backend == "sim"
        text = f"[scheduler]\ntq = {self.tq}\nidle_release = {self.idle_release}\n"
        text += f'[gpu]\nbackend = "{"sim" if sim else "nvml"}"\npoll_interval = {self.poll}\n'
        if sim:
            text += f"[gpu.sim]\ndevices = 1\nmemory_gib = {self.card_gib}\n"
            text += f"swap_out_gbps = {self.out_gbps}\nswap_in_gbps = {self.in_gbps}\n"
        else:
            text += 'gate = "cuda-lock"\n'
        text += f'[memory]\nswap = "checkpoint"\nreserve_mib = {self.reserve_mib}\n'
        text += "host_floor_mib = 0\n" + (f'park = "{self.park}"\n' if PARK_KEY else "")
        text += f'[control]\nsocket = "{d}/kiwid.sock"\n'
        text += f'[daemon]\nstate_dir = "{d}/state"\nshutdown_timeout = 60\n'
        text += '[kubernetes]\ncdi_dir = ""\n'
        text += '\n[[tenants]]\nmatch = { cgroup = "*/trainer" }\npriority = 0\n'
        text += f"memory = {int(self.trainer_gib * GIB)}\n"
        text += '\n[[tenants]]\nmatch = { cgroup = "*/s[0-9]*" }\npriority = 1\n'
        text += f"memory = {int(self.server_gib * GIB)}\n"
        return text


@dataclasses.dataclass
class Server:
    """One HTTP server: its name, process, port and cgroup."""

    name: str
    proc: subprocess.Popen[str]
    port: int
    cgroup: Path

    @property
    def key(self) -> str:
        return f"cgroup:/{self.cgroup.relative_to(V2)}"


class Fleet:
    """One configuration, from start to clean-up (a context manager)."""

    def __init__(self, opts: Options, d: Path) -> None:
        self.opts = opts
        self.d = d
        self.tag = uuid.uuid4().hex[:8]
        self.parent = V2 / f"{PREFIX}{self.tag}"
        self.freezer = V1_FREEZER / f"{PREFIX}{self.tag}" if V1_FREEZER.exists() else None
        self.double: DriverDouble | None = None
        self.daemon = Daemon(d)
        self.servers: list[Server] = []
        self.trainer_proc: subprocess.Popen[bytes] | CudaTenant | None = None
        self.samples: list[Sample] = []
        self.lines: list[tuple[float, str]] = []
        self.requests: list[Request] = []
        self.last_status: dict[str, Any] | None = None
        self.warmup: float | None = None
        self.cleaned: list[str] | None = None
        """What the clean-up could not undo (``None``: not cleaned up yet)."""
        self.settled = False
        self.start_t = self.end_t = 0.0
        self._log_at = 0
        self._halt = threading.Event()

    @property
    def trainer_key(self) -> str:
        return f"cgroup:/{(self.parent / 'trainer').relative_to(V2)}"

    # ------------------------------------------------------------ set-up

    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def _groups(self, name: str) -> list[Path]:
        groups = [self.parent / name]
        if self.freezer is not None and self.opts.backend == "sim":
            groups.append(self.freezer / name)
        for group in groups:
            group.mkdir(parents=True, exist_ok=True)
        return groups

    def start(self) -> None:
        """kiwid and the fleet, until the trainer runs (or ``settle`` seconds pass)."""
        o = self.opts
        self.daemon.write_config(o.config(self.d))
        if o.backend == "sim":
            self.daemon.start()
            for i in range(1, o.servers + 1):
                server = self._spawn_server(f"s{i}", {})
                memory = int(o.server_gib * GIB)
                self._attach(server.proc.pid, memory, "cpu")
            sleeper = subprocess.Popen(
                ["sleep", "86400"], stdin=subprocess.DEVNULL, start_new_session=True
            )
            self.trainer_proc = sleeper
            for group in self._groups("trainer"):
                (group / "cgroup.procs").write_text(str(sleeper.pid))
            self._attach(sleeper.pid, int(o.trainer_gib * GIB), "active")
        else:
            everyone = int((o.trainer_gib + o.servers * o.server_gib) * GIB) + GIB
            self.double = DriverDouble(
                self.d / "cuda",
                everyone,
                checkpoint_bytes_per_s=int(o.out_gbps * 1e9),
                restore_bytes_per_s=int(o.in_gbps * 1e9),
            )
            self.daemon.env = self.double.env()
            for i in range(1, o.servers + 1):
                self._spawn_server(f"s{i}", self.double.env())
            self.trainer_proc = self.double.spawn_tenant(
                int(o.trainer_gib * GIB), cgroup=self._groups("trainer")[0]
            )
            self.double.configure(capacity=int(o.card_gib * GIB))
            self.daemon.start(ready="Gate: the CUDA driver's process lock", timeout=30)
        runs = wait_until(self._trainer_runs, o.settle, 0.2)
        # s2 warms up (one request): the trainer's next turn makes its room, and s1, which
        # never ran, is the first to go (least recently run): the window's first request
        # finds it parked.
        with contextlib.suppress(OSError):  # with park "off" it may wait behind every server
            self.warmup = _get(self.servers[min(1, len(self.servers) - 1)].port, o.settle)
        self.settled = bool(runs and wait_until(self._trainer_runs, o.settle, 0.2))

    def _attach(self, pid: int, memory: int, activity: str) -> None:
        args = {"pid": pid, "gpu": 0, "memory_bytes": memory, "activity": activity}
        self.daemon.call("sim-attach", args)

    def _spawn_server(self, name: str, env: dict[str, str]) -> Server:
        o = self.opts
        argv = [sys.executable, str(SERVER), "--card", o.backend, "--work", str(o.work)]
        argv += ["--memory", str(int(o.server_gib * GIB))]
        for group in self._groups(name):
            argv += ["--cgroup", str(group)]
        with open(self.d / f"{name}.log", "wb") as errors:  # a reset connection's traceback
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
                env={**os.environ, **env},
                start_new_session=True,  # a Ctrl-C in the terminal reaches only the bench
            )
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 15)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("ready "):
            proc.kill()
            raise RuntimeError(f"server {name} did not start (exit code {proc.poll()})")
        server = Server(name, proc, int(line.split()[1]), self.parent / name)
        self.servers.append(server)
        # Blocked in accept, its start-up over: no CPU time the sim would take for GPU work.
        wait_until(lambda: _proc_state(proc.pid) == "S", 5, 0.02)
        time.sleep(0.2)
        return server

    def _trainer_runs(self) -> bool:
        status = self.daemon.status(5)
        if status is None:
            return False
        return any(
            t["id"] == self.trainer_key and t["state"] == "holder" and not t["gated"]
            for t in status["gpus"][0]["tenants"]
        )

    # ------------------------------------------------------------ the run

    def run(self) -> None:
        """Record for ``seconds``: the sampler and the client, side by side."""
        self.start_t = time.monotonic()
        self._read_log()  # the set-up's lines are stamped before the window
        self.lines = [(self.start_t - 1e-3, text) for _, text in self.lines]
        sampler = threading.Thread(target=self._sample_loop, daemon=True)
        client = threading.Thread(target=self._client_loop, daemon=True)
        sampler.start()
        client.start()
        try:
            while time.monotonic() - self.start_t < self.opts.seconds:
                time.sleep(0.2)
                if not self.daemon.alive():
                    raise RuntimeError(f"kiwid exited: {self.daemon.tail(self.daemon.logs[-1])}")
        finally:
            self._halt.set()
            client.join(130)
            sampler.join(10)
            self.end_t = time.monotonic()
            self._read_log()
            self.last_status = self.daemon.status(5)

    def _sample_loop(self) -> None:
        while not self._halt.is_set():
            status = self.daemon.status(2)
            now = time.monotonic()
            if status is not None:
                gpu = status["gpus"][0]
                entries = gpu["tenants"]
                holder = gpu["holder"]["tenant"] if gpu["holder"] else None
                runs = any(
                    t["id"] == self.trainer_key and t["state"] == "holder" and not t["gated"]
                    for t in entries
                )
                states = {t["id"]: t["state"] for t in entries}
                resident = int(gpu.get("memory_resident_bytes") or 0)
                self.samples.append(Sample(now, holder, runs, states, resident))
                self.last_status = status
            self._read_log()
            self._halt.wait(SAMPLE_S)

    def _read_log(self) -> None:
        """Stamp kiwid's new log lines with the time they were read."""
        log = self.daemon.logs[-1]
        with contextlib.suppress(OSError), open(log, "rb") as f:
            f.seek(self._log_at)
            data = f.read()
            end = data.rfind(b"\n") + 1  # a line half-written is read next time
            self._log_at += end
            now = time.monotonic()
            for line in data[:end].decode(errors="replace").splitlines():
                self.lines.append((now, line))

    def _client_loop(self) -> None:
        target = self.servers[0]
        due = self.start_t + self.opts.first_after
        while not self._halt.wait(max(0.0, due - time.monotonic())):
            last = self.samples[-1] if self.samples else None
            state = last.states.get(target.key) if last else None
            resident = last.resident_bytes if last else 0
            sent = time.monotonic()
            latency, error = None, ""
            try:
                latency = _get(target.port)
            except OSError as err:
                error = str(err)
            self.requests.append(Request(sent, latency, state, resident, error))
            due += self.opts.period
            if due > self.start_t + self.opts.seconds:
                break

    # ------------------------------------------------------------ clean-up

    def cleanup(self) -> list[str]:
        """Stop kiwid, recover, kill every process, thaw and remove every cgroup (once).

        ``kiwid recover`` runs twice: while the tenants live (on a card that does not
        hold them all it keeps the rest swapped and exits 1, as documented), and once
        they are killed, when it must let go of every record (exit 0).
        """
        if self.cleaned is not None:
            return self.cleaned
        problems: list[str] = []
        self._halt.set()
        self.daemon.stop(60)
        first = self._recover()
        if first is not None and first[0] != 0 and "Kept swapped" not in first[1]:
            problems.append(f"kiwid recover exited {first[0]}: {first[1]}")
        pids = {s.proc.pid for s in self.servers}
        trainer = self.trainer_proc
        if isinstance(trainer, subprocess.Popen):
            pids.add(trainer.pid)
        for parent in (self.parent, self.freezer):
            if parent is not None and parent.exists():
                problems += thaw_and_remove(parent, pids)
        for server in self.servers:
            with contextlib.suppress(OSError):
                server.proc.kill()
            server.proc.wait()
            if server.proc.stdout is not None:
                server.proc.stdout.close()
        if isinstance(trainer, subprocess.Popen):
            with contextlib.suppress(OSError):
                trainer.kill()
            trainer.wait()
        last = self._recover()
        if last is not None and last[0] != 0:
            problems.append(f"kiwid recover after the kill exited {last[0]}: {last[1]}")
        if self.double is not None:
            self.double.close()
        self.cleaned = problems
        return problems

    def _recover(self) -> tuple[int, str] | None:
        """``kiwid recover``'s exit code and its last lines, or None without a state dir."""
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if self.daemon.state_dir.exists():
                out = self.daemon.recover()
                said = (out.stdout + out.stderr).strip().splitlines()[-3:]
                return out.returncode, " | ".join(said)
        return None


def _get(port: int, timeout: float = 120) -> float:
    """One request to a server; the seconds until its whole answer was read."""
    sent = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=timeout) as answer:
        answer.read()
    return time.monotonic() - sent


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def sweep_leftovers() -> list[str]:
    """Thaw and remove the empty cgroups of an earlier run that was killed outright."""
    removed = []
    for root in (V2, V1_FREEZER):
        for parent in root.glob(f"{PREFIX}*"):
            groups = [parent, *(p for p in parent.rglob("*") if p.is_dir())]
            with contextlib.suppress(OSError):
                if any((g / "cgroup.procs").read_text().strip() for g in groups):
                    continue  # a live process: maybe another run now
                thaw_and_remove(parent)
                removed.append(str(parent))
    return removed
