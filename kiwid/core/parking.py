"""Parked tenants: idle ones whose memory waits in host RAM until they are asked for.

A tenant parks when its memory goes to host RAM and it is idle: it was idle when
swapped out to make room (:func:`kiwid.core.room.swap_out_for_room`), or it did no
GPU work in a turn it got (:func:`park_unused`). A parked tenant is gated, out of
the queue, holds no turn and costs no swap; it is woken (:func:`wake`) by a request
waiting on one of its sockets (the shell's probe), by an operator or a router
(``kiwictl wake``), or when parking no longer applies to it (:func:`wake_unparkable`),
and then waits for a turn as a burst, like any tenant whose GPU work began.

Without parking, such a tenant is queued after its eviction: at its turn it is
restored, does nothing for ``idle_release``, goes idle and is swapped out again at
the next squeeze, a restore wasted each time (``ledger.restores_wasted`` counts
them for everyone, parked or not).
"""

from __future__ import annotations

from kiwid.core.actions import Action
from kiwid.core.model import Mode, SwapMode, TenantState, TenantSwap
from kiwid.core.states import Trigger
from kiwid.core.table import TenantTable
from kiwid.core.tenant import TenantRecord

S = TenantState

REQUEST = "request"
"""A request waits on one of its sockets (the shell's probe)."""
OPERATOR = "operator"
"""``kiwictl wake``, or a router's ``wake`` command."""
POLICY = "policy"
"""Parking no longer applies to it (a rule, an annotation, ``memory.park``, its GPU)."""
REASONS = (REQUEST, OPERATOR, POLICY)


def unparkable(table: TenantTable, t: TenantRecord) -> str | None:
    """Why ``t`` may not park by policy (``None``: it may).

    Each of its GPUs must be managed, gate at times (mode not ``off``), move memory
    (``memory.swap`` not ``none``) and park (``memory.park = "idle"``); the tenant's
    own policy must let its memory move and let it park.
    """
    if not t.gpus:
        return "it is on no GPU"
    policy = t.cls.policy
    if not policy.park:
        return "its rule or pod says park = false"
    if policy.swap is not TenantSwap.ALLOW or t.memory.unswappable is not None:
        return "its memory may not leave the card"
    for gpu in sorted(t.gpus):
        gp = table.policies.get(gpu)
        if gp is None:
            return f"GPU {gpu} is not managed now"
        if gp.mode is Mode.OFF:
            return f"GPU {gpu} does not gate (mode off)"
        if gp.swap is SwapMode.NONE:
            return f"GPU {gpu} moves no memory (memory.swap = none)"
        if not gp.park:
            return f'GPU {gpu} parks nobody (memory.park = "off")'
    return None


def may_park(table: TenantTable, t: TenantRecord) -> bool:
    """Whether ``t`` parks now, if idle: its policy lets it, and it has memory that may move."""
    return unparkable(table, t) is None and t.movable and any(t.held(g) for g in t.gpus)


def park_unused(table: TenantTable, t: TenantRecord, now: float, actions: list[Action]) -> None:
    """A woken holder that did no GPU work in its turn parks again: gated, memory out.

    The caller checked :func:`may_park` and the host-RAM floor. Its swap-out is
    asked after its gate (a tenant's jobs run in order).
    """
    table.set_state(t, Trigger.TURN_UNUSED, now)
    t.turn.granted_at = None
    table.gate(t, actions)


def wake(table: TenantTable, t: TenantRecord, reason: str, detail: str, now: float) -> bool:
    """Wake a parked tenant: it joins the back of its class's queue, as a burst.

    Returns whether it was parked (a tenant that is not wakes nothing).
    """
    if t.state is not S.PARKED:
        return False
    table.set_state(t, Trigger.WOKEN, now)
    t.seq = table.next_seq()
    t.turn.last_wake = (now, reason, detail)
    t.ledger.wakes += 1
    table.wakes[reason] = table.wakes.get(reason, 0) + 1
    return True


def wake_unparkable(table: TenantTable, among: list[TenantRecord], now: float) -> None:
    """Parked tenants that parking no longer applies to are woken (reason ``policy``).

    A rule or an annotation turned it off for the tenant, ``memory.park`` for its GPU,
    or its GPU stopped moving memory or gating: it waits for a turn again, and its
    memory comes back at it.
    """
    for t in among:
        if t.state is S.PARKED and (why := unparkable(table, t)) is not None:
            wake(table, t, POLICY, why, now)


def unpark_resident(table: TenantTable, t: TenantRecord, now: float, actions: list[Action]) -> None:
    """A parked tenant whose memory could not leave the card is let go, idle.

    Parked means in host RAM: one whose swap-out failed holds its room all the same,
    so it runs free again, as an idle tenant does, until its next GPU work.
    """
    if t.state is S.PARKED and t.memory.residency.on_card:
        table.set_state(t, Trigger.UNPARKED, now)
        table.let_go(t, now, actions)
