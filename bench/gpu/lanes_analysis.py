"""bench/gpu/checkpoint_lanes.py's figures: aggregate GB/s of concurrent checkpoints/restores.

Pure: takes each case's timed operations, returns rows and a short table. A case is
a set of driver calls started together (threads behind a barrier): 1, 2 or 3
checkpoints (device -> host), 1, 2 or 3 restores (host -> device), or one of each
(is the link used both ways at once?). Its aggregate rate is the bytes of all its
calls over the case's wall time (first start to last end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

GIB = 2**30


@dataclass
class Op:
    kind: str  # "checkpoint" or "restore"
    pid: int
    nbytes: int
    t0: float  # CLOCK_MONOTONIC around the driver call
    t1: float
    error: str | None = None

    @property
    def gbps(self) -> float | None:
        return self.nbytes / (self.t1 - self.t0) / 1e9 if self.t1 > self.t0 else None


@dataclass
class Case:
    name: str  # e.g. "checkpoint x2", "checkpoint + restore"
    ops: list[Op] = field(default_factory=list)
    skipped: str | None = None  # why it did not run

    @property
    def ok(self) -> bool:
        return self.skipped is None and bool(self.ops) and all(o.error is None for o in self.ops)

    @property
    def wall_s(self) -> float:
        return max(o.t1 for o in self.ops) - min(o.t0 for o in self.ops) if self.ops else 0.0

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.ops)

    @property
    def gbps(self) -> float | None:
        return self.nbytes / self.wall_s / 1e9 if self.ok and self.wall_s > 0 else None


def solo_rate(cases: Sequence[Case], kind: str) -> float | None:
    """The rate of one call of ``kind`` alone (the "x1" case)."""
    for c in cases:
        if c.name == f"{kind} x1" and c.gbps is not None:
            return c.gbps
    return None


def findings(cases: Sequence[Case]) -> list[str]:
    """What the cases say: does concurrency in one direction, or both ways, pay?"""
    out = []
    for kind in ("checkpoint", "restore"):
        one = solo_rate(cases, kind)
        for n in (2, 3):
            c = next((c for c in cases if c.name == f"{kind} x{n}"), None)
            if one and c is not None and c.gbps:
                out.append(
                    f"{n} {kind}s at once: {c.gbps:.2f} GB/s together, {c.gbps / one:.2f}x one "
                    f"alone ({one:.2f} GB/s)"
                )
    duplex = next((c for c in cases if c.name == "checkpoint + restore"), None)
    out_one, in_one = solo_rate(cases, "checkpoint"), solo_rate(cases, "restore")
    if duplex is not None and duplex.ok and out_one and in_one:
        rates = {o.kind: o.gbps or 0.0 for o in duplex.ops}
        serial = duplex.nbytes / (
            sum(o.nbytes / (out_one if o.kind == "checkpoint" else in_one) for o in duplex.ops)
        )
        out.append(
            f"one of each at once: checkpoint {rates.get('checkpoint', 0):.2f} GB/s "
            f"({rates.get('checkpoint', 0) / out_one:.0%} of alone), restore "
            f"{rates.get('restore', 0):.2f} GB/s ({rates.get('restore', 0) / in_one:.0%} of "
            f"alone); {duplex.gbps or 0:.2f} GB/s together against {serial:.2f} one after "
            "the other"
        )
    return out


def table(cases: Sequence[Case], machine: Sequence[str]) -> str:
    head = ("case", "calls", "GiB", "wall s", "GB/s together", "GB/s each")
    rows = []
    for c in cases:
        if c.skipped is not None:
            rows.append((c.name, "-", "-", "-", "-", f"skipped: {c.skipped}"))
            continue
        each = ", ".join(
            f"{o.kind[0]} {o.gbps:.2f}" if o.gbps and o.error is None else f"{o.kind[0]} ERROR"
            for o in c.ops
        )
        rows.append(
            (
                c.name,
                str(len(c.ops)),
                f"{c.nbytes / GIB:.1f}",
                f"{c.wall_s:.2f}",
                "-" if c.gbps is None else f"{c.gbps:.2f}",
                each,
            )
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [
        " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [head, *rows]
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    errors = [
        f"  {c.name}: {o.kind} of {o.pid}: {o.error}" for c in cases for o in c.ops if o.error
    ]
    return "\n".join(
        [
            "== concurrent checkpoints and restores on one GPU (kiwid's CudaLock)",
            *machine,
            *lines,
            *(["errors:", *errors] if errors else []),
            *findings(cases),
            "(c = checkpoint: device -> host RAM; r = restore: host RAM -> device; each call "
            "moves one process's whole device memory; together = all bytes / wall time)",
        ]
    )


def synthetic() -> list[Case]:
    """Made-up timings, like the H200's single-call rates: 2.3 GB/s out, 6.3 GB/s in.

    Two checkpoints at once share 3.6 GB/s, three 4.2; restores do not gain; one of
    each runs each at its own rate.
    """
    nb = 16 * GIB

    def ops(kind: str, rates: Sequence[float], start: float) -> list[Op]:
        return [Op(kind, 100 + k, nb, start, start + nb / (r * 1e9)) for k, r in enumerate(rates)]

    return [
        Case("checkpoint x1", ops("checkpoint", [2.3], 0.0)),
        Case("restore x1", ops("restore", [6.3], 10.0)),
        Case("checkpoint x2", ops("checkpoint", [1.8, 1.8], 20.0)),
        Case("restore x2", ops("restore", [3.15, 3.15], 40.0)),
        Case("checkpoint x3", ops("checkpoint", [1.4, 1.4, 1.4], 50.0)),
        Case("restore x3", ops("restore", [2.1, 2.1, 2.1], 80.0)),
        Case(
            "checkpoint + restore", [*ops("checkpoint", [2.3], 90.0), *ops("restore", [6.3], 90.0)]
        ),
        Case("restore x1 again", skipped="time budget"),
    ]
