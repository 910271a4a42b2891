"""``kiwictl status`` and ``kiwictl tenants`` in words: the daemon's answers for a person.

The shape of what is rendered is in ``docs/control-protocol.md``; scripts read
``--json`` instead.
"""

from __future__ import annotations

from typing import Any

from kiwid.cli.fault_text import fault_clause
from kiwid.cli.handover_text import handover_line
from kiwid.cli.parking_text import parked_clause

__all__ = ["format_number", "format_status", "format_tenants"]


def format_number(value: float) -> str:
    """Format seconds without a needless ``.0`` (20.0 → ``20``, 2.5 → ``2.5``).

    Args:
        value: A finite number.

    Returns:
        Its shortest readable form.
    """
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError  # pragma: no cover - the loop always returns


def _override(value: Any, configured: Any, shown: str) -> str:
    if configured is None or value == configured:
        return ""
    return f" (runtime override; file says {shown})"


def _gpu_lines(gpu: dict[str, Any]) -> list[str]:
    tq, tq_conf = gpu.get("tq"), gpu.get("tq_configured")
    mode, mode_conf = gpu.get("mode"), gpu.get("mode_configured")
    health = "" if gpu.get("healthy", True) else "  UNHEALTHY"
    memory = _bytes(gpu.get("memory_total_bytes"))
    lines = [f"GPU {gpu.get('id')}: {gpu.get('name')} ({gpu.get('uuid')}), {memory}{health}"]
    tq_text = "?" if tq is None else f"{format_number(tq)} s"
    conf_text = "?" if tq_conf is None else format_number(tq_conf)
    lines.append(f"  TQ       {tq_text}{_override(tq, tq_conf, conf_text)}")
    if gpu.get("idle_release") is not None:
        lines.append(f"  release  after {format_number(gpu['idle_release'])} s without GPU work")
    contended = ", contended" if gpu.get("contended") else ""
    lines.append(f"  mode     {mode}{contended}{_override(mode, mode_conf, str(mode_conf))}")
    holder = gpu.get("holder")
    waiters = gpu.get("waiters") or []
    if holder is None:
        lines.append("  holder   none")
    else:
        left = holder.get("remaining_s")
        if gpu.get("handover_waits_for"):
            when = f"quantum over, keeps it until {gpu['handover_waits_for']}'s memory is back"
        elif left is None:
            when = (
                "keeps it: those waiting rank lower" if waiters else "keeps it while nobody waits"
            )
        else:
            when = f"{left:.1f} s left"
        since = holder.get("since_s")
        if since is None:  # granted, its quantum not begun: its hand-over is under way
            lines.append(f"  holder   {holder['tenant']}, granted, not running yet")
        else:
            lines.append(f"  holder   {holder['tenant']} for {since:.1f} s, {when}")
    if not waiters:
        lines.append("  waiters  none")
    for i, w in enumerate(waiters):
        label = "  waiters  " if i == 0 else "           "
        unbounded = (
            f" (no wait bound: {w['wait_bound_reason']})" if w.get("wait_bound_reason") else ""
        )
        lines.append(
            f"{label}{w['position']}. {w['tenant']} waiting {w['waiting_s']:.1f} s{unbounded}"
        )
    lines += handover_line(gpu.get("handover"))
    lines += _stuck_lines(gpu)
    swaps = gpu.get("swaps")
    if swaps is None:  # an older kiwid: one swap at most
        swaps = [gpu["swap"]] if gpu.get("swap") else []
    for i, swap in enumerate(swaps):
        rate = swap.get("rate_bytes_s")
        speed = f" at ~{rate / 1e9:.1f} GB/s" if rate else ""
        lines.append(
            f"{'  swap     ' if i == 0 else '           '}{swap['tenant']} {swap['direction']}: "
            f"{_bytes(swap.get('bytes'))}, {swap.get('elapsed_s', 0):.1f} s so far{speed}"
        )
    if gpu.get("free_bytes") is not None:
        lines.append(
            f"  memory   {_bytes(gpu['free_bytes'])} free (driver), "
            f"{_bytes(gpu.get('memory_resident_bytes'))} held by tenants"
        )
    tenants = gpu.get("tenants") or []
    if not tenants:
        lines.append("  tenants  none")
    for i, t in enumerate(tenants):
        label = "  tenants  " if i == 0 else "           "
        pids = ",".join(str(p) for p in t.get("pids", [])) or "-"
        size = _bytes(t.get("footprint_bytes"))
        pod = _pod(t)
        who = f"{t.get('name')}, pod {pod}" if pod else str(t.get("name"))
        where = ", in host RAM" if t.get("resident") is False else ""
        refused = f" (swap refused: {t['swap_refusal']})" if t.get("swap_refusal") else ""
        known = (
            f", sized from its last run ({_bytes(t['remembered_bytes'])})"
            if t.get("remembered_bytes")
            else ""
        )
        waiting = f"; not let go yet: {t['waiting_for']}" if t.get("waiting_for") else ""
        if t.get("state") == "released":
            waiting += f"; released by an operator ({t.get('released') or 'nothing to say'})"
        if t.get("state") == "parked":
            waiting += f"; {parked_clause(t)}"
        lines.append(
            f"{label}{t['id']} ({who}): {t.get('state')}, pids {pids}, {size}{where}{known}"
            f"{refused}{waiting}"
        )
    return lines


def _stuck_lines(gpu: dict[str, Any]) -> list[str]:
    """Who is stuck on the GPU and why, who blocks it, and who is held back."""
    lines: list[str] = []
    reasons = {t.get("id"): t.get("stuck_reason") for t in gpu.get("tenants") or []}
    for i, tid in enumerate(gpu.get("stuck") or []):
        label = "  stuck    " if i == 0 else "           "
        reason = reasons.get(tid) or {}
        mending = "; a retry or release is under way" if reason.get("mending") else ""
        lines.append(
            f"{label}{tid}: {fault_clause(reason)}{mending} "
            f"(kiwictl retry {tid}, or kiwictl release {tid})"
        )
    if gpu.get("blocked_by"):
        lines.append(
            f"  blocked  by {gpu['blocked_by']}: stuck and not gated, it may run; nobody "
            "else is let go here until its gate takes"
        )
    stuck = set(gpu.get("stuck") or [])
    held = [h for h in gpu.get("held_back") or [] if h.get("tenant") not in stuck]
    for i, h in enumerate(held):
        label = "  held     " if i == 0 else "           "
        lines.append(f"{label}{h['tenant']}, gated: {h.get('waiting_for') or 'reason unknown'}")
    return lines


def _pod(tenant: dict[str, Any]) -> str:
    """``namespace/pod`` (or the pod alone, e.g. a UID from a cgroup path); ``""`` if none."""
    pod, namespace = tenant.get("pod"), tenant.get("namespace")
    if not pod:
        return ""
    return f"{namespace}/{pod}" if namespace else str(pod)


def format_status(status: dict[str, Any]) -> str:
    """Render the daemon's status object for a person.

    Args:
        status: The ``status`` result (shape in ``docs/control-protocol.md``).

    Returns:
        Several lines, one block per GPU, without a trailing newline.
    """
    lines = [
        f"kiwid {status.get('version')} (pid {status.get('pid')}), "
        f"scheduling {status.get('scheduling')}"
    ]
    config = status.get("config") or {}
    reload = config.get("last_reload") or {}
    if reload.get("ok", True):
        lines.append(f"config   {config.get('path')} (last reload ok)")
    else:
        lines.append(
            f"config   {config.get('path')}: last reload FAILED, previous settings kept: "
            f"{reload.get('error')}"
        )
    state_file = status.get("state_file") or {}
    if state_file.get("trouble"):
        lines.append(
            f"state    {state_file.get('path')}: UNUSABLE at start: {state_file['trouble']}"
        )
    for key, why in sorted((state_file.get("unusable_records") or {}).items()):
        lines.append(f"state    record {key} kept for you, unusable: {why}")
    gpus = status.get("gpus") or []
    if not gpus:
        lines.append("no GPUs")
    for gpu in gpus:
        lines += ["", *_gpu_lines(gpu)]
    return "\n".join(lines)


def format_tenants(tenants: list[dict[str, Any]]) -> str:
    """Render the ``tenants`` list as an aligned table.

    Args:
        tenants: The ``tenants`` field of the daemon's answer.

    Returns:
        A header and one row per tenant (with a ``POD`` column, ``namespace/pod``,
        when any tenant has a pod), or ``no tenants``.
    """
    if not tenants:
        return "no tenants"
    pods = any(_pod(t) for t in tenants)  # a POD column only where there are pods
    rows = [("TENANT", "NAME", *(("POD",) if pods else ()), "STATE", "GPUS", "FOOTPRINT", "PIDS")]
    for t in tenants:
        gpus = ",".join(str(g) for g in t.get("gpus", [])) or "-"
        pids = ",".join(str(p) for p in t.get("pids", [])) or "-"
        size = _bytes(t.get("footprint_bytes"))
        pod = ((_pod(t) or "-"),) if pods else ()
        rows.append(
            (str(t.get("id")), str(t.get("name")), *pod, str(t.get("state")), gpus, size, pids)
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
