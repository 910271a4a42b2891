"""A GPU's hand-over, named in one place: from whom, to whom, since when, its phase.

A newcomer nobody knows gets the card to itself (room is made: the others leave),
then its memory comes back (restoring); the holder it replaces is gated first
where its gate is slow, then the new holder's ungate is on its way (letting go),
and its taking ends the hand-over. Every step goes through the table of phases
(:mod:`kiwid.core.handover`), which refuses what it does not list.
"""

from __future__ import annotations

import pytest

from kiwid.core.actions import Ungate
from kiwid.core.events import Event, Gated, Ungated
from kiwid.core.handover import STEPS, Handover, InvalidStep, Phase, step
from kiwid.core.model import SwapMode
from tests.core.timed_card import TimedCard


class Watched(TimedCard):
    """A TimedCard that notes every hand-over's (to, from, phase) after each event."""

    def do(self, event: Event) -> None:
        super().do(event)
        for gpu in self.sched.view(self.clock.now()).gpus:
            h = gpu.handover
            if h is not None:
                seen = (h.to, h.from_, h.phase)
                if not self.phases or self.phases[-1] != seen:
                    self.phases.append(seen)


def watched(**kw: object) -> Watched:
    card = Watched(**kw)  # type: ignore[arg-type]
    card.phases = []  # type: ignore[attr-defined]
    return card


def test_a_newcomer_s_hand_over_makes_room_then_restores_it() -> None:
    card = watched(capacity_gib=40, tq=30)
    card.join("a", 10)
    card.join("b", 10)  # b nobody knows: the card to itself, a's memory leaves first
    card.run(40)  # a's quantum (30 s), then its 10 GiB out at 2.3 GB/s
    # b waited in host RAM (checkpoint mode): room first, then its own memory back;
    # its ungate takes at once here (the last test shows it on its way).
    assert card.phases == [("b", "a", "making room"), ("b", "a", "restoring")]  # type: ignore[attr-defined]
    view = card.sched.view(card.clock.now())
    assert view.gpus[0].handover is None, "b runs: its hand-over is over"
    assert view.gpus[0].holder == "b"


def test_a_known_tenant_in_host_ram_is_restored_in_its_hand_over() -> None:
    card = watched(capacity_gib=25, tq=30)
    card.join("a", 10)
    card.join("b", 10)
    card.run(200)  # both known now; each other's memory goes out at every turn
    seen = {(to, phase) for to, _, phase in card.phases}  # type: ignore[attr-defined]
    assert ("a", "restoring") in seen or ("b", "restoring") in seen, card.phases


def test_a_hand_over_waits_for_the_holder_s_gate_then_the_next_one_s_ungate() -> None:
    card = watched(capacity_gib=140, tq=30, swap=SwapMode.NONE)
    held: dict[str, Event] = {}  # a's gate and b's ungate answer when the test says
    slow: set[str] = set()
    real_do = TimedCard.do

    def do(self: Watched, event: Event) -> None:
        if isinstance(event, Gated | Ungated) and event.tenant in slow:
            held[event.tenant] = event
            return
        real_do(self, event)

    def handover() -> tuple[str, str | None, str | None] | None:
        h = card.sched.view(card.clock.now()).gpus[0].handover
        return None if h is None else (h.to, h.from_, h.phase)

    card.do = do.__get__(card)  # type: ignore[method-assign]
    card.join("a", 10)
    card.join("b", 10)
    slow |= {"a", "b"}
    card.run(31)  # a's quantum is over: its gate not answered yet, b granted
    assert handover() == ("b", "a", "gating the holder")
    assert not any(a == Ungate("b") for _, a in card.log), "b let go while a may run"
    slow.discard("a")
    card.do(held.pop("a"))  # a's gate took: b is let go, its ungate on its way
    assert any(a == Ungate("b") for _, a in card.log)
    assert handover() == ("b", "a", "letting go")
    slow.discard("b")
    card.do(held.pop("b"))  # b runs
    assert handover() is None


def test_the_table_refuses_what_it_does_not_list() -> None:
    h = Handover("0", "b", "a", 0.0)
    step(h, Phase.ROOM)
    step(h, Phase.LETTING_GO)
    with pytest.raises(InvalidStep):
        step(h, Phase.RESTORING)  # once its ungate is asked, nothing else is
    assert h.phase is Phase.LETTING_GO
    assert set(STEPS) == {None, *Phase}
    assert Ungated  # (the answer that ends it, in the scheduler)
