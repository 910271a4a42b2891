"""The status object that ``kiwictl status --json`` prints (protocol v1).

Its shape is documented in docs/control-protocol.md and is stable for scripts:
fields may be added, never renamed or removed within protocol version 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kiwid import __version__
from kiwid.adapters.gpu import DeviceInfo
from kiwid.core.model import GpuPolicy, TenantState
from kiwid.core.view import SchedulerView
from kiwid.daemon.tenants import TenantInfo


def tenant_json(
    info: TenantInfo | None, key: str, state: TenantState, gate_failure: str | None
) -> dict[str, Any]:
    """One tenant, as status and ``tenants`` list it."""
    ident = info.identity if info else None
    return {
        "id": key,
        "name": ident.name if ident else key,
        "kind": ident.kind if ident else None,
        "container_id": ident.container_id if ident else None,
        "pod": ident.pod if ident else None,
        "namespace": ident.namespace if ident else None,
        "state": state.value,
        "pids": sorted(info.pids) if info else [],
        "gpus": sorted(info.gpus) if info else [],
        "footprint_bytes": sum(v or 0 for v in info.footprint.values()) if info else None,
        "gate_failure": gate_failure,
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
                    }
                    for w in (g.waiters if g else ())
                ],
                "tenants": [
                    tenant_json(
                        tenants.get(t.tenant), t.tenant, t.state, gate_failures.get(t.tenant)
                    )
                    for t in view.tenants
                    if gid in t.gpus
                ],
            }
        )
    return {
        "version": __version__,
        "pid": pid,
        "config": dict(config),
        "scheduling": "on" if scheduling_on else "off",
        "gate": gate_method,
        "gpus": gpus,
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
