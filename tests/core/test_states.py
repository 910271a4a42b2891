from __future__ import annotations

import pytest

from kiwid.core.clock import FakeClock
from kiwid.core.model import TenantState
from kiwid.core.states import TRANSITIONS, InvalidTransition, Trigger, mermaid, transition


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
        Trigger.GATING_STARTED,
        Trigger.SWAPPED_OUT,  # gated to be swapped out
        Trigger.SWAP_IN_FAILED,  # never let go: its memory is still in host RAM
    }
    for (_, trigger), target in TRANSITIONS.items():
        assert (target is TenantState.WAITING) == (trigger in gating)


def test_docs_diagram_is_generated_from_the_table() -> None:
    with open("docs/states.md") as f:
        assert mermaid() in f.read()


def test_fake_clock() -> None:
    clock = FakeClock(5)
    assert clock.advance(2.5) == 7.5
    with pytest.raises(ValueError, match="back"):
        clock.advance(-1)
