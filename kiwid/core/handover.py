"""A GPU's hand-over, from one holder to the next, named in one place.

From the moment a waiter is granted a GPU until it runs there, the hand-over goes
through phases: the holder it replaces is being gated (it may still run), room is
being made for the new one's memory (others swap out), its own memory comes back
from host RAM, and its ungate is on its way. Some are skipped (nothing to restore,
room enough). :func:`step` records each phase as the scheduler's rules reach it
(:mod:`kiwid.core.room`); the hand-over ends once the new holder runs (``Ungated``)
or gives up its turn. Status shows it, and ``kiwictl explain`` says it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kiwid.core.model import GpuId, TenantId


class Phase(enum.StrEnum):
    """Where a hand-over stands."""

    GATING = "gating the holder"
    """The tenant it replaces may still run: its gate is on its way."""
    ROOM = "making room"
    """Other tenants' memory is leaving the card for the new holder's."""
    RESTORING = "restoring"
    """The new holder's memory is coming back from host RAM."""
    LETTING_GO = "letting go"
    """The new holder's ungate is on its way: it runs once it takes."""


P = Phase

STEPS: dict[Phase | None, frozenset[Phase]] = {
    None: frozenset(P),
    P.GATING: frozenset({P.GATING, P.ROOM, P.RESTORING, P.LETTING_GO}),
    P.ROOM: frozenset({P.ROOM, P.RESTORING, P.GATING, P.LETTING_GO}),
    P.RESTORING: frozenset({P.RESTORING, P.ROOM, P.GATING, P.LETTING_GO}),
    P.LETTING_GO: frozenset({P.LETTING_GO}),
}
"""From a phase (``None``: the grant), the phases it may go to; it ends from any.

Room, restore and the holder's gate go on side by side: the phase is what the
hand-over waits for now, in the order the rules look (room, memory, the holder).
Once its ungate is asked, nothing else is."""


class InvalidStep(Exception):
    """A hand-over was asked to go where its table does not lead."""

    def __init__(self, before: Phase | None, after: Phase) -> None:
        """Record the refused step."""
        super().__init__(f"no step from {before.value if before else 'its grant'!r} to {after}")
        self.before = before
        self.after = after


@dataclass
class Handover:
    """One GPU's hand-over."""

    gpu: GpuId
    to: TenantId
    """The tenant granted the GPU."""
    from_: TenantId | None
    """The tenant that held it before (``None``: nobody)."""
    since: float
    """When the grant came (monotonic seconds)."""
    phase: Phase | None = None
    """What it waits for now (``None``: not looked at yet)."""


def step(handover: Handover, phase: Phase) -> None:
    """Move ``handover`` to ``phase``.

    Raises:
        InvalidStep: the table does not lead there.
    """
    if phase not in STEPS[handover.phase]:
        raise InvalidStep(handover.phase, phase)
    handover.phase = phase


def mermaid() -> str:
    """Render the table as a Mermaid state diagram (for docs/states.md)."""
    lines = ["stateDiagram-v2"]
    for target in P:
        lines.append(f"    [*] --> {_node(target)}: granted")
    for before, afters in STEPS.items():
        if before is None:
            continue
        for after in sorted(afters - {before}, key=list(P).index):
            lines.append(f"    {_node(before)} --> {_node(after)}")
    lines.append(f"    {_node(P.LETTING_GO)} --> [*]: its ungate took: it runs")
    for phase in P:
        lines.append(f'    state "{phase.value}" as {_node(phase)}')
    return "\n".join(lines)


def _node(phase: Phase) -> str:
    return phase.name.lower()
