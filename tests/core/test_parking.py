"""Parked tenants: idle ones stay in host RAM, out of the queue, until woken."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from kiwid.core.actions import Action, Gate, SwapIn, SwapOut, Ungate
from kiwid.core.events import (
    ActivitySeen,
    FootprintSeen,
    GpusConfigured,
    HostMemorySeen,
    TenantAttached,
    TenantFaulted,
    TenantPolicySet,
    Tick,
    WakeAsked,
)
from kiwid.core.model import GpuPolicy, Mode, SwapMode, TenantPolicy, TenantState
from kiwid.core.residency import Residency
from kiwid.core.scheduler import Scheduler
from tests.core.test_properties import GPUS, TENANTS, Answer, Run, steps_with
from tests.core.test_swap import Card
from tests.helpers import steps

GiB = 2**30
S = TenantState
SERVERS = ("s1", "s2", "s3")


class Fleet(Card):
    """A 16 GiB card: three idle servers of 3 GiB, and two trainers that squeeze them."""

    def __init__(self, *, park: bool, **policy: object) -> None:
        super().__init__(SwapMode.CHECKPOINT, capacity_gib=16, park=park)
        if policy:
            self.policy = replace(self.policy, **policy)  # type: ignore[arg-type]
            self.do(GpusConfigured({"0": self.policy}))
        self.busy: set[str] = set()
        for name in SERVERS:  # resident, known, idle
            self.do(TenantAttached(name, frozenset({"0"})))
            self.do(FootprintSeen(name, "0", 3 * GiB))
        self.start("t", 4)
        self.live(5)
        self.start("u", 6)  # a newcomer: its first turn wants the whole card

    def start(self, name: str, gib: int) -> list[Action]:
        self.do(TenantAttached(name, frozenset({"0"})))
        self.do(FootprintSeen(name, "0", gib * GiB))
        self.busy.add(name)
        return self.do(ActivitySeen(name))

    def live(self, seconds: float) -> list[Action]:
        """Time passes; the busy tenants show GPU work whenever they are let go."""
        out: list[Action] = []
        for step in steps(self.clock.now, self.sched.next_deadline, seconds, max_step=1.0):
            self.clock.advance(step)
            out += self.do(Tick())
            for name in sorted(self.busy):
                if self.sched.tenant_state(name) in (S.HOLDER, S.CORUNNING, S.IDLE):
                    out += self.do(ActivitySeen(name))
        return out

    def state(self, name: str) -> S | None:
        return self.sched.tenant_state(name)


def test_idle_tenants_swapped_out_for_room_park_and_are_never_restored() -> None:
    fleet = Fleet(park=True)
    out = fleet.live(300)
    assert {fleet.state(s) for s in SERVERS} == {S.PARKED}
    assert all(fleet.sched.residency(s) is Residency.HOST for s in SERVERS)
    assert not [a for a in out if isinstance(a, SwapIn) and a.tenant in SERVERS]
    view = fleet.sched.view(fleet.clock.now())
    assert all(t.ledger.quanta == 0 for t in view.tenants if t.tenant in SERVERS)
    assert {w.tenant for g in view.gpus for w in g.waiters} <= {"t", "u"}
    assert view.restores_wasted == 0
    # The trainers rotate between themselves meanwhile.
    assert sum(isinstance(a, Ungate) and a.tenant in ("t", "u") for a in out) >= 8


def test_without_parking_idle_tenants_are_restored_for_turns_they_waste() -> None:
    fleet = Fleet(park=False)
    out = fleet.live(300)
    restored = {a.tenant for a in out if isinstance(a, SwapIn)} & set(SERVERS)
    assert restored == set(SERVERS)  # each got a turn, did nothing, and was counted
    view = fleet.sched.view(fleet.clock.now())
    wasted = {t.tenant: t.ledger.restores_wasted for t in view.tenants}
    assert all(wasted[s] >= 1 for s in SERVERS), wasted
    assert view.restores_wasted == sum(wasted.values())
    assert S.PARKED not in {fleet.state(s) for s in SERVERS}


def test_a_woken_tenant_waits_as_a_burst_is_restored_at_its_turn_and_runs() -> None:
    fleet = Fleet(park=True)
    fleet.live(60)
    assert fleet.state("s1") is S.PARKED
    assert fleet.do(WakeAsked("s1", "request", "tcp 0.0.0.0:8000: 1 connection")) == []
    assert fleet.state("s1") is S.WAITING
    view = fleet.sched.view(fleet.clock.now())
    (s1,) = [t for t in view.tenants if t.tenant == "s1"]
    assert s1.last_wake == (fleet.clock.now(), "request", "tcp 0.0.0.0:8000: 1 connection")
    assert s1.ledger.wakes == 1 and view.wakes == {"request": 1}
    fleet.busy.add("s1")  # it answers the request that woke it
    out: list[Action] = []
    while Ungate("s1") not in out:
        out += fleet.live(1)
    assert out.index(SwapIn("s1")) < out.index(Ungate("s1"))
    fleet.live(2)
    fleet.busy.discard("s1")  # answered: idle again
    fleet.live(10)
    # It worked in its turn: idle, on the card, and its restore was not wasted.
    assert fleet.state("s1") is S.IDLE
    assert fleet.sched.residency("s1") is Residency.RESIDENT
    assert fleet.sched.view(fleet.clock.now()).restores_wasted == 0


def test_a_turn_without_gpu_work_parks_the_tenant_again_and_counts_the_restore() -> None:
    fleet = Fleet(park=True)
    fleet.live(60)
    fleet.do(WakeAsked("s2", "operator", "uid 0"))
    out = fleet.live(120)  # s2 never works
    assert SwapIn("s2") in out and Ungate("s2") in out
    assert fleet.state("s2") is S.PARKED
    after = out[out.index(Ungate("s2")) :]
    assert after.index(Gate("s2")) < after.index(SwapOut("s2"))
    view = fleet.sched.view(fleet.clock.now())
    (s2,) = [t for t in view.tenants if t.tenant == "s2"]
    assert s2.ledger.restores_wasted == 1 and view.restores_wasted == 1
    assert view.wakes == {"operator": 1}


def test_a_busy_tenant_whose_turn_shows_no_work_goes_idle_ungated_not_parked() -> None:
    # Its work may only have been seen late (after a retry, on a loaded host):
    # parked, gated, it could show none, and no request may ever come to wake it.
    fleet = Fleet(park=True)
    fleet.live(60)
    holder = fleet.sched.view(fleet.clock.now()).gpus[0].holder
    (waiter,) = {"t", "u"} - {holder}
    assert fleet.state(waiter) is S.WAITING
    fleet.busy.discard(waiter)  # its next turn shows no work
    out: list[Action] = []
    while Ungate(waiter) not in out:
        out += fleet.live(1)
    fleet.live(fleet.policy.idle_release_s + 1)
    assert fleet.state(waiter) is S.IDLE and not fleet.sched.gated(waiter)
    fleet.busy.add(waiter)
    fleet.do(ActivitySeen(waiter))  # its work shows: it queues again
    assert fleet.state(waiter) in (S.WAITING, S.HOLDER)


def test_a_woken_tenant_of_a_higher_priority_suspends_the_holder() -> None:
    fleet = Fleet(park=True)
    fleet.do(TenantPolicySet("s3", TenantPolicy(priority=1)))
    fleet.live(60)
    assert fleet.state("s3") is S.PARKED
    holder = fleet.sched.view(fleet.clock.now()).gpus[0].holder
    assert holder in ("t", "u")
    out = fleet.do(WakeAsked("s3", "request"))
    assert out[0] == Gate(holder)  # preempted at once (preempt_after 0), suspended
    assert fleet.state(holder) is S.WAITING
    assert SwapIn("s3") in out or SwapIn("s3") in fleet.live(5)


def test_waking_a_tenant_that_is_not_parked_changes_nothing() -> None:
    fleet = Fleet(park=True)
    before = fleet.state("t")
    assert fleet.do(WakeAsked("t", "operator")) == []
    assert fleet.do(WakeAsked("nobody", "operator")) == []
    assert fleet.state("t") is before
    assert fleet.sched.view(fleet.clock.now()).wakes == {}


def test_parked_tenants_are_woken_when_parking_stops_applying_to_them() -> None:
    fleet = Fleet(park=True)
    fleet.live(60)
    fleet.do(TenantPolicySet("s1", TenantPolicy(park=False)))  # a rule: park = false
    assert fleet.state("s1") is S.WAITING
    assert [fleet.state(s) for s in ("s2", "s3")] == [S.PARKED, S.PARKED]
    fleet.do(GpusConfigured({"0": replace(fleet.policy, park=False)}))  # memory.park = "off"
    assert [fleet.state(s) for s in ("s2", "s3")] == [S.WAITING, S.WAITING]
    view = fleet.sched.view(fleet.clock.now())
    assert view.wakes == {"policy": 3}
    why = {t.tenant: t.last_wake[2] for t in view.tenants if t.last_wake}
    assert why["s1"] == "its rule or pod says park = false"
    assert why["s2"] == 'GPU 0 parks nobody (memory.park = "off")'


def test_a_parked_tenant_whose_memory_cannot_leave_is_let_go_idle() -> None:
    fleet = Fleet(park=True)
    fleet.fail.add("s1")  # its checkpoint fails once
    out: list[Action] = []
    while SwapOut("s1") not in out:
        out += fleet.live(1)
    assert out.index(SwapOut("s1")) < out.index(Ungate("s1"))
    assert fleet.state("s1") is S.IDLE
    assert fleet.sched.residency("s1") is Residency.RESIDENT
    assert not fleet.sched.gated("s1")


def test_nobody_parks_below_the_host_ram_floor() -> None:
    card = Card(SwapMode.CHECKPOINT, capacity_gib=16, park=True)
    card.do(GpusConfigured({"0": card.policy}, host_floor_bytes=8 * GiB))
    card.do(HostMemorySeen(9 * GiB))  # a 3 GiB swap-out would leave 6: below the floor
    out: list[Action] = []
    for name in SERVERS:
        card.do(TenantAttached(name, frozenset({"0"})))
        card.do(FootprintSeen(name, "0", 3 * GiB))
    for name, gib in (("t", 4), ("u", 6)):
        card.do(TenantAttached(name, frozenset({"0"})))
        card.do(FootprintSeen(name, "0", gib * GiB))
        out += card.do(ActivitySeen(name))
    for _ in range(60):
        card.clock.advance(1.0)
        out += card.do(Tick())
    assert not [a for a in out if isinstance(a, SwapOut) and a.tenant in SERVERS]
    assert {card.sched.tenant_state(s) for s in SERVERS} == {S.IDLE}
    assert all(card.sched.residency(s) is Residency.RESIDENT for s in SERVERS)


def test_a_parked_tenant_can_get_stuck_like_any_other() -> None:
    fleet = Fleet(park=True)
    fleet.live(60)
    epoch = fleet.sched.epoch("s2")
    assert epoch is not None
    fleet.do(TenantFaulted("s2", "swap-in", "restore hung", Residency.UNKNOWN, epoch=epoch))
    assert fleet.state("s2") is S.STUCK


def test_where_nothing_gates_a_tenant_held_in_host_ram_gets_room_from_parking_idle_ones() -> None:
    # t0 moves to GPU 0 and back (its memory goes to host RAM on the way); then GPU 1
    # turns to mode auto: t0 alone bursts and fits, so GPU 1 stops gating, while the
    # idle t1 and t2 fill its card. Nobody takes turns, so no grant makes room: an
    # idle tenant parks for t0's restore (found by the property test below: t0
    # waited in host RAM for ever, and the core had no reason to look again).
    policy = GpuPolicy(
        tq_s=1.0, idle_release_s=0.5, capacity_bytes=40 * GiB, reserve_bytes=GiB,
        swap=SwapMode.AUTO, park=True,
    )  # fmt: skip
    run = Run(Scheduler(dict.fromkeys(("0", "1", "2"), policy)))
    for tenant, gib in (("t0", 1), ("t1", 19), ("t2", 20)):
        run.step(TenantAttached(tenant, frozenset({"1"})))
        run.step(FootprintSeen(tenant, "1", gib * GiB))
        run.step(ActivitySeen(tenant))
    run.step(TenantAttached("t0", frozenset({"0"})))
    run.step(TenantAttached("t0", frozenset({"1"})))
    auto = {"0": policy, "1": replace(policy, mode=Mode.AUTO), "2": policy}
    run.step(GpusConfigured(auto))
    for _ in range(30):
        run.step(Answer(0, ok=True))
        run.pass_time(1.0)
    states = {t: run.sched.tenant_state(t) for t in ("t0", "t1", "t2")}
    assert run.sched.residency("t0") is Residency.RESIDENT, states
    assert S.PARKED in (states["t1"], states["t2"]), states


swapping = st.builds(
    GpuPolicy,
    tq_s=st.sampled_from([1.0, 5.0]),
    idle_release_s=st.sampled_from([0.5, 2.0]),
    mode=st.sampled_from([Mode.EXCLUSIVE, Mode.EXCLUSIVE, Mode.AUTO]),
    capacity_bytes=st.just(40 * GiB),
    reserve_bytes=st.just(GiB),
    swap=st.sampled_from([SwapMode.AUTO, SwapMode.CHECKPOINT]),
    park=st.sampled_from([True, True, True, False]),
)
arrivals = st.lists(
    st.tuples(st.sampled_from(TENANTS), st.sampled_from(GPUS), st.integers(1, 20)),
    min_size=3,
    max_size=6,
)
busy_steps = st.one_of(
    steps_with(swapping),
    st.builds(ActivitySeen, st.sampled_from(TENANTS)),
    st.builds(WakeAsked, st.sampled_from(TENANTS), st.sampled_from(["request", "operator"])),
    st.builds(Answer, st.integers(0, 5), st.just(True)),
    st.floats(0.5, 10.0),
)


@settings(max_examples=200, deadline=None)
@given(
    st.fixed_dictionaries(dict.fromkeys(GPUS, swapping)),
    arrivals,
    st.lists(busy_steps, max_size=80),
)
def test_invariants_hold_with_parking_over_random_event_sequences(
    initial: dict[str, GpuPolicy], opening: list[tuple[str, str, int]], script: list[object]
) -> None:
    """The core's invariants (tests/core/test_properties.py), in a world whose tenants
    hold memory that moves: a parked tenant stays gated, out of every queue, in host
    RAM or on its way there, and is never restored until woken."""
    run = Run(Scheduler(initial))
    for tenant, gpu, gib in opening:
        run.step(TenantAttached(tenant, frozenset({gpu})))
        run.step(FootprintSeen(tenant, gpu, gib * GiB))
        run.step(ActivitySeen(tenant))
    for step in script:
        run.step(step)
    run.settle()
    # A quiet fleet settles when its GPUs park: nobody is restored for a turn it does
    # not use. With memory.park = "off", idle tenants larger than the card take turns
    # for ever; that is the behaviour "off" keeps, so it is not asserted there.
    if all(gpu.policy.park for gpu in run.sched.view(run.now).gpus):  # the policies in force
        assert not any(run.jobs.values()), f"jobs keep coming: {run.jobs}"
