"""Jobs that gate: gate, ungate, follow new processes, settle a late lock, fence, forget.

Each returns what the scheduler must hear: a gate that took is ``Gated``, an
ungate that took ``Ungated`` (the tenant runs from then on); a gate
or ungate that fails is tried again for ``gpu.driver_timeout`` and then makes the
tenant stuck (``TenantFaulted``), never a silent success. The state file is
written ahead of every change it records: before a tenant is gated, before a new
process of it is locked, before a fence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from kiwid.core.events import Event, Gated, TenantFaulted, Ungated
from kiwid.daemon.engine.executor import Job
from kiwid.daemon.engine.tools import Tools, not_given_up, who
from kiwid.daemon.gating.cudagate import CudaLockGate
from kiwid.daemon.gating.gates import GateError
from kiwid.daemon.gating.record import GatedRecord

log = logging.getLogger("kiwid.engine")


def gate(tools: Tools, job: Job) -> list[Event]:
    """Gate a tenant: record it, then freeze or lock it (tried again on failure)."""
    info = job.info
    if info is None:  # gone from the tracker already: nothing of it can run
        return [TenantFaulted(job.tenant, "gate", "unknown to the tenant table", contained=False)]

    def attempt() -> None:
        not_given_up(job, "gated")  # a retry after the deadline: hands off
        before = tools.state.records.get(job.tenant)  # a stuck tenant gated again
        record = tools.gate.prepare(info)
        if before is not None:
            record = before.regated(record)
        tools.state.put(record)  # write-ahead: recorded before it is frozen
        try:
            tools.gate.gate(record, job.given_up.is_set)
        except GateError:
            # Undo the write-ahead only if nothing holds the tenant now: a call
            # that failed half-way (a process locked, or left CHECKPOINTED and so
            # unlisted by NVML) must stay recorded, for its ungate and recovery,
            # and to keep the tenant known. Only if it is still ours: a fence
            # written while a call of this gate hung stays.
            if before is not None:
                tools.state.put(before, only=record)
            elif not tools.gate.holds(info):
                tools.state.drop(record.tenant, only=record)
            raise

    try:
        tools.retrying(attempt, f"the gate of {who(info, job.tenant)}", job.given_up)
    except GateError as err:
        log.error("Could not gate %s: %s", who(info, job.tenant), err)
        fault = TenantFaulted(job.tenant, "gate", str(err), pid=err.pid, answer=err.answer)
        return [tools.fence(info, fault, job.given_up)]
    log.debug("Gated %s", who(info, job.tenant))
    return [Gated(job.tenant)]


def ungate(tools: Tools, job: Job) -> list[Event]:
    """Let a recorded tenant go (tried again on failure; stuck, still gated, if it cannot)."""
    tenant = job.tenant
    record = tools.state.records.get(tenant)
    if record is None:
        return [Ungated(tenant)]  # nothing holds it: it runs
    if record.swapped:  # never: the scheduler lets go only what is on the card
        reason = "not let go: the state file says its memory is in host RAM"
        log.error("%s: %s", tenant, reason)
        return [TenantFaulted(tenant, "ungate", reason)]

    try:
        tools.retrying(lambda: tools.gate.ungate(record), f"the ungate of {tenant}", job.given_up)
    except GateError as err:
        log.error("Could not ungate %s: %s (kept in %s)", tenant, err, tools.state.path)
        fault = TenantFaulted(tenant, "ungate", str(err), pid=err.pid, answer=err.answer)
        if isinstance(tools.gate, CudaLockGate):
            # The lock lets go process by process: the ones that unlocked run now,
            # so the tenant is fenced with the freezer (or said to run).
            return [tools.fence(job.info, replace(fault, contained=False), job.given_up)]
        return [fault]  # a cgroup that did not thaw stays frozen as a whole
    try:
        if not tools.state.drop(tenant, only=record):
            # Changed while the call ran (it ran past its deadline and was fenced
            # meanwhile): what is recorded now is what holds the tenant.
            log.warning("Ungated %s late; its record since is kept", tenant)
            return []
    except OSError as err:  # it runs; its record only makes recovery try again, harmlessly
        log.warning("Ungated %s, but its record stays in %s: %s", tenant, tools.state.path, err)
    log.debug("Ungated %s", tenant)
    return [Ungated(tenant)]


Move = Callable[[Tools, Job, GatedRecord, tuple[int, ...]], list[Event]]
"""What moves the memory of processes just locked (the tenant's record, their pids)."""


def follow(tools: Tools, job: Job, move: Move | None = None) -> list[Event]:
    """Lock the processes a gated tenant started since (recorded ahead of the lock).

    With the job's sizes (its memory is in host RAM), ``move`` takes theirs there
    once they are locked (the dispatch wires the swap job's).
    """
    gate_ = tools.gate
    record = tools.state.records.get(job.tenant)
    known = record.pids if record else ()
    new = {pid: start for pid, start in job.pids.items() if pid not in known}
    if record is None or not new or not isinstance(gate_, CudaLockGate):
        return []
    grown = record.with_pids(new)
    try:
        tools.state.put(grown)
        gate_.follow(grown, tuple(sorted(new)), job.given_up.is_set)
    except (GateError, OSError) as err:
        pid = err.pid if isinstance(err, GateError) else None
        answer = err.answer if isinstance(err, GateError) else None
        reason = f"its new process could not be locked: {err}"
        log.error("%s: %s", who(job.info, job.tenant), reason)
        fault = TenantFaulted(job.tenant, "gate", reason, pid=pid, answer=answer, answers=False)
        return [tools.fence(job.info, fault, job.given_up)]
    log.info("Locked %s's new process %s", who(job.info, job.tenant), ", ".join(map(str, new)))
    if move is not None and job.sizes and not job.given_up.is_set():
        return move(tools, job, grown, tuple(sorted(new)))
    return []


def settle(tools: Tools, job: Job) -> list[Event]:
    """A gate (or follow, or retry) returned after kiwid gave up on it: settle what it did.

    Its call was in flight when kiwid gave up, and may have taken since, on a
    tenant that kiwid fenced, released or let go meanwhile. Where kiwid holds the
    tenant gated as the settle starts (``job.hold``), or a record holds it, the
    gate stays and the record names it (its ungate and ``kiwid recover`` undo it);
    where kiwid lets it run, the gate is undone, recorded ahead like any gate so
    that nothing stays gated unrecorded. A gate that will not undo makes the
    tenant stuck, fenced.
    """
    gate_, info, tenant = tools.gate, job.info, job.tenant
    if info is None:
        return []
    if isinstance(gate_, CudaLockGate):  # one state call per process, not two
        held = gate_.held(info.pids)
    else:
        held = sorted(info.pids) if gate_.holds(info) else []
    if not held:
        return []  # the late call holds nothing
    try:
        fresh = gate_.prepare(info)
    except GateError as err:  # its cgroup is gone: so is what could hold it
        log.warning("%s: nothing to settle: %s", who(info, tenant), err)
        return []
    starts = {p: s or 0 for p, s in fresh.pid_starts().items() if p in held}
    pids = ", ".join(map(str, held))

    def recorded_ahead(record: GatedRecord | None) -> GatedRecord | None:
        return fresh if record is None else None

    def naming(record: GatedRecord | None) -> GatedRecord | None:
        if record is None:
            return fresh
        missing = {p: s for p, s in starts.items() if p not in record.pids}
        return record.with_pids(missing) if missing else None

    if job.hold.is_set() or not tools.state.update(tenant, recorded_ahead):
        if tools.state.update(tenant, naming):
            log.warning("%s: recorded pid %s, gated late", who(info, tenant), pids)
        return []
    log.warning("%s runs, yet pid %s is gated by a late call: undoing it", who(info, tenant), pids)
    try:
        tools.retrying(lambda: gate_.ungate(fresh), f"the ungate of {tenant}", job.given_up)
    except GateError as err:
        reason = f"what a gate did after kiwid gave up on it could not be undone: {err}"
        log.error("%s: %s", who(info, tenant), reason)
        fault = TenantFaulted(
            tenant, "ungate", reason, contained=False, pid=err.pid, answer=err.answer
        )
        return [tools.fence(info, fault, job.given_up)]
    if not job.given_up.is_set():  # late: what is recorded since stays
        tools.state.drop(tenant, only=fresh)
    return []


def fence(tools: Tools, job: Job) -> list[Event]:
    """Fence a tenant whose gate or lock never answered: the fault, told as it now stands.

    Only if kiwid still holds the tenant as the fence starts (``job.hold``): an
    operator's release that ran before it lets the tenant run, for good.
    """
    if not job.hold.is_set():
        log.info("Not fencing %s: kiwid let it go since", who(job.info, job.tenant))
        return []
    # Its telling answers nothing: the late job's own fault did (a gate asked, an
    # operator's release); what the fence makes of it counts as it comes.
    told = replace(job.fault, answers=False) if job.fault else None
    fault = told or TenantFaulted(job.tenant, "gate", "its lock cannot be trusted", answers=False)
    return [tools.fence(job.info, fault, job.given_up)]


def forget(tools: Tools, job: Job) -> list[Event]:
    """A tenant left: undo what may remain of its gate (its cgroup may be gone)."""
    tenant = job.tenant
    record = tools.state.records.get(tenant)
    if record is not None:
        if record.swapped:  # its processes are gone, and its host memory with them
            tools.state.drop(tenant)
        else:
            try:
                tools.gate.ungate(record)
                tools.state.drop(tenant)
            except GateError as err:
                log.error("Could not ungate %s as it left: %s", tenant, err)
    tools.gate.forget(tenant)
    return []
