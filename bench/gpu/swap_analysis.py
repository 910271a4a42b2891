"""bench/gpu/swap.py's analysis: hand-overs, useful GPU time and integrity from parsed logs.

Pure: takes the tenants' logs and kiwid's events, returns an :class:`Analysis`.
"""

from __future__ import annotations

import math
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

PINNED_GBPS = 55.0  # pinned host<->device copies measured on the H200 (the hand-over floor)

# --------------------------------------------------------------------- analysis


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


def analyse(
    logs: Mapping[str, WorkerLog], events: Sequence[KEvent], lo: float, hi: float
) -> Analysis:
    """Hand-overs, shares and integrity from the tenants' logs and kiwid's lines in [lo, hi]."""
    events = sorted(events, key=lambda e: e.t)
    swaps = [e for e in events if e.kind in ("swap-out", "swap-in")]
    grants = [e for e in events if e.kind == "grant"]
    stalls = {label: stalls_of(w.points, hi) for label, w in logs.items()}
    resumes = {
        label: sorted(
            ([w.points[0][0]] if w.points else []) + [r for _, r in stalls[label] if r is not None]
        )
        for label, w in logs.items()
    }
    used: set[int] = set()
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
    other = [e for k, e in enumerate(swaps) if k not in used]
    failed = [e for e in events if e.kind in ("swap-failed", "swap-refused")]

    tenants = []
    for label, w in logs.items():
        running = clip(running_intervals(w.points, stalls[label]), lo, hi)
        checks = [(a, b) for a, b, *_ in w.verifies]
        useful = max(0.0, measure(running) - measure(intersect(running, checks)))
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
        tenants.append(
            TenantResult(
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
        )
    notes = []
    if not grants:
        notes.append("kiwid logged no Grant line: no hand-overs to show")
    if not swaps:
        notes.append("kiwid logged no 'Swapped out'/'Swapped in' line")
    failures = [t for t in tenants if t.bad_checks]
    incomplete = [t for t in tenants if not t.bad_checks and not t.swap_ins_checked]
    if failures:
        integrity, ok = "FAIL: " + "; ".join(f"{t.label} {t.verdict}" for t in failures), False
    elif not tenants or incomplete:
        why = ", ".join(f"{t.label} {t.verdict}" for t in incomplete) or "no tenants"
        integrity, ok = f"INCOMPLETE: {why}", False
    else:
        n = sum(t.swap_ins_checked for t in tenants)
        integrity = f"PASS: {n} swap-in(s) checked, every byte of every ballast intact"
        ok = True
    return Analysis((lo, hi), rows, other, failed, tenants, integrity, ok, notes)
