"""Whether a process is frozen, as the kernel's cgroup freezer tells (read only).

The simulated GPU uses it to show no activity for a frozen process, as NVML shows
no utilisation samples for one. Freezing itself is the cgroups adapter's job.
"""

from __future__ import annotations

from pathlib import Path

from kiwid.linux.mountinfo import read_mountinfo
from kiwid.linux.proc import ProcError, read_proc_cgroup

__all__ = ["is_frozen"]


def is_frozen(pid: int) -> bool:
    """Whether the cgroup v2 or v1 freezer has frozen ``pid``'s cgroup."""
    try:
        paths = read_proc_cgroup(pid)
        mounts = read_mountinfo()
    except (ProcError, OSError):
        return False
    for mount in mounts:
        if mount.fstype == "cgroup2" and paths.v2 is not None:
            state, frozen, path = "cgroup.events", "frozen 1", paths.v2
        elif (
            mount.fstype == "cgroup"
            and "freezer" in mount.super_options
            and paths.v1_freezer is not None
        ):
            state, frozen, path = "freezer.state", "FROZEN", paths.v1_freezer
        else:
            continue
        try:
            text = Path(str(mount.mount_point) + path.rstrip("/"), state).read_text()
        except OSError:
            continue
        if frozen in text.splitlines():
            return True
    return False
