"""Reading files whose path an operator (or another process) chose.

A config or state path may name a FIFO (a plain ``open`` then blocks forever), a
device such as ``/dev/zero`` (a plain ``read`` never ends), a directory or a
symlink to any of those. :func:`read_regular` refuses everything but a regular
file, never blocks, and reads at most a bounded number of bytes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["NotRegularFile", "TooLarge", "describe_mode", "read_regular"]


class NotRegularFile(OSError):
    """The path exists but is not a regular file (a FIFO, a device, a directory...).

    ``str()`` is one sentence naming the path and what it is.
    """


class TooLarge(OSError):
    """The file is larger than the caller accepts."""


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

    The file is opened without blocking (a FIFO would otherwise wait for a
    writer) and checked with ``fstat`` on the open descriptor, so a file swapped
    for something else between a check and the open is caught too.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        NotRegularFile: it is a FIFO, device, directory, socket...
        TooLarge: it holds more than ``max_bytes`` bytes.
        OSError: it cannot be opened or read (permissions, I/O).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path, flags)
    except IsADirectoryError:
        raise NotRegularFile(f"{path} is a directory, not a file") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            what = describe_mode(info.st_mode)
            raise NotRegularFile(f"{path} is {what}, not a regular file")
        if info.st_size > max_bytes:
            raise TooLarge(f"{path} is larger than {max_bytes} bytes")
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, min(65536, max_bytes + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:  # it grew while we read
                raise TooLarge(f"{path} is larger than {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)
