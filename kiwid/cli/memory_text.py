"""What ``kiwictl explain`` says of a tenant's GPU memory: declared, used, remembered.

Everything comes from its entry in one ``status`` answer: ``declared_bytes`` and
``declared_source``, ``peak_bytes``, ``remembered_bytes`` and ``workload``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiwid.core.quantity import shown_bytes

_SOURCE = {
    "annotation": "its pod's annotation kiwi.io/gpu-memory",
    "register": "its registration",
}


def _source(tenant: Mapping[str, Any]) -> str:
    source = str(tenant.get("declared_source") or "register")
    return _SOURCE.get(
        source, f"{source} of /etc/kiwi.toml" if source.startswith("rule") else source
    )


def declared_sentence(tenant: Mapping[str, Any]) -> str:
    """What it declared, and whether it uses more (``""`` when it declared nothing).

    E.g. ``It declared 40 GiB, uses 52 GiB: more than it declared (its pod's
    annotation kiwi.io/gpu-memory), so it is sized by what it uses.``
    """
    declared, peak = tenant.get("declared_bytes"), tenant.get("peak_bytes")
    if not isinstance(declared, int):
        return ""
    if isinstance(peak, int) and peak > declared:
        return (
            f"It declared {shown_bytes(declared)}, uses {shown_bytes(peak)}: more than it "
            f"declared ({_source(tenant)}), so it is sized by what it uses; memory it takes "
            "beyond what is free beside the others may fail to allocate."
        )
    uses = f", and uses {shown_bytes(peak)} at most so far" if isinstance(peak, int) else ""
    return (
        f"It declared {shown_bytes(declared)} of GPU memory per GPU ({_source(tenant)}){uses}: "
        "its turns make room for that much, not for the whole card."
    )


def remembered_sentence(tenant: Mapping[str, Any]) -> str:
    """That its workload ran here before and sizes it (``""`` when none did)."""
    remembered = tenant.get("remembered_bytes")
    if not remembered:
        return ""
    return (
        f"Its workload ran here before ({tenant.get('workload')}): it is sized from that "
        f"run's {remembered / 2**30:.1f} GiB, not given the whole card as a newcomer."
    )
