"""One real process attached to the simulated GPU, and how its CPU time is read."""

from __future__ import annotations

import os
import resource
import threading
from dataclasses import dataclass, field

from kiwid.linux.proc import read_stat

__all__ = ["Attachment"]


class _Descriptors:
    """The descriptors all attachments hold, within half of the soft open-file limit.

    Two per attachment; the rest of the limit is for the control socket's clients,
    /proc reads and the state file. At Debian's stock limit of 1024 attachments took
    every descriptor by ~500 tenants, and kiwid could accept no kiwictl connection
    any more. Beyond the budget, an attachment reads its process by path. One count
    for the whole process, as the limit is.
    """

    SHARE = 0.5

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = 0

    def reserve(self, count: int) -> bool:
        """Reserve ``count`` descriptors within the budget; False when it is spent."""
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        budget = float("inf") if soft == resource.RLIM_INFINITY else soft * self.SHARE
        with self._lock:
            if self._held + count > budget:
                return False
            self._held += count
            return True

    def release(self, count: int) -> None:
        """Give back descriptors :meth:`reserve` reserved."""
        with self._lock:
            self._held -= count


_DESCRIPTORS = _Descriptors()


@dataclass
class Attachment:
    """Mutable bookkeeping for one process on one simulated GPU.

    ``/proc/PID/schedstat`` and a pidfd are held open: a reaped process (and so a
    reused PID) reads ESRCH, the pidfd is readable once it exits (zombies too),
    and schedstat is the cheap CPU-time reading of each poll. Only within a budget
    of descriptors (see ``_Descriptors``): beyond it, ``/proc/PID/stat`` by path.
    """

    used_memory_bytes: int
    activity: str
    start_ticks: int
    """``/proc/PID/stat`` starttime: tells a reused PID apart."""
    samples: list[tuple[float, int]] = field(default_factory=list)
    """(clock s, CPU time) readings within the activity window."""
    pending: tuple[float, tuple[int, int]] | None = None
    """The reading ``processes()`` just took, used once by the ``active_pids()`` right
    after it (the daemon's poll): one read per process and poll, not two."""
    fd: int | None = None
    sched_fd: int | None = None
    swapped: bool = False
    """Its memory is "in host RAM": not listed, not on the card."""
    first_cpu: int = 0
    reserved: bool = False
    """It holds a reservation of two descriptors (see ``_Descriptors``)."""

    @classmethod
    def open(cls, pid: int, used_memory_bytes: int, activity: str) -> Attachment:
        """Start following a running process.

        Raises:
            ValueError: no running process has that PID.
        """
        stat = read_stat(pid) if type(pid) is int and pid > 0 else None
        if stat is None or stat.zombie:
            raise ValueError(f"no running process with pid {pid!r}")
        entry = cls(used_memory_bytes, activity, stat.start_ticks)
        entry.reserved = _DESCRIPTORS.reserve(2)
        try:
            if entry.reserved:
                entry.fd = os.pidfd_open(pid)
                entry.sched_fd = os.open(f"/proc/{pid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # out of descriptors, or an old kernel: read by path instead
            entry.close()
        first = entry.stat(pid)
        if first is None:
            entry.close()
            raise ValueError(f"no running process with pid {pid!r}")
        entry.first_cpu = first[0]
        return entry

    def stat(self, pid: int) -> tuple[int, int] | None:
        """``(cpu time, starttime)`` of the process, or ``None`` if it is gone.

        With a pidfd the CPU time comes in ns from the held ``schedstat`` (a third
        of the cost of ``stat``). Without, ``/proc/PID/stat`` (CPU time in clock
        ticks, zombies as gone); the unit is the same for all of one entry's samples.
        """
        if self.fd is None or self.sched_fd is None:
            stat = read_stat(pid)
            return None if stat is None or stat.zombie else (stat.cpu_ticks, stat.start_ticks)
        try:
            cpu_ns = int(os.pread(self.sched_fd, 128, 0).split(maxsplit=1)[0])
        except (OSError, ValueError):  # ESRCH: reaped (its PID may be someone else's now)
            return None
        return cpu_ns, self.start_ticks

    def close(self) -> None:
        """Close the held descriptors (safe to call twice)."""
        for fd in (self.fd, self.sched_fd):
            if fd is not None:
                os.close(fd)
        self.fd = self.sched_fd = None
        if self.reserved:
            self.reserved = False
            _DESCRIPTORS.release(2)
