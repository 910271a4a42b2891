"""bench/gpu/swap.py's printed table and headline figures, from a swap_analysis.Analysis."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from swap_analysis import Analysis, Handover

GIB = 2**30

# The targets for the H200 run (bench/gpu/frontier.py reports against them).
TARGETS = {
    "steady_useful": 0.90,  # at least
    "steady_p50_s": 3.0,  # at most
    "known_first_turn_s": 15.0,  # at most
}


def _f(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.1f}"


def _rate(nbytes: int | None, seconds: float | None) -> str:
    if not nbytes or not seconds:
        return "-"
    return f"{nbytes / seconds / 1e9:.2f}"


def grid(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    table = [list(head), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _medians(rows: Sequence[Handover]) -> str:
    gaps = [h.gap_s for h in rows if h.gap_s is not None and h.frm is not None]
    outs = [h.out_bytes / h.out_s / 1e9 for h in rows if h.out_bytes and h.out_s]
    ins = [h.in_bytes / h.in_s / 1e9 for h in rows if h.in_bytes and h.in_s]
    floors = [h.floor_s for h in rows if h.floor_s is not None and h.frm is not None]
    return (
        "hand-over "
        + (f"{statistics.median(gaps):.1f} s" if gaps else "-")
        + (f" (n={len(gaps)}, {min(gaps):.1f}-{max(gaps):.1f})" if gaps else "")
        + (f" against a floor of {statistics.median(floors):.1f} s" if floors else "")
        + "; out "
        + (f"{statistics.median(outs):.2f} GB/s" if outs else "-")
        + ", in "
        + (f"{statistics.median(ins):.2f} GB/s" if ins else "-")
    )


def _handover_table(a: Analysis) -> list[str]:
    out = [
        f"== hand-overs ({len(a.handovers)} grants by kiwid; window "
        f"{a.window[1] - a.window[0]:.0f} s)"
    ]
    rows = [
        (
            str(k),
            f"{h.at_s:.1f}",
            f"{h.frm or '-'} -> {h.to}",
            h.kind if h.kind in ("steady", "warm-up") else f"first ({h.kind})",
            _gib(h.out_bytes),
            _f(h.out_s),
            _rate(h.out_bytes, h.out_s),
            _gib(h.in_bytes),
            _f(h.in_s),
            _rate(h.in_bytes, h.in_s),
            _f(h.gap_s),
            _f(h.floor_s),
        )
        for k, h in enumerate(a.handovers, 1)
    ]
    head = (
        "#", "at s", "from -> to", "turn", "out GiB", "out s", "out GB/s",
        "in GiB", "in s", "in GB/s", "hand-over s", "floor s",
    )  # fmt: skip
    out.append(grid(head, rows) if rows else "(none)")
    if any(h.frm for h in a.handovers):
        out.append("median, every hand-over: " + _medians(a.handovers))
    steady = [h for h in a.handovers if h.kind == "steady"]
    if steady:
        out.append("median, steady hand-overs: " + _medians(steady))
    if a.other_swaps:
        out.append("other swaps (not part of a hand-over: newcomers, first turns):")
        for e in a.other_swaps:
            out.append(
                f"  +{e.t - a.window[0]:6.1f} s  {e.kind:8} {e.who}: {e.nbytes / GIB:.1f} GiB "
                f"in {e.seconds:.1f} s ({e.nbytes / max(e.seconds, 1e-9) / 1e9:.2f} GB/s)"
            )
    for e in a.failed_swaps:
        what = "SWAP FAILED" if e.kind == "swap-failed" else "swap not done"
        out.append(f"  +{e.t - a.window[0]:6.1f} s  {what}: {e.line.split('] ', 1)[-1]}")
    return out


def _rotation(a: Analysis) -> list[str]:
    s = a.steady
    whole = a.window[1] - a.window[0]
    out = ["", "== useful GPU time and hand-overs"]
    out.append(
        f"whole window:    {a.useful_share:4.0%} useful of {whole:.0f} s (first turns, "
        "allocation and checks included)"
    )
    if s.start is None:
        out.append(f"steady rotation: none ({s.why_not})")
    else:
        out.append(
            f"steady rotation: {_pct(s.share):>4} useful of {s.window_s:.0f} s; hand-over p50 "
            f"{_f(s.p50_s)} s over {len(s.gaps)}"
            + (f" ({min(s.gaps):.1f}-{max(s.gaps):.1f} s)" if s.gaps else "")
        )
        out.append(
            f"  (from +{s.start - a.window[0]:.1f} s: the first grant after every tenant had "
            "held once)"
        )
    out += ["", "== first turns (kiwid's first Grant of a tenant -> its first iteration after it)"]
    for f in a.first_turns:
        how = "held first, nothing to move" if f.after is None else f"after {f.after}"
        stall = "-" if f.stall_s is None else f"{f.stall_s:.1f} s"
        if f.still_waiting:
            stall = f"> {stall} (no iteration before the end)"
        out.append(f"  {f.label:4} {f.label_kind:8} at +{f.at_s:6.1f} s ({how}): {stall}")
    if not a.first_turns:
        out.append("  (none)")
    known = a.known_first_turns
    if known:
        worst = max(known, key=lambda f: f.stall_s or 0.0)
        out.append(
            f"known workloads' first turn: max {_f(worst.stall_s)} s ({worst.label}), "
            f"n={len(known)}"
        )
    else:
        out.append("known workloads' first turn: none (no earlier run shared this state_dir)")
    return out


def _losses(a: Analysis) -> list[str]:
    c = a.losses
    if c is None:
        return []
    out = ["", f"== loss curve of {c.label} ({c.model})"]
    out.append(
        f"steps {c.steps} (compared {c.compared} with the unswapped run's {c.reference_steps}, "
        f"step i against step i mod {c.reference_steps}); swaps while it trained: "
        f"{c.swap_outs} out, {c.swap_ins} in; stalls {c.stalls} ({c.mid_cycle_stalls} mid-cycle)"
    )
    out.append(f"verdict: {c.verdict}")
    return out


def report(a: Analysis, machine_lines: Sequence[str]) -> str:
    out = ["", "== machine", *machine_lines, "", *_handover_table(a), *_rotation(a), *_losses(a)]
    out += ["", "== tenants"]
    rows = [
        (
            t.label,
            _gib(t.allocated_bytes),
            str(t.turns),
            f"{t.useful_s:.1f}",
            f"{t.share:.0%}",
            _f(t.its_running, "{:.0f}"),
            f"{t.checks}",
            t.verdict,
        )
        for t in a.tenants
    ]
    out.append(
        grid(
            ("tenant", "GiB", "turns", "useful GPU s", "share", "it/s running", "checks", "data"),
            rows,
        )
    )
    for t in a.tenants:
        for err in t.errors[:3]:
            out.append(f"  {t.label} error: {err}")
    out += [*a.notes, "", f"== integrity: {a.integrity}", ""]
    out.append(LEGEND)
    return "\n".join(out)


def summary(a: Analysis) -> dict[str, Any]:
    """The headline figures (results.json's "summary", frontier.py's table)."""
    known = a.known_first_turns
    worst = max((f.stall_s or 0.0 for f in known), default=None)
    c = a.losses
    return {
        "window_s": round(a.window[1] - a.window[0], 1),
        "whole_useful": round(a.useful_share, 4),
        "steady_start_s": None
        if a.steady.start is None
        else round(a.steady.start - a.window[0], 1),
        "steady_why_not": a.steady.why_not or None,
        "steady_window_s": round(a.steady.window_s, 1),
        "steady_useful": None if a.steady.share is None else round(a.steady.share, 4),
        "steady_p50_s": None if a.steady.p50_s is None else round(a.steady.p50_s, 2),
        "steady_handovers": [round(g, 2) for g in a.steady.gaps],
        "first_turns": [
            {
                "tenant": f.label,
                "kind": f.label_kind,
                "at_s": round(f.at_s, 1),
                "after": f.after,
                "stall_s": None if f.stall_s is None else round(f.stall_s, 2),
                "still_waiting": f.still_waiting,
            }
            for f in a.first_turns
        ],
        "known_first_turn_s": None if worst is None else round(worst, 2),
        "never_held": [t.label for t in a.tenants if not t.turns],
        "bad_bytes": a.bad_bytes,
        "integrity": a.integrity,
        "integrity_ok": a.integrity_ok,
        "loss_identical": None if c is None else c.ok,  # across at least one swap-in
        "loss_failed": None if c is None else c.failed,  # the curves differ
        "loss_steps": None if c is None else c.compared,
        "loss_swap_ins": None if c is None else c.swap_ins,
        "loss_verdict": None if c is None else c.verdict,
        "loss_fallback": None if c is None else c.fallback,
    }


LEGEND = (
    "out/in: kiwid's 'Swapped out/in' lines (checkpoint of the previous tenant, restore of the\n"
    "  next). hand-over s: the previous tenant's last iteration -> the next tenant's first,\n"
    "  on the tenants' CLOCK_MONOTONIC. floor s: the bytes moved at 55 GB/s (pinned copies on\n"
    "  the H200). turn: a tenant's first (newcomer: kiwid never saw the workload; known: an\n"
    "  earlier run sharing kiwid's state_dir ran it), warm-up (a repeat turn before every tenant\n"
    "  had held once), steady (from the first grant after that). share: a tenant's useful GPU\n"
    "  time (iterations, not checks) / the window."
)
