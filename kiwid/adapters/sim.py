"""A simulated GPU backend driven by real processes (stdlib only; reads ``/proc``).

It stands in for NVML on machines without a GPU. Real PIDs are *attached* to a
simulated GPU with a memory footprint and an activity mode:

* ``"cpu"``: the process counts as bursting when it consumed CPU time (utime +
  stime of the process, not of its children) in the query window. A busy
  process is bursting, a sleeping one is idle, and a process frozen by the
  cgroup freezer has no samples, exactly like NVML.
* ``"active"``: always bursting, unless its cgroup is frozen (NVML shows no
  samples for a frozen process either).
* ``"idle"``: never bursting.

A process that exits (or whose PID is reused) drops out automatically.

Memory: each GPU has ``memory_bytes``; a process's footprint can be *swapped
out* (:meth:`SimBackend.swap_out`), after which it is missing from
:meth:`SimBackend.processes`, as a checkpointed process is missing from NVML's
list, and :meth:`SimBackend.swap_in` brings it back only if it fits beside the
resident processes (else :class:`SimOutOfMemory`, as the driver's restore
fails). The time a swap takes is the caller's to simulate.
"""

from __future__ import annotations

import json
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiwid.adapters.gpu import DeviceInfo, GpuBackendError, GpuLost, GpuProcess

__all__ = ["ACTIVITIES", "SimAttachment", "SimBackend", "SimOutOfMemory", "swap_in_persisted"]

GIB = 1024**3
ACTIVITIES = frozenset({"cpu", "active", "idle"})
"""The activity modes :meth:`SimBackend.attach` accepts."""

_PROC = Path("/proc")
_PENDING_FRESH_S = 0.05


class SimOutOfMemory(Exception):
    """A swap-in does not fit beside the resident processes of its simulated GPU."""


@dataclass(frozen=True)
class SimAttachment:
    """A process attached to a simulated GPU, as :meth:`SimBackend.attached` reports it.

    Attributes:
        pid: Host PID.
        index: The simulated GPU index.
        used_memory_bytes: The simulated device memory the process uses, in bytes.
        activity: ``"cpu"``, ``"active"`` or ``"idle"``.
    """

    pid: int
    index: int
    used_memory_bytes: int
    activity: str


@dataclass
class _Entry:
    """Mutable bookkeeping for one attachment."""

    used_memory_bytes: int
    activity: str
    start_ticks: int  # /proc/PID/stat starttime: tells a reused PID apart
    samples: list[tuple[float, int]] = field(default_factory=list)  # (clock s, cpu ticks)
    # The /proc reading processes() just took, used once by the active_pids() right
    # after it (the daemon's poll): one read per process and poll, not two.
    pending: tuple[float, tuple[int, int]] | None = None  # (time.monotonic(), stat)
    # /proc/PID/stat and /proc/PID/schedstat held open: a reaped process (and so a
    # reused PID) reads ESRCH; schedstat is the cheap CPU-time reading of each poll.
    fd: int | None = None  # pidfd: readable once the process exits (zombies too)
    sched_fd: int | None = None
    swapped: bool = False  # its memory is "in host RAM": not listed, not on the card


class SimBackend:
    """GPU backend that simulates ``devices`` GPUs of ``memory_bytes`` each.

    Thread-safe: one lock guards all state, so :meth:`attach` may be called from
    the control socket's thread while the poller queries.

    Args:
        devices: How many simulated GPUs (indices ``0 .. devices - 1``).
        memory_bytes: Memory of each simulated GPU in bytes.
        clock: Monotonic seconds; timestamps the CPU-time samples.
        persist: A JSON file that keeps the attachments across restarts of the
            daemon (as a real GPU keeps its processes); ``None``: in memory only.

    Raises:
        ValueError: ``devices`` or ``memory_bytes`` is negative.
    """

    name = "sim"

    def __init__(
        self,
        devices: int = 1,
        memory_bytes: int = 80 * GIB,
        clock: Callable[[], float] = time.monotonic,
        persist: Path | None = None,
    ) -> None:
        if devices < 0 or memory_bytes < 0:
            raise ValueError("devices and memory_bytes must not be negative")
        self._devices = tuple(
            DeviceInfo(i, f"GPU-sim-{i:012d}", "Kiwi simulated GPU", memory_bytes)
            for i in range(devices)
        )
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, int], _Entry] = {}  # (pid, index) -> entry
        self._lost: set[int] = set()
        self._exits = select.poll()  # the pidfds: one syscall tells who exited
        self._by_fd: dict[int, tuple[int, int]] = {}
        self._dirty = False
        self._persist = persist
        if persist is not None:
            self._load(persist)

    def devices(self) -> Sequence[DeviceInfo]:
        """List the simulated GPUs that are not lost.

        Returns:
            The GPUs, ordered by index.
        """
        with self._lock:
            return [d for d in self._devices if d.index not in self._lost]

    def attach(self, pid: int, index: int, used_memory_bytes: int, activity: str = "cpu") -> None:
        """Attach a real process to a simulated GPU (again: update its footprint and mode).

        Args:
            pid: Host PID of a running process.
            index: The simulated GPU index.
            used_memory_bytes: Simulated device memory the process uses, in bytes.
            activity: ``"cpu"``, ``"active"`` or ``"idle"`` (see the module docstring).

        Raises:
            ValueError: Unknown index, no such (live) process, negative or non-integer
                memory, or an unknown activity.
        """
        self._check_index(index)
        if type(used_memory_bytes) is not int or used_memory_bytes < 0:
            raise ValueError(f"used_memory_bytes must be an int >= 0, got {used_memory_bytes!r}")
        _check_activity(activity)
        stat = _read_stat(pid) if type(pid) is int and pid > 0 else None
        if stat is None:
            raise ValueError(f"no running process with pid {pid!r}")
        entry = _Entry(used_memory_bytes, activity, stat[1])
        try:
            entry.fd = os.pidfd_open(pid)
            entry.sched_fd = os.open(f"/proc/{pid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # out of descriptors, or an old kernel: read by path instead
            if entry.fd is not None:
                os.close(entry.fd)
            entry.fd = entry.sched_fd = None
        first = _entry_stat(pid, entry)
        if first is None:
            raise ValueError(f"no running process with pid {pid!r}")
        entry.samples = [(self._clock(), first[0])]
        with self._lock:
            self._drop((pid, index))
            self._entries[(pid, index)] = entry
            if entry.fd is not None:
                self._exits.register(entry.fd, select.POLLIN)
                self._by_fd[entry.fd] = (pid, index)
            self._dirty = True
            self._save()

    def detach(self, pid: int) -> bool:
        """Detach a process from every simulated GPU.

        Args:
            pid: Host PID.

        Returns:
            Whether the process was attached.
        """
        with self._lock:
            keys = [key for key in self._entries if key[0] == pid]
            for key in keys:
                self._drop(key)
            self._save()
            return bool(keys)

    def set_activity(self, pid: int, activity: str) -> None:
        """Change the activity mode of an attached process on every GPU it is on.

        Args:
            pid: Host PID.
            activity: ``"cpu"``, ``"active"`` or ``"idle"``.

        Raises:
            ValueError: Unknown activity, or the process is not attached.
        """
        _check_activity(activity)
        now = self._clock()
        with self._lock:
            entries = [entry for key, entry in self._entries.items() if key[0] == pid]
            if not entries:
                raise ValueError(f"pid {pid} is not attached")
            for entry in entries:
                entry.activity = activity
                stat = _entry_stat(pid, entry)
                entry.samples = [] if stat is None else [(now, stat[0])]

    def attached(self) -> list[SimAttachment]:
        """List the live attachments, ordered by GPU index then PID.

        Returns:
            One record per (process, GPU) attachment.
        """
        with self._lock:
            for index in range(len(self._devices)):
                self._prune(index)
            return [
                SimAttachment(pid, index, entry.used_memory_bytes, entry.activity)
                for (pid, index), entry in sorted(self._entries.items(), key=lambda kv: kv[0][::-1])
            ]

    def lose(self, index: int) -> None:
        """Make a simulated GPU fall off the bus: later queries raise :class:`GpuLost`.

        Args:
            index: The simulated GPU index.

        Raises:
            ValueError: Unknown index.
        """
        self._check_index(index)
        with self._lock:
            self._lost.add(index)

    def processes(self, index: int) -> Sequence[GpuProcess]:
        """List the live processes attached to a simulated GPU.

        Args:
            index: The simulated GPU index.

        Returns:
            One entry per process, ordered by PID.

        Raises:
            GpuLost: The GPU was marked lost with :meth:`lose`.
            GpuBackendError: Unknown index.
        """
        with self._lock:
            self._check_query(index)
            self._prune(index)
            self._save()
            return [
                GpuProcess(pid, entry.used_memory_bytes)
                for (pid, i), entry in sorted(self._entries.items())
                if i == index and not entry.swapped
            ]

    def swap_out(self, pids: Sequence[int]) -> dict[int, int]:
        """Take the memory of ``pids`` off their simulated GPUs (to "host RAM").

        Returns:
            The bytes moved per GPU index (attached PIDs only; others are ignored).
        """
        moved: dict[int, int] = {}
        with self._lock:
            for (pid, index), entry in self._entries.items():
                if pid in pids and not entry.swapped:
                    entry.swapped = True
                    moved[index] = moved.get(index, 0) + entry.used_memory_bytes
            self._dirty = True
            self._save()
        return moved

    def swap_in(self, pids: Sequence[int]) -> dict[int, int]:
        """Bring the memory of ``pids`` back, all or nothing.

        Returns:
            The bytes moved per GPU index.

        Raises:
            SimOutOfMemory: It does not fit beside the resident processes.
        """
        with self._lock:
            moved = self._check_swap_in(pids)
            for (pid, _), entry in self._entries.items():
                if pid in pids:
                    entry.swapped = False
            self._dirty = True
            self._save()
        return moved

    def check_swap_in(self, pids: Sequence[int]) -> None:
        """Raise :class:`SimOutOfMemory` if ``pids`` would not fit back now."""
        with self._lock:
            self._check_swap_in(pids)

    def resident_of(self, pids: Sequence[int]) -> int:
        """The bytes of ``pids`` on their simulated GPUs."""
        with self._lock:
            return sum(
                e.used_memory_bytes
                for (p, _), e in self._entries.items()
                if p in pids and not e.swapped
            )

    def swapped_of(self, pids: Sequence[int]) -> int:
        """The bytes of ``pids`` swapped out ("in host RAM")."""
        with self._lock:
            return sum(
                e.used_memory_bytes
                for (p, _), e in self._entries.items()
                if p in pids and e.swapped
            )

    def _check_swap_in(self, pids: Sequence[int]) -> dict[int, int]:
        moved: dict[int, int] = {}
        for (pid, index), entry in self._entries.items():
            if pid in pids and entry.swapped:
                moved[index] = moved.get(index, 0) + entry.used_memory_bytes
        for index, nbytes in moved.items():
            resident = self._resident_bytes(index)
            total = self._devices[index].memory_total_bytes
            if resident + nbytes > total:
                raise SimOutOfMemory(
                    f"GPU {index}: {nbytes} bytes do not fit beside {resident} "
                    f"resident bytes of {total}"
                )
        return moved

    def resident_bytes(self, index: int) -> int:
        """The memory of the processes on a simulated GPU that are not swapped out."""
        with self._lock:
            return self._resident_bytes(index)

    def _resident_bytes(self, index: int) -> int:
        return sum(
            e.used_memory_bytes
            for (_, i), e in self._entries.items()
            if i == index and not e.swapped
        )

    def active_pids(self, index: int, window_s: float) -> frozenset[int]:
        """Return the attached PIDs that are bursting on a simulated GPU.

        In ``"cpu"`` mode the CPU time now is compared with the oldest sample taken
        within the last ``window_s`` seconds or, when there is none, the newest older
        sample: with one query per window that is "since the previous query".

        Args:
            index: The simulated GPU index.
            window_s: Look-back window in seconds.

        Returns:
            The bursting PIDs.

        Raises:
            GpuLost: The GPU was marked lost with :meth:`lose`.
            GpuBackendError: Unknown index.
        """
        with self._lock:
            self._check_query(index)
            now = self._clock()
            active: set[int] = set()
            for (pid, i), entry in list(self._entries.items()):
                if i != index:
                    continue
                if entry.activity == "idle" or entry.swapped:
                    continue
                pending, entry.pending = entry.pending, None
                if pending is not None and time.monotonic() - pending[0] < _PENDING_FRESH_S:
                    stat: tuple[int, int] | None = pending[1]
                else:
                    stat = _entry_stat(pid, entry)
                if stat is None or stat[1] != entry.start_ticks:  # exited, or PID reused
                    self._drop((pid, i))
                    continue
                if entry.activity == "active":
                    if not _frozen(pid):
                        active.add(pid)
                    continue
                samples = entry.samples
                recent = [k for k, (t, _) in enumerate(samples) if t >= now - window_s]
                base = recent[0] if recent else len(samples) - 1
                if base >= 0 and stat[0] > samples[base][1]:
                    active.add(pid)
                entry.samples = [*samples[max(base, 0) :], (now, stat[0])]
            self._save()
            return frozenset(active)

    def close(self) -> None:
        """Forget every attachment."""
        with self._lock:
            for key in list(self._entries):
                self._drop(key)

    def _check_index(self, index: int) -> None:
        """Raise ``ValueError`` unless ``index`` names a simulated GPU."""
        if type(index) is not int or not 0 <= index < len(self._devices):
            raise ValueError(f"no simulated GPU with index {index!r}")

    def _check_query(self, index: int) -> None:
        """Raise the errors NVML would for a query on ``index`` (lock held)."""
        if type(index) is not int or not 0 <= index < len(self._devices):
            raise GpuBackendError(f"no simulated GPU with index {index!r}")
        if index in self._lost:
            raise GpuLost(index, "simulated loss")

    def _drop(self, key: tuple[int, int]) -> None:
        """Forget an attachment and close its descriptor (lock held)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            if entry.fd is not None:
                self._exits.unregister(entry.fd)
                del self._by_fd[entry.fd]
            for fd in (entry.fd, entry.sched_fd):
                if fd is not None:
                    os.close(fd)
            self._dirty = True

    def _save(self) -> None:
        """Write the attachments to the persist file, if any and changed (lock held)."""
        if self._persist is None or not self._dirty:
            return
        self._dirty = False
        doc = {
            "memory_bytes": [d.memory_total_bytes for d in self._devices],
            "entries": [
                [pid, index, e.used_memory_bytes, e.activity, e.start_ticks, e.swapped]
                for (pid, index), e in sorted(self._entries.items())
            ],
        }
        tmp = self._persist.with_name(self._persist.name + ".tmp")
        try:
            self._persist.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(doc))
            tmp.replace(self._persist)
        except OSError:
            self._dirty = True  # try again at the next change

    def _load(self, path: Path) -> None:
        """Re-attach the live processes of a previous run (a PID reused since is skipped)."""
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        for item in _persisted_entries(doc):
            try:
                pid, index, memory, activity, start_ticks, *rest = item
                stat = _read_stat(int(pid))
                if stat is not None and stat[1] == start_ticks:
                    self.attach(int(pid), int(index), int(memory), str(activity))
                    if rest and rest[0]:
                        self._entries[(int(pid), int(index))].swapped = True
            except (TypeError, ValueError):
                continue

    def _prune(self, index: int) -> None:
        """Drop a GPU's attachments whose process exited or whose PID was reused.

        Only that GPU's: the daemon queries every GPU each poll (lock held).
        """
        for fd, _ in self._exits.poll(0):  # exited, zombies included, on any GPU
            self._drop(self._by_fd[fd])
        for key, entry in list(self._entries.items()):
            if key[1] != index:
                continue
            if entry.activity != "cpu" and entry.fd is not None:
                continue  # its pidfd says when it exits; no CPU time needed
            stat = _entry_stat(key[0], entry)
            if stat is None or stat[1] != entry.start_ticks:
                self._drop(key)
            else:
                entry.pending = (time.monotonic(), stat)


def _persisted_entries(doc: object) -> list[Any]:
    """The attachments of a persist file (a bare list in files of older versions)."""
    if isinstance(doc, dict):
        doc = doc.get("entries")
    return doc if isinstance(doc, list) else []


def swap_in_persisted(path: Path, pids: Sequence[int]) -> bool:
    """Bring ``pids`` back in a persist file, without a running daemon (recover).

    All or nothing, and only if they fit beside the live resident processes: the
    file is loaded into a :class:`SimBackend` (which drops exited processes), the
    swap-in done there, and the result saved back.

    Returns:
        Whether the file listed any of them as swapped out.

    Raises:
        SimOutOfMemory: they do not fit.
    """
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    sizes = doc.get("memory_bytes") if isinstance(doc, dict) else None
    if not sizes:
        return False  # a file from before swapping: nothing in it is swapped
    backend = SimBackend(len(sizes), max(int(n) for n in sizes), persist=path)
    try:
        return bool(backend.swap_in(pids))
    finally:
        backend.close()


def _check_activity(activity: str) -> None:
    """Raise ``ValueError`` unless ``activity`` is a known mode."""
    if activity not in ACTIVITIES:
        raise ValueError(f"activity must be one of {sorted(ACTIVITIES)}, got {activity!r}")


def _entry_stat(pid: int, entry: _Entry) -> tuple[int, int] | None:
    """``(cpu time, starttime)`` of an attached process, or ``None`` if it is gone.

    With a pidfd (exits, zombies included, are found by polling it) the CPU time
    comes in ns from the held ``schedstat`` (a third of the cost of ``stat``).
    Without, :func:`_read_stat` (CPU time in clock ticks, zombies as gone); the
    unit is the same for all of one entry's samples.
    """
    if entry.fd is None or entry.sched_fd is None:
        return _read_stat(pid)
    try:
        cpu_ns = int(os.pread(entry.sched_fd, 128, 0).split(maxsplit=1)[0])
    except (OSError, ValueError):  # ESRCH: reaped (its PID may be someone else's now)
        return None
    return cpu_ns, entry.start_ticks


def _read_stat(pid: int) -> tuple[int, int] | None:
    """Return ``(utime + stime, starttime)`` in clock ticks, or ``None`` if not alive.

    A zombie (exited, not yet reaped) counts as not alive.
    """
    try:  # os.open/os.read: pathlib's path building costs more than the read itself
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        text = os.read(fd, 4096).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)
    return _parse_stat(text)


def _parse_stat(text: str) -> tuple[int, int] | None:
    """``(utime + stime, starttime)`` from a ``/proc/PID/stat`` text; ``None`` for a zombie."""
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[11]) + int(fields[12]), int(fields[19])


def _frozen(pid: int) -> bool:
    """Whether the cgroup v2 or v1 freezer has frozen ``pid``'s cgroup."""
    try:
        lines = (_PROC / str(pid) / "cgroup").read_text().splitlines()
        mounts = (_PROC / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        for mount in mounts:
            left, _, right = mount.partition(" - ")
            fstype, _, options = right.split(" ", 2)
            mount_point = left.split(" ")[4]
            if hierarchy == "0" and fstype == "cgroup2":
                state, frozen = "cgroup.events", "frozen 1"
            elif (
                fstype == "cgroup" and "freezer" in controllers.split(",") and "freezer" in options
            ):
                state, frozen = "freezer.state", "FROZEN"
            else:
                continue
            try:
                text = Path(mount_point + path.rstrip("/"), state).read_text()
            except OSError:
                continue
            if frozen in text.splitlines():
                return True
    return False
