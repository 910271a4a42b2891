from __future__ import annotations

import pytest

from kiwid.core.clock import FakeClock
from kiwid.core.diagrams import document
from kiwid.core.model import TenantState
from kiwid.core.residency import MOVES, InvalidMove, Move, Residency, move
from kiwid.core.states import TRANSITIONS, InvalidTransition, Trigger, transition


def test_every_listed_transition_is_allowed() -> None:
    for (state, trigger), target in TRANSITIONS.items():
        assert transition(state, trigger) is target


def test_unlisted_transitions_raise_and_name_the_state() -> None:
    unlisted = [(s, t) for s in TenantState for t in Trigger if (s, t) not in TRANSITIONS]
    assert unlisted
    for state, trigger in unlisted:
        with pytest.raises(InvalidTransition, match=state.value):
            transition(state, trigger)


def test_only_waiting_is_reached_by_gating_triggers() -> None:
    gating = {
        Trigger.BURST_BUSY,
        Trigger.PREEMPTED,
        Trigger.PREEMPTED_PRIORITY,
        Trigger.GATING_STARTED,
        Trigger.SWAPPED_OUT,  # gated to be swapped out
        Trigger.SWAP_IN_FAILED,  # never let go: its memory is still in host RAM
        Trigger.PASSED_OVER,  # never let go: its memory is still moving
        Trigger.ADOPTED,  # a previous kiwid gated it
        Trigger.GATE_MENDED,  # a stuck tenant's gate took when tried again
        Trigger.RETRIED,  # a stuck tenant mended: gated, it waits for its turn
        Trigger.WOKEN,  # a parked tenant (gated) asked for: it waits for its turn
    }
    for (state, trigger), target in TRANSITIONS.items():
        if state is TenantState.RELEASED:  # back into the rotation: it runs free till its burst
            assert target is TenantState.IDLE
            continue
        assert (target is TenantState.WAITING) == (trigger in gating)


def test_a_tenant_parks_only_idle_and_leaves_parked_only_woken_unparked_or_stuck() -> None:
    into = {t for (s, t), target in TRANSITIONS.items() if target is TenantState.PARKED}
    assert into == {Trigger.PARKED_IDLE, Trigger.TURN_UNUSED}
    assert (TenantState.IDLE, Trigger.PARKED_IDLE) in TRANSITIONS
    assert (TenantState.HOLDER, Trigger.TURN_UNUSED) in TRANSITIONS
    out = {t: target for (s, t), target in TRANSITIONS.items() if s is TenantState.PARKED}
    assert out == {
        Trigger.WOKEN: TenantState.WAITING,
        Trigger.UNPARKED: TenantState.IDLE,
        Trigger.FAULTED: TenantState.STUCK,
    }


def test_only_a_fault_makes_a_tenant_stuck_and_only_an_operator_or_its_gate_ends_it() -> None:
    for (state, trigger), target in TRANSITIONS.items():
        assert (target is TenantState.STUCK) == (trigger is Trigger.FAULTED), (state, trigger)
        if state is TenantState.STUCK and target is not TenantState.STUCK:
            assert trigger in (Trigger.GATE_MENDED, Trigger.RETRIED, Trigger.RELEASED)
    # Any tenant can get stuck; only a stuck one can be released.
    for state in TenantState:
        if state is not TenantState.RELEASED:
            assert (state, Trigger.FAULTED) in TRANSITIONS
    assert [s for (s, t) in TRANSITIONS if t is Trigger.RELEASED] == [TenantState.STUCK]


def test_docs_diagrams_are_generated_from_the_tables() -> None:
    with open("docs/states.md") as f:
        assert f.read() == document()


def test_every_listed_move_is_allowed_and_no_other() -> None:
    for (residency, why), target in MOVES.items():
        assert move(residency, why) is target
    unlisted = [(r, m) for r in Residency for m in Move if (r, m) not in MOVES]
    for residency, why in unlisted:
        with pytest.raises(InvalidMove, match=residency.value):
            move(residency, why)


def test_only_memory_on_the_card_may_run_and_a_move_is_one_state() -> None:
    # Every way back to the card ends a restore; every move in flight takes room.
    on_card = {r for r in Residency if r.on_card}
    assert on_card == {Residency.RESIDENT, Residency.PREFETCHED}
    # What the driver says after a fault, a retry or a release (FOUND_*, LOST_TRACK)
    # is the only other way: kiwid asks the driver, it does not guess.
    found = (Move.FOUND_ON_CARD, Move.FOUND_IN_HOST, Move.LOST_TRACK)
    for (residency, why), target in MOVES.items():
        if target in on_card and residency not in on_card:
            assert why in (Move.IN_DONE, Move.OUT_FAILED, Move.FOUND_ON_CARD), (residency, why)
        if target.moving:
            assert target.takes_room
    # A move in flight can only end (or, a prefetch, turn into its grant's restore), or
    # be found elsewhere by the driver.
    for (residency, why), target in MOVES.items():
        if residency.moving:
            ends = (Move.OUT_DONE, Move.OUT_FAILED, Move.IN_DONE, Move.IN_FAILED, Move.IN_DEFERRED)
            assert (
                why in ends
                or why in found
                or (residency is Residency.PREFETCHING and why is Move.GRANTED)
            ), (residency, why, target)
    # Unknown memory counts on the card and never runs; only the driver's word ends it.
    assert Residency.UNKNOWN.takes_room and not Residency.UNKNOWN.on_card
    assert {why for (r, why) in MOVES if r is Residency.UNKNOWN} == {
        Move.FOUND_ON_CARD,
        Move.FOUND_IN_HOST,
    }


def test_fake_clock() -> None:
    clock = FakeClock(5)
    assert clock.advance(2.5) == 7.5
    with pytest.raises(ValueError, match="back"):
        clock.advance(-1)
