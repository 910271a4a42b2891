"""Open sock_diag sockets in other network namespaces without entering them ourselves.

A netlink socket belongs for good to the network namespace of the thread that
created it. :func:`diag_sockets` starts one short-lived helper thread which, for
each namespace in turn, calls ``setns(fd, CLONE_NEWNET)`` (a per-thread change
on Linux) and creates a socket there; then the thread ends, and its namespace
with it. No other thread of kiwid ever changes namespace, and nothing runs in
the tenant's namespace but that kernel call and a ``socket()``.

Why a thread and not a forked child passing the socket back over ``SCM_RIGHTS``
(what pyroute2 does): kiwid runs gRPC and other threads, and ``fork()`` in a
threaded process copies locks held by threads that do not exist in the child;
a thread costs less too (no page tables to copy). Python 3.11 has no
``os.setns`` (3.12 does), so the call goes through ctypes and libc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import threading
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import TypeVar

from kiwid.adapters.sockets.diag import SocketDiagError, open_diag_socket

__all__ = ["CLONE_NEWNET", "diag_sockets", "same_namespace"]

CLONE_NEWNET = 0x40000000
K = TypeVar("K", bound=Hashable)


def _setns_function() -> Callable[[int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        setns = libc.setns
    except (OSError, AttributeError):
        return None
    setns.argtypes = (ctypes.c_int, ctypes.c_int)
    setns.restype = ctypes.c_int
    return setns


_SETNS = _setns_function()


def same_namespace(fd: int) -> bool:
    """Whether the namespace file ``fd`` is the calling thread's own network namespace."""
    mine = Path("/proc/thread-self/ns/net").stat()
    theirs = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def _enter_and_open(fd: int) -> socket.socket | SocketDiagError:
    """In the helper thread: move it into ``fd``'s namespace and open a socket there."""
    if _SETNS is None:
        return SocketDiagError("libc has no setns(); cannot read another network namespace")
    if _SETNS(fd, CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        return SocketDiagError(f"cannot enter the network namespace: {os.strerror(code)}", code)
    try:
        return open_diag_socket()
    except SocketDiagError as err:
        return err


def diag_sockets(namespaces: Mapping[K, int]) -> dict[K, socket.socket | SocketDiagError]:
    """Open one sock_diag socket in each network namespace.

    Args:
        namespaces: Key -> an open file descriptor of the namespace
            (``/proc/PID/ns/net``); the caller keeps and closes them.

    Returns:
        Key -> the socket (the caller closes it), or why there is none for that
        namespace. The calling thread's own namespace is served in that thread.
    """
    sockets: dict[K, socket.socket | SocketDiagError] = {}
    foreign: dict[K, int] = {}
    for key, fd in namespaces.items():
        try:
            own = same_namespace(fd)
        except OSError as err:
            sockets[key] = SocketDiagError(f"cannot read a network namespace: {err.strerror}")
            continue
        if own:
            try:
                sockets[key] = open_diag_socket()
            except SocketDiagError as err:
                sockets[key] = err
        else:
            foreign[key] = fd
    if not foreign:
        return sockets

    def work() -> None:
        # Once moved, this thread never moves back: it ends, and nothing else
        # runs on it. Keys are visited in order; a failed setns leaves the thread
        # where it was, which the next key's setns replaces.
        for key, fd in foreign.items():
            sockets[key] = _enter_and_open(fd)

    helper = threading.Thread(target=work, name="kiwi-sockdiag-netns", daemon=True)
    try:
        helper.start()
    except RuntimeError as err:  # no thread to be had: out of memory or pids
        raise SocketDiagError(f"cannot start the namespace helper thread: {err}") from err
    helper.join()
    return sockets
