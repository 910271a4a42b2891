"""The OCI container state that the runtime writes to kiwi-hook's stdin, parsed and checked.

See the runtime spec's "State"; `parse_state` takes the fields kiwi-hook uses
(``id``, ``pid``, ``bundle``, ``annotations``) and refuses a state whose fields
have the wrong types with `MalformedState`.
"""

from __future__ import annotations

import json
from typing import Any


class MalformedState(ValueError):
    """The OCI state on stdin is not what the runtime spec describes."""


def parse_state(raw: bytes) -> dict[str, Any]:
    """Parse and check an OCI container state.

    Args:
        raw: The bytes read from stdin.

    Returns:
        The state: ``id`` a non-empty string, ``pid`` an int or absent,
        ``bundle`` a string or absent, ``annotations`` a string map (``{}`` if absent).

    Raises:
        MalformedState: Not UTF-8 JSON, not an object, or a field of the wrong type.
    """
    try:
        state = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedState(f"the OCI state on stdin is not JSON: {exc}") from None
    if not isinstance(state, dict):
        raise MalformedState("the OCI state on stdin is not a JSON object")
    cid = state.get("id")
    if not isinstance(cid, str) or not cid:
        raise MalformedState("the OCI state on stdin has no container 'id'")
    pid = state.get("pid")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid < 0):
        raise MalformedState(f"the OCI state's 'pid' is not a process id: {pid!r}")
    bundle = state.get("bundle")
    if bundle is not None and not isinstance(bundle, str):
        raise MalformedState("the OCI state's 'bundle' is not a path")
    annotations = state.get("annotations") or {}
    if not isinstance(annotations, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()
    ):
        raise MalformedState("the OCI state's 'annotations' is not a map of strings")
    return {**state, "pid": pid or None, "annotations": annotations}
