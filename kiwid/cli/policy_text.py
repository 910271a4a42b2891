"""What ``kiwictl explain`` says of weights, priorities and preemptions.

Everything comes from one ``status`` answer: each tenant's ``policy`` (weight,
priority, own TQ, swap, and where each came from), its ``quantum_s``, its shares
and its ``last_preemption``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiwid.cli.words import format_duration

_SOURCE = {
    "default": "default",
    "annotation": "from its pod's annotation",
    "runtime": "set with kiwictl",
}


def _source(policy: Mapping[str, Any], key: str) -> str:
    source = str((policy.get("sources") or {}).get(key, "default"))
    text = _SOURCE.get(source, source)
    if source.startswith("rule"):
        text = f"from {source} of /etc/kiwi.toml"
    if key in (policy.get("capped") or []):
        text += ", capped by its rule"
    return text


def rank_label(tenant: Mapping[str, Any] | None) -> str:
    """``priority 2 tenant X`` (the id alone at priority 0)."""
    if tenant is None:
        return "?"
    priority = (tenant.get("policy") or {}).get("priority", 0)
    return f"priority {priority} tenant {tenant.get('id')}" if priority else str(tenant.get("id"))


def policy_sentence(tenant: Mapping[str, Any], tq: float | None) -> str:
    """Its quantum, weight and priority, where they came from, and its shares.

    E.g. ``Its quantum is 60 s = TQ 30 x weight 2 (from rule 0 of /etc/kiwi.toml);
    priority 10 (from its pod's annotation, capped by its rule).``
    """
    policy = tenant.get("policy")
    if not policy:
        return ""
    weight, priority = policy.get("weight", 1.0), policy.get("priority", 0)
    own_tq = policy.get("tq")
    base = own_tq if own_tq is not None else tq
    quantum = tenant.get("quantum_s")
    if quantum is not None and base is not None and abs(quantum - base * weight) > 1e-6:
        left = format_duration(quantum)
        size = f"Its quantum is the {left} left of one that a higher priority cut short"
    elif base is not None:
        which = "its own TQ" if own_tq is not None else "TQ"
        size = (
            f"Its quantum is {format_duration(base * weight)} = {which} {base:g} x weight "
            f"{weight:g} ({_source(policy, 'weight')})"
        )
    else:
        size = f"Its weight is {weight:g} ({_source(policy, 'weight')})"
    text = f"{size}; priority {priority} ({_source(policy, 'priority')})"
    if policy.get("swap") == "never":
        text += "; its memory is never swapped out"
    share = tenant.get("share") or {}
    if share.get("entitled") is not None and share.get("received") is not None:
        text += (
            f". Since kiwid started it was entitled to {share['entitled']:.0%} of the GPU's time "
            f"and received {share['received']:.0%}"
        )
    if tenant.get("boosted"):
        text += ". It waited scheduler.max_wait behind higher priorities: it gets one quantum next"
    return text + "."


def preemption_sentence(tenant: Mapping[str, Any]) -> str:
    """When it was last preempted, and why (e.g. for a priority 10 tenant)."""
    last = tenant.get("last_preemption")
    if not last:
        return ""
    ago = format_duration(last.get("ago_s"))
    if last.get("reason") == "priority":
        by = f" for {last['by']}" if last.get("by") else ""
        return (
            f"It was preempted {ago} ago{by}, a tenant of a higher priority: suspended, not "
            "killed, it waits at the front of its class with the rest of its quantum."
        )
    return f"Its last quantum ended {ago} ago, when someone waited."
