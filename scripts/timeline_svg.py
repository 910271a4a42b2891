"""The drawing half of scripts/timeline.py: kiwid status samples to an SVG.

Standard library only; no kiwid, no root. ``render`` takes the samples (each a
time and, per tenant, its state, weight and priority as status showed them) and
draws one lane per tenant: held, held after ``max_wait``, waited frozen, and a
mark where a higher priority preempted it.
"""

from __future__ import annotations

import html
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

COLORS = {"alice": "#3b7dd8", "bob": "#2a9d6f", "urgent": "#d9822b"}
OTHER_COLORS = ("#8e5ec7", "#c44e7a", "#6c757d")
PREEMPT_COLOR = "#c62828"


@dataclass(frozen=True)
class Lane:
    """One tenant's row: the key its samples use, what it is called, its colour."""

    key: str
    label: str
    color: str


@dataclass(frozen=True)
class Span:
    """A stretch of time a tenant spent in one drawn state."""

    start: float
    end: float
    kind: str  # "holds", "boosted" (holds after max_wait) or "waits"


def drawn_state(tenant: Mapping[str, Any] | None) -> str | None:
    """What a sampled tenant is in the picture: holds, boosted, waits, or nothing."""
    if tenant is None:
        return None
    state = tenant.get("state")
    if state == "holder" and not tenant.get("gated"):
        return "boosted" if tenant.get("boosted") else "holds"
    if state in ("waiting", "holder"):  # a holder still gated has not been let go yet
        return "waits"
    return None  # idle or co-running: not taking turns


def spans(samples: Sequence[Mapping[str, Any]], key: str) -> list[Span]:
    """The spans of one tenant: each sample's state lasts until the next sample."""
    out: list[Span] = []
    for here, there in itertools.pairwise(samples):
        kind = drawn_state(here["tenants"].get(key))
        if kind is None:
            continue
        if out and out[-1].kind == kind and out[-1].end == here["t"]:
            out[-1] = Span(out[-1].start, there["t"], kind)
        else:
            out.append(Span(here["t"], there["t"], kind))
    return out


def preemptions(samples: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, str | None]]:
    """When a tenant was preempted for a higher priority (its ledger's count went up)."""
    out: list[tuple[float, str | None]] = []
    before = None
    for sample in samples:
        tenant = sample["tenants"].get(key)
        if tenant is None:
            continue
        count = tenant.get("preempted_priority", 0)
        if before is not None and count > before:
            out.append((sample["t"], tenant.get("preempted_by")))
        before = count
    return out


def _ticks(duration: float) -> list[float]:
    step = next(s for s in (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300) if duration / s <= 20)
    return [i * step for i in range(int(duration / step + 1e-9) + 1)]


def render(
    samples: Sequence[Mapping[str, Any]],
    lanes: Sequence[Lane],
    *,
    title: str,
    markers: Sequence[tuple[float, str]] = (),
    notes: Sequence[str] = (),
) -> str:
    """An SVG timeline of ``samples``, one lane per tenant.

    ``samples``: ``{"t": seconds, "tenants": {key: {"state", "gated", "boosted",
    "preempted_priority", "preempted_by"}}}`` in time order (the last one only ends
    the one before). ``markers``: vertical lines across all lanes, e.g. when a
    tenant started. ``notes``: lines of text under the picture.
    """
    if len(samples) < 2:
        raise ValueError("a timeline needs at least two samples")
    t0, t1 = samples[0]["t"], samples[-1]["t"]
    width, left, right, top, lane_h, gap = 980, 220, 100, 56, 34, 10
    plot_w = width - left - right
    axis_y = top + len(lanes) * (lane_h + gap)
    legend_y = axis_y + 44
    height = legend_y + 30 + 18 * len(notes) + 10

    def x(t: float) -> float:
        return round(left + (t - t0) / (t1 - t0) * plot_w, 1)

    esc = html.escape
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, '
        f'sans-serif" font-size="13">',
        f"<title>{esc(title)}</title>",
        "<defs>",
        '<pattern id="boost" width="8" height="8" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)">'
        '<rect width="8" height="8" fill="#ffffff" fill-opacity="0"/>'
        '<line x1="0" y1="0" x2="0" y2="8" stroke="#ffffff" stroke-width="3" '
        'stroke-opacity="0.6"/></pattern>',
        "</defs>",
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{left}" y="26" font-size="16" font-weight="bold">{esc(title)}</text>',
    ]
    for i, lane in enumerate(lanes):
        y = top + i * (lane_h + gap)
        out.append(f'<rect x="{left}" y="{y}" width="{plot_w}" height="{lane_h}" fill="#f3f4f6"/>')
        out.append(
            f'<text x="{left - 10}" y="{y + lane_h / 2 + 5}" text-anchor="end">'
            f"{esc(lane.label)}</text>"
        )
        held = 0.0
        for span in spans(samples, lane.key):
            x0, x1 = x(span.start), x(span.end)
            w = round(max(x1 - x0, 0.5), 1)
            if span.kind == "waits":
                out.append(
                    f'<rect class="waits" x="{x0}" y="{y + lane_h / 2 - 3}" width="{w}" '
                    f'height="6" fill="{lane.color}" fill-opacity="0.35"/>'
                )
                continue
            held += span.end - span.start
            out.append(
                f'<rect class="{span.kind}" x="{x0}" y="{y + 3}" width="{w}" '
                f'height="{lane_h - 6}" fill="{lane.color}"/>'
            )
            if span.kind == "boosted":
                out.append(
                    f'<rect x="{x0}" y="{y + 3}" width="{w}" height="{lane_h - 6}" '
                    'fill="url(#boost)"/>'
                )
        for at, by in preemptions(samples, lane.key):
            px = x(at)
            why = f"preempted at {at - t0:.1f} s" + (f" for {by}" if by else "")
            out.append(
                f'<g class="preemption"><title>{esc(why)}</title>'
                f'<line x1="{px}" y1="{y - 2}" x2="{px}" y2="{y + lane_h + 2}" '
                f'stroke="{PREEMPT_COLOR}" stroke-width="2"/>'
                f'<path d="M{px - 6},{y - 8} L{px + 6},{y - 8} L{px},{y + 1} Z" '
                f'fill="{PREEMPT_COLOR}"/></g>'
            )
        out.append(
            f'<text x="{left + plot_w + 10}" y="{y + lane_h / 2 + 5}" fill="#374151">'
            f"held {held:.1f} s</text>"
        )
    for at, text in markers:
        mx = x(at)
        out.append(
            f'<line x1="{mx}" y1="{top - 14}" x2="{mx}" y2="{axis_y}" stroke="#111827" '
            'stroke-dasharray="4 3"/>'
        )
        out.append(f'<text x="{mx + 4}" y="{top - 16}" font-size="12">{esc(text)}</text>')
    out.append(
        f'<line x1="{left}" y1="{axis_y}" x2="{left + plot_w}" y2="{axis_y}" stroke="#111827"/>'
    )
    for tick in _ticks(t1 - t0):
        tx = x(t0 + tick)
        out.append(f'<line x1="{tx}" y1="{axis_y}" x2="{tx}" y2="{axis_y + 5}" stroke="#111827"/>')
        out.append(
            f'<text x="{tx}" y="{axis_y + 19}" text-anchor="middle" font-size="11">{tick:g}</text>'
        )
    out.append(
        f'<text x="{left + plot_w}" y="{axis_y + 34}" text-anchor="end" font-size="11">'
        "seconds</text>"
    )
    swatch = "#6b7280"
    legend = [
        f'<rect x="{left}" y="{legend_y}" width="22" height="14" fill="{swatch}"/>'
        f'<text x="{left + 28}" y="{legend_y + 12}">holds the GPU</text>',
        f'<rect x="{left + 140}" y="{legend_y}" width="22" height="14" fill="{swatch}"/>'
        f'<rect x="{left + 140}" y="{legend_y}" width="22" height="14" fill="url(#boost)"/>'
        f'<text x="{left + 168}" y="{legend_y + 12}">holds after max_wait</text>',
        f'<rect x="{left + 340}" y="{legend_y + 4}" width="22" height="6" fill="{swatch}" '
        f'fill-opacity="0.35"/><text x="{left + 368}" y="{legend_y + 12}">waits, frozen</text>',
        f'<path d="M{left + 494},{legend_y} L{left + 506},{legend_y} L{left + 500},'
        f'{legend_y + 9} Z" fill="{PREEMPT_COLOR}"/><text x="{left + 512}" '
        f'y="{legend_y + 12}">preempted for a higher priority</text>',
    ]
    out += legend
    for i, note in enumerate(notes):
        out.append(
            f'<text x="{left}" y="{legend_y + 40 + 18 * i}" font-size="12" fill="#374151">'
            f"{esc(note)}</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


# --- the run ---------------------------------------------------------------------------
