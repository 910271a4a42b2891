"""``kiwictl workloads``: the remembered workloads as a table."""

from __future__ import annotations

from typing import Any

from kiwid.cli.words import format_bytes


def _about(seconds: float) -> str:
    """A coarse span: ``40 s``, ``12 min``, ``23 h``, ``3 d`` (rounded to the nearest)."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{round(seconds / size)} {unit}"
    return f"{round(seconds)} s"


def _checkpoint(entry: dict[str, Any], now: float) -> str:
    if not entry.get("unswappable"):
        return "may be swapped"
    until = entry.get("until_unix")
    left = "" if until is None else f" for {_about(float(until) - now)} more"
    return f"unswappable{left}: {entry.get('why')}"


def format_workloads(result: dict[str, Any]) -> str:
    """Render the ``workloads`` answer as an aligned table.

    Args:
        result: The daemon's answer (``now_unix``, ``retry_after_s``, ``workloads``).

    Returns:
        A header and one row per workload: its name, its peak footprint, when it was
        last seen, the tenants running it now, and whether its memory may be
        swapped (if not: for how long more, and why); or ``no remembered workloads``.
    """
    workloads = result.get("workloads") or []
    if not workloads:
        return "no remembered workloads"
    now = float(result.get("now_unix") or 0.0)
    rows = [("WORKLOAD", "PEAK", "LAST SEEN", "RUNNING", "CHECKPOINT")]
    for w in workloads:
        rows.append(
            (
                str(w.get("workload")),
                format_bytes(w.get("peak_bytes")),
                f"{_about(now - float(w.get('seen_unix') or 0.0))} ago",
                ",".join(w.get("tenants") or []) or "-",
                _checkpoint(w, now),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [
        "  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]])
        for row in rows
    ]
    retry = result.get("retry_after_s")
    if retry is not None:
        lines += [
            "",
            f"A failed checkpoint is tried again {_about(float(retry))} after it failed "
            "(memory.checkpoint_retry_after); kiwictl forget WORKLOAD forgets one now.",
        ]
    return "\n".join(lines)
