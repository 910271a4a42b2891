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


class TenantState(enum.StrEnum):
    """Where a tenant stands. Only ``WAITING`` tenants are gated."""

    IDLE = "idle"
    """No GPU work lately; runs free."""
    HOLDER = "holder"
    """In a burst and holding all of its (gating) GPUs exclusively."""
    WAITING = "waiting"
    """In a burst, gated (frozen or locked), queued for its turn."""
    CORUNNING = "corunning"
    """In a burst on GPUs that are not gated now (mode off, or auto and it fits)."""


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
    """

    tq_s: float = 30.0
    idle_release_s: float = 5.0
    mode: Mode = Mode.EXCLUSIVE
    capacity_bytes: int = 80 * 2**30
    reserve_bytes: int = 2**30
    swap: SwapMode = SwapMode.NONE

    def __post_init__(self) -> None:
        """Reject values the scheduler cannot honour.

        Raises:
            ValueError: a non-positive TQ, a negative idle release or memory size.
        """
        if not self.tq_s > 0:
            raise ValueError(f"tq_s must be > 0, not {self.tq_s}")
        if not self.idle_release_s > 0:
            raise ValueError(f"idle_release_s must be > 0, not {self.idle_release_s}")
        if self.capacity_bytes < 0 or self.reserve_bytes < 0:
            raise ValueError("capacity_bytes and reserve_bytes must be >= 0")
