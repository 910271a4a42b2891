"""bench/gpu/swap.py's printed table, from an :class:`~swap_analysis.Analysis`."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from swap_analysis import Analysis

GIB = 2**30

# --------------------------------------------------------------------- output


def _f(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


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


def report(a: Analysis, machine_lines: Sequence[str]) -> str:
    out = ["", "== machine", *machine_lines, ""]
    out.append(
        f"== hand-overs ({len(a.handovers)} grants by kiwid; window "
        f"{a.window[1] - a.window[0]:.0f} s)"
    )
    rows = []
    for k, h in enumerate(a.handovers, 1):
        rows.append(
            (
                str(k),
                f"{h.at_s:.1f}",
                f"{h.frm or '-'} -> {h.to}",
                _gib(h.out_bytes),
                _f(h.out_s),
                _rate(h.out_bytes, h.out_s),
                _gib(h.in_bytes),
                _f(h.in_s),
                _rate(h.in_bytes, h.in_s),
                _f(h.gap_s),
                _f(h.floor_s),
            )
        )
    head = (
        "#",
        "at s",
        "from -> to",
        "out GiB",
        "out s",
        "out GB/s",
        "in GiB",
        "in s",
        "in GB/s",
        "hand-over s",
        "floor s",
    )
    out.append(grid(head, rows) if rows else "(none)")
    gaps = [h.gap_s for h in a.handovers if h.gap_s is not None and h.frm is not None]
    outs = [h.out_bytes / h.out_s / 1e9 for h in a.handovers if h.out_bytes and h.out_s]
    ins = [h.in_bytes / h.in_s / 1e9 for h in a.handovers if h.in_bytes and h.in_s]
    floors = [h.floor_s for h in a.handovers if h.floor_s is not None and h.frm is not None]
    if gaps or outs or ins:
        out.append(
            "median: hand-over "
            + (f"{statistics.median(gaps):.1f} s" if gaps else "-")
            + (f" against a floor of {statistics.median(floors):.1f} s" if floors else "")
            + "; out "
            + (f"{statistics.median(outs):.2f} GB/s" if outs else "-")
            + ", in "
            + (f"{statistics.median(ins):.2f} GB/s" if ins else "-")
        )
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
    total = sum(t.share for t in a.tenants)
    out.append(
        f"useful GPU time, all tenants: {total:.0%} of the window (the rest: hand-overs, "
        "allocation, checks)"
    )
    for t in a.tenants:
        for err in t.errors[:3]:
            out.append(f"  {t.label} error: {err}")
    out += [*a.notes, "", f"== integrity: {a.integrity}", ""]
    out.append(LEGEND)
    return "\n".join(out)


LEGEND = (
    "out/in: kiwid's 'Swapped out/in' lines (checkpoint of the previous tenant, restore of the\n"
    "  next). hand-over s: the previous tenant's last iteration -> the next tenant's first,\n"
    "  on the tenants' CLOCK_MONOTONIC. floor s: the bytes moved at 55 GB/s (pinned copies on\n"
    "  the H200). share: a tenant's useful GPU time (iterations, not checks) / the window."
)
