"""From the GPU backend's process lists to tenants and scheduler events.

A tenant is a container (one cgroup) or a bare process. Each poll reads, per
GPU, the compute processes with their memory and the PIDs that did GPU work,
maps PIDs to tenants (cached per PID) and turns the differences into events.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kiwid.adapters import procs
from kiwid.adapters.cgroups import CgroupError, CgroupLayout, CgroupRef, populated
from kiwid.adapters.gpu import GpuProcess
from kiwid.core.events import ActivitySeen, Event, FootprintSeen, TenantAttached, TenantDetached

log = logging.getLogger("kiwid")


@dataclass(frozen=True)
class Identity:
    """Who a process belongs to, as the host sees it."""

    key: str
    """Stable tenant id: ``docker:<id12>``, ``cgroup:/path``, ``pid:<pid>``..."""
    kind: str
    name: str
    cgroup_v2: str | None = None
    cgroup_v1_freezer: str | None = None
    dedicated: bool = False
    """Whether its cgroup holds only this tenant (else it must be isolated to gate it)."""
    container_id: str | None = None
    pod: str | None = None
    namespace: str | None = None
    requested_weight: float | None = None
    """The weight its pod's ``kiwi.io/weight`` annotation asks for (``None``: none)."""
    requested_priority: int | None = None
    """The priority its pod's ``kiwi.io/priority`` annotation asks for."""
    requested_memory: int | None = None
    """The GPU memory per GPU (bytes) it declared at ``register``: its pod's
    ``kiwi.io/gpu-memory`` annotation, or a client's own ``memory_bytes``."""
    requested_park: bool | None = None
    """What its pod's ``kiwi.io/park`` annotation says (``None``: nothing)."""
    memory_source: str | None = None
    """Where ``requested_memory`` came from: ``annotation`` or ``register``."""
    identity_source: str | None = None
    """Where ``pod`` came from: ``annotations`` (the runtime's, through kiwi-hook),
    ``podresources`` (the kubelet's PodResources API, by device IDs) or ``cgroup``
    (the pod UID in a ``kubepods`` cgroup path); ``None`` without a pod."""


@dataclass
class TenantInfo:
    """What kiwid knows of one tenant (the daemon's side; the core has only the key)."""

    identity: Identity
    pids: set[int] = field(default_factory=set)
    gpus: frozenset[str] = frozenset()
    footprint: dict[str, int | None] = field(default_factory=dict)
    first_seen: float = 0.0

    @property
    def key(self) -> str:
        """The tenant's id."""
        return self.identity.key


@dataclass(frozen=True)
class GpuSample:
    """One GPU's processes and active PIDs at one poll."""

    gpu: str
    processes: Sequence[GpuProcess]
    active_pids: frozenset[int]


Alive = Callable[[int, int | None], bool]
"""Whether a PID runs and, given its start time, is still that process."""


@dataclass(frozen=True)
class Hidden:
    """A tenant missing from the GPUs' process lists that must be kept all the same.

    It is gated, and its memory may be in host RAM (a checkpointed process
    vanishes from NVML's list); the state file says so, with its processes, their
    start times and the GPUs its swap left (empty: the GPUs it was last seen on).
    A process counts only if its pid and its start time both match: a pid reused
    since is another process, which must never be taken for the tenant.
    """

    pids: frozenset[int]
    gpus: frozenset[str]
    starts: Mapping[int, int | None] = field(default_factory=dict)
    """Start time (clock ticks since boot) of each of ``pids`` (``None``: not known)."""

    def live_pids(self, alive: Alive) -> set[int]:
        """Its processes that still run, each the very process recorded."""
        return {pid for pid in self.pids if alive(pid, self.starts.get(pid))}


@dataclass
class Registration:
    """A container announced by kiwi-hook before (or without) GPU processes.

    It ends with ``unregister`` (kiwi-hook's poststop) or, should that never come,
    by itself once its container is gone (:meth:`TenantTracker.observe`).
    """

    container_id: str
    identity: Identity
    gpus: frozenset[str]
    pids: frozenset[int]
    starts: Mapping[int, int | None] = field(default_factory=dict)
    """Start time (clock ticks since boot) of each of ``pids`` when it registered: a
    PID reused since is another process (``None`` or absent: not known)."""


@functools.cache
def _layout() -> CgroupLayout | None:
    try:
        return CgroupLayout.detect()
    except CgroupError:
        return None


def cgroup_populated(ident: Identity) -> bool:
    """Whether ``ident``'s cgroup (or one below it) still holds a process.

    Gone, unreadable, or in no hierarchy this host mounts: it holds none.
    """
    layout = _layout()
    if layout is None:
        return False
    try:
        return populated(layout, CgroupRef(ident.cgroup_v2, ident.cgroup_v1_freezer))
    except CgroupError:
        return False


class TenantTracker:
    """Keeps the tenant table and turns each poll into scheduler events."""

    def __init__(
        self,
        identify: Callable[[int], Identity | None],
        alive: Alive | None = None,
        occupied: Callable[[Identity], bool] = cgroup_populated,
    ) -> None:
        """Track tenants.

        ``identify`` maps a host PID to its tenant (``None``: process gone);
        ``alive`` says whether a PID still runs (and is the process that started
        then); ``occupied`` whether a tenant's cgroup still holds a process.
        """
        self._identify = identify
        self._alive: Alive = alive or procs.alive
        self._occupied = occupied
        self._by_pid: dict[int, Identity] = {}
        self.tenants: dict[str, TenantInfo] = {}
        self._last_key: object = None
        self._listed: set[str] = set()
        """Tenants a GPU listed a process of (not only announced by kiwi-hook)."""
        self.registered: dict[str, Registration] = {}
        """Containers that kiwi-hook announced, by tenant key (names, cgroup, GPUs)."""
        self._registry_version = 0
        self.gone: dict[str, TenantInfo] = {}
        """Tenants detached by the last poll (the engine takes them for its ledger)."""
        self.pid_memory: dict[int, dict[str, int]] = {}
        """Each listed process's memory per GPU by the last poll (absent: not listed, or
        the driver did not say)."""

    def observe(
        self,
        samples: Iterable[GpuSample],
        now: float,
        lost_gpus: Iterable[str] = (),
        hidden: Mapping[str, Hidden] | None = None,
    ) -> list[Event]:
        """Return the events that this poll's ``samples`` amount to.

        GPUs in ``lost_gpus`` could not be read this time: their tenants keep
        their last known state rather than being dropped. ``hidden`` tenants are
        kept while one of their processes lives, though no GPU lists them.
        """
        samples = list(samples)
        lost_set = frozenset(lost_gpus)
        self._expire_registrations()
        keep = {k: h for k, h in (hidden or {}).items() if h.live_pids(self._alive)}
        # An idle node's polls repeat themselves: nothing to diff, nothing to say.
        # (Activity is news every time: it keeps a burst alive.)
        key = (
            tuple((s.gpu, tuple(s.processes)) for s in samples),
            lost_set,
            self._registry_version,
            tuple(sorted(keep)),
        )
        if key == self._last_key and not any(s.active_pids for s in samples):
            return []
        self._last_key = key
        pids: dict[str, set[int]] = {}
        gpus: dict[str, set[str]] = {}
        memory: dict[tuple[str, str], int | None] = {}
        active: set[str] = set()
        seen_pids: set[int] = set()
        per_pid: dict[int, dict[str, int]] = {}
        for sample in samples:
            for proc in sample.processes:
                if proc.used_memory_bytes is not None:
                    per_pid.setdefault(proc.pid, {})[sample.gpu] = proc.used_memory_bytes
                ident = self._lookup(proc.pid)
                if ident is None:
                    continue
                seen_pids.add(proc.pid)
                pids.setdefault(ident.key, set()).add(proc.pid)
                gpus.setdefault(ident.key, set()).add(sample.gpu)
                slot = (ident.key, sample.gpu)
                used = proc.used_memory_bytes
                known = memory.get(slot, 0)
                memory[slot] = None if used is None or known is None else known + used
                if proc.pid in sample.active_pids:
                    active.add(ident.key)
        self._listed |= set(pids)
        self.pid_memory = per_pid
        for tid, reg in self.registered.items():  # containers announced by kiwi-hook
            if tid not in gpus:
                gpus[tid] = set(reg.gpus)
                pids[tid] = set(reg.pids)
        for tid, h in keep.items():  # gated, maybe checkpointed: unlisted, not gone
            # Also beside processes of it that the GPU lists (a process it started
            # since): one tenant, all of its processes, so that all are gated.
            alive = {p for p in h.live_pids(self._alive) if self._lookup(p) is not None}
            # Not swapped: kept on the GPUs it was listed on (a failed lock left a
            # process checkpointed). A container only announced, never listed, and
            # unregistered since, is gone whatever its record says.
            seen = self.tenants.get(tid) if tid in self._listed else None
            where = h.gpus or (seen.gpus if seen is not None else frozenset())
            if alive and where:
                gpus.setdefault(tid, set()).update(where)
                pids.setdefault(tid, set()).update(alive)
                seen_pids |= alive
        lost = lost_set
        for tid, info in self.tenants.items():  # keep tenants of unreadable GPUs
            kept = info.gpus & lost
            if kept and tid not in gpus:
                gpus[tid] = set(kept)
                pids[tid] = set(info.pids)
                seen_pids |= info.pids
        for pid in set(self._by_pid) - seen_pids:
            del self._by_pid[pid]
        self._listed &= set(pids)
        return self._diff(pids, gpus, memory, active, now)

    def memory_of(self, pid: int) -> dict[str, int] | None:
        """A process's memory per GPU by the last poll (``None``: not listed, or unsaid)."""
        return self.pid_memory.get(pid)

    def register(self, reg: Registration) -> None:
        """Announce a container (its names win over what /proc tells)."""
        self.registered[reg.identity.key] = reg
        self._registry_version += 1

    def _expire_registrations(self) -> None:
        """Forget the announced containers that are gone though no poststop said so.

        A container is gone when none of its registered processes runs (a PID
        reused since is another process) and its cgroup holds no process any
        more, or is gone. kiwi-hook's poststop may never come: a runtime killed
        with its container, a hook that timed out, a host that rebooted a runtime.
        """
        for key, reg in list(self.registered.items()):
            if any(self._alive(pid, reg.starts.get(pid)) for pid in reg.pids):
                continue
            if self._occupied(reg.identity):
                continue
            del self.registered[key]
            self._registry_version += 1
            log.info(
                "Container %s (%s) is gone without its poststop unregister "
                "(process %s exited, its cgroup is empty): forgotten",
                reg.container_id,
                key,
                ",".join(map(str, sorted(reg.pids))) or "-",
            )

    def unregister(self, container_id: str) -> str | None:
        """Forget an announced container; return its tenant key, if it was known."""
        for key, reg in list(self.registered.items()):
            if reg.container_id == container_id:
                del self.registered[key]
                self._registry_version += 1
                return key
        return None

    def update_identity(self, key: str, identity: Identity) -> bool:
        """Give an announced container better names (found after it registered).

        Returns:
            Whether ``key`` is still announced (nothing changes otherwise).
        """
        reg = self.registered.get(key)
        if reg is None:
            return False
        reg.identity = identity
        info = self.tenants.get(key)
        if info is not None:
            info.identity = identity
        return True

    def identify(self, pid: int) -> Identity | None:
        """The tenant a live PID belongs to (``None``: gone)."""
        return self._lookup(pid)

    def _lookup(self, pid: int) -> Identity | None:
        ident = self._by_pid.get(pid)
        if ident is None:
            ident = self._identify(pid)
            if ident is not None:
                self._by_pid[pid] = ident
        return ident

    def _diff(
        self,
        pids: Mapping[str, set[int]],
        gpus: Mapping[str, set[str]],
        memory: Mapping[tuple[str, str], int | None],
        active: set[str],
        now: float,
    ) -> list[Event]:
        events: list[Event] = []
        for key in sorted(set(self.tenants) - set(gpus)):
            self.gone[key] = self.tenants.pop(key)
            events.append(TenantDetached(key))
        for key in sorted(gpus):
            gpu_set = frozenset(gpus[key])
            info = self.tenants.get(key)
            reg = self.registered.get(key)
            if info is None:
                ident = reg.identity if reg else self._by_pid[next(iter(pids[key]))]
                info = TenantInfo(ident, first_seen=now)
                self.tenants[key] = info
            elif reg is not None:
                info.identity = reg.identity
            info.pids = set(pids[key])
            if info.gpus != gpu_set:
                info.gpus = gpu_set
                events.append(TenantAttached(key, gpu_set))
            for gpu in sorted(gpu_set):
                used = memory.get((key, gpu))
                if (key, gpu) in memory and info.footprint.get(gpu, -1) != used:
                    info.footprint[gpu] = used
                    events.append(FootprintSeen(key, gpu, used))
        events.extend(ActivitySeen(key) for key in sorted(active))
        return events
