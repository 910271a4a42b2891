"""What ``kiwictl`` says of a parked tenant: since when, how much, and what wakes it.

A parked tenant is idle with its memory in host RAM, gated and out of the queue,
until a request waits on one of its sockets or ``kiwictl wake`` wakes it. Its
entry in one ``status`` answer has ``parked_since``, ``wakes_on`` and its sizes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from kiwid.core.quantity import shown_bytes


def _size(tenant: Mapping[str, Any]) -> str:
    size = tenant.get("footprint_bytes") or tenant.get("peak_bytes")
    return f"its {shown_bytes(size)}" if isinstance(size, int) and size > 0 else "its memory"


def wakes_clause(tenant: Mapping[str, Any]) -> str:
    """``wakes on a connection to tcp 0.0.0.0:8000 or on `kiwictl wake```."""
    where = [str(w) for w in tenant.get("wakes_on") or []]
    if not where:
        return "wakes on `kiwictl wake` (it listens on no socket kiwid can watch)"
    return f"wakes on a connection to {' or '.join(where)} or on `kiwictl wake`"


def _since(tenant: Mapping[str, Any]) -> str:
    since = tenant.get("parked_since")
    if not isinstance(since, int | float):
        return ""
    return f" since {time.strftime('%H:%M:%S', time.localtime(since))}"


def parked_clause(tenant: Mapping[str, Any]) -> str:
    """``parked since 12:01:05: idle, its 3 GiB in host RAM; wakes on ...``."""
    return f"parked{_since(tenant)}: idle, {_size(tenant)} in host RAM; {wakes_clause(tenant)}"


def parked_sentence(tenant: Mapping[str, Any], who: str) -> str:
    """``kiwictl explain``'s words for a parked tenant."""
    return (
        f"{who} is PARKED{_since(tenant)}: idle, {_size(tenant)} in host RAM; "
        f"{wakes_clause(tenant)}. It holds no turns and costs no swaps meanwhile; woken, "
        "it joins the queue as a burst and is restored at its turn."
    )


def wake_sentence(tenant: Mapping[str, Any]) -> str:
    """Its last wake, e.g. ``Last woken 2m10s ago by a request (tcp ...).`` (or ``""``)."""
    wake = tenant.get("last_wake")
    if not isinstance(wake, Mapping):
        return ""
    by = {"request": "a request", "operator": "an operator", "policy": "kiwid"}
    reason = str(wake.get("reason"))
    detail = f" ({wake['detail']})" if wake.get("detail") else ""
    return f"Last woken {wake.get('ago_s', 0):.0f} s ago by {by.get(reason, reason)}{detail}."
