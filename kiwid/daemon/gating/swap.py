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
from typing import Protocol

from kiwid.adapters.cudalock import CudaLock, CudaLockError, ProcessState
from kiwid.adapters.sim import SimBackend, SimFault, SimOutOfMemory, swap_in_persisted
from kiwid.adapters.sim.link import Link
from kiwid.daemon.gating.state import GatedRecord

log = logging.getLogger("kiwid.swap")


class SwapError(Exception):
    """A tenant's memory could not be moved (it is where it was)."""


class Swapper(Protocol):
    """Move gated tenants' memory between the GPU and host RAM."""

    method: str

    def swap_out(self, record: GatedRecord) -> None:
        """Move the memory of the (gated) tenant to host RAM.

        Raises:
            SwapError: it could not be moved; it is on the GPU, still gated.
        """
        ...

    def swap_in(self, record: GatedRecord) -> None:
        """Bring the memory back; the tenant stays gated.

        Raises:
            SwapError: it could not be brought back; it stays in host RAM, gated.
        """
        ...


class CheckpointSwapper:
    """The driver's ``cuCheckpointProcessCheckpoint`` / ``Restore``."""

    method = "checkpoint"

    def __init__(self, lock: CudaLock) -> None:
        """Use ``lock``'s driver library (it must have :attr:`CudaLock.can_swap`)."""
        self._lock = lock

    def swap_out(self, record: GatedRecord) -> None:
        """Checkpoint every process of the tenant; undo the ones done on failure."""
        done: list[int] = []
        for pid in record.pids:
            try:
                if self._lock.state(pid) is not ProcessState.LOCKED:
                    continue  # not a CUDA process, or already in host RAM
                self._lock.checkpoint(pid)
            except CudaLockError as err:
                for back in reversed(done):
                    try:
                        self._lock.restore(back)
                    except CudaLockError as again:
                        log.error("pid %d stays in host RAM: restore failed: %s", back, again)
                raise SwapError(f"checkpoint of pid {pid}: {err}") from err
            done.append(pid)

    def swap_in(self, record: GatedRecord) -> None:
        """Restore every checkpointed process of the tenant."""
        restore_checkpointed(self._lock, record)


def restore_checkpointed(lock: CudaLock, record: GatedRecord) -> None:
    """Restore each CHECKPOINTED process of ``record`` (they stay locked).

    Raises:
        SwapError: a restore failed (out of device memory, most likely).
    """
    for pid in record.pids:
        try:
            if lock.state(pid) is ProcessState.CHECKPOINTED:
                lock.restore(pid)
        except CudaLockError as err:
            raise SwapError(f"restore of pid {pid}: {err}") from err


class SimSwapper:
    """The simulated GPU's swap: bookkeeping plus the time its link model says.

    Each GPU's link carries ``out_bytes_per_s`` towards host RAM and
    ``in_bytes_per_s`` back at the same time; swaps in one direction share it.
    """

    method = "sim"

    def __init__(self, backend: SimBackend, out_bytes_per_s: float, in_bytes_per_s: float) -> None:
        """Swap on ``backend`` at the given rates (bytes per second, per direction)."""
        self._backend = backend
        self._link = Link({"out": out_bytes_per_s, "in": in_bytes_per_s})

    def swap_out(self, record: GatedRecord) -> None:
        """Take the tenant's memory off the simulated GPU, once the link has carried it."""
        fault = self._injected(record, "checkpoint")
        self._link.transfer(self._backend.resident_of(record.pids), "out")
        self._backend.swap_out(record.pids)
        if fault is not None:  # stuck: the memory went, the swap failed all the same
            raise SwapError(_message(fault))

    def swap_in(self, record: GatedRecord) -> None:
        """Bring it back if it fits, once the link has carried it."""
        fault = self._injected(record, "restore")
        if fault is not None:  # stuck: it stays in host RAM
            raise SwapError(_message(fault))
        try:
            self._backend.check_swap_in(record.pids)
        except SimOutOfMemory as err:
            raise SwapError(str(err)) from err
        self._link.transfer(self._backend.swapped_of(record.pids), "in")
        try:
            self._backend.swap_in(record.pids)
        except SimOutOfMemory as err:  # the card filled up meanwhile
            raise SwapError(str(err)) from err

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
            raise SwapError(_message(fault))
        return fault


def _message(fault: SimFault) -> str:
    return f"injected fault (sim-fault): {fault.op} of pid {fault.pid}: {fault.kind}"


def restore_record(record: GatedRecord, state_dir: Path) -> None:
    """Bring a swapped tenant's memory back without a daemon (recover, start-up).

    Raises:
        SwapError: it could not be restored; it stays in host RAM, gated.
    """
    if not record.swapped:
        return
    if record.swap_method == "sim":
        try:
            swap_in_persisted(state_dir / "sim.json", record.pids)
        except SimOutOfMemory as err:
            raise SwapError(str(err)) from err
        return
    try:
        lock = CudaLock()
    except CudaLockError as err:
        raise SwapError(f"the driver's checkpoint API is unavailable here: {err}") from err
    restore_checkpointed(lock, record)
