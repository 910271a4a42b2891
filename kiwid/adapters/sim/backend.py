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
resident processes and the memory no process shows (:meth:`SimBackend.set_foreign`;
else :class:`SimOutOfMemory`, as the driver's restore fails).
:meth:`SimBackend.free_memory` is what NVML's free memory would say. The time a
swap takes is the caller's to simulate (:mod:`kiwid.adapters.sim.link`).
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kiwid.adapters.gpu import DeviceInfo, GpuBackendError, GpuLost, GpuProcess
from kiwid.adapters.sim.faults import SimFaults
from kiwid.adapters.sim.persist import PersistFile
from kiwid.adapters.sim.process import Attachment
from kiwid.linux.freezer import is_frozen

__all__ = ["ACTIVITIES", "SimAttachment", "SimBackend", "SimOutOfMemory"]

GIB = 1024**3
ACTIVITIES = frozenset({"cpu", "active", "idle"})
"""The activity modes :meth:`SimBackend.attach` accepts."""

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
        self._entries: dict[tuple[int, int], Attachment] = {}  # (pid, index) -> entry
        self._lost: set[int] = set()
        self._foreign: dict[int, int] = {}  # index -> bytes no process shows
        self._exits = select.poll()  # the pidfds: one syscall tells who exited
        self._by_fd: dict[int, tuple[int, int]] = {}
        self._dirty = False
        self._persist = None if persist is None else PersistFile(persist)
        self.faults = SimFaults()
        """Faults injected into its swaps (``sim-fault``; not kept across a restart)."""
        if self._persist is not None:
            for pid, index, memory, activity, swapped in self._persist.live_entries():
                self.attach(pid, index, memory, activity)
                self._entries[(pid, index)].swapped = swapped

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
        entry = Attachment.open(pid, used_memory_bytes, activity)
        entry.samples = [(self._clock(), entry.first_cpu)]
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
                stat = entry.stat(pid)
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

    def resident_of(self, pids: Sequence[int]) -> dict[int, int]:
        """The bytes of ``pids`` on each simulated GPU (by index), not swapped out."""
        return self._bytes_of(pids, swapped=False)

    def swapped_of(self, pids: Sequence[int]) -> dict[int, int]:
        """The bytes of ``pids`` swapped out ("in host RAM"), by GPU index."""
        return self._bytes_of(pids, swapped=True)

    def _bytes_of(self, pids: Sequence[int], *, swapped: bool) -> dict[int, int]:
        out: dict[int, int] = {}
        with self._lock:
            for (pid, index), e in self._entries.items():
                if pid in pids and e.swapped is swapped:
                    out[index] = out.get(index, 0) + e.used_memory_bytes
        return out

    def free_memory(self, index: int) -> int:
        """The simulated GPU's free memory: its size less what is on it and ``foreign``."""
        with self._lock:
            self._check_query(index)
            used = self._resident_bytes(index) + self._foreign.get(index, 0)
            return max(0, self._devices[index].memory_total_bytes - used)

    def set_foreign(self, index: int, nbytes: int) -> None:
        """Memory on a simulated GPU that no process shows (the driver, a display server)."""
        with self._lock:
            self._check_index(index)
            if nbytes < 0:
                raise ValueError(f"foreign memory must be >= 0 bytes, not {nbytes}")
            self._foreign[index] = nbytes

    def _check_swap_in(self, pids: Sequence[int]) -> dict[int, int]:
        moved: dict[int, int] = {}
        for (pid, index), entry in self._entries.items():
            if pid in pids and entry.swapped:
                moved[index] = moved.get(index, 0) + entry.used_memory_bytes
        for index, nbytes in moved.items():
            resident = self._resident_bytes(index) + self._foreign.get(index, 0)
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
                    stat = entry.stat(pid)
                if stat is None or stat[1] != entry.start_ticks:  # exited, or PID reused
                    self._drop((pid, i))
                    continue
                if entry.activity == "active":
                    if not is_frozen(pid):
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
            entry.close()
            self._dirty = True

    def _save(self) -> None:
        """Write the attachments to the persist file, if any and changed (lock held)."""
        if self._persist is None or not self._dirty:
            return
        entries = [
            (pid, index, e.used_memory_bytes, e.activity, e.start_ticks, e.swapped)
            for (pid, index), e in sorted(self._entries.items())
        ]
        sizes = [d.memory_total_bytes for d in self._devices]
        self._dirty = not self._persist.save(sizes, entries)  # try again at the next change

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
            stat = entry.stat(key[0])
            if stat is None or stat[1] != entry.start_ticks:
                self._drop(key)
            else:
                entry.pending = (time.monotonic(), stat)


def _check_activity(activity: str) -> None:
    """Raise ``ValueError`` unless ``activity`` is a known mode."""
    if activity not in ACTIVITIES:
        raise ValueError(f"activity must be one of {sorted(ACTIVITIES)}, got {activity!r}")
