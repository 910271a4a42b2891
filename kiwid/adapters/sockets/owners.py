"""Which sockets a tenant's processes hold, and in which network namespaces.

``/proc/PID/fd/N`` links read ``socket:[INODE]`` for a socket; the inode is what
sock_diag reports as ``idiag_inode`` / ``udiag_ino``. ``/proc/PID/ns/net`` is the
process's network namespace: a file to ``setns()`` into, whose (device, inode)
names the namespace. Each process is read through one ``/proc/PID`` directory
descriptor, so that a PID reused between two reads cannot mix two processes: the
old directory answers ``ESRCH``/``ENOENT`` instead.

Only this adapter reads these files; should another part of kiwid need them, the
readers move to :mod:`kiwid.linux.proc`.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from kiwid.adapters.sockets.diag import SocketDiagError

__all__ = ["NamespaceKey", "Owners", "read_owners"]

PROC = "/proc"
NamespaceKey = tuple[int, int]  # (st_dev, st_ino) of the nsfs file
_GONE = (errno.ENOENT, errno.ESRCH)


@dataclass
class Owners:
    """The sockets of a set of processes, grouped by network namespace.

    Attributes:
        inodes: Every socket inode the processes hold.
        namespaces: Namespace -> an open descriptor of it (close with :meth:`close`).
        pids: Namespace -> the processes read in it (with sockets or not).
    """

    inodes: set[int] = field(default_factory=set)
    namespaces: dict[NamespaceKey, int] = field(default_factory=dict)
    pids: dict[NamespaceKey, list[int]] = field(default_factory=dict)

    def close(self) -> None:
        """Close the namespace descriptors."""
        for fd in self.namespaces.values():
            os.close(fd)
        self.namespaces.clear()


def _socket_inodes(pid_dir: int) -> list[int]:
    fd_dir = os.open("fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=pid_dir)
    try:
        names = os.listdir(fd_dir)  # noqa: PTH208 - a directory descriptor: no pathlib
        inodes: list[int] = []
        for name in names:
            try:
                target = os.readlink(name, dir_fd=fd_dir)
            except FileNotFoundError:  # closed since the listing
                continue
            if target.startswith("socket:["):
                inodes.append(int(target[8:-1]))
        return inodes
    finally:
        os.close(fd_dir)


def _read_one(pid: int, owners: Owners) -> None:
    """Add one process's sockets and namespace; a process that is gone adds nothing."""
    try:
        pid_dir = os.open(f"{PROC}/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        if err.errno in _GONE:
            return
        raise SocketDiagError(f"cannot read {PROC}/{pid}: {err.strerror}", err.errno) from err
    ns_fd = -1
    try:
        ns_fd = os.open("ns/net", os.O_RDONLY | os.O_CLOEXEC, dir_fd=pid_dir)
        stat = os.fstat(ns_fd)
        inodes = _socket_inodes(pid_dir)
    except OSError as err:
        if ns_fd >= 0:
            os.close(ns_fd)
        if err.errno in _GONE:  # exited (or a zombie: no namespaces, no files)
            return
        raise SocketDiagError(
            f"cannot read the sockets of process {pid}: {err.strerror}", err.errno
        ) from err
    finally:
        os.close(pid_dir)
    key = (stat.st_dev, stat.st_ino)
    owners.inodes.update(inodes)
    owners.pids.setdefault(key, []).append(pid)
    # A namespace is read only for processes that hold sockets: no setns, no
    # dump for a helper process that has none.
    if not inodes or key in owners.namespaces:
        os.close(ns_fd)
    else:
        owners.namespaces[key] = ns_fd


def read_owners(pids: Iterable[int]) -> Owners:
    """Read the socket inodes and network namespaces of processes.

    Args:
        pids: The processes; those that are gone (or zombies) are skipped.

    Returns:
        What they hold; the caller closes it.

    Raises:
        SocketDiagError: A process's files could not be read (not root?).
    """
    owners = Owners()
    try:
        for pid in dict.fromkeys(pids):
            _read_one(pid, owners)
    except BaseException:
        owners.close()
        raise
    return owners
