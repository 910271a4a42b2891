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
from kiwid.daemon.gating.gates import GateError
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
        finished: Event = SwapFinished(job.tenant, direction, ok=False, reason=why)
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
        return SwapFinished(job.tenant, "out", ok=False, reason=never, unswappable=True)
    sizes = dict(job.sizes)
    swapped = replace(record, swapped=sizes, swap_method=swapper.method)
    tools.state.put(swapped)  # write-ahead: recovery restores it if we die
    started = tools.clock()
    if failed := _checkpoint(tools, swapper, swapped, ahead=swapped, before=record):
        err, placement = failed
        if placement.on_card_gated:
            log.error("Swap failed: out of %s: %s; it keeps its memory on the GPU", name, err)
            return SwapFinished(
                job.tenant, "out", ok=False, reason=str(err), unswappable=err.unsupported
            )
        return _faulted(tools, job, "swap-out", err, placement)
    if job.given_up.is_set() and tools.state.records.get(job.tenant) != swapped:
        return _undo_late_out(tools, swapper, job, swapped)
    seconds = tools.clock() - started
    moved = sum(sizes.values())
    _log_moved("out", name, moved, seconds)
    return SwapFinished(job.tenant, "out", ok=True, moved_bytes=moved, seconds=seconds)


def follow_out(tools: Tools, job: Job, record: GatedRecord, new: tuple[int, ...]) -> list[Event]:
    """Move the memory of a swapped-out tenant's new processes (locked) to host RAM too.

    Left on the card, a new process holds room that the holder counts on, beside
    a tenant the scheduler has in host RAM. The state file counts its bytes with
    the rest ahead of the checkpoint. A checkpoint that fails with its memory where
    it was leaves it there, locked: the tenant's restore later brings back the
    rest (a plain failure, as a swap-out's). Memory anywhere else: stuck.
    """
    swapper = tools.swapper
    name = who(job.info, job.tenant)
    listed = ", ".join(map(str, new))
    if swapper is None:
        return []
    if (never := tools.guards.unswappable(new)) is not None:
        log.warning("%s's new process %s keeps its memory on the GPU: %s", name, listed, never)
        return []
    before = record.swapped or {}
    sizes = {g: before.get(g, 0) + job.sizes.get(g, 0) for g in sorted({*before, *job.sizes})}
    ahead = replace(record, swapped=sizes, swap_method=swapper.method)
    try:
        if not tools.state.put(ahead, only=record):
            return []  # kiwid (an operator, a fence) dealt with it meanwhile
    except OSError as unwritten:  # unrecorded, a checkpoint could strand it: none
        log.error("%s's new process %s stays on the GPU, locked: %s", name, listed, unwritten)
        return []
    started = tools.clock()
    if failed := _checkpoint(tools, swapper, record.only(new), ahead=ahead, before=record):
        err, theirs = failed
        if theirs.on_card_gated:
            log.error("%s's new process %s stays on the GPU, locked: %s", name, listed, err)
            return []
        fault = _faulted(tools, job, "swap-out", err, swapper.placement(ahead), answers=False)
        return [fault]
    seconds = tools.clock() - started
    _log_moved("out", f"{name}'s new process {listed}", sum(job.sizes.values()), seconds)
    return []


def _checkpoint(
    tools: Tools,
    swapper: Swapper,
    moving: GatedRecord,
    *,
    ahead: GatedRecord,
    before: GatedRecord,
) -> tuple[SwapError, Placement] | None:
    """Checkpoint ``moving``'s processes; ``None`` when done, else why and where it is.

    A failure that left all of ``moving`` on the card, gated, is a plain one: the
    write-ahead ``ahead`` gives way to ``before`` again, and the guards hear of it.
    """
    tenant = moving.tenant
    try:
        swapper.swap_out(moving)
    except SwapError as err:
        placement = swapper.placement(moving)
        if placement.on_card_gated:
            try:
                tools.state.put(before, only=ahead)  # all of it is where it was
            except OSError as again:  # it overstates host RAM: a restore asks the driver
                log.warning("%s's record still counts memory on the GPU: %s", tenant, again)
            tools.guards.checkpoint_failed(tenant, str(err), err.unsupported)
        return err, placement
    return None


def _undo_late_out(tools: Tools, swapper: Swapper, job: Job, swapped: GatedRecord) -> Event:
    """Bring back the memory a checkpoint moved out after its deadline.

    It moved it behind the back of whoever dealt with the tenant since (an
    operator's release dropped its record and let it run): the memory comes back,
    and a tenant let go runs again. Unseen, it would run with its memory in host
    RAM, unlisted by the GPU and with no record: dropped as gone, and stranded.
    """
    name = who(job.info, job.tenant)
    let_go = tools.state.records.get(job.tenant) is None
    try:
        swapper.swap_in(swapped)
    except SwapError as err:
        tools.state.put(swapped)  # where its memory is: kept, and restored by recovery
        reason = f"its checkpoint returned late and moved its memory to host RAM: {err}"
        log.error("%s: %s", name, reason)
        return TenantFaulted(job.tenant, "swap-out", reason, R.HOST, pid=err.pid)
    if let_go:
        try:
            tools.gate.ungate(swapped)  # restored gated (locked): as it was, it runs
        except GateError as err:
            tools.state.put(replace(swapped, swapped=None, swap_method=None))
            log.error("%s: restored after a late checkpoint, but not let go: %s", name, err)
            return TenantFaulted(job.tenant, "swap-out", str(err), R.RESIDENT, pid=err.pid)
    log.warning("%s: its checkpoint returned late; its memory is back on the card", name)
    return SwapFinished(job.tenant, "out", ok=False, reason="returned late: undone")


def _in(tools: Tools, swapper: Swapper, job: Job, record: GatedRecord) -> Event:
    name = who(job.info, job.tenant)
    coming = record.swapped or {}
    if short := _too_little_free(tools, coming):
        log.info("Swap in of %s waits: %s", name, short)
        return SwapFinished(job.tenant, "in", ok=False, reason=short, deferred=True)
    started = tools.clock()
    try:
        swapper.swap_in(record)
    except SwapError as err:
        placement = swapper.placement(record)
        if placement.where is R.HOST and err.transient and not placement.runs:
            log.error("Swap failed: in of %s: %s; it stays in host RAM, gated", name, err)
            return SwapFinished(job.tenant, "in", ok=False, reason=str(err))
        if not placement.on_card_gated:
            return _faulted(tools, job, "swap-in", err, placement)
        log.warning("The restore of %s said %s, yet all of it is back: taken as done", name, err)
    tools.state.put(replace(record, swapped=None, swap_method=None), only=record)
    seconds = tools.clock() - started
    moved = sum(coming.values())
    _log_moved("in", name, moved, seconds)
    return SwapFinished(job.tenant, "in", ok=True, moved_bytes=moved, seconds=seconds)


def _faulted(
    tools: Tools,
    job: Job,
    operation: str,
    err: SwapError,
    placement: Placement,
    *,
    answers: bool = True,
) -> Event:
    """The driver is out of step with what was asked: the tenant is stuck.

    Its record keeps ``swapped`` (recovery restores what is in host RAM).
    ``answers``: whether the fault answers a swap the scheduler asked for (a
    follow's does not).
    """
    detail = placement.detail
    reason = f"{operation.replace('-', ' ')}: {err}" + (f"; {detail}" if detail else "")
    log.error("%s is stuck: %s", who(job.info, job.tenant), reason)
    fault = TenantFaulted(
        job.tenant,
        operation,
        reason,
        placement.where,
        not placement.runs,
        pid=err.pid,
        answer=err.answer,
        answers=answers,
    )
    if placement.runs:
        return tools.fence(job.info, fault, job.given_up)
    return fault


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
