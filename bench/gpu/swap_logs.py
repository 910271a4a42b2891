"""bench/gpu/swap.py's inputs: kiwid's log lines and the tenants' progress logs, parsed.

No I/O beyond reading a log file; no kiwid, no GPU. The interval helpers turn a
tenant's progress points into its stalls and running stretches.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from enforcement import merge

GAP_S = 1.0  # an iteration slower than this: the tenant was gated (and swapped)

# --------------------------------------------------------------------- kiwid's lines


@dataclass
class KEvent:
    """One kiwid log line that matters here, time-stamped on arrival (CLOCK_MONOTONIC)."""

    t: float
    kind: str  # grant, preempt, release, queue, gone, swap-out, swap-in, swap-failed
    who: str  # a worker label (w0, w1, ...) or kiwid's own text when it is no worker
    nbytes: int = 0
    seconds: float = 0.0
    gbps: float = 0.0
    line: str = ""


SWAP_RE = re.compile(
    r"Swapped (out|in) (.+?): ([\d,_]+) bytes in ([\d.]+) s(?: \(([\d.]+) GB/s\))?"
)
SWAP_REFUSED_RE = re.compile(r"Swap (?:out|in) of (.+?) not done")
KIND_RES = (
    ("grant", re.compile(r"Grant: (.+?) holds GPU")),
    ("preempt", re.compile(r"Preempt: (.+?) yields GPU")),
    ("release", re.compile(r"Early release: (.+?) yields GPU")),
    ("queue", re.compile(r"Queue: (.+?) waits for GPU")),
    ("gone", re.compile(r"Gone: (.+?) left the GPU")),
)


def who_is(text: str, names: Mapping[str, str]) -> str:
    """The worker label whose cgroup name ``text`` mentions (``names``: cgroup -> label)."""
    for cgroup, label in names.items():
        if re.search(rf"{re.escape(cgroup)}(?!\d)", text):
            return label
    return text


def parse_kiwid(lines: Iterable[tuple[float, str]], names: Mapping[str, str]) -> list[KEvent]:
    events = []
    for t, line in lines:
        match = SWAP_RE.search(line)
        if match:
            nbytes = int(re.sub(r"[,_]", "", match.group(3)))
            seconds = float(match.group(4))
            gbps = float(match.group(5)) if match.group(5) else 0.0
            if seconds > 0:
                gbps = nbytes / seconds / 1e9
            events.append(
                KEvent(
                    t,
                    f"swap-{match.group(1)}",
                    who_is(match.group(2), names),
                    nbytes,
                    seconds,
                    gbps,
                    line,
                )
            )
            continue
        if "Swap failed" in line:
            events.append(KEvent(t, "swap-failed", who_is(line, names), line=line))
            continue
        match = SWAP_REFUSED_RE.search(line)
        if match:
            events.append(KEvent(t, "swap-refused", who_is(match.group(1), names), line=line))
            continue
        for kind, regex in KIND_RES:
            match = regex.search(line)
            if match:
                events.append(KEvent(t, kind, who_is(match.group(1), names), line=line))
                break
    return events


# --------------------------------------------------------------------- tenants' logs


@dataclass
class WorkerLog:
    points: list[tuple[float, int]] = field(default_factory=list)
    verifies: list[tuple[float, float, int, int, bool]] = field(default_factory=list)
    alloc: tuple[float, float, int, int] | None = None  # t0, t1, bytes, OOM retries
    ooms: int = 0
    errors: list[str] = field(default_factory=list)
    # a trainer's (train_worker.py): what it trains, and every step's loss
    model: str | None = None  # e.g. "torch-transformer layers=4 ... cycle=200"
    losses: list[tuple[int, float, str]] = field(default_factory=list)  # step, t, float.hex

    @property
    def cycle(self) -> int | None:
        """Steps after which the trainer starts again from its initial state (its model line)."""
        for word in (self.model or "").split():
            if word.startswith("cycle="):
                with contextlib.suppress(ValueError):
                    return int(word.split("=", 1)[1])
        return None


def parse_worker_log(text: str) -> WorkerLog:
    """A tenant's log (see swap_worker.py and train_worker.py for the lines)."""
    out = WorkerLog()
    for line in text.splitlines():
        parts = line.split()
        try:
            if parts[0] == "p" and len(parts) == 3:
                out.points.append((float(parts[1]), int(parts[2])))
            elif parts[0] == "loss" and len(parts) == 5 and parts[4] == ";":
                float.fromhex(parts[3])  # a loss line ends in ';': one cut short is dropped
                out.losses.append((int(parts[1]), float(parts[2]), parts[3]))
            elif parts[0] == "verify" and len(parts) == 6:
                t0, t1 = float(parts[1]), float(parts[2])
                out.verifies.append((t0, t1, int(parts[3]), int(parts[4]), parts[5] == "1"))
            elif parts[0] == "alloc" and len(parts) == 5:
                out.alloc = (float(parts[1]), float(parts[2]), int(parts[3]), int(parts[4]))
            elif parts[0] == "model" and len(parts) > 1:
                out.model = " ".join(parts[1:])
            elif parts[0] == "oom":
                out.ooms += 1
            elif parts[0] == "error":
                out.errors.append(" ".join(parts[2:]))
        except (IndexError, ValueError):
            continue  # a line cut short by SIGKILL
    return out


def read_worker_log(path: Path) -> WorkerLog:
    try:
        return parse_worker_log(path.read_text(errors="replace"))
    except OSError:
        return WorkerLog()


def stalls_of(
    points: Sequence[tuple[float, int]], end: float | None = None, gap_s: float = GAP_S
) -> list[tuple[float, float | None]]:
    """(last progress before, first progress after) every stretch longer than gap_s.

    A stall still going on at ``end`` (the tenant was waiting when the run stopped)
    ends in None.
    """
    out: list[tuple[float, float | None]] = []
    for (t0, n0), (t1, n1) in itertools.pairwise(points):
        if t1 - t0 > gap_s and n1 - n0 <= 1:
            out.append((t0, t1))
    if points and end is not None and end - points[-1][0] > gap_s:
        out.append((points[-1][0], None))
    return out


def measure(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(b - a for a, b in merge(intervals))


def clip(
    intervals: Iterable[tuple[float, float]], lo: float, hi: float
) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def intersect(
    xs: Sequence[tuple[float, float]], ys: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    out = []
    for a, b in merge(xs):
        out += clip(merge(ys), a, b)
    return out


def running_intervals(
    points: Sequence[tuple[float, int]], stalls: Sequence[tuple[float, float | None]]
) -> list[tuple[float, float]]:
    """When a tenant made progress: its loop minus its stalls."""
    if len(points) < 2:
        return []
    out, cursor = [], points[0][0]
    for s, r in stalls:
        if s > cursor:
            out.append((cursor, s))
        cursor = max(cursor, r if r is not None else math.inf)
    if points[-1][0] > cursor:
        out.append((cursor, points[-1][0]))
    return out
