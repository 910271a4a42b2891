"""The figures of bench/idle_fleet.py from what a run recorded: pure functions, no I/O.

A run records kiwid's status every ~0.2 s (:class:`Sample`), kiwid's log lines with
the time the bench read them, and each HTTP request the bench's client sent
(:class:`Request`). From these: restores per tenant (kiwid's ``Swapped in`` lines),
bytes moved, the trainer's share of the GPU outside the time requests need it,
latency percentiles, and the bound a parked server's first request should meet.

Not a benchmark itself.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

GB = 1e9
_SWAPPED = re.compile(r"Swapped (in|out) (.+?): (\d+) bytes in ([0-9.]+) s")


@dataclass(frozen=True)
class Swap:
    """One ``Swapped in|out`` line of kiwid's log."""

    direction: str
    tenant: str
    """kiwid's tenant key (``cgroup:/...``), as the line names it."""
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class Sample:
    """kiwid's status at one moment (monotonic seconds of the bench)."""

    t: float
    holder: str | None
    trainer_runs: bool
    """The trainer holds the GPU and is let go (not gated)."""
    states: dict[str, str]
    """Each tenant's state by key."""
    resident_bytes: int
    """Memory on the card, as kiwid's scheduler counts it."""


@dataclass(frozen=True)
class Request:
    """One request of the bench's client."""

    sent: float
    latency: float | None
    """Seconds until the whole answer was read; ``None``: it failed."""
    state: str | None
    """The server's state in the last sample before it was sent."""
    resident_bytes: int = 0
    """Memory on the card in that sample."""
    error: str = ""


def parse_swap(line: str) -> Swap | None:
    """The swap a log line reports (``None``: the line is no ``Swapped`` line).

    kiwid names a tenant ``name (key)``, or by its key alone.
    """
    found = _SWAPPED.search(line)
    if found is None:
        return None
    who = found.group(2)
    if who.endswith(")") and " (" in who:
        who = who[who.rindex(" (") + 2 : -1]
    return Swap(found.group(1), who, int(found.group(3)), float(found.group(4)))


def swaps(lines: Iterable[tuple[float, str]], start: float, end: float) -> list[tuple[float, Swap]]:
    """The swaps of the lines read from ``start`` to ``end``, with the time each was read."""
    out = []
    for t, line in lines:
        swap = parse_swap(line)
        if swap is not None and start <= t <= end:
            out.append((t, swap))
    return out


def restores(found: list[tuple[float, Swap]], tenant: str, after: float | None = None) -> int:
    """How many times ``tenant``'s memory came back (after ``after``, when given)."""
    return sum(
        1
        for t, s in found
        if s.direction == "in" and s.tenant == tenant and (after is None or t > after)
    )


def moved(found: list[tuple[float, Swap]], direction: str) -> int:
    """Bytes moved ``direction`` (``"in"`` or ``"out"``), all tenants together."""
    return sum(s.nbytes for _, s in found if s.direction == direction)


def first_in_state(samples: list[Sample], tenant: str, state: str) -> float | None:
    """When ``tenant`` was first seen in ``state`` (``None``: never)."""
    return next((s.t for s in samples if s.states.get(tenant) == state), None)


def state_at(samples: list[Sample], t: float) -> Sample | None:
    """The last sample taken at or before ``t``."""
    last = None
    for s in samples:
        if s.t > t:
            break
        last = s
    return last


def busy_windows(requests: list[Request], tail: float) -> list[tuple[float, float]]:
    """Each request's time on the GPU: from sent to answered, plus ``tail`` seconds.

    A failed request counts until the end of the run (``math.inf``).
    """
    return [
        (r.sent, math.inf if r.latency is None else r.sent + r.latency + tail) for r in requests
    ]


def trainer_share(
    samples: list[Sample], start: float, end: float, excluded: list[tuple[float, float]]
) -> tuple[float, float]:
    """The trainer's share of the time from ``start`` to ``end`` outside ``excluded``.

    Each sample stands for the time until the next one. Returns (share, seconds
    counted); the share is 0 when no time counted.
    """
    ran = counted = 0.0
    inside = [s for s in samples if start <= s.t <= end]
    for here, following in zip(inside, [*inside[1:], None], strict=True):
        until = end if following is None else following.t
        span = _outside(here.t, until, excluded)
        counted += span
        if here.trainer_runs:
            ran += span
    return (ran / counted if counted > 0 else 0.0), counted


def _outside(a: float, b: float, excluded: list[tuple[float, float]]) -> float:
    """The length of ``[a, b]`` that no window of ``excluded`` covers."""
    if b <= a:
        return 0.0
    cuts = sorted((max(a, lo), min(b, hi)) for lo, hi in excluded if hi > a and lo < b)
    covered, reach = 0.0, a
    for low, hi in cuts:
        lo = max(low, reach)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return (b - a) - covered


def percentiles(samples: list[float], qs: tuple[float, ...]) -> list[float]:
    """Nearest-rank percentiles of ``samples`` (NaN each when there are none)."""
    if not samples:
        return [math.nan for _ in qs]
    ordered = sorted(samples)
    n = len(ordered)
    return [ordered[min(n - 1, max(0, math.ceil(q / 100 * n) - 1))] for q in qs]


def room_bytes(resident: int, size: int, reserve: int, card: int, unit: int) -> int:
    """Bytes that must leave the card before ``size`` more fit beside ``resident`` and the reserve.

    Tenants leave whole: the shortfall is rounded up to whole ``unit`` (a server).
    """
    short = resident + size + reserve - card
    return 0 if short <= 0 else math.ceil(short / unit) * unit


def restore_bound(
    *,
    poll: float,
    gate: float,
    size: int,
    room: int,
    in_rate: float,
    out_rate: float,
    slack: float = 1.0,
) -> float:
    """One poll + the holder's gate + the restore of ``size`` + the room it needs + ``slack``.

    Rates in bytes per second.
    """
    return poll + gate + size / in_rate + room / out_rate + slack


def verdict(ok: bool | None) -> str:
    """PASS, FAIL, or n/a where nothing was measured."""
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def fmt_s(value: float | None, digits: int = 2) -> str:
    """Seconds for the table; ``-`` for none."""
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.{digits}f}"
