"""Stuck and released tenants in words, for ``explain``, ``status`` and ``retry``/``release``.

Everything here reads the status object's ``stuck_reason`` and ``released`` fields
(docs/control-protocol.md); nothing asks kiwid.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

__all__ = [
    "at_text",
    "blocked_sentence",
    "fault_clause",
    "released_sentence",
    "stuck_sentence",
]

_OPERATIONS = {
    "gate": "its gate (freeze or CUDA lock)",
    "ungate": "its ungate",
    "swap-out": "its checkpoint (swap-out)",
    "swap-in": "its restore",
    "retry": "the operator's retry",
    "release": "the operator's release",
    "adopt": "its re-adoption at kiwid's start",
}


def at_text(at_unix: float | None, now_unix: float | None = None) -> str:
    """A wall-clock instant as ``12:00:01`` (with the date when it is not today)."""
    if at_unix is None:
        return "?"
    at = time.localtime(at_unix)
    today = time.localtime(time.time() if now_unix is None else now_unix)
    if (at.tm_year, at.tm_yday) == (today.tm_year, today.tm_yday):
        return time.strftime("%H:%M:%S", at)
    return time.strftime("%Y-%m-%d %H:%M:%S", at)


def fault_clause(reason: Mapping[str, Any]) -> str:
    """What failed, to which process, with what answer, and when.

    ``its restore of pid 123 failed with CUDA_ERROR_OPERATING_SYSTEM (304) at
    12:00:01``; without the driver's answer, the reason kiwid gave.
    """
    operation = str(reason.get("operation") or "")
    what = _OPERATIONS.get(operation, f"its {operation or 'operation'}")
    pid = f" of pid {reason['pid']}" if reason.get("pid") is not None else ""
    at = at_text(reason.get("at_unix"))
    if reason.get("answer"):
        return f"{what}{pid} failed with {reason['answer']} at {at}"
    return f"{what}{pid} failed at {at}: {reason.get('reason') or 'no reason given'}"


def stuck_sentence(tenant: Mapping[str, Any], who: str) -> str:
    """Why ``tenant`` (a status entry, state ``stuck``) is stuck and what an operator can do."""
    reason = tenant.get("stuck_reason") or {}
    tid = tenant.get("id")
    text = f"{who} is STUCK: {fault_clause(reason)}"
    if reason.get("contained", True):
        text += (
            "; it stays gated and holds nothing while the others rotate. "
            f"`kiwictl retry {tid}` tries again; `kiwictl release {tid}` lets it run ungated."
        )
    else:
        text += (
            "; kiwid could not gate it, so it may still run and nobody else is let go on "
            "its GPUs (its gate is tried again every TQ). "
            f"`kiwictl retry {tid}` tries again now; `kiwictl release {tid}` lets it run "
            "ungated, outside the rotation."
        )
    if reason.get("mending"):
        text += " A retry or release of it is under way."
    return text


def released_sentence(tenant: Mapping[str, Any], who: str) -> str:
    """What a released tenant (state ``released``) does, and how it comes back."""
    note = tenant.get("released")
    said = f" ({note})" if note else ""
    return (
        f"{who} is RELEASED: an operator let it run ungated{said}. It runs outside the "
        "rotation, holds nothing and keeps nobody waiting, until it leaves or "
        f"`kiwictl retry {tenant.get('id')}` brings it back."
    )


def blocked_sentence(blocker: str, gpu: str) -> str:
    """Why nobody is let go on ``gpu``: ``blocker``, stuck, may still run there."""
    return (
        f"Nobody is let go on GPU {gpu} while {blocker} may run there: it is stuck and "
        "kiwid could not gate it (its gate is tried again every TQ; "
        f"`kiwictl release {blocker}` lets it run outside the rotation)."
    )
