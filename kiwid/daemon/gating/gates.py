"""Gates: how a waiting tenant is kept off the GPU, behind one interface.

* ``FreezeGate`` freezes the tenant's cgroup (v2 ``cgroup.freeze``, or the v1
  freezer). A bare process is first moved into a cgroup of its own
  (``/kiwi/pid-N``) so that nothing else is frozen with it.
* ``CudaLockGate`` takes the driver's process lock on each of the tenant's
  processes: only their CUDA calls stop, their CPU work goes on. The lock
  outlives the process that took it, so it is recorded like a freeze and undone
  by ``kiwid recover`` or the next start (:mod:`kiwid.daemon.gating.cudagate`).
* ``NullGate`` gates nothing: kiwid runs without the rights to freeze (not
  root), still schedules and shows the rotation, and says so at start.

Every gate returns a :class:`~kiwid.daemon.gating.record.GatedRecord` that is
enough to undo it from another process (``kiwid recover``), with what tells the
gated thing apart from another under the same name: the cgroups' inode numbers,
the processes' start times. Ungating checks them, so kiwid never thaws a cgroup
(or unlocks a process) that it did not gate itself.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol

from kiwid.adapters.cgroups import (
    CgroupLayout,
    CgroupRef,
    FreezeError,
    Freezer,
    cgroup_ids,
    isolate_process,
    remove_isolation,
)
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.tenants.tracker import TenantInfo
from kiwid.linux.proc import read_stat

log = logging.getLogger("kiwid.gate")


Guard = Callable[[GatedRecord], AbstractContextManager[bool]]
"""Whether a record is still what a job read, held while the job acts on it: a job
whose call returned late must not thaw a fence written since (the state file's
:meth:`~kiwid.daemon.gating.state.StateFile.unchanged`)."""


@contextlib.contextmanager
def always(record: GatedRecord) -> Iterator[bool]:
    """The guard of whoever owns the tenant outright (``kiwid recover``): yes."""
    yield True


class GateError(Exception):
    """A tenant could not be gated or ungated.

    Attributes:
        pid: The process the failing call was about (``None``: the whole tenant).
        answer: What the driver or the kernel answered, e.g. ``CUDA_ERROR_TIMEOUT (909)``.
    """

    def __init__(self, message: str, pid: int | None = None, answer: str | None = None) -> None:
        super().__init__(message)
        self.pid = pid
        self.answer = answer


class TenantGate(Protocol):
    """Gate and ungate tenants."""

    method: str

    def prepare(self, tenant: TenantInfo) -> GatedRecord:
        """Return the record that undoes a gate of ``tenant`` (no gating yet)."""
        ...

    def gate(self, record: GatedRecord) -> frozenset[int] | None:
        """Stop the tenant's GPU work; on failure leave it running.

        Returns the processes it holds, where it holds them one by one (the CUDA
        lock: only those with a CUDA context); ``None`` where it holds the whole
        cgroup, processes started later included (the freezer).

        Raises:
            GateError: it could not be gated (it was left ungated).
        """
        ...

    def ungate(self, record: GatedRecord, guard: Guard = always) -> None:
        """Let the tenant run again (a tenant that is gone is fine).

        What only the record says (a freeze, a fence) is undone only while ``guard``
        says the record is still the one read.

        Raises:
            GateError: it could not be ungated.
        """
        ...

    def forget(self, tenant: str) -> None:
        """The tenant is gone: drop whatever the gate made for it."""
        ...

    def holds(self, tenant: TenantInfo) -> bool:
        """Whether the tenant is gated now by this gate's lever (whoever pulled it)."""
        ...


class FreezeGate:
    """Freeze a tenant's cgroup."""

    method = "freeze"

    def __init__(self, layout: CgroupLayout, timeout_s: float = 2.0) -> None:
        """Use the cgroup hierarchies of ``layout``; wait ``timeout_s`` for a freeze."""
        self.layout = layout
        self._freezer = Freezer(layout, timeout_s=timeout_s)
        self._isolated: dict[str, CgroupRef] = {}

    def prepare(self, tenant: TenantInfo) -> GatedRecord:
        """Return the record; a bare process is moved into a cgroup of its own.

        Raises:
            GateError: the bare process could not be isolated.
        """
        ref = self.ref_of(tenant)
        try:
            ids = cgroup_ids(self.layout, ref)
        except FreezeError as err:
            raise GateError(f"{tenant.key}: {err}") from err
        return make_record(tenant, self.method, ref.v2, ref.v1_freezer, ids)

    def ref_of(self, tenant: TenantInfo) -> CgroupRef:
        """The cgroup that freezes ``tenant`` and nothing else (a bare process is isolated).

        Raises:
            GateError: the bare process could not be isolated.
        """
        ident = tenant.identity
        if ident.dedicated:
            return CgroupRef(v2=ident.cgroup_v2, v1_freezer=ident.cgroup_v1_freezer)
        if len(tenant.pids) != 1:
            raise GateError(f"{ident.key}: a shared cgroup with several processes")
        (pid,) = tenant.pids
        try:
            ref = self._isolated.get(ident.key) or isolate_process(pid, self.layout)
        except (OSError, FreezeError) as err:
            msg = f"{ident.key}: cannot move it into a cgroup of its own: {err}"
            raise GateError(msg, pid) from err
        self._isolated[ident.key] = ref
        return ref

    def gate(self, record: GatedRecord) -> None:
        """Freeze the tenant's cgroup and wait until it is frozen (all of it, always).

        Raises:
            GateError: it did not freeze in time (it was thawed back).
        """
        try:
            self._freezer.freeze(_ref(record))
        except (OSError, FreezeError) as err:
            raise GateError(f"{record.tenant}: {err}", answer=_errno(err)) from err

    def ungate(self, record: GatedRecord, guard: Guard = always) -> None:
        """Thaw the tenant's cgroup in every hierarchy, if it is the one kiwid froze.

        A cgroup that is gone is fine (the tenant exited). One whose identity does
        not match the record (removed and made again since, or a record kiwid did
        not write) is left alone, and so is one whose record changed since it was
        read (``guard``: frozen again since, by a fence).

        Raises:
            GateError: the freezer refused to thaw it, or it is not kiwid's to thaw.
        """
        with guard(record) as current:
            if current:
                self.thaw(record)

    def thaw(self, record: GatedRecord) -> None:
        """Thaw the record's cgroup, if it is the one kiwid froze (see :meth:`ungate`).

        Raises:
            GateError: the freezer refused to thaw it, or it is not kiwid's to thaw.
        """
        try:
            now = cgroup_ids(self.layout, _ref(record))
        except FreezeError as err:
            raise GateError(f"{record.tenant}: {err}") from err
        paths = (record.cgroup_v2, record.cgroup_v1_freezer)
        for path, seen, recorded in zip(paths, now, record.cgroup_ids, strict=True):
            if seen is not None and seen != recorded:
                raise GateError(
                    f"{record.tenant}: cgroup {path} is not the one kiwid froze (its identity "
                    f"is {seen}, the record says {recorded}); leaving it alone"
                )
        try:
            self._freezer.thaw(_ref(record))
        except (OSError, FreezeError) as err:
            raise GateError(f"{record.tenant}: {err}", answer=_errno(err)) from err

    def holds(self, tenant: TenantInfo) -> bool:
        """Whether ``tenant``'s cgroup is frozen now (by whoever froze it)."""
        ident = tenant.identity
        ref = CgroupRef(v2=ident.cgroup_v2, v1_freezer=ident.cgroup_v1_freezer)
        try:
            return self._freezer.is_frozen(ref)
        except FreezeError:
            return False

    def forget(self, tenant: str) -> None:
        """Remove the cgroup a bare process was moved into, once it is empty."""
        ref = self._isolated.pop(tenant, None)
        if ref is not None:
            with contextlib.suppress(OSError, FreezeError):
                remove_isolation(ref, self.layout)


class NullGate:
    """Gate nothing (no rights to freeze): the schedule is computed and shown only."""

    method = "none"

    def prepare(self, tenant: TenantInfo) -> GatedRecord:
        """Return a record that needs no undoing."""
        return make_record(tenant, self.method, None, None)

    def gate(self, record: GatedRecord) -> None:
        """Do nothing."""

    def ungate(self, record: GatedRecord, guard: Guard = always) -> None:
        """Do nothing."""

    def forget(self, tenant: str) -> None:
        """Do nothing."""

    def holds(self, tenant: TenantInfo) -> bool:
        """Nothing is ever held."""
        return False


def make_record(
    tenant: TenantInfo,
    method: str,
    v2: str | None,
    v1: str | None,
    ids: tuple[int | None, int | None] = (None, None),
) -> GatedRecord:
    """The record of a gate of ``tenant`` by ``method`` on cgroups ``v2``/``v1``."""
    pids = tuple(sorted(tenant.pids))
    return GatedRecord(
        tenant.key, method, v2, v1, pids, cgroup_ids=ids, starts=tuple(map(start_of, pids))
    )


def start_of(pid: int) -> int:
    """A process's start time in clock ticks since boot (0 if it is gone)."""
    stat = read_stat(pid)
    return stat.start_ticks if stat is not None else 0


def _ref(record: GatedRecord) -> CgroupRef:
    return CgroupRef(v2=record.cgroup_v2, v1_freezer=record.cgroup_v1_freezer)


def _errno(err: Exception) -> str | None:
    return f"errno {err.errno}" if isinstance(err, OSError) and err.errno else None
