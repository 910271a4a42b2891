"""Jobs an operator asks for a stuck tenant: ``kiwictl retry`` and ``kiwictl release``.

A retry mends: it asks the driver where the tenant's memory is and which of its
processes run, locks (or freezes) what runs, brings back a part left in host RAM
so that all of it is in one place, lifts the fence once the lock holds, and says
where the memory is (``Mended``). What it cannot mend leaves the tenant stuck,
with the new reason.

A release lets the tenant run ungated on the operator's word, by the same
procedure as ``kiwid recover`` (:func:`kiwid.daemon.gating.recovery.release`):
restore, unlock, thaw whatever can be; what could not is said (``Released``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kiwid.core.events import Event, Mended, Released, TenantFaulted
from kiwid.core.residency import Residency
from kiwid.daemon.engine.executor import Job
from kiwid.daemon.engine.tools import Tools, who
from kiwid.daemon.gating import recovery
from kiwid.daemon.gating.cudagate import CudaLockGate
from kiwid.daemon.gating.gates import GateError
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.gating.swap import Placement, SwapError

log = logging.getLogger("kiwid.engine")
R = Residency


def retry(tools: Tools, job: Job) -> list[Event]:
    """Mend a stuck tenant: gated whole, its memory all in one place; or say why not."""
    name = who(job.info, job.tenant)
    record = tools.state.records.get(job.tenant)
    try:
        mended = _mend(tools, job, record)
    except (GateError, SwapError, OSError) as err:
        after = tools.placement(record) if record is not None else Placement(R.RESIDENT, True)
        reason = f"the retry failed: {err}" + (f"; {after.detail}" if after.detail else "")
        log.error("%s stays stuck: %s", name, reason)
        pid = err.pid if isinstance(err, GateError | SwapError) else None
        answer = err.answer if isinstance(err, GateError | SwapError) else None
        return [
            TenantFaulted(
                job.tenant,
                "retry",
                reason,
                after.where,
                not after.runs,
                pid=pid,
                answer=answer,
                epoch=job.epoch,
            )
        ]
    log.info("Mended %s: gated, its memory %s", name, _where(mended))
    return [Mended(job.tenant, mended, epoch=job.epoch)]


def _mend(tools: Tools, job: Job, record: GatedRecord | None) -> Residency:
    """Bring the tenant to gated-and-whole; where its memory is then.

    Raises:
        GateError: it could not be gated, or stays out of step.
        SwapError: its memory could not be brought together.
        OSError: the state file could not be written.
    """
    if record is None:  # its gate never took, so it was never recorded: gate it now
        if job.info is None:
            raise GateError(f"{job.tenant}: unknown to the tenant table")
        fresh = tools.gate.prepare(job.info)
        tools.state.put(fresh)  # write-ahead, as any gate
        tools.gate.gate(fresh)
        return R.RESIDENT
    placement = tools.placement(record)
    if placement.runs:  # a process of it is unlocked: lock (or freeze) it again
        tools.gate.gate(record)
    if placement.where is R.UNKNOWN and tools.swapper is not None:
        tools.swapper.swap_in(record)  # part of it in host RAM: all of it to the card
    placement = tools.placement(record)
    if placement.where is R.UNKNOWN or placement.runs:
        raise GateError(f"{job.tenant}: still out of step: {placement.detail}")
    if record.fenced and isinstance(tools.gate, CudaLockGate):
        record = tools.gate.unfence(record)  # the lock holds it again
    home = placement.where is R.HOST
    tools.state.put(
        replace(
            record,
            fault=None,
            swapped=record.swapped if home else None,
            swap_method=record.swap_method if home else None,
        )
    )
    return placement.where


def release(tools: Tools, job: Job) -> list[Event]:
    """Restore, unlock and thaw a stuck tenant on the operator's word; say what could not."""
    name = who(job.info, job.tenant)
    record = tools.state.records.get(job.tenant)
    if record is None:
        note = "kiwid held nothing of it"
        return [Released(job.tenant, complete=True, note=note, epoch=job.epoch)]
    undo = recovery.undo_with(tools.state.dir, tools.gate, tools.swapper, tools.state.unchanged)
    again = f"kiwictl release {job.tenant}"
    why = recovery.release(record, undo(record), " on an operator's word", again)
    if why is None:
        tools.state.drop(job.tenant, expect=record.version)  # a fence written since stays
        note = "restored, unlocked and thawed"
        return [Released(job.tenant, complete=True, note=note, epoch=job.epoch)]
    after = tools.placement(record)
    log.error("Could not release %s whole: %s", name, why)
    return [
        Released(job.tenant, complete=False, note=why, contained=not after.runs, epoch=job.epoch)
    ]


def _where(residency: Residency) -> str:
    return "in host RAM" if residency is R.HOST else "on the card"
