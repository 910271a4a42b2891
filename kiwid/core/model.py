"""Plain values the scheduling core works with."""

from __future__ import annotations

import enum
from dataclasses import dataclass

GpuId = str
"""A GPU as the scheduler knows it: its index as a decimal string ("0", "1", ...)."""

TenantId = str
"""A tenant: a container (its cgroup) or a bare process; opaque to the core."""


class Mode(enum.StrEnum):
    """How a GPU is shared."""

    EXCLUSIVE = "exclusive"
    """Overlapping bursts always rotate: one tenant at a time, TQ seconds each."""
    AUTO = "auto"
    """Rotate only when the bursting tenants' memory does not fit the card."""
    OFF = "off"
    """No gating: the driver time-slices the GPU between everyone."""


class SwapMode(enum.StrEnum):
    """What happens to a waiting tenant's GPU memory (``[memory] swap``)."""

    NONE = "none"
    """It stays on the card: every tenant's working set must fit together."""
    CHECKPOINT = "checkpoint"
    """Every waiting tenant's memory goes to host RAM (the driver's checkpoint)."""
    AUTO = "auto"
    """Memory goes to host RAM only when the next tenant would not fit beside it."""


class Newcomer(enum.StrEnum):
    """What a tenant never seen before gets on its first turn (``memory.newcomer``)."""

    WHOLE_CARD = "whole-card"
    """The card to itself: every waiting tenant's memory leaves first. Safe (it may
    take all it wants), at the cost of one slow first hand-over."""
    FREE = "free"
    """Only what it has shown so far: it may run out of memory if it grows beyond
    what is free beside the others."""


class TenantSwap(enum.StrEnum):
    """Whether a tenant's memory may be swapped to host RAM (per tenant, ``swap``)."""

    ALLOW = "allow"
    """As the GPU's ``memory.swap`` says."""
    NEVER = "never"
    """Never: its memory stays on the card (a latency-critical tenant)."""


@dataclass(frozen=True)
class TenantPolicy:
    """How one tenant is scheduled, as the shell resolved it (rules, annotations, kiwictl).

    Attributes:
        weight: Its quantum is ``TQ x weight``; with everyone saturating, long-run
            shares are ``weight / sum of weights`` within its priority class (> 0).
        priority: Higher first: a higher class preempts a lower holder and lower
            classes wait while a higher one bursts.
        tq_s: Its own TQ in seconds (``None``: the GPU's).
        swap: Whether its memory may go to host RAM.
    """

    weight: float = 1.0
    priority: int = 0
    tq_s: float | None = None
    swap: TenantSwap = TenantSwap.ALLOW

    def __post_init__(self) -> None:
        """Reject values the scheduler cannot honour.

        Raises:
            ValueError: a weight or TQ that is not a finite number > 0.
        """
        if not 0 < self.weight < float("inf"):
            raise ValueError(f"weight must be > 0, not {self.weight}")
        if self.tq_s is not None and not 0 < self.tq_s < float("inf"):
            raise ValueError(f"tq_s must be > 0, not {self.tq_s}")


class TenantState(enum.StrEnum):
    """Where a tenant stands. ``WAITING`` and ``STUCK`` tenants are gated."""

    IDLE = "idle"
    """No GPU work lately; runs free."""
    HOLDER = "holder"
    """In a burst and holding all of its (gating) GPUs exclusively."""
    WAITING = "waiting"
    """In a burst, gated (frozen or locked), queued for its turn."""
    CORUNNING = "corunning"
    """In a burst on GPUs that are not gated now (mode off, or auto and it fits)."""
    STUCK = "stuck"
    """An operation on it failed for good, ran past its deadline, or left the driver
    out of step: it stays gated, holds nothing and waits for an operator (``kiwictl
    retry`` or ``release``) while everyone else rotates."""
    RELEASED = "released"
    """A stuck tenant an operator let go: it runs ungated, outside the rotation, until
    it leaves or ``kiwictl retry`` brings it back."""


@dataclass(frozen=True)
class GpuPolicy:
    """The scheduling policy of one GPU, as the shell resolved it from config.

    Attributes:
        tq_s: The time quantum in seconds (> 0).
        idle_release_s: Seconds without GPU activity after which a holder yields
            early, or a granted waiter goes back to idle.
        mode: The sharing mode.
        capacity_bytes: The card's memory, for ``auto``'s fit test.
        reserve_bytes: Memory kept free in ``auto``'s fit test and when swapping
            (driver, context overheads).
        swap: Whether and when waiting tenants' memory is swapped to host RAM.
        preempt_after_s: Seconds of a holder's quantum after which a waiting tenant
            of a higher priority preempts it (0: at once).
        max_wait_s: The longest a tenant waits behind higher priority classes
            before it gets one quantum all the same (``None``: no bound).
        newcomer: What a tenant whose footprint nobody knows needs on its first turn.
    """

    tq_s: float = 30.0
    idle_release_s: float = 5.0
    mode: Mode = Mode.EXCLUSIVE
    capacity_bytes: int = 80 * 2**30
    reserve_bytes: int = 2**30
    swap: SwapMode = SwapMode.NONE
    preempt_after_s: float = 0.0
    max_wait_s: float | None = None
    newcomer: Newcomer = Newcomer.WHOLE_CARD

    def __post_init__(self) -> None:
        """Reject values the scheduler cannot honour.

        Raises:
            ValueError: a non-positive TQ, a negative idle release, memory size or
                preemption delay, or a non-positive max wait.
        """
        if not self.tq_s > 0:
            raise ValueError(f"tq_s must be > 0, not {self.tq_s}")
        if not self.idle_release_s > 0:
            raise ValueError(f"idle_release_s must be > 0, not {self.idle_release_s}")
        if self.capacity_bytes < 0 or self.reserve_bytes < 0:
            raise ValueError("capacity_bytes and reserve_bytes must be >= 0")
        if not self.preempt_after_s >= 0:
            raise ValueError(f"preempt_after_s must be >= 0, not {self.preempt_after_s}")
        if self.max_wait_s is not None and not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, not {self.max_wait_s}")
