"""GPU benchmark: does kiwid really give each tenant the GPU alone, and at what cost?

Run as root on a machine with an NVIDIA GPU, with the system ``python3`` (it needs
torch and nvidia-ml-py; kiwid needs psutil, sdnotify and watchdog)::

    python3 bench/gpu/enforcement.py             # < 5 minutes on an H200
    python3 bench/gpu/enforcement.py --dry-run   # no GPU: checks and plan only
    python3 bench/gpu/enforcement.py --rehearse --seconds 2   # no GPU: whole flow, fakes

Each worker (``worker.py``: 8192x8192 bf16 matmuls, one sync per iteration) runs in
a cgroup of its own, made by this script, and logs its progress with
CLOCK_MONOTONIC. Phases, each a short measured window after a warm-up:

1. ``solo``: one worker alone (it/s).
2. ``co-run``: 2, then 3 workers at once without kiwid (driver time-slicing).
3. Under kiwid (``python3 -m kiwid --config CFG``), for gate ``freeze`` and
   ``cuda-lock`` and TQ 1 and 5 s: 2 workers (and 3 at TQ 1).

Measured per scenario: each worker's it/s and the sum; the longest co-run, i.e. the
longest stretch when two workers used the GPU at once, from NVML per-process
samples taken here every 50 ms (resolution: one NVML sample period) and, in
parentheses, from the workers' own progress logs (resolution: one iteration); the
hand-over latency, from the last iteration a worker completed before it stalled to
the first iteration the next worker completed after it resumed (p50/p99).

Everything is undone at the end, also on errors, Ctrl-C or SIGTERM: kiwid is
stopped and ``kiwid recover`` run, workers are thawed and killed, cgroups removed.
Results: a table on stdout, ``results.json``, kiwid logs and progress files in the
output folder (``$OUT/kiwi-enforcement`` when ``$OUT`` is set).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import importlib.util
import itertools
import json
import math
import os
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORKER = HERE / "worker.py"
WORK = Path("/tmp/kiwi-bench")
SOCK = WORK / "kiwid.sock"
STATE = WORK / "state"
CG_PREFIX = "kiwigpu-bench-"
KIWID_DEPS = ("psutil", "sdnotify", "watchdog", "prometheus_client")
GATES = ("freeze", "cuda-lock")
GAP_S = 0.05  # an iteration slower than this is a stall (gated); iterations take ~2-6 ms
NVML_PERIOD_S = 0.05
NVML_LOOKBACK_US = 500_000
HANDOVER_TOLERANCE_S = 0.5
DEPS_DIR = HERE / "_deps"  # kiwid's own dependencies, copied by --vendor-deps (git-ignored)
EXTRA_PATHS: list[str] = []  # put on sys.path here and on kiwid's PYTHONPATH
T0 = time.monotonic()

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # kiwid.adapters.control, for a status snapshot


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:6.1f}s] {message}", flush=True)


class BenchError(Exception):
    """A scenario or a check could not be carried out."""


# --------------------------------------------------------------------- cgroups


@dataclass(frozen=True)
class Layout:
    """Mount points of the cgroup2 hierarchy and of the v1 freezer."""

    v2: Path | None
    v1: Path | None

    @classmethod
    def detect(cls, mountinfo: Path = Path("/proc/self/mountinfo")) -> Layout:
        v2: Path | None = None
        v1: Path | None = None
        for line in mountinfo.read_text().splitlines():
            fields = line.split()
            if "-" not in fields:
                continue
            sep = fields.index("-")
            if sep < 5 or len(fields) < sep + 4:
                continue
            point = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))
            fstype, opts = fields[sep + 1], fields[sep + 3].split(",")
            if fstype == "cgroup2" and v2 is None:
                v2 = point
            elif fstype == "cgroup" and "freezer" in opts and v1 is None:
                v1 = point
        return cls(v2, v1)

    def __str__(self) -> str:
        return f"cgroup2 at {self.v2 or '-'}, v1 freezer at {self.v1 or '-'}"


class Cgroup:
    """A cgroup of our own, in cgroup2 and in the v1 freezer where they exist."""

    def __init__(self, layout: Layout, name: str) -> None:
        self.name = name
        self.v2 = layout.v2 / name if layout.v2 else None
        self.v1 = layout.v1 / name if layout.v1 else None
        if self.v2 is None and self.v1 is None:
            raise BenchError("no cgroup2 mount and no v1 freezer in /proc/self/mountinfo")

    def dirs(self) -> list[Path]:
        return [d for d in (self.v2, self.v1) if d is not None]

    def create(self) -> None:
        for directory in self.dirs():
            directory.mkdir(exist_ok=True)

    def add(self, pid: int) -> None:
        for directory in self.dirs():
            (directory / "cgroup.procs").write_text(str(pid))

    def holds(self, pid: int) -> bool:
        """Whether ``/proc/PID/cgroup`` shows the process in this cgroup."""
        want = f"/{self.name}"
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            hier, controllers, path = [*line.split(":", 2), "", ""][:3]
            v2_line = hier == "0" and controllers == ""
            if (v2_line or "freezer" in controllers.split(",")) and path == want:
                return True
        return False

    def _v2_usable(self) -> bool:
        return self.v2 is not None and (self.v2 / "cgroup.freeze").exists()

    def freeze(self) -> None:
        if self._v2_usable():
            assert self.v2 is not None
            (self.v2 / "cgroup.freeze").write_text("1")
        elif self.v1 is not None:
            (self.v1 / "freezer.state").write_text("FROZEN")

    def frozen(self) -> bool:
        if self._v2_usable():
            assert self.v2 is not None
            return "frozen 1" in (self.v2 / "cgroup.events").read_text().splitlines()
        return self.v1 is not None and (self.v1 / "freezer.state").read_text().strip() == "FROZEN"

    def thaw(self) -> None:
        """Thaw in every hierarchy (kiwid or we may have frozen either)."""
        for directory, file, value in (
            (self.v2, "cgroup.freeze", "0"),
            (self.v1, "freezer.state", "THAWED"),
        ):
            if directory is not None and (directory / file).exists():
                with contextlib.suppress(OSError):
                    (directory / file).write_text(value)

    def remove(self, wait_s: float = 3.0) -> bool:
        """Thaw and remove; waits a little for exiting processes to leave."""
        self.thaw()
        deadline = time.monotonic() + wait_s
        left = self.dirs()
        while True:
            left = [d for d in left if d.exists() and not _rmdir(d)]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return not left


def _rmdir(directory: Path) -> bool:
    try:
        directory.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def stale_cgroups(layout: Layout) -> list[Cgroup]:
    names = {
        d.name
        for root in (layout.v2, layout.v1)
        if root is not None
        for d in root.glob(f"{CG_PREFIX}*")
    }
    return [Cgroup(layout, name) for name in sorted(names)]


# --------------------------------------------------------------------- workers


class Worker:
    """One ``worker.py`` process (or ``script``) in its own cgroup, spawned blocked on a pipe.

    ``script`` takes ``--out --seconds --go-fd --parent --gap-ms [--dry-run]`` and
    ``extra_args``; ``swap.py`` runs ``swap_worker.py`` this way. With
    ``stable_argv`` the first four (they change from run to run) go by environment
    (``KIWI_BENCH_OUT``, ``_SECONDS``, ``_GO_FD``, ``_PARENT``) instead, so that the
    command line, by which kiwid knows a bare process from one run to the next, stays
    the same.
    """

    def __init__(
        self,
        index: int,
        layout: Layout,
        outdir: Path,
        seconds: float,
        *,
        dry_run: bool,
        script: Path = WORKER,
        gap_s: float = GAP_S,
        extra_args: Sequence[str] = (),
        stable_argv: bool = False,
        env_extra: Mapping[str, str] | None = None,
        label: str | None = None,
    ) -> None:
        self.index = index
        self.label = label or f"w{index}"
        self.cgroup = Cgroup(layout, f"{CG_PREFIX}{index}")
        self.progress = outdir / f"progress-{index}.txt"
        self.errfile = outdir / f"worker-{index}.err"
        self.cgroup.create()
        read_end, self._go = os.pipe()
        env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", PYTHONUNBUFFERED="1")
        env.update(env_extra or {})
        run_specific = {
            "out": str(self.progress),
            "seconds": f"{seconds:g}",
            "go-fd": str(read_end),
            "parent": str(os.getpid()),
        }
        argv = [sys.executable, str(script)]
        if stable_argv:  # kiwid knows a bare process by its command line: keep it the same
            env.update(
                {f"KIWI_BENCH_{k.upper().replace('-', '_')}": v for k, v in run_specific.items()}
            )
        else:
            for key, value in run_specific.items():
                argv += [f"--{key}", value]
        argv += ["--gap-ms", f"{gap_s * 1e3:g}", *extra_args]
        if dry_run:
            argv.append("--dry-run")
        self.argv = argv
        with open(self.errfile, "wb") as err:
            self.proc = subprocess.Popen(
                argv,
                pass_fds=(read_end,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                start_new_session=True,  # a Ctrl-C reaches only the bench, which cleans up
            )
        os.close(read_end)
        self._buf = b""
        try:
            self.cgroup.add(self.proc.pid)  # before it can start any CUDA work
        except OSError as exc:
            self.kill()
            raise BenchError(
                f"cannot move worker {self.proc.pid} into {self.cgroup.name}: {exc}"
            ) from exc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, command: bytes) -> None:
        os.write(self._go, command)

    def expect(self, word: str, timeout_s: float) -> str:
        """Wait for a stdout line starting with ``word``; return it."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self._buf:
                line, _, self._buf = self._buf.partition(b"\n")
                text = line.decode(errors="replace").strip()
                if text.startswith(word):
                    return text
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(
                    f"worker {self.pid}: no '{word}' within {timeout_s:g} s{self.err_tail()}"
                )
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    rc = self.proc.wait(5)
                    raise BenchError(
                        f"worker {self.pid} exited ({rc}) before '{word}'{self.err_tail()}"
                    )
                self._buf += chunk

    def poll_lines(self) -> list[str]:
        """The stdout lines the worker wrote so far, without blocking; [] at end of file."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        with contextlib.suppress(OSError, ValueError):
            while select.select([fd], [], [], 0)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                self._buf += chunk
        lines = []
        while b"\n" in self._buf:
            line, _, self._buf = self._buf.partition(b"\n")
            lines.append(line.decode(errors="replace").strip())
        return lines

    def err_tail(self) -> str:
        try:
            text = self.errfile.read_text(errors="replace").strip().splitlines()[-8:]
        except OSError:
            return ""
        return (":\n    " + "\n    ".join(text)) if text else ""

    def kill(self, *, hard: bool = False, wait_s: float = 5.0) -> None:
        """Thaw, SIGTERM, then SIGKILL (``hard``: SIGKILL at once); reap within ``wait_s``."""
        if hard and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        self.cgroup.thaw()
        if self._go >= 0:  # once: a second close could hit a reused descriptor
            with contextlib.suppress(OSError):
                os.close(self._go)
            self._go = -1
        if hard:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait_s)
        elif self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(wait_s)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def dispose(self) -> None:
        self.kill()
        if not self.cgroup.remove():
            log(f"warning: could not remove cgroup {self.cgroup.name}")


def read_progress(path: Path) -> list[tuple[float, int]]:
    points: list[tuple[float, int]] = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:
                with contextlib.suppress(ValueError):
                    points.append((float(parts[0]), int(parts[1])))
    return points


# --------------------------------------------------------------------- kiwid


def kiwid_env() -> dict[str, str]:
    paths = [str(REPO), *EXTRA_PATHS]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")


def kiwid_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kiwid", *args]


def config_text(tq: float, gate: str | None, backend: str = "nvml") -> str:
    gate_line = f'gate = "{gate}"\n' if gate else ""
    sim = "[gpu.sim]\ndevices = 1\nmemory_gib = 141\n" if backend == "sim" else ""
    return (
        f"[scheduler]\ntq = {tq:g}\nidle_release = 2\n"
        f'[gpu]\nbackend = "{backend}"\npoll_interval = 0.1\n{gate_line}{sim}'
        f'[control]\nsocket = "{SOCK}"\n'
        f'[daemon]\nstate_dir = "{STATE}"\n'
        '[kubernetes]\ncdi_dir = ""\n'
    )


def check_config(path: Path) -> tuple[int, str]:
    done = subprocess.run(
        kiwid_cmd("check-config", str(path)),
        env=kiwid_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, (done.stdout + done.stderr).strip()


def kiwid_recover(state: Path = STATE) -> None:
    """``kiwid recover --state-dir STATE``: let go of anything a kiwid left gated there."""
    if not state.exists():
        return
    done = subprocess.run(
        kiwid_cmd("recover", "--state-dir", str(state)),
        env=kiwid_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        text = (done.stdout + done.stderr).strip()
        log(f"warning: kiwid recover exited {done.returncode}: {text}")


def socket_alive(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


EVENT = re.compile(r"\[INFO\] (Gated|Ungated) (\S+)")


class Kiwid:
    """kiwid as a child; its output lines are read and time-stamped on arrival."""

    def __init__(self, config: Path, logfile: Path) -> None:
        self.logfile = logfile
        self.lines: list[tuple[float, str]] = []
        self._shown = 0
        self.proc = subprocess.Popen(
            kiwid_cmd("--config", str(config)),
            env=kiwid_env(),
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.logfile, "w", buffering=1) as out:  # line by line: kept if we die
            for raw in self.proc.stdout:
                now = time.monotonic()
                line = raw.rstrip("\n")
                self.lines.append((now, line))
                out.write(f"{now:.6f} {line}\n")
                if ("[WARNING]" in line or "[ERROR]" in line) and self._shown < 12:
                    self._shown += 1
                    log(f"  kiwid: {line}")

    def wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for _, line in list(self.lines):
                if " ready: " in line or line.endswith(" ready"):
                    return line
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the reader catch the last lines
                raise BenchError(f"kiwid exited ({self.proc.returncode}):\n{self.tail()}")
            time.sleep(0.05)
        raise BenchError(f"kiwid not ready within {timeout_s:g} s:\n{self.tail()}")

    def tail(self, count: int = 15) -> str:
        return "\n".join("    " + line for _, line in self.lines[-count:])

    def events(self, lo: float, hi: float) -> list[tuple[float, str, str]]:
        out = []
        for when, line in list(self.lines):
            match = EVENT.search(line)
            if match and lo <= when <= hi:
                out.append((when, match.group(1), match.group(2)))
        return out

    def status(self) -> Any:
        try:
            from kiwid.adapters.control import request  # noqa: PLC0415 - needs the repo path

            return request(SOCK, "status", timeout_s=2.0)
        except Exception as exc:
            return {"error": str(exc)}

    def attach_sim(self, pid: int) -> None:
        """Rehearsal: make ``pid`` an always-busy tenant of the simulated GPU 0."""
        from kiwid.adapters.control import request  # noqa: PLC0415 - needs the repo path

        args = {"pid": pid, "gpu": 0, "memory_bytes": 2**30, "activity": "active"}
        request(SOCK, "sim-attach", args, timeout_s=5.0)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                log("warning: kiwid ignored SIGTERM for 20 s; SIGKILL")
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        return self.proc.returncode


# --------------------------------------------------------------------- NVML sampler


class NvmlSampler(threading.Thread):
    """Polls ``nvmlDeviceGetProcessUtilization`` every 50 ms; keeps (pid, ts) with SM > 0."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        super().__init__(daemon=True)
        self.nvml = nvml
        self.handle = handle
        self.active: dict[int, set[int]] = {}
        self.queries = 0
        self.errors: list[str] = []
        self.clock: str | None = None  # which clock NVML's time stamps follow
        self.mono_offset = 0.0  # NVML time stamp (s) minus CLOCK_MONOTONIC, from the samples
        self._halt = threading.Event()  # not _stop: threading.Thread has a _stop method

    def run(self) -> None:
        newest = 0  # the first query returns each process's latest sample, on any clock
        while not self._halt.wait(NVML_PERIOD_S):
            self.queries += 1
            try:
                samples = self.nvml.nvmlDeviceGetProcessUtilization(
                    self.handle, max(0, newest - NVML_LOOKBACK_US)
                )
            except self.nvml.NVMLError as exc:
                if "not found" not in str(exc).lower() and len(self.errors) < 5:
                    self.errors.append(str(exc))
                continue
            if self.clock is None and samples:
                stamp = max(int(x.timeStamp) for x in samples) / 1e6
                wall, mono = time.time(), time.monotonic()
                self.clock = "wall" if abs(stamp - wall) < 30 else "monotonic?"
                self.clock = "monotonic" if abs(stamp - mono) < 30 else self.clock
                self.mono_offset = stamp - mono  # a rough fallback (sample lag included)
            for sample in samples:
                newest = max(newest, int(sample.timeStamp))
                if sample.smUtil > 0:
                    self.active.setdefault(int(sample.pid), set()).add(int(sample.timeStamp))

    def stop(self) -> None:
        self._halt.set()
        self.join(2)


class FakeNvml:
    """Rehearsal stand-in for pynvml: a live worker is busy unless its cgroup is frozen."""

    class NVMLError(Exception):
        pass

    def __init__(self, bench: Bench, period_us: int = 166_000) -> None:
        self.bench = bench
        self.period_us = period_us

    def nvmlDeviceGetProcessUtilization(self, handle: object, last_seen: int) -> list[Any]:
        now = int(time.time() * 1e6)
        stamp = now - now % self.period_us
        out = [
            types.SimpleNamespace(pid=w.pid, timeStamp=stamp, smUtil=50)
            for w in list(self.bench.live)
            if stamp > last_seen and w.proc.poll() is None and not w.cgroup.frozen()
        ]
        if not out:
            raise self.NVMLError("Not Found")
        return out

    def nvmlShutdown(self) -> None:
        pass


# --------------------------------------------------------------------- analysis


def merge(
    intervals: Iterable[tuple[float, float]], slack: float = 0.0
) -> list[tuple[float, float]]:
    """Union of intervals; ones less than ``slack`` apart are joined too."""
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1] + slack:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def overlap(
    per_tenant: Sequence[Sequence[tuple[float, float]]], lo: float, hi: float, slack: float = 0.0
) -> tuple[float, float]:
    """Longest stretch and total time within [lo, hi] when >= 2 tenants were active."""
    events: list[tuple[float, int]] = []
    for intervals in per_tenant:
        for start, end in merge(intervals, slack):
            a, b = max(start, lo), min(end, hi)
            if a < b:
                events += [(a, 1), (b, -1)]
    events.sort()  # at a tie, -1 sorts first: touching intervals do not overlap
    count, start, longest, total = 0, 0.0, 0.0, 0.0
    for when, delta in events:
        before = count
        count += delta
        if before < 2 <= count:
            start = when
        elif count < 2 <= before:
            longest = max(longest, when - start)
            total += when - start
    return longest, total


def gaps_of(points: Sequence[tuple[float, int]], gap_s: float = GAP_S) -> list[tuple[float, float]]:
    """Stalls: (last completion before, first completion after) an iteration slower than gap_s."""
    return [
        (t0, t1)
        for (t0, n0), (t1, n1) in itertools.pairwise(points)
        if n1 - n0 == 1 and t1 - t0 > gap_s
    ]


def running_of(
    points: Sequence[tuple[float, int]], gaps: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    """When a worker was making progress: its whole run minus its stalls."""
    if len(points) < 2:
        return []
    out, cursor = [], points[0][0]
    for s, r in gaps:
        if s > cursor:
            out.append((cursor, s))
        cursor = max(cursor, r)
    if points[-1][0] > cursor:
        out.append((cursor, points[-1][0]))
    return out


def iterations_at(points: Sequence[tuple[float, int]], when: float) -> int:
    times = [t for t, _ in points]
    i = bisect.bisect_right(times, when)
    return points[i - 1][1] if i else 0


def rate(points: Sequence[tuple[float, int]], lo: float, hi: float) -> float:
    return (iterations_at(points, hi) - iterations_at(points, lo)) / (hi - lo)


def handovers(gaps: Sequence[Sequence[tuple[float, float]]], lo: float, hi: float) -> list[float]:
    """Hand-over latencies in ms: another worker's stall start -> this worker's resume.

    For every resume inside [lo, hi], the other workers' stall starts that fall in
    this worker's own stall (plus a tolerance after it, in case the next tenant is
    let go before the holder is stopped) are candidates; the nearest one counts. A
    negative value means the two ran together for that long.
    """
    out = []
    for y, own in enumerate(gaps):
        for s_y, r in own:
            if not lo <= r <= hi:
                continue
            candidates = [
                s
                for x, other in enumerate(gaps)
                if x != y
                for s, _ in other
                if s_y <= s <= r + HANDOVER_TOLERANCE_S
            ]
            if candidates:
                s = min(candidates, key=lambda c, r=r: abs(r - c))
                out.append((r - s) * 1e3)
    return out


def nvml_period(active: dict[int, set[int]]) -> float | None:
    """Median spacing (s) of consecutive active samples of one PID, under 1 s."""
    diffs = []
    for stamps in active.values():
        ordered = sorted(stamps)
        diffs += [(b - a) / 1e6 for a, b in itertools.pairwise(ordered) if 0 < b - a < 1e6]
    return statistics.median(diffs) if diffs else None


def nvml_corun(
    active: dict[int, set[int]], pids: Iterable[int], lo_wall: float, hi_wall: float
) -> dict[str, Any]:
    """Longest stretch when two PIDs had SM samples, a sample covering (ts - period, ts]."""
    period = nvml_period(active)
    wanted = [p for p in pids if p in active]
    note = None
    if not wanted and active:
        wanted, note = list(active), "NVML PIDs differ from the workers' (PID namespace?): used all"
    per = period or 0.2
    intervals = [[(ts / 1e6 - per, ts / 1e6) for ts in active[p]] for p in wanted]
    # consecutive samples of one PID up to 1.5 periods apart: busy all along (jitter)
    longest, total = overlap(intervals, lo_wall, hi_wall, slack=per / 2)
    samples = sum(1 for p in wanted for ts in active[p] if lo_wall <= ts / 1e6 <= hi_wall)
    return {
        "longest_ms": round(longest * 1e3, 1),
        "total_ms": round(total * 1e3, 1),
        "sample_period_ms": round(period * 1e3, 1) if period else None,
        "samples_in_window": samples,
        "pids_seen": sorted(active),
        "note": note,
    }


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


# --------------------------------------------------------------------- scenarios


@dataclass
class Scenario:
    name: str
    workers: int
    window: float
    warmup: float
    gate: str | None = None
    tq: float | None = None

    @property
    def kiwid(self) -> bool:
        return self.gate is not None


@dataclass
class Result:
    scenario: Scenario
    status: str = "ok"
    rates: list[float] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


def plan(seconds: float, gates: Sequence[str], only: Sequence[str]) -> list[Scenario]:
    out = [
        Scenario("solo", 1, max(5.0, seconds / 2), 1.0),
        Scenario("co-run, no kiwid", 2, seconds, 1.0),
        Scenario("co-run, no kiwid", 3, seconds, 1.0),
    ]
    for gate in gates:
        for tq in (1.0, 5.0):
            for n in (2, 3) if tq == 1.0 else (2,):
                out.append(Scenario(f"kiwid {gate} TQ {tq:g}", n, seconds, 2.0, gate, tq))
    if only:
        out = [s for s in out if any(word in f"{s.name} x{s.workers}" for word in only)]
    return out


def overhead_guess(kiwid: bool) -> float:
    """Seconds a scenario takes beyond warm-up and window, before any was measured."""
    return 8.0 if kiwid else 5.0  # worker CUDA init, kiwid start/stop/recover, teardown


class Bench:
    def __init__(self, args: argparse.Namespace, layout: Layout, outdir: Path) -> None:
        self.args = args
        self.layout = layout
        self.outdir = outdir
        self.spares: list[Worker] = []
        self.live: list[Worker] = []
        self.kiwid: Kiwid | None = None
        self.count = 0
        self.nvml: Any = None
        self.handle: Any = None
        self.configs: dict[str, Path] = {}
        self.solo_rate: float | None = None
        # a safety cap on a worker's run; the bench stops them first
        self.worker_seconds = 1.8 if args.dry_run else args.seconds + 15.0

    # workers ------------------------------------------------------------
    def spawn(self, count: int) -> None:
        for _ in range(count):
            worker = Worker(
                self.count,
                self.layout,
                self.outdir,
                self.worker_seconds,
                dry_run=self.args.dry_run or self.args.rehearse,
            )
            self.count += 1
            self.spares.append(worker)

    def take(self, count: int) -> list[Worker]:
        if len(self.spares) < count:
            self.spawn(count - len(self.spares))
        taken, self.spares = self.spares[:count], self.spares[count:]
        self.live += taken
        for worker in taken:
            if not worker.cgroup.holds(worker.pid):
                raise BenchError(f"worker {worker.pid} is not in {worker.cgroup.name}")
        return taken

    def release(self, workers: Sequence[Worker]) -> None:
        for worker in workers:
            worker.dispose()
            if worker in self.live:
                self.live.remove(worker)

    # kiwid --------------------------------------------------------------
    def stop_kiwid(self) -> None:
        """SIGTERM kiwid and wait, then ``kiwid recover`` (nothing if none runs)."""
        if self.kiwid is not None:
            rc = self.kiwid.stop()
            if rc not in (0, None):
                log(f"warning: kiwid exited {rc}:\n{self.kiwid.tail(6)}")
            self.kiwid = None
            kiwid_recover()

    # one scenario -------------------------------------------------------
    def run(self, s: Scenario, upcoming: Scenario | None) -> Result:
        result = Result(s)
        workers: list[Worker] = []
        sampler: NvmlSampler | None = None
        tag = f"{s.name} x{s.workers}"
        try:
            workers = self.take(s.workers)
            for w in workers:
                w.label = f"w{workers.index(w)}"
                w.send(b"i")
            for w in workers:
                ready = w.expect("ready", 120)
                result.details.setdefault("gpu_bytes", []).append(int(ready.split()[1]))
            if s.kiwid:
                assert s.tq is not None
                assert s.gate is not None
                slug = re.sub(r"[^a-z0-9]+", "-", tag.lower()).strip("-")
                self.kiwid = Kiwid(
                    self.configs[s.gate + f"-{s.tq:g}"], self.outdir / f"kiwid-{slug}.log"
                )
                result.details["kiwid_ready"] = self.kiwid.wait_ready(30)
                gate_lines = [line for _, line in self.kiwid.lines if "Gate:" in line]
                result.details["kiwid_gate_line"] = gate_lines[0] if gate_lines else None
                log(f"  kiwid ready; {gate_lines[0] if gate_lines else 'no [INFO] Gate: line'}")
            if self.nvml is not None:
                sampler = NvmlSampler(self.nvml, self.handle)
                sampler.start()
            offset = time.time() - time.monotonic()
            t_go = time.monotonic()
            for w in workers:
                w.send(b"g")
            if self.args.rehearse and self.kiwid is not None:
                for w in workers:  # the simulated GPU sees them as always busy
                    self.kiwid.attach_sim(w.pid)
            lo, hi = t_go + s.warmup, t_go + s.warmup + s.window
            log(
                f"  go: {s.workers} worker(s), pids {[w.pid for w in workers]}; "
                f"window {s.window:g} s after {s.warmup:g} s warm-up"
            )
            if upcoming is not None:
                self.spawn(
                    max(0, upcoming.workers - len(self.spares))
                )  # torch imports overlap this run
            self._watch(workers, lo, hi, result)
            if sampler is not None:
                sampler.stop()
            kiwid = self.kiwid
            if kiwid is not None:
                result.details["kiwid_log"] = str(kiwid.logfile)
                # Stopping kiwid ungates everyone; a worker writes the line of its last
                # iteration before a stall only once it runs again, so let them run a bit.
                self.stop_kiwid()
                time.sleep(0.3)
            self._analyse(s, workers, result, lo, hi, offset, sampler, kiwid)
        except BenchError as exc:
            result.status = "error"
            result.details["error"] = str(exc)
            log(f"  ERROR in {tag}: {exc}")
        finally:
            if sampler is not None and sampler.is_alive():
                sampler.stop()
            if self.kiwid is not None:
                result.details["kiwid_log"] = str(self.kiwid.logfile)
            self.stop_kiwid()
            self.release(workers)
        return result

    def _watch(self, workers: Sequence[Worker], lo: float, hi: float, result: Result) -> None:
        every = 5.0
        last = {w.label: (time.monotonic(), 0) for w in workers}
        next_line = time.monotonic() + every
        mid_done = False
        while (now := time.monotonic()) < hi:
            for w in workers:
                if w.proc.poll() is not None:
                    raise BenchError(
                        f"worker {w.label} (pid {w.pid}) exited early "
                        f"({w.proc.returncode}){w.err_tail()}"
                    )
            if self.kiwid is not None:
                if self.kiwid.proc.poll() is not None:
                    raise BenchError(
                        f"kiwid exited ({self.kiwid.proc.returncode}):\n{self.kiwid.tail()}"
                    )
                if not mid_done and now >= (lo + hi) / 2:
                    result.details["kiwid_status_mid_window"] = self.kiwid.status()
                    mid_done = True
            if now >= next_line:
                parts = []
                for w in workers:
                    points = read_progress(w.progress)
                    t_last, n_last = last[w.label]
                    n_now = points[-1][1] if points else 0
                    parts.append(
                        f"{w.label} {(n_now - n_last) / max(now - t_last, 1e-9):5.0f} it/s"
                    )
                    last[w.label] = (now, n_now)
                phase = "warm-up" if now < lo else f"window {now - lo:4.1f}/{hi - lo:g} s"
                log(f"  {phase}: " + ", ".join(parts))
                next_line = now + every
            time.sleep(min(0.2, max(0.0, hi - now)))

    def _analyse(
        self,
        s: Scenario,
        workers: Sequence[Worker],
        result: Result,
        lo: float,
        hi: float,
        offset: float,
        sampler: NvmlSampler | None,
        kiwid: Kiwid | None,
    ) -> None:
        points = [read_progress(w.progress) for w in workers]
        result.rates = [rate(p, lo, hi) for p in points]
        gaps = [gaps_of(p) for p in points]
        running = [running_of(p, g) for p, g in zip(points, gaps, strict=True)]
        longest, total = overlap(running, lo, hi)
        hand = handovers(gaps, lo, hi)
        d = result.details
        d["window_s"] = [round(lo, 3), round(hi, 3)]
        d["progress_files"] = [str(w.progress) for w in workers]
        d["workers_corun"] = {
            "longest_ms": round(longest * 1e3, 1),
            "total_ms": round(total * 1e3, 1),
        }
        d["stalls_in_window"] = [sum(1 for a, _ in g if lo <= a <= hi) for g in gaps]
        if hand:
            d["handover_ms"] = {
                "n": len(hand),
                "p50": round(percentile(hand, 50), 2),
                "p99": round(percentile(hand, 99), 2),
                "max": round(max(hand), 2),
                "min": round(min(hand), 2),
            }
        if sampler is not None:
            if sampler.clock == "monotonic":
                offset = 0.0
            elif sampler.clock not in (None, "wall"):
                offset = sampler.mono_offset
            d["nvml"] = nvml_corun(
                sampler.active, [w.pid for w in workers], lo + offset, hi + offset
            )
            d["nvml"]["clock"] = sampler.clock
            d["nvml"]["queries"] = sampler.queries
            d["nvml"]["errors"] = sampler.errors
        if kiwid is not None:
            events = kiwid.events(lo, hi)
            names = {f"cgroup:/{w.cgroup.name}": w.label for w in workers}
            d["kiwid_events_in_window"] = {
                "gated": sum(1 for e in events if e[1] == "Gated"),
                "ungated": sum(1 for e in events if e[1] == "Ungated"),
                "tenants": sorted({names.get(e[2], e[2]) for e in events}),
            }
            d["kiwid_warnings"] = [
                line for _, line in kiwid.lines if "[WARNING]" in line or "[ERROR]" in line
            ][:20]
            if not events:
                d.setdefault("notes", []).append("kiwid logged no Gated/Ungated line in the window")
        if s.name == "solo" and result.rates:
            self.solo_rate = result.rates[0]
        each = " / ".join(f"{r:.0f}" for r in result.rates)
        nv = d.get("nvml", {})
        hand_text = (
            f"{d['handover_ms']['p50']:.2f}/{d['handover_ms']['p99']:.2f} ms (n={len(hand)})"
            if hand
            else "-"
        )
        log(
            f"  result: it/s {each} (sum {sum(result.rates):.0f}); longest co-run: NVML "
            f"{nv.get('longest_ms', '-')} ms (sample period {nv.get('sample_period_ms', '-')} ms), "
            f"workers {longest * 1e3:.1f} ms; hand-over p50/p99 {hand_text}"
        )

    def close(self) -> None:
        """Undo everything; every step guarded."""
        for step in (self.stop_kiwid, kiwid_recover, self._kill_all, self._remove_stale):
            try:
                step()
            except Exception as exc:
                log(f"warning: cleanup step {step.__name__} failed: {exc}")
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()

    def _kill_all(self) -> None:
        for worker in [*self.live, *self.spares]:
            with contextlib.suppress(Exception):
                worker.dispose()
        self.live, self.spares = [], []

    def _remove_stale(self) -> None:
        for cgroup in stale_cgroups(self.layout):
            if not cgroup.remove(1.0):
                log(f"warning: cgroup {cgroup.name} still busy; left in place")


# --------------------------------------------------------------------- output


def table(results: Sequence[Result], solo: float | None) -> str:
    head = (
        "scenario",
        "workers",
        "it/s each",
        "sum it/s",
        "longest co-run ms",
        "hand-over p50/p99 ms",
    )
    rows = [head]
    for r in results:
        s, d = r.scenario, r.details
        if r.status != "ok":
            rows.append((s.name, str(s.workers), r.status, "", "", ""))
            continue
        total = sum(r.rates)
        pct = f" ({total / solo:.0%})" if solo and s.workers > 1 else ""
        nv = d.get("nvml", {}).get("longest_ms")
        corun = f"{nv:.0f}" if nv is not None else "-"
        corun += f" ({d['workers_corun']['longest_ms']:.1f})" if s.workers > 1 else ""
        if s.workers == 1:
            corun = "-"
        hand = d.get("handover_ms")
        hand_text = f"{hand['p50']:.2f}/{hand['p99']:.2f} (n={hand['n']})" if hand else "-"
        rows.append(
            (
                s.name,
                str(s.workers),
                " / ".join(f"{x:.0f}" for x in r.rates),
                f"{total:.0f}{pct}",
                corun,
                hand_text,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


LEGEND = (
    "longest co-run ms: longest stretch in the window when two workers used the GPU at once,\n"
    "  from NVML per-process samples (resolution one NVML sample period, so exclusive\n"
    "  rotation shows about one period per hand-over) and, in parentheses, from the workers'\n"
    "  progress logs (resolution one iteration). sum it/s (%): relative to solo.\n"
    "hand-over: last iteration of the stopped worker -> first iteration of the next one,\n"
    "  CLOCK_MONOTONIC of the workers; negative = they overlapped."
)


# --------------------------------------------------------------------- checks


def have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_kiwid_deps() -> list[str]:
    missing = []
    for module in KIWID_DEPS:
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    return missing


PIP_HINT = (
    "kiwid needs the Python packages psutil, sdnotify, watchdog and prometheus-client in this"
    " python ({exe}).\n"
    "  Install them:   {exe} -m pip install psutil sdnotify watchdog prometheus-client\n"
    "  Without internet, from carried wheels:\n"
    "    {exe} -m pip install --no-index --find-links WHEEL_DIR \\\n"
    "      psutil sdnotify watchdog prometheus-client\n"
    "  or, on a machine that has them, run this script with --vendor-deps and carry\n"
    "  bench/gpu/_deps along (it is put on the path when present; see --deps)"
)


def preflight(args: argparse.Namespace, layout: Layout) -> bool:
    """Log the modules found; unless ``--dry-run``, log what stops a run. Ready?

    Shared with swap.py: torch and nvidia-ml-py (not needed for ``--rehearse``),
    kiwid's dependencies, root, and a cgroup hierarchy to put workers in.
    """
    missing_deps = missing_kiwid_deps()
    log(
        f"modules: torch {'ok' if have('torch') else 'MISSING'}, "
        f"nvidia-ml-py (pynvml) {'ok' if have('pynvml') else 'MISSING'}, "
        f"kiwid deps {'ok' if not missing_deps else 'MISSING ' + ', '.join(missing_deps)}"
    )
    if args.dry_run:
        return True
    problems = []
    missing_mods = [m for m in ("torch", "pynvml") if not have(m)]
    if missing_mods and not args.rehearse:
        problems.append(
            f"missing modules {missing_mods} (this script needs torch and nvidia-ml-py)"
        )
    if missing_deps:
        problems.append(PIP_HINT.format(exe=sys.executable))
    if os.geteuid() != 0:
        problems.append("not root: creating and gating cgroups needs root")
    if layout.v2 is None and layout.v1 is None:
        problems.append("no cgroup2 mount and no v1 freezer")
    for problem in problems:
        log("ERROR: " + problem)
    return not problems


def vendor_deps(target: Path) -> int:
    """Copy kiwid's dependencies from this python into ``target`` (for a machine without)."""
    import platform  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    target.mkdir(parents=True, exist_ok=True)
    for name in KIWID_DEPS:
        module = __import__(name)
        source = Path(module.__file__ or "").parent
        shutil.copytree(
            source, target / name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
        )
        log(f"copied {name} {getattr(module, '__version__', '')} from {source}")
    binaries = sorted(p.name for p in target.rglob("*.so"))
    log(
        f"{target}: compiled parts {binaries} for {platform.machine()} "
        "(psutil's is abi3: any CPython >= 3.6 on the same CPU architecture and glibc)"
    )
    return 0


def prepare_configs(
    bench: Bench, gates: Sequence[str], *, sim: bool = False, probe: bool = False
) -> dict[str, str | None]:
    """Write and check kiwid configs; return gate -> None if usable, else why not.

    With ``probe``, kiwid is started once per gate (no tenants) to read which gate it
    really uses (its ``[INFO] Gate:`` line): kiwid falls back from the CUDA lock to the
    freezer when the driver lacks it, and measuring the freezer twice wastes GPU time.
    """
    WORK.mkdir(parents=True, exist_ok=True)
    backend = "sim" if sim else "nvml"
    verdict: dict[str, str | None] = {}
    for gate in gates:
        verdict[gate] = None
        for tq in (1.0, 5.0):
            path = WORK / f"kiwid-{gate}-tq{tq:g}{'-sim' if sim else ''}.toml"
            path.write_text(config_text(tq, gate, backend))
            rc, text = check_config(path)
            if rc == 1 and gate == "cuda-lock":
                log(
                    "cuda-lock was not available in this build: check-config rejected "
                    f'gate = "cuda-lock": {text}'
                )
                verdict[gate] = "n/a: cuda-lock not in this build"
                break
            if rc == 1:
                path.write_text(config_text(tq, None, backend))
                rc, text = check_config(path)
                log(
                    f'check-config rejected gate = "{gate}"; retried without the gate key '
                    "(kiwid's default gate, the freezer): cuda-lock was not available in "
                    f"this build{'' if rc == 0 else f'; still rejected ({rc}): {text}'}"
                )
            if rc != 0:
                log(f"kiwid check-config {path} failed ({rc}): {text}")
                verdict[gate] = f"n/a: kiwid rejects the config ({rc})"
                break
            bench.configs[f"{gate}-{tq:g}"] = path
        if verdict[gate] is None and probe:
            line = probe_gate(bench.configs[f"{gate}-1"], bench.outdir / f"kiwid-probe-{gate}.log")
            log(f"  gate {gate}: kiwid says {line!r}")
            want = "CUDA" if gate == "cuda-lock" else "freezer"
            if want not in line:
                verdict[gate] = f"n/a: kiwid used another gate ({line or 'none'})"
                if gate == "cuda-lock":
                    log("cuda-lock was not available on this machine: kiwid fell back; skipped")
        if verdict[gate] is None:
            log(f"  config for gate {gate}: OK ({bench.configs[f'{gate}-1']})")
    return verdict


def probe_gate(config: Path, logfile: Path) -> str:
    """Start kiwid without tenants; return its ``Gate:`` line (or a warning about gating)."""
    kiwid = Kiwid(config, logfile)
    try:
        kiwid.wait_ready(30)
    except BenchError as exc:
        log(f"  kiwid did not start with {config}: {exc}")
        return ""
    finally:
        kiwid.stop()
    for _, line in kiwid.lines:
        if "Gate:" in line or "not be gated" in line:
            return line
    return ""


def clean_start(layout: Layout, state: Path = STATE) -> None:
    """Leftovers of an earlier, interrupted run: kiwid state, socket, cgroups."""
    kiwid_recover(state)
    if SOCK.exists() or SOCK.is_symlink():
        if socket_alive(SOCK):
            raise BenchError(f"another kiwid answers on {SOCK}; stop it first")
        SOCK.unlink()
    for cgroup in stale_cgroups(layout):
        log(f"removing leftover cgroup {cgroup.name}")
        cgroup.remove(1.0)


def dry_run_checks(bench: Bench, layout: Layout, gates: Sequence[str]) -> tuple[int, int]:
    """Checks without CUDA; returns (errors, warnings).

    Analysis on synthetic data; two sleep-based workers spawned, moved into their
    cgroups, released and rotated by freezing, as kiwid would; kiwid itself on its
    simulated backend (start, status, stop, recover).
    """
    errors = warnings = 0

    def check(name: str, ok: bool, detail: str = "") -> None:
        nonlocal errors
        errors += 0 if ok else 1
        log(f"  {'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")

    # analysis on synthetic data: A holds until 0.2 s, B until 1.1995 s, A is back at 1.19 s
    a = [(0.0, 0), (0.1, 50), (0.2, 100), (1.19, 101), (1.3, 150)]
    b = [(0.0, 0), (0.2005, 1), (0.7, 300), (1.1995, 600), (1.5, 601)]
    ga, gb = gaps_of(a), gaps_of(b)
    check("stall detection", ga == [(0.2, 1.19)] and gb == [(0.0, 0.2005), (1.1995, 1.5)])
    hand = handovers([ga, gb], 0.0, 2.0)
    check("hand-over pairing", [round(h, 3) for h in hand] == [-9.5, 0.5], f"{hand} ms")
    longest, _ = overlap([running_of(a, ga), running_of(b, gb)], 0.0, 2.0)
    check("co-run from progress", abs(longest - 0.0095) < 1e-9, f"{longest * 1e3:.1f} ms")
    active = {1: {1_000_000, 1_100_000, 1_200_000}, 2: {1_200_000, 1_300_000, 1_400_000}}
    nv = nvml_corun(active, [1, 2], 0.0, 10.0)
    check(
        "co-run from NVML samples",
        nv["longest_ms"] == 100.0 and nv["sample_period_ms"] == 100.0,
        f"{nv}",
    )

    if os.geteuid() != 0:
        log("  warning: not root: cgroup checks skipped (the real run needs root)")
        return errors, warnings + 1
    # two fake workers, rotated by freezing their cgroups, as kiwid would
    workers = bench.take(2)
    for w in workers:
        check(f"worker {w.pid} moved into {w.cgroup.name} before release", w.cgroup.holds(w.pid))
        w.send(b"i")
    for w in workers:
        w.expect("ready", 30)
    t_go = time.monotonic()
    workers[1].cgroup.freeze()
    for w in workers:
        w.send(b"g")
    switches = []
    holder, waiter = workers
    while time.monotonic() < t_go + 1.6:
        time.sleep(0.3)
        t = time.perf_counter()
        deadline = time.monotonic() + 2.0
        holder.cgroup.freeze()
        while not holder.cgroup.frozen() and time.monotonic() < deadline:
            time.sleep(0.0005)
        waiter.cgroup.thaw()
        switches.append((time.perf_counter() - t) * 1e3)
        holder, waiter = waiter, holder
    frozen_ok = holder.cgroup.frozen() is False and waiter.cgroup.frozen() is True
    check(
        "freeze/thaw of worker cgroups",
        frozen_ok,
        f"{len(switches)} switches, max {max(switches):.2f} ms",
    )
    for w in workers:
        w.cgroup.thaw()
    for w in workers:
        w.expect("done", 30)
    points = [read_progress(w.progress) for w in workers]
    gaps = [gaps_of(p) for p in points]
    hand = handovers(gaps, t_go, t_go + 5)
    longest, _ = overlap(
        [running_of(p, g) for p, g in zip(points, gaps, strict=True)], t_go + 0.1, t_go + 1.6
    )
    check(
        "end-to-end: progress -> stalls -> hand-overs",
        len(hand) >= 3 and max(hand) < 50,
        f"{len(hand)} hand-overs, p50 {percentile(hand, 50) if hand else float('nan'):.2f} ms, "
        f"co-run {longest * 1e3:.1f} ms (sleep-based worker: a few ms is expected)",
    )
    bench.release(workers)
    check("cgroups removed", not stale_cgroups(layout))

    # kiwid itself, on the simulated backend (no GPU)
    missing = missing_kiwid_deps()
    if missing:
        log("  warning: " + PIP_HINT.format(exe=sys.executable).replace("\n", "\n  "))
        log("  warning: kiwid checks skipped (missing " + ", ".join(missing) + ")")
        return errors, warnings + 1
    verdict = prepare_configs(bench, gates)
    check("kiwid configs", verdict.get("freeze") is None, f"gates: {verdict}")
    sim_cfg = WORK / "kiwid-sim-smoke.toml"
    sim_cfg.write_text(config_text(1.0, "freeze", "sim"))
    if check_config(sim_cfg)[0] == 1:
        sim_cfg.write_text(config_text(1.0, None, "sim"))
    kiwid = Kiwid(sim_cfg, bench.outdir / "kiwid-sim-smoke.log")
    bench.kiwid = kiwid
    try:
        ready = kiwid.wait_ready(30)
        check("kiwid starts (sim backend) and says ready", True, ready)
        status = kiwid.status()
        check("kiwid answers status on the socket", "error" not in status, str(status)[:120])
    except BenchError as exc:
        check("kiwid starts (sim backend)", False, str(exc))
    bench.stop_kiwid()
    check("kiwid stopped, recover ran", kiwid.proc.returncode == 0, f"exit {kiwid.proc.returncode}")
    return errors, warnings


# --------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--seconds", type=float, default=20.0, help="measured window per scenario (solo: half)"
    )
    parser.add_argument(
        "--budget", type=float, default=280.0, help="skip scenarios that would end later (s)"
    )
    parser.add_argument(
        "--gates", default=",".join(GATES), help="gates to try (default %(default)s)"
    )
    parser.add_argument(
        "--only", default="", help="comma-separated substrings of scenario names to run"
    )
    parser.add_argument("--out", type=Path, help="output folder (default $OUT/kiwi-enforcement)")
    parser.add_argument("--dry-run", action="store_true", help="no CUDA: checks and the plan")
    parser.add_argument(
        "--deps",
        type=Path,
        default=DEPS_DIR,
        help="folder with psutil, sdnotify, watchdog, prometheus_client for kiwid, used if present "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--vendor-deps",
        action="store_true",
        help="copy kiwid's dependencies from this python into --deps, then exit",
    )
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="no CUDA: every scenario with sleep-based workers, kiwid on its simulated GPU "
        "(workers attached as always busy, so kiwid freezes them in turn); tests the plumbing",
    )
    args = parser.parse_args()
    if args.vendor_deps:
        return vendor_deps(args.deps)
    if args.deps.is_dir():
        EXTRA_PATHS.append(str(args.deps))
        sys.path.insert(0, str(args.deps))

    def _sigterm(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with it ignored
    gates = [g for g in args.gates.split(",") if g]
    bad = [g for g in gates if g not in GATES]
    if bad:
        parser.error(f"unknown gate(s) {bad}; choose from {GATES}")
    outdir = args.out or (
        Path(os.environ["OUT"]) / "kiwi-enforcement" if os.environ.get("OUT") else WORK / "out"
    )
    outdir.mkdir(parents=True, exist_ok=True)
    scenarios = plan(args.seconds, gates, [w for w in args.only.split(",") if w])

    mode = (
        " (DRY RUN)"
        if args.dry_run
        else " (REHEARSAL: no GPU, simulated kiwid)"
        if args.rehearse
        else ""
    )
    log(f"kiwi GPU enforcement bench{mode}: python {sys.version.split()[0]} ({sys.executable})")
    log(f"repo {REPO}; output {outdir}; work dir {WORK}")
    if EXTRA_PATHS:
        log(f"kiwid's dependencies also from {EXTRA_PATHS[0]}")
    est = sum(s.warmup + s.window + overhead_guess(s.kiwid) for s in scenarios) + 10
    log(f"plan ({len(scenarios)} scenarios, ~{est:.0f} s estimated, budget {args.budget:g} s):")
    for s in scenarios:
        kind = f"kiwid gate={s.gate} tq={s.tq:g}" if s.kiwid else "no kiwid"
        log(f"  {s.name} x{s.workers}: {kind}; warm-up {s.warmup:g} s + window {s.window:g} s")

    layout = Layout.detect()
    log(f"cgroups: {layout}; root: {os.geteuid() == 0}")
    if not preflight(args, layout):
        return 2

    bench = Bench(args, layout, outdir)
    results: list[Result] = []
    try:
        if os.geteuid() == 0:
            clean_start(layout)
        if args.dry_run:
            errors, warnings = dry_run_checks(bench, layout, gates)
            log(
                f"dry run {'OK' if not errors else 'FAILED'}: "
                f"{errors} failure(s), {warnings} warning(s)"
            )
            return 1 if errors else 0
        if args.rehearse:
            bench.nvml = FakeNvml(bench)
        else:
            import pynvml  # noqa: PLC0415 - only on the GPU machine

            pynvml.nvmlInit()
            bench.nvml, bench.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
            log(
                f"GPU 0: {pynvml.nvmlDeviceGetName(bench.handle)}, "
                f"driver {pynvml.nvmlSystemGetDriverVersion()}"
            )
        if scenarios:  # their torch imports overlap the kiwid config checks
            bench.spawn(scenarios[0].workers)
        wanted = any(s.kiwid for s in scenarios)
        verdict = prepare_configs(bench, gates, sim=args.rehearse, probe=True) if wanted else {}
        if args.rehearse:  # the simulated backend has no CUDA lock: run its scenarios anyway
            verdict = {g: None if v and "another gate" in v else v for g, v in verdict.items()}
        runnable = [s for s in scenarios if not s.kiwid or verdict.get(s.gate or "") is None]
        overhead = {True: overhead_guess(True), False: overhead_guess(False)}
        for s in scenarios:
            if s not in runnable:
                results.append(Result(s, status=verdict.get(s.gate or "") or "n/a"))
                continue
            i = runnable.index(s)
            upcoming = runnable[i + 1] if i + 1 < len(runnable) else None
            need = s.warmup + s.window + overhead[s.kiwid]
            if time.monotonic() - T0 + need > args.budget:
                log(f"SKIP {s.name} x{s.workers}: needs ~{need:.0f} s, budget {args.budget:g} s")
                results.append(Result(s, status="skipped (time budget)"))
                continue
            log(f"== {s.name} x{s.workers}")
            started = time.monotonic()
            results.append(bench.run(s, upcoming))
            spent = time.monotonic() - started - s.warmup - s.window
            overhead[s.kiwid] = spent + 1.0  # the latest, plus a margin (the first has imports)
            log(f"   ({time.monotonic() - started:.1f} s, of which {spent:.1f} s set-up/teardown)")
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the clean-up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        bench.close()
        log("cleaned up: kiwid stopped, recover ran, workers killed, cgroups removed")
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if results:
            print("\n" + table(results, bench.solo_rate) + "\n" + LEGEND, flush=True)
            dump = {
                "machine": os.uname().nodename,
                "python": sys.version.split()[0],
                "seconds": args.seconds,
                "elapsed_s": round(time.monotonic() - T0, 1),
                "results": [
                    {
                        "scenario": r.scenario.name,
                        "workers": r.scenario.workers,
                        "gate": r.scenario.gate,
                        "tq": r.scenario.tq,
                        "status": r.status,
                        "its_each": [round(x, 1) for x in r.rates],
                        "its_sum": round(sum(r.rates), 1),
                        **r.details,
                    }
                    for r in results
                ],
            }
            (outdir / "results.json").write_text(json.dumps(dump, indent=1, default=str))
            log(f"results: {outdir / 'results.json'}; total {time.monotonic() - T0:.0f} s")
    return (
        0
        if all(r.status == "ok" or r.status.startswith(("n/a", "skipped")) for r in results)
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
