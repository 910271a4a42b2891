"""bench/gpu/swap.py's analysis: hand-overs, useful GPU time and integrity from parsed logs.

Pure: takes the tenants' logs and kiwid's events, returns an :class:`Analysis`.

Three views of the same rotation:

* the whole window (from the rotation's start to its end, first turns included);
* the **steady rotation**: from the first grant after every tenant has held the GPU
  once, to the end of the window (every tenant then known to kiwid, no allocation);
* each tenant's **first turn**: its first ``Grant:`` line to its first iteration
  after it, labelled *newcomer* (kiwid had never seen the workload) or *known* (an
  earlier run that shared kiwid's ``state_dir`` ran it).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from swap_logs import (
    KEvent,
    WorkerLog,
    clip,
    intersect,
    measure,
    running_intervals,
    stalls_of,
)
from swap_losses import LossCheck, compare_losses

PINNED_GBPS = 55.0  # pinned host<->device copies measured on the H200 (the hand-over floor)
GRANT_SLACK_S = 0.5  # a stall that starts this soon after a grant still holds it up


@dataclass
class Handover:
    at_s: float  # kiwid's Grant line, seconds after the rotation started
    to: str
    frm: str | None
    out_bytes: int | None = None
    out_s: float | None = None
    in_bytes: int | None = None
    in_s: float | None = None
    stop: float | None = None  # the previous tenant's last iteration (its clock)
    resume: float | None = None  # the next tenant's first iteration after that
    kind: str = "steady"  # first turn: "newcomer" or "known"; then "warm-up", "steady"

    @property
    def gap_s(self) -> float | None:
        if self.stop is None or self.resume is None:
            return None
        return self.resume - self.stop

    @property
    def floor_s(self) -> float | None:
        moved = (self.out_bytes or 0) + (self.in_bytes or 0)
        return moved / (PINNED_GBPS * 1e9) if moved else None


@dataclass
class FirstTurn:
    label: str
    known: bool  # an earlier run sharing kiwid's state_dir ran this workload
    at_s: float  # its first Grant line, seconds after the rotation started
    after: str | None  # who held before it (None: it held first, nothing to move)
    stall_s: float | None  # grant -> its first iteration after it (0: it ran at its grant)
    still_waiting: bool = False  # no iteration before the end: stall_s is a lower bound

    @property
    def label_kind(self) -> str:
        return "known" if self.known else "newcomer"


@dataclass
class Steady:
    start: float | None  # the first grant after every tenant had held once (absolute)
    why_not: str = ""  # when there is none
    window_s: float = 0.0
    useful_s: float = 0.0
    gaps: list[float] = field(default_factory=list)  # its hand-overs, s

    @property
    def share(self) -> float | None:
        return self.useful_s / self.window_s if self.window_s > 0 else None

    @property
    def p50_s(self) -> float | None:
        return statistics.median(self.gaps) if self.gaps else None


@dataclass
class TenantResult:
    label: str
    allocated_bytes: int | None
    turns: int
    useful_s: float
    share: float
    iterations: int
    its_running: float | None
    checks: int
    bad_checks: int
    bad_bytes: int
    swap_ins: int
    swap_ins_checked: int
    verdict: str
    errors: list[str]


@dataclass
class Analysis:
    window: tuple[float, float]
    handovers: list[Handover]
    other_swaps: list[KEvent]
    failed_swaps: list[KEvent]
    tenants: list[TenantResult]
    integrity: str
    integrity_ok: bool
    notes: list[str] = field(default_factory=list)
    first_turns: list[FirstTurn] = field(default_factory=list)
    steady: Steady = field(default_factory=lambda: Steady(None, "not analysed"))
    losses: LossCheck | None = None

    @property
    def useful_share(self) -> float:
        """Useful GPU time of all tenants over the whole window."""
        return sum(t.share for t in self.tenants)

    @property
    def bad_bytes(self) -> int:
        return sum(t.bad_bytes for t in self.tenants)

    @property
    def known_first_turns(self) -> list[FirstTurn]:
        """Known workloads' first turns that had to take the GPU from someone."""
        return [f for f in self.first_turns if f.known and f.after is not None]


def _nearest(
    events: list[KEvent],
    used: set[int],
    pick: Callable[[KEvent], bool],
    lo: float,
    hi: float,
    at: float,
) -> KEvent | None:
    found = [
        (abs(e.t - at), k)
        for k, e in enumerate(events)
        if k not in used and lo < e.t < hi and pick(e)
    ]
    if not found:
        return None
    k = min(found)[1]
    used.add(k)
    return events[k]


def steady_start(grants: Sequence[KEvent], tenants: Sequence[str]) -> tuple[float | None, str]:
    """The first grant after every tenant has held once; or None and why not."""
    held: set[str] = set()
    for g in grants:
        if held >= set(tenants):
            return g.t, ""
        held.add(g.who)
    never = [t for t in tenants if t not in held]
    if never:
        return None, f"{', '.join(never)} never held the GPU"
    return None, "no grant after every tenant had held once"


def first_turn_stall(
    points: Sequence[tuple[float, int]],
    stalls: Sequence[tuple[float, float | None]],
    grant: float,
    end: float,
) -> tuple[float | None, bool]:
    """(grant -> first iteration after it, still waiting at the end) for one tenant.

    0 when it was running at its grant (the first holder, or kiwid granted a tenant
    it had not gated yet).
    """
    for s, r in stalls:
        if s <= grant + GRANT_SLACK_S and (r is None or r > grant):
            return (end - grant, True) if r is None else (max(0.0, r - grant), False)
    after = [t for t, n in points if t > grant and n > 0]
    if points and points[0][0] <= grant and after:
        return 0.0, False  # running at its grant
    if after:  # its loop started after the grant
        return after[0] - grant, False
    return end - grant, True


def _handovers(
    logs: Mapping[str, WorkerLog],
    grants: Sequence[KEvent],
    swaps: list[KEvent],
    stalls: Mapping[str, list[tuple[float, float | None]]],
    lo: float,
    used: set[int],
) -> list[Handover]:
    resumes = {
        label: sorted(
            ([w.points[0][0]] if w.points else []) + [r for _, r in stalls[label] if r is not None]
        )
        for label, w in logs.items()
    }
    rows = []
    for i, g in enumerate(grants):
        prev = grants[i - 1] if i else None
        lo_t = prev.t if prev else -math.inf
        hi_t = grants[i + 1].t if i + 1 < len(grants) else math.inf
        frm = prev.who if prev is not None and prev.who != g.who else None
        row = Handover(at_s=g.t - lo, to=g.who, frm=frm)
        sw_in = _nearest(
            swaps, used, lambda e, w=g.who: e.kind == "swap-in" and e.who == w, lo_t, hi_t, g.t
        )
        if sw_in is not None:
            row.in_bytes, row.in_s = sw_in.nbytes, sw_in.seconds
        if frm is not None:
            sw_out = _nearest(
                swaps, used, lambda e, w=frm: e.kind == "swap-out" and e.who == w, lo_t, hi_t, g.t
            )
            if sw_out is not None:
                row.out_bytes, row.out_s = sw_out.nbytes, sw_out.seconds
            starts = [s for s, _ in stalls.get(frm, []) if lo_t - 1 < s < hi_t]
            if starts:
                row.stop = min(starts, key=lambda s, at=g.t: abs(s - at))
        after = row.stop if row.stop is not None else lo_t
        later = [r for r in resumes.get(g.who, []) if after < r < hi_t + 1]
        if later:
            row.resume = later[0]
        rows.append(row)
    return rows


def _tenant(
    label: str,
    w: WorkerLog,
    grants: Sequence[KEvent],
    swaps: Sequence[KEvent],
    stalls: Sequence[tuple[float, float | None]],
    lo: float,
    hi: float,
) -> TenantResult:
    useful = useful_s(w, stalls, lo, hi)
    iters = w.points[-1][1] - w.points[0][1] if len(w.points) > 1 else 0
    bad = [v for v in w.verifies if v[2] != 0 or not v[4]]
    ins = [e for e in swaps if e.kind == "swap-in" and e.who == label]
    outs = [e.t for e in swaps if e.kind == "swap-out" and e.who == label]
    checked = 0
    for e in ins:
        until = min([t for t in outs if t > e.t] or [math.inf])
        if any(e.t - 2.0 <= v[0] < until for v in w.verifies):
            checked += 1
    if w.alloc is None:
        verdict = "never allocated" + (f" ({w.ooms} out-of-memory retries)" if w.ooms else "")
    elif bad:
        verdict = f"FAIL: {len(bad)} bad check(s), {sum(v[2] for v in bad)} bad bytes"
        if any(not v[4] for v in bad):
            verdict += ", operands changed"
    elif not ins and outs:
        verdict = (
            f"swapped out at +{outs[0] - lo:.0f} s, never back in "
            f"({len(w.verifies)} check(s) before)"
        )
    elif not ins:
        verdict = f"ok, but never swapped in ({len(w.verifies)} check(s))"
    elif checked == 0:
        verdict = f"not checked after any of its {len(ins)} swap-in(s)"
    else:
        verdict = f"OK: {checked}/{len(ins)} swap-ins checked, 0 bad bytes"
    return TenantResult(
        label=label,
        allocated_bytes=w.alloc[2] if w.alloc else None,
        turns=sum(1 for g in grants if g.who == label),
        useful_s=useful,
        share=useful / (hi - lo) if hi > lo else 0.0,
        iterations=iters,
        its_running=iters / useful if useful > 0 else None,
        checks=len(w.verifies),
        bad_checks=len(bad),
        bad_bytes=sum(v[2] for v in bad),
        swap_ins=len(ins),
        swap_ins_checked=checked,
        verdict=verdict,
        errors=w.errors,
    )


def useful_s(
    w: WorkerLog, stalls: Sequence[tuple[float, float | None]], lo: float, hi: float
) -> float:
    """Seconds a tenant made progress in [lo, hi], its checks left out."""
    running = clip(running_intervals(w.points, stalls), lo, hi)
    checks = [(a, b) for a, b, *_ in w.verifies]
    return max(0.0, measure(running) - measure(intersect(running, checks)))


def _integrity(tenants: Sequence[TenantResult], losses: LossCheck | None) -> tuple[str, bool]:
    failures = [t for t in tenants if t.bad_checks]
    incomplete = [t for t in tenants if not t.bad_checks and not t.swap_ins_checked]
    if failures:
        return "FAIL: " + "; ".join(f"{t.label} {t.verdict}" for t in failures), False
    if losses is not None and losses.failed:
        return f"FAIL: {losses.label}'s loss curve: {losses.verdict}", False
    if not tenants or incomplete:
        why = ", ".join(f"{t.label} {t.verdict}" for t in incomplete) or "no tenants"
        return f"INCOMPLETE: {why}", False
    if losses is not None and not losses.ok:
        return f"INCOMPLETE: {losses.label}'s loss curve: {losses.verdict}", False
    n = sum(t.swap_ins_checked for t in tenants)
    text = f"PASS: {n} swap-in(s) checked, every byte of every ballast intact"
    if losses is not None:
        text += f"; {losses.label}'s loss curve bit-identical to the unswapped run's"
    return text, True


def analyse(
    logs: Mapping[str, WorkerLog],
    events: Sequence[KEvent],
    lo: float,
    hi: float,
    *,
    known: Mapping[str, bool] | None = None,
    reference: WorkerLog | None = None,
    reference_2: WorkerLog | None = None,
) -> Analysis:
    """Hand-overs, shares and integrity from the tenants' logs and kiwid's lines in [lo, hi].

    ``known``: which tenants an earlier run sharing kiwid's state_dir ran. ``reference``:
    the unswapped run of the trainer (the tenant whose log has a ``model`` line);
    ``reference_2``: a second one, which must agree with it for a verdict.
    """
    known = known or {}
    events = sorted(events, key=lambda e: e.t)
    swaps = [e for e in events if e.kind in ("swap-out", "swap-in")]
    grants = [e for e in events if e.kind == "grant" and e.t <= hi]  # none after the window
    stalls = {label: stalls_of(w.points, hi) for label, w in logs.items()}
    used: set[int] = set()
    rows = _handovers(logs, grants, swaps, stalls, lo, used)
    other = [e for k, e in enumerate(swaps) if k not in used]
    failed = [e for e in events if e.kind in ("swap-failed", "swap-refused")]
    tenants = [_tenant(lb, w, grants, swaps, stalls[lb], lo, hi) for lb, w in logs.items()]

    start, why_not = steady_start(grants, list(logs))
    steady = Steady(start, why_not)
    first_turns: list[FirstTurn] = []
    held: set[str] = set()
    for g, row in zip(grants, rows, strict=True):
        if g.who not in held and g.who in logs:
            row.kind = "known" if known.get(g.who) else "newcomer"
            stall, waiting = first_turn_stall(logs[g.who].points, stalls[g.who], g.t, hi)
            first_turns.append(
                FirstTurn(g.who, bool(known.get(g.who)), g.t - lo, row.frm, stall, waiting)
            )
        elif start is not None and g.t >= start:
            row.kind = "steady"
        else:
            row.kind = "warm-up"
        held.add(g.who)
    if start is not None and hi > start:
        steady.window_s = hi - start
        steady.useful_s = sum(useful_s(w, stalls[lb], start, hi) for lb, w in logs.items())
        steady.gaps = [
            h.gap_s
            for h in rows
            if h.kind == "steady" and h.frm is not None and h.gap_s is not None
        ]

    losses = None
    trainers = [lb for lb, w in logs.items() if w.model is not None]
    if trainers:
        tr = trainers[0]
        losses = compare_losses(tr, logs[tr], reference, swaps, stalls[tr], reference_2)
    notes = []
    if not grants:
        notes.append("kiwid logged no Grant line: no hand-overs to show")
    if not swaps:
        notes.append("kiwid logged no 'Swapped out'/'Swapped in' line")
    integrity, ok = _integrity(tenants, losses)
    return Analysis(
        (lo, hi), rows, other, failed, tenants, integrity, ok, notes, first_turns, steady, losses
    )
