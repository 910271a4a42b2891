"""Property-based tests of the scheduling core over random event sequences.

The core runs against a small model of the world it drives: a gate takes (or fails)
only when the test answers it, in an order hypothesis draws; an ungate may fail;
any tenant may get stuck, and an operator may retry or release it. What the world
does is the truth the core's decisions are checked against:

* the core never lets a tenant go onto a gating GPU where another bursting tenant
  may run (one whose gate was not answered, or did not take);
* the core never believes a tenant is gated while the world has it running;
* a stuck tenant is never let go, swapped or granted until an operator asks;
* FIFO within a class, a ledger that adds up, no deadlock, bounded waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kiwid.core.actions import (
    Action,
    Converge,
    Fence,
    Gate,
    Release,
    Retry,
    SwapIn,
    SwapOut,
    Ungate,
)
from kiwid.core.events import (
    ActivitySeen,
    Converged,
    Event,
    FootprintSeen,
    Gated,
    GpusConfigured,
    Mended,
    ReleaseAsked,
    Released,
    RetryAsked,
    SwapFinished,
    TenantAttached,
    TenantDetached,
    TenantFaulted,
    TenantPolicySet,
    Tick,
    Ungated,
    WakeAsked,
)
from kiwid.core.model import GpuPolicy, Mode, SwapMode, TenantPolicy, TenantState
from kiwid.core.residency import Residency
from kiwid.core.scheduler import Scheduler
from tests.helpers import steps as clock_steps

GiB = 2**30
GPUS = ("0", "1", "2")
TENANTS = tuple(f"t{i}" for i in range(6))
S = TenantState
BURSTING = (S.HOLDER, S.WAITING, S.CORUNNING, S.STUCK, S.PARKED)
"""Tenants that must be held while another is let go on their GPUs (a parked one too:
it was gated when it parked, and may run until that gate took)."""
RUNNING = (S.HOLDER, S.CORUNNING)
"""Tenants in a burst whose running matters (a released one runs on an operator's word)."""

policies = st.builds(
    GpuPolicy,
    tq_s=st.sampled_from([1.0, 5.0, 30.0]),
    idle_release_s=st.sampled_from([0.5, 5.0]),
    mode=st.sampled_from(list(Mode)),
    capacity_bytes=st.just(80 * GiB),
    reserve_bytes=st.just(GiB),
    preempt_after_s=st.sampled_from([0.0, 0.0, 3.0]),
    max_wait_s=st.sampled_from([None, None, 20.0]),
    swap=st.sampled_from([SwapMode.NONE, SwapMode.AUTO, SwapMode.CHECKPOINT]),
    park=st.booleans(),
)
gpu_sets = st.frozensets(st.sampled_from(GPUS), min_size=1, max_size=3)
tenants = st.sampled_from(TENANTS)
# Scripts start with a few tenants attached, then mostly activity and time, so that
# bursts overlap and tenants queue, are gated and rotate in most examples (random
# steps alone rarely got two tenants bursting on one GPU).
openings = st.lists(st.builds(TenantAttached, tenants, gpu_sets), min_size=2, max_size=6)


@dataclass(frozen=True)
class Answer:
    """The world answers the oldest outstanding job of one tenant (index into the list)."""

    pick: int
    ok: bool


@dataclass(frozen=True)
class Trouble:
    """Something happens to a tenant: a fault (contained or not), or an operator's ask."""

    tenant: str
    what: str


def steps_with(gpu_policies: st.SearchStrategy[GpuPolicy]) -> st.SearchStrategy[object]:
    """Random steps: tenants come, go and burst, footprints and policies change, time
    passes, the world answers gates and ungates, tenants get stuck, operators act."""
    return st.one_of(
        st.builds(TenantAttached, tenants, gpu_sets),
        st.builds(TenantDetached, tenants),
        st.builds(ActivitySeen, tenants),
        st.builds(ActivitySeen, tenants),
        st.builds(ActivitySeen, tenants),
        st.builds(
            FootprintSeen,
            tenants,
            st.sampled_from(GPUS),
            st.integers(0, 60).map(lambda g: g * GiB),
        ),
        st.builds(GpusConfigured, st.fixed_dictionaries(dict.fromkeys(GPUS, gpu_policies))),
        st.builds(
            TenantPolicySet,
            tenants,
            st.builds(
                TenantPolicy,
                weight=st.sampled_from([0.5, 1.0, 3.0]),
                priority=st.integers(0, 2),
                tq_s=st.sampled_from([None, None, 2.0]),
                park=st.sampled_from([True, True, False]),
            ),
        ),
        st.builds(WakeAsked, tenants, st.sampled_from(["request", "operator"])),
        st.builds(Answer, st.integers(0, 5), st.sampled_from([True, True, True, False])),
        st.builds(Answer, st.integers(0, 5), st.just(True)),
        st.builds(
            Trouble, tenants, st.sampled_from(["stuck", "stuck", "retry", "release", "retry"])
        ),
        st.floats(0.01, 40.0),  # time passes
        st.floats(0.01, 40.0),
    )


steps = steps_with(policies)


@dataclass
class Run:
    """Drives a scheduler like the daemon does, against a model of the world."""

    sched: Scheduler
    now: float = 0.0
    answer_at_once: bool = False
    """Every job succeeds as soon as it is asked (a world without faults)."""
    jobs: dict[str, list[Action]] = field(default_factory=dict)
    """Per tenant, the jobs asked and not answered yet, oldest first."""
    frozen: set[str] = field(default_factory=set)
    """Tenants the world has gated (their gate took, and no ungate since)."""
    gated: set[str] = field(default_factory=set)
    """Tenants the core should believe gated, by the actions and answers so far."""
    asked: dict[str, type] = field(default_factory=dict)
    """Operators' asks (Retry or Release) not answered yet."""
    wait_started: dict[str, float] = field(default_factory=dict)
    attached_at: dict[str, float] = field(default_factory=dict)
    longest_wait: float = 0.0
    answers: list[Event] = field(default_factory=list)
    """Answers given and not fed to the core yet."""

    # ---- driving ------------------------------------------------------------

    def feed(self, event: Event) -> None:
        todo = self.answers = [event]
        while todo:
            event = todo.pop(0)
            if isinstance(event, TenantAttached):
                self.attached_at.setdefault(event.tenant, self.now)
            before = self.sched.view(self.now)
            tenant = getattr(event, "tenant", "")
            epoch = getattr(event, "epoch", None)
            current = epoch is None or epoch == self.sched.epoch(tenant)
            was_stuck = self.sched.tenant_state(tenant) is S.STUCK
            if current:
                self.note(event, was_stuck)
            actions = self.sched.handle(event, self.now)
            stuck = self.sched.tenant_state(tenant) is S.STUCK
            if isinstance(event, TenantFaulted) and stuck and current:
                (self.gated.add if event.contained else self.gated.discard)(event.tenant)
                self.asked.pop(event.tenant, None)  # its epoch moved: the ask is moot
            if isinstance(event, Released) and stuck and current:
                self.asked.pop(event.tenant, None)
            if isinstance(event, TenantDetached) and event.tenant not in self.sched.tenant_ids():
                self.jobs.pop(event.tenant, None)
                self.frozen.discard(event.tenant)
                self.asked.pop(event.tenant, None)
            for action in actions:
                self.jobs.setdefault(action.tenant, []).append(action)
            self.check(event, actions, before)
            if isinstance(event, TenantDetached) and event.tenant not in self.sched.tenant_ids():
                self.attached_at.pop(event.tenant, None)
            if self.answer_at_once:
                while any(self.jobs.values()):
                    todo += self.answer(next(t for t, j in self.jobs.items() if j), ok=True)

    def settle(self, rounds: int = 500) -> None:
        """The world answers everything still asked of it, a second apart, until it stops."""
        for _ in range(rounds):
            if not any(self.jobs.values()):
                return
            self.step(Answer(0, ok=True))
            self.pass_time(1.0)

    def pass_time(self, seconds: float) -> None:
        """Advance, waking at every deadline on the way (as the daemon does)."""
        for step in clock_steps(lambda: self.now, self.sched.next_deadline, seconds):
            self.now += step
            self.feed(Tick())

    def step(self, step: object) -> None:
        if isinstance(step, float):
            self.pass_time(step)
        elif isinstance(step, Answer):
            waiting = sorted(t for t, j in self.jobs.items() if j)
            if waiting:
                for event in self.answer(waiting[step.pick % len(waiting)], ok=step.ok):
                    self.feed(event)
        elif isinstance(step, Trouble):
            self.trouble(step)
        elif isinstance(step, ActivitySeen) and step.tenant in self.frozen:
            return  # a frozen or locked tenant does no GPU work (its unlock not back yet)
        else:
            assert isinstance(step, Event.__args__)  # type: ignore[attr-defined]
            self.feed(step)

    def answer(self, tenant: str, *, ok: bool) -> list[Event]:
        """The world carries out ``tenant``'s oldest job; what the core hears of it.

        As the engine does, a job asked in an epoch the tenant has left is moot: it
        is dropped, never carried out (a converge reads what is wanted as it runs).
        """
        job = self.jobs[tenant].pop(0)
        e = job.epoch
        if not isinstance(job, Converge) and e != self.sched.epoch(tenant):
            if isinstance(job, Retry | Release):
                self.asked.pop(tenant, None)
            return []
        match job:
            case Gate():
                if ok:
                    self.frozen.add(tenant)
                    return [Gated(tenant, epoch=e)]
                why = "the freeze timed out"
                return [TenantFaulted(tenant, "gate", why, contained=False, epoch=e)]
            case Ungate():
                if ok or tenant not in self.frozen:  # nothing to thaw cannot fail
                    self.frozen.discard(tenant)
                    return [Ungated(tenant, epoch=e)]
                why = "cgroup.freeze refused"
                return [TenantFaulted(tenant, "ungate", why, contained=True, epoch=e)]
            case Retry():
                self.asked.pop(tenant, None)
                self.frozen.add(tenant)
                if ok:
                    return [Mended(tenant, Residency.RESIDENT, epoch=e)]
                return [TenantFaulted(tenant, "retry", "still out of step", epoch=e)]
            case Release():
                self.asked.pop(tenant, None)
                if ok:
                    self.frozen.discard(tenant)
                    return [Released(tenant, complete=True, epoch=e)]
                held = tenant in self.frozen
                why = "pid 7: unlock refused"
                return [Released(tenant, False, why, contained=held, epoch=e)]
            case Converge():
                want = self.sched.want(tenant)
                if want is None:
                    return []
                (self.frozen.add if want.gated else self.frozen.discard)(tenant)
                found = want.memory or Residency.RESIDENT  # driven where wanted
                return [Converged(tenant, not want.gated, found, epoch=want.epoch)]
            case Fence():
                self.frozen.add(tenant)
                return [Converged(tenant, False, None, epoch=e)]
            case SwapOut() | SwapIn():
                way = "out" if isinstance(job, SwapOut) else "in"
                size = sum(self.sched.peak(tenant).values())
                moved = size if ok else 0
                return [SwapFinished(tenant, way, ok, moved, 1.0, reason="no", epoch=e)]
        return []

    def trouble(self, trouble: Trouble) -> None:
        tenant = trouble.tenant
        if tenant not in self.sched.tenant_ids():
            return
        if trouble.what == "stuck":
            # The shell fenced it (the freezer) before it said so: it does not run.
            self.frozen.add(tenant)
            epoch = self.sched.epoch(tenant) or 0
            hung = TenantFaulted(
                tenant, "swap-out", "checkpoint hung", Residency.UNKNOWN, epoch=epoch
            )
            self.feed(hung)
        elif trouble.what == "retry":
            self.feed(RetryAsked(tenant))
        else:
            self.feed(ReleaseAsked(tenant))

    def note(self, event: Event, stuck: bool) -> None:
        """What the core should believe gated once ``event`` (of the epoch now) is in.

        (A fault: see ``feed``.)
        """
        if isinstance(event, Mended):
            self.gated.add(event.tenant)
        elif isinstance(event, Released) and event.complete:
            self.gated.discard(event.tenant)
        elif isinstance(event, Converged) and stuck:
            (self.gated.discard if event.runs else self.gated.add)(event.tenant)

    # ---- checking ------------------------------------------------------------

    def check(self, event: Event, actions: list[Action], before: object) -> None:
        existing = self.sched.tenant_ids()
        assert all(a.tenant in existing for a in actions), (event, actions)
        view = self.sched.view(self.now)
        by_id = {t.tenant: t for t in view.tenants}
        gating = {g.gpu for g in view.gpus if g.gating}
        self.gated &= existing
        for action in actions:
            t = by_id[action.tenant]
            if isinstance(action, Gate):
                assert action.tenant not in self.gated, f"double gate {action}"
                self.gated.add(action.tenant)
            elif isinstance(action, Ungate):
                assert action.tenant in self.gated, f"ungate of an ungated {action}"
                assert t.state is not S.STUCK, f"a stuck tenant let go: {action}"
                self.gated.discard(action.tenant)
                # Never let go where another bursting tenant may run.
                for other in view.tenants:
                    shared = other.gpus & t.gpus & gating
                    if other.tenant == t.tenant or not shared or other.state not in BURSTING:
                        continue
                    assert other.tenant in self.frozen and not other.gate_pending, (
                        f"{action} while {other.tenant} may run on GPU {shared}"
                    )

            elif isinstance(action, Retry | Release):
                assert self.asked.get(action.tenant) is None, f"twice {action}"
                assert t.state is S.STUCK, action
                self.asked[action.tenant] = type(action)
            elif isinstance(action, Converge | Fence):
                pass  # asked after a fault, or an answer of an old epoch: any time
            else:  # swaps: only of gated tenants that are not stuck
                assert t.state is not S.STUCK and t.gated, action
                # A parked tenant's memory stays in host RAM: it is never restored.
                assert not (isinstance(action, SwapIn) and t.state is S.PARKED), action
        assert self.gated == {t.tenant for t in view.tenants if t.gated}, (event, actions)
        # Per gating GPU, one tenant at most runs or will once its unlock returns (an
        # unlock of the tenant's epoch now, not followed by a gate): a tenant whose
        # unlock is slow shows no work, and must not be taken for an idle one that lets
        # the next run beside it. An unlock of an epoch the tenant has left is moot: it
        # is dropped, never carried out (``answer``; the engine's lanes do the same).
        unlocking = set()
        for tenant, jobs in self.jobs.items():
            kinds = [type(j) for j in jobs if j.epoch == self.sched.epoch(tenant)]
            if Ungate in kinds and Gate not in kinds[kinds.index(Ungate) :]:
                unlocking.add(tenant)
        for gpu in gating:
            on = {
                t.tenant
                for t in view.tenants
                if gpu in t.gpus and (t.tenant in unlocking or (t.state in RUNNING and not t.gated))
            }
            assert len(on) <= 1, f"{sorted(on)} run on GPU {gpu} ({event}, {actions})"

        for t in view.tenants:
            # The core never believes a tenant gated while the world has it running
            # (unless a job that gates it is still under way).
            if t.gated and not t.gate_pending and t.tenant not in self.frozen:
                pending = any(isinstance(j, Retry) for j in self.jobs.get(t.tenant, []))
                assert pending, f"{t.tenant} runs, gated in the core ({event})"
            if t.state is S.WAITING:
                assert t.gated, f"{t.tenant} waits ungated"
            if t.state is S.PARKED:  # gated, its memory off the card or on its way
                assert t.gated, f"{t.tenant} parked ungated"
                assert t.residency in (Residency.SWAPPING_OUT, Residency.HOST), t
            if t.state is S.STUCK:
                assert t.fault is not None
                # Gated as it is contained, or (not contained) while its gate is tried again.
                assert t.gated == t.fault.contained or (t.gated and t.gate_pending), t
            else:
                assert t.fault is None
        # One holder per gating GPU; never a holder on a GPU a loose tenant keeps.
        for gpu in view.gpus:
            if not gpu.gating:
                continue
            running = [
                t.tenant
                for t in view.tenants
                if gpu.gpu in t.gpus and t.state in (S.HOLDER, S.CORUNNING)
            ]
            assert len(running) <= 1, (gpu.gpu, running)
            assert all(t.state is not S.CORUNNING for t in view.tenants if gpu.gpu in t.gpus)
        # FIFO: nobody is granted while someone ahead of it on a shared GPU still waits.
        assert isinstance(before, type(view))
        states_now = {t.tenant: t.state for t in view.tenants}
        was_waiting = {t.tenant for t in before.tenants if t.state is S.WAITING}
        gpus_now = {t.tenant: t.gpus for t in view.tenants}
        rank = {t.tenant: (t.boosted, t.policy.priority) for t in view.tenants}
        # One whose memory is still moving may be passed over (its move runs late), and
        # one whose memory could not come back steps aside for a TQ: both say why.
        aside = {t.tenant for t in view.tenants if t.residency.moving or t.waiting_for}
        for gpu in before.gpus:
            order = [w.tenant for w in gpu.waiters]
            assert not {o for o in order if states_now.get(o) is S.PARKED}, "parked in a queue"
            for i, tenant in enumerate(order):
                if tenant in was_waiting and states_now.get(tenant) is S.HOLDER:
                    ahead = [
                        a
                        for a in order[:i]
                        if states_now.get(a) is S.WAITING  # and still on a GPU it wants,
                        and a not in aside
                        and gpus_now.get(a, frozenset()) & gpus_now.get(tenant, frozenset())
                        and rank[a] >= rank[tenant]  # in a class as high (FIFO is per class)
                    ]
                    assert not ahead, f"{tenant} overtook {ahead} on GPU {gpu.gpu}"
        # The ledger accounts for every second since a tenant appeared.
        for t in view.tenants:
            assert abs(t.ledger.total_s - (self.now - self.attached_at[t.tenant])) < 1e-6
            assert t.ledger.quanta >= t.ledger.preempted + t.ledger.early_releases
        # No deadlock: while anyone waits, the core has a reason to wake or an answer
        # is outstanding.
        waiting = {t.tenant for t in view.tenants if t.state is S.WAITING}
        if waiting and not any(self.jobs.values()) and not self.answers:
            assert self.sched.next_deadline() is not None
        # Waits, measured exactly at the event that starts or ends them.
        for tenant in existing | set(self.wait_started):
            if tenant in waiting:
                self.wait_started.setdefault(tenant, self.now)
            elif tenant in self.wait_started:
                started = self.wait_started.pop(tenant)
                self.longest_wait = max(self.longest_wait, self.now - started)


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(dict.fromkeys(GPUS, policies)),
    openings,
    st.lists(steps, min_size=10, max_size=80),
)
def test_invariants_hold_over_random_event_sequences(
    initial: dict[str, GpuPolicy], opening: list[Event], script: list[object]
) -> None:
    run = Run(Scheduler(initial))
    for step in [*opening, *script]:
        run.step(step)
    run.settle()  # the world answers everything still asked of it; it all settles
    assert not any(run.jobs.values()), f"jobs keep coming: {run.jobs}"


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(2, 6),
    tq=st.sampled_from([1.0, 7.5, 30.0]),
    arrivals=st.lists(st.floats(0, 20), min_size=6, max_size=6),
    pauses=st.lists(st.floats(0.05, 3.0), min_size=1, max_size=50),
    stuck=st.booleans(),
)
def test_no_starvation_every_waiter_is_granted_within_bound(
    n: int, tq: float, arrivals: list[float], pauses: list[float], stuck: bool
) -> None:
    """With n tenants always busy when let run, no wait exceeds (n-1)*TQ.

    Hand-overs are instantaneous in the core, so the allowance per hand-over is
    zero here; the daemon adds its own hand-over time on top. A stuck tenant
    (``stuck``) takes no turn and holds nobody up: the others still wait at most
    (n-2)*TQ.
    """
    run = Run(Scheduler({"0": GpuPolicy(tq_s=tq, idle_release_s=5.0)}), answer_at_once=True)
    names = TENANTS[:n]
    for name in names:
        run.feed(TenantAttached(name, frozenset({"0"})))
    order = sorted(zip(arrivals[:n], names, strict=True))
    for at, name in order:
        run.pass_time(max(0.0, at - run.now))
        run.feed(ActivitySeen(name))
    busy = list(names)
    if stuck:
        run.trouble(Trouble(names[0], "stuck"))
        busy.remove(names[0])
        run.wait_started.clear()
        run.longest_wait = 0.0
    for pause in pauses * 4:
        run.pass_time(pause)
        for name in busy:
            if run.sched.tenant_state(name) is not S.WAITING:
                run.feed(ActivitySeen(name))
    assert run.longest_wait <= (len(busy) - 1) * tq + 1e-9
