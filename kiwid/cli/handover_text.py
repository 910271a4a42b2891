"""A GPU's hand-over in words: ``kiwictl explain``'s sentence, ``kiwictl status``'s line."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

_PHASES = {
    "gating the holder": "{before}, the holder before, is being gated (it may still run)",
    "making room": "other tenants' memory is leaving the card to make room for {to}",
    "restoring": "{to}'s memory is coming back from host RAM",
    "letting go": "{to}'s ungate is on its way: it runs once it takes",
}


def handover_sentence(gpu: str, handover: Mapping[str, Any]) -> str:
    """``GPU 0 is being handed over from a to b since 12:01:02 (3.2 s): restoring ...``."""
    to, before = handover.get("to"), handover.get("from")
    since = time.strftime("%H:%M:%S", time.localtime(float(handover.get("since_unix") or 0)))
    seconds = float(handover.get("seconds") or 0.0)
    source = f" from {before}" if before else ""
    text = f"GPU {gpu} is being handed over{source} to {to} since {since} ({seconds:.1f} s)"
    phase = handover.get("phase")
    said = _PHASES.get(str(phase))
    if said is None:
        return f"{text}."
    return f"{text}: {phase}: {said.format(to=to, before=before or 'the holder')}."


def handover_line(handover: Mapping[str, Any] | None) -> list[str]:
    """``  handover a -> b, restoring, 3.2 s`` (none: no line)."""
    if not handover:
        return []
    before = handover.get("from") or "-"
    phase = handover.get("phase") or "granted"
    seconds = float(handover.get("seconds") or 0.0)
    return [f"  handover {before} -> {handover.get('to')}, {phase}, {seconds:.1f} s"]
