"""The fault matrix's judge: samples every 50 ms, and what they show (bench/driver_faults.py).

Two threads sample while the matrix runs. One reads the card every 50 ms (who
runs, each tenant's progress); the other asks kiwid for its status every 100 ms
(who is stuck or released). From them:

* **windows**: per GPU at most one tenant runs outside a hand-over. A hand-over
  lets the next go a moment after it locked the last, so a sample may see both:
  a violation is the same two (or more) tenants running in two samples in a
  row. A tenant an operator released runs on their word and does not count;
  nor does any sample while the judge is paused (kiwid down or restarting, the
  GPU lost and until kiwid gates again).
* **rotation**: a healthy tenant (not the one the fault was injected into, not
  stuck, not released) makes progress at least every ``bound_s`` seconds of
  unpaused time.

Each violation is counted against the cell running when it was seen, with a
line saying what was seen. Hand-overs (the one running tenant changing) are
counted too.

Not a benchmark itself.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from _faults_rig import Daemon, Snapshot, Tenant


class Sampled(Protocol):
    """What the judge reads of a rig."""

    daemon: Daemon
    tenants: list[Tenant]

    def snapshot(self) -> Snapshot: ...


@dataclass
class Counts:
    """Violations and events seen in one cell."""

    window: int = 0
    rotation: int = 0
    handovers: int = 0


@dataclass
class Judge:
    """Samples a rig from two threads; counts what it sees against the current cell."""

    rig: Sampled
    bound_s: float
    interval_s: float = 0.05
    cell: str = "set-up"
    counts: dict[str, Counts] = field(default_factory=lambda: collections.defaultdict(Counts))
    details: list[str] = field(default_factory=list)
    states: dict[str, str] = field(default_factory=dict)
    """Each tenant's state by kiwid's last status (by tenant name)."""
    stuck_since: dict[str, float] = field(default_factory=dict)
    """When each stuck tenant was first seen stuck (monotonic)."""
    exempt: set[str] = field(default_factory=set)
    """Tenants the rotation does not judge now (the fault's target)."""
    released: set[str] = field(default_factory=set)
    """Tenants the operator released (not judged by windows or rotation)."""
    progress_total: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    _pauses: set[str] = field(default_factory=set)
    _resume_when_gated: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _previous: set[str] | None = None
    _in_window: bool = False
    _last: dict[str, tuple[float, float]] = field(default_factory=dict)  # progress, when
    _late: set[str] = field(default_factory=set)
    _holder: str | None = None
    _errors: int = 0

    # ------------------------------------------------------------ control

    def start(self) -> None:
        for target in (self._card_loop, self._status_loop):
            thread = threading.Thread(target=target, daemon=True, name=target.__name__)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def begin(self, cell: str, target: str | None) -> None:
        with self._lock:
            self.cell = cell
            self.exempt = {target} if target else set()

    def pause(self, why: str) -> None:
        """Judge nothing until :meth:`resume` (kiwid down, the GPU lost)."""
        with self._lock:
            self._pauses.add(why)
            self._resume_when_gated = None

    def resume(self, why: str, grace_s: float) -> None:
        """Judge again once at most one tenant runs, or after ``grace_s`` at the latest."""
        with self._lock:
            self._pauses.discard(why)
            if not self._pauses:
                self._resume_when_gated = time.monotonic() + grace_s

    def set_released(self, name: str, released: bool) -> None:
        """An operator released ``name`` (or brought it back): windows leave it out."""
        with self._lock:
            if released:
                self.released.add(name)
            else:
                self.released.discard(name)

    def paused(self) -> bool:
        with self._lock:
            return bool(self._pauses) or self._resume_when_gated is not None

    def stuck(self) -> dict[str, float]:
        """The stuck tenants by name, with when they were first seen stuck."""
        with self._lock:
            return dict(self.stuck_since)

    def note(self, line: str) -> None:
        with self._lock:
            self.details.append(f"[{self.cell}] {line}")

    # ------------------------------------------------------------ sampling

    def _status_loop(self) -> None:
        names = {t.key: t.name for t in self.rig.tenants}
        while not self._stop.wait(0.1):
            status = self.rig.daemon.status()
            if status is None:
                continue
            states = {}
            for gpu in status.get("gpus", []):
                for tenant in gpu.get("tenants", []):
                    states[names.get(tenant["id"], tenant["id"])] = tenant["state"]
            now = time.monotonic()
            with self._lock:
                self.states = states
                for name, state in states.items():
                    if state == "stuck":
                        self.stuck_since.setdefault(name, now)
                    else:
                        self.stuck_since.pop(name, None)

    def _card_loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                snap = self.rig.snapshot()
            except (OSError, ValueError) as err:  # a file of the card mid-write
                self._errors += 1
                if self._errors < 5:
                    self.note(f"sample failed: {err}")
            else:
                self._judge(snap, started)
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def _judge(self, snap: Snapshot, now: float) -> None:
        with self._lock:
            self.samples += 1
            counts = self.counts[self.cell]
            for name, value in snap.progress.items():
                self.progress_total[name] = value
            released = {n for n, state in self.states.items() if state == "released"}
            running = snap.running - self.released - released
            if len(running) == 1:
                (one,) = running
                if one != self._holder:
                    counts.handovers += self._holder is not None
                    self._holder = one
            if snap.lost:
                self._pauses.add("lost")
            elif "lost" in self._pauses:
                self._pauses.discard("lost")
                if not self._pauses:
                    self._resume_when_gated = now + 10
            gated = len(running) <= 1
            resumes = self._resume_when_gated is not None and not self._pauses
            if resumes and (gated or now >= (self._resume_when_gated or 0)):
                self._resume_when_gated = None
            if self._pauses or self._resume_when_gated is not None:
                self._previous = None
                self._in_window = False
                self._last = {n: (v, now) for n, v in snap.progress.items()}
                self._late.clear()
                return
            self._windows(running, counts, snap.detail)
            self._rotation(snap, now, counts)

    def _windows(self, running: set[str], counts: Counts, detail: str) -> None:
        previous, self._previous = self._previous, running
        both = running & previous if previous is not None else set()
        if len(both) >= 2:
            if not self._in_window:
                counts.window += 1
                states = {n: self.states.get(n, "?") for n in sorted(both)}
                self.details.append(
                    f"[{self.cell}] window: {sorted(both)} ran together; kiwid said {states}; "
                    f"the card: {detail}"
                )
            self._in_window = True
        else:
            self._in_window = False

    def _rotation(self, snap: Snapshot, now: float, counts: Counts) -> None:
        for name, value in snap.progress.items():
            last, when = self._last.get(name, (value, now))
            healthy = (  # a tenant kiwid does not list (None) should get turns too
                name not in self.exempt
                and name not in self.released
                and self.states.get(name) not in ("stuck", "released")
            )
            if value > last or not healthy:
                self._last[name] = (value, now)
                self._late.discard(name)
                continue
            self._last[name] = (last, when)
            if now - when > self.bound_s and name not in self._late:
                self._late.add(name)
                counts.rotation += 1
                self.details.append(
                    f"[{self.cell}] rotation: {name} made no progress for {now - when:.1f} s "
                    f"(bound {self.bound_s:.1f} s; states {dict(sorted(self.states.items()))}; "
                    f"the card: {snap.detail})"
                )

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {
                "samples": self.samples,
                "progress": dict(self.progress_total),
                "handovers": sum(c.handovers for c in self.counts.values()),
            }
