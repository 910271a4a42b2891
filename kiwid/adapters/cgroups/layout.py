"""Cgroups as kiwid names them: refs, where the hierarchies are mounted, the errors.

A tenant is named by a :class:`CgroupRef`: its cgroup path in the cgroup2
hierarchy and in the v1 ``freezer`` hierarchy, as ``/proc/PID/cgroup`` shows them.
:class:`CgroupLayout` says where those hierarchies are mounted (``/sys/fs/cgroup``
on a pure v2 host; ``/sys/fs/cgroup/unified`` and ``/sys/fs/cgroup/freezer`` on a
hybrid one).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kiwid.linux.mountinfo import parse_mountinfo
from kiwid.linux.proc import ProcError, read_proc_cgroup

_GONE = (errno.ENOENT, errno.ENODEV, errno.ESRCH)  # cgroup removed / process exited


@dataclass(frozen=True)
class CgroupRef:
    """Where a tenant lives in each cgroup hierarchy.

    Attributes:
        v2: Path in the cgroup2 hierarchy, relative to its root and starting with
            ``/`` (e.g. ``/system.slice/docker-<id>.scope``); ``None`` if absent.
        v1_freezer: Path in the v1 freezer hierarchy, likewise; ``None`` if absent.
    """

    v2: str | None
    v1_freezer: str | None


class CgroupError(Exception):
    """Base class of every error this module raises."""


class FreezeError(CgroupError):
    """A freeze or thaw was refused or failed."""


class FreezeTimeout(FreezeError):
    """The kernel did not confirm a freeze in time; the cgroup was thawed again.

    Attributes:
        cgroup: The cgroup directory that did not freeze.
    """

    def __init__(self, cgroup: Path, timeout_s: float) -> None:
        super().__init__(f"{cgroup} did not freeze within {timeout_s:g} s; thawed it again")
        self.cgroup = cgroup


class CgroupGone(FreezeError):
    """The tenant's cgroup no longer exists (the tenant exited)."""


class IsolationError(FreezeError):
    """A process could not be moved into a cgroup of its own (so it cannot be frozen)."""


@dataclass(frozen=True)
class CgroupLayout:
    """Where the cgroup hierarchies are mounted.

    Attributes:
        v2_root: Mount point of the cgroup2 hierarchy, or ``None``.
        v1_freezer_root: Mount point of the v1 freezer hierarchy, or ``None``.
    """

    v2_root: Path | None
    v1_freezer_root: Path | None

    @classmethod
    def from_mountinfo(cls, text: str) -> CgroupLayout:
        """Find the cgroup mounts in the text of ``/proc/self/mountinfo``.

        Args:
            text: The file's content.

        Returns:
            The layout; the first mount of each kind wins.
        """
        v2: Path | None = None
        v1: Path | None = None
        for mount in parse_mountinfo(text):
            if mount.fstype == "cgroup2" and v2 is None:
                v2 = mount.mount_point
            elif mount.fstype == "cgroup" and "freezer" in mount.super_options and v1 is None:
                v1 = mount.mount_point
        return cls(v2_root=v2, v1_freezer_root=v1)

    @classmethod
    def detect(cls, mountinfo: Path = Path("/proc/self/mountinfo")) -> CgroupLayout:
        """Read the mount table of the calling process.

        Args:
            mountinfo: The mountinfo file to read.

        Returns:
            The layout of this host.

        Raises:
            CgroupError: The mount table cannot be read.
        """
        try:
            return cls.from_mountinfo(mountinfo.read_text())
        except OSError as exc:
            raise CgroupError(f"cannot read {mountinfo}: {exc}") from exc

    def dirs(self, ref: CgroupRef) -> tuple[Path | None, Path | None]:
        """Return the v2 and v1 freezer directories of ``ref``; ``None`` for the root.

        Raises:
            FreezeError: A path is relative or contains ``..``.
        """
        return _resolve(self.v2_root, ref.v2), _resolve(self.v1_freezer_root, ref.v1_freezer)


def _resolve(root: Path | None, path: str | None) -> Path | None:
    if root is None or path is None or _is_root(path):
        return None
    rel = PurePosixPath(path)
    if not rel.is_absolute() or ".." in rel.parts:
        raise FreezeError(f"bad cgroup path {path!r}: it must be absolute without '..'")
    return root.joinpath(*rel.parts[1:])


def _is_root(path: str | None) -> bool:
    return path is not None and PurePosixPath(path) == PurePosixPath("/")


def cgroup_of(pid: int | str = "self") -> CgroupRef:
    """Read a process's cgroup2 and v1 freezer paths from ``/proc/PID/cgroup``.

    Args:
        pid: The process ID, or ``"self"``.

    Returns:
        Its cgroups; a hierarchy the host does not have is ``None``.

    Raises:
        CgroupError: The process is gone or its cgroup file cannot be read.
    """
    try:
        paths = read_proc_cgroup(pid)
    except ProcError as exc:
        raise CgroupError(f"cannot read the cgroups of process {pid}: {exc}") from exc
    return CgroupRef(v2=paths.v2, v1_freezer=paths.v1_freezer)


def cgroup_ids(layout: CgroupLayout, ref: CgroupRef) -> tuple[int | None, int | None]:
    """The inode numbers of ``ref``'s v2 and v1 freezer directories (``None``: none).

    A cgroup's inode number is its identity for the kernel: a cgroup removed and
    made again under the same path has another. kiwid records it when it gates and
    checks it before it thaws, so it never thaws a cgroup it did not freeze.

    Raises:
        FreezeError: A path is relative or contains ``..``.
    """
    ids: list[int | None] = []
    for directory in layout.dirs(ref):
        try:
            ids.append(directory.stat().st_ino if directory is not None else None)
        except OSError:
            ids.append(None)
    return ids[0], ids[1]


def populated(layout: CgroupLayout, ref: CgroupRef) -> bool:
    """Whether ``ref``'s cgroup, or one below it, still holds a process.

    cgroup2 says so in ``cgroup.events`` (``populated``, descendants included); the
    v1 freezer hierarchy has only each cgroup's ``cgroup.procs``. A cgroup that is
    gone, or unreadable, holds nothing kiwid could gate; so does a root or a
    hierarchy this host does not mount.

    Raises:
        FreezeError: A path is relative or contains ``..``.
    """
    v2, v1 = layout.dirs(ref)
    if v2 is not None:
        try:
            return "populated 1" in (v2 / "cgroup.events").read_text().splitlines()
        except OSError:
            return False
    if v1 is not None:
        for directory, _, files in os.walk(v1):  # a vanished directory ends its branch
            if "cgroup.procs" in files:
                try:
                    if Path(directory, "cgroup.procs").read_text().strip():
                        return True
                except OSError:
                    continue
    return False


def _control(file: Path, value: str | None = None) -> str:
    """Read a cgroup control file, or write ``value`` to it.

    Raises:
        CgroupGone: The cgroup was removed (the tenant exited).
        FreezeError: Any other failure.
    """
    try:
        if value is None:
            return file.read_text()
        file.write_text(value)
    except OSError as exc:
        if exc.errno in _GONE:
            raise CgroupGone(f"{file.parent} no longer exists") from exc
        action = "read" if value is None else f"write {value!r} to"
        raise FreezeError(f"cannot {action} {file}: {exc}") from exc
    return value
