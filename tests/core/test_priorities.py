"""Weights, priorities, preemption by suspension and ``max_wait``, in the pure core."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiwid.core.actions import Action, Gate, SwapIn, SwapOut, Ungate
from kiwid.core.clock import FakeClock
from kiwid.core.events import (
    ActivitySeen,
    Event,
    FootprintSeen,
    Gated,
    SwapFinished,
    TenantAttached,
    TenantPolicySet,
    Tick,
    Ungated,
)
from kiwid.core.model import GpuPolicy, SwapMode, TenantPolicy, TenantState, TenantSwap
from kiwid.core.residency import Residency
from kiwid.core.scheduler import Scheduler
from kiwid.core.view import TenantView
from tests.helpers import steps

S = TenantState
GiB = 2**30
POLL_S = 0.5


class Node:
    """One GPU, a fake clock, tenants that are busy whenever they are let go."""

    def __init__(self, **policy: object) -> None:
        self.clock = FakeClock(0.0)
        self.policy = GpuPolicy(**{"tq_s": 10.0, "idle_release_s": 5.0, **policy})  # type: ignore[arg-type]
        self.sched = Scheduler({"0": self.policy})
        self.busy: set[str] = set()
        self.actions: list[Action] = []
        self.grants: list[str] = []

    def do(self, event: Event) -> list[Action]:
        """Handle ``event``; gates, ungates and swaps are carried out (and reported) at once."""
        out = self.sched.handle(event, self.clock.now())
        self.actions += out
        self.grants += [c.tenant for c in self.sched.drain_transitions() if c.new is S.HOLDER]
        for action in list(out):
            if isinstance(action, SwapOut | SwapIn):
                direction = "out" if isinstance(action, SwapOut) else "in"
                out += self.do(SwapFinished(action.tenant, direction, True, epoch=action.epoch))
            elif isinstance(action, Gate):
                out += self.do(Gated(action.tenant, epoch=action.epoch))
            elif isinstance(action, Ungate):
                out += self.do(Ungated(action.tenant, epoch=action.epoch))
        return out

    def join(self, name: str, *, weight: float = 1.0, priority: int = 0, **kw: object) -> None:
        self.do(TenantAttached(name, frozenset({"0"})))
        self.do(TenantPolicySet(name, TenantPolicy(weight=weight, priority=priority, **kw)))  # type: ignore[arg-type]
        self.busy.add(name)
        self.do(ActivitySeen(name))

    def run(self, seconds: float, on_poll: object = None) -> None:
        """Time passes, polled every 0.5 s: busy tenants show activity when let go."""
        for step in steps(self.clock.now, self.sched.next_deadline, seconds, max_step=POLL_S):
            self.clock.advance(step)
            self.do(Tick())
            for name in sorted(self.busy):
                if not self.sched.gated(name):
                    self.do(ActivitySeen(name))
            if callable(on_poll):
                on_poll()

    def tenants(self) -> dict[str, TenantView]:
        return {t.tenant: t for t in self.sched.view(self.clock.now()).tenants}

    def holder(self) -> str | None:
        return self.sched.view(self.clock.now()).gpus[0].holder


def test_quantum_is_tq_times_weight_and_shares_follow_the_weights() -> None:
    node = Node(tq_s=1.0)
    for name, weight in (("a", 1), ("b", 2), ("c", 3)):
        node.join(name, weight=weight)
    node.run(600)
    views = node.tenants()
    assert views["b"].quantum_s == 2.0
    held = {n: v.ledger.holding_s for n, v in views.items()}
    total = sum(held.values())
    for name, weight in (("a", 1), ("b", 2), ("c", 3)):
        assert held[name] / total == pytest.approx(weight / 6, abs=0.01)
        # Entitled and received agree for tenants that always saturate.
        assert views[name].ledger.entitled_s == pytest.approx(held[name], rel=0.02)


def test_a_higher_priority_burst_suspends_the_holder_at_once() -> None:
    node = Node()
    node.join("low")
    node.run(3)  # low holds, 3 s into its 10 s quantum
    node.join("high", priority=10)
    assert node.holder() == "high"
    assert node.actions[-3:] == [Gate("high"), Gate("low"), Ungate("high")]
    low = node.tenants()["low"]
    assert low.state is S.WAITING and low.gated
    assert low.ledger.preempted == low.ledger.preempted_priority == 1
    assert low.last_preemption == (3.0, "priority", "high")
    assert low.quantum_s == pytest.approx(7.0)  # the rest of its quantum


def test_preempt_after_lets_the_holder_finish_that_much_of_its_quantum() -> None:
    node = Node(preempt_after_s=4.0)
    node.join("low")
    node.run(1)
    node.join("high", priority=1)
    assert node.holder() == "low"
    node.run(2.9)
    assert node.holder() == "low"
    node.run(0.2)  # 4 s into low's quantum
    assert node.holder() == "high"


def test_the_preempted_holder_goes_first_in_its_class_with_the_rest_of_its_quantum() -> None:
    node = Node()
    node.join("a")
    node.join("b")  # waits behind a, in a's class
    node.run(4)  # a: 4 s of its 10
    node.join("vip", priority=5)
    node.busy.discard("vip")  # vip's burst is short: it goes idle after idle_release
    node.run(5.5)
    # a comes back before b (front of the class), for the 6 s it had left.
    assert node.holder() == "a"
    a = node.tenants()["a"]
    assert a.quantum_s == pytest.approx(6.0)
    assert a.last_preemption is not None and a.last_preemption[:2] == (4.0, "priority")
    node.run(6.5)
    assert node.holder() == "b"


def test_a_higher_class_holder_is_not_cut_for_lower_waiters() -> None:
    node = Node()
    node.join("high", priority=3)
    node.join("low")
    before = len(node.actions)
    node.run(100)
    assert node.holder() == "high"
    assert node.actions[before:] == [], "no pointless hand-over to itself"
    assert node.tenants()["low"].ledger.holding_s == 0
    assert node.tenants()["low"].ledger.entitled_s == 0  # a lower class is entitled to nothing


def test_max_wait_gives_a_starved_tenant_one_quantum() -> None:
    node = Node(max_wait_s=25.0)
    node.join("high", priority=3)
    node.join("high2", priority=3)
    node.join("low")
    node.run(24.9)
    assert node.tenants()["low"].ledger.holding_s == 0
    node.run(0.2)
    assert node.tenants()["low"].boosted
    node.run(10)  # the holder finishes its quantum, then low gets one
    assert node.holder() == "low"
    node.run(10.2)
    assert node.holder() in ("high", "high2")
    assert node.tenants()["low"].ledger.holding_s == pytest.approx(10.0, abs=POLL_S)


def test_swap_never_keeps_a_tenant_on_the_card_while_others_rotate_through_host_ram() -> None:
    node = Node(swap=SwapMode.CHECKPOINT, capacity_bytes=100 * GiB, reserve_bytes=GiB)
    node.join("pinned", swap=TenantSwap.NEVER)
    node.do(FootprintSeen("pinned", "0", 20 * GiB))
    for name in ("x", "y"):
        node.join(name)
        node.do(FootprintSeen(name, "0", 40 * GiB))
    seen: list[Action] = []
    for _ in range(40):
        out = list(node.actions)
        node.run(5)
        for action in node.actions[len(out) :]:
            seen.append(action)
            if isinstance(action, SwapOut | SwapIn):
                direction = "out" if isinstance(action, SwapOut) else "in"
                node.do(SwapFinished(action.tenant, direction, True, epoch=action.epoch))
    assert not [a for a in seen if isinstance(a, SwapOut) and a.tenant == "pinned"]
    assert [a for a in seen if isinstance(a, SwapOut) and a.tenant != "pinned"]
    assert node.tenants()["pinned"].residency is Residency.RESIDENT
    assert node.tenants()["pinned"].ledger.quanta >= 3


# ---------------------------------------------------------------- properties

weights = st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])


@settings(max_examples=150, deadline=None)
@given(st.lists(weights, min_size=2, max_size=5), st.sampled_from([1.0, 5.0, 30.0]))
def test_saturating_shares_are_the_weights_over_whole_rotations(ws: list[float], tq: float) -> None:
    node = Node(tq_s=tq)
    names = [f"t{i}" for i in range(len(ws))]
    for name, weight in zip(names, ws, strict=True):
        node.join(name, weight=weight)
    first = node.grants[0]
    # Until >= 50 quanta and a whole number of rotations (the first holds again).
    while len(node.grants) < 50 or node.grants[-1] != first:
        seen = len(node.grants)
        while len(node.grants) == seen:
            node.run(POLL_S)
    views = node.tenants()
    total = sum(v.ledger.holding_s for v in views.values())
    for name, weight in zip(names, ws, strict=True):
        share = views[name].ledger.holding_s / total
        assert share == pytest.approx(weight / sum(ws), abs=0.02), (name, ws)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(weights, st.integers(0, 2)), min_size=1, max_size=4),
    st.floats(0.0, 30.0),
    st.sampled_from([0.0, 2.0, 8.0]),
    st.integers(3, 9),
)
def test_a_higher_priority_burst_holds_within_preempt_after_and_a_poll(
    lower: list[tuple[float, int]], arrival: float, preempt_after: float, priority: int
) -> None:
    node = Node(tq_s=10.0, preempt_after_s=preempt_after)
    for i, (weight, prio) in enumerate(lower):
        node.join(f"t{i}", weight=weight, priority=prio)
    node.run(arrival)
    started = node.clock.now()
    node.join("vip", priority=priority)
    while node.holder() != "vip" or node.sched.gated("vip"):
        node.run(POLL_S)
        assert node.clock.now() - started <= preempt_after + POLL_S + 1e-9


class Watch:
    """Checks, at every poll, who holds against who waits, and the longest waits."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.waiting_since: dict[str, float] = {}
        self.longest: dict[str, float] = {}
        self.boosted_holder = False

    def __call__(self) -> None:
        now = self.node.clock.now()
        views = self.node.tenants()
        holder = self.node.holder()
        for name, view in views.items():
            if view.state is S.WAITING:
                self.waiting_since.setdefault(name, now)
                self.longest[name] = max(
                    self.longest.get(name, 0.0), now - self.waiting_since[name]
                )
            else:
                self.waiting_since.pop(name, None)
        if holder is None or self.node.sched.gated(holder):
            return
        h = views[holder]
        preempt_after = self.node.policy.preempt_after_s
        for name, view in views.items():
            if (
                view.state is S.WAITING
                and view.policy.priority > h.policy.priority
                and not h.boosted
            ):
                waited = now - max(self.waiting_since[name], now - h.ledger.holding_s)
                assert waited <= preempt_after + 1e-9, f"{holder} holds while {name} waits"


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(weights, st.integers(0, 3)), min_size=2, max_size=5),
    st.one_of(st.none(), st.sampled_from([20.0, 45.0])),
    st.lists(st.floats(0.5, 20.0), min_size=3, max_size=12),
)
def test_lower_classes_wait_unless_max_wait_and_max_wait_bounds_every_wait(
    tenants: list[tuple[float, int]], max_wait: float | None, pauses: list[float]
) -> None:
    node = Node(tq_s=5.0, max_wait_s=max_wait)
    watch = Watch(node)
    for i, (weight, prio) in enumerate(tenants):
        node.join(f"t{i}", weight=weight, priority=prio)
    for pause in pauses:
        node.run(pause, on_poll=watch)
    if max_wait is not None:
        # Each boosted tenant ahead costs one quantum more; the longest is TQ x weight.
        longest_quantum = 5.0 * max(w for w, _ in tenants)
        bound = max_wait + len(tenants) * longest_quantum + POLL_S
        assert max(watch.longest.values(), default=0.0) <= bound


def test_the_view_counts_each_waiter_ahead_by_its_own_quantum() -> None:
    node = Node()
    node.join("a", weight=1)
    node.join("b", weight=2)
    node.join("c", weight=3)
    node.join("low", priority=-1)
    for name in ("a", "b", "c", "low"):
        node.do(ActivitySeen(name))
    gpu = node.sched.view(node.clock.now()).gpus[0]
    assert gpu.holder == "a"
    assert gpu.holder_quantum_s == 10.0
    waiters = {w.tenant: w for w in gpu.waiters}
    assert [w.tenant for w in gpu.waiters] == ["b", "c", "low"]
    assert (waiters["b"].ahead_s, waiters["c"].ahead_s) == (0.0, 20.0)
    assert waiters["low"].ahead_s == 50.0
    assert not waiters["b"].outranked and not waiters["c"].outranked
    assert waiters["low"].outranked  # behind a higher class: no bound but max_wait
