"""Carrying out one job, whatever it is, and saying how it went.

Everything here blocks (a freeze waits for the kernel, a checkpoint of 47 GiB
takes half a minute), so the daemon runs it on worker threads; tests run it
inline. Each kind of job lives in its own module (:mod:`.gate_jobs`,
:mod:`.swap_jobs`, :mod:`.mend_jobs`, :mod:`.converge_jobs`, :mod:`.side_jobs`);
this one dispatches, and makes sure that every job reports an outcome the
scheduler hears, echoing the job's epoch, also when it raises: a gate that raised
is a gate that did not take, never a success.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kiwid.core.events import Event, TenantFaulted
from kiwid.core.residency import Residency
from kiwid.daemon.engine import converge_jobs, gate_jobs, mend_jobs, side_jobs, swap_jobs
from kiwid.daemon.engine.executor import OPERATIONS, Job, Kind
from kiwid.daemon.engine.tools import SwapGuards, Tools
from kiwid.daemon.gating.gates import TenantGate
from kiwid.daemon.gating.state import StateFile
from kiwid.daemon.gating.swap import Swapper

log = logging.getLogger("kiwid.engine")

_JOBS: dict[Kind, Callable[[Tools, Job], list[Event]]] = {
    Kind.GATE: gate_jobs.gate,
    Kind.UNGATE: gate_jobs.ungate,
    Kind.FORGET: gate_jobs.forget,
    Kind.SWAP_OUT: swap_jobs.swap,
    Kind.SWAP_IN: swap_jobs.swap,
    Kind.RETRY: mend_jobs.retry,
    Kind.RELEASE: mend_jobs.release,
    Kind.CONVERGE: converge_jobs.converge,
    Kind.FOLLOW: side_jobs.follow,
    Kind.FENCE: side_jobs.fence,
}


class Effects:
    """The gate, the swapper and the state file, behind one ``carry_out``."""

    def __init__(
        self,
        gate: TenantGate,
        state: StateFile,
        swapper: Swapper | None = None,
        clock: Callable[[], float] | None = None,
        guards: SwapGuards | None = None,
    ) -> None:
        """Gate with ``gate``, record in ``state``, move memory with ``swapper``."""
        self.tools = Tools(gate, state, swapper, guards or SwapGuards())
        if clock is not None:
            self.tools.clock = clock

    @property
    def gate(self) -> TenantGate:
        """The gate in use."""
        return self.tools.gate

    @property
    def state(self) -> StateFile:
        """The state file."""
        return self.tools.state

    @property
    def swapper(self) -> Swapper | None:
        """The swapper, if memory can move here."""
        return self.tools.swapper

    def carry_out(self, job: Job) -> list[Event]:
        """Do ``job``; return what the scheduler must hear of it (never raises)."""
        try:
            return _JOBS[job.kind](self.tools, job)
        except Exception as err:  # a bug must not stop the rotation, nor pass for a success
            log.exception("Carrying out %s of %s failed", job.kind.value, job.tenant)
            return self._failed(job, err)

    def _failed(self, job: Job, err: Exception) -> list[Event]:
        """What the scheduler hears of a job that raised: the tenant is stuck.

        A job that locks or unlocks may have left it running; any other left it
        gated, its memory wherever the driver says. The converge that follows the
        fault finds out, and contains it.
        """
        operation = OPERATIONS.get(job.kind)
        if operation is None:  # a forget: the tenant is gone already
            return []
        reason = f"internal error during its {job.kind.value}: {err!r}"
        moving = job.kind in (Kind.SWAP_OUT, Kind.SWAP_IN, Kind.RETRY, Kind.RELEASE)
        where = Residency.UNKNOWN if moving else None
        contained = job.kind in (Kind.SWAP_OUT, Kind.SWAP_IN)
        fault = TenantFaulted(job.tenant, operation, reason, where, contained, epoch=job.epoch)
        return [fault]
