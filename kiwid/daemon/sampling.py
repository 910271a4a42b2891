"""One poll: every GPU's processes and activity, turned into scheduler events.

Reads the backend (NVML or the sim), maps PIDs to tenants (the tracker), keeps a
GPU that stopped answering out of the rotation until it answers again, reads the
host's available RAM for the swap floor, and hands the events to the engine.
A tenant whose memory is in host RAM is missing from the GPU's process list (as
NVML drops a checkpointed process, swapped or left so by a failing driver call):
the state file, which records every tenant before it is gated and before its
memory leaves, keeps it in the table while one of its processes lives.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kiwid.adapters import procs
from kiwid.adapters.gpu import GpuBackendError, GpuLost
from kiwid.core.events import (
    Event,
    GpusConfigured,
    HostMemorySeen,
    MemoryFreeSeen,
    TenantAttached,
    TenantDetached,
)
from kiwid.core.model import TenantState
from kiwid.daemon.context import Context
from kiwid.daemon.gating.gates import start_of
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.tenants.tracker import GpuSample, Hidden

log = logging.getLogger("kiwid")
_ARRIVALS = (TenantAttached, TenantDetached, GpusConfigured)


def hidden_tenants(records: Mapping[str, GatedRecord]) -> dict[str, Hidden]:
    """Every gated tenant the state file records, kept while alive though unlisted.

    Its memory may be in host RAM by a swap (the GPUs it is on recorded), or by a
    driver call that failed and left a process checkpointed (a lock, a state
    query): NVML lists neither, and neither tenant is gone. Alive means a
    recorded pid runs with its recorded start time: a pid reused since names
    another process, which is never taken for the tenant.
    """
    return {
        key: Hidden(frozenset(r.pids), frozenset(r.swapped or ()), r.pid_starts())
        for key, r in records.items()
    }


def follow_gated(ctx: Context) -> None:
    """Have every process of a tenant the CUDA lock gates looked at, each poll.

    The freezer holds a whole cgroup, new processes too; the lock holds only the
    processes it was taken on, and one with no CUDA context then (held at admission,
    before its first CUDA call) could not be locked. So each poll hands every
    process of a lock-gated tenant to the engine's follow, which locks those the
    driver says run (:mod:`kiwid.daemon.engine.side_jobs`).
    """
    if ctx.engine.effects.gate.method != "cuda-lock":
        return
    scheduler = ctx.engine.scheduler
    for key, info in ctx.engine.tracker.tenants.items():
        held = scheduler.gated(key) or scheduler.tenant_state(key) is TenantState.STUCK
        if info.pids and held:
            ctx.engine.follow(key, {pid: start_of(pid) for pid in sorted(info.pids)})


def wake_on_requests(ctx: Context) -> list[Event]:
    """Ask the core to wake each parked tenant that a client waits on (its sockets).

    The freezer holds a parked tenant's processes: a request then waits in its
    queues. The CUDA lock leaves them running: a request it read waits unanswered
    at its first CUDA call (:mod:`kiwid.daemon.tenants.waker`).
    """
    scheduler = ctx.engine.scheduler
    tenants = ctx.engine.tracker.tenants
    parked = {
        key: frozenset(info.pids)
        for key, info in tenants.items()
        if info.pids and scheduler.tenant_state(key) is TenantState.PARKED
    }
    freezes = ctx.engine.effects.gate.method == "freeze"
    records = ctx.state.records
    frozen = {k for k in parked if freezes or (k in records and records[k].fenced)}
    return list(ctx.waker.events(parked, frozen))


def poll(ctx: Context) -> list[Event]:
    """Sample every GPU; return the events that the differences amount to."""
    samples: list[GpuSample] = []
    lost: list[str] = []
    window = ctx.settings.gpu.poll_interval
    health_changed = False
    for device in ctx.devices:
        gid = str(device.index)
        try:
            processes = ctx.backend.processes(device.index)
            active = ctx.backend.active_pids(device.index, window)
        except GpuLost as err:
            lost.append(gid)
            if gid not in ctx.unhealthy:
                ctx.unhealthy.add(gid)
                health_changed = True
                log.error("GPU %s is lost (%s): its tenants are no longer gated", gid, err)
            continue
        except GpuBackendError as err:  # a passing fault: its tenants keep their state
            lost.append(gid)
            if ctx.read_failures.get(gid) != str(err):
                ctx.read_failures[gid] = str(err)
                log.warning("Cannot read GPU %s this time: %s; its tenants are kept", gid, err)
            continue
        if ctx.read_failures.pop(gid, None) is not None:
            log.info("GPU %s answers again", gid)
        if gid in ctx.unhealthy:
            ctx.unhealthy.discard(gid)
            health_changed = True
            log.info("GPU %s is back", gid)
        samples.append(GpuSample(gid, processes, active))
    hidden = hidden_tenants(ctx.state.records)
    events = ctx.engine.tracker.observe(samples, ctx.clock(), lost, hidden)
    follow_gated(ctx)
    if health_changed:
        events.insert(0, ctx.configured())
    # A new tenant's policy before its first footprint and activity: a tenant whose
    # memory may never move must not be swapped out in the very poll that found it.
    arrivals = [
        e for e in events if isinstance(e, TenantAttached | TenantDetached | GpusConfigured)
    ]
    rest = [
        e for e in events if not isinstance(e, TenantAttached | TenantDetached | GpusConfigured)
    ]
    tenants = ctx.engine.tracker.tenants
    # What a workload's earlier runs left (its footprint, a failed checkpoint) also
    # before its activity: a recurring job is sized before its first turn.
    remembered = ctx.workloads.events(tenants)
    ctx.workloads.observe(tenants)
    ctx.workloads.save_if_due()
    events = [*arrivals, *ctx.tenant_policies.events(tenants), *remembered, *rest]
    for line in ctx.tenant_policies.overruns(tenants):
        log.warning(line)
    events += wake_on_requests(ctx)
    if ctx.can_swap and ctx.settings.memory.swap != "none":
        events.append(HostMemorySeen(procs.available_host_memory()))
        for sample in samples:
            free = ctx.free_bytes(sample.gpu)
            if free is not None:
                events.append(MemoryFreeSeen(sample.gpu, free))
    return events
