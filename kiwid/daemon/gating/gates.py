"""Gates: how a waiting tenant is kept off the GPU, behind one interface.

* ``FreezeGate`` freezes the tenant's cgroup (v2 ``cgroup.freeze``, or the v1
  freezer). A bare process is first moved into a cgroup of its own
  (``/kiwi/pid-N``) so that nothing else is frozen with it.
* ``CudaLockGate`` takes the driver's process lock on each of the tenant's
  processes: only their CUDA calls stop, their CPU work goes on. The lock
  outlives the process that took it, so it is recorded like a freeze and undone
  by ``kiwid recover`` or the next start.
* ``NullGate`` gates nothing: kiwid runs without the rights to freeze (not
  root), still schedules and shows the rotation, and says so at start.

Every gate returns a :class:`~kiwid.daemon.gating.state.GatedRecord` that is enough to
undo it from another process (``kiwid recover``), with what tells the gated thing
apart from another under the same name: the cgroups' inode numbers, the
processes' start times. Ungating checks them, so kiwid never thaws a cgroup (or
unlocks a process) that it did not gate itself.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Protocol

from kiwid.adapters import procs
from kiwid.adapters.cgroups import (
    CgroupLayout,
    CgroupRef,
    FreezeError,
    Freezer,
    cgroup_ids,
    isolate_process,
    remove_isolation,
)
from kiwid.adapters.cudalock import CudaLock, CudaLockError, ProcessState
from kiwid.daemon.gating.state import GatedRecord
from kiwid.daemon.tenants.tracker import TenantInfo
from kiwid.linux.proc import read_stat

log = logging.getLogger("kiwid.gate")


class GateError(Exception):
    """A tenant could not be gated or ungated."""


class TenantGate(Protocol):
    """Gate and ungate tenants."""

    method: str

    def prepare(self, tenant: TenantInfo) -> GatedRecord:
        """Return the record that undoes a gate of ``tenant`` (no gating yet)."""
        ...

    def gate(self, record: GatedRecord) -> None:
        """Stop the tenant's GPU work; on failure leave it running.

        Raises:
            GateError: it could not be gated (it was left ungated).
        """
        ...

    def ungate(self, record: GatedRecord) -> None:
        """Let the tenant run again (a tenant that is gone is fine).

        Raises:
            GateError: it could not be ungated.
        """
        ...

    def forget(self, tenant: str) -> None:
        """The tenant is gone: drop whatever the gate made for it."""
        ...


class FreezeGate:
    """Freeze a tenant's cgroup."""

    method = "freeze"

    def __init__(self, layout: CgroupLayout, timeout_s: float = 2.0) -> None:
        """Use the cgroup hierarchies of ``layout``; wait ``timeout_s`` for a freeze."""
        self._layout = layout
        self._freezer = Freezer(layout, timeout_s=timeout_s)
        self._isolated: dict[str, CgroupRef] = {}

    def prepare(self, tenant: TenantInfo) -> GatedRecord:
        """Return the record; a bare process is moved into a cgroup of its own.

        Raises:
            GateError: the bare process could not be isolated.
        """
        ident = tenant.identity
        if ident.dedicated:
            ref = CgroupRef(v2=ident.cgroup_v2, v1_freezer=ident.cgroup_v1_freezer)
        else:
            if len(tenant.pids) != 1:
                raise GateError(f"{ident.key}: a shared cgroup with several processes")
            (pid,) = tenant.pids
            try:
                ref = self._isolated.get(ident.key) or isolate_process(pid, self._layout)
            except (OSError, FreezeError) as err:
                msg = f"{ident.key}: cannot move it into a cgroup of its own: {err}"
                raise GateError(msg) from err
            self._isolated[ident.key] = ref
        try:
            ids = cgroup_ids(self._layout, ref)
        except FreezeError as err:
            raise GateError(f"{ident.key}: {err}") from err
        return _record(tenant, self.method, ref.v2, ref.v1_freezer, ids)

    def gate(self, record: GatedRecord) -> None:
        """Freeze the tenant's cgroup and wait until it is frozen.

        Raises:
            GateError: it did not freeze in time (it was thawed back).
        """
        try:
            self._freezer.freeze(_ref(record))
        except (OSError, FreezeError) as err:
            raise GateError(f"{record.tenant}: {err}") from err

    def ungate(self, record: GatedRecord) -> None:
        """Thaw the tenant's cgroup in every hierarchy, if it is the one kiwid froze.

        A cgroup that is gone is fine (the tenant exited). One whose identity does
        not match the record (removed and made again since, or a record kiwid did
        not write) is left alone.

        Raises:
            GateError: the freezer refused to thaw it, or it is not kiwid's to thaw.
        """
        try:
            now = cgroup_ids(self._layout, _ref(record))
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
            raise GateError(f"{record.tenant}: {err}") from err

    def forget(self, tenant: str) -> None:
        """Remove the cgroup a bare process was moved into, once it is empty."""
        ref = self._isolated.pop(tenant, None)
        if ref is not None:
            with contextlib.suppress(OSError, FreezeError):
                remove_isolation(ref, self._layout)


class CudaLockGate:
    """Lock the CUDA calls of every process of a tenant (driver r550+)."""

    method = "cuda-lock"

    def __init__(self, lock: CudaLock, timeout_s: float = 2.0) -> None:
        """Use ``lock``; give the driver ``timeout_s`` to drain a process's work."""
        self._lock = lock
        self._timeout_ms = max(1, int(timeout_s * 1000))

    @property
    def lock(self) -> CudaLock:
        """The driver library it locks with (the checkpoint swapper uses it too)."""
        return self._lock

    def prepare(self, tenant: TenantInfo) -> GatedRecord:
        """Return the record (the PIDs to unlock)."""
        ident = tenant.identity
        return _record(tenant, self.method, ident.cgroup_v2, ident.cgroup_v1_freezer)

    def gate(self, record: GatedRecord) -> None:
        """Lock every process; if one fails, unlock those already locked.

        Raises:
            GateError: a process could not be locked (none is left locked).
        """
        done: list[int] = []
        for pid in record.pids:
            try:
                # Already locked (or in host RAM): a previous kiwid gated it and
                # this one re-adopts it. Locking again would fail, and dropping
                # the record then would strand it.
                if self._lock.state(pid) is not ProcessState.RUNNING:
                    continue
                self._lock.lock(pid, self._timeout_ms)
            except CudaLockError as err:
                for locked in done:
                    with contextlib.suppress(CudaLockError):
                        self._lock.unlock(locked)
                raise GateError(f"{record.tenant}: cannot lock pid {pid}: {err}") from err
            done.append(pid)

    def ungate(self, record: GatedRecord) -> None:
        """Unlock every process that is still locked.

        Raises:
            GateError: a live, locked process refused to unlock.
        """
        failed: list[str] = []
        for pid, start in record.pid_starts().items():
            if not procs.alive(pid, start):
                continue  # gone (or a zombie, or the PID is someone else's now)
            try:
                state = self._lock.state(pid)
                if state is ProcessState.CHECKPOINTED:  # unlocking would strand it
                    failed.append(f"pid {pid}: its memory is in host RAM; restore it first")
                elif state is ProcessState.LOCKED:
                    self._lock.unlock(pid)
            except CudaLockError as err:
                # A process being torn down (SIGKILLed) has no CUDA state left to
                # query: the driver says NOT_INITIALIZED. Nothing stays locked.
                if err.name == "CUDA_ERROR_NOT_INITIALIZED" or not procs.alive(pid):
                    continue
                failed.append(f"pid {pid}: {err}")
        if failed:
            raise GateError(f"{record.tenant}: cannot unlock {'; '.join(failed)}")

    def forget(self, tenant: str) -> None:
        """Nothing to drop: the lock lives in the driver and ends with the process."""


class NullGate:
    """Gate nothing (no rights to freeze): the schedule is computed and shown only."""

    method = "none"

    def prepare(self, tenant: TenantInfo) -> GatedRecord:
        """Return a record that needs no undoing."""
        return _record(tenant, self.method, None, None)

    def gate(self, record: GatedRecord) -> None:
        """Do nothing."""

    def ungate(self, record: GatedRecord) -> None:
        """Do nothing."""

    def forget(self, tenant: str) -> None:
        """Do nothing."""


def _record(
    tenant: TenantInfo,
    method: str,
    v2: str | None,
    v1: str | None,
    ids: tuple[int | None, int | None] = (None, None),
) -> GatedRecord:
    pids = tuple(sorted(tenant.pids))
    starts = []
    for pid in pids:
        stat = read_stat(pid)
        starts.append(stat.start_ticks if stat is not None else 0)
    return GatedRecord(tenant.key, method, v2, v1, pids, cgroup_ids=ids, starts=tuple(starts))


def _ref(record: GatedRecord) -> CgroupRef:
    return CgroupRef(v2=record.cgroup_v2, v1_freezer=record.cgroup_v1_freezer)


def ungate_record(record: GatedRecord, layout: CgroupLayout | None = None) -> None:
    """Undo ``record`` without a running daemon (``kiwid recover``, start-up).

    Raises:
        GateError: the tenant could not be ungated.
    """
    if record.method == "freeze":
        FreezeGate(layout or CgroupLayout.detect()).ungate(record)
    elif record.method == "cuda-lock":
        try:
            lock = CudaLock()
        except CudaLockError as err:
            raise GateError(f"{record.tenant}: the CUDA lock is unavailable here: {err}") from err
        CudaLockGate(lock).ungate(record)
    elif record.method != "none":
        raise GateError(f"{record.tenant}: unknown gate method {record.method!r}")
