"""A cgroup of its own for a bare process (one not in a container).

:func:`isolate_process` moves it into ``/kiwi/pid-<pid>`` so that it can be
frozen without its neighbours; :func:`remove_isolation` removes that cgroup once
the process is gone.
"""

from __future__ import annotations

import contextlib
import errno
import os

from kiwid.adapters.cgroups.layout import CgroupError, CgroupLayout, CgroupRef, IsolationError

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
