"""One run of the fault matrix, and the operator who deals with it (bench/driver_faults.py).

A run: pick a tenant at random and wait a random time into the rotation;
inject the cell's fault; watch until a tenant is stuck, or the fault is spent
and nothing came of it for a while (kiwid coped alone: ``absorbed``). Then the
operator: ``kiwictl retry`` after clearing the fault (``mended``) and
``kiwictl release`` (``released``; it runs on its own, then ``kiwictl retry``
brings it back into the rotation) in turn; every ``kill_every``-th run instead
clears the fault, kills kiwid with SIGKILL and runs ``kiwid recover``
(``recovered``), checks that every tenant runs with all its memory on the card,
and starts kiwid again. A stuck tenant that the operator's word does not bring
back, once every fault is cleared, is ``unresolved`` (counted), and kiwid is
killed and recovered to go on. After each run, every tenant's memory must be on
the card or recorded in the state file (what ``kiwid recover`` undoes).

Not a benchmark itself.
"""

from __future__ import annotations

import collections
import random
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from _faults_judge import Judge
from _faults_rig import Daemon, Snapshot, Tenant, wait_until

ENDINGS = ("absorbed", "mended", "released", "recovered", "unresolved")


class Rig(Protocol):
    """What a run needs of a backend (:mod:`_faults_double`, :mod:`_faults_sim`)."""

    name: str
    daemon: Daemon
    tenants: list[Tenant]
    tq: float
    driver_timeout: float
    gate_timeout: float

    def snapshot(self) -> Snapshot: ...
    def inject(self, op: str, kind: str, tenant: Tenant, rng: random.Random) -> str: ...
    def end_loss(self) -> None: ...
    def pending(self) -> bool: ...
    def clear(self) -> None: ...
    def memory_problems(self) -> list[str]: ...
    def prepare_recover(self) -> None: ...
    def recovered_problems(self) -> list[str]: ...
    def repair(self) -> list[str]: ...
    def hold(self, stop: bool) -> None: ...
    def after_restart(self) -> bool: ...


@dataclass
class CellResult:
    """What the runs of one (operation, kind) came to."""

    runs: int = 0
    memory: int = 0
    rotation: int = 0
    """Runs after which kiwid did not list a tenant whose processes live (it never gets a
    turn again); the judge counts the other rotation violations."""
    tracebacks: int = 0
    operator: int = 0
    """Operator's actions that left a tenant stuck once every fault was cleared."""
    endings: collections.Counter[str] = field(default_factory=collections.Counter)
    seconds: float = 0.0


@dataclass
class Matrix:
    """Runs cells against a started rig, judged by a running :class:`Judge`."""

    rig: Rig
    judge: Judge
    rng: random.Random
    kill_every: int = 5
    react_s: tuple[float, float] | None = None
    """How long the operator takes to act on a stuck tenant, drawn between the two
    (default: half to 1.2 times the rotation's bound, so that the others' turns
    are judged while it is stuck)."""
    results: dict[str, CellResult] = field(
        default_factory=lambda: collections.defaultdict(CellResult)
    )
    stuck_for: list[tuple[str, float]] = field(default_factory=list)
    """(cell, seconds a tenant stayed stuck until the operator acted)."""
    to_stuck: list[tuple[str, float]] = field(default_factory=list)
    """(cell, seconds from the fault's injection until a tenant was seen stuck)."""
    acted: list[tuple[str, str, float]] = field(default_factory=list)
    """(cell, action, seconds the operator's action took: kiwictl, and a release's return)."""
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    kills: int = 0
    handover_stats: list[tuple[int, float]] = field(default_factory=list)
    """kiwid's own hand-over histogram (count, sum of seconds), one per kiwid."""
    restarts: CellResult = field(default_factory=CellResult)
    """kiwid started again after each kill -9 and recover, while its tenants work:
    ``memory`` counts the restarts that left a tenant gated with no record, or set
    up no rotation."""
    index: int = 0
    _actions: int = 0

    @property
    def deadline_s(self) -> float:
        """The longest a driver call may take before its tenant is stuck (gate/ungate)."""
        return 2 * self.rig.driver_timeout + self.rig.gate_timeout

    @property
    def round_s(self) -> float:
        """One round of the rotation: every tenant's quantum."""
        return len(self.rig.tenants) * self.rig.tq

    # ------------------------------------------------------------ one run

    def run(self, op: str, kind: str) -> None:
        """One run of cell ``op/kind`` (see the module docstring)."""
        cell = f"{op}/{kind}"
        result = self.results[cell]
        self.index += 1
        started = time.monotonic()
        marks = self._marks()
        tenant = self._target(kind)
        self.judge.begin(cell, None if kind == "gpu-lost" else tenant.name)
        time.sleep(self.rng.uniform(0, self.round_s))
        what = self.rig.inject(op, kind, tenant, self.rng)
        injected = time.monotonic()
        if kind == "late-context":  # the container it announced is the one to watch
            tenant = self.rig.tenants[-1]
            self.judge.begin(cell, tenant.name)
        self.judge.note(f"run {self.index}: {what} ({tenant.name})")
        if kind == "gpu-lost":
            time.sleep(self.rng.uniform(0.5, 2 * self.rig.driver_timeout + 1))
            self.rig.end_loss()
        self._watch()
        stuck = self.judge.stuck()
        kill = self.kill_every > 0 and self.index % self.kill_every == 0
        if stuck:
            self.to_stuck.append((cell, min(stuck.values()) - injected))
            low, high = self.react_s or (0.5 * self.judge.bound_s, 1.2 * self.judge.bound_s)
            time.sleep(self.rng.uniform(low, high))  # the others rotate meanwhile
            stuck = self.judge.stuck()
        now = time.monotonic()
        self.stuck_for += [(cell, now - since) for since in stuck.values()]
        if not stuck:
            ending = "absorbed"
        elif kill:
            ending = "recovered"
        else:
            ending = self._operator(sorted(stuck), kind)
            self.acted.append((cell, ending, time.monotonic() - now))
        self.rig.clear()
        if ending == "unresolved":
            result.operator += 1
            kill = True
        problems = self._memory()
        forgotten = self._forgotten()
        if forgotten:  # nothing an operator can ask for: kiwid recover brings it back
            result.rotation += 1
            for line in forgotten:
                self.judge.note(f"rotation: {line}")
            kill = True
        if kill:
            problems += self.kill_and_recover()
        if problems:
            result.memory += 1
            for line in problems:
                self.judge.note(f"memory: {line}")
        result.tracebacks += self._tracebacks(marks)
        result.runs += 1
        result.endings[ending] += 1
        result.seconds += time.monotonic() - started

    def _forgotten(self) -> list[str]:
        """Tenants whose processes live that kiwid no longer lists (2 s to list them)."""

        def missing() -> list[str]:
            status = self.rig.daemon.status()
            if status is None:
                return ["kiwid does not answer"]
            listed = {t["id"] for gpu in status["gpus"] for t in gpu["tenants"]}
            return [
                f"kiwid does not list {t.name} ({t.key}), whose processes {t.pids()} live"
                for t in self.rig.tenants
                if t.pids() and t.key not in listed
            ]

        lines = missing()
        deadline = time.monotonic() + 2
        while lines and time.monotonic() < deadline:
            time.sleep(0.1)
            lines = missing()
        return lines

    def _target(self, kind: str) -> Tenant:
        if kind == "multi":
            return max(self.rig.tenants, key=lambda t: len(t.pids()))
        return self.rng.choice(self.rig.tenants)

    def _watch(self) -> None:
        """Until a tenant is stuck, or the fault is spent and nothing came of it."""
        settle = self.deadline_s + 1
        limit = time.monotonic() + 1.5 * self.round_s + 2 * self.deadline_s
        quiet_since: float | None = None
        while time.monotonic() < limit:
            if self.judge.stuck():
                return
            now = time.monotonic()
            if self.rig.pending():
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since > settle:
                return
            time.sleep(0.05)

    # ------------------------------------------------------------ the operator

    def _operator(self, names: list[str], kind: str = "") -> str:
        """Retry (after clearing the fault) or release, in turn; the other way if that fails.

        ``hang-retry`` and ``hang-release`` cells: that word comes while the call that
        made the tenant stuck still hangs (it waits behind the call); the fault is
        cleared then. Returns the ending: ``mended``, ``released``, or ``unresolved``
        when neither brought a tenant back.
        """
        first = ("retry", "release")[self._actions % 2]
        self._actions += 1
        early = kind in ("hang-retry", "hang-release")
        if early:
            first = kind.removeprefix("hang-")
        endings = []
        for tenant in [t for t in self.rig.tenants if t.name in names]:
            if first == "retry":
                ending = self._retry(tenant, clear_first=not early)
            else:
                ending = self._release(tenant)
            if ending == "unresolved":  # the operator tries the other way
                ending = self._release(tenant) if first == "retry" else self._retry(tenant)
                self.judge.note(f"{tenant.name}: the {first} failed; the other way: {ending}")
            endings.append(ending)
        return "unresolved" if "unresolved" in endings else endings[0]

    def _retry(self, tenant: Tenant, *, clear_first: bool = True) -> str:
        """Clear the fault, then ``kiwictl retry`` (waiting out a call not returned yet).

        Not ``clear_first``: the retry comes while the call hangs; it waits behind
        it (kiwictl says so), and runs once the fault is cleared.
        """
        if not clear_first:
            out = self.rig.daemon.ctl("retry", tenant.key)
            said = (out.stdout + out.stderr).strip()
            if "waits behind" not in said:
                self.judge.note(f"retry of {tenant.name} while its call hangs: {said}")
            self.rig.clear()
            return "mended" if self._settled(tenant, ("waiting", "holder")) else "unresolved"
        self.rig.clear()
        if self._ctl_retry(tenant, "mend"):
            return "mended"
        return "unresolved"

    def _settled(self, tenant: Tenant, states: tuple[str, ...]) -> bool:
        """Whether ``tenant`` reaches one of ``states`` (an operator's word that waited ran)."""
        deadline = 3 * self.deadline_s + 10
        if wait_until(lambda: self.judge.states.get(tenant.name) in states, deadline):
            return True
        self.judge.note(f"{tenant.name} is {self.judge.states.get(tenant.name)}, not {states}")
        return False

    def _ctl_retry(self, tenant: Tenant, why: str) -> bool:
        deadline = time.monotonic() + 3 * self.deadline_s + 10
        while True:
            out = self.rig.daemon.ctl("retry", tenant.key)
            said = (out.stdout + out.stderr).strip()
            if out.returncode == 0:
                return True
            waits = "has not returned since" in said or "under way" in said
            if waits and time.monotonic() < deadline:
                time.sleep(0.3)
                continue
            if why == "mend" and "not stuck" in said:
                return True  # kiwid's own gate, tried again every TQ, took meanwhile
            self.judge.note(f"retry ({why}) of {tenant.name} exited {out.returncode}: {said}")
            return False

    def _release(self, tenant: Tenant) -> str:
        """``kiwictl release`` (the fault cleared first if it holds); it runs; then back."""
        self.judge.set_released(tenant.name, True)  # from the operator's word on, it may run
        out = self.rig.daemon.ctl("release", tenant.key)
        said = (out.stdout + out.stderr).strip()
        code = out.returncode
        if "waits behind" in said:  # taken: it runs once the hung call returns
            self.rig.clear()
            code = 0 if self._settled(tenant, ("released",)) else 1
        elif code != 0 and "not stuck" not in said:  # the fault holds: clear it
            self.rig.clear()
            time.sleep(0.2)
            out = self.rig.daemon.ctl("release", tenant.key)
            said, code = (out.stdout + out.stderr).strip(), out.returncode
            if "released already" in said:  # the first one went on past its answer
                code = 0
        if code != 0:
            self.judge.set_released(tenant.name, False)
            if "not stuck" in said:
                return "mended"  # kiwid's own gate, tried again every TQ, took meanwhile
            self.judge.note(f"release of {tenant.name} exited {code}: {said}")
            return "unresolved"
        before = self.rig.snapshot().progress[tenant.name]
        if not wait_until(lambda: self.rig.snapshot().progress[tenant.name] > before, 5):
            status = self.rig.daemon.ctl("status").stdout.strip().replace("\n", " | ")
            self.judge.note(
                f"{tenant.name} released, yet it made no progress in 5 s; the card: "
                f"{self.rig.snapshot().detail}; kiwid: {status}"
            )
        self.rig.clear()
        back = self._ctl_retry(tenant, "back into the rotation")

        def queued() -> bool:
            state = self.judge.states.get(tenant.name)
            runs = tenant.name in self.rig.snapshot().running
            return state == "holder" or (state == "waiting" and not runs)

        if back and not wait_until(queued, 10):
            self.judge.note(f"{tenant.name} not back in the rotation 10 s after the retry")
        self.judge.set_released(tenant.name, False)
        return "released" if back else "unresolved"

    # ------------------------------------------------------------ checks

    def _memory(self) -> list[str]:
        """Memory problems that last (read again over a second: a move may be under way)."""
        problems = self.rig.memory_problems()
        for _ in range(10):
            if not problems:
                return []
            time.sleep(0.1)
            problems = [p for p in self.rig.memory_problems() if p in problems]
        return problems

    def kill_and_recover(self) -> list[str]:
        """kill -9 kiwid, ``kiwid recover``; every tenant runs, all its memory back; restart.

        Returns what ``kiwid recover`` left undone (the run's memory violations). What
        it left the bench undoes by hand, so that kiwid then starts again from a
        clean state, while its tenants work, as systemd would restart it. A restart
        that does not set up the rotation, or leaves a tenant gated with no record,
        is counted in :attr:`restarts`; the bench then undoes that too and starts
        kiwid once more with its tenants stopped until it serves, so that the matrix
        can go on.
        """
        self.kills += 1
        self.judge.pause("kiwid")
        problems = self._kill_recover_check()
        for line in self.rig.repair():
            self.judge.note(f"bench, after kiwid recover: {line}")
        self.rig.daemon.start()
        self.restarts.runs += 1
        wrong = self._restarted()
        if wrong:
            self.restarts.memory += 1
            for line in wrong:
                self.judge.note(f"restart: with the tenants at work: {line}")
            self._kill_recover_check()
            for line in self.rig.repair():
                self.judge.note(f"bench, after the restart: {line}")
            self.rig.hold(True)
            try:
                self.rig.daemon.start()
            finally:
                self.rig.hold(False)
            for line in self._restarted():
                self.judge.note(f"restart: with the tenants stopped: {line}")
        for tenant in self.rig.tenants:
            self.judge.set_released(tenant.name, False)
        self.judge.resume("kiwid", self.deadline_s)
        return problems

    def _restarted(self) -> list[str]:
        wrong = [] if self.rig.after_restart() else ["no rotation 30 s after the start"]
        return wrong + self._memory()

    def _kill_recover_check(self) -> list[str]:
        self.rig.clear()
        self._keep_handovers()
        daemon = self.rig.daemon
        daemon.kill9()
        self.rig.prepare_recover()
        out = daemon.recover()
        problems = []
        if out.returncode != 0:
            errors = [line for line in out.stderr.splitlines() if "[ERROR]" in line]
            problems.append(f"kiwid recover exited {out.returncode}: {' | '.join(errors)}")
        problems += self.rig.recovered_problems()
        before = self.rig.snapshot().progress

        def all_ran() -> bool:
            now = self.rig.snapshot().progress
            return all(now[n] > before[n] for n in now)

        if not wait_until(all_ran, 5):
            problems.append("not every tenant made progress within 5 s of kiwid recover")
        return problems

    def _keep_handovers(self) -> None:
        status = self.rig.daemon.status()
        if status is not None:
            histogram = status["gpus"][0].get("handover_seconds") or {}
            self.handover_stats.append((histogram.get("count", 0), histogram.get("sum", 0.0)))

    def _marks(self) -> dict[str, int]:
        daemon = self.rig.daemon
        return {str(p): p.stat().st_size for p in [*daemon.logs, *daemon.recover_logs]}

    def _tracebacks(self, marks: dict[str, int]) -> int:
        daemon = self.rig.daemon
        found = 0
        for log in [*daemon.logs, *daemon.recover_logs]:
            with open(log, "rb") as f:
                f.seek(marks.get(str(log), 0))
                text = f.read().decode(errors="replace")
            found += text.count("Traceback (most recent call last)")
        return found

    def finish(self) -> dict[str, Any]:
        """The figures of the whole matrix (after the last run)."""
        self._keep_handovers()
        return {"kills": self.kills, "handover_stats": self.handover_stats}
