"""Swappers: how a gated tenant's GPU memory goes to host RAM and comes back.

* ``CheckpointSwapper`` uses the driver's checkpoint API on every process of the
  tenant: ``cuCheckpointProcessCheckpoint`` needs the process LOCKED, so it
  works with the CUDA-lock gate only (a frozen process cannot be checkpointed).
  Restore leaves the process locked; the gate's ungate unlocks it.
* ``SimSwapper`` moves the simulated GPU's bookkeeping and takes the time its
  link model says (:mod:`kiwid.adapters.sim.link`: each direction at its own
  rate, shared by the swaps going that way), on the worker thread. Before each
  swap it meets the faults injected with ``sim-fault``
  (:mod:`kiwid.adapters.sim.faults`), as the driver's would come.

Both leave the tenant as it was when they fail: a failed swap-out restores what
it had already checkpointed, so the memory is on the card and the tenant gated.
The one exception is injected on purpose: a ``stuck`` fault leaves the memory
in host RAM, as the driver of cuda-checkpoint issue 44 does.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple, Protocol

from kiwid.adapters import procs
from kiwid.adapters.cudalock import CudaLock, CudaLockError, ProcessState
from kiwid.adapters.sim import SimBackend, SimFault, SimOutOfMemory, swap_in_persisted
from kiwid.adapters.sim.link import Link
from kiwid.core.residency import Residency
from kiwid.daemon.gating.record import GatedRecord

log = logging.getLogger("kiwid.swap")


TRANSIENT = frozenset({"CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_NOT_READY", "CUDA_ERROR_TIMEOUT"})
"""The driver's answers that say nothing about the tenant: not now (host or device
memory short, its work not drained in time). Tried again at its next turn."""
UNSUPPORTED = frozenset({"CUDA_ERROR_NOT_SUPPORTED"})
"""The driver's answers that say the tenant can never be checkpointed (managed or
IPC memory, an NCCL job): its memory stays on the card, and its workload is
remembered so."""
CHECKPOINT_FLOOR_BYTES_S = {"out": 1e9, "in": 2e9}
"""The slowest a checkpoint (out) and a restore (in) are expected to run: about
half of what an H200 measured (2.2 GB/s out, 5-6 GB/s in). A checkpoint's deadline
is ``gpu.driver_timeout`` plus twice its size at its rate; a restore's (a swap-in, a
retry, a release, a converge) twice ``gpu.driver_timeout`` plus twice its size at
its rate (:mod:`kiwid.daemon.engine.deadlines`)."""


class SwapError(Exception):
    """A tenant's memory could not be moved.

    Where it is then is for :meth:`Swapper.placement` to say; the error says why.

    Attributes:
        pid: The process the failing call was about, if one.
        answer: What the driver answered, e.g. ``CUDA_ERROR_OUT_OF_MEMORY (2)``.
        transient: The answer says nothing about the tenant: try again later.
        unsupported: The answer says the tenant can never be checkpointed.
    """

    def __init__(
        self,
        message: str,
        pid: int | None = None,
        answer: str | None = None,
        *,
        transient: bool = False,
        unsupported: bool = False,
    ) -> None:
        super().__init__(message)
        self.pid = pid
        self.answer = answer
        self.transient = transient
        self.unsupported = unsupported


class Placement(NamedTuple):
    """Where a tenant's memory is by the driver, and whether any of it runs."""

    where: Residency
    """``RESIDENT``, ``HOST``, or ``UNKNOWN`` (part of it each way, or unreadable)."""
    runs: bool = False
    """A process of it runs (unlocked) although it should be gated."""
    detail: str = ""
    """Per process, for the operator (empty when all is as expected)."""
    on_card: tuple[int, ...] = ()
    """Its processes whose memory is on the card (locked or running)."""
    in_host: tuple[int, ...] = ()
    """Its processes whose memory is in host RAM (checkpointed)."""

    @property
    def on_card_gated(self) -> bool:
        """All of it is on the card and none of it runs: as before a checkpoint."""
        return self.where is Residency.RESIDENT and not self.runs


class Swapper(Protocol):
    """Move gated tenants' memory between the GPU and host RAM."""

    method: str

    def swap_out(self, record: GatedRecord) -> None:
        """Move the memory of the (gated) tenant to host RAM.

        Raises:
            SwapError: it could not all be moved (see :meth:`placement` for where it is).
        """
        ...

    def swap_in(self, record: GatedRecord) -> None:
        """Bring the memory back; the tenant stays gated.

        Raises:
            SwapError: it could not all be brought back (see :meth:`placement`).
        """
        ...

    def placement(self, record: GatedRecord) -> Placement:
        """Where the tenant's memory is now, by the driver (or the simulated GPU)."""
        ...

    def expected_s(self, nbytes: int, direction: str) -> float:
        """How long moving ``nbytes`` ``"out"`` or ``"in"`` takes at the slowest expected rate."""
        ...


class CheckpointSwapper:
    """The driver's ``cuCheckpointProcessCheckpoint`` / ``Restore``."""

    method = "checkpoint"

    def __init__(self, lock: CudaLock) -> None:
        """Use ``lock``'s driver library (it must have :attr:`CudaLock.can_swap`)."""
        self._lock = lock

    def swap_out(self, record: GatedRecord) -> None:
        """Checkpoint every process of the tenant; undo the ones done on failure.

        Raises:
            SwapError: a checkpoint failed (its undo is tried; the placement says how it went).
        """
        done: list[int] = []
        for pid, start in record.pid_starts().items():
            try:
                if recorded_state(self._lock, pid, start) is not ProcessState.LOCKED:
                    continue  # gone, not a CUDA process, or already in host RAM
                self._lock.checkpoint(pid)
            except CudaLockError as err:
                if not procs.alive(pid, start):
                    continue  # it ended during its checkpoint: nothing of it to move
                for back in reversed(done):
                    try:
                        self._lock.restore(back)
                    except CudaLockError as again:
                        log.error("pid %d stays in host RAM: restore failed: %s", back, again)
                raise _swap_error(f"checkpoint of pid {pid}", pid, err) from err
            done.append(pid)

    def swap_in(self, record: GatedRecord) -> None:
        """Restore every checkpointed process of the tenant.

        Raises:
            SwapError: a restore failed.
        """
        restore_checkpointed(self._lock, record)

    def placement(self, record: GatedRecord) -> Placement:
        """Where the tenant's memory is by the driver's process states."""
        return driver_placement(self._lock, record)

    def expected_s(self, nbytes: int, direction: str) -> float:
        """Seconds at the slowest rate expected of the driver (``CHECKPOINT_FLOOR_BYTES_S``)."""
        return nbytes / CHECKPOINT_FLOOR_BYTES_S[direction]


def driver_placement(lock: CudaLock, record: GatedRecord) -> Placement:
    """Where a tenant's memory is by the driver: each live process's state, summed up."""
    on_card, in_host, runs, unread = [], [], [], []
    for pid, start in record.pid_starts().items():
        if not procs.alive(pid, start):
            continue
        try:
            state = lock.state(pid)
        except CudaLockError as err:
            if err.name != "CUDA_ERROR_NOT_INITIALIZED":
                unread.append(f"pid {pid}: {err}")
            continue  # no CUDA context: no memory of it anywhere
        if state is ProcessState.CHECKPOINTED:
            in_host.append(pid)
        elif state is ProcessState.RUNNING:
            on_card.append(pid)
            runs.append(pid)
        elif state is ProcessState.LOCKED:
            on_card.append(pid)
        else:
            unread.append(f"pid {pid}: {state.name}")
    return _placement(on_card, in_host, runs, unread)


def _placement(
    on_card: list[int], in_host: list[int], runs: list[int], odd: list[str]
) -> Placement:
    parts = [*odd]
    if on_card and in_host:
        parts.append(f"on the card: pid {', '.join(map(str, on_card))}")
        parts.append(f"in host RAM: pid {', '.join(map(str, in_host))}")
    if runs:
        parts.append(f"unlocked: pid {', '.join(map(str, runs))}")
    if odd or (on_card and in_host):
        where = Residency.UNKNOWN
    else:
        where = Residency.HOST if in_host else Residency.RESIDENT
    return Placement(where, bool(runs), "; ".join(parts), tuple(on_card), tuple(in_host))


def _swap_error(what: str, pid: int, err: CudaLockError) -> SwapError:
    answer = f"{err.name} ({err.code})"
    return SwapError(
        f"{what}: {err}",
        pid,
        answer,
        transient=err.name in TRANSIENT,
        unsupported=err.name in UNSUPPORTED,
    )


def restore_checkpointed(lock: CudaLock, record: GatedRecord) -> None:
    """Restore each CHECKPOINTED process of ``record`` (they stay locked).

    Raises:
        SwapError: a restore failed (out of device memory, most likely).
    """
    for pid, start in record.pid_starts().items():
        try:
            if recorded_state(lock, pid, start) is ProcessState.CHECKPOINTED:
                lock.restore(pid)
        except CudaLockError as err:
            if not procs.alive(pid, start):
                continue  # it ended during its restore: its memory went with it
            raise _swap_error(f"restore of pid {pid}", pid, err) from err


def recorded_state(lock: CudaLock, pid: int, start: int | None) -> ProcessState | None:
    """The driver's state of a process a record names (``None``: gone, or no CUDA context).

    A record keeps every process it ever named, also one that ended since (a process
    a follow locked while its tenant waited): the driver answers ``NOT_INITIALIZED``
    for it, and it has no memory anywhere. It must not keep the rest of its tenant's
    memory from moving.

    Raises:
        CudaLockError: the driver could not say, for a live process.
    """
    if not procs.alive(pid, start):
        return None
    try:
        return lock.state(pid)
    except CudaLockError as err:
        if err.name == "CUDA_ERROR_NOT_INITIALIZED" or not procs.alive(pid, start):
            return None
        raise


class SimSwapper:
    """The simulated GPU's swap: bookkeeping plus the time its link model says.

    Each GPU's link carries ``out_bytes_per_s`` towards host RAM and
    ``in_bytes_per_s`` back at the same time; swaps in one direction share it.
    """

    method = "sim"

    def __init__(self, backend: SimBackend, out_bytes_per_s: float, in_bytes_per_s: float) -> None:
        """Swap on ``backend`` at the given rates (bytes per second, per direction)."""
        self._backend = backend
        self._rates = {"out": out_bytes_per_s, "in": in_bytes_per_s}
        self._link = Link(self._rates)

    def swap_out(self, record: GatedRecord) -> None:
        """Take the tenant's memory off the simulated GPU, once the link has carried it."""
        fault = self._injected(record, "checkpoint")
        self._link.transfer(self._backend.resident_of(record.pids), "out")
        self._backend.swap_out(record.pids)
        if fault is not None:  # stuck: the memory went, the swap failed all the same
            raise SwapError(_message(fault), fault.pid, "injected: stuck")

    def swap_in(self, record: GatedRecord) -> None:
        """Bring it back if it fits, once the link has carried it."""
        fault = self._injected(record, "restore")
        if fault is not None:  # stuck: it stays in host RAM
            raise SwapError(_message(fault), fault.pid, "injected: stuck")
        try:
            self._backend.check_swap_in(record.pids)
        except SimOutOfMemory as err:
            raise SwapError(str(err), answer="out of memory", transient=True) from err
        self._link.transfer(self._backend.swapped_of(record.pids), "in")
        try:
            self._backend.swap_in(record.pids)
        except SimOutOfMemory as err:  # the card filled up meanwhile
            raise SwapError(str(err), answer="out of memory", transient=True) from err

    def placement(self, record: GatedRecord) -> Placement:
        """Where the simulated GPU has the tenant's memory (the freezer holds its processes)."""
        on_card = [p for p in record.pids if self._backend.resident_of([p])]
        in_host = [p for p in record.pids if self._backend.swapped_of([p])]
        return _placement(on_card, in_host, [], [])

    def expected_s(self, nbytes: int, direction: str) -> float:
        """Seconds at the link's configured rate (alone on it)."""
        return nbytes / self._rates[direction]

    def _injected(self, record: GatedRecord, op: str) -> SimFault | None:
        """Meet the fault injected for this swap: wait out a hang, raise a failure.

        Returns:
            A ``stuck`` fault, for the caller to fail after its work; else ``None``.

        Raises:
            SwapError: a ``fail`` fault.
        """
        faults = self._backend.faults
        fault = faults.take(record.pids, op)
        if fault is not None and fault.kind == "hang":
            log.warning(
                "%s: held by %s; it waits for sim-fault none", record.tenant, _message(fault)
            )
            faults.wait_cleared(fault)
            return None
        if fault is not None and fault.kind == "fail":
            raise SwapError(_message(fault), fault.pid, "injected: fail", transient=True)
        return fault


def _message(fault: SimFault) -> str:
    return f"injected fault (sim-fault): {fault.op} of pid {fault.pid}: {fault.kind}"


def restore_record(record: GatedRecord, state_dir: Path) -> None:
    """Bring a swapped tenant's memory back without a daemon (recover, start-up).

    Raises:
        SwapError: it could not be restored; it stays in host RAM, gated.
    """
    if record.method != "cuda-lock":
        # The simulated GPU keeps what is swapped in its file: it says, not only the
        # record (which does not know of a swap a killed kiwid was in the middle of).
        persisted = state_dir / "sim.json"
        if record.swap_method == "sim" or persisted.exists():
            try:
                swap_in_persisted(persisted, record.pids)
            except SimOutOfMemory as err:
                raise SwapError(str(err), answer="out of memory", transient=True) from err
        return
    try:
        lock = CudaLock()
    except CudaLockError as err:
        raise SwapError(f"the driver's checkpoint API is unavailable here: {err}") from err
    restore_checkpointed(lock, record)
