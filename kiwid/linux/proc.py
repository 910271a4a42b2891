"""``/proc/PID/...``: the one parser of each file kiwid reads there.

* ``/proc/PID/cgroup``: a process's cgroup2 path and its v1 paths;
* ``/proc/PID/stat``: run state, CPU time and start time (which tells a PID that
  was reused apart from the process it named before);
* ``/proc/PID/status``: the real and effective user IDs;
* ``/proc/PID/comm``: the program's name;
* ``/proc/PID/cmdline`` and ``/proc/PID/exe``: the program and its arguments;
* ``/proc/PID/maps``: the files a process has mapped (the libraries it uses).

Every reader returns ``None`` (or raises :class:`ProcessGone`) for a process that
is gone, so callers never see a bare ``OSError`` for the common race.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "AccessDenied",
    "ProcCgroups",
    "ProcError",
    "ProcStat",
    "ProcessGone",
    "alive",
    "comm",
    "command_line",
    "executable",
    "mapped_files",
    "parse_maps",
    "parse_proc_cgroup",
    "parse_stat",
    "read_proc_cgroup",
    "read_stat",
    "uids",
]

PROC = "/proc"


class ProcError(Exception):
    """Base class of the errors this module raises."""


class ProcessGone(ProcError):
    """The process exited (or never existed)."""


class AccessDenied(ProcError):
    """The kernel refused to tell about the process (kiwid is not root?)."""


@dataclass(frozen=True)
class ProcCgroups:
    """The cgroups of one process, parsed from ``/proc/PID/cgroup``.

    Attributes:
        v2: Path in the cgroup2 hierarchy (the ``0::`` line), or ``None``.
        v1_freezer: Path in the v1 hierarchy that has the ``freezer`` controller.
        v1: Every v1 line: controller (``cpu``, ``name=systemd``, ...) -> path.
    """

    v2: str | None
    v1_freezer: str | None
    v1: Mapping[str, str] = field(default_factory=dict)


def parse_proc_cgroup(text: str) -> ProcCgroups:
    """Parse the text of ``/proc/PID/cgroup`` (v1, v2 or hybrid layout).

    Each line is ``hierarchy-id:controller-list:path``; the path is the rest of
    the line, colons included (the kernel does not escape it).
    """
    v2: str | None = None
    freezer: str | None = None
    v1: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
            continue
        for controller in controllers.split(","):
            v1[controller] = path
            if controller == "freezer":
                freezer = path
    return ProcCgroups(v2=v2, v1_freezer=freezer, v1=v1)


def _read(pid: int | str, name: str, whole: int = 0) -> str:
    """Read ``/proc/<pid>/<name>`` (os.open/os.read: cheaper than pathlib here).

    One read of up to 64 KiB, enough for every small file; ``whole``: read on to
    the end, up to that many bytes (``maps`` runs long and comes a page at a time).

    Raises:
        ProcessGone: the process does not exist (any more).
        AccessDenied: the file cannot be read for another reason.
    """
    try:
        fd = os.open(f"{PROC}/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError) as err:
        raise ProcessGone(f"process {pid} is gone") from err
    except OSError as err:
        raise AccessDenied(f"cannot read {PROC}/{pid}/{name}: {err.strerror}") from err
    chunks: list[bytes] = []
    try:
        chunks.append(os.read(fd, 65536))
        size = len(chunks[0])
        while whole and size < whole and chunks[-1]:
            chunks.append(os.read(fd, 1 << 20))
            size += len(chunks[-1])
    except OSError as err:
        if err.errno == errno.ESRCH:
            raise ProcessGone(f"process {pid} is gone") from err
        raise AccessDenied(f"cannot read {PROC}/{pid}/{name}: {err.strerror}") from err
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "surrogateescape")


def read_proc_cgroup(pid: int | str) -> ProcCgroups:
    """Read and parse ``/proc/<pid>/cgroup``.

    Raises:
        ProcessGone: the process does not exist (any more).
        AccessDenied: the file cannot be read.
    """
    return parse_proc_cgroup(_read(pid, "cgroup"))


@dataclass(frozen=True)
class ProcStat:
    """What kiwid reads from ``/proc/PID/stat``.

    Attributes:
        state: The one-letter run state (``R``, ``S``, ``T``, ``Z``...).
        cpu_ticks: User plus system CPU time, in clock ticks.
        start_ticks: When the process started, in clock ticks since boot: with the
            PID it names one process for good (a reused PID has another).
    """

    state: str
    cpu_ticks: int
    start_ticks: int

    @property
    def zombie(self) -> bool:
        """Whether it exited and waits to be reaped (it runs nothing)."""
        return self.state in ("Z", "X")


def parse_stat(text: str) -> ProcStat:
    """Parse the text of ``/proc/PID/stat`` (the command name may hold spaces and ')').

    Raises:
        ValueError: the text is not a stat line.
    """
    try:
        fields = text[text.rindex(")") + 2 :].split()
        return ProcStat(fields[0], int(fields[11]) + int(fields[12]), int(fields[19]))
    except IndexError as err:
        raise ValueError(f"not a /proc/PID/stat line: {text[:80]!r}") from err


def read_stat(pid: int) -> ProcStat | None:
    """``/proc/<pid>/stat``, or ``None`` if the process is gone or unreadable."""
    try:
        return parse_stat(_read(pid, "stat"))
    except (ProcError, ValueError):
        return None


def alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, given ``start_ticks``, is that process."""
    stat = read_stat(pid)
    if stat is None or stat.zombie:
        return False
    return start_ticks is None or stat.start_ticks == start_ticks


def uids(pid: int) -> tuple[int, int] | None:
    """The real and effective user IDs of a process (``None``: gone or unreadable)."""
    try:
        text = _read(pid, "status")
    except ProcError:
        return None
    for line in text.splitlines():
        if line.startswith("Uid:"):
            values = line.split()[1:3]
            if len(values) == 2 and all(v.isdigit() for v in values):
                return int(values[0]), int(values[1])
    return None


def comm(pid: int) -> str | None:
    """The name of the program a process runs (``None``: gone or unreadable).

    ``comm``, not the ``exe`` link: a runtime's init and a container's program
    live in another mount namespace, where the link reads just ``/``.
    """
    try:
        return _read(pid, "comm").strip()
    except ProcError:
        return None


def command_line(pid: int) -> tuple[str, ...] | None:
    """The arguments a process was started with, ``argv[0]`` first.

    ``None``: gone, unreadable, or a kernel thread (which has none).
    """
    try:
        text = _read(pid, "cmdline", whole=1 << 20)
    except ProcError:
        return None
    args = tuple(text.split("\0"))
    if args and args[-1] == "":
        args = args[:-1]
    return args or None


def executable(pid: int) -> str | None:
    """The path of the program a process runs, as its mount namespace names it.

    ``None``: gone or unreadable.
    """
    try:
        return str(Path(f"{PROC}/{pid}/exe").readlink())
    except OSError:
        return None


def mapped_files(pid: int) -> frozenset[str] | None:
    """The files a process has mapped: the path column of ``/proc/PID/maps``.

    Pseudo-mappings such as ``[heap]`` are left out. ``None``: gone or unreadable.
    """
    try:
        text = _read(pid, "maps", whole=64 << 20)
    except ProcError:
        return None
    return parse_maps(text)


def parse_maps(text: str) -> frozenset[str]:
    """The paths in the text of a ``/proc/PID/maps`` (a deleted file keeps its suffix)."""
    paths: set[str] = set()
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            paths.add(fields[5])
    return frozenset(paths)
