"""``kiwictl explain TENANT``: why a tenant waits or idles, in plain words.

Everything is worked out client-side from one ``status`` answer (shape in
``docs/control-protocol.md``): the lookup, who holds the GPU, who is ahead, the
estimated turn and the tenant's ledger. ``analyse`` gives the facts as JSON;
``explain_text`` turns them into sentences. ``top`` reuses the small helpers.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kiwid.adapters.control import request
from kiwid.cli.fault_text import blocked_sentence, released_sentence, stuck_sentence
from kiwid.cli.handover_text import handover_sentence
from kiwid.cli.lookup import AmbiguousTenant, TenantNotFound, collect_tenants, find_tenant
from kiwid.cli.memory_text import declared_sentence, remembered_sentence
from kiwid.cli.parking_text import parked_sentence, wake_sentence
from kiwid.cli.policy_text import policy_sentence, preemption_sentence, rank_label
from kiwid.cli.words import format_bytes, format_duration, plural, tenant_label

__all__ = [
    "AmbiguousTenant",
    "TenantNotFound",
    "analyse",
    "collect_tenants",
    "explain_text",
    "find_tenant",
    "format_bytes",
    "format_duration",
    "ledger_text",
    "plural",
    "run",
    "tenant_label",
    "waiter_eta",
]

Json = dict[str, Any]
_TENANT_KEYS = (
    *("id", "name", "kind", "container_id", "pod", "namespace", "state", "pids"),
    *("policy", "quantum_s", "share", "boosted", "last_preemption", "waiting_for"),
    *("swap_refusal", "workload", "remembered_bytes", "stuck_reason", "released"),
    *("declared_bytes", "declared_source", "peak_bytes", "footprint_bytes"),
    *("parked_since", "wakes_on", "last_wake", "park_refusal"),
)


def _eta_for_newcomer(gpu: Mapping[str, Any]) -> float:
    """When a tenant that starts GPU work now would get its turn, roughly."""
    holder, waiters = gpu.get("holder"), gpu.get("waiters") or []
    tq = float(gpu.get("tq") or 0.0)
    if holder is None and not waiters:
        return 0.0
    if waiters and waiters[-1].get("eta_s") is not None:
        return float(waiters[-1]["eta_s"]) + tq
    left = 0.0
    if holder is not None:
        left = holder.get("remaining_s")
        left = max(0.0, tq - float(holder.get("since_s") or 0.0)) if left is None else left
    return float(left) + tq * len(waiters)


def waiter_eta(gpu: Mapping[str, Any], waiter: Mapping[str, Any]) -> tuple[float, bool]:
    """When a waiter's turn comes: kiwid's ``eta_s``, else an estimate.

    Args:
        gpu: The GPU's entry in ``status``.
        waiter: One of its ``waiters``.

    Returns:
        Seconds until its turn, and whether that was estimated here (an older
        kiwid: the holder's remaining time plus a TQ per tenant ahead).
    """
    if waiter.get("eta_s") is not None:
        return float(waiter["eta_s"]), False
    holder = gpu.get("holder")
    remaining = float((holder or {}).get("remaining_s") or 0.0)
    ahead = max(int(waiter.get("position") or 1) - 1, 0)
    return remaining + float(gpu.get("tq") or 0.0) * ahead, True


def _gpu_facts(t: Mapping[str, Any], gpu: Mapping[str, Any]) -> Json:
    gid = str(gpu.get("id"))
    holder = gpu.get("holder")
    waiters = gpu.get("waiters") or []
    me = next((w for w in waiters if w.get("tenant") == t["id"]), None)
    facts: Json = {
        "gpu": gid,
        "healthy": gpu.get("healthy", True),
        "tq": gpu.get("tq"),
        "idle_release": gpu.get("idle_release"),
        "mode": gpu.get("mode"),
        "holder": holder,
        "waiting": [w.get("tenant") for w in waiters],
        "position": None,
        "waiting_s": None,
        "ahead": [],
        "eta_s": None,
        "eta_estimated": False,
        "ledger": t["ledgers"].get(gid),
        "handover_waits_for": gpu.get("handover_waits_for"),
        "blocked_by": gpu.get("blocked_by"),
        "handover": gpu.get("handover"),
    }
    # Who holds it and who is ahead, with their priority (``priority 2 tenant X``).
    on_gpu = {str(o.get("id")): o for o in gpu.get("tenants") or []}
    held_by = on_gpu.get(holder["tenant"]) if holder else None
    facts["holder_label"] = rank_label(held_by) if holder else None
    facts["holder_outranks"] = _priority(held_by) > _priority(t)
    if me is not None:
        position = int(me.get("position") or waiters.index(me) + 1)
        ahead = [w.get("tenant") for w in waiters if int(w.get("position") or 0) < position]
        eta, estimated = waiter_eta(gpu, me)
        facts.update(position=position, waiting_s=me.get("waiting_s"), ahead=ahead)
        facts["ahead_labels"] = [rank_label(on_gpu.get(str(a))) for a in ahead]
        facts.update(eta_s=eta, eta_estimated=estimated)
    elif t.get("state") == "idle":
        facts.update(eta_s=_eta_for_newcomer(gpu), eta_estimated=True)
    return facts


def _priority(tenant: Mapping[str, Any] | None) -> int:
    return int(((tenant or {}).get("policy") or {}).get("priority", 0))


def analyse(status: Mapping[str, Any], tenant: Json) -> Json:
    """The facts behind an explanation (what ``explain --json`` prints).

    Args:
        status: The ``status`` result.
        tenant: One of `collect_tenants` (e.g. from `find_tenant`).

    Returns:
        ``tenant`` (its identity), ``scheduling``, ``uptime_s`` and ``gpus``: per
        GPU of the tenant, holder, waiters, its position, who is ahead, its ETA
        and its ledger.
    """
    by_id = {str(g.get("id")): g for g in status.get("gpus") or []}
    ident = {k: tenant.get(k) for k in _TENANT_KEYS}
    ident.update(gate_failure=tenant.get("gate_failure"), departed=bool(tenant.get("departed")))
    ident.update(gone_for_s=tenant.get("gone_for_s"))
    gpus = [str(g) for g in tenant.get("gpus") or []]
    return {
        "tenant": ident,
        "scheduling": status.get("scheduling"),
        "uptime_s": status.get("uptime_s"),
        "gpus": [
            _gpu_facts(tenant, by_id[g]) for g in gpus if g in by_id and not ident["departed"]
        ],
        "ledger": next(iter(tenant["ledgers"].values()), None),
    }


def _ids(tenants: Iterable[Any]) -> str:
    return ", ".join(str(t) for t in tenants)


def _waiting(who: str, f: Json) -> str:
    text = f"{who} is WAITING for GPU {f['gpu']} since {format_duration(f['waiting_s'])}: "
    holder = f["holder"]
    if holder is None:
        text += "the GPU is being handed over"
    elif f.get("holder_outranks"):
        held_by = f.get("holder_label") or holder["tenant"]
        left = holder.get("remaining_s")
        until = "while it has GPU work" if left is None else f"for {format_duration(left)} more"
        text += f"it is waiting behind {held_by}, which keeps the GPU {until}"
    elif holder.get("remaining_s") is None:
        held_by = f.get("holder_label") or holder["tenant"]
        text += f"the GPU is held by {held_by}, which keeps it until it goes idle"
    else:
        left = format_duration(holder["remaining_s"])
        held_by = f.get("holder_label") or holder["tenant"]
        text += f"the GPU is held by {held_by} whose quantum ends in {left}"
    ahead = f["ahead"]
    if ahead:
        verb = "is" if len(ahead) == 1 else "are"
        labels = f.get("ahead_labels") or ahead
        text += f"; {plural(len(ahead), 'tenant')} {verb} ahead of it ({_ids(labels)})."
    else:
        text += "; it is next in line."
    about = "about " if f["eta_estimated"] else ""
    return f"{text} Estimated turn in {about}{format_duration(f['eta_s'])}."


def _holding(who: str, f: Json) -> str:
    since = format_duration((f["holder"] or {}).get("since_s"))
    text = f"{who} HOLDS GPU {f['gpu']} (for {since} now)"
    left = (f["holder"] or {}).get("remaining_s")
    release = format_duration(f["idle_release"])
    if not f["waiting"]:
        return f"{text}; nobody waits, so it keeps it until it has no GPU work for {release}."
    if f.get("handover_waits_for"):
        return (
            f"{text}; its quantum is over, but it keeps the GPU while the memory of "
            f"{f['handover_waits_for']}, next in line, comes back from host RAM (at most one "
            "more TQ): the GPU works instead of waiting for a restore."
        )
    if left is None:
        n = len(f["waiting"])
        return (
            f"{text}; {plural(n, 'tenant')} of a lower priority {'waits' if n == 1 else 'wait'} "
            f"({_ids(f['waiting'])}), so it keeps it until it has no GPU work for {release} "
            "(unless scheduler.max_wait lets one of them go first)."
        )
    n = len(f["waiting"])
    return (
        f"{text}; {plural(n, 'tenant')} {'waits' if n == 1 else 'wait'} "
        f"({_ids(f['waiting'])}), so its quantum ends in {format_duration(left)}, "
        "then it goes to the back of the queue."
    )


def _idle(who: str, f: Json) -> str:
    release = format_duration(f["idle_release"])
    text = (
        f"{who} is IDLE on GPU {f['gpu']}: it has had no GPU work for at least {release} "
        "(or none yet), so it neither holds the GPU nor waits for it."
    )
    if f["holder"] is None and not f["waiting"]:
        return f"{text} At its next GPU work it gets the GPU at once (it is free)."
    holder = f["holder"]["tenant"] if f["holder"] else "nobody"
    return (
        f"{text} At its next GPU work it is queued (holder {holder}, "
        f"{plural(len(f['waiting']), 'tenant')} waiting): turn in about "
        f"{format_duration(f['eta_s'])}."
    )


def _corunning(who: str, f: Json, scheduling: Any) -> str:
    text = f"{who} RUNS UN-GATED on GPU {f['gpu']}, sharing it with whoever else is busy: "
    if scheduling == "off":
        return text + "the scheduler is off (kiwictl -S off), so the driver time-slices the GPU."
    if f["mode"] == "off":
        return text + "the GPU's mode is off, so the driver time-slices it."
    if f["mode"] == "auto":
        return text + "in auto mode the busy tenants' memory fits on the GPU, so nobody is gated."
    return text + "kiwid does not gate it now."


def ledger_text(ledger: Mapping[str, Any] | None, uptime_s: float | None = None) -> str:
    """The ledger in one sentence (``Ledger: held 5m10s in 11 quanta (…), waited 4m02s.``).

    ``uptime_s`` (since kiwid started, the ledger's origin) is told when known; no
    ledger gives an empty string.
    """
    if not ledger:
        return ""
    quanta = int(ledger.get("quanta", 0))
    since = f" (since kiwid started {format_duration(uptime_s)} ago)" if uptime_s else ""
    text = (
        f"Ledger{since}: held {format_duration(ledger.get('holding_s', 0.0))} in "
        f"{quanta} {'quantum' if quanta == 1 else 'quanta'} "
        f"({ledger.get('preempted', 0)} preempted, "
        f"{plural(int(ledger.get('early_releases', 0)), 'early release')}), "
        f"waited {format_duration(ledger.get('waiting_s', 0.0))}"
    )
    for key, word in (("corunning_s", "ran un-gated"), ("idle_s", "idle")):
        if ledger.get(key):
            text += f", {word} {format_duration(ledger[key])}"
    if ledger.get("swapped_out_bytes") or ledger.get("swapped_in_bytes"):
        text += (
            f"; swapped {format_bytes(ledger.get('swapped_out_bytes'))} out and "
            f"{format_bytes(ledger.get('swapped_in_bytes'))} in, "
            f"taking {format_duration(ledger.get('swap_s'))}"
        )
    return text + "."


def explain_text(facts: Json) -> str:
    """Turn `analyse`'s facts into plain sentences.

    Args:
        facts: What `analyse` returned.

    Returns:
        A paragraph, one sentence or more per GPU, then the ledger.
    """
    t = facts["tenant"]
    who = tenant_label(t)
    if t["departed"]:
        gone = format_duration(t.get("gone_for_s"))
        parts = [f"{who} is GONE: it left {gone} ago; kiwid keeps its ledger for a while."]
    else:
        state = t.get("state")
        parts = [stuck_sentence(t, who)] if state == "stuck" else []
        if state == "released":
            parts.append(released_sentence(t, who))
        for f in facts["gpus"]:
            if not f["healthy"]:
                parts.append(f"GPU {f['gpu']} is UNHEALTHY (kiwid lost it).")
            if state == "waiting" and f["position"] is not None:
                parts.append(_waiting(who, f))
            elif state == "holder":
                parts.append(_holding(who, f))
            elif state == "corunning":
                parts.append(_corunning(who, f, facts["scheduling"]))
            elif state == "idle":
                parts.append(_idle(who, f))
            elif state == "parked":
                parts.append(parked_sentence(t, who))
            elif state not in ("stuck", "released"):
                parts.append(f"{who} is {str(state).upper()} on GPU {f['gpu']}.")
            if f.get("blocked_by") not in (None, t["id"]) and state in ("waiting", "holder"):
                parts.append(blocked_sentence(str(f["blocked_by"]), str(f["gpu"])))
            handover = f.get("handover") or {}
            if t["id"] in (handover.get("to"), handover.get("from")):
                parts.append(handover_sentence(str(f["gpu"]), handover))
        if not facts["gpus"] and state not in ("stuck", "released"):
            parts.append(f"{who} is {str(state).upper()} and uses no GPU kiwid knows.")
        if len(facts["gpus"]) > 1:
            gpus = _ids(f["gpu"] for f in facts["gpus"])
            parts.append(f"It gets GPUs {gpus} together or none of them.")
        if t.get("gate_failure") and state != "stuck":
            parts.append(f"kiwid could not gate it ({t['gate_failure']}), so it runs un-gated.")
        if t.get("waiting_for") and state in ("waiting", "holder"):
            parts.append(f"It is not let go yet: {t['waiting_for']}.")
        if t.get("swap_refusal"):
            parts.append(f"Its memory stays on the card: {t['swap_refusal']}.")
        parts += [p for p in (declared_sentence(t), remembered_sentence(t)) if p]
        parts += [p for p in (wake_sentence(t),) if p]
        tq = facts["gpus"][0]["tq"] if facts["gpus"] else None
        parts += [p for p in (policy_sentence(t, tq), preemption_sentence(t)) if p]
    ledger = ledger_text(facts.get("ledger"), facts.get("uptime_s"))
    return " ".join([*parts, ledger] if ledger else parts)


def _candidate_line(t: Mapping[str, Any]) -> str:
    pids = ",".join(str(p) for p in t.get("pids") or []) or "-"
    return f"  {tenant_label(t)}  {t.get('state')}  pids {pids}"


def run(socket: str | Path, query: str, as_json: bool = False) -> int:
    """Run ``kiwictl explain``: ask for the status, find the tenant, print why.

    Args:
        socket: kiwid's control socket.
        query: Tenant id, container id (prefix of 4+), name, pod or PID.
        as_json: Print `analyse`'s facts (with the text) as JSON.

    Returns:
        0 explained, 1 not found or ambiguous (the candidates are listed).

    Raises:
        DaemonUnreachable: kiwid does not answer (kiwictl exits 3).
        ControlError: kiwid refused the status request.
    """
    status = request(socket, "status")
    try:
        tenant = find_tenant(status, query)
    except AmbiguousTenant as exc:
        lines = "\n".join(_candidate_line(t) for t in exc.candidates)
        print(f"[ERROR] {query!r} matches several tenants; say which:\n{lines}", file=sys.stderr)
        return 1
    except TenantNotFound:
        print(
            f"[ERROR] no tenant matches {query!r} (by id, container id, name, pod or PID); "
            "see kiwictl tenants",
            file=sys.stderr,
        )
        return 1
    facts = analyse(status, tenant)
    text = explain_text(facts)
    if as_json:
        print(json.dumps({**facts, "explanation": text}, indent=2, sort_keys=True))
    else:
        print(text)
    return 0
