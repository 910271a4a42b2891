"""Fault injection: random faults against a real kiwid, with swapping off and on.

A real kiwid on the simulated GPU (a small card, so that with ``swap =
"checkpoint"`` memory moves at every hand-over) gates real busy processes, each
in a cgroup of its own, with the cgroup freezer. Then, again and again, one
random fault: kill -9 (then ``kiwid recover`` or a restart, as systemd would),
SIGTERM, SIGSTOP for a while, a tenant that dies (and a new one), a good reload,
a bad reload, ``kiwictl -T``, ``-S off`` / ``-S on``, a second kiwid on the same
state directory, ``kiwid recover`` while kiwid runs. After each, once things
settle, it checks:

* per GPU, at most one tenant unfrozen while kiwid schedules (never two in two
  samples in a row: a hand-over unfreezes the next a moment after it froze the
  last, and a sample may fall in between);
* no tenant frozen while no kiwid is alive to manage it;
* no traceback in any kiwid log, and the refusals refuse (exit 3).

Prints a table of the faults and what was found, and the machine. Needs root
(the freezer). Usage::

    .venv/bin/python bench/fault_injection.py [--faults 120] [--seed 7] [--swap both]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from _kiwid import machine

from kiwid.adapters.control import ControlError, DaemonUnreachable, request

ROOT = Path(__file__).resolve().parents[1]
KIWID = [sys.executable, "-m", "kiwid"]
V2 = (
    Path("/sys/fs/cgroup/unified")
    if Path("/sys/fs/cgroup/unified/cgroup.procs").exists()
    else Path("/sys/fs/cgroup")
)
GIB = 2**30
FAULTS = (
    "kill-9+recover",
    "kill-9+restart",
    "sigterm",
    "sigstop",
    "tenant-dies",
    "good-reload",
    "bad-reload",
    "set-tq",
    "scheduling-off-on",
    "second-kiwid",
    "recover-while-live",
)

CONFIG = """\
[scheduler]
tq = {tq}
idle_release = 0.5
[gpu]
backend = "sim"
poll_interval = 0.05
[gpu.sim]
devices = 1
memory_gib = 10
swap_out_gbps = 40
swap_in_gbps = 60
[memory]
swap = "{swap}"
reserve_mib = 1024
host_floor_mib = 0
[control]
socket = "{d}/kiwid.sock"
[daemon]
state_dir = "{d}/state"
shutdown_timeout = 10
[kubernetes]
cdi_dir = ""
"""


@dataclass
class Run:
    """One kiwid and its tenants in a scratch directory."""

    d: Path
    swap: str
    rng: random.Random
    parent: str = field(default_factory=lambda: f"kiwi-fi-{uuid.uuid4().hex[:8]}")
    kiwid: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)
    tenants: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    kept_swapped: int = 0
    """Stops that left a tenant frozen with its memory in host RAM, recorded: the
    card had no room to restore it (by design: kiwid recover or the next start
    brings it back)."""
    scheduling_off: bool = False
    counter: int = 0

    @property
    def sock(self) -> Path:
        return self.d / "kiwid.sock"

    def config(self, tq: float = 2.0) -> str:
        return CONFIG.format(d=self.d, tq=tq, swap=self.swap)

    def write_config(self, text: str) -> None:
        tmp = self.d / ".kiwi.toml.tmp"
        tmp.write_text(text)
        tmp.replace(self.d / "kiwi.toml")

    # ---- kiwid ----------------------------------------------------------------

    def start(self) -> None:
        log = self.d / f"kiwid-{len(self.logs)}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            self.kiwid = subprocess.Popen(
                [*KIWID, "--config", str(self.d / "kiwi.toml")],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        self.wait(self.answers, 15, "kiwid to answer")
        self.scheduling_off = False
        for name, proc in self.tenants.items():  # the sim keeps them across restarts
            if proc.poll() is None:
                self.attach(name)

    def answers(self) -> bool:
        try:
            request(self.sock, "ping", timeout_s=2)
        except (DaemonUnreachable, ControlError):
            return False
        return True

    def alive(self) -> bool:
        return self.kiwid is not None and self.kiwid.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.kiwid is not None
        self.kiwid.send_signal(sig)
        return self.kiwid.wait(timeout=60)

    def recover(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*KIWID, "recover", "--state-dir", str(self.d / "state")],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=ROOT,
        )

    # ---- tenants ----------------------------------------------------------------

    def spawn(self) -> str:
        self.counter += 1
        name = f"t{self.counter}"
        cgroup = V2 / self.parent / name
        cgroup.mkdir(parents=True)
        r, w = os.pipe()
        code = f"import os\nos.read({r}, 1)\nwhile True: pass"
        proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(r,))
        os.close(r)
        (cgroup / "cgroup.procs").write_text(str(proc.pid))
        os.write(w, b"x")
        os.close(w)
        self.tenants[name] = proc
        return name

    def attach(self, name: str) -> None:
        proc = self.tenants[name]
        with contextlib.suppress(ControlError, DaemonUnreachable):
            request(
                self.sock,
                "sim-attach",
                {"pid": proc.pid, "gpu": 0, "memory_bytes": 4 * GIB, "activity": "cpu"},
            )

    def frozen(self) -> dict[str, bool]:
        out = {}
        for name, proc in self.tenants.items():
            if proc.poll() is not None:
                continue
            with contextlib.suppress(OSError):
                events = (V2 / self.parent / name / "cgroup.events").read_text()
                out[name] = "frozen 1" in events.splitlines()
        return out

    def cleanup(self) -> None:
        if self.alive():
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.stop()
        self.recover()
        for name, proc in self.tenants.items():
            with contextlib.suppress(OSError):
                (V2 / self.parent / name / "cgroup.freeze").write_text("0")
            proc.kill()
            proc.wait()
            with contextlib.suppress(OSError):
                (V2 / self.parent / name).rmdir()
        with contextlib.suppress(OSError):
            (V2 / self.parent).rmdir()

    # ---- checks ---------------------------------------------------------------

    def wait(self, predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                self.problems.append(f"timed out waiting for {what}")
                return
            time.sleep(0.02)

    def check(self, fault: str) -> None:
        """Sample the tenants for a second and judge what was seen."""
        if not self.alive():
            frozen = [n for n, f in self.frozen().items() if f]
            swapped = self.recorded_swapped()
            if frozen and all(self.tenants[n].pid in swapped for n in frozen):
                self.kept_swapped += 1
            elif frozen:
                self.problems.append(f"{fault}: {frozen} frozen with no live kiwid")
            return
        previous: set[str] | None = None
        for _ in range(20):
            running = {n for n, f in self.frozen().items() if not f}
            if not self.scheduling_off and previous is not None:
                both = running & previous
                if len(running) > 1 and len(previous) > 1 and len(both) > 1:
                    self.problems.append(f"{fault}: {sorted(both)} ran together")
                    break
            previous = running
            time.sleep(0.05)

    def recorded_swapped(self) -> set[int]:
        """PIDs the state file records with their memory in host RAM."""
        try:
            doc = json.loads((self.d / "state" / "state.json").read_text())
        except (OSError, ValueError):
            return set()
        return {
            pid for rec in doc["gated"].values() if rec.get("swapped") for pid, _ in rec["pids"]
        }

    def tracebacks(self) -> list[str]:
        return [str(log) for log in self.logs if "Traceback" in log.read_text(errors="replace")]

    # ---- faults -----------------------------------------------------------------

    def inject(self, fault: str) -> None:
        rng = self.rng
        if fault.startswith("kill-9"):
            self.stop(signal.SIGKILL)
            if fault.endswith("recover"):
                out = self.recover()  # systemd's ExecStopPost=
                if out.returncode not in (0, 1):
                    self.problems.append(f"{fault}: recover exited {out.returncode}")
                self.check(fault)
            self.start()
        elif fault == "sigterm":
            code = self.stop()
            kept = bool(self.recorded_swapped())
            if code != (1 if kept else 0):  # 1: a tenant stays gated, and says so
                self.problems.append(f"sigterm: kiwid exited {code}")
            self.check(fault)
            self.start()
        elif fault == "sigstop":
            assert self.kiwid is not None
            self.kiwid.send_signal(signal.SIGSTOP)
            time.sleep(rng.uniform(0.2, 1.5))
            self.kiwid.send_signal(signal.SIGCONT)
        elif fault == "tenant-dies":
            live = [n for n, p in self.tenants.items() if p.poll() is None]
            if live:
                victim = self.tenants[rng.choice(live)]
                victim.kill()
                victim.wait()
            self.attach(self.spawn())
        elif fault == "good-reload":
            self.write_config(self.config(tq=rng.choice([1.0, 2.0, 3.0])))
            with contextlib.suppress(OSError):
                os.kill(self.kiwid.pid, signal.SIGHUP)  # type: ignore[union-attr]
        elif fault == "bad-reload":
            self.write_config(self.config() + "\n[scheduler]\ntq = -1\n")
            time.sleep(0.3)
            self.write_config(self.config())
        elif fault == "set-tq":
            with contextlib.suppress(ControlError, DaemonUnreachable):
                request(self.sock, "set-tq", {"tq": rng.choice([0.5, 1.0, 2.5])})
        elif fault == "scheduling-off-on":
            with contextlib.suppress(ControlError, DaemonUnreachable):
                request(self.sock, "set-mode", {"mode": "off"})
                self.scheduling_off = True
                time.sleep(rng.uniform(0.3, 1.0))
                request(self.sock, "set-mode", {"mode": "on"})
                self.scheduling_off = False
        elif fault == "second-kiwid":
            other = self.d / "other.toml"
            other.write_text(self.config().replace("kiwid.sock", "other.sock"))
            out = subprocess.run(
                [*KIWID, "--config", str(other)],
                check=False,
                capture_output=True,
                text=True,
                timeout=60,
                cwd=ROOT,
            )
            if out.returncode != 3:
                self.problems.append(f"second-kiwid: exited {out.returncode}, not 3")
        elif fault == "recover-while-live":
            out = self.recover()
            if out.returncode != 3:
                self.problems.append(f"recover-while-live: exited {out.returncode}, not 3")
        time.sleep(0.3)
        self.check(fault)


def run(
    faults: int, seed: int, swap: str, tenants: int = 3
) -> tuple[collections.Counter[str], list[str], int]:
    """Inject ``faults`` random faults.

    Returns:
        How many of each, the problems found, and how many stops left a tenant
        recorded in host RAM because the card had no room for it.
    """
    rng = random.Random(seed)
    d = Path(tempfile.mkdtemp(prefix="kiwi-fi-", dir="/tmp"))
    d.chmod(0o755)
    r = Run(d, swap, rng)
    counts: collections.Counter[str] = collections.Counter()
    try:
        r.write_config(r.config())
        r.start()
        for _ in range(tenants):
            r.attach(r.spawn())
        time.sleep(1)
        for _ in range(faults):
            fault = rng.choice(FAULTS)
            counts[fault] += 1
            r.inject(fault)
        code = r.stop()
        if code != (1 if r.recorded_swapped() else 0):
            r.problems.append(f"final stop: kiwid exited {code}")
        r.check("final stop")
        r.problems += [f"traceback in {log}" for log in r.tracebacks()]
    finally:
        r.cleanup()
        with contextlib.suppress(OSError):
            for path in sorted(d.rglob("*"), reverse=True):
                path.unlink() if not path.is_dir() or path.is_symlink() else path.rmdir()
            d.rmdir()
    return counts, r.problems, r.kept_swapped


def sweep_leftovers() -> None:
    """Thaw and remove the cgroups of an earlier run that was killed outright.

    A SIGKILL leaves no chance to clean up: its tenants die, their cgroups stay
    frozen. A run with any process left in its cgroups is left alone.
    """
    for parent in V2.glob("kiwi-fi-*"):
        groups = [c for c in parent.iterdir() if (c / "cgroup.procs").is_file()]
        with contextlib.suppress(OSError):
            if any((g / "cgroup.procs").read_text().strip() for g in [*groups, parent]):
                continue  # alive, or someone else's: not ours to touch
            for group in [*groups, parent]:
                (group / "cgroup.freeze").write_text("0")
                group.rmdir()
            print(f"removed {parent}, left frozen by a run that was killed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=120, help="faults in all (default 120)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--swap", choices=("none", "checkpoint", "both"), default="both")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("fault_injection.py needs root (it freezes cgroups)")
    # SIGTERM and SIGHUP unwind like Ctrl-C, so each run's cleanup thaws its tenants.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    sweep_leftovers()
    print(machine())
    modes = ["none", "checkpoint"] if args.swap == "both" else [args.swap]
    total = 0
    found: list[str] = []
    for i, swap in enumerate(modes):
        started = time.monotonic()
        counts, problems, kept = run(args.faults // len(modes), args.seed + i, swap)
        total += sum(counts.values())
        found += problems
        took = time.monotonic() - started
        print(f"\nswap = {swap!r}: {sum(counts.values())} faults in {took:.0f} s")
        for fault in FAULTS:
            print(f"  {fault:20s} {counts[fault]:4d}")
        print(f"  stops that kept a tenant in host RAM (no room to restore; recorded): {kept}")
        print(f"  problems: {len(problems)}")
        for problem in problems:
            print(f"    - {problem}")
    print(f"\n{total} faults, {len(found)} problems: " + json.dumps(found))


if __name__ == "__main__":
    main()
