"""The CUDA-lock gate: the driver's process lock on each of a tenant's processes.

Only their CUDA calls stop, their CPU work goes on. The lock outlives the process
that took it, so it is recorded like a freeze and undone by ``kiwid recover`` or
the next start. A process the tenant starts later, or one that creates its CUDA
context later, is locked by the follow that each poll runs for a gated tenant
(:mod:`kiwid.daemon.engine.follow_jobs`). When the lock cannot be trusted (a call that
failed half-way, or never returned), the tenant's cgroup is frozen as well, a
*fence* (:meth:`CudaLockGate.fence`): the freezer is the lever that does not
depend on the driver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import replace

from kiwid.adapters import procs
from kiwid.adapters.cgroups import CgroupLayout, FreezeError, cgroup_ids
from kiwid.adapters.cudalock import CudaLock, CudaLockBusy, CudaLockError, ProcessState
from kiwid.daemon.gating.gates import FreezeGate, GateError, Guard, always, make_record
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.tenants.tracker import TenantInfo


class CudaLockGate:
    """Lock the CUDA calls of every process of a tenant (driver r550+)."""

    method = "cuda-lock"

    def __init__(
        self, lock: CudaLock, timeout_s: float = 2.0, fence: FreezeGate | None = None
    ) -> None:
        """Use ``lock``; give the driver ``timeout_s`` to drain a process's work.

        ``fence``: the freezer that holds a tenant whose lock cannot be trusted
        (``None``: no fence; such a tenant may run, and kiwid says so).
        """
        self._lock = lock
        self._timeout_ms = max(1, int(timeout_s * 1000))
        self._fence = fence

    @property
    def lock(self) -> CudaLock:
        """The driver library it locks with (the checkpoint swapper uses it too)."""
        return self._lock

    def prepare(self, tenant: TenantInfo) -> GatedRecord:
        """Return the record (the PIDs to unlock)."""
        ident = tenant.identity
        return make_record(tenant, self.method, ident.cgroup_v2, ident.cgroup_v1_freezer)

    def gate(self, record: GatedRecord) -> frozenset[int]:
        """Lock every process that runs; if one fails, unlock those this call locked.

        A process with no CUDA context yet answers ``CUDA_ERROR_NOT_INITIALIZED``: it
        cannot run on the GPU, and it is not locked either. It stays to lock: each
        poll's follow looks at every process of a gated tenant that runs.

        Returns:
            The processes it holds now (locked by it or before it, or checkpointed).

        Raises:
            GateError: a process could not be locked (none this call locked stays so).
        """
        held: set[int] = set()
        done: list[int] = []
        for pid in record.pids:
            try:
                state = self._lock.state(pid)
                if state is not ProcessState.RUNNING:
                    held.add(pid)  # a previous kiwid (or a follow) locked it already
                    continue
                self._lock.lock(pid, self._timeout_ms)
            except CudaLockError as err:
                if err.name == "CUDA_ERROR_NOT_INITIALIZED" and procs.alive(pid):
                    continue  # no CUDA context (yet): nothing of it runs on the GPU
                for locked in done:
                    with contextlib.suppress(CudaLockError):
                        self._lock.unlock(locked)
                raise GateError(
                    f"{record.tenant}: cannot lock pid {pid}: {err}", pid, _answer(err)
                ) from err
            done.append(pid)
            held.add(pid)
        return frozenset(held)

    def state_of(self, pid: int, *, wait: bool = True) -> ProcessState | None:
        """The driver's state of ``pid`` (``None``: it has no CUDA context, or is gone).

        ``wait=False``: also ``None`` while another call of kiwid's on ``pid`` is in
        flight (a lock, a checkpoint, a restore), rather than wait for it in the
        driver's queue; that call decides where the process ends up.

        Raises:
            GateError: the driver could not say.
        """
        try:
            return self._lock.state(pid, wait=wait)
        except CudaLockBusy:
            return None
        except CudaLockError as err:
            if err.name == "CUDA_ERROR_NOT_INITIALIZED" or not procs.alive(pid):
                return None
            raise GateError(f"cannot read pid {pid}'s state: {err}", pid, _answer(err)) from err

    def lock_one(self, pid: int, *, wait: bool = True) -> bool:
        """Lock one running process; whether it is locked.

        ``False``: it has no context any more, or, with ``wait=False``, another call
        of kiwid's on it is in flight.

        Raises:
            GateError: the driver refused.
        """
        try:
            self._lock.lock(pid, self._timeout_ms, wait=wait)
        except CudaLockBusy:
            return False
        except CudaLockError as err:
            if err.name == "CUDA_ERROR_NOT_INITIALIZED" and procs.alive(pid):
                return False
            raise GateError(f"cannot lock pid {pid}: {err}", pid, _answer(err)) from err
        return True

    def fence(self, tenant: TenantInfo, record: GatedRecord) -> GatedRecord:
        """The record with the cgroup that fences ``tenant`` (to write ahead, then freeze).

        Raises:
            GateError: there is no fence here, or the tenant's cgroup cannot be found.
        """
        if self._fence is None:
            raise GateError(f"{record.tenant}: no cgroup freezer to fence it with")
        ref = self._fence.ref_of(tenant)
        try:
            ids = cgroup_ids(self._fence.layout, ref)
        except FreezeError as err:
            raise GateError(f"{record.tenant}: {err}") from err
        return replace(
            record, cgroup_v2=ref.v2, cgroup_v1_freezer=ref.v1_freezer, cgroup_ids=ids, fenced=True
        )

    def freeze_fence(self, record: GatedRecord) -> None:
        """Freeze a fenced record's cgroup.

        Raises:
            GateError: no fence here, or it did not freeze.
        """
        if self._fence is None or not record.fenced:
            raise GateError(f"{record.tenant}: no fence to freeze")
        self._fence.gate(record)

    def unfence(self, record: GatedRecord) -> GatedRecord:
        """Thaw a fenced record's cgroup (its lock holds it again); the record without it.

        Raises:
            GateError: the fence would not thaw.
        """
        if record.fenced:
            (self._fence or FreezeGate(CgroupLayout.detect())).thaw(record)
        return replace(record, fenced=False)

    def ungate(self, record: GatedRecord, guard: Guard = always) -> None:
        """Unlock every process that is still locked, then thaw its fence if it has one.

        The fence is thawed only while ``guard`` says the record is the one read: an
        unlock that returns after its deadline must not thaw the fence that kiwid
        froze meanwhile, beside its hung call.

        Raises:
            GateError: a live, locked process refused to unlock, or the fence to thaw.
        """
        unlock_all(self._lock, record)
        if record.fenced:
            (self._fence or FreezeGate(CgroupLayout.detect())).ungate(record, guard)

    def holds(self, tenant: TenantInfo) -> bool:
        """Whether a process of ``tenant`` is locked or checkpointed now."""
        return bool(self.held(tenant.pids))

    def held(self, pids: Iterable[int]) -> list[int]:
        """Those of ``pids`` that are locked or checkpointed now."""
        out: list[int] = []
        for pid in sorted(pids):
            with contextlib.suppress(CudaLockError):
                if self._lock.state(pid) is not ProcessState.RUNNING:
                    out.append(pid)
        return out

    def forget(self, tenant: str) -> None:
        """Drop the fence's isolation cgroup, if any (the lock ends with the process)."""
        if self._fence is not None:
            self._fence.forget(tenant)


def unlock_all(lock: CudaLock, record: GatedRecord) -> None:
    """Unlock every live, locked process of ``record`` (restore those in host RAM first).

    Raises:
        GateError: a live process refused to unlock, or its memory stayed in host RAM.
    """
    failed: list[str] = []
    first: GateError | None = None
    for pid, start in record.pid_starts().items():
        if not procs.alive(pid, start):
            continue  # gone (or a zombie, or the PID is someone else's now)
        try:
            state = lock.state(pid)
            if state is ProcessState.CHECKPOINTED:  # unlocking would strand it
                failed.append(f"pid {pid}: its memory is in host RAM; restore it first")
                first = first or GateError("", pid, "CHECKPOINTED")
            elif state is ProcessState.LOCKED:
                _unlock(lock, pid)
        except CudaLockError as err:
            # A process being torn down (SIGKILLed) has no CUDA state left to
            # query: the driver says NOT_INITIALIZED. Nothing stays locked.
            if err.name == "CUDA_ERROR_NOT_INITIALIZED" or not procs.alive(pid):
                continue
            failed.append(f"pid {pid}: {err}")
            answer = "CHECKPOINTED" if err.name == "CHECKPOINTED" else _answer(err)
            first = first or GateError("", pid, answer)
    if failed:
        message = f"{record.tenant}: cannot unlock {'; '.join(failed)}"
        raise GateError(message, first.pid if first else None, first.answer if first else None)


def _unlock(lock: CudaLock, pid: int) -> None:
    """Unlock ``pid``; a refusal because a checkpoint in flight just ended says so.

    Raises:
        CudaLockError: the unlock failed; ``CHECKPOINTED`` when its memory went to
            host RAM meanwhile (restore it first).
    """
    try:
        lock.unlock(pid)
    except CudaLockError as err:
        with contextlib.suppress(CudaLockError):
            if lock.state(pid) is ProcessState.CHECKPOINTED:
                raise CudaLockError(-1, "CHECKPOINTED", "a checkpoint ended meanwhile") from err
        raise


def _answer(err: CudaLockError) -> str:
    return f"{err.name} ({err.code})"
