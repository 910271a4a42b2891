"""The driver double's directory, for Python: read and write it as the C library does.

The stand-in ``libcuda.so.1`` (``libcuda_standin.c``, whose header comment is
the reference for the layout) keeps the simulated driver's state in the
directory that ``KIWI_STANDIN_CUDA`` names, so that every process sees one card:
kiwid, ``kiwid recover``, the tests, the stand-in pynvml and the tenant
programs. In short::

    config          capacity, foreign, checkpoint_rate, restore_rate, oom_sticks
    lock            flock(2)ed around every read-modify-write
    procs/PID       state, memory, stuck, moving, until, start: one CUDA process
    faults/PID.OP   "fail CODE TIMES", "hang SECS TIMES", "stuck TIMES", "oom TIMES", "none"
    lost            the GPU fell off the bus
    progress/PID    a tenant's work counter (cuda_tenant.py): two little-endian
                    uint64, iterations done and CLOCK_MONOTONIC ns of the last

Stdlib only: the stand-in pynvml (imported by a real kiwid) and the tenant
program import it as the top-level module ``cudadir``, the tests as
``tests.stand_ins.cudadir``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ENVIRONMENT = "KIWI_STANDIN_CUDA"
"""The environment variable naming the double's directory."""
RUNNING, LOCKED, CHECKPOINTED = 0, 1, 2
STILL, CHECKPOINTING, RESTORING = 0, 1, 2
OPS = ("lock", "unlock", "checkpoint", "restore", "state")
PROGRESS = struct.Struct("<QQ")


@dataclass(frozen=True)
class Proc:
    """One CUDA process of the double, as its ``procs/PID`` entry says.

    ``state`` is what ``cuCheckpointProcessGetState`` answers: during a
    checkpoint LOCKED, during a restore CHECKPOINTED.
    """

    pid: int
    state: int
    memory: int
    stuck: bool = False
    moving: int = STILL
    until: int = 0
    start: int = 0

    @property
    def resident(self) -> bool:
        """Whether its memory is on the card (a restore in flight has reserved it)."""
        return self.state != CHECKPOINTED or self.moving == RESTORING


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold the directory's lock, as the C library does around each change."""
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file (a name of this thread's) and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _pairs(path: Path) -> dict[str, int] | None:
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    pairs = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            pairs[key] = int(value)
    return pairs


def read_config(directory: Path) -> dict[str, int]:
    """The card: capacity, foreign, checkpoint_rate, restore_rate, oom_sticks (0 if unset)."""
    keys = ("capacity", "foreign", "checkpoint_rate", "restore_rate", "oom_sticks")
    pairs = _pairs(directory / "config") or {}
    return {key: pairs.get(key, 0) for key in keys}


def write_config(directory: Path, **values: int) -> None:
    """Set keys of ``config``, keeping the others."""
    config = {**read_config(directory), **values}
    write_atomic(directory / "config", "".join(f"{k} {v}\n" for k, v in config.items()))


def start_ticks(pid: int) -> int | None:
    """The start time of a live process (``/proc/PID/stat`` field 22); ``None``: gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def read_proc(directory: Path, pid: int) -> Proc | None:
    """A live process's entry, an operation whose time is over done; ``None``: no CUDA process."""
    pairs = _pairs(directory / "procs" / str(pid))
    if pairs is None:
        return None
    start = pairs.get("start", 0)
    ticks = start_ticks(pid)
    if ticks is None or (start and ticks != start):
        return None  # the driver freed a dead process's memory
    moving, state = pairs.get("moving", STILL), pairs.get("state", RUNNING)
    if moving != STILL and time.monotonic_ns() >= pairs.get("until", 0):
        moving, state = STILL, CHECKPOINTED if moving == CHECKPOINTING else LOCKED
    return Proc(
        pid,
        state,
        pairs.get("memory", 0),
        bool(pairs.get("stuck", 0)),
        moving,
        pairs.get("until", 0),
        start,
    )


def read_procs(directory: Path) -> dict[int, Proc]:
    """Every live CUDA process of the double, by PID."""
    procs = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(directory / "procs"):
            if entry.isdigit() and (proc := read_proc(directory, int(entry))) is not None:
                procs[proc.pid] = proc
    return procs


def write_proc(directory: Path, proc: Proc) -> None:
    """Write a process's entry (hold :func:`locked` around a read-modify-write)."""
    fields = ("state", "memory", "stuck", "moving", "until", "start")
    text = "".join(f"{f} {int(getattr(proc, f))}\n" for f in fields)
    write_atomic(directory / "procs" / str(proc.pid), text)


def resident_bytes(procs: dict[int, Proc]) -> int:
    """The device memory of the processes whose memory is on the card."""
    return sum(p.memory for p in procs.values() if p.resident)


def lost(directory: Path) -> bool:
    """Whether the GPU fell off the bus."""
    return (directory / "lost").exists()


def read_progress(directory: Path, pid: int) -> tuple[int, int]:
    """A tenant process's (iterations, CLOCK_MONOTONIC ns of the last); (0, 0) if none."""
    try:
        data = (directory / "progress" / str(pid)).read_bytes()
    except FileNotFoundError:
        return (0, 0)
    if len(data) < PROGRESS.size:
        return (0, 0)
    count, last = PROGRESS.unpack_from(data)
    return int(count), int(last)


def nvml_view(directory: Path) -> tuple[bool, int, int, list[dict[str, object]]]:
    """What NVML shows of the double's card: lost, total, used, compute processes.

    A CHECKPOINTED process is not listed (as on the H200); a LOCKED one is, with
    its memory, but does no GPU work (``gated``: no utilisation samples).
    """
    config = read_config(directory)
    procs = read_procs(directory)
    listed: list[dict[str, object]] = [
        {"pid": p.pid, "usedGpuMemory": p.memory, "live": True, "gated": p.state != RUNNING}
        for p in sorted(procs.values(), key=lambda p: p.pid)
        if p.resident
    ]
    used = resident_bytes(procs) + config["foreign"]
    return lost(directory), config["capacity"], used, listed
