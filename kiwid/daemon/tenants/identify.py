"""PID → tenant identity, through the procs adapter."""

from __future__ import annotations

import functools
import logging
import os

from kiwid.adapters import procs
from kiwid.adapters.cgroups import isolation_path
from kiwid.daemon.tenants.tracker import Identity

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
    if isolation_path(pid) in (tenant.cgroup_v2, tenant.cgroup_v1_freezer):
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
        identity_source="cgroup" if tenant.pod_uid else None,
    )


def identity_of_container(
    container_id: str,
    cgroup_v2: str | None,
    cgroup_v1_freezer: str | None,
    pid: int,
    *,
    name: str | None = None,
    pod: str | None = None,
    namespace: str | None = None,
    weight: float | None = None,
    priority: int | None = None,
    memory: int | None = None,
    memory_source: str | None = None,
    park: bool | None = None,
) -> Identity:
    """The identity of a container that kiwi-hook announced.

    ``weight`` and ``priority`` are what its pod's annotations ask for, ``memory``
    the GPU memory per GPU it declares (``memory_source``: ``annotation`` or
    ``register``); the rules cap them when its policy is resolved.

    Its key is the one its processes will have when they show up on a GPU (it is
    derived from the same cgroup path), so the two meet in one tenant. The cgroup
    is the one process ``pid`` is in, as the kernel says: a path given beside it
    must be that one (never an ancestor slice, never a bystander's cgroup).

    Raises:
        ValueError: the process is gone, the cgroups given are not its own, or its
            cgroup is not a container's own (the root, a login session, a slice,
            or kiwid's own).
    """
    try:
        paths = procs.read_proc_cgroup(pid)
    except procs.ProcsError as err:
        raise ValueError(f"cannot read the cgroups of pid {pid}: {err}") from err
    for given, actual, what in (
        (cgroup_v2, paths.v2, "cgroup_v2"),
        (cgroup_v1_freezer, paths.v1_freezer, "cgroup_v1_freezer"),
    ):
        if given is not None and given != actual:
            raise ValueError(
                f"{what} {given!r} is not the cgroup of pid {pid} ({actual!r}); refusing to "
                "gate a cgroup the container's process is not in"
            )
    cgroup_v2, cgroup_v1_freezer = paths.v2, paths.v1_freezer
    freezable = [p for p in (cgroup_v2, cgroup_v1_freezer) if p not in (None, "", "/")]
    if not freezable:
        raise ValueError(f"pid {pid} is in the root cgroup: that is the whole machine")
    if any(p.rstrip("/").endswith(".slice") for p in freezable):
        raise ValueError(f"{freezable[0]} is a slice, which holds other units; refusing to gate it")
    if _own_cgroup() in freezable:
        raise ValueError(f"{_own_cgroup()} is kiwid's own cgroup; refusing to gate it")
    who = procs.identify(procs.ProcCgroups(cgroup_v2, cgroup_v1_freezer, {}))
    if not who.dedicated:
        raise ValueError(
            f"cgroup {freezable[0]} is shared with other processes; refusing to gate it"
        )
    return Identity(
        key=f"{who.kind}:{who.name}",
        kind=who.kind,
        name=name or who.name,
        cgroup_v2=cgroup_v2,
        cgroup_v1_freezer=cgroup_v1_freezer,
        dedicated=True,
        container_id=container_id,
        pod=pod,
        namespace=namespace,
        requested_weight=weight,
        requested_priority=priority,
        requested_memory=memory,
        memory_source=memory_source if memory is not None else None,
        requested_park=park,
        identity_source="annotations" if pod else None,
    )
