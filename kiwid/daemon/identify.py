"""PID → tenant identity, through the procs adapter."""

from __future__ import annotations

import functools
import logging
import os

from kiwid.adapters import procs
from kiwid.daemon.tenants import Identity

log = logging.getLogger("kiwid.tenants")


@functools.cache
def _own_cgroup() -> str | None:
    """Return kiwid's own cgroup; processes that share it are bare processes, not containers."""
    try:
        own = procs.read_proc_cgroup(os.getpid()).v2
    except procs.ProcsError:
        return None
    return None if own in (None, "", "/") else own  # the root is nobody's own


def identify(pid: int) -> Identity | None:
    """Return the tenant of host process ``pid`` (``None``: it is gone or unreadable)."""
    try:
        tenant = procs.tenant_of(pid, own_cgroup=_own_cgroup())
    except procs.ProcsError as err:
        log.warning("Cannot tell which container process %d belongs to: %s", pid, err)
        return None
    if tenant is None:
        return None
    if f"/kiwi/pid-{pid}" in (tenant.cgroup_v2, tenant.cgroup_v1_freezer):
        # A bare process that a kiwid isolated earlier: still the same bare tenant.
        return Identity(
            key=f"pid:{pid}",
            kind="process",
            name=f"pid {pid}",
            cgroup_v2=tenant.cgroup_v2,
            cgroup_v1_freezer=tenant.cgroup_v1_freezer,
            dedicated=False,
        )
    return Identity(
        key=tenant.key,
        kind=tenant.kind,
        name=tenant.name,
        cgroup_v2=tenant.cgroup_v2,
        cgroup_v1_freezer=tenant.cgroup_v1_freezer,
        dedicated=tenant.dedicated,
        container_id=tenant.container_id,
        pod=tenant.pod_uid,
    )
