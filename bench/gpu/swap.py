"""GPU memory oversubscription check: three tenants larger than the card together, swapped by kiwid.

Run as root on a machine with an NVIDIA GPU, with the system ``python3`` (it needs
torch and nvidia-ml-py; kiwid needs psutil, sdnotify, watchdog, prometheus_client,
from ``bench/gpu/_deps`` where the machine lacks them)::

    python3 bench/gpu/swap.py               # ~7 minutes on an H200 (3 x 47.5 GiB, TQ 30 s)
    python3 bench/gpu/swap.py --dry-run     # no GPU: checks, analysis on synthetic data, plan
    python3 bench/gpu/swap.py --rehearse    # no GPU: the whole flow on kiwid's simulated GPU

Each tenant (``swap_worker.py``, in a cgroup of its own) holds a patterned ballast of
``--gib`` GiB and runs bf16 matmuls; after every stall (it was locked and swapped out)
it checks its whole ballast and its operands. kiwid runs with ``[memory] swap =
"checkpoint"`` and ``[gpu] gate = "cuda-lock"`` at TQ ``--tq``, so waiting tenants'
memory goes to host RAM through the driver's checkpoint API. The tenants are let
allocate one after the other, each only when NVML shows room for it.

Printed at the end, also when something failed half-way: per hand-over, the bytes,
swap-out and swap-in seconds and GB/s (kiwid's ``Swapped out``/``Swapped in`` lines)
and the hand-over time on the tenants' own clocks; each tenant's share of useful GPU
time; the integrity result; the machine. Clean-up on every path: workers SIGKILLed,
kiwid stopped, ``kiwid recover``, cgroups removed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import enforcement as enf
from enforcement import (
    SOCK,
    STATE,
    WORK,
    BenchError,
    Kiwid,
    Layout,
    Worker,
    check_config,
    clean_start,
    kiwid_recover,
    log,
    merge,
    missing_kiwid_deps,
    stale_cgroups,
)

HERE = Path(__file__).resolve().parent
SWAP_WORKER = HERE / "swap_worker.py"
GIB = 2**30
GAP_S = 1.0  # an iteration slower than this: the tenant was gated (and swapped)
OVERHEAD_GIB = 1.5  # per tenant beyond the ballast: CUDA context, operands, check buffers
H200_GIB, H200_BALLAST_GIB = 140.4, 47.5  # the card and the by-hand reference's tenants
PINNED_GBPS = 55.0  # pinned host<->device copies measured on the H200 (the hand-over floor)
LEAD_S = 2.0  # release a tenant only this long before a hand-over is due, at the latest
CLEANUP_RESERVE_S = 60.0  # kept free at the end of --max-total for the clean-up


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


def parse_worker_log(text: str) -> WorkerLog:
    out = WorkerLog()
    for line in text.splitlines():
        parts = line.split()
        try:
            if parts[0] == "p" and len(parts) == 3:
                out.points.append((float(parts[1]), int(parts[2])))
            elif parts[0] == "verify" and len(parts) == 6:
                t0, t1 = float(parts[1]), float(parts[2])
                out.verifies.append((t0, t1, int(parts[3]), int(parts[4]), parts[5] == "1"))
            elif parts[0] == "alloc" and len(parts) == 5:
                out.alloc = (float(parts[1]), float(parts[2]), int(parts[3]), int(parts[4]))
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


# --------------------------------------------------------------------- kiwid config


def config_text(
    tq: float,
    *,
    backend: str,
    gate: str | None,
    swap: str = "checkpoint",
    host_floor_mib: int = 4096,
    sim_gib: float = 140.0,
    sim_gbps: tuple[float, float] = (25.0, 50.0),
) -> str:
    gate_line = f'gate = "{gate}"\n' if gate else ""
    sim = (
        f"[gpu.sim]\ndevices = 1\nmemory_gib = {sim_gib:g}\n"
        f"swap_out_gbps = {sim_gbps[0]:g}\nswap_in_gbps = {sim_gbps[1]:g}\n"
        if backend == "sim"
        else ""
    )
    return (
        f"[scheduler]\ntq = {tq:g}\nidle_release = 5\n"
        f'[gpu]\nbackend = "{backend}"\npoll_interval = 0.5\n{gate_line}{sim}'
        f'[memory]\nswap = "{swap}"\nreserve_mib = 1024\nhost_floor_mib = {host_floor_mib}\n'
        f'[control]\nsocket = "{SOCK}"\n'
        f'[daemon]\nstate_dir = "{STATE}"\n'
        '[kubernetes]\ncdi_dir = ""\n'
    )


# --------------------------------------------------------------------- the machine


def host_available() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def host_total() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def machine_line() -> str:
    sys.path.insert(0, str(HERE.parent))
    try:
        from _kiwid import machine  # noqa: PLC0415 - bench/_kiwid.py, the benchmarks' line

        return str(machine())
    except Exception as exc:
        return f"machine: {os.uname().nodename} ({exc})"


class GpuMemory:
    """NVML's view of GPU 0 (or, in a rehearsal, one kept from kiwid's swap lines)."""

    def __init__(self, nvml: Any = None, handle: Any = None, total: int = 0) -> None:
        self.nvml, self.handle = nvml, handle
        self.total = total
        self.resident: dict[str, int] = {}  # rehearsal: tenant -> bytes on the card
        self.errors: list[str] = []

    def used_free(self) -> tuple[int, int]:
        """(used, free) bytes; a failed NVML query counts as a full card."""
        if self.nvml is not None:
            try:
                info = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
            except Exception as exc:
                self.errors.append(str(exc))
                return self.total, 0
            return int(info.used), int(info.free)
        used = sum(self.resident.values())
        return used, max(0, self.total - used)

    def processes(self) -> int:
        if self.nvml is None:
            return len(self.resident)
        return len(self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle))


# --------------------------------------------------------------------- the run


class Run:
    """Workers, kiwid and the rotation; every wait is bounded, ``close`` undoes everything."""

    def __init__(self, args: argparse.Namespace, layout: Layout, outdir: Path) -> None:
        self.args = args
        self.layout = layout
        self.outdir = outdir
        self.sim = args.rehearse or args.dry_run
        self.workers: list[Worker] = []
        self.kiwid: Kiwid | None = None
        self.kiwid_lines: list[tuple[float, str]] = []
        self.kiwid_log: Path | None = None
        self.memory = GpuMemory()
        self.t_rot0: float | None = None
        self.t_end: float | None = None
        self.released: dict[str, float] = {}
        self.allocated: dict[str, float] = {}
        self.forced: list[str] = []
        self.exited: dict[str, int] = {}
        self.samples: list[tuple[float, int, int, int | None]] = []  # t, used, free, host avail
        self.status_polls: list[dict[str, Any]] = []
        self.ready_lines: list[str] = []
        self.gate_line: str | None = None
        self.errors: list[str] = []
        self.seen_lines = 0

    @property
    def names(self) -> dict[str, str]:
        return {w.cgroup.name: w.label for w in self.workers}

    # set-up -------------------------------------------------------------
    def spawn(self) -> None:
        a = self.args
        seconds = a.budget + 300.0  # a safety cap: the bench kills them long before
        for i in range(a.tenants):
            with contextlib.suppress(FileNotFoundError):  # an earlier run's
                (self.outdir / f"progress-{i}.txt").unlink()
            extra = ["--gib", f"{a.gib:g}", "--seed", str(i), "--alloc-timeout", "120"]
            self.workers.append(
                Worker(
                    i,
                    self.layout,
                    self.outdir,
                    seconds,
                    dry_run=self.sim,
                    script=SWAP_WORKER,
                    gap_s=GAP_S,
                    extra_args=extra,
                )
            )

    def init_workers(self, timeout_s: float) -> None:
        """Each worker: into its cgroup (done by Worker), then CUDA set-up, before kiwid."""
        for w in self.workers:
            if not w.cgroup.holds(w.pid):
                raise BenchError(f"worker {w.pid} is not in {w.cgroup.name}")
            w.send(b"i")
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            line = w.expect("ready", max(1.0, deadline - time.monotonic()))
            self.ready_lines.append(f"{w.label}: {line}")
            log(f"  {w.label} (pid {w.pid}, cgroup {w.cgroup.name}): {line}")

    def start_kiwid(self, config: Path) -> None:
        self.kiwid_log = self.outdir / "kiwid.log"
        self.kiwid = Kiwid(config, self.kiwid_log)
        ready = self.kiwid.wait_ready(60)
        log(f"  kiwid: {ready}")
        gate = [line for _, line in self.kiwid.lines if "Gate:" in line]
        self.gate_line = gate[0] if gate else None
        log(f"  kiwid: {self.gate_line or 'no [INFO] Gate: line'}")
        if not self.sim and (self.gate_line is None or "CUDA" not in self.gate_line):
            log("  WARNING: kiwid does not gate with the CUDA lock; swapping needs it")
        if self.sim:  # as on the GPU, kiwid knows the idle tenants (their contexts) at once
            for w in self.workers:
                self._sim_attach(w, int(self.args.overhead_gib * GIB))

    def _sim_attach(self, w: Worker, nbytes: int) -> None:
        from kiwid.adapters.control import request  # noqa: PLC0415 - needs the repo path

        args = {"pid": w.pid, "gpu": 0, "memory_bytes": nbytes, "activity": "cpu"}
        request(SOCK, "sim-attach", args, timeout_s=5.0)
        self.memory.resident[w.label] = nbytes

    # the rotation -------------------------------------------------------
    def rotate(self) -> None:
        a = self.args
        assert self.kiwid is not None
        need = int((a.gib + a.overhead_gib + a.margin_gib) * GIB)
        self.t_rot0 = t0 = time.monotonic()
        hard_end = enf.T0 + a.max_total - CLEANUP_RESERVE_S
        rot_end = min(t0 + a.budget, hard_end - a.settle)
        log(
            f"rotation: {a.budget:g} s budget (until +{rot_end - enf.T0:.0f} s), then up to "
            f"{a.settle:g} s for a swap in flight to end; release needs {need / GIB:.1f} GiB free"
        )
        pending = list(self.workers)
        last_release = t0
        free_ok_since: float | None = None
        next_sample = next_status = next_line = t0
        status: dict[str, Any] = {}
        settling = False
        settle_end = math.inf
        while True:
            now = time.monotonic()
            self._read_workers()
            self._read_kiwid()
            if self.kiwid.proc.poll() is not None:
                raise BenchError(
                    f"kiwid exited ({self.kiwid.proc.returncode}):\n{self.kiwid.tail()}"
                )
            alive = [w for w in self.workers if w.label not in self.exited]
            if not alive:
                raise BenchError("every worker exited")
            if now >= next_sample:
                next_sample = now + 0.5
                used, free = self.memory.used_free()
                self.samples.append((now, used, free, host_available()))
                free_ok_since = (free_ok_since or now) if free >= need else None
            if now >= next_status:
                next_status = now + 2.0
                status = self._status(now)
            if pending:
                w = pending[0]
                prev = self.workers[self.workers.index(w) - 1] if self.released else None
                prev_done = (
                    prev is None or prev.label in self.allocated or prev.label in self.exited
                )
                calm = _calm(status, min(LEAD_S, 0.3 * a.tq))
                room = free_ok_since is not None and now - free_ok_since >= 1.0
                forced = bool(self.released) and now - last_release > a.force_after and room
                if (prev_done and room and calm) or not self.released or forced:
                    if forced and not (prev_done and calm):
                        log(
                            f"  WARNING: releasing {w.label} after {a.force_after:g} s although "
                            f"kiwid is not calm ({calm}) or {prev.label if prev else '-'} has "
                            f"not allocated ({prev_done})"
                        )
                        self.forced.append(w.label)
                    self._release(w)
                    pending.pop(0)
                    last_release = now
                    free_ok_since = None
            if now >= next_line:
                next_line = now + 15.0
                self._progress_line(status)
            if not settling and now >= rot_end:
                settling = True
                settle_end = min(now + a.settle, hard_end)
                log(f"rotation over (+{now - t0:.0f} s); waiting for a swap in flight to end")
            if settling:
                swap = _swap_of(status)
                if swap is None or now >= settle_end:
                    if swap is not None:
                        log(f"  a swap is still in flight ({swap}); stopping anyway")
                    break
                next_status = min(next_status, now + 1.0)
            time.sleep(0.25)
        self.t_end = time.monotonic()

    def _release(self, w: Worker) -> None:
        if self.sim and w.label in self.memory.resident:  # its footprint grows as it allocates
            self._sim_attach(w, int((self.args.gib + self.args.overhead_gib) * GIB))
        elif self.sim:  # swapped out while idle: attaching again would bring it back in the sim
            log(f"  (rehearsal: {w.label} is swapped out; its simulated footprint stays small)")
        try:
            w.send(b"a")
        except OSError as exc:
            log(f"  WARNING: cannot release {w.label}: {exc}")
        self.released[w.label] = time.monotonic()
        used, free = self.memory.used_free()
        log(
            f"  released {w.label} to allocate {self.args.gib:g} GiB "
            f"(GPU: {used / GIB:.1f} GiB used, {free / GIB:.1f} GiB free)"
        )

    def _read_workers(self) -> None:
        for w in self.workers:
            for line in w.poll_lines():
                if line.startswith("allocated"):
                    self.allocated[w.label] = time.monotonic()
                    took = self.allocated[w.label] - self.released.get(w.label, math.nan)
                    size = line.split()[1] if len(line.split()) > 1 else "?"
                    log(f"  {w.label} allocated ({size} bytes) {took:.1f} s after release")
                elif line.startswith("error"):
                    log(f"  {w.label}: {line}")
            if w.label not in self.exited and w.proc.poll() is not None:
                self.exited[w.label] = w.proc.returncode
                log(f"  WARNING: {w.label} exited ({w.proc.returncode}){w.err_tail()}")

    def _read_kiwid(self) -> None:
        assert self.kiwid is not None
        lines = list(self.kiwid.lines)
        new, self.seen_lines = lines[self.seen_lines :], len(lines)
        self.kiwid_lines += new
        events = parse_kiwid(new, self.names)
        for e in events:
            if e.kind in ("swap-out", "swap-in"):
                if e.kind == "swap-out":
                    self.memory.resident.pop(e.who, None)
                elif self.sim:
                    self.memory.resident[e.who] = e.nbytes
            if e.kind != "queue":
                text = e.line.split("] ", 1)[-1]
                log(f"  kiwid: {text}")

    def _status(self, now: float) -> dict[str, Any]:
        assert self.kiwid is not None
        t = time.perf_counter()
        status = self.kiwid.status()
        rtt = (time.perf_counter() - t) * 1e3
        gpu = (status.get("gpus") or [{}])[0] if isinstance(status, dict) else {}
        self.status_polls.append(
            {
                "t": round(now - (self.t_rot0 or now), 2),
                "rtt_ms": round(rtt, 1),
                "error": status.get("error") if isinstance(status, dict) else "?",
                "holder": (gpu.get("holder") or {}).get("tenant"),
                "remaining_s": (gpu.get("holder") or {}).get("remaining_s"),
                "swap": gpu.get("swap"),
            }
        )
        return status

    def _progress_line(self, status: Mapping[str, Any]) -> None:
        now = time.monotonic()
        parts = []
        for w in self.workers:
            wl = read_worker_log(w.progress)
            if w.label in self.exited:
                parts.append(f"{w.label} exited")
            elif not wl.points:
                parts.append(f"{w.label} -")
            else:
                t, n = wl.points[-1]
                state = "running" if now - t < 2 * GAP_S else f"stalled {now - t:.0f} s"
                parts.append(f"{w.label} {n} it ({state})")
        used, _ = self.memory.used_free()
        avail = host_available()
        holder = _holder_of(status)
        swap = _swap_of(status)
        log(
            f"  +{now - (self.t_rot0 or now):5.0f} s  holder {who_is(holder or '-', self.names)}; "
            + ", ".join(parts)
            + f"; GPU {used / GIB:.1f} GiB used; host {(avail or 0) / GIB:.0f} GiB available"
            + (f"; swap {swap}" if swap else "")
        )

    # clean-up -----------------------------------------------------------
    def close(self) -> None:
        """SIGKILL the workers, stop kiwid, ``kiwid recover``, remove the cgroups."""
        t = time.monotonic()
        for w in self.workers:
            if w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
        deadline = time.monotonic() + 30.0
        for w in self.workers:
            try:
                w.kill(hard=True, wait_s=max(0.5, deadline - time.monotonic()))
            except Exception as exc:
                log(f"warning: killing {w.label} failed: {exc}")
            if w.proc.poll() is None:
                log(f"warning: {w.label} (pid {w.pid}) did not exit within 30 s of SIGKILL")
        for step in (self._stop_kiwid, _recover, self._remove_cgroups):
            try:
                step()
            except Exception as exc:
                log(f"warning: clean-up step {step.__name__} failed: {exc}")
        if self.memory.nvml is not None:
            with contextlib.suppress(Exception):
                self.memory.nvml.nvmlShutdown()
        took = time.monotonic() - t
        log(f"cleaned up in {took:.1f} s: workers killed, kiwid stopped, recover ran")

    def _stop_kiwid(self) -> None:
        if self.kiwid is None:
            return
        rc = self.kiwid.stop()
        self._read_kiwid()
        if rc not in (0, None):
            log(f"warning: kiwid exited {rc}:\n{self.kiwid.tail(8)}")
        self.kiwid = None

    def _remove_cgroups(self) -> None:
        for w in self.workers:
            if not w.cgroup.remove(3.0):
                log(f"warning: could not remove cgroup {w.cgroup.name}")
        for cgroup in stale_cgroups(self.layout):
            if not cgroup.remove(1.0):
                log(f"warning: cgroup {cgroup.name} still busy; left in place")

    # results ------------------------------------------------------------
    def analysis(self) -> Analysis:
        logs = {w.label: read_worker_log(w.progress) for w in self.workers}
        events = parse_kiwid(self.kiwid_lines, self.names)
        lo = self.t_rot0 if self.t_rot0 is not None else time.monotonic()
        hi = self.t_end if self.t_end is not None else time.monotonic()
        result = analyse(logs, events, lo, hi)
        if self.forced:
            result.notes.append(f"released before kiwid was calm: {', '.join(self.forced)}")
        never = [w.label for w in self.workers if w.label not in self.released]
        if never and self.samples:
            most = max(s[2] for s in self.samples) / GIB
            result.notes.append(
                f"never let allocate: {', '.join(never)} (no room and calm together; the most "
                f"free GPU memory seen: {most:.1f} GiB)"
            )
        return result


def _recover() -> None:
    try:
        kiwid_recover()
    except subprocess.TimeoutExpired:
        log("warning: kiwid recover took over 60 s")


def _gpu0(status: Mapping[str, Any]) -> Mapping[str, Any]:
    gpus = status.get("gpus") if isinstance(status, Mapping) else None
    return gpus[0] if gpus else {}


def _holder_of(status: Mapping[str, Any]) -> str | None:
    holder = _gpu0(status).get("holder") or {}
    return holder.get("tenant")


def _swap_of(status: Mapping[str, Any]) -> str | None:
    swap = _gpu0(status).get("swap")
    if not swap:
        return None
    if isinstance(swap, Mapping):
        done, total = swap.get("done_bytes") or 0, swap.get("bytes") or 0
        return (
            f"{swap.get('direction')} {swap.get('tenant')} {done / GIB:.1f}/{total / GIB:.1f} GiB"
        )
    return str(swap)


def _calm(status: Mapping[str, Any], lead_s: float) -> bool:
    """No swap-in in flight, no hand-over due within lead_s (no status: don't block on it).

    A swap-in takes GPU memory that NVML may not show yet; a swap-out only frees it.
    """
    gpu = _gpu0(status)
    if not gpu:
        return True
    swap = gpu.get("swap")
    if swap and (not isinstance(swap, Mapping) or swap.get("direction") != "out"):
        return False
    remaining = (gpu.get("holder") or {}).get("remaining_s")
    return remaining is None or remaining >= lead_s


# --------------------------------------------------------------------- dry run


SYNTH_NAMES = {"kiwigpu-bench-0": "w0", "kiwigpu-bench-1": "w1", "kiwigpu-bench-2": "w2"}


def synthetic() -> tuple[dict[str, WorkerLog], list[KEvent], float, float]:
    """A made-up rotation: w0 holds, w1 and w2 arrive and are swapped out, then w0 -> w1 -> w2.

    Times are seconds; each hand-over moves 10 GB out in 5 s and 10 GB in in 2 s.
    """
    gb = 10 * 10**9

    def pts(*spans: tuple[float, float]) -> list[tuple[float, int]]:
        out, n = [], 0
        for a, b in spans:
            out.append((a, n))
            t = a
            while t + 0.5 <= b:
                t += 0.5
                n += 50
                out.append((t, n))
        return out

    logs = {
        "w0": WorkerLog(points=pts((0, 30), (67, 80)), alloc=(0, 0, gb, 0)),
        "w1": WorkerLog(points=pts((5, 6), (37, 60)), alloc=(4, 5, gb, 0)),
        "w2": WorkerLog(points=pts((40, 41), (67.5, 70)), alloc=(39, 40, gb, 2)),
    }
    logs["w0"].verifies = [(0, 0.1, 0, gb, True), (67, 67.2, 0, gb, True)]
    logs["w1"].verifies = [(5, 5.1, 0, gb, True), (37, 37.1, 0, gb, True)]
    logs["w2"].verifies = [(40, 40.1, 0, gb, True), (67.5, 67.6, 5, gb, True)]
    k = "kiwigpu-bench-"
    moved = "10000000000 bytes in"
    raw = [
        (0.5, f"[INFO] Grant: {k}0 (cgroup:/{k}0) holds GPU 0 (burst)"),
        (13.0, f"[INFO] Swapped out {k}1 (cgroup:/{k}1): {moved} 5.0 s (2.0 GB/s)"),
        (30.0, f"[INFO] Preempt: {k}0 (cgroup:/{k}0) yields GPU 0: quantum over and someone waits"),
        (30.1, f"[INFO] Grant: {k}1 (cgroup:/{k}1) holds GPU 0 (turn)"),
        (32.1, f"[INFO] Swapped in cgroup:/{k}1: {moved} 2.0 s (5.0 GB/s)"),
        (37.0, f"[INFO] Swapped out cgroup:/{k}0: {moved} 5.0 s (2.0 GB/s)"),
        (46.0, f"[INFO] Swapped out cgroup:/{k}2: {moved} 5.0 s (2.0 GB/s)"),
        (60.0, f"[INFO] Grant: cgroup:/{k}2 holds GPU 0 (turn)"),
        (62.0, f"[INFO] Swapped in cgroup:/{k}2: {moved} 2.0 s (5.0 GB/s)"),
        (67.0, f"[INFO] Swapped out cgroup:/{k}1: {moved} 5.0 s (2.0 GB/s)"),
        (66.0, f"[INFO] Swapped in cgroup:/{k}0: {moved} 4.0 s (2.5 GB/s)"),
        (66.5, f"[ERROR] Swap failed: in of /{k}9 (cgroup:/{k}9): CUDA_ERROR_OUT_OF_MEMORY; it"),
        (66.6, f"[WARNING] Swap out of /{k}2 (cgroup:/{k}2) not done: host RAM floor: ..."),
    ]
    return logs, parse_kiwid(raw, SYNTH_NAMES), 0.0, 80.0


def dry_run(run: Run, layout: Layout) -> tuple[int, int]:
    """Checks without CUDA; returns (errors, warnings)."""
    errors = warnings = 0

    def check(name: str, ok: bool, detail: str = "") -> None:
        nonlocal errors
        errors += 0 if ok else 1
        log(f"  {'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")

    logs, events, lo, hi = synthetic()
    kinds = [e.kind for e in events]
    check(
        "kiwid line parsing",
        kinds.count("swap-out") == 4
        and kinds.count("swap-in") == 3
        and kinds.count("grant") == 3
        and kinds.count("swap-failed") == 1
        and kinds.count("swap-refused") == 1
        and all(e.who in ("w0", "w1", "w2") for e in events if e.kind != "swap-failed"),
        f"{kinds}",
    )
    a = analyse(logs, events, lo, hi)
    h = a.handovers
    check(
        "hand-overs from grants and swap lines",
        len(h) == 3
        and (h[1].frm, h[1].to, h[1].out_s, h[1].in_s) == ("w0", "w1", 5.0, 2.0)
        and h[1].gap_s == 7.0
        and (h[2].frm, h[2].to, h[2].out_s, h[2].in_s) == ("w1", "w2", 5.0, 2.0)
        and h[2].gap_s == 7.5,
        "; ".join(f"{x.frm}->{x.to} out {x.out_s} in {x.in_s} gap {x.gap_s}" for x in h),
    )
    check(
        "other swaps (newcomers) kept apart",
        [(e.kind, e.who) for e in a.other_swaps]
        == [("swap-out", "w1"), ("swap-out", "w2"), ("swap-in", "w0")],
        f"{[(e.kind, e.who) for e in a.other_swaps]}",
    )
    shares = {t.label: round(t.useful_s, 2) for t in a.tenants}
    check(
        "useful time (minus stalls and checks)",
        shares == {"w0": 42.7, "w1": 23.8, "w2": 3.3},
        f"{shares}",
    )
    check(
        "integrity verdicts",
        a.integrity.startswith("FAIL")
        and "w2" in a.integrity
        and a.tenants[1].swap_ins_checked == 1,
        a.integrity,
    )
    log("  the synthetic table:\n" + report(a, ["machine: synthetic"]))

    if os.geteuid() != 0:
        log("  warning: not root: worker and kiwid checks skipped (the real run needs root)")
        return errors, warnings + 1
    run.spawn()
    for w in run.workers:
        check(f"{w.label} (pid {w.pid}) in {w.cgroup.name} before release", w.cgroup.holds(w.pid))
    run.init_workers(60)
    w0, w1 = run.workers[0], run.workers[1]
    for w in (w0, w1):
        w.send(b"a")
    t_go = time.monotonic()
    time.sleep(1.0)
    w1.cgroup.freeze()  # as kiwid's gate would
    time.sleep(1.6)
    w1.cgroup.thaw()
    time.sleep(1.0)
    for w in (w0, w1):
        lines = w.poll_lines()
        check(
            f"{w.label} says allocated", any(x.startswith("allocated") for x in lines), f"{lines}"
        )
    wl = read_worker_log(w1.progress)
    stalls = stalls_of(wl.points)
    check(
        "a frozen tenant: one stall, then a check",
        len(stalls) == 1
        and any(v[0] >= stalls[0][0] for v in wl.verifies)
        and all(v[2] == 0 and v[4] for v in wl.verifies),
        f"stalls {[(round(s - t_go, 2), round((r or 0) - t_go, 2)) for s, r in stalls]}, "
        f"{len(wl.verifies)} checks",
    )
    run.close()
    check("workers killed", all(w.proc.poll() is not None for w in run.workers))
    check("cgroups removed", not stale_cgroups(layout))
    run.workers = []

    missing = missing_kiwid_deps()
    if missing:
        log("  warning: kiwid checks skipped (missing " + ", ".join(missing) + ")")
        return errors, warnings + 1
    WORK.mkdir(parents=True, exist_ok=True)
    for backend, gate in (("nvml", "cuda-lock"), ("sim", None)):
        path = WORK / f"kiwid-swap-{backend}.toml"
        path.write_text(config_text(run.args.tq, backend=backend, gate=gate))
        rc, text = check_config(path)
        check(f"kiwid check-config ({backend})", rc == 0, text.splitlines()[-1] if text else "")
    kiwid = run.kiwid = Kiwid(WORK / "kiwid-swap-sim.toml", run.outdir / "kiwid-dry-run.log")
    try:
        check("kiwid starts (sim backend)", True, kiwid.wait_ready(30))
        status = kiwid.status()
        check("kiwid answers status", "error" not in status, str(status)[:100])
    except BenchError as exc:
        check("kiwid starts (sim backend)", False, str(exc))
    run.close()
    check("kiwid stopped, recover ran", kiwid.proc.returncode == 0, f"exit {kiwid.proc.returncode}")
    return errors, warnings


# --------------------------------------------------------------------- main


def plan_lines(args: argparse.Namespace) -> list[str]:
    total = args.tenants * (args.gib + args.overhead_gib)
    need = args.gib + args.overhead_gib + args.margin_gib
    est = 30 + args.budget + 0.5 * args.settle + 30
    return [
        f"{args.tenants} tenants x {args.gib:g} GiB ballast (~{total:.0f} GiB with contexts), "
        f"kiwid TQ {args.tq:g} s, swap = checkpoint, gate = "
        + ("the sim's" if args.rehearse else "cuda-lock"),
        f"rotation {args.budget:g} s, settle <= {args.settle:g} s, hard cap {args.max_total:g} s "
        f"in all; expected ~{est:.0f} s",
        f"tenant i+1 allocates once NVML shows {need:g} GiB "
        f"free and kiwid is not swapping in nor handing over within {LEAD_S:g} s (once "
        f"{args.force_after:g} s have passed, room is enough)",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--gib", type=float, default=None, help="ballast per tenant, GiB (47.5; rehearse 4.75)"
    )
    parser.add_argument("--tenants", type=int, default=3, help="how many tenants")
    parser.add_argument("--tq", type=float, default=None, help="kiwid's TQ, s (30; rehearse 5)")
    parser.add_argument(
        "--budget", type=float, default=None, help="rotation seconds (330; rehearse 45)"
    )
    parser.add_argument("--settle", type=float, default=45.0, help="wait for a swap in flight")
    parser.add_argument("--max-total", type=float, default=470.0, help="hard cap on the run, s")
    parser.add_argument("--margin-gib", type=float, default=4.0, help="free memory margin")
    parser.add_argument(
        "--force-after", type=float, default=120.0, help="release the next tenant anyway after"
    )
    parser.add_argument("--host-floor-mib", type=int, default=4096, help="kiwid's host RAM floor")
    parser.add_argument(
        "--sim-gbps",
        default="2.2,5.5",
        help="rehearsal: the simulated GPU's swap-out,swap-in rates in GB/s (the H200's "
        "driver: 2.2,5.5); default %(default)s",
    )
    parser.add_argument("--out", type=Path, help="output folder (default $OUT/kiwi-swap)")
    parser.add_argument("--deps", type=Path, default=enf.DEPS_DIR, help="kiwid's dependencies")
    parser.add_argument("--dry-run", action="store_true", help="no CUDA: checks and the plan")
    parser.add_argument(
        "--rehearse", action="store_true", help="no CUDA: the whole run on kiwid's simulated GPU"
    )
    args = parser.parse_args()
    args.tq = args.tq if args.tq is not None else (5.0 if args.rehearse else 30.0)
    args.gib = args.gib if args.gib is not None else (4.75 if args.rehearse else H200_BALLAST_GIB)
    # A rehearsal is a model of the H200 run at gib / 47.5 scale: the simulated card, the
    # tenants' overhead and the margin shrink with it (kiwid's host floor checks real RAM).
    args.scale = args.gib / H200_BALLAST_GIB if args.rehearse else 1.0
    args.overhead_gib = OVERHEAD_GIB * args.scale
    args.margin_gib *= args.scale
    args.budget = args.budget if args.budget is not None else (45.0 if args.rehearse else 330.0)
    if args.tenants < 1 or args.gib <= 0:
        parser.error("--tenants >= 1 and --gib > 0")
    try:
        out_gbps, in_gbps = (float(x) for x in args.sim_gbps.split(","))
    except ValueError:
        parser.error("--sim-gbps OUT,IN, e.g. 2.2,5.5")
    args.sim_gbps = (out_gbps, in_gbps)
    if args.deps.is_dir():
        enf.EXTRA_PATHS.append(str(args.deps))
        sys.path.insert(0, str(args.deps))

    def _sigterm(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    outdir = args.out or (
        Path(os.environ["OUT"]) / "kiwi-swap" if os.environ.get("OUT") else WORK / "out-swap"
    )
    outdir.mkdir(parents=True, exist_ok=True)
    mode = " (DRY RUN)" if args.dry_run else " (REHEARSAL: simulated GPU)" if args.rehearse else ""
    log(f"kiwi GPU swap check{mode}: python {sys.version.split()[0]} ({sys.executable})")
    log(f"repo {enf.REPO}; output {outdir}; work dir {WORK}")
    for line in plan_lines(args):
        log("plan: " + line)
    layout = Layout.detect()
    avail, total = host_available(), host_total()
    log(
        f"cgroups: {layout}; root: {os.geteuid() == 0}; host RAM {(total or 0) / GIB:.0f} GiB, "
        f"{(avail or 0) / GIB:.0f} GiB available"
    )
    if not enf.preflight(args, layout):
        return 2
    swapped = (args.tenants - 1) * (args.gib + args.overhead_gib) * GIB
    if not args.dry_run and avail is not None and avail < swapped + args.host_floor_mib * 2**20:
        log(
            f"WARNING: {avail / GIB:.0f} GiB of host RAM available, the swapped tenants need "
            f"~{swapped / GIB:.0f} GiB plus the {args.host_floor_mib} MiB floor: kiwid may "
            "refuse swap-outs"
        )

    run = Run(args, layout, outdir)
    machine = [machine_line()]
    finished: list[Analysis | None] = []
    interrupted = False
    try:
        if os.geteuid() == 0:
            clean_start(layout)
        if args.dry_run:
            errors, warnings = dry_run(run, layout)
            log(
                f"dry run {'OK' if not errors else 'FAILED'}: "
                f"{errors} failure(s), {warnings} warning(s)"
            )
            return 1 if errors else 0
        _real(run, args, machine)
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        interrupted = True
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the clean-up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if run.t_end is None and run.t_rot0 is not None:
            run.t_end = time.monotonic()
        run.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if not args.dry_run and run.workers:
            finished.append(_finish(run, args, outdir, machine))
    if interrupted:
        return 130
    result = finished[0] if finished else None
    return 0 if result is not None and result.integrity_ok and not run.errors else 1


def _real(run: Run, args: argparse.Namespace, machine: list[str]) -> None:
    """Set up and rotate; a BenchError is recorded, the verdict comes after the clean-up."""
    try:
        if args.rehearse:
            sim_gib = round(H200_GIB * args.scale, 2)
            run.memory = GpuMemory(total=int(sim_gib * GIB))
            machine.append(
                f"GPU: none (rehearsal: kiwid's simulated GPU, {sim_gib:g} GiB, swaps at "
                f"{args.sim_gbps[0]:g} GB/s out, {args.sim_gbps[1]:g} GB/s in)"
            )
        else:
            import pynvml  # noqa: PLC0415 - only on the GPU machine

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            run.memory = GpuMemory(pynvml, handle, total)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            driver = pynvml.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else driver
            machine.append(f"GPU 0: {name}, {total / GIB:.1f} GiB, driver {driver}")
            used, _ = run.memory.used_free()
            procs = run.memory.processes()
            log(f"{machine[-1]}; {used / GIB:.1f} GiB used by {procs} process(es) before the run")
            if procs:
                log("WARNING: the GPU already has processes: they take room from the tenants")
        host = host_total()
        machine.append(f"host RAM {(host or 0) / GIB:.0f} GiB; {run.layout}")
        WORK.mkdir(parents=True, exist_ok=True)
        backend = "sim" if args.rehearse else "nvml"
        gate = None if args.rehearse else "cuda-lock"
        config = WORK / f"kiwid-swap-{backend}.toml"
        config.write_text(
            config_text(
                args.tq,
                backend=backend,
                gate=gate,
                host_floor_mib=args.host_floor_mib,
                sim_gib=round(H200_GIB * args.scale, 2),
                sim_gbps=args.sim_gbps,
            )
        )
        run.spawn()  # torch imports overlap the config check
        checked_config(config)
        run.init_workers(120)
        machine += run.ready_lines
        run.start_kiwid(config)
        run.rotate()
    except BenchError as exc:
        run.errors.append(str(exc))
        log(f"ERROR: {exc}")


def checked_config(config: Path) -> None:
    rc, text = check_config(config)
    if rc != 0:
        raise BenchError(f"kiwid check-config {config} failed ({rc}): {text}")
    log(f"kiwid config {config}: OK")


def _finish(
    run: Run, args: argparse.Namespace, outdir: Path, machine: list[str]
) -> Analysis | None:
    analysis = None
    text = ""
    try:
        if run.t_rot0 is not None:
            analysis = run.analysis()
            text = report(analysis, machine)
        else:
            text = "\n== no rotation took place\n" + "\n".join(machine)
        if run.errors:
            text += "\nerrors:\n" + "\n".join("  " + e for e in run.errors)
        polls = run.status_polls
        during = [p for p in polls if p["swap"]]
        if polls:
            rtts = sorted(p["rtt_ms"] for p in polls)
            text += (
                f"\nkiwictl status: {len(polls)} queries, {sum(1 for p in polls if p['error'])} "
                f"failed, max {rtts[-1]:.0f} ms; {len(during)} answered during a swap"
            )
        if run.samples:
            text += (
                f"\nGPU memory used: max {max(s[1] for s in run.samples) / GIB:.1f} GiB of "
                f"{run.memory.total / GIB:.1f}; host RAM available: min "
                f"{min((s[3] or 0) for s in run.samples) / GIB:.1f} GiB"
            )
        print(text, flush=True)
        (outdir / "swap-table.txt").write_text(text + "\n")
    except Exception as exc:
        log(f"ERROR: the analysis failed: {exc!r}; raw logs are in {outdir}")
    dump = {
        "machine": machine,
        "args": {k: str(v) for k, v in vars(args).items()},
        "elapsed_s": round(time.monotonic() - enf.T0, 1),
        "errors": run.errors,
        "gate_line": run.gate_line,
        "released_s": {k: round(v - (run.t_rot0 or v), 2) for k, v in run.released.items()},
        "allocated_s": {k: round(v - (run.t_rot0 or v), 2) for k, v in run.allocated.items()},
        "forced": run.forced,
        "exited": run.exited,
        "status_polls": run.status_polls,
        "nvml_errors": run.memory.errors[:20],
        "kiwid_log": str(run.kiwid_log) if run.kiwid_log else None,
    }
    if analysis is not None:
        dump["integrity"] = analysis.integrity
        dump["integrity_ok"] = analysis.integrity_ok
        dump["handovers"] = [
            {**asdict(h), "gap_s": h.gap_s, "floor_s": h.floor_s} for h in analysis.handovers
        ]
        dump["other_swaps"] = [asdict(e) for e in analysis.other_swaps]
        dump["failed_swaps"] = [asdict(e) for e in analysis.failed_swaps]
        dump["tenants"] = [asdict(t) for t in analysis.tenants]
        dump["notes"] = analysis.notes
    with contextlib.suppress(OSError, TypeError, ValueError):
        (outdir / "results.json").write_text(json.dumps(dump, indent=1, default=str))
    log(f"results: {outdir}; total {time.monotonic() - enf.T0:.0f} s")
    return analysis


if __name__ == "__main__":
    sys.exit(main())
