"""What status says of stuck, released and held-back tenants, and of the state file.

A stuck tenant waits for an operator (``kiwictl retry`` or ``release``): status
gives its fault whole (what kiwid was doing, to which process, what the driver
answered, since when), per GPU who is stuck and who blocks it, and the state
file's own troubles, so that the operator sees all of it in one place.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from kiwid.core.model import TenantId, TenantState
from kiwid.core.view import FaultView, GpuView, TenantView
from kiwid.daemon.context import Context


def fault_json(fault: FaultView | None, now: float | None) -> dict[str, Any] | None:
    """A stuck tenant's fault (``None`` unless it is stuck).

    ``at_unix`` is when it got stuck, by the wall clock (the core counts in
    monotonic seconds: ``since``); ``contained``: kiwid knows it does not run;
    ``mending``: an operator's retry or release is under way.
    """
    if fault is None:
        return None
    at = None if now is None else round(time.time() - (now - fault.since), 3)
    return {
        "operation": fault.operation,
        "reason": fault.reason,
        "pid": fault.pid,
        "answer": fault.answer,
        "at_unix": at,
        "contained": fault.contained,
        "mending": fault.mending,
    }


def held_back_json(gpu: GpuView, tenants: Mapping[TenantId, TenantView]) -> list[dict[str, Any]]:
    """The tenants kept gated on ``gpu`` although nothing may be ahead of them, and why.

    On a GPU that does not gate now (``kiwictl -S off``, or ``auto`` and all fits),
    a tenant whose memory is in host RAM stays gated until it is back on the card;
    a stuck one stays gated (anywhere) until an operator retries or releases it.
    """
    out: list[dict[str, Any]] = []
    for tid in gpu.held_back:
        view = tenants.get(tid)
        why = view.waiting_for if view is not None else None
        if view is not None and view.state is TenantState.STUCK and view.fault is not None:
            why = f"stuck ({view.fault.operation}): {view.fault.reason}"
        elif why is None and view is not None and not view.residency.on_card:
            why = f"its memory is not on the card ({view.residency.value})"
        out.append({"tenant": tid, "waiting_for": why})
    return out


def state_file_json(ctx: Context) -> dict[str, Any]:
    """The state file: where it is, records no kiwid can act on, and why it was unusable.

    ``unusable_records``: records kept in the file for the operator (key → why);
    ``trouble``: why the file found at start could not be used (``None``: it could).
    """
    return {
        "path": str(ctx.state.path),
        "unusable_records": dict(sorted(ctx.state.unusable.items())),
        "trouble": ctx.state_trouble,
    }


def stuck_summary(gpu: Mapping[str, Any]) -> str:
    """``, 1 stuck (a)`` for a GPU entry of the status with stuck tenants; else ``""``."""
    stuck = list(gpu.get("stuck") or [])
    if not stuck:
        return ""
    names = ", ".join(stuck[:3]) + (f" and {len(stuck) - 3} more" if len(stuck) > 3 else "")
    return f", {len(stuck)} stuck ({names})"
