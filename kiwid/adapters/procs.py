"""Map a PID to its tenant: the only module that imports ``psutil``.

A tenant is what Kiwi gates as one unit: a container (docker, containerd/CRI,
CRI-O, podman), a systemd unit, another dedicated cgroup, or else one bare process.
:func:`identify` is pure and works on what :mod:`kiwid.linux.proc` parsed from
``/proc/PID/cgroup`` (the one parser of that file, re-exported here);
:func:`tenant_of` reads that file for a live process.

psutil errors never leave this module: a vanished process becomes ``None`` or
:class:`ProcessGone`, a refused one :class:`AccessDenied`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

import psutil

from kiwid.linux import proc
from kiwid.linux.proc import (
    AccessDenied,
    ProcCgroups,
    ProcError,
    ProcessGone,
    parse_proc_cgroup,
    read_proc_cgroup,
)

__all__ = [
    "AccessDenied",
    "ContainerIdentity",
    "ProcCgroups",
    "ProcessGone",
    "ProcsError",
    "Tenant",
    "alive",
    "available_host_memory",
    "cpu_seconds",
    "identify",
    "parse_proc_cgroup",
    "read_proc_cgroup",
    "tenant_of",
    "tenants_of",
]


ProcsError = ProcError
"""Base class of every error this module raises (the Linux readers' own)."""


@dataclass(frozen=True)
class ContainerIdentity:
    """What a cgroup path says about who owns a process.

    Attributes:
        kind: ``docker``, ``containerd``, ``cri-o``, ``podman``, ``systemd``,
            ``cgroup`` (another cgroup) or ``process`` (the root cgroup).
        container_id: The 64-hex container ID for container kinds, else ``None``.
        pod_uid: The Kubernetes pod UID (with dashes) under kubepods, else ``None``.
        name: Short name: the 12-hex ID, the systemd unit, or the cgroup path.
        cgroup: The cgroup path the identity was read from, ``None`` if none.
        dedicated: Whether the cgroup holds only this tenant; freezing a
            non-dedicated one (root, ``session-N.scope``, ``user@N.service``,
            ``init.scope``) would stop unrelated processes.
    """

    kind: str
    container_id: str | None
    pod_uid: str | None
    name: str
    cgroup: str | None
    dedicated: bool


@dataclass(frozen=True)
class Tenant:
    """A gating unit and the PIDs seen in it.

    Attributes:
        key: Stable per container: ``docker:<id12>``, ``containerd:<id12>``,
            ``cri-o:<id12>``, ``podman:<id12>``, ``systemd:<unit>``,
            ``cgroup:<path>``, or ``pid:<pid>`` for a bare process.
        kind: As :attr:`ContainerIdentity.kind`; ``process`` for a bare process.
        name: Short human name.
        container_id: Full container ID, or ``None``.
        pod_uid: Kubernetes pod UID, or ``None``.
        cgroup_v2: The process's cgroup2 path (what the freezer freezes).
        cgroup_v1_freezer: The process's v1 freezer path.
        dedicated: ``False`` for a bare process: it must be isolated before freezing.
        pids: The PIDs seen in this tenant.
    """

    key: str
    kind: str
    name: str
    container_id: str | None
    pod_uid: str | None
    cgroup_v2: str | None
    cgroup_v1_freezer: str | None
    dedicated: bool
    pids: frozenset[int]


_HEX64 = r"[0-9a-f]{64}"
# (kind, pattern with a group "id"), tried in order on each path; the last match wins
# so that the innermost container counts (e.g. a container inside a pod slice).
_CONTAINERS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("docker", re.compile(rf"/docker-(?P<id>{_HEX64})\.scope(?=/|$)")),
    ("docker", re.compile(rf"/docker/(?P<id>{_HEX64})(?=/|$)")),
    ("containerd", re.compile(rf"/cri-containerd-(?P<id>{_HEX64})\.scope(?=/|$)")),
    ("cri-o", re.compile(rf"/crio-(?P<id>{_HEX64})(?:\.scope)?(?=/|$)")),
    ("podman", re.compile(rf"/libpod-(?P<id>{_HEX64})(?:\.scope)?(?=/|$)")),
    ("containerd", re.compile(rf"/kubepods\b.*/pod[0-9a-f_-]+/(?P<id>{_HEX64})(?=/|$)")),
)
_UID = r"[-_]".join(f"[0-9a-f]{{{n}}}" for n in (8, 4, 4, 4, 12))
_POD = re.compile(rf"/kubepods\b.*[-/]pod(?P<uid>{_UID})(?:\.slice)?/")
_SHARED_UNIT = re.compile(r"^(session-[^/]+\.scope|user@\d+\.service|init\.scope)$")
_USER_MANAGER = re.compile(r"/(user@\d+\.service)/")


def _container(path: str) -> ContainerIdentity | None:
    best: tuple[int, str, str] | None = None
    for kind, pattern in _CONTAINERS:
        for match in pattern.finditer(path):
            if best is None or match.start() > best[0]:
                best = (match.start(), kind, match.group("id"))
    if best is None:
        return None
    _, kind, container_id = best
    pod = _POD.search(path)
    pod_uid = pod.group("uid").replace("_", "-") if pod else None
    return ContainerIdentity(kind, container_id, pod_uid, container_id[:12], path, True)


def identify(paths: ProcCgroups) -> ContainerIdentity:
    """Say who owns a process from its cgroup paths.

    Container patterns are looked for in the cgroup2 path, then the v1 freezer
    path, then the other v1 paths; a systemd unit or a generic cgroup only in the
    cgroup2 or freezer path (the ones kiwid can freeze).

    Args:
        paths: What :func:`parse_proc_cgroup` returned.

    Returns:
        The identity; kind ``process`` (not dedicated) for the root cgroup.
    """
    freezable = [p for p in (paths.v2, paths.v1_freezer) if p not in (None, "", "/")]
    for path in [*freezable, *paths.v1.values()]:
        if path and (found := _container(path)) is not None:
            return found
    if not freezable:
        return ContainerIdentity("process", None, None, "/", "/", dedicated=False)
    path = freezable[0]
    unit = path.rstrip("/").rsplit("/", 1)[-1]
    if unit.endswith((".scope", ".service")):
        manager = _USER_MANAGER.search(path)
        name = f"{manager.group(1)}/{unit}" if manager and manager.group(1) != unit else unit
        dedicated = _SHARED_UNIT.match(unit) is None
        return ContainerIdentity("systemd", None, None, name, path, dedicated)
    return ContainerIdentity("cgroup", None, None, path, path, dedicated=True)


def tenant_of(pid: int, own_cgroup: str | None = None) -> Tenant | None:
    """Find the tenant a live process belongs to.

    Args:
        pid: The process ID.
        own_cgroup: kiwid's own cgroup path; a process in it is a bare process.

    Returns:
        The tenant with ``pids == {pid}``, or ``None`` if the process is gone.

    Raises:
        AccessDenied: The process's cgroups cannot be read.
    """
    try:
        paths = read_proc_cgroup(pid)
    except ProcessGone:
        return None
    who = identify(paths)
    # The root cgroup is never dedicated anyway; comparing with it would wrongly
    # make v1-only containers bare when kiwid runs in the v2 root.
    own = own_cgroup not in (None, "", "/") and own_cgroup in (
        who.cgroup,
        paths.v2,
        paths.v1_freezer,
    )
    bare = not who.dedicated or own
    return Tenant(
        key=f"pid:{pid}" if bare else f"{who.kind}:{who.name}",
        kind="process" if bare else who.kind,
        name=f"pid {pid}" if bare else who.name,
        container_id=who.container_id,
        pod_uid=who.pod_uid,
        cgroup_v2=paths.v2,
        cgroup_v1_freezer=paths.v1_freezer,
        dedicated=not bare,
        pids=frozenset({pid}),
    )


def tenants_of(pids: Iterable[int], own_cgroup: str | None = None) -> dict[str, Tenant]:
    """Group live processes by tenant; vanished ones are skipped.

    Args:
        pids: Process IDs, e.g. from NVML's list of compute processes.
        own_cgroup: As for :func:`tenant_of`.

    Returns:
        Tenant key -> tenant, whose ``pids`` are all the given PIDs in it.

    Raises:
        AccessDenied: A process's cgroups cannot be read.
    """
    tenants: dict[str, Tenant] = {}
    for pid in pids:
        tenant = tenant_of(pid, own_cgroup)
        if tenant is None:
            continue
        seen = tenants.get(tenant.key)
        if seen is not None:
            tenant = replace(seen, pids=seen.pids | tenant.pids)
        tenants[tenant.key] = tenant
    return tenants


def cpu_seconds(pid: int) -> float | None:
    """Return the CPU time (user + system, in seconds) a process has used so far.

    Args:
        pid: The process ID.

    Returns:
        The CPU seconds, or ``None`` if the process is gone.

    Raises:
        AccessDenied: psutil was refused access to the process.
    """
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:  # includes ZombieProcess
        return None
    except psutil.AccessDenied as exc:
        raise AccessDenied(f"cannot read the CPU time of process {pid}") from exc
    return float(times.user + times.system)


def alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether a process exists and is not a zombie (an unreaped corpse runs nothing).

    Args:
        pid: The process ID.
        start_ticks: Its start time as recorded earlier: a PID reused since by
            another process is not alive (``None``: do not check).

    Returns:
        ``True`` if the process exists, has not exited and is the one recorded.
    """
    return proc.alive(pid, start_ticks)


def available_host_memory() -> int:
    """Bytes of host RAM available to new allocations without swapping (MemAvailable)."""
    return int(psutil.virtual_memory().available)
