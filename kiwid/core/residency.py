"""Where a tenant's GPU memory is, as one table (like :mod:`kiwid.core.states`).

The scheduler owns this fact and nobody else: the shell derives what it must keep
(the state file's ``swapped`` records, the tenants it keeps while they are missing
from the GPU's process list) from it and from the state file, never by flags of
its own. Every change goes through :func:`move`; a change the table does not list
raises :class:`InvalidMove` and leaves the tenant as it was.

Safety rests on three rules the scheduler keeps with this table:

* a tenant is let go (``Ungate``) only while its memory is on the card
  (``resident`` or ``prefetched``);
* a tenant's memory moves only while it is gated, one move at a time (a move in
  flight is a state, so a second one cannot be asked for);
* a restore is asked for only when the card has room for it beside everything
  that is on it or moving onto or off it.
"""

from __future__ import annotations

import enum


class Residency(enum.StrEnum):
    """Where a tenant's GPU memory is."""

    RESIDENT = "resident"
    """On the card."""
    SWAPPING_OUT = "swapping-out"
    """Being copied to host RAM (it still takes its room on the card)."""
    HOST = "host"
    """In host RAM: the tenant is gated and waits for room and its turn."""
    SWAPPING_IN = "swapping-in"
    """Being brought back for its turn (it takes its room on the card)."""
    PREFETCHING = "prefetching"
    """Being brought back ahead of its turn, beside the holder."""
    PREFETCHED = "prefetched"
    """Back on the card ahead of its turn; kept there until it runs."""
    UNKNOWN = "unknown"
    """The driver left it out of step (part on the card, part in host RAM, or a move
    that never returned): counted on the card, never let go until an operator's
    ``kiwictl retry`` or ``release`` finds where it is."""

    @property
    def on_card(self) -> bool:
        """Whether the tenant may run: its memory is on the card and not moving."""
        return self in (Residency.RESIDENT, Residency.PREFETCHED)

    @property
    def moving(self) -> bool:
        """Whether a swap of it is in flight."""
        return self in (Residency.SWAPPING_OUT, Residency.SWAPPING_IN, Residency.PREFETCHING)

    @property
    def takes_room(self) -> bool:
        """Whether it counts against the card's memory (all but ``host``).

        ``unknown`` counts whole: some or all of it may be on the card.
        """
        return self is not Residency.HOST


class Move(enum.StrEnum):
    """Why a tenant's memory moves (or a move ends)."""

    SWAP_OUT = "swapped out: room for another tenant, or checkpoint mode"
    OUT_DONE = "its memory reached host RAM"
    OUT_FAILED = "the swap-out failed: its memory stays on the card"
    SWAP_IN = "its turn came: its memory comes back"
    PREFETCH = "next in line: its memory comes back before its turn"
    IN_DONE = "its memory is back on the card"
    IN_FAILED = "the restore failed: its memory stays in host RAM"
    IN_DEFERRED = "the restore did not start: too little free memory on the card"
    GRANTED = "its turn came while it was on the card or coming back"
    ADOPTED_SWAPPED = "a previous kiwid left it in host RAM"
    LOST_TRACK = (
        "a move failed half-way or never returned, or a previous kiwid died during one: "
        "where it is, is unknown"
    )
    FOUND_ON_CARD = "the driver says (after a fault, a retry or a release) it is all on the card"
    FOUND_IN_HOST = "the driver says (after a fault or a retry) it is all in host RAM"


R = Residency
M = Move

MOVES: dict[tuple[Residency, Move], Residency] = {
    (R.RESIDENT, M.SWAP_OUT): R.SWAPPING_OUT,
    (R.SWAPPING_OUT, M.OUT_DONE): R.HOST,
    (R.SWAPPING_OUT, M.OUT_FAILED): R.RESIDENT,
    (R.HOST, M.SWAP_IN): R.SWAPPING_IN,
    (R.HOST, M.PREFETCH): R.PREFETCHING,
    (R.SWAPPING_IN, M.IN_DONE): R.RESIDENT,
    (R.SWAPPING_IN, M.IN_FAILED): R.HOST,
    (R.PREFETCHING, M.IN_DONE): R.PREFETCHED,
    (R.PREFETCHING, M.IN_FAILED): R.HOST,
    (R.SWAPPING_IN, M.IN_DEFERRED): R.HOST,
    (R.PREFETCHING, M.IN_DEFERRED): R.HOST,
    (R.PREFETCHING, M.GRANTED): R.SWAPPING_IN,
    (R.PREFETCHED, M.GRANTED): R.RESIDENT,
    (R.PREFETCHED, M.SWAP_OUT): R.SWAPPING_OUT,
    (R.RESIDENT, M.ADOPTED_SWAPPED): R.HOST,
    **{(r, M.LOST_TRACK): R.UNKNOWN for r in Residency if r is not R.UNKNOWN},
    **{(r, M.FOUND_ON_CARD): R.RESIDENT for r in Residency if not r.on_card},
    **{(r, M.FOUND_IN_HOST): R.HOST for r in Residency if r is not R.HOST},
}
"""(residency, move) → next residency. Nothing else is allowed."""


class InvalidMove(Exception):
    """A change of residency that the table does not allow was attempted."""

    def __init__(self, residency: Residency, move: Move) -> None:
        """Record the refused ``residency`` and ``move``."""
        super().__init__(f"no move from {residency.value!r} on {move.name}")
        self.residency = residency
        self.move = move


def settle(residency: Residency, found: Residency) -> Residency:
    """The residency once the driver says where the memory is (``found``).

    ``found`` is ``RESIDENT``, ``HOST`` or ``UNKNOWN``; a tenant already there (or
    ``PREFETCHED``, which is on the card) stays as it is.

    Raises:
        InvalidMove: ``found`` is not one of the three.
    """
    if found is R.RESIDENT:
        return residency if residency.on_card else move(residency, M.FOUND_ON_CARD)
    if found is R.HOST:
        return residency if residency is R.HOST else move(residency, M.FOUND_IN_HOST)
    if found is R.UNKNOWN:
        return residency if residency is R.UNKNOWN else move(residency, M.LOST_TRACK)
    raise InvalidMove(residency, M.LOST_TRACK)


def move(residency: Residency, why: Move) -> Residency:
    """Return the residency after ``why``.

    Raises:
        InvalidMove: the table has no such move.
    """
    try:
        return MOVES[(residency, why)]
    except KeyError:
        raise InvalidMove(residency, why) from None


def mermaid() -> str:
    """Render the table as a Mermaid state diagram (for docs/states.md)."""
    lines = ["stateDiagram-v2", "    [*] --> resident"]
    for (state, why), target in MOVES.items():
        lines.append(f"    {_node(state)} --> {_node(target)}: {why.value}")
    return "\n".join(lines)


def _node(residency: Residency) -> str:
    return residency.value.replace("-", "_")
