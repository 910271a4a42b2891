"""The core's memory policy: who is swapped out, when, and in what order."""

from __future__ import annotations

import pytest

from kiwid.core.actions import Action, Gate, SwapIn, SwapOut, Ungate
from kiwid.core.clock import FakeClock
from kiwid.core.events import (
    ActivitySeen,
    Event,
    FootprintSeen,
    Gated,
    GpusConfigured,
    SwapFinished,
    TenantAdopted,
    TenantAttached,
    TenantDetached,
    Tick,
    Ungated,
)
from kiwid.core.model import GpuPolicy, Mode, SwapMode, TenantState
from kiwid.core.scheduler import Scheduler
from tests.helpers import steps

GiB = 2**30
S = TenantState


class Card:
    """One GPU of ``capacity_gib`` with swapping, a fake clock, and the actions seen.

    Like the shell, it carries out each swap the core asks for and reports it, at
    once (time stands still while memory moves, at ``in_rate``/``out_rate`` in the
    reports); a swap of a tenant in ``fail`` fails, once.
    """

    def __init__(
        self,
        swap: SwapMode,
        capacity_gib: float = 140.0,
        tq: float = 30.0,
        in_rate: float = 6e9,
        out_rate: float = 2.5e9,
        park: bool = True,
    ) -> None:
        self.rates = {"in": in_rate, "out": out_rate}
        self.fail: set[str] = set()
        self.clock = FakeClock(1000.0)
        self.policy = GpuPolicy(
            tq_s=tq,
            idle_release_s=5,
            capacity_bytes=int(capacity_gib * GiB),
            reserve_bytes=1 * GiB,
            swap=swap,
            park=park,
        )
        self.sched = Scheduler({"0": self.policy})

    def do(self, event: Event) -> list[Action]:
        """Handle ``event``; carry out (and report) every swap that follows, in order."""
        out: list[Action] = []
        todo = [event]
        while todo:
            actions = self.sched.handle(todo.pop(0), self.clock.now())
            out += actions
            for action in actions:
                if isinstance(action, Gate):
                    todo.append(Gated(action.tenant, epoch=action.epoch))
                if isinstance(action, Ungate):
                    todo.append(Ungated(action.tenant, epoch=action.epoch))
                if isinstance(action, SwapOut | SwapIn):
                    direction = "out" if isinstance(action, SwapOut) else "in"
                    ok = action.tenant not in self.fail
                    self.fail.discard(action.tenant)
                    size = sum(self.sched.peak(action.tenant).values())
                    moved = size if ok else 0
                    seconds = size / self.rates[direction]
                    todo.append(
                        SwapFinished(
                            action.tenant, direction, ok, moved, seconds, epoch=action.epoch
                        )
                    )
        return out

    def join(self, name: str, gib: float) -> list[Action]:
        """A tenant appears with ``gib`` of memory and starts a burst."""
        self.do(TenantAttached(name, frozenset({"0"})))
        self.do(FootprintSeen(name, "0", int(gib * GiB)))
        return self.do(ActivitySeen(name))

    def run(self, seconds: float) -> list[Action]:
        """Let time pass with every ungated tenant busy; return the actions."""
        out: list[Action] = []
        for step in steps(self.clock.now, self.sched.next_deadline, seconds, max_step=1.0):
            self.clock.advance(step)
            out += self.do(Tick())
            for name in sorted(self.sched.tenant_ids()):
                if self.sched.tenant_state(name) is not S.WAITING:
                    out += self.do(ActivitySeen(name))
        return out

    def holder(self) -> str | None:
        view = self.sched.view(self.clock.now())
        return view.gpus[0].holder

    def resident(self) -> set[str]:
        return {t for t in self.sched.tenant_ids() if self.resident_one(t)}

    def resident_one(self, tenant: str) -> bool:
        residency = self.sched.residency(tenant)
        return residency is not None and residency.on_card


def test_checkpoint_rotation_of_three_tenants_that_do_not_fit_together() -> None:
    card = Card(SwapMode.CHECKPOINT)
    assert card.join("a", 47.5) == []  # alone: holds at once, nothing moves
    # Newcomers queue; with "checkpoint" every waiter's memory goes to host RAM.
    assert card.join("b", 47.5) == [Gate("b"), SwapOut("b")]
    assert card.join("c", 47.5) == [Gate("c"), SwapOut("c")]
    assert card.resident() == {"a"}
    # b's first turn: its footprint is unknown, so it gets the whole card, and
    # a's memory goes out BEFORE b comes back.
    assert card.run(30) == [Gate("a"), SwapOut("a"), SwapIn("b"), Ungate("b")]
    assert card.holder() == "b"
    assert card.resident() == {"b"}
    assert card.run(30) == [Gate("b"), SwapOut("b"), SwapIn("c"), Ungate("c")]
    # a is known now (47.5 GiB) and fits beside c: it is restored (prefetched)
    # before c's quantum ends, and let go as soon as c's gate took, while c's
    # checkpoint runs: a waits neither for its own restore nor for c's checkpoint.
    assert card.run(30) == [SwapIn("a"), Gate("c"), SwapOut("c"), Ungate("a")]
    assert card.run(30) == [SwapIn("b"), Gate("a"), SwapOut("a"), Ungate("b")]
    assert card.resident() == {"b"}


def test_auto_swaps_only_what_the_next_tenant_needs() -> None:
    card = Card(SwapMode.AUTO, capacity_gib=80)
    card.join("a", 30)
    assert card.join("b", 30) == [Gate("b")]  # queued, its memory stays
    # b's first turn needs the whole card: a goes out first.
    assert card.run(30) == [Gate("a"), SwapOut("a"), Ungate("b")]
    # a (30 GiB, known) fits beside b: it comes back ahead of its turn, b stays.
    assert card.run(30) == [SwapIn("a"), Gate("b"), Ungate("a")]
    # From now on both are resident and hand-overs move no memory.
    assert card.run(30) == [Gate("a"), Ungate("b")]
    assert card.run(30) == [Gate("b"), Ungate("a")]
    assert card.resident() == {"a", "b"}


def test_victims_are_the_least_recently_run() -> None:
    card = Card(SwapMode.AUTO, capacity_gib=101)  # room: 100 GiB
    for name in ("x", "y", "z"):
        card.join(name, 30)
    card.run(30 * 6)  # everyone's first turn (each evicting the others), then a round
    assert card.resident() == {"x", "y", "z"}  # 90 GiB: they all fit
    assert card.holder() == "x"
    # A tenant known to need 40 GiB, found in host RAM at start, queues last.
    card.do(TenantAttached("w", frozenset({"0"})))
    assert card.do(TenantAdopted("w", {"0": 40 * GiB})) == []
    assert card.run(30) == [Gate("x"), Ungate("y")]  # 90 GiB resident: nothing moves
    assert card.run(30) == [Gate("y"), Ungate("z")]
    # w's turn: 30 GiB must go. x ran longest ago (before y and z).
    assert card.run(30) == [Gate("z"), SwapOut("x"), SwapIn("w"), Ungate("w")]
    # x's turn: y is now the least recently run.
    assert card.run(30) == [Gate("w"), SwapOut("y"), SwapIn("x"), Ungate("x")]
    assert card.resident() == {"w", "x", "z"}


def test_failed_swap_in_sends_the_tenant_back_and_the_rotation_goes_on() -> None:
    card = Card(SwapMode.CHECKPOINT)
    card.join("a", 40)
    card.join("b", 40)
    card.join("c", 40)
    # The shell cannot restore b (say, the card's memory was taken meanwhile).
    card.fail.add("b")
    handover = card.run(30)
    assert handover[:3] == [Gate("a"), SwapOut("a"), SwapIn("b")]
    # b is never let go (it never ran) and c gets the turn at once.
    assert Ungate("b") not in handover
    assert card.sched.tenant_state("b") is S.WAITING
    assert card.holder() == "c"
    assert not card.resident_one("b")
    assert handover[3:] == [SwapIn("c"), Ungate("c")]
    assert card.sched.ledger("b", card.clock.now()).swapped_in_bytes == 0  # type: ignore[union-attr]
    # b skips one quantum, then is tried again.
    later = card.run(30)
    assert SwapIn("a") in later  # a was ahead of b after b went to the back
    again = card.run(30)
    assert SwapIn("b") in again
    assert card.holder() == "b"


def test_failed_swap_out_keeps_the_memory_and_the_tenant_is_not_chosen_again() -> None:
    card = Card(SwapMode.AUTO, capacity_gib=80)
    card.join("a", 30)
    card.join("b", 30)
    card.fail.add("a")
    out = card.run(30)
    # b's first turn needs the whole card; a cannot leave: b runs all the same.
    assert out == [Gate("a"), SwapOut("a"), Ungate("b")]
    assert card.resident_one("a")
    assert card.sched.tenant_state("a") is S.WAITING  # still gated, memory intact
    view = {t.tenant: t for t in card.sched.view(card.clock.now()).tenants}
    assert view["a"].swap_refusal is not None
    # Not chosen again while it waits; its next turn brings it back without a move.
    assert card.run(30) == [Gate("b"), Ungate("a")]


def test_swap_results_add_up_in_the_ledger() -> None:
    card = Card(SwapMode.CHECKPOINT, in_rate=5 * GiB, out_rate=2 * GiB)
    card.join("a", 10)
    card.join("b", 10)
    card.run(30)
    ledger = card.sched.ledger("b", card.clock.now())
    assert ledger is not None
    assert (ledger.swapped_out_bytes, ledger.swapped_in_bytes) == (10 * GiB, 10 * GiB)
    assert ledger.swap_s == 10 / 2 + 10 / 5
    # A report nobody asked for (a stale one) changes nothing.
    card.do(
        SwapFinished(
            "b", "in", ok=True, moved_bytes=10 * GiB, seconds=2.0, epoch=card.sched.epoch("b") or 0
        )
    )
    assert card.sched.ledger("b", card.clock.now()) == ledger


def test_a_swapped_tenant_that_exits_is_simply_dropped() -> None:
    card = Card(SwapMode.CHECKPOINT)
    card.join("a", 40)
    card.join("b", 40)
    assert card.do(TenantDetached("b")) == []
    assert card.run(60) == []  # a keeps the GPU: nobody waits any more
    assert card.holder() == "a"


def test_a_waiter_in_host_ram_comes_back_before_it_is_let_go_when_gating_stops() -> None:
    card = Card(SwapMode.CHECKPOINT)
    card.join("a", 40)
    card.join("b", 40)
    off = GpuPolicy(
        tq_s=30, mode=Mode.OFF, capacity_bytes=140 * GiB, reserve_bytes=GiB, swap=SwapMode.NONE
    )
    assert card.do(GpusConfigured({"0": off})) == [SwapIn("b"), Ungate("b")]
    assert card.resident() == {"a", "b"}


def test_without_swapping_nothing_moves() -> None:
    card = Card(SwapMode.NONE)
    card.join("a", 100)
    assert card.join("b", 100) == [Gate("b")]
    assert card.run(30) == [Gate("a"), Ungate("b")]


def test_an_idle_resident_tenant_is_gated_before_its_memory_goes_out() -> None:
    card = Card(SwapMode.AUTO, capacity_gib=80)
    card.join("a", 30)
    card.join("b", 30)
    card.run(30)  # b's first turn: a swapped out
    card.run(30)  # a back beside b
    # b goes quiet (idle, resident, ungated); a newcomer needs the whole card.
    card.do(TenantAttached("n", frozenset({"0"})))
    card.do(FootprintSeen("n", "0", 5 * GiB))
    card.clock.advance(1)
    assert card.do(ActivitySeen("n")) == [Gate("n")]
    out: list[Action] = []
    end = card.clock.now() + 40
    while card.clock.now() < end:  # only a and n keep busy
        card.clock.advance(1)
        out += card.do(Tick())
        for name in ("a", "n"):
            if card.sched.tenant_state(name) is not S.WAITING:
                out += card.do(ActivitySeen(name))
    assert card.sched.tenant_state("b") is S.PARKED  # idle when it left: no turn for it
    i = out.index(Gate("b"))
    assert out[i + 1] == SwapOut("b")
    assert out.index(SwapOut("b")) < out.index(Ungate("n"))


def test_a_holder_whose_memory_is_moving_starts_its_quantum_when_let_go() -> None:
    card = Card(SwapMode.CHECKPOINT, park=False)  # a, idle when it leaves, waits its turn
    card.join("a", 40)
    card.join("b", 40)
    card.clock.advance(30)
    # b never ran: it gets the card to itself, so a's memory leaves first. Nothing
    # else happens until the shell reports the swap-out.
    asked = card.clock.now()
    out = card.sched.handle(Tick(), asked)
    assert out == [Gate("a"), SwapOut("a")]
    gate = out[0]
    assert card.sched.handle(Gated("a", epoch=gate.epoch), asked) == []  # the freeze took
    # Only a's move is timed: twice its size at the checkpoint rate seen so far (b's),
    # and a second; past it, the move is overdue.
    expected = asked + 2 * 40 * GiB / card.rates["out"] + 1
    assert card.sched.next_deadline() == pytest.approx(expected)
    for _ in range(20):  # 20 s of swapping: b shows no activity, yet is not released
        card.clock.advance(1)
        assert card.sched.handle(Tick(), card.clock.now()) == []
        card.sched.handle(ActivitySeen("a"), card.clock.now())  # gated: ignored
    assert card.holder() == "b"
    done = SwapFinished("a", "out", ok=True, moved_bytes=40 * GiB, seconds=20, epoch=out[1].epoch)
    restore = card.sched.handle(done, card.clock.now())
    assert restore == [SwapIn("b")]
    card.clock.advance(7)
    back = SwapFinished("b", "in", ok=True, moved_bytes=40 * GiB, seconds=7, epoch=restore[0].epoch)
    let_go = card.sched.handle(back, card.clock.now())
    assert let_go == [Ungate("b")]
    pending = card.sched.next_deadline()  # its unlock is under way: it cannot go idle
    assert pending is not None and pending > card.clock.now() + card.policy.idle_release_s
    ungated = Ungated("b", epoch=let_go[0].epoch)
    assert card.sched.handle(ungated, card.clock.now()) == []  # the unlock took
    deadline = card.sched.next_deadline()
    assert deadline is not None
    # Its first idle window (from its unlock's answer) and its quantum count from now.
    assert deadline == card.clock.now() + card.policy.idle_release_s
    let_go = card.clock.now()
    out = []
    while card.holder() == "b":  # b busy all along; a waits
        card.clock.advance(1)
        card.do(ActivitySeen("b"))
        out += card.do(Tick())
    assert card.clock.now() - let_go == card.policy.tq_s  # a full quantum of running
    assert out.index(SwapIn("a")) < out.index(Gate("b"))


def test_the_next_in_line_is_prefetched_by_its_restore_time_before_the_turn() -> None:
    # Restores at 8 GB/s in the shell's reports: the core learns the rate.
    card = Card(SwapMode.CHECKPOINT, in_rate=8e9)
    card.join("a", 40)
    card.join("b", 40)
    card.run(30)  # b's first turn
    start = card.clock.now()
    seen: list[tuple[float, Action]] = []
    while not any(a == Ungate("a") for _, a in seen):
        deadline = card.sched.next_deadline()
        assert deadline is not None
        card.clock.advance(max(0.0, min(1.0, deadline - card.clock.now())) or 1e-3)
        card.do(ActivitySeen("b"))
        seen += [(card.clock.now() - start, a) for a in card.do(Tick())]
    at = {a: t for t, a in reversed(seen)}
    # Prefetched 40 GiB / 8 GB/s + 1 s before b's quantum ends; let go at its end.
    assert at[SwapIn("a")] == pytest.approx(30 - (40 * GiB / 8e9 + 1), abs=1e-6)
    assert at[Ungate("a")] == 30
    assert [a for _, a in seen] == [SwapIn("a"), Gate("b"), SwapOut("b"), Ungate("a")]


def test_no_prefetch_that_would_not_fit_beside_the_resident() -> None:
    card = Card(SwapMode.AUTO, capacity_gib=101)  # room 100 GiB
    card.join("a", 60)
    card.join("b", 60)
    card.run(30)  # b's first turn: a out
    out = card.run(30)
    # a (60) does not fit beside b (60): no early restore; b must go first.
    assert out == [Gate("b"), SwapOut("b"), SwapIn("a"), Ungate("a")]
