"""One record of the state file: how to ungate one tenant, whatever happened to kiwid.

Each record names what kiwid gated and how to tell it is still the same thing:
the cgroup directories' inode numbers (a cgroup removed and made again under the
same path is another cgroup) and each process's start time (a PID reused since is
another process). Recovery acts only on what matches.

Besides the gate: whether its memory is (or may be) in host RAM (``swapped``,
written ahead of every swap-out from the scheduler's own sizes and kept until the
memory is back), whether its cgroup was frozen as a fence because its CUDA lock
could not be trusted (``fenced``), and why it is stuck (``fault``), so that a
restarted kiwid keeps it stuck until an operator clears it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

METHODS = ("freeze", "cuda-lock", "none")
SWAP_METHODS = ("checkpoint", "sim")


@dataclass(frozen=True)
class RecordedFault:
    """Why a tenant is stuck, as the state file keeps it."""

    operation: str
    reason: str
    at_unix: float
    pid: int | None = None
    answer: str | None = None


@dataclass(frozen=True)
class GatedRecord:
    """How to ungate one tenant, whatever happened to kiwid."""

    tenant: str
    method: str
    """``freeze``, ``cuda-lock`` or ``none``."""
    cgroup_v2: str | None
    cgroup_v1_freezer: str | None
    pids: tuple[int, ...]
    swapped: dict[str, int] | None = None
    """Its GPU memory is (being) swapped to host RAM: bytes per GPU. Recovery
    brings it back (when it fits) before letting the tenant go."""
    swap_method: str | None = None
    """How it was swapped: ``checkpoint`` (the driver) or ``sim``."""
    cgroup_ids: tuple[int | None, int | None] = (None, None)
    """Inode numbers of the v2 and v1 freezer cgroup directories it froze."""
    starts: tuple[int, ...] = ()
    """Start time (clock ticks since boot) of each of ``pids``, in the same order."""
    fenced: bool = False
    """Its cgroup (``cgroup_v2``/``cgroup_v1_freezer``, with ``cgroup_ids``) was frozen
    too, because its CUDA lock could not be trusted: thaw it when letting it go."""
    fault: RecordedFault | None = None
    """Why it is stuck (``None``: it is not)."""
    version: int = 0
    """Bumped by every write of it (:class:`~kiwid.daemon.gating.state.StateFile`): a
    writer that read version N writes (or drops) it only if it is still N."""

    def pid_starts(self) -> dict[int, int | None]:
        """Each pid with its recorded start time (``None`` if not recorded)."""
        return {
            pid: self.starts[i] if i < len(self.starts) else None for i, pid in enumerate(self.pids)
        }

    def regated(self, fresh: GatedRecord) -> GatedRecord:
        """This record, gated again as ``fresh`` says, keeping what it knew.

        Where its memory is, its fence and why it is stuck outlive a new gate (a
        stuck tenant gated again, a late gate): a gate that overwrote them would
        strand memory in host RAM, or a frozen fence.
        """
        kept = self if self.fenced else fresh  # a fence names its own cgroup
        merged = fresh.with_pids({p: s or 0 for p, s in self.pid_starts().items()})
        return replace(
            merged,
            cgroup_v2=kept.cgroup_v2,
            cgroup_v1_freezer=kept.cgroup_v1_freezer,
            cgroup_ids=kept.cgroup_ids,
            swapped=self.swapped,
            swap_method=self.swap_method,
            fenced=self.fenced,
            fault=self.fault,
        )

    def only(self, pids: tuple[int, ...]) -> GatedRecord:
        """The record narrowed to those of its ``pids`` (a swap of some processes)."""
        starts = self.pid_starts()
        kept = tuple(p for p in self.pids if p in pids)
        return replace(self, pids=kept, starts=tuple(starts[p] or 0 for p in kept))

    def with_pids(self, pids: dict[int, int]) -> GatedRecord:
        """The record with ``pids`` (pid -> start time) added to its own."""
        merged = {**{p: s or 0 for p, s in self.pid_starts().items()}, **pids}
        order = sorted(merged)
        return replace(self, pids=tuple(order), starts=tuple(merged[p] for p in order))


class BadRecord(ValueError):
    """One record of the state file is not of the documented shape."""


def _path(raw: Any, key: str) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise BadRecord(f"{key} must be a cgroup path or null, not {type(raw).__name__}")
    if not raw.startswith("/") or "\0" in raw or any(part == ".." for part in raw.split("/")):
        raise BadRecord(f"{key} {raw!r} is not an absolute cgroup path")
    return raw


def _int(raw: Any, what: str, *, low: int = 0) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < low:
        raise BadRecord(f"{what} must be an integer >= {low}, not {raw!r}")
    return raw


def parse_record(key: Any, raw: Any) -> GatedRecord:
    """Check one record of the file; name what is wrong.

    Raises:
        BadRecord: the record is not of the documented shape.
    """
    if not isinstance(key, str) or not key or not key.isprintable():
        raise BadRecord("the tenant key is not a printable string")
    if not isinstance(raw, dict):
        raise BadRecord("the record is not an object")
    method = raw.get("method")
    if method not in METHODS:
        raise BadRecord(f"unknown gate method {method!r}")
    v2 = _path(raw.get("cgroup_v2"), "cgroup_v2")
    v1 = _path(raw.get("cgroup_v1_freezer"), "cgroup_v1_freezer")
    ids = raw.get("cgroup_ids", [None, None])
    if not isinstance(ids, list) or len(ids) != 2:
        raise BadRecord("cgroup_ids must be a list of two inode numbers (or nulls)")
    cgroup_ids = tuple(None if i is None else _int(i, "a cgroup id", low=1) for i in ids)
    pids_raw = raw.get("pids", [])
    if not isinstance(pids_raw, list):
        raise BadRecord("pids must be a list of [pid, start time] pairs")
    pids: list[int] = []
    starts: list[int] = []
    for item in pids_raw:
        if not isinstance(item, list) or len(item) != 2:
            raise BadRecord("pids must be a list of [pid, start time] pairs")
        pids.append(_int(item[0], "a pid", low=1))
        starts.append(_int(item[1], "a start time"))
    swapped_raw = raw.get("swapped")
    swapped: dict[str, int] | None = None
    if swapped_raw is not None:
        if not isinstance(swapped_raw, dict):
            raise BadRecord("swapped must be an object of bytes per GPU")
        swapped = {str(g): _int(n, "swapped bytes") for g, n in swapped_raw.items()}
    swap_method = raw.get("swap_method")
    if swap_method not in (None, *SWAP_METHODS):
        raise BadRecord(f"unknown swap method {swap_method!r}")
    if method == "freeze" and all(p is None or p.rstrip("/") == "" for p in (v2, v1)):
        raise BadRecord(
            "a frozen tenant's record names no cgroup but the root, which kiwid never gates"
        )
    fenced = raw.get("fenced", False)
    if not isinstance(fenced, bool):
        raise BadRecord(f"fenced must be true or false, not {fenced!r}")
    if fenced and all(p is None or p.rstrip("/") == "" for p in (v2, v1)):
        raise BadRecord("a fenced tenant's record names no cgroup but the root")
    return GatedRecord(
        tenant=key,
        method=method,
        cgroup_v2=v2,
        cgroup_v1_freezer=v1,
        pids=tuple(pids),
        swapped=swapped,
        swap_method=swap_method,
        cgroup_ids=(cgroup_ids[0], cgroup_ids[1]),
        starts=tuple(starts),
        fenced=fenced,
        fault=_fault(raw.get("fault")),
        version=_int(raw.get("version", 0), "version"),
    )


def _fault(raw: Any) -> RecordedFault | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRecord("fault must be an object or null")
    operation, reason, at = raw.get("operation"), raw.get("reason"), raw.get("at_unix")
    pid, answer = raw.get("pid"), raw.get("answer")
    if not isinstance(operation, str) or not isinstance(reason, str):
        raise BadRecord("a fault needs an operation and a reason (strings)")
    if isinstance(at, bool) or not isinstance(at, int | float):
        raise BadRecord("a fault needs at_unix (a number)")
    if pid is not None:
        pid = _int(pid, "a fault's pid", low=1)
    if answer is not None and not isinstance(answer, str):
        raise BadRecord("a fault's answer must be a string or null")
    return RecordedFault(operation, reason, float(at), pid, answer)


def record_json(rec: GatedRecord) -> dict[str, Any]:
    """A record as the state file keeps it (what :func:`parse_record` reads back)."""
    return {
        "method": rec.method,
        "cgroup_v2": rec.cgroup_v2,
        "cgroup_v1_freezer": rec.cgroup_v1_freezer,
        "cgroup_ids": list(rec.cgroup_ids),
        "pids": [[pid, start or 0] for pid, start in rec.pid_starts().items()],
        "swapped": rec.swapped,
        "swap_method": rec.swap_method,
        "fenced": rec.fenced,
        "version": rec.version,
        "fault": None
        if rec.fault is None
        else {
            "operation": rec.fault.operation,
            "reason": rec.fault.reason,
            "at_unix": round(rec.fault.at_unix, 3),
            "pid": rec.fault.pid,
            "answer": rec.fault.answer,
        },
    }
