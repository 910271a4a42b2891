"""Whether a tenant's gate holds, and which way it is moving, as one table.

The scheduler asks for a gate (:class:`~kiwid.core.actions.Gate`) and for an ungate
(:class:`~kiwid.core.actions.Ungate`); the shell answers each once it has taken
(``Gated``, ``Ungated``). Between the two a tenant's gate is on its way, and
what it may do then differs: a tenant whose gate is *closing* may still run (no
one else is let go on its GPUs), one whose gate is *opening* does not run yet
(its quantum has not begun). A fault, a fence, a mend or an operator's release
says outright whether it runs. Every change goes through :func:`pull`; one the
table does not list raises :class:`InvalidPull`.

The answers that reach this table are the current epoch's only
(:mod:`kiwid.core.answers`): an answer to a gate asked before a let-go is old
news and changes nothing here.
"""

from __future__ import annotations

import enum


class Lever(enum.StrEnum):
    """Where a tenant's gate stands."""

    OPEN = "open"
    """It runs: never gated, its ungate took, or kiwid knows its gate did not hold."""
    OPENING = "opening"
    """An ungate is asked and has not taken yet: it does not run yet."""
    CLOSING = "closing"
    """A gate is asked and has not taken yet: it may still run."""
    CLOSED = "closed"
    """Its gate holds (frozen, locked or fenced)."""

    @property
    def gated(self) -> bool:
        """Whether the scheduler holds it gated (asked, and not let go since)."""
        return self in (Lever.CLOSING, Lever.CLOSED)


class Pull(enum.StrEnum):
    """What moves a tenant's gate."""

    GATE = "a gate is asked"
    GATED = "its gate took"
    UNGATE = "it is let go: an ungate is asked"
    UNGATED = "its ungate took: it runs"
    HELD = "kiwid knows it does not run: a contained fault, a fence, a mend, a re-adoption"
    LOOSE = "kiwid knows it may run: a gate or ungate that did not take, a release"


L = Lever
P = Pull

PULLS: dict[tuple[Lever, Pull], Lever] = {
    (L.OPEN, P.GATE): L.CLOSING,
    (L.OPENING, P.GATE): L.CLOSING,
    (L.CLOSING, P.GATED): L.CLOSED,
    (L.CLOSED, P.GATED): L.CLOSED,
    # A stuck tenant's converge found it running while its gate was on its way.
    (L.OPEN, P.GATED): L.CLOSED,
    (L.CLOSED, P.UNGATE): L.OPENING,
    (L.CLOSING, P.UNGATE): L.OPENING,
    (L.OPENING, P.UNGATED): L.OPEN,
    # The ungate of before took; the gate asked since is still on its way.
    (L.CLOSING, P.UNGATED): L.CLOSING,
    **{(lever, P.HELD): L.CLOSED for lever in Lever},
    **{(lever, P.LOOSE): L.OPEN for lever in Lever},
}
"""(lever, pull) → next lever. Nothing else is allowed."""


class InvalidPull(Exception):
    """A change of a gate that the table does not allow was attempted."""

    def __init__(self, lever: Lever, why: Pull) -> None:
        """Record the refused ``lever`` and ``why``."""
        super().__init__(f"no pull from {lever.value!r} on {why.name}")
        self.lever = lever
        self.why = why


def pull(lever: Lever, why: Pull) -> Lever:
    """Return the lever after ``why``.

    Raises:
        InvalidPull: the table has no such change.
    """
    try:
        return PULLS[(lever, why)]
    except KeyError:
        raise InvalidPull(lever, why) from None


def mermaid() -> str:
    """Render the table as a Mermaid state diagram (for docs/states.md)."""
    lines = ["stateDiagram-v2", "    [*] --> open"]
    for (lever, why), target in PULLS.items():
        lines.append(f"    {lever.value} --> {target.value}: {why.value}")
    return "\n".join(lines)
