"""Jobs that move memory: a swap-out and a swap-in, with the outcome the driver says.

The scheduler decides how much leaves (``SwapOut`` carries its sizes); the state
file records it ahead of the checkpoint and keeps it until the memory is back. A
swap that fails is judged by where the memory is afterwards, by the driver's own
process states (:meth:`~kiwid.daemon.gating.swap.Swapper.placement`), not by the
call's answer alone: all of it where it was is a plain failure (the rotation goes
on, the tenant tries again later); anything else, part here and part there, a
process unlocked, or memory where the call said it is not, leaves the tenant
stuck with the state file still saying host RAM, so that ``kiwid recover``
brings back whatever is there. The scheduler hears the same outcome the state
file records, so the two never disagree.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kiwid.core.events import Event, MemoryFreeSeen, SwapFinished, TenantFaulted
from kiwid.core.residency import Residency
from kiwid.daemon.engine.executor import Job, Kind
from kiwid.daemon.engine.tools import Tools, who
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.gating.swap import Placement, SwapError, Swapper

log = logging.getLogger("kiwid.engine")
R = Residency


def swap(tools: Tools, job: Job) -> list[Event]:
    """Carry out one swap; say how it went, after the cards' free memory now."""
    out = job.kind is Kind.SWAP_OUT
    record = tools.state.records.get(job.tenant)
    swapper = tools.swapper
    direction = "out" if out else "in"
    if swapper is None or record is None:
        why = "swapping is unavailable" if swapper is None else "it is not gated"
        log.warning("Swap %s of %s not done: %s", direction, who(job.info, job.tenant), why)
        finished: Event = SwapFinished(job.tenant, direction, ok=False, reason=why, epoch=job.epoch)
    elif out:
        finished = _out(tools, swapper, job, record)
    else:
        finished = _in(tools, swapper, job, record)
    return [*_readings(tools, job.gpus), finished]


def _readings(tools: Tools, gpus: frozenset[str]) -> list[Event]:
    """Fresh readings of the cards' free memory (a restore may wait for one)."""
    out: list[Event] = []
    for gpu in sorted(gpus):
        free = tools.guards.free_bytes(gpu)
        if free is not None:
            out.append(MemoryFreeSeen(gpu, free))
    return out


def _out(tools: Tools, swapper: Swapper, job: Job, record: GatedRecord) -> Event:
    name = who(job.info, job.tenant)
    guards = tools.guards
    if (never := guards.unswappable(record.pids)) is not None:
        log.warning("Swap out of %s not done: %s; its memory stays on the GPU", name, never)
        guards.checkpoint_failed(job.tenant, never, True)
        return SwapFinished(
            job.tenant, "out", ok=False, reason=never, unswappable=True, epoch=job.epoch
        )
    sizes = dict(job.sizes)

    def ahead(current: GatedRecord | None) -> GatedRecord | None:
        base = current or record  # (a follow may have named a process since)
        return replace(base, swapped=sizes, swap_method=swapper.method)

    # Write-ahead: recovery restores it if we die.
    swapped = tools.state.update(job.tenant, ahead) or tools.state.records[job.tenant]
    started = tools.clock()
    try:
        swapper.swap_out(swapped)
    except SwapError as err:
        placement = swapper.placement(swapped)
        if not placement.on_card_gated:
            return _faulted(job, "swap-out", err, placement)
        try:  # all of it is where it was
            tools.state.update(job.tenant, _back_on_card)
        except OSError as again:  # it overstates host RAM: a restore asks the driver
            log.warning("%s's record still counts memory in host RAM: %s", name, again)
        guards.checkpoint_failed(job.tenant, str(err), err.unsupported)
        log.error("Swap failed: out of %s: %s; it keeps its memory on the GPU", name, err)
        return SwapFinished(
            job.tenant,
            "out",
            ok=False,
            reason=str(err),
            unswappable=err.unsupported,
            epoch=job.epoch,
        )
    seconds = tools.clock() - started
    moved = sum(sizes.values())
    _log_moved("out", name, moved, seconds)
    return SwapFinished(
        job.tenant, "out", ok=True, moved_bytes=moved, seconds=seconds, epoch=job.epoch
    )


def _back_on_card(record: GatedRecord | None) -> GatedRecord | None:
    return None if record is None else replace(record, swapped=None, swap_method=None)


def _in(tools: Tools, swapper: Swapper, job: Job, record: GatedRecord) -> Event:
    name = who(job.info, job.tenant)
    coming = record.swapped or {}
    if short := _too_little_free(tools, coming):
        log.info("Swap in of %s waits: %s", name, short)
        return SwapFinished(
            job.tenant, "in", ok=False, reason=short, deferred=True, epoch=job.epoch
        )
    started = tools.clock()
    try:
        swapper.swap_in(record)
    except SwapError as err:
        placement = swapper.placement(record)
        if placement.where is R.HOST and err.transient and not placement.runs:
            log.error("Swap failed: in of %s: %s; it stays in host RAM, gated", name, err)
            return SwapFinished(job.tenant, "in", ok=False, reason=str(err), epoch=job.epoch)
        if not placement.on_card_gated:
            return _faulted(job, "swap-in", err, placement)
        log.warning("The restore of %s said %s, yet all of it is back: taken as done", name, err)
    tools.state.update(job.tenant, _back_on_card)
    seconds = tools.clock() - started
    moved = sum(coming.values())
    _log_moved("in", name, moved, seconds)
    return SwapFinished(
        job.tenant, "in", ok=True, moved_bytes=moved, seconds=seconds, epoch=job.epoch
    )


def _faulted(job: Job, operation: str, err: SwapError, placement: Placement) -> Event:
    """The driver is out of step with what was asked: the tenant is stuck.

    Its record keeps ``swapped`` (recovery restores what is in host RAM); the
    converge the core asks next contains it if a process of it runs.
    """
    detail = placement.detail
    reason = f"{operation.replace('-', ' ')}: {err}" + (f"; {detail}" if detail else "")
    log.error("%s is stuck: %s", who(job.info, job.tenant), reason)
    return TenantFaulted(
        job.tenant,
        operation,
        reason,
        placement.where,
        not placement.runs,
        pid=err.pid,
        answer=err.answer,
        epoch=job.epoch,
    )


def _log_moved(direction: str, name: str, moved: int, seconds: float) -> None:
    rate = moved / seconds / 1e9 if seconds > 0 else 0.0
    log.info("Swapped %s %s: %d bytes in %.2f s (%.2f GB/s)", direction, name, moved, seconds, rate)


def _too_little_free(tools: Tools, coming: dict[str, int]) -> str | None:
    """Why a restore of ``coming`` (bytes per GPU) must not start now (``None``: it may).

    A restore that runs out of device memory can leave a process stuck in host
    RAM for good, so the driver's free memory is read right before each one.
    """
    reserve = tools.guards.reserve_bytes()
    for gpu, nbytes in sorted(coming.items()):
        free = tools.guards.free_bytes(gpu)
        if free is not None and free < nbytes + reserve:
            gib = 2**30
            return (
                f"waiting for free memory on GPU {gpu}: the driver reports "
                f"{free / gib:.1f} GiB free, its restore needs {nbytes / gib:.1f} GiB plus "
                f"memory.reserve_mib ({reserve / gib:.1f} GiB)"
            )
    return None
