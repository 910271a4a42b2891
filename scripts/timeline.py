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
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiwid.adapters.control import ControlError, DaemonUnreachable, request

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its drawing half, beside it
from timeline_svg import COLORS, OTHER_COLORS, Lane, render

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "scheduling-timeline.svg"
V2 = Path("/sys/fs/cgroup/unified")
V2 = V2 if (V2 / "cgroup.procs").exists() else Path("/sys/fs/cgroup")
SAMPLE_EVERY_S = 0.1

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
