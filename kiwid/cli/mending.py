"""``kiwictl retry TENANT`` and ``kiwictl release TENANT``: an operator's word on a stuck tenant.

The tenant is found in the status as ``explain`` and ``set-weight`` find it; kiwid
answers once it has carried the request out, and this prints what happened in
one or two plain lines.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiwid.adapters.control import request
from kiwid.cli.fault_text import fault_clause
from kiwid.cli.lookup import find_or_say

__all__ = ["HELP", "run"]

HELP = {
    "retry": (
        "try a stuck tenant again: kiwid finds where its memory is and gates it whole; "
        "then it waits for its turn. A released tenant goes back into the rotation"
    ),
    "release": (
        "let a stuck tenant run ungated, on your word: kiwid restores, unlocks and thaws "
        "what it can; it then runs outside the rotation until it leaves or you retry it"
    ),
}
EXIT_OK = 0
EXIT_INVALID = 1
_WHERE = {
    "host": "in host RAM",
    "resident": "on the card",
    "prefetched": "on the card",
    "swapping-out": "on its way to host RAM",
    "swapping-in": "on its way back to the card",
    "prefetching": "on its way back to the card",
    "unknown": "where the driver cannot say",
}
ANSWER_MARGIN_S = 10.0
"""Beyond kiwid's own bound on its answer (2 x gpu.driver_timeout + 5 s), how long to wait."""


def run(socket: str | Path, command: str, query: str) -> int:
    """Find the tenant, ask kiwid to ``retry`` or ``release`` it, say what happened.

    Returns:
        0 done (mended, back in the rotation, released), 1 not found, ambiguous,
        still stuck, still under way when kiwid answered, or waiting behind a driver
        call of the tenant that has not returned.

    Raises:
        DaemonUnreachable: kiwid does not answer (kiwictl exits 3).
        ControlError: kiwid refused the request (e.g. the tenant is not stuck).
    """
    status = request(socket, "status")
    tenant = find_or_say(status, query)
    if tenant is None:
        return EXIT_INVALID
    bound = 2 * float(status.get("driver_timeout_s") or 10.0) + ANSWER_MARGIN_S
    result = request(socket, command, {"tenant": str(tenant["id"])}, timeout_s=bound)
    ok, lines = outcome(command, result)
    for line in lines:
        print(line, file=sys.stdout if ok else sys.stderr)
    return EXIT_OK if ok else EXIT_INVALID


def _contained(result: Mapping[str, Any]) -> bool:
    reason = result.get("stuck_reason") or {}
    return bool(reason.get("contained"))


def outcome(command: str, result: Mapping[str, Any]) -> tuple[bool, list[str]]:
    """Whether it worked, and what to print (one or two lines)."""
    tid, state = result.get("tenant"), result.get("state")
    behind = result.get("queued_behind")
    if behind:
        since = time.strftime("%H:%M:%S", time.localtime(float(behind.get("since_unix") or 0)))
        return False, [
            f"[WARNING] {tid}: the {command} waits behind its {behind.get('job')}, whose driver "
            f"call has not returned since {since} ({float(behind.get('seconds') or 0):.0f} s); "
            "it runs as soon as that call returns.",
            f"[WARNING] Meanwhile {tid} stays stuck, "
            + (
                "held (locked, or fenced with the freezer)"
                if _contained(result)
                else "and may run: nobody else is let go on its GPUs"
            )
            + "; kiwictl status shows how it ends.",
        ]
    if result.get("pending"):
        return False, [
            f"[WARNING] {tid}: the {command} is still under way after "
            f"{float(result.get('seconds') or 0):.0f} s; kiwictl status shows how it ends."
        ]
    if state == "gone":
        return False, [f"[ERROR] {tid} left meanwhile."]
    if state == "stuck":
        reason = result.get("stuck_reason") or {}
        other = "release" if command == "retry" else "retry"
        return False, [
            f"[ERROR] {tid} is still stuck: {fault_clause(reason)}.",
            f"[ERROR] `kiwictl explain {tid}` says more; `kiwictl {other} {tid}` is the other way.",
        ]
    if state == "released":
        note = result.get("released")
        said = f" ({note})" if note else ""
        return True, [
            f"[INFO] {tid}: released{said}; it runs ungated, outside the rotation, until it "
            f"leaves or `kiwictl retry {tid}`."
        ]
    if state == "idle":
        return True, [f"[INFO] {tid}: back in the rotation; it queues at its next GPU work."]
    residency = str(result.get("residency"))
    memory = "its memory " + _WHERE.get(residency, residency)
    if state == "waiting":
        return True, [f"[INFO] {tid}: mended; it waits for its turn, {memory}."]
    return True, [f"[INFO] {tid}: mended; it is {state} now, {memory}."]
