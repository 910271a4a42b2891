"""Freeze and thaw tenants through the cgroup freezer (stdlib only).

The package: :mod:`.layout` (refs, mounts, errors), :mod:`.freezer`,
:mod:`.isolation`. Everything is imported from here.

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

from kiwid.adapters.cgroups.freezer import Freezer
from kiwid.adapters.cgroups.isolation import (
    ISOLATION_PARENT,
    isolate_process,
    isolation_path,
    remove_isolation,
)
from kiwid.adapters.cgroups.layout import (
    CgroupError,
    CgroupGone,
    CgroupLayout,
    CgroupRef,
    FreezeError,
    FreezeTimeout,
    IsolationError,
    cgroup_ids,
    cgroup_of,
    populated,
)

__all__ = [
    "ISOLATION_PARENT",
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
    "isolation_path",
    "populated",
    "remove_isolation",
]
