"""Freeze and thaw tenants through the cgroup freezer (stdlib only).

A tenant is named by a :class:`CgroupRef`: its cgroup path in the cgroup2
hierarchy and in the v1 ``freezer`` hierarchy, as ``/proc/PID/cgroup`` shows them.
:class:`CgroupLayout` says where those hierarchies are mounted (``/sys/fs/cgroup``
on a pure v2 host; ``/sys/fs/cgroup/unified`` and ``/sys/fs/cgroup/freezer`` on a
hybrid one).

:class:`Freezer` prefers cgroup2 (``cgroup.freeze`` = 1, then ``frozen 1`` in
``cgroup.events``) and falls back to v1 (``freezer.state`` = ``FROZEN``) when the
tenant has no usable v2 cgroup. A freeze that the kernel does not confirm before
the deadline is undone, so a tenant is never left half-frozen. kiwid refuses to
freeze the root cgroup or any cgroup that contains kiwid itself.

:func:`isolate_process` moves a bare process (one not in a container) into a
cgroup of its own so that it can be frozen without its neighbours.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kiwid.linux.mountinfo import parse_mountinfo
from kiwid.linux.proc import ProcError, read_proc_cgroup

__all__ = [
    "CgroupError",
    "CgroupGone",
    "CgroupLayout",
    "CgroupRef",
    "FreezeError",
    "FreezeTimeout",
    "Freezer",
    "IsolationError",
    "cgroup_ids",
    "cgroup_of",
    "isolate_process",
    "remove_isolation",
]

_FIRST_POLL_S = 0.0002  # first wait between two reads of the freezer state
_MAX_POLL_S = 0.01  # the backoff doubles up to this
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


def _v2_frozen(directory: Path) -> bool:
    return "frozen 1" in _control(directory / "cgroup.events").splitlines()


def _v1_state(directory: Path) -> str:
    return _control(directory / "freezer.state").strip()


class Freezer:
    """Freezes and thaws tenants' cgroups, v2 first, v1 as the fallback."""

    def __init__(
        self, layout: CgroupLayout, timeout_s: float = 2.0, *, own: CgroupRef | None = None
    ) -> None:
        """Create a freezer.

        Args:
            layout: Where the hierarchies are mounted.
            timeout_s: How long a freeze may take before it is undone, in seconds.
                The state is polled only before the deadline, so 0 never confirms.
            own: kiwid's own cgroups, which it refuses to freeze; read from
                ``/proc/self/cgroup`` at every freeze when ``None``.
        """
        self.layout = layout
        self.timeout_s = timeout_s
        self._own = own

    def freeze(self, ref: CgroupRef) -> None:
        """Freeze a tenant and wait until the kernel confirms it.

        Args:
            ref: The tenant's cgroups.

        Raises:
            FreezeError: No usable freezer (e.g. the tenant is in the root cgroup), or
                the cgroup contains kiwid itself, or a control file cannot be written.
            CgroupGone: The cgroup no longer exists.
            FreezeTimeout: Not frozen within ``timeout_s``; the cgroup was thawed again.
        """
        v2, v1 = self.layout.dirs(ref)
        own_v2, own_v1 = self.layout.dirs(self._own or cgroup_of("self"))
        if v2 is not None and not v2.is_dir():
            raise CgroupGone(f"{v2} no longer exists")
        if v2 is not None and (v2 / "cgroup.freeze").exists():
            _refuse_own(v2, own_v2)
            self._freeze_v2(v2)
        elif v1 is not None:
            _refuse_own(v1, own_v1)
            self._freeze_v1(v1)
        elif _is_root(ref.v2) or _is_root(ref.v1_freezer):
            raise FreezeError(
                f"refusing to freeze the root cgroup of {ref}: that would freeze "
                "every process on the host, kiwid included"
            )
        else:
            raise FreezeError(f"no usable freezer for {ref} on {self.layout}")

    def _freeze_v2(self, directory: Path) -> None:
        self._freeze(directory / "cgroup.freeze", "1", "0", lambda: _v2_frozen(directory))

    def _freeze_v1(self, directory: Path) -> None:
        if not directory.is_dir():
            raise CgroupGone(f"{directory} no longer exists")

        def frozen() -> bool:
            state = _v1_state(directory)
            if state == "FREEZING":  # re-kick tasks that slipped through (forks, wakeups)
                _control(directory / "freezer.state", "FROZEN")
            return state == "FROZEN"

        self._freeze(directory / "freezer.state", "FROZEN", "THAWED", frozen)

    def _freeze(self, file: Path, on: str, off: str, done: Callable[[], bool]) -> None:
        """Write ``on``, wait for ``done``; on timeout or any error write ``off`` again."""
        _control(file, on)
        frozen = False
        try:
            frozen = self._wait(done)
        finally:
            if not frozen:  # never leave a half-frozen tenant behind
                with contextlib.suppress(CgroupGone):
                    _control(file, off)
        if not frozen:
            raise FreezeTimeout(file.parent, self.timeout_s)

    def thaw(self, ref: CgroupRef) -> None:
        """Thaw a tenant in every hierarchy where it has a cgroup.

        Both v2 and v1 are thawed, since something else may have frozen either. A
        cgroup that no longer exists is fine: the tenant exited.

        Args:
            ref: The tenant's cgroups.

        Raises:
            FreezeError: A control file exists but cannot be written (after trying
                every hierarchy).
        """
        first_error: FreezeError | None = None
        v2, v1 = self.layout.dirs(ref)
        targets = [(v2, "cgroup.freeze", "0"), (v1, "freezer.state", "THAWED")]
        for directory, name, value in targets:
            if directory is None:
                continue
            file = directory / name
            if not file.exists():
                continue  # tenant gone, or a kernel without this freezer
            try:
                _control(file, value)
            except CgroupGone:
                continue
            except FreezeError as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def is_frozen(self, ref: CgroupRef) -> bool:
        """Whether the tenant is frozen in any hierarchy.

        Args:
            ref: The tenant's cgroups.

        Returns:
            ``True`` if v2 reports ``frozen 1`` or v1 reports ``FROZEN``; a missing
            cgroup is not frozen.

        Raises:
            FreezeError: A control file exists but cannot be read.
        """
        v2, v1 = self.layout.dirs(ref)
        try:
            if v2 is not None and v2.is_dir() and _v2_frozen(v2):
                return True
            return v1 is not None and v1.is_dir() and _v1_state(v1) == "FROZEN"
        except CgroupGone:
            return False

    def _wait(self, done: Callable[[], bool]) -> bool:
        """Poll ``done`` with a doubling backoff until it holds or the deadline passes."""
        deadline = time.monotonic() + self.timeout_s
        delay = _FIRST_POLL_S
        while (remaining := deadline - time.monotonic()) > 0:
            if done():
                return True
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _MAX_POLL_S)
        return False


def _refuse_own(target: Path, own_dir: Path | None) -> None:
    """Refuse ``target`` if kiwid's own cgroup ``own_dir`` is it or lies below it."""
    if own_dir is not None and (own_dir == target or target in own_dir.parents):
        raise FreezeError(
            f"refusing to freeze {target}: kiwid itself runs in {own_dir}, "
            "so kiwid would freeze itself"
        )


ISOLATION_PARENT = "kiwi"
"""Where bare processes get a cgroup of their own: ``/kiwi/pid-<pid>``."""


def isolation_path(pid: int, parent: str = ISOLATION_PARENT) -> str:
    """The cgroup path :func:`isolate_process` moves ``pid`` into."""
    return f"/{parent.strip('/')}/pid-{pid}"


def isolate_process(pid: int, layout: CgroupLayout, parent: str = ISOLATION_PARENT) -> CgroupRef:
    """Move a bare process into ``/<parent>/pid-<pid>`` in cgroup2 and the v1 freezer.

    Writing a PID to ``cgroup.procs`` moves all the threads of that process. Only the
    freezer-relevant hierarchies are touched; v1 controllers such as memory stay.

    Args:
        pid: The process to move.
        layout: Where the hierarchies are mounted.
        parent: The parent cgroup, created if needed (no leading ``/``).

    Returns:
        The new cgroups of the process.

    Raises:
        FreezeError: ``parent`` contains ``..``.
        IsolationError: ``pid`` is kiwid itself, the host has no cgroup hierarchy,
            the process is gone, or a cgroup cannot be created or written.
    """
    if pid == os.getpid():
        raise IsolationError("refusing to isolate kiwid itself")
    path = isolation_path(pid, parent)
    ref = CgroupRef(
        v2=path if layout.v2_root else None, v1_freezer=path if layout.v1_freezer_root else None
    )
    v2_dir, v1_dir = layout.dirs(ref)
    if v2_dir is None and v1_dir is None:
        raise IsolationError(f"no cgroup hierarchy to isolate process {pid} into")
    moved_v2 = False
    try:
        for directory in (v2_dir, v1_dir):
            if directory is None:
                continue
            try:
                directory.mkdir(parents=True, exist_ok=True)
                with open(directory / "cgroup.procs", "w") as handle:
                    handle.write(str(pid))
            except OSError as exc:
                # The v1 freezer is optional where cgroup2 can freeze (it may be
                # mounted read-only, as in systemd-nspawn hosts on hybrid layouts).
                usable_v2 = moved_v2 and v2_dir is not None and (v2_dir / "cgroup.freeze").exists()
                if directory is v1_dir and usable_v2 and exc.errno != errno.ESRCH:
                    with contextlib.suppress(OSError):
                        directory.rmdir()
                    return CgroupRef(v2=ref.v2, v1_freezer=None)
                raise
            moved_v2 = moved_v2 or directory is v2_dir
    except OSError as exc:
        remove_isolation(ref, layout)
        what = "is gone" if exc.errno == errno.ESRCH else f"could not be moved: {exc}"
        raise IsolationError(f"process {pid} {what}") from exc
    return ref


def remove_isolation(ref: CgroupRef, layout: CgroupLayout) -> None:
    """Remove the cgroups that :func:`isolate_process` made, once they are empty.

    A cgroup that is still busy (its process lives on) or already gone is left alone.

    Args:
        ref: What :func:`isolate_process` returned.
        layout: Where the hierarchies are mounted.

    Raises:
        CgroupError: A cgroup could not be removed for another reason.
    """
    for directory in layout.dirs(ref):
        if directory is None:
            continue
        try:
            directory.rmdir()
        except OSError as exc:
            if exc.errno not in (errno.EBUSY, errno.ENOENT):
                raise CgroupError(f"cannot remove {directory}: {exc}") from exc
