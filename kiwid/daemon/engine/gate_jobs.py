"""Jobs that gate: gate, ungate, forget.

Each returns what the scheduler must hear, echoing the job's epoch: a gate that
took is ``Gated``, an ungate that took ``Ungated`` (the tenant runs from then
on); a gate or ungate that fails is tried again for ``gpu.driver_timeout`` and
then makes the tenant stuck (``TenantFaulted``), never a silent success: the
core then asks for a converge, which contains it. The state file is written
ahead of every change it records, and a record is dropped only at the version
the job read: what another wrote since (a fence beside a hung call) stays.
"""

from __future__ import annotations

import logging

from kiwid.core.events import Event, Gated, TenantFaulted, Ungated
from kiwid.daemon.engine.executor import Job
from kiwid.daemon.engine.side_jobs import freeze
from kiwid.daemon.engine.tools import Tools, who
from kiwid.daemon.gating.cudagate import CudaLockGate
from kiwid.daemon.gating.gates import GateError
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.tenants.tracker import TenantInfo

log = logging.getLogger("kiwid.engine")


def gate(tools: Tools, job: Job) -> list[Event]:
    """Gate a tenant: record it, then freeze or lock it (tried again on failure).

    The record names only what the gate holds: a process with no CUDA context yet
    is not locked, and stays to lock (each poll's follow looks at every process of
    a gated tenant that runs).
    """
    info, tenant = job.info, job.tenant
    if info is None:  # gone from the tracker already: nothing of it can run
        reason = "unknown to the tenant table"
        return [TenantFaulted(tenant, "gate", reason, contained=False, epoch=job.epoch)]

    def attempt() -> None:
        fresh = tools.gate.prepare(info)

        def ahead(record: GatedRecord | None) -> GatedRecord:
            return fresh if record is None else record.regated(fresh)

        before = tools.state.records.get(tenant)
        written = tools.state.update(tenant, ahead) or tools.state.records[tenant]
        try:
            held = tools.gate.gate(written)
        except GateError:
            # Undo the write-ahead only if nothing holds the tenant now: a call that
            # failed half-way (a process left CHECKPOINTED, unlisted by NVML) must
            # stay recorded, for its ungate and recovery.
            if before is not None:
                tools.state.put(before, expect=written.version)
            elif not tools.gate.holds(info):
                tools.state.drop(tenant, expect=written.version)
            raise
        if held is not None:
            tools.state.update(tenant, lambda r: _naming(r, written, held))
            if not held:
                _hold_before_its_first_call(tools, info)

    try:
        tools.retrying(attempt, f"the gate of {who(info, tenant)}")
    except GateError as err:
        log.error("Could not gate %s: %s", who(info, tenant), err)
        fault = TenantFaulted(
            tenant,
            "gate",
            str(err),
            contained=False,
            pid=err.pid,
            answer=err.answer,
            epoch=job.epoch,
        )
        return [fault]
    log.debug("Gated %s", who(info, tenant))
    return [Gated(tenant, epoch=job.epoch)]


def _hold_before_its_first_call(tools: Tools, info: TenantInfo) -> None:
    """No process of it has a CUDA context yet: the freezer holds it until its turn.

    A container held at admission, before its first CUDA call: the lock has nothing
    to hold (``NOT_INITIALIZED``), and the process would create its context and run
    beside the holder until the next poll's follow locked it. Frozen, it starts
    nothing: as admission promises, it waits from its first instruction. Once it
    has been let go and used the GPU, the lock holds it (its CPU side runs on).
    """
    frozen, why = freeze(tools, info, info.key)
    if frozen:
        log.info("Froze %s until its turn: no CUDA context of it to lock yet", who(info, info.key))
    else:  # nothing of it runs on the GPU yet; the follow locks its first context
        log.info("%s has no CUDA context to lock yet, and cannot be frozen: %s", info.key, why)


def _naming(
    record: GatedRecord | None, written: GatedRecord, held: frozenset[int]
) -> GatedRecord | None:
    """The record naming only what the gate holds (and what a follow added since)."""
    if record is None:
        return None
    kept = tuple(p for p in record.pids if p in held or p not in written.pids)
    return record.only(kept)


def ungate(tools: Tools, job: Job) -> list[Event]:
    """Let a recorded tenant go (tried again on failure; stuck if it cannot)."""
    tenant = job.tenant
    record = tools.state.records.get(tenant)
    if record is None:
        return [Ungated(tenant, epoch=job.epoch)]  # nothing holds it: it runs
    if record.swapped:  # never: the scheduler lets go only what is on the card
        reason = "not let go: the state file says its memory is in host RAM"
        log.error("%s: %s", tenant, reason)
        return [TenantFaulted(tenant, "ungate", reason, epoch=job.epoch)]
    try:
        tools.retrying(
            lambda: tools.gate.ungate(record, tools.state.unchanged), f"the ungate of {tenant}"
        )
    except GateError as err:
        log.error("Could not ungate %s: %s (kept in %s)", tenant, err, tools.state.path)
        # The lock lets go process by process: the ones that unlocked may run now. A
        # cgroup that did not thaw stays frozen as a whole.
        contained = not isinstance(tools.gate, CudaLockGate)
        fault = TenantFaulted(
            tenant,
            "ungate",
            str(err),
            contained=contained,
            pid=err.pid,
            answer=err.answer,
            epoch=job.epoch,
        )
        return [fault]
    try:
        if not tools.state.drop(tenant, expect=record.version):
            log.warning("Ungated %s; its record, written since, is kept", tenant)
    except OSError as err:  # it runs; its record only makes recovery try again, harmlessly
        log.warning("Ungated %s, but its record stays in %s: %s", tenant, tools.state.path, err)
    log.debug("Ungated %s", tenant)
    return [Ungated(tenant, epoch=job.epoch)]


def forget(tools: Tools, job: Job) -> list[Event]:
    """A tenant left: undo what may remain of its gate (its cgroup may be gone)."""
    tenant = job.tenant
    record = tools.state.records.get(tenant)
    if record is not None:
        if record.swapped:  # its processes are gone, and its host memory with them
            tools.state.drop(tenant, expect=record.version)
        else:
            try:
                tools.gate.ungate(record)
                tools.state.drop(tenant, expect=record.version)
            except GateError as err:
                log.error("Could not ungate %s as it left: %s", tenant, err)
    tools.gate.forget(tenant)
    return []
