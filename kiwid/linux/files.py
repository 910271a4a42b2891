"""Reading files whose path an operator (or another process) chose, and writing ours.

A config or state path may name a FIFO (a plain ``open`` then blocks forever), a
device such as ``/dev/zero`` (a plain ``read`` never ends), a directory or a
symlink to any of those. :func:`read_regular` refuses everything but a regular
file, never blocks, and reads at most a bounded number of bytes.

:func:`write_atomic` is how kiwid writes every file of its own (state, sim
attachments, remembered workloads, CDI specs): a reader, or kiwid after a crash,
sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["NotRegularFile", "TooLarge", "describe_mode", "read_regular", "write_atomic"]


class NotRegularFile(OSError):
    """The path exists but is not a regular file (a FIFO, a device, a directory...).

    ``str()`` is one sentence naming the path and what it is.

    Attributes:
        path: The path as given.
        kind: What it is instead, as :func:`describe_mode` names it (``"a FIFO
            (named pipe)"``).
    """

    def __init__(self, path: str | Path, kind: str) -> None:
        """Say that ``path`` is ``kind``."""
        super().__init__(f"{path} is {kind}, not a regular file")
        self.path = str(path)
        self.kind = kind


class TooLarge(OSError):
    """The file is larger than the caller accepts.

    Attributes:
        path: The path as given.
        max_bytes: The most the caller accepts.
    """

    def __init__(self, path: str | Path, max_bytes: int) -> None:
        """Say that ``path`` holds more than ``max_bytes`` bytes."""
        super().__init__(f"{path} is larger than {max_bytes} bytes")
        self.path = str(path)
        self.max_bytes = max_bytes


def describe_mode(mode: int) -> str:
    """A file type as a person names it: ``a FIFO``, ``a character device``..."""
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISREG, "a regular file"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")


def read_regular(path: str | Path, max_bytes: int) -> bytes:
    """Return the bytes of the regular file ``path``, refusing anything else.

    The path is checked with ``stat`` before it is opened, so a special file is
    never opened at all (opening some devices acts: ``/dev/watchdog`` arms the
    watchdog, a tape device rewinds). It is then opened without blocking (a FIFO
    put in its place would otherwise wait for a writer) and checked again with
    ``fstat`` on the open descriptor, so a file swapped for something else between
    the check and the open is caught too. At most ``max_bytes + 1`` bytes are read,
    whatever size the file claims (``/proc`` files claim 0).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        NotRegularFile: it is a FIFO, device, directory, socket...
        TooLarge: it holds more than ``max_bytes`` bytes.
        OSError: it cannot be opened or read (permissions, a symlink loop, I/O).
    """
    _check_regular(path, Path(path).stat(), max_bytes)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    fd = os.open(path, flags)
    try:
        _check_regular(path, os.fstat(fd), max_bytes)
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, min(65536, max_bytes + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:  # it grew since the check, or claims a wrong size
                raise TooLarge(path, max_bytes)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _check_regular(path: str | Path, info: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise NotRegularFile(path, describe_mode(info.st_mode))
    if info.st_size > max_bytes:
        raise TooLarge(path, max_bytes)


def write_atomic(path: str | Path, data: bytes, mode: int = 0o600, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` at once: a temporary file beside it, renamed.

    ``mode`` is the new file's; ``durable`` fsyncs the file and its directory
    before returning (the state file must survive a power cut; a cache need not).

    Raises:
        OSError: the directory or the file cannot be written (nothing is left behind).
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        Path(tmp).chmod(mode)
        Path(tmp).replace(target)
    except BaseException:
        with contextlib.suppress(OSError):
            Path(tmp).unlink()
        raise
    if durable:
        dirfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)
