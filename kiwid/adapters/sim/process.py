"""One real process attached to the simulated GPU, and how its CPU time is read."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kiwid.linux.proc import read_stat

__all__ = ["Attachment"]


@dataclass
class Attachment:
    """Mutable bookkeeping for one process on one simulated GPU.

    ``/proc/PID/schedstat`` and a pidfd are held open: a reaped process (and so a
    reused PID) reads ESRCH, the pidfd is readable once it exits (zombies too),
    and schedstat is the cheap CPU-time reading of each poll.
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
        try:
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
