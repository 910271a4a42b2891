"""Plain values the scheduling core works with."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import ClassVar

from kiwid.core.quantity import QuantityError, declared_bytes

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

    The range of a weight and a priority lives here and only here: the config
    rules, ``register``, kiwi-hook and ``kiwictl set-weight``/``set-priority`` all
    ask :meth:`weight_refusal` and :meth:`priority_refusal`, so that a value one of
    them takes is taken by all, and refused by all in the same words. kiwi-hook,
    which warns rather than refuse, brings a pod's value within the range with
    :meth:`clamp_weight` and :meth:`clamp_priority`.

    Attributes:
        weight: Its quantum is ``TQ x weight``; with everyone saturating, long-run
            shares are ``weight / sum of weights`` within its priority class.
        priority: Higher first: a higher class preempts a lower holder and lower
            classes wait while a higher one bursts.
        tq_s: Its own TQ in seconds (``None``: the GPU's).
        swap: Whether its memory may go to host RAM.
        memory_bytes: The GPU memory it declared it needs on each of its GPUs (bytes;
            ``None``: none declared). Its first turn is sized by it, and it is never
            sized below it; a larger footprint, seen or remembered, wins.
        park: Whether it may park when idle (its memory in host RAM, out of the
            queue until a request or an operator wakes it), where its GPUs park
            (``memory.park``). ``False``: a rule's ``park = false`` or a pod's
            ``kiwi.io/park: "false"`` keeps it in the rotation.
    """

    MIN_WEIGHT: ClassVar[float] = 0.01
    """The smallest weight: a quantum of TQ / 100."""
    MAX_WEIGHT: ClassVar[float] = 1000.0
    """The largest weight: a quantum of 1000 x TQ."""
    MIN_PRIORITY: ClassVar[int] = -1000
    MAX_PRIORITY: ClassVar[int] = 1000
    WEIGHT_RANGE: ClassVar[str] = "a number from 0.01 to 1000"
    """The range in words, completing "must be ..." (the config rules say it so)."""
    PRIORITY_RANGE: ClassVar[str] = "an integer from -1000 to 1000"

    weight: float = 1.0
    priority: int = 0
    tq_s: float | None = None
    swap: TenantSwap = TenantSwap.ALLOW
    memory_bytes: int | None = None
    park: bool = True

    @staticmethod
    def memory_refusal(memory: object) -> str | None:
        """Why ``memory`` cannot be a tenant's declaration in bytes; ``None`` if it can."""
        if not isinstance(memory, int) or isinstance(memory, bool):
            return f"memory_bytes must be an integer number of bytes, not {memory!r}"
        try:
            declared_bytes(memory)
        except QuantityError as err:
            return f"memory_bytes {memory}: {err}"
        return None

    @staticmethod
    def weight_refusal(weight: object) -> str | None:
        """Why ``weight`` cannot be a tenant's weight, naming it; ``None`` if it can."""
        if (
            isinstance(weight, int | float)
            and not isinstance(weight, bool)
            and TenantPolicy.MIN_WEIGHT <= weight <= TenantPolicy.MAX_WEIGHT  # NaN is not
        ):
            return None
        return f"weight must be {TenantPolicy.WEIGHT_RANGE}, not {_shown(weight)}"

    @staticmethod
    def priority_refusal(priority: object) -> str | None:
        """Why ``priority`` cannot be a tenant's priority, naming it; ``None`` if it can."""
        if (
            isinstance(priority, int)
            and not isinstance(priority, bool)
            and TenantPolicy.MIN_PRIORITY <= priority <= TenantPolicy.MAX_PRIORITY
        ):
            return None
        return f"priority must be {TenantPolicy.PRIORITY_RANGE}, not {_shown(priority)}"

    @staticmethod
    def clamp_weight(weight: float) -> float:
        """The weight in range nearest to ``weight``.

        kiwi-hook asks for it when a pod's annotation asks for one out of range,
        rather than refusing the container.

        Raises:
            ValueError: ``weight`` is NaN, nearest to nothing.
        """
        if math.isnan(weight):
            raise ValueError(TenantPolicy.weight_refusal(weight))
        return min(max(weight, TenantPolicy.MIN_WEIGHT), TenantPolicy.MAX_WEIGHT)

    @staticmethod
    def clamp_priority(priority: float) -> int:
        """The priority in range nearest to ``priority``, as :meth:`clamp_weight`.

        Args:
            priority: An integer, or an infinity for one too long to read.

        Raises:
            ValueError: ``priority`` is NaN, nearest to nothing.
        """
        if math.isnan(priority):
            raise ValueError(TenantPolicy.priority_refusal(priority))
        return int(min(max(priority, TenantPolicy.MIN_PRIORITY), TenantPolicy.MAX_PRIORITY))

    def __post_init__(self) -> None:
        """Reject values the scheduler cannot honour.

        Raises:
            ValueError: a weight or priority out of range, a TQ that is not a finite
                number > 0, or a memory declaration of no bytes.
        """
        refusal = self.weight_refusal(self.weight) or self.priority_refusal(self.priority)
        if refusal is None and self.memory_bytes is not None:
            refusal = self.memory_refusal(self.memory_bytes)
        if refusal is not None:
            raise ValueError(refusal)
        if self.tq_s is not None and not 0 < self.tq_s < float("inf"):
            raise ValueError(f"tq_s must be > 0, not {self.tq_s}")


def _shown(value: object) -> str:
    """A number as a message names it: ``2`` for ``2.0`` (kiwictl sends floats)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


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
    PARKED = "parked"
    """Idle with its memory in host RAM (or on its way there): gated, out of the queue,
    holding no turn and costing no swap, until a request waits on one of its sockets
    or an operator (``kiwictl wake``) wakes it; then it waits for a turn as a burst."""
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
        link_bytes_per_s: The rates (out to host RAM, back in) a swap is expected to
            run at until one is seen on this GPU (``None``: the slowest expected of
            the driver's checkpoint on an H200).
        park: Whether idle tenants park (``memory.park = "idle"``): one swapped out
            for room while idle, or a woken one that did no GPU work in its turn, stays in
            host RAM, out of the queue, until woken. ``False`` (``"off"``): it waits
            for a turn like any other.
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
    link_bytes_per_s: tuple[float, float] | None = None
    park: bool = True

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


@dataclass(frozen=True)
class Fault:
    """Why a tenant is stuck."""

    operation: str
    """What kiwid was doing: ``gate``, ``ungate``, ``swap-out``, ``swap-in``, ``retry``,
    ``release`` or ``adopt``."""
    reason: str
    at: float
    """When (monotonic seconds)."""
    contained: bool
    """Whether kiwid knows it does not run (gated, locked or fenced)."""
    pid: int | None = None
    answer: str | None = None
