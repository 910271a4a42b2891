"""Small words kiwictl's views share: durations, sizes, plurals, tenant labels."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def format_duration(seconds: float | None) -> str:
    """Say a duration briefly: ``12.3 s``, ``5m10s``, ``2h03m`` (``?`` for ``None``)."""
    if seconds is None:
        return "?"
    if seconds < 60:
        return f"{max(seconds, 0.0):.1f} s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def format_bytes(n: float | None) -> str:
    """Say a size briefly: ``512 B``, ``1.5 GiB`` (``?`` for ``None``)."""
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{int(n)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def plural(n: int, word: str) -> str:
    """``1 tenant``, ``2 tenants``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def tenant_label(tenant: Mapping[str, Any]) -> str:
    """A tenant's id, with its pod when it has one (``docker:3f2a… (pod ns/web)``)."""
    pod = tenant.get("pod")
    if not pod:
        return str(tenant.get("id"))
    ns = tenant.get("namespace")
    return f"{tenant.get('id')} (pod {ns}/{pod})" if ns else f"{tenant.get('id')} (pod {pod})"
