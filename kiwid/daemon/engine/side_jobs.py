"""The jobs that run beside a tenant's lane: the follow and the fence.

**The follow.** The cgroup freezer holds a whole cgroup, processes started later
too; the CUDA lock holds only the processes it was taken on, and a process that
had no CUDA context when its tenant was gated (a container held at admission,
before its first CUDA call) is not locked: it answers ``NOT_INITIALIZED``. So
each poll runs a follow for every lock-gated tenant, which asks the driver the
state of each of its processes and locks those that run, recorded ahead of the
lock. It runs beside the tenant's lane, not behind it: a new process must not run
beside the holder for the 30 seconds of its tenant's checkpoint, and locking one
process does not touch the checkpoint of another. (Fencing the whole tenant with
the freezer while it waits would stall that very checkpoint: the driver
checkpoints only a process that is not frozen.) Nor does it wait behind a lane
job's call in the driver: the driver serialises the calls on one process (a state
asked during a checkpoint of that process waits for it, on an H200), so the
follow skips a process that a call of kiwid's is on now (``wait=False``); that
call decides where the process ends up, and the next poll looks again. A follow
never runs beside, nor after, a job that may let the tenant go (:mod:`.executor`,
rule 2). Where the tenant's memory is in host RAM, processes of it on the card
(locked now) hold room that the others count on: the follow says so
(``MemorySplit``), and the core asks a converge to move them there too.

**The fence.** A driver call that hangs may leave the tenant running (a lock that
never took, an unlock half-way). The fence freezes its cgroup: the freezer never
calls the driver, so it is the one thing that may run beside the hung call. It is
recorded ahead of the freeze, so that every way out thaws it.
"""

from __future__ import annotations

import logging

from kiwid.adapters.cudalock import ProcessState
from kiwid.core.events import Converged, Event, MemorySplit, TenantFaulted
from kiwid.core.residency import Residency
from kiwid.daemon.engine.executor import Job
from kiwid.daemon.engine.tools import Tools, who
from kiwid.daemon.gating.cudagate import CudaLockGate
from kiwid.daemon.gating.gates import GateError
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.tenants.tracker import TenantInfo

log = logging.getLogger("kiwid.engine")


def follow(tools: Tools, job: Job) -> list[Event]:
    """Lock the processes of a gated tenant that run; say those on the card if it is in host RAM."""
    gate, tenant, want = tools.gate, job.tenant, job.want
    if not isinstance(gate, CudaLockGate) or want is None:
        return []
    if tenant not in tools.state.records:
        return []  # its gate has not recorded it yet: the gate locks them all
    locked: list[int] = []
    on_card: list[int] = []
    try:
        for pid, start in sorted(job.pids.items()):
            state = gate.state_of(pid, wait=False)  # never behind a lane job's call
            if state is ProcessState.LOCKED:
                on_card.append(pid)
            if state is not ProcessState.RUNNING:
                continue  # no context yet (it stays to lock), locked, in host RAM, or busy
            if not _named(tools, tenant, pid, start):
                return []  # its record went meanwhile: kiwid let it go
            if gate.lock_one(pid, wait=False):
                locked.append(pid)
    except (GateError, OSError) as err:
        reason = f"its process could not be locked: {err}"
        log.error("%s: %s", who(job.info, tenant), reason)
        which = err.pid if isinstance(err, GateError) else None
        answer = err.answer if isinstance(err, GateError) else None
        return [
            TenantFaulted(
                tenant, "gate", reason, contained=False, pid=which, answer=answer, epoch=job.epoch
            )
        ]
    if locked:
        log.info("Locked %s's process %s", who(job.info, tenant), ", ".join(map(str, locked)))
    stray = tuple(sorted({*locked, *on_card}))
    if want.memory is Residency.HOST and stray:
        return [MemorySplit(tenant, stray, epoch=job.epoch)]
    return []


def _named(tools: Tools, tenant: str, pid: int, start: int) -> bool:
    """Record ``pid`` in ``tenant``'s record ahead of its lock; whether the record stands."""

    def adding(record: GatedRecord | None) -> GatedRecord | None:
        if record is None or pid in record.pids:
            return None
        return record.with_pids({pid: start})

    tools.state.update(tenant, adding)
    return tenant in tools.state.records


def fence(tools: Tools, job: Job) -> list[Event]:
    """Freeze a tenant whose driver call hangs; say whether it is held (``Converged``)."""
    frozen, why = freeze(tools, job.info, job.tenant)
    if frozen:
        log.warning("Fenced %s with the cgroup freezer: a call of it hangs", job.tenant)
    else:
        log.error("Cannot fence %s with the freezer: %s; it may run", job.tenant, why)
    note = "fenced with the cgroup freezer" if frozen else f"it may run: {why}"
    return [Converged(job.tenant, not frozen, None, note=note, epoch=job.epoch)]


def _gone(tenant: str) -> GatedRecord:
    raise GateError(f"{tenant}: its record could not be written")


def freeze(tools: Tools, info: TenantInfo | None, tenant: str) -> tuple[bool, str]:
    """Freeze ``tenant``'s cgroup, recorded ahead (the fence); whether it froze, and why not.

    Under the CUDA lock the record says ``fenced`` (every way out thaws it); under the
    freezer gate the freeze is the gate itself.
    """
    gate = tools.gate
    if info is None:
        return False, "unknown to the tenant table"
    try:
        # Written again even if the record says so already: its version tells a job
        # that read it before (an unlock returning late) not to thaw this freeze.
        if isinstance(gate, CudaLockGate):

            def fenced(record: GatedRecord | None) -> GatedRecord:
                return gate.fence(info, record or gate.prepare(info))

            gate.freeze_fence(tools.state.update(tenant, fenced, bump=True) or _gone(tenant))
        else:  # the freezer is the gate itself

            def own(record: GatedRecord | None) -> GatedRecord:
                return record or gate.prepare(info)

            gate.gate(tools.state.update(tenant, own, bump=True) or _gone(tenant))
    except (GateError, OSError) as err:
        return False, f"the fence failed: {err}"
    return True, ""
