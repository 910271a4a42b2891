"""Draw docs/scheduling-timeline.svg, who holds the GPU over time, from a real run.

Starts a real kiwid on the simulated GPU (backend "sim") with ``[[tenants]]`` rules
that give ``alice`` weight 1, ``bob`` weight 2 and ``urgent`` priority 10; runs
alice and bob as busy processes in cgroups of their own (as containers are), starts
urgent part-way through, samples kiwid's status on its control socket every 0.1 s,
and renders an SVG with one lane per tenant: when it held the GPU, when it waited
frozen, when ``max_wait`` gave it a quantum, and when a higher priority preempted
it. Standard library only.

    .venv/bin/python scripts/timeline.py                    # writes docs/scheduling-timeline.svg
    .venv/bin/python scripts/timeline.py --render S.json    # draw again from saved samples

Needs root (cgroups, freezing); it refuses without it. Everything it starts (kiwid,
the tenants, their cgroups) is stopped and removed before it exits, on an error,
Ctrl-C or SIGTERM too.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiwid.adapters.control import ControlError, DaemonUnreachable, request

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "scheduling-timeline.svg"
V2 = Path("/sys/fs/cgroup/unified")
V2 = V2 if (V2 / "cgroup.procs").exists() else Path("/sys/fs/cgroup")
SAMPLE_EVERY_S = 0.1
COLORS = {"alice": "#3b7dd8", "bob": "#2a9d6f", "urgent": "#d9822b"}
OTHER_COLORS = ("#8e5ec7", "#c44e7a", "#6c757d")
PREEMPT_COLOR = "#c62828"

CONFIG = """\
[scheduler]
tq = {tq}
idle_release = 1
preempt_after = {preempt_after}
max_wait = {max_wait}
[gpu]
backend = "sim"
poll_interval = 0.05
[control]
socket = "{socket}"
[daemon]
state_dir = "{state}"
[kubernetes]
cdi_dir = ""

[[tenants]]
match = {{ cgroup = "/kiwi-timeline-*/alice" }}
weight = 1
[[tenants]]
match = {{ cgroup = "/kiwi-timeline-*/bob" }}
weight = 2
[[tenants]]
match = {{ cgroup = "/kiwi-timeline-*/urgent" }}
priority = 10
"""


# --- drawing -------------------------------------------------------------------------


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


@dataclass
class Run:
    """What one run needs: its directory, kiwid, and the tenants' processes by name."""

    work: Path
    parent: Path
    kiwid: subprocess.Popen[bytes] | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def socket(self) -> Path:
        return self.work / "kiwid.sock"


def _busy(name: str, run: Run, seconds: float | None = None) -> subprocess.Popen[bytes]:
    """A busy process in a cgroup of its own, attached to the simulated GPU 0."""
    cgroup = run.parent / name
    cgroup.mkdir(parents=True)
    work = "while True: pass" if seconds is None else f"while time.monotonic() < {seconds}: pass"
    # It spins only once it is in its cgroup (its start-up is not the picture's).
    go_r, go_w = os.pipe()
    code = f"import os, time\nos.read({go_r}, 1)\n{work}"
    proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(go_r,))
    os.close(go_r)
    run.procs[name] = proc
    (cgroup / "cgroup.procs").write_text(str(proc.pid))
    os.write(go_w, b"x")
    os.close(go_w)
    request(
        run.socket,
        "sim-attach",
        {"pid": proc.pid, "gpu": 0, "memory_bytes": 4 << 30, "activity": "cpu"},
    )
    return proc


def _start_kiwid(run: Run, args: argparse.Namespace) -> None:
    config = run.work / "kiwi.toml"
    config.write_text(
        CONFIG.format(
            tq=args.tq,
            preempt_after=args.preempt_after,
            max_wait=args.max_wait,
            socket=run.socket,
            state=run.work / "state",
        )
    )
    log = (run.work / "kiwid.log").open("wb")
    with log:
        run.kiwid = subprocess.Popen(
            [sys.executable, "-m", "kiwid", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 15
    while not _answers(run.socket):
        if run.kiwid.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("kiwid did not start:\n" + (run.work / "kiwid.log").read_text())
        time.sleep(0.05)


def _answers(sock: Path) -> bool:
    try:
        request(sock, "ping")
    except (DaemonUnreachable, ControlError):
        return False
    return True


def _sample(run: Run, started: float) -> dict[str, Any]:
    gpu = request(run.socket, "status")["gpus"][0]
    names = {f"cgroup:/{run.parent.name}/{name}": name for name in run.procs}
    tenants = {}
    for t in gpu["tenants"]:
        name = names.get(t["id"])
        if name is None:
            continue
        last = t.get("last_preemption") or {}
        tenants[name] = {
            "state": t["state"],
            "gated": t["gated"],
            "boosted": t["boosted"],
            "preempted_priority": t["ledger"]["preempted_priority"],
            "preempted_by": names.get(last.get("by"), last.get("by")),
            "weight": t["policy"]["weight"],
            "priority": t["policy"]["priority"],
            "held_s": t["ledger"]["holding_s"],
        }
    return {"t": round(time.monotonic() - started, 3), "tenants": tenants}


def _cleanup(run: Run) -> None:
    if run.kiwid is not None and run.kiwid.poll() is None:
        run.kiwid.send_signal(signal.SIGTERM)  # kiwid thaws everything on its way out
        try:
            run.kiwid.wait(timeout=20)
        except subprocess.TimeoutExpired:
            run.kiwid.kill()
            run.kiwid.wait()
    subprocess.run(
        [sys.executable, "-m", "kiwid", "recover", "--state-dir", str(run.work / "state")],
        check=False,
        capture_output=True,
        timeout=60,
    )
    for name, proc in run.procs.items():
        with contextlib.suppress(OSError):
            (run.parent / name / "cgroup.freeze").write_text("0")
        proc.kill()
        proc.wait()
    if run.parent.is_dir():
        for child in run.parent.iterdir():
            if child.is_dir():
                with contextlib.suppress(OSError):
                    (child / "cgroup.freeze").write_text("0")
                _wait_empty(child)
                with contextlib.suppress(OSError):
                    child.rmdir()
        with contextlib.suppress(OSError):
            run.parent.rmdir()


def _wait_empty(cgroup: Path, timeout_s: float = 5.0) -> None:
    """Wait (a little) until the kernel says a cgroup's processes are gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if "populated 0" in (cgroup / "cgroup.events").read_text():
                return
        except OSError:
            return
        time.sleep(0.02)


@contextlib.contextmanager
def _run(args: argparse.Namespace) -> Iterator[Run]:
    work = Path(tempfile.mkdtemp(prefix="kiwi-timeline-"))
    run = Run(work, V2 / f"kiwi-timeline-{uuid.uuid4().hex[:6]}")
    try:
        yield run
    finally:
        _cleanup(run)
        if args.keep:
            print(f"kiwid's files: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def record(args: argparse.Namespace) -> dict[str, Any]:
    """Run kiwid and the tenants; return the samples and what the picture needs."""
    with _run(args) as run:
        _start_kiwid(run, args)
        assert run.kiwid is not None
        print(
            f"kiwid (pid {run.kiwid.pid}) on the simulated GPU, tenants under {run.parent}; "
            f"sampling for {args.duration:g} s",
            flush=True,
        )
        _busy("alice", run)
        _busy("bob", run)
        started = time.monotonic()
        samples: list[dict[str, Any]] = []
        urgent_started = None
        tick = 0
        while True:
            now = time.monotonic() - started
            if urgent_started is None and now >= args.urgent_at:
                urgent_started = round(now, 3)
                _busy("urgent", run, seconds=time.monotonic() + args.urgent_for)
            samples.append(_sample(run, started))
            if now >= args.duration:
                break
            if run.kiwid.poll() is not None:
                raise RuntimeError("kiwid exited:\n" + (run.work / "kiwid.log").read_text())
            tick += 1
            time.sleep(max(0.0, started + tick * SAMPLE_EVERY_S - time.monotonic()))
        print(f"kiwid (pid {run.kiwid.pid}) stopping")
    return {
        "samples": samples,
        "urgent_at": urgent_started,
        "settings": {
            "tq": args.tq,
            "preempt_after": args.preempt_after,
            "max_wait": args.max_wait,
            "urgent_for": args.urgent_for,
        },
    }


def picture(run: Mapping[str, Any]) -> str:
    """The SVG of a recorded run."""
    samples = run["samples"]
    seen: dict[str, Mapping[str, Any]] = {}
    for sample in samples:
        for name, tenant in sample["tenants"].items():
            seen.setdefault(name, tenant)
    lanes = []
    for i, (name, tenant) in enumerate(sorted(seen.items(), key=lambda kv: kv[0])):
        color = COLORS.get(name, OTHER_COLORS[i % len(OTHER_COLORS)])
        label = f"{name}: weight {tenant['weight']:g}, priority {tenant['priority']}"
        lanes.append(Lane(name, label, color))
    s = run["settings"]
    markers = []
    if run.get("urgent_at") is not None:
        markers.append((run["urgent_at"], "urgent starts"))
        seen_at = [i for i, x in enumerate(samples) if "urgent" in x["tenants"]]
        gone = next(
            (x["t"] for x in samples[seen_at[0] :] if "urgent" not in x["tenants"])
            if seen_at
            else (),
            None,
        )
        if gone is not None:
            markers.append((gone, "urgent has exited"))
    notes = [
        f"A real kiwid on the simulated GPU: TQ {s['tq']:g} s, preempt_after "
        f"{s['preempt_after']:g} s, max_wait {s['max_wait']:g} s. The tenants are busy processes",
        f"in cgroups of their own, frozen while they wait; urgent is busy for {s['urgent_for']:g} s, "
        "then exits.",
        f"kiwid's status sampled every {SAMPLE_EVERY_S:g} s; drawn by scripts/timeline.py.",
    ]
    return render(
        samples,
        lanes,
        title="Who holds the GPU: weights 1:2, then a priority tenant",
        markers=markers,
        notes=notes,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=OUT, help="the SVG (default docs/scheduling-timeline.svg)"
    )
    parser.add_argument("--samples", type=Path, help="also save the samples (JSON) here")
    parser.add_argument("--render", type=Path, help="draw saved samples instead of a run")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds (default 20)")
    parser.add_argument("--tq", type=float, default=1.0, help="TQ, seconds (default 1)")
    parser.add_argument(
        "--urgent-at", type=float, default=6.0, help="when urgent starts, seconds (default 6)"
    )
    parser.add_argument(
        "--urgent-for", type=float, default=8.0, help="how long it is busy, seconds (default 8)"
    )
    parser.add_argument(
        "--preempt-after", type=float, default=0.5, help="scheduler.preempt_after (default 0.5)"
    )
    parser.add_argument(
        "--max-wait", type=float, default=4.0, help="scheduler.max_wait (default 4; 0: off)"
    )
    parser.add_argument("--keep", action="store_true", help="keep kiwid's config and log")
    args = parser.parse_args()
    if args.render is not None:
        data = json.loads(args.render.read_text())
    else:
        if os.geteuid() != 0:
            print("timeline: needs root (tenants in cgroups, frozen by kiwid)", file=sys.stderr)
            return 2
        if not (V2 / "cgroup.subtree_control").exists():
            print(f"timeline: no cgroup2 hierarchy at {V2}", file=sys.stderr)
            return 2
        # A SIGTERM (a timeout, say) ends the run through its clean-up, like Ctrl-C.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        data = record(args)
        if args.samples is not None:
            args.samples.write_text(json.dumps(data, indent=1) + "\n")
    args.out.write_text(picture(data))
    for name in sorted({n for s in data["samples"] for n in s["tenants"]}):
        last = next(s["tenants"][name] for s in reversed(data["samples"]) if name in s["tenants"])
        print(f"  {name:<8} held {last['held_s']:6.2f} s")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
