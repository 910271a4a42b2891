"""Kiwi's main job on a machine without a GPU: kiwid rotating real tenants.

Starts kiwid with the simulated GPU backend, three busy processes, each in a
cgroup of its own (as containers are), attached to the simulated GPU, and one
idle process. Prints who holds the GPU and who is frozen, every second, then
each tenant's share of the CPU time (the stand-in for GPU time) over the whole
rotations seen, and cleans up. Run through ``scripts/demo`` (which installs
first). Needs root for cgroups; without it kiwid still schedules (the demo's own
kiwid lets the user's group change it), but freezes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import grp
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from kiwid.adapters.control import ControlError, DaemonUnreachable, request

V2 = Path("/sys/fs/cgroup/unified")
V2 = V2 if (V2 / "cgroup.procs").exists() else Path("/sys/fs/cgroup")


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def wait_asleep(pid: int) -> None:
    deadline = time.monotonic() + 5
    last = -1
    while time.monotonic() < deadline:
        ticks = cpu_ticks(pid)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "S" and ticks == last:
            return
        last = ticks
        time.sleep(0.1)


def print_shares(
    turns: list[tuple[str, dict[str, int]]], tenants: list[str], busy: int, root: bool
) -> None:
    """Each tenant's CPU time between the first turn and the last whole rotation."""
    rotations = (len(turns) - 1) // busy
    if rotations < 1:
        print(f"\nFewer than {busy + 1} turns seen: run longer (--duration) for the shares.")
        return
    first, last = turns[0][1], turns[rotations * busy][1]
    used = {name: last[name] - first[name] for name in tenants}
    total = sum(used.values()) or 1
    print(
        f"\nCPU time each tenant got (the simulated GPU's work) over {rotations} whole "
        f"rotation{'s' if rotations > 1 else ''} ({rotations * busy} turns):"
    )
    for name in tenants:
        ticks = used[name]
        print(
            f"  {name:<10} {ticks / os.sysconf('SC_CLK_TCK'):6.2f} s  {100 * ticks / total:5.1f} %"
        )
    if not root:
        print("(not root: nothing was frozen, so every busy tenant ran all the time)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds to run (default 20)")
    parser.add_argument("--tq", type=float, default=3.0, help="time quantum in seconds (default 3)")
    args = parser.parse_args()
    root = os.geteuid() == 0
    work = Path(tempfile.mkdtemp(prefix="kiwi-demo-"))
    sock = work / "kiwid.sock"
    config = work / "kiwi.toml"
    # Attaching tenants to the simulated GPU is an administrator's command: this
    # kiwid of the demo's own (its socket in a private directory) takes the user's
    # group as its admin group, so that the demo runs without root too.
    admin_group = grp.getgrgid(os.getgid()).gr_name
    config.write_text(
        f'[scheduler]\ntq = {args.tq}\nidle_release = 1\n[gpu]\nbackend = "sim"\npoll_interval = 0.1\n'
        f'[control]\nsocket = "{sock}"\nadmin_group = "{admin_group}"\n'
        f'[daemon]\nstate_dir = "{work}/state"\n'
        '[kubernetes]\ncdi_dir = ""\n'  # the demo leaves no CDI spec behind
    )
    parent = V2 / f"kiwi-demo-{uuid.uuid4().hex[:6]}"
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    kiwid = subprocess.Popen(
        [sys.executable, "-m", "kiwid", "--config", str(config)],
        stderr=open(work / "kiwid.log", "wb"),  # noqa: SIM115 - lives as long as kiwid
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                request(sock, "ping")
                break
            except (DaemonUnreachable, ControlError):
                if time.monotonic() > deadline or kiwid.poll() is not None:
                    print((work / "kiwid.log").read_text(), file=sys.stderr)
                    return 1
                time.sleep(0.05)
        for name, busy in (("alice", True), ("bob", True), ("carol", True), ("idle-dave", False)):
            work_code = "while True: pass" if busy else "import time; time.sleep(3600)"
            proc = subprocess.Popen([sys.executable, "-c", work_code])
            if root:
                (parent / name).mkdir(parents=True)
                (parent / name / "cgroup.procs").write_text(str(proc.pid))
            procs.append((name, proc))
            if not busy:  # attach it once its start-up (CPU work the sim would see) is over
                wait_asleep(proc.pid)
            request(
                sock,
                "sim-attach",
                {"pid": proc.pid, "gpu": 0, "memory_bytes": 8 << 30, "activity": "cpu"},
            )
        names = {}
        for name, proc in procs:
            names[f"cgroup:/{parent.name}/{name}" if root else f"pid:{proc.pid}"] = name
        print(
            f"kiwid (pid {kiwid.pid}) on a simulated 80 GiB GPU, TQ {args.tq:g} s; "
            f"{'real cgroup freezer' if root else 'not root: scheduling shown, nothing frozen'}"
        )
        print(f"{'t (s)':>6}  {'holder':<8} {'waiting (in order)':<22} frozen")
        # CPU ticks of every tenant at the start of each turn: shares are counted
        # over whole rotations only (every busy tenant the same number of turns).
        turns: list[tuple[str, dict[str, int]]] = []
        started = time.monotonic()
        next_row = started
        while time.monotonic() - started < args.duration:
            gpu = request(sock, "status")["gpus"][0]
            holder = names.get(gpu["holder"]["tenant"], "?") if gpu["holder"] else "-"
            if holder != "-" and (not turns or turns[-1][0] != holder):
                turns.append((holder, {name: cpu_ticks(p.pid) for name, p in procs}))
            if time.monotonic() >= next_row:
                next_row += 1.0
                waiting = ", ".join(names.get(w["tenant"], "?") for w in gpu["waiters"]) or "-"
                frozen = []
                if root:
                    for name, _ in procs:
                        events = (parent / name / "cgroup.events").read_text()
                        if "frozen 1" in events:
                            frozen.append(name)
                print(
                    f"{time.monotonic() - started:6.1f}  {holder:<8} {waiting:<22} {', '.join(frozen) or '-'}"
                )
            time.sleep(0.05)
        print_shares(turns, [name for name, _ in procs], busy=3, root=root)
        print(f"\nkiwid's log: {work / 'kiwid.log'}")
        return 0
    finally:
        if kiwid.poll() is None:
            kiwid.send_signal(signal.SIGTERM)
            try:
                kiwid.wait(timeout=15)
            except subprocess.TimeoutExpired:
                kiwid.kill()
        subprocess.run(
            [sys.executable, "-m", "kiwid", "recover", "--state-dir", str(work / "state")],
            check=False,
            capture_output=True,
        )
        for _, proc in procs:
            proc.kill()
            proc.wait()
        if root:
            for name, _ in procs:
                with contextlib.suppress(OSError):
                    (parent / name / "cgroup.freeze").write_text("0")
                with contextlib.suppress(OSError):
                    (parent / name).rmdir()
            with contextlib.suppress(OSError):
                parent.rmdir()


if __name__ == "__main__":
    sys.exit(main())
