"""The status object that ``kiwictl status --json`` prints (protocol v1).

Its shape is documented in docs/control-protocol.md and is stable for scripts:
fields may be added, never renamed or removed within protocol version 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kiwid import __version__
from kiwid.adapters.gpu import DeviceInfo
from kiwid.core.ledger import LedgerView
from kiwid.core.model import GpuPolicy, TenantState
from kiwid.core.view import GpuView, SchedulerView
from kiwid.daemon.engine import Departed, Histogram, SwapProgress
from kiwid.daemon.tenants import TenantInfo


def ledger_json(ledger: LedgerView | None) -> dict[str, Any] | None:
    """A tenant's ledger as the status object shows it."""
    if ledger is None:
        return None
    return {
        "holding_s": round(ledger.holding_s, 3),
        "waiting_s": round(ledger.waiting_s, 3),
        "idle_s": round(ledger.idle_s, 3),
        "corunning_s": round(ledger.corunning_s, 3),
        "quanta": ledger.quanta,
        "preempted": ledger.preempted,
        "early_releases": ledger.early_releases,
        "swapped_out_bytes": ledger.swapped_out_bytes,
        "swapped_in_bytes": ledger.swapped_in_bytes,
        "swap_s": round(ledger.swap_s, 3),
    }


def tenant_json(
    info: TenantInfo | None,
    key: str,
    state: TenantState,
    gate_failure: str | None,
    ledger: LedgerView | None = None,
    *,
    resident: bool | None = None,
    swap_refusal: str | None = None,
) -> dict[str, Any]:
    """One tenant, as status and ``tenants`` list it.

    ``resident`` is ``False`` while its GPU memory is in host RAM; ``swap_refusal``
    says why its last swap could not be done (e.g. the host memory floor).
    """
    ident = info.identity if info else None
    return {
        "id": key,
        "name": ident.name if ident else key,
        "kind": ident.kind if ident else None,
        "container_id": ident.container_id if ident else None,
        "pod": ident.pod if ident else None,
        "namespace": ident.namespace if ident else None,
        "identity_source": ident.identity_source if ident else None,
        "state": state.value,
        "pids": sorted(info.pids) if info else [],
        "gpus": sorted(info.gpus) if info else [],
        "footprint_bytes": sum(v or 0 for v in info.footprint.values()) if info else None,
        "gate_failure": gate_failure,
        "ledger": ledger_json(ledger),
        "resident": resident,
        "swap_refusal": swap_refusal,
    }


def swap_json(progress: SwapProgress | None, now: float) -> dict[str, Any] | None:
    """A swap in progress: who, which way, how big, and (estimated) how far along.

    The driver's checkpoint is one call that reports nothing until it returns, so
    ``done_bytes`` is estimated from the rate of the previous swap that way.
    """
    if progress is None:
        return None
    elapsed = max(0.0, now - progress.started)
    rate = progress.expected_rate
    done = min(progress.bytes, int(elapsed * rate)) if rate else None
    return {
        "tenant": progress.tenant,
        "direction": progress.direction,
        "bytes": progress.bytes,
        "elapsed_s": round(elapsed, 3),
        "rate_bytes_s": round(rate) if rate else None,
        "done_bytes": done,
        "done_estimated": True,
    }


def build_status(
    *,
    pid: int,
    config: Mapping[str, Any],
    scheduling_on: bool,
    devices: Sequence[DeviceInfo],
    unhealthy: set[str],
    configured: Mapping[str, tuple[float, float, str]],
    view: SchedulerView,
    tenants: Mapping[str, TenantInfo],
    gate_failures: Mapping[str, str],
    gate_method: str,
    handovers: Mapping[str, Histogram],
    departed: Sequence[Departed],
    swaps: Mapping[str, SwapProgress] | None = None,
    swap_refusals: Mapping[str, str] | None = None,
    host_floor_bytes: int = 0,
    reloads: Mapping[str, int],
    uptime_s: float,
) -> dict[str, Any]:
    """Assemble the status object from the scheduler's view and kiwid's tables."""
    now = view.now
    by_gpu = {g.gpu: g for g in view.gpus}
    gpus: list[dict[str, Any]] = []
    for device in devices:
        gid = str(device.index)
        g = by_gpu.get(gid)
        policy: GpuPolicy | None = g.policy if g else None
        tq_conf, _, mode_conf = configured[gid]
        holder = None
        if g is not None and g.holder is not None and g.holder_since is not None:
            holder = {
                "tenant": g.holder,
                "since_s": round(now - g.holder_since, 3),
                "remaining_s": None
                if g.preempt_at is None
                else round(max(0.0, g.preempt_at - now), 3),
            }
        gpus.append(
            {
                "id": gid,
                "index": device.index,
                "uuid": device.uuid,
                "name": device.name,
                "memory_total_bytes": device.memory_total_bytes,
                "healthy": gid not in unhealthy,
                "tq": policy.tq_s if policy else tq_conf,
                "tq_configured": tq_conf,
                "idle_release": policy.idle_release_s if policy else None,
                "mode": policy.mode.value if policy else mode_conf,
                "mode_configured": mode_conf,
                "contended": bool(g and g.gating and g.waiters),
                "gating": bool(g and g.gating),
                "holder": holder,
                "waiters": [
                    {
                        "tenant": w.tenant,
                        "waiting_s": round(now - w.since, 3),
                        "position": w.position,
                        "eta_s": _eta(g, w.position, now) if g else None,
                    }
                    for w in (g.waiters if g else ())
                ],
                "tenants": [
                    tenant_json(
                        tenants.get(t.tenant),
                        t.tenant,
                        t.state,
                        gate_failures.get(t.tenant),
                        t.ledger,
                        resident=t.resident,
                        swap_refusal=(swap_refusals or {}).get(t.tenant),
                    )
                    for t in view.tenants
                    if gid in t.gpus
                ],
                "handover_seconds": handovers.get(gid, Histogram()).as_json(),
                "swap": swap_json(
                    next((w for w in (swaps or {}).values() if gid in w.gpus), None), now
                ),
                "swap_mode": policy.swap.value if policy else None,
                "memory_resident_bytes": g.memory_in_use_bytes if g else 0,
            }
        )
    return {
        "version": __version__,
        "pid": pid,
        "config": dict(config),
        "scheduling": "on" if scheduling_on else "off",
        "gate": gate_method,
        "uptime_s": round(uptime_s, 3),
        "counters": {"reloads": dict(reloads)},
        "gpus": gpus,
        "host_floor_bytes": host_floor_bytes,
        "departed": [_departed_json(d, now) for d in departed],
    }


def _eta(gpu: GpuView, position: int, now: float) -> float:
    """Seconds until the waiter at ``position`` is granted, if everyone ahead uses a full TQ.

    An estimate: holders that go idle yield earlier, multi-GPU waiters may wait
    for other GPUs too.
    """
    remaining = max(0.0, gpu.preempt_at - now) if gpu.preempt_at is not None else 0.0
    return round(remaining + (position - 1) * gpu.policy.tq_s, 3)


def _departed_json(d: Departed, now: float) -> dict[str, Any]:
    ident = d.info.identity if d.info else None
    return {
        "id": d.tenant,
        "name": ident.name if ident else d.tenant,
        "kind": ident.kind if ident else None,
        "pod": ident.pod if ident else None,
        "namespace": ident.namespace if ident else None,
        "identity_source": ident.identity_source if ident else None,
        "gpus": sorted(d.info.gpus) if d.info else [],
        "ledger": ledger_json(d.ledger),
        "gone_for_s": round(now - d.gone_at, 3),
    }


def summary_line(status: Mapping[str, Any]) -> str:
    """A one-line summary for systemd's STATUS=."""
    parts = []
    for gpu in status["gpus"]:
        holder = gpu["holder"]["tenant"] if gpu["holder"] else "none"
        parts.append(
            f"GPU {gpu['id']}: TQ {gpu['tq']:g} s, {gpu['mode']}, holder {holder}, "
            f"{len(gpu['waiters'])} waiting"
        )
    return "; ".join(parts) if parts else "no GPUs"
