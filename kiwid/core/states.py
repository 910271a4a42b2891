"""The tenant state machine, as one table.

Every change of a tenant's state goes through :func:`transition`; a change the
table does not list raises :class:`InvalidTransition` and leaves the tenant as
it was. ``docs/states.md`` is generated from this table and the residency table
(``python -m kiwid.core.diagrams``).

Waiting and parked tenants are gated; so is a holder whose memory is still coming back to
the card (it is let go once it is there: :mod:`kiwid.core.residency`), and so is
a stuck one, which waits for an operator while the others rotate.
"""

from __future__ import annotations

import enum

from kiwid.core.model import TenantState


class Trigger(enum.StrEnum):
    """Why a tenant changes state."""

    BURST_FREE = "burst starts, its GPUs are free"
    BURST_BUSY = "burst starts, a GPU it needs is held or claimed"
    BURST_UNGATED = "burst starts on GPUs that are not gated now"
    GRANTED = "its turn: every GPU it needs is free and nobody ahead claims them"
    PREEMPTED = "quantum over and someone waits"
    PREEMPTED_PRIORITY = "a tenant of a higher priority waits for its GPU"
    IDLE_TIMEOUT = "no GPU work for idle_release seconds"
    GATING_STOPPED = "its GPUs stopped gating (mode off, or auto and it all fits)"
    GATING_STARTED = "its GPUs started gating (mode exclusive, or auto and it no longer fits)"
    SWAPPED_OUT = "its memory went to host RAM to make room; it waits to come back"
    SWAP_IN_FAILED = (
        "its memory could not come back (restore failed, or no room); it waits, "
        "the rotation goes on"
    )
    PASSED_OVER = (
        "granted while its memory moves, and the move runs past its expected time: "
        "the next one goes first"
    )
    ADOPTED = "a previous kiwid left it gated; it waits for its turn"
    FAULTED = (
        "an operation on it failed for good, ran past its deadline, or left the driver out of step"
    )
    GATE_MENDED = "its gate, tried again, took: it waits for its turn"
    PARKED_IDLE = (
        "idle when its memory went to host RAM to make room: parked, out of the queue "
        "until a request or an operator wakes it"
    )
    TURN_UNUSED = "no GPU work in the turn it got: parked, its memory goes back to host RAM"
    WOKEN = (
        "a request waits on one of its sockets, an operator or a router woke it "
        "(kiwictl wake), or parking no longer applies to it: it waits for a turn"
    )
    UNPARKED = "its memory could not leave the card: it is let go, idle"
    RETRIED = "an operator asked kiwid to try again (kiwictl retry), and it could"
    RELEASED = "an operator let it run ungated (kiwictl release)"


S = TenantState
T = Trigger

TRANSITIONS: dict[tuple[TenantState, Trigger], TenantState] = {
    (S.IDLE, T.BURST_FREE): S.HOLDER,
    (S.IDLE, T.BURST_BUSY): S.WAITING,
    (S.IDLE, T.BURST_UNGATED): S.CORUNNING,
    (S.WAITING, T.GRANTED): S.HOLDER,
    (S.WAITING, T.GATING_STOPPED): S.CORUNNING,
    (S.HOLDER, T.PREEMPTED): S.WAITING,
    (S.HOLDER, T.PREEMPTED_PRIORITY): S.WAITING,
    (S.HOLDER, T.IDLE_TIMEOUT): S.IDLE,
    (S.HOLDER, T.GATING_STOPPED): S.CORUNNING,
    (S.CORUNNING, T.IDLE_TIMEOUT): S.IDLE,
    (S.CORUNNING, T.GATING_STARTED): S.WAITING,
    (S.CORUNNING, T.GRANTED): S.HOLDER,
    (S.IDLE, T.SWAPPED_OUT): S.WAITING,
    (S.HOLDER, T.SWAP_IN_FAILED): S.WAITING,
    (S.HOLDER, T.PASSED_OVER): S.WAITING,
    (S.IDLE, T.ADOPTED): S.WAITING,
    (S.IDLE, T.PARKED_IDLE): S.PARKED,
    (S.HOLDER, T.TURN_UNUSED): S.PARKED,
    (S.PARKED, T.WOKEN): S.WAITING,
    (S.PARKED, T.UNPARKED): S.IDLE,
    (S.PARKED, T.FAULTED): S.STUCK,
    (S.IDLE, T.FAULTED): S.STUCK,
    (S.HOLDER, T.FAULTED): S.STUCK,
    (S.WAITING, T.FAULTED): S.STUCK,
    (S.CORUNNING, T.FAULTED): S.STUCK,
    (S.STUCK, T.FAULTED): S.STUCK,
    (S.STUCK, T.GATE_MENDED): S.WAITING,
    (S.STUCK, T.RETRIED): S.WAITING,
    (S.STUCK, T.RELEASED): S.RELEASED,
    (S.RELEASED, T.RETRIED): S.IDLE,
}
"""(state, trigger) → next state. Nothing else is allowed."""


class InvalidTransition(Exception):
    """A state change that the table does not allow was attempted."""

    def __init__(self, state: TenantState, trigger: Trigger) -> None:
        """Record the refused ``state`` and ``trigger``."""
        super().__init__(f"no transition from {state.value!r} on {trigger.name}")
        self.state = state
        self.trigger = trigger


def transition(state: TenantState, trigger: Trigger) -> TenantState:
    """Return the state after ``trigger``.

    Raises:
        InvalidTransition: the table has no such transition.
    """
    try:
        return TRANSITIONS[(state, trigger)]
    except KeyError:
        raise InvalidTransition(state, trigger) from None


def mermaid() -> str:
    """Render the table as a Mermaid state diagram (for docs/states.md)."""
    lines = ["stateDiagram-v2", "    [*] --> idle"]
    for (state, trigger), target in TRANSITIONS.items():
        lines.append(f"    {state.value} --> {target.value}: {trigger.value}")
    return "\n".join(lines)
