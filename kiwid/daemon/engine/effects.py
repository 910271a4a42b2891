"""Carrying out one job: the gate, the swapper and the state file, in that order.

Everything here blocks (a freeze waits for the kernel, a checkpoint of 47 GiB
takes half a minute), so the daemon runs it on worker threads; tests run it
inline. The state file is written ahead of every change it records: before a
tenant is gated, before its memory leaves the card. What a job did goes back to
the scheduler as events (:class:`~kiwid.core.events.SwapFinished`,
:class:`~kiwid.core.events.GateFailed`); nothing here decides anything.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kiwid.core.events import Event, GateFailed, MemoryFreeSeen, SwapFinished
from kiwid.daemon.engine.executor import Job, Kind
from kiwid.daemon.gating.gates import GateError, TenantGate
from kiwid.daemon.gating.state import StateFile
from kiwid.daemon.gating.swap import SwapError, Swapper
from kiwid.daemon.tenants.tracker import TenantInfo

log = logging.getLogger("kiwid.engine")


def _unknown(_: str) -> int | None:
    return None


def _no_reason(_: Sequence[int]) -> str | None:
    return None


def _nobody(tenant: str, reason: str) -> None:
    return None


@dataclass(frozen=True)
class SwapGuards:
    """What a swap asks of the world around it (the daemon wires them to the GPU)."""

    free_bytes: Callable[[str], int | None] = _unknown
    """A GPU's free memory now, by the driver (``None``: it cannot be read)."""
    reserve_bytes: Callable[[], int] = int
    """``memory.reserve_mib`` in force, in bytes."""
    unswappable: Callable[[Sequence[int]], str | None] = _no_reason
    """Why a tenant's processes cannot be checkpointed (``None``: no sign of it)."""
    checkpoint_failed: Callable[[str, str], None] = _nobody
    """Told of every tenant the driver could not (or must not) checkpoint, and why."""


class Effects:
    """The gate, the swapper and the state file, behind one ``carry_out``."""

    def __init__(
        self,
        gate: TenantGate,
        state: StateFile,
        swapper: Swapper | None = None,
        clock: Callable[[], float] = time.monotonic,
        guards: SwapGuards | None = None,
    ) -> None:
        """Gate with ``gate``, record in ``state``, move memory with ``swapper``."""
        self.gate = gate
        self.state = state
        self.swapper = swapper
        self.guards = guards or SwapGuards()
        self._clock = clock

    def carry_out(self, job: Job) -> list[Event]:
        """Do ``job``; return what the scheduler must hear of it (never raises)."""
        try:
            match job.kind:
                case Kind.GATE:
                    return self._gate(job)
                case Kind.UNGATE:
                    self._ungate(job.tenant)
                case Kind.SWAP_OUT | Kind.SWAP_IN:
                    return self._swap(job)
                case Kind.FORGET:
                    self._forget(job.tenant)
        except Exception:  # a bug must not stop the rotation for good
            log.exception("Carrying out %s of %s failed", job.kind.value, job.tenant)
            if job.kind in (Kind.SWAP_OUT, Kind.SWAP_IN):
                direction = "out" if job.kind is Kind.SWAP_OUT else "in"
                return [SwapFinished(job.tenant, direction, ok=False, reason="internal error")]
        return []

    def _gate(self, job: Job) -> list[Event]:
        info = job.info
        if info is None:
            return [GateFailed(job.tenant, "unknown to the tenant table")]
        try:
            record = self.gate.prepare(info)
            self.state.put(record)  # write-ahead: recorded before it is frozen
            try:
                self.gate.gate(record)
            except GateError:
                self.state.drop(record.tenant)
                raise
        except GateError as err:
            log.warning("Could not gate %s: %s; it runs on, the rotation goes on", _who(info), err)
            return [GateFailed(job.tenant, str(err))]
        log.debug("Gated %s", _who(info))
        return []

    def _ungate(self, tenant: str) -> bool:
        """Ungate a recorded tenant; whether nothing of it stays gated."""
        record = self.state.records.get(tenant)
        if record is None:
            return True
        if record.swapped:  # never: the scheduler lets go only what is on the card
            log.error("Not ungating %s: its memory is in host RAM", tenant)
            return False
        try:
            self.gate.ungate(record)
        except GateError as err:
            log.error(
                "Could not ungate %s: %s (kept in %s for kiwid recover)",
                tenant,
                err,
                self.state.path,
            )
            return False
        self.state.drop(tenant)
        log.debug("Ungated %s", tenant)
        return True

    def _swap(self, job: Job) -> list[Event]:
        """Carry out one swap; say how it went, after the cards' free memory now."""
        finished = self._swap_once(job)
        return [*self._readings(job.gpus), finished]

    def _readings(self, gpus: frozenset[str]) -> list[Event]:
        """Fresh readings of the cards' free memory (a restore may wait for one)."""
        out: list[Event] = []
        for gpu in sorted(gpus):
            free = self.guards.free_bytes(gpu)
            if free is not None:
                out.append(MemoryFreeSeen(gpu, free))
        return out

    def _swap_once(self, job: Job) -> SwapFinished:
        direction = "out" if job.kind is Kind.SWAP_OUT else "in"
        who = _who(job.info) if job.info else job.tenant
        record = self.state.records.get(job.tenant)
        swapper = self.swapper
        if swapper is None or record is None:
            why = "swapping is unavailable" if swapper is None else "it is not gated"
            log.warning("Swap %s of %s not done: %s", direction, who, why)
            return SwapFinished(job.tenant, direction, ok=False, reason=why)
        if direction == "out" and (never := self.guards.unswappable(record.pids)) is not None:
            log.warning("Swap out of %s not done: %s; its memory stays on the GPU", who, never)
            self.guards.checkpoint_failed(job.tenant, never)
            return SwapFinished(job.tenant, "out", ok=False, reason=never, unswappable=True)
        if direction == "in" and (short := self._too_little_free(record.swapped or {})):
            log.info("Swap in of %s waits: %s", who, short)
            return SwapFinished(job.tenant, "in", ok=False, reason=short, deferred=True)
        started = self._clock()
        try:
            if direction == "out":
                moved = sum(job.sizes.values())
                swapped = replace(record, swapped=dict(job.sizes), swap_method=swapper.method)
                self.state.put(swapped)  # write-ahead: recovery restores it if we die
                try:
                    swapper.swap_out(swapped)
                except SwapError as err:
                    self.state.put(record)
                    self.guards.checkpoint_failed(job.tenant, str(err))
                    raise
            else:
                moved = sum((record.swapped or {}).values())
                if record.swapped:
                    swapper.swap_in(record)
                    self.state.put(replace(record, swapped=None, swap_method=None))
        except SwapError as err:
            log.error(
                "Swap failed: %s of %s: %s; it %s, gated; the rotation goes on",
                direction,
                who,
                err,
                "keeps its memory on the GPU" if direction == "out" else "stays in host RAM",
            )
            return SwapFinished(job.tenant, direction, ok=False, reason=str(err))
        seconds = self._clock() - started
        log.info(
            "Swapped %s %s: %d bytes in %.2f s (%.2f GB/s)",
            direction,
            who,
            moved,
            seconds,
            moved / seconds / 1e9 if seconds > 0 else 0.0,
        )
        return SwapFinished(job.tenant, direction, ok=True, moved_bytes=moved, seconds=seconds)

    def _too_little_free(self, coming: dict[str, int]) -> str | None:
        """Why a restore of ``coming`` (bytes per GPU) must not start now (``None``: it may).

        A restore that runs out of device memory can leave a process stuck in host
        RAM for good, so the driver's free memory is read right before each one.
        """
        reserve = self.guards.reserve_bytes()
        for gpu, nbytes in sorted(coming.items()):
            free = self.guards.free_bytes(gpu)
            if free is not None and free < nbytes + reserve:
                gib = 2**30
                return (
                    f"waiting for free memory on GPU {gpu}: the driver reports "
                    f"{free / gib:.1f} GiB free, its restore needs {nbytes / gib:.1f} GiB plus "
                    f"memory.reserve_mib ({reserve / gib:.1f} GiB)"
                )
        return None

    def _forget(self, tenant: str) -> None:
        """A tenant left: undo what may remain of its gate (its cgroup may be gone)."""
        record = self.state.records.get(tenant)
        if record is not None:
            if record.swapped:  # its processes are gone, and its host memory with them
                self.state.drop(tenant)
            else:
                self._ungate(tenant)
        self.gate.forget(tenant)


def _who(info: TenantInfo) -> str:
    """A tenant as log lines name it: ``name (key)``, or the key alone."""
    name, key = info.identity.name, info.key
    return f"{name} ({key})" if name != key else key
