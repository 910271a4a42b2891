"""The status object that ``kiwictl status --json`` prints (protocol v1).

Its shape is documented in docs/control-protocol.md and is stable for scripts:
fields may be added, never renamed or removed within protocol version 1.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

from kiwid import __version__
from kiwid.adapters.control import EncodedResult
from kiwid.core.ledger import LedgerView
from kiwid.core.model import GpuPolicy, TenantState
from kiwid.core.view import HandoverView, TenantView
from kiwid.daemon.context import Context
from kiwid.daemon.control.stuck import (
    fault_json,
    held_back_json,
    state_file_json,
    stuck_summary,
)
from kiwid.daemon.control.waits import waiter_json
from kiwid.daemon.engine.records import Departed, Histogram, SwapProgress
from kiwid.daemon.gpu_policy import MIB, configured
from kiwid.daemon.tenants.policy import Resolved
from kiwid.daemon.tenants.tracker import TenantInfo

STATUS_MAX_AGE_S = 0.1
"""A cached status is rebuilt when something changed, or when it is older than this."""


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
        "preempted_priority": ledger.preempted_priority,
        "entitled_s": round(ledger.entitled_s, 3),
        "parked_s": round(ledger.parked_s, 3),
        "wakes": ledger.wakes,
        "restores_wasted": ledger.restores_wasted,
    }


def tenant_json(
    info: TenantInfo | None,
    view: TenantView,
    resolved: Resolved | None = None,
    now: float | None = None,
    workload: str | None = None,
    *,
    wakes_on: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One tenant, as status and ``tenants`` list it.

    A parked tenant (idle, its memory in host RAM, out of the queue) has
    ``parked_since`` (Unix time) and ``wakes_on``, where a connection wakes it;
    ``park_refusal`` says why a tenant may not park (``None``: it may); ``last_wake``
    when and why it was last woken.

    ``resident`` is ``False`` while its GPU memory is off the card (``residency``
    says where: in host RAM, or moving); ``waiting_for`` says why a gated tenant
    is not let go although it may be next; ``swap_refusal`` why its memory may not
    move for now (e.g. the host memory floor); ``stuck_reason`` why it is stuck
    (``None`` unless it is) and ``released`` what an operator's release reported.
    ``declared_bytes`` is the GPU memory per GPU it declared (``declared_source``:
    ``annotation``, ``register`` or ``rule N``), ``peak_bytes`` the most it was seen
    using on one GPU: it is sized by the larger.
    """
    ident = info.identity if info else None
    key = view.tenant
    return {
        "id": key,
        "name": ident.name if ident else key,
        "kind": ident.kind if ident else None,
        "container_id": ident.container_id if ident else None,
        "pod": ident.pod if ident else None,
        "namespace": ident.namespace if ident else None,
        "identity_source": ident.identity_source if ident else None,
        "state": view.state.value,
        "pids": sorted(info.pids) if info else [],
        "gpus": sorted(info.gpus) if info else sorted(view.gpus),
        "footprint_bytes": sum(v or 0 for v in info.footprint.values()) if info else None,
        "gate_failure": view.gate_failure,
        "ledger": ledger_json(view.ledger),
        "resident": view.resident,
        "residency": view.residency.value,
        "gated": view.gated,
        "waiting_for": view.waiting_for,
        "swap_refusal": view.swap_refusal,
        "policy": (resolved or Resolved(view.policy, None, _DEFAULT_SOURCES)).as_json(),
        "quantum_s": None if view.quantum_s is None else round(view.quantum_s, 3),
        "boosted": view.boosted,
        "entitled_share_now": round(view.entitled_share, 4),
        "last_preemption": _preemption_json(view.last_preemption, now),
        "workload": workload,
        "remembered_bytes": view.remembered or None,
        "stuck_reason": fault_json(view.fault, now),
        "released": view.released_note if view.state is TenantState.RELEASED else None,
        "declared_bytes": view.policy.memory_bytes,
        "declared_source": resolved.declared_source if resolved else None,
        "peak_bytes": max((view.peak or {}).values(), default=0) or None,
        **_parking_json(view, now, wakes_on),
    }


def _parking_json(view: TenantView, now: float | None, wakes_on: tuple[str, ...]) -> dict[str, Any]:
    parked = view.state is TenantState.PARKED
    wake = view.last_wake
    return {
        "parked_since": round(time.time() - (now - view.since), 3) if parked and now else None,
        "wakes_on": list(wakes_on) if parked else None,
        "park_refusal": view.parks,
        "last_wake": None
        if wake is None or now is None
        else {"ago_s": round(now - wake[0], 3), "reason": wake[1], "detail": wake[2]},
    }


_DEFAULT_SOURCES = dict.fromkeys(("weight", "priority", "tq", "swap", "park"), "default")


def _preemption_json(
    last: tuple[float, str, str | None] | None, now: float | None
) -> dict[str, Any] | None:
    if last is None or now is None:
        return None
    at, reason, by = last
    return {"ago_s": round(now - at, 3), "reason": reason, "by": by}


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


def handover_json(handover: HandoverView | None, now: float) -> dict[str, Any] | None:
    """A GPU's hand-over under way: to whom, from whom, since when, waiting for what."""
    if handover is None:
        return None
    return {
        "to": handover.to,
        "from": handover.from_,
        "since_unix": round(time.time() - (now - handover.since), 3),
        "seconds": round(now - handover.since, 3),
        "phase": handover.phase,
    }


def build_status(ctx: Context) -> dict[str, Any]:
    """Assemble the status object from the scheduler's view and kiwid's tables."""
    now = ctx.clock()
    engine = ctx.engine
    view = engine.scheduler.view(now)
    tenants = engine.tracker.tenants
    swaps = engine.swaps
    resolved = ctx.tenant_policies.resolved
    allowance = ctx.settings.scheduler.handover_allowance
    by_gpu = {g.gpu: g for g in view.gpus}
    by_tenant = {t.tenant: t for t in view.tenants}
    gpus: list[dict[str, Any]] = []
    for device in ctx.devices:
        gid = str(device.index)
        g = by_gpu.get(gid)
        policy: GpuPolicy | None = g.policy if g else None
        tq_conf, _, mode_conf = configured(ctx.settings, device)
        holder = None
        if g is not None and g.holder is not None:
            holder = {
                "tenant": g.holder,
                "since_s": None if g.holder_since is None else round(now - g.holder_since, 3),
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
                "healthy": gid not in ctx.unhealthy,
                "tq": policy.tq_s if policy else tq_conf,
                "tq_configured": tq_conf,
                "idle_release": policy.idle_release_s if policy else None,
                "mode": policy.mode.value if policy else mode_conf,
                "mode_configured": mode_conf,
                "contended": bool(g and g.gating and g.waiters),
                "gating": bool(g and g.gating),
                "holder": holder,
                "waiters": []
                if g is None
                else [
                    waiter_json(g, w, now, allowance, gpus=by_gpu, tenants=by_tenant)
                    for w in g.waiters
                ],
                "tenants": _with_shares(
                    [
                        tenant_json(
                            tenants.get(t.tenant),
                            t,
                            resolved.get(t.tenant),
                            now,
                            ctx.workloads.workload(t.tenant),
                            wakes_on=ctx.waker.wakes_on.get(t.tenant, ()),
                        )
                        for t in view.tenants
                        if gid in t.gpus
                    ]
                ),
                "handover_seconds": engine.handovers.get(gid, Histogram()).as_json(),
                "handover": handover_json(g.handover if g else None, now),
                "swap": swap_json(next((w for w in swaps.values() if gid in w.gpus), None), now),
                "swaps": [swap_json(w, now) for w in swaps.values() if gid in w.gpus],
                "free_bytes": g.free_bytes if g else None,
                "handover_waits_for": g.handover_waits_for if g else None,
                "swap_mode": policy.swap.value if policy else None,
                "memory_resident_bytes": g.memory_in_use_bytes if g else 0,
                "stuck": list(g.stuck) if g else [],
                "blocked_by": g.blocked_by if g else None,
                "held_back": held_back_json(g, by_tenant) if g else [],
            }
        )
    record = ctx.reload
    return {
        "version": __version__,
        "pid": os.getpid(),
        "config": {
            "path": str(ctx.config_path),
            "loaded_at_unix": record.loaded_at_unix,
            "last_reload": record.as_json(),
            "restart_pending": list(record.restart_pending),
        },
        "scheduling": "off" if ctx.overrides.scheduling_off else "on",
        "gate": engine.effects.gate.method,
        "uptime_s": round(now - ctx.started, 3),
        "counters": {
            "reloads": dict(record.counts),
            "wakes": dict(view.wakes),
            "restores_wasted": view.restores_wasted,
        },
        "gpus": gpus,
        "host_floor_bytes": ctx.settings.memory.host_floor_mib * MIB,
        "handover_allowance_s": allowance,
        "departed": [_departed_json(d, now) for d in engine.departed(now)],
        "state_file": state_file_json(ctx),
        "driver_timeout_s": ctx.settings.gpu.driver_deadline_s,
    }


def _with_shares(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add each tenant's share of the GPU's time: entitled and received, since start."""
    held = sum(e["ledger"]["holding_s"] for e in entries)
    entitled = sum(e["ledger"]["entitled_s"] for e in entries)
    for e in entries:
        e["share"] = {
            "entitled": round(e["ledger"]["entitled_s"] / entitled, 4) if entitled else None,
            "received": round(e["ledger"]["holding_s"] / held, 4) if held else None,
        }
    return entries


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
            f"{len(gpu['waiters'])} waiting{stuck_summary(gpu)}"
        )
    return "; ".join(parts) if parts else "no GPUs"


class StatusCache:
    """The status, rebuilt at most every STATUS_MAX_AGE_S unless something changed.

    A hundred ``kiwictl status`` callers at once then cost one build and one
    encoding, not a hundred; the times in it are at most that old.
    """

    def __init__(self, ctx: Context) -> None:
        """Serve ``ctx``'s status."""
        self._ctx = ctx
        self._built: tuple[float, int, dict[str, Any], EncodedResult] | None = None
        self._told: tuple[str, int] = ("", -1)  # systemd's STATUS= line, and when

    def invalidate(self) -> None:
        """Rebuild at the next read (after a reload or a runtime change)."""
        self._built = None

    def status(self) -> dict[str, Any]:
        """The status object, from the cache when it is fresh."""
        return self._fresh()[2]

    def encoded(self) -> EncodedResult:
        """The status object encoded as JSON (for the control socket)."""
        return self._fresh()[3]

    def tell_systemd(self) -> None:
        """Send systemd a new ``STATUS=`` line when the summary changed."""
        generation = self._ctx.engine.generation
        if generation == self._told[1]:
            return
        line = summary_line(self.status())
        if line != self._told[0]:
            self._ctx.notifier.status(line)
        self._told = (line, generation)

    def _fresh(self) -> tuple[float, int, dict[str, Any], EncodedResult]:
        now = self._ctx.clock()
        generation = self._ctx.engine.generation
        built = self._built
        if built is None or built[1] != generation or now - built[0] > STATUS_MAX_AGE_S:
            status = build_status(self._ctx)
            # ASCII: a name read from /proc may hold undecodable bytes (as escapes).
            encoded = EncodedResult(json.dumps(status, allow_nan=False).encode())
            built = self._built = (now, generation, status, encoded)
        return built
