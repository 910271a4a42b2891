"""The converge: read the truth of a tenant, drive it to what the core wants now.

Level-triggered, as a Kubernetes controller's reconcile: it does not replay what
was asked before, it reads what is (each process's driver state, the freezer,
the state file's record) and what the core wants as the job starts (a
:class:`~kiwid.core.actions.Want`), and closes the gap:

* **gated** — every process that runs is locked, recorded ahead of the lock
  (under the freezer gate: its cgroup frozen); one that will not lock is fenced
  with the freezer. Where its memory belongs in host RAM, processes of it on the
  card (a process started since its swap-out) are checkpointed too; where it
  belongs on the card, a part left in host RAM comes back. Its memory is never
  moved whole: that is the scheduler's to ask (a swap), and the converge only says
  where it found it.
* **running** — what is in host RAM comes back (when the card has room), every
  lock is undone and every freeze thawed, and its record dropped: as ``kiwid
  recover`` lets a tenant go (:func:`kiwid.daemon.gating.recovery.release`).

It writes the record as it found it (where the memory is, its fault), at the
version it read, and answers ``Converged`` with what it found; a want it could
not reach comes as a ``TenantFaulted``. The core asks for it after every fault,
after a result of an old epoch, and when a follow finds a tenant in host RAM
with processes on the card.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from kiwid.adapters.cudalock import ProcessState
from kiwid.core.actions import Want
from kiwid.core.events import Converged, Event, TenantFaulted
from kiwid.core.residency import Residency
from kiwid.daemon.engine.executor import Job
from kiwid.daemon.engine.side_jobs import freeze
from kiwid.daemon.engine.tools import Tools, who
from kiwid.daemon.gating import recovery
from kiwid.daemon.gating.cudagate import CudaLockGate
from kiwid.daemon.gating.gates import GateError, start_of
from kiwid.daemon.gating.record import GatedRecord, RecordedFault
from kiwid.daemon.gating.swap import Placement, SwapError
from kiwid.daemon.tenants.tracker import TenantInfo

log = logging.getLogger("kiwid.engine")
R = Residency


def converge(tools: Tools, job: Job) -> list[Event]:
    """Drive the tenant to ``job.want``; say what it found (or why it could not)."""
    want = job.want
    if want is None:
        return []  # it left: a forget deals with what remains
    try:
        if want.gated:
            return _hold(tools, job, want)
        return _free(tools, job, want)
    except (GateError, SwapError, OSError) as err:
        record = tools.state.records.get(job.tenant)
        after = tools.placement(record) if record is not None else Placement(R.RESIDENT, True)
        reason = f"the converge failed: {err}" + (f"; {after.detail}" if after.detail else "")
        log.error("%s: %s", who(job.info, job.tenant), reason)
        return [_fault(job, want, reason, after)]


def _hold(tools: Tools, job: Job, want: Want) -> list[Event]:
    """Every process held; its memory whole where the core has it; the record as found."""
    tenant, info = job.tenant, job.info
    notes: list[str] = []
    runs = _gate_what_runs(tools, job, notes)
    record = tools.state.records.get(tenant)
    if record is None:  # nothing of it was ever gated (no record ahead, nothing locked)
        return [Converged(tenant, runs, R.RESIDENT, note="; ".join(notes), epoch=want.epoch)]
    placement = tools.placement(record)
    swapper = tools.swapper
    if swapper is not None and placement.where is R.UNKNOWN and not placement.runs:
        if want.memory is R.HOST and placement.on_card:  # a process started since its swap-out
            record = _record_out(tools, record, placement.on_card, want)
            swapper.swap_out(record.only(placement.on_card))
            notes.append(f"moved pid {_pids(placement.on_card)} to host RAM with the rest")
        elif want.memory is R.RESIDENT and placement.in_host:
            swapper.swap_in(record)
            notes.append(f"brought pid {_pids(placement.in_host)} back to the card")
        placement = tools.placement(record)
    record = _record_as_found(tools, record, placement, want)
    # Unlocked by the driver's word, yet frozen by the fence: it does not run.
    runs = runs or (placement.runs and not record.fenced)
    note = "; ".join(notes)
    if note:
        log.warning("Converged %s: %s", who(info, tenant), note)
    stuck = want.fault is not None
    if not stuck and runs:
        reason = f"a process of it runs though it is gated{': ' + note if note else ''}"
        return [_fault(job, want, reason, placement._replace(runs=True))]
    if not stuck and placement.where is R.UNKNOWN:
        return [_fault(job, want, f"its memory is split: {placement.detail}", placement)]
    host = dict(record.swapped) if record.swapped else None
    return [Converged(tenant, runs, placement.where, host, note=note, epoch=want.epoch)]


def _gate_what_runs(tools: Tools, job: Job, notes: list[str]) -> bool:
    """Lock (or freeze) every process of the tenant that runs; whether one still runs."""
    gate, tenant, info = tools.gate, job.tenant, job.info
    if info is None:
        return False
    if not isinstance(gate, CudaLockGate):  # the freezer: the cgroup, new processes too
        if gate.holds(info):
            return False
        frozen, why = freeze(tools, info, tenant)
        notes.append("froze its cgroup" if frozen else f"could not freeze it: {why}")
        return not frozen
    record = tools.state.records.get(tenant)
    pids = {**(record.pid_starts() if record else {}), **dict.fromkeys(info.pids)}
    failed: list[str] = []
    for pid in sorted(pids):
        try:
            if gate.state_of(pid) is not ProcessState.RUNNING:
                continue
            start = pids[pid] or _start(record, pid)

            def adding(r: GatedRecord | None, p: int = pid, s: int = start) -> GatedRecord | None:
                return _adding(r, gate, info, p, s)

            tools.state.update(tenant, adding)
            if gate.lock_one(pid):
                notes.append(f"locked pid {pid}")
        except GateError as err:
            failed.append(str(err))
    if not failed:
        return False
    frozen, why = freeze(tools, info, tenant)
    notes.append(f"{'; '.join(failed)}: " + ("fenced" if frozen else f"not fenced: {why}"))
    return not frozen


def _adding(
    record: GatedRecord | None, gate: CudaLockGate, info: TenantInfo, pid: int, start: int
) -> GatedRecord | None:
    """The record with ``pid`` (a new one naming it alone), written ahead of its lock."""
    if record is not None and pid in record.pids:
        return None
    if record is None:
        return gate.prepare(info).only(()).with_pids({pid: start})
    return record.with_pids({pid: start})


def _start(record: GatedRecord | None, pid: int) -> int:
    return (record.pid_starts().get(pid) if record else None) or start_of(pid)


def _record_out(
    tools: Tools, record: GatedRecord, pids: tuple[int, ...], want: Want
) -> GatedRecord:
    """The record with the bytes of ``pids`` counted in host RAM, written ahead of their move."""
    moving: dict[str, int] = {}
    for pid in pids:
        seen = tools.guards.pid_bytes(pid)
        for gpu, nbytes in (seen or dict(want.host_bytes)).items():
            moving[gpu] = moving.get(gpu, 0) + nbytes
    before = record.swapped or {}
    sizes = {g: before.get(g, 0) + moving.get(g, 0) for g in sorted({*before, *moving})}
    method = tools.swapper.method if tools.swapper is not None else None
    written = tools.state.put(replace(record, swapped=sizes, swap_method=method))
    assert written is not None
    return written


def _record_as_found(
    tools: Tools, record: GatedRecord, placement: Placement, want: Want
) -> GatedRecord:
    """Write where the memory was found, and the core's fault, into the record."""
    swapped = record.swapped
    if placement.where is R.RESIDENT:
        swapped = None
    elif placement.where is R.HOST and not swapped:
        swapped = dict(want.host_bytes)  # moved by a call kiwid no longer waited for
    fault = None
    if want.fault is not None:
        ago = tools.clock() - want.fault.at
        cause = want.fault
        fault = RecordedFault(
            cause.operation, cause.reason, time.time() - ago, cause.pid, cause.answer
        )
    method = record.swap_method if swapped else None
    if swapped and method is None and tools.swapper is not None:
        method = tools.swapper.method
    changed = replace(record, swapped=swapped, swap_method=method, fault=fault)
    if changed == record:
        return record
    return tools.state.put(changed, expect=record.version) or tools.state.records.get(
        record.tenant, record
    )


def _free(tools: Tools, job: Job, want: Want) -> list[Event]:
    """Restore, unlock and thaw what holds the tenant, and drop its record."""
    tenant = job.tenant
    record = tools.state.records.get(tenant)
    if record is None:  # nothing recorded holds it (what kiwid holds is recorded ahead)
        return [Converged(tenant, True, R.RESIDENT, epoch=want.epoch)]
    placement = tools.placement(record)
    if placement.in_host and (short := _short(tools, record)):
        reason = f"its memory is in host RAM and cannot come back now: {short}"
        return [_fault(job, want, reason, placement)]
    undo = recovery.undo_with(tools.state.dir, tools.gate, tools.swapper, tools.state.unchanged)(
        record
    )
    why = recovery.release(record, undo, " (converged)", f"kiwictl release {tenant}")
    if why is not None:
        after = tools.placement(record)
        return [_fault(job, want, f"it could not be let go: {why}", after)]
    tools.state.drop(tenant, expect=record.version)
    note = "let go: restored, unlocked and thawed what held it"
    log.warning("Converged %s: %s", who(job.info, tenant), note)
    return [Converged(tenant, True, R.RESIDENT, note=note, epoch=want.epoch)]


def _short(tools: Tools, record: GatedRecord) -> str | None:
    """Why the card cannot take the record's memory back now (``None``: it can)."""
    reserve = tools.guards.reserve_bytes()
    for gpu, nbytes in sorted((record.swapped or {}).items()):
        free = tools.guards.free_bytes(gpu)
        if free is not None and free < nbytes + reserve:
            return f"GPU {gpu} has {free} bytes free, its restore needs {nbytes} plus the reserve"
    return None


def _fault(job: Job, want: Want, reason: str, placement: Placement) -> TenantFaulted:
    operation = "gate" if want.gated else "ungate"
    return TenantFaulted(
        job.tenant,
        operation,
        reason,
        placement.where,
        not placement.runs,
        epoch=want.epoch,
    )


def _pids(pids: tuple[int, ...]) -> str:
    return ", ".join(map(str, pids))
