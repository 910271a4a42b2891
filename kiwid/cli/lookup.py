"""Finding a tenant in a ``status`` answer by what an operator types.

``kiwictl explain``, ``set-weight`` and ``set-priority`` take a tenant id, a
container id (or a prefix of 4+ characters), a name, a pod (``ns/pod``) or a PID.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["AmbiguousTenant", "TenantNotFound", "collect_tenants", "find_or_say", "find_tenant"]

Json = dict[str, Any]
_MIN_PREFIX = 4  # characters of a container id (or pod UID) that select it


class TenantNotFound(LookupError):
    """No tenant matches the query."""


class AmbiguousTenant(LookupError):
    """Several tenants match the query.

    Attributes:
        candidates: The matching tenants, as `collect_tenants` returns them.
    """

    def __init__(self, query: str, candidates: list[Json]) -> None:
        super().__init__(f"{query!r} matches {len(candidates)} tenants")
        self.candidates = candidates


def collect_tenants(status: Mapping[str, Any]) -> list[Json]:
    """Every tenant in ``status``, once, with its ledger per GPU.

    Args:
        status: The ``status`` result.

    Returns:
        Live tenants in order of appearance, then departed ones (``departed``
        true, ``gone_for_s`` set). Each has ``gpus`` and ``ledgers`` (GPU → ledger).
    """
    found: dict[str, Json] = {}
    for gpu in status.get("gpus") or []:
        for t in gpu.get("tenants") or []:
            entry = found.setdefault(
                str(t["id"]), {**t, "gpus": list(t.get("gpus") or []), "ledgers": {}}
            )
            if t.get("ledger") is not None:
                entry["ledgers"][str(gpu["id"])] = t["ledger"]
            if str(gpu["id"]) not in entry["gpus"]:
                entry["gpus"].append(str(gpu["id"]))
    for d in status.get("departed") or []:
        if str(d["id"]) not in found:
            ledger = d.get("ledger")
            ledgers = {str(g): ledger for g in d.get("gpus") or []} if ledger else {}
            found[str(d["id"])] = {**d, "state": "gone", "departed": True, "ledgers": ledgers}
    return list(found.values())


def _matches(t: Mapping[str, Any], query: str) -> int | None:
    """How well ``t`` matches: 0 its id, 1 another exact field, 2 a prefix; else None."""
    if str(t.get("id")) == query:
        return 0
    pod, ns = t.get("pod"), t.get("namespace")
    exact = {t.get("name"), t.get("container_id"), pod, f"{ns}/{pod}" if ns and pod else None}
    pid = query.isdigit() and (int(query) in (t.get("pids") or []) or t.get("id") == f"pid:{query}")
    if query in exact or pid:
        return 1
    if len(query) >= _MIN_PREFIX:
        prefixed = [t.get("container_id"), pod]
        _, colon, rest = query.partition(":")
        if colon and len(rest) >= _MIN_PREFIX:
            prefixed.append(t.get("id"))
        if any(isinstance(v, str) and v.startswith(query) for v in prefixed):
            return 2
    return None


def find_tenant(status: Mapping[str, Any], query: str) -> Json:
    """Find one tenant by id, container id (or a prefix of 4+), name, pod or PID.

    The best kind of match wins (the id, then an exact field or PID, then a
    prefix); live tenants beat departed ones.

    Args:
        status: The ``status`` result.
        query: What the user typed.

    Returns:
        The tenant, as `collect_tenants` gives it.

    Raises:
        TenantNotFound: Nothing matches.
        AmbiguousTenant: Several tenants match equally well.
    """
    query = query.strip()
    tiers: dict[int, list[Json]] = {}
    for t in collect_tenants(status):
        rank = _matches(t, query)
        if rank is not None:
            tiers.setdefault(rank, []).append(t)
    if not tiers:
        raise TenantNotFound(query)
    best = tiers[min(tiers)]
    live = [t for t in best if not t.get("departed")]
    best = live or best
    if len(best) > 1:
        raise AmbiguousTenant(query, best)
    return best[0]


def find_or_say(status: Mapping[str, Any], query: str) -> Json | None:
    """The tenant ``query`` names, or ``None`` once an ``[ERROR]`` line said why not.

    For the commands that act on one tenant (retry, release, wake, set-weight,
    set-priority): they exit 1 on ``None``.
    """
    try:
        return find_tenant(status, query)
    except AmbiguousTenant as exc:
        print(f"[ERROR] {exc}; say which (see kiwictl tenants)", file=sys.stderr)
    except TenantNotFound:
        print(
            f"[ERROR] no tenant matches {query!r} (by id, container id, name, pod or PID); "
            "see kiwictl tenants",
            file=sys.stderr,
        )
    return None
