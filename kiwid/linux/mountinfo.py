r"""``/proc/self/mountinfo``: where the cgroup hierarchies are mounted.

The one parser of that file: mount points come octal-escaped (``\040`` for a
space), and the fields after the `` - `` separator name the filesystem type and
its super options (where a v1 hierarchy lists its controllers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Mount", "parse_mountinfo", "read_mountinfo", "unescape"]

MOUNTINFO = Path("/proc/self/mountinfo")


def unescape(field: str) -> str:
    r"""Decode the octal escapes (``\040`` for a space) of a mountinfo field."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo.

    Attributes:
        root: The path inside the filesystem that is mounted (``/`` mostly).
        mount_point: Where it is mounted, unescaped.
        fstype: ``cgroup2``, ``cgroup``, ``ext4``...
        super_options: The filesystem's own options (a v1 cgroup lists its
            controllers there, e.g. ``rw,freezer``).
    """

    root: str
    mount_point: Path
    fstype: str
    super_options: tuple[str, ...]


def parse_mountinfo(text: str) -> list[Mount]:
    """Parse the text of a mountinfo file; malformed lines are skipped."""
    mounts: list[Mount] = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 4 or sep < 5:
            continue
        mounts.append(
            Mount(
                root=unescape(fields[3]),
                mount_point=Path(unescape(fields[4])),
                fstype=fields[sep + 1],
                super_options=tuple(fields[sep + 3].split(",")),
            )
        )
    return mounts


def read_mountinfo(path: Path = MOUNTINFO) -> list[Mount]:
    """Read and parse a mountinfo file.

    Raises:
        OSError: it cannot be read.
    """
    return parse_mountinfo(path.read_text(encoding="utf-8", errors="surrogateescape"))
