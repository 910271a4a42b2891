"""The core's record of one tenant (mutable; never leaves the core).

Its fields come in groups, one per concern: where it stands in the rotation
(:class:`Turn`), where its memory is and what may be done with it
(:class:`Memory`), what went wrong and the operator's word on it
(:class:`FaultState`), and its class among the tenants (:class:`Class`). The
scheduling state and the residency are each one value of a transition table
(:mod:`kiwid.core.states`, :mod:`kiwid.core.residency`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kiwid.core.ledger import Ledger
from kiwid.core.lever import Lever
from kiwid.core.model import Fault, GpuId, TenantId, TenantPolicy, TenantState, TenantSwap
from kiwid.core.residency import Residency

S = TenantState


__all__ = ["Class", "Fault", "FaultState", "Memory", "TenantRecord", "Turn"]


@dataclass
class Turn:
    """Where a tenant stands in the rotation, and the timers of its turn."""

    granted_at: float | None = None
    """When its quantum began: the moment it was let go after its grant (``None``:
    not holding, or granted and still gated while its memory comes back)."""
    window_at: float | None = None
    """When it was last let go: the start of its window to show GPU work."""
    quiet_s: float = 0.0
    """Seconds it ran without GPU work at the end of its earlier turns in this burst:
    silence over several turns shorter than ``idle_release`` adds up, so a tenant
    that stopped working goes idle all the same instead of rotating for ever."""
    claim: int = -1
    """Order of its claim on the GPUs it holds now: its grant, or a later change of
    its GPUs (a counter, so that claims at the same instant are still ordered)."""
    last_run: float = -math.inf
    """When it was last granted (the least recently run is swapped out first)."""
    last_active: float | None = None
    """When GPU work of it was last seen."""
    remaining_s: float | None = None
    """The rest of its quantum, kept when a higher priority preempted it."""
    retry_at: float = -math.inf
    """Its memory could not come back: not granted again before this time."""
    adopting_until: float = -math.inf
    """Re-adopted from a previous kiwid: until then it claims no GPU, so that the
    tenants that run show their activity first."""
    waiting_for: str | None = None
    """Why a gated tenant is not let go although nothing is ahead of it."""
    free_wait_since: float | None = None
    """Granted, its restore waits for the card's free memory since then."""
    last_preemption: tuple[float, str, TenantId | None] | None = None
    """When it was last preempted, why (``quantum`` or ``priority``), and for whom."""
    last_wake: tuple[float, str, str] | None = None
    """When it was last woken from parked, why (``request``, ``operator`` or
    ``policy``), and what woke it (the socket and what waits on it, or who asked)."""

    @property
    def began(self) -> float | None:
        """When its present window to show GPU work began: its let-go, else its grant."""
        return self.window_at if self.window_at is not None else self.granted_at

    def silent(self) -> bool:
        """Whether it was let go and showed no GPU work since (its turn unused so far)."""
        began = self.began
        return began is not None and (self.last_active is None or self.last_active < began)

    def idle_since_woken(self) -> bool:
        """Whether it was woken from parked and has shown no GPU work since."""
        woken = self.last_wake
        return woken is not None and (self.last_active is None or self.last_active < woken[0])


@dataclass
class Memory:
    """Where a tenant's memory is, how big it is, and whether it may move."""

    residency: Residency = Residency.RESIDENT
    footprint: dict[GpuId, int | None] = field(default_factory=dict)
    """What the GPU lists of it now, per GPU (``None``: the driver does not say)."""
    peak: dict[GpuId, int] = field(default_factory=dict)
    """The most memory it was seen using, per GPU (remembered while swapped)."""
    known: bool = False
    """Whether its working set is known: it held the GPU before, or its workload
    ran before (``remembered``)."""
    remembered: int = 0
    """The peak footprint its workload had in an earlier run (bytes per GPU; 0: none)."""
    unswappable: str | None = None
    """Why its memory may never leave the card (the driver cannot checkpoint it)."""
    swap_refusal: str | None = None
    """Why its memory may not be moved for now (``None``: it may)."""
    refused_until_run: bool = False
    """``swap_refusal`` came from a failed swap-out: it holds until it runs again."""
    restored_for_turn: bool = False
    """Its memory came back from host RAM for the turn it holds or waits for: if it
    does no GPU work in that turn, the restore was wasted (``ledger.restores_wasted``)."""
    move_due: float = math.inf
    """A move of it in flight should be done by then (its size at the rate seen so
    far): past it, the move is overdue and the tenant is passed over for its turn."""


@dataclass
class FaultState:
    """What went wrong with a tenant, and the operator's word on it."""

    cause: Fault | None = None
    """Why it is stuck (``STUCK`` only)."""
    regate_at: float = math.inf
    """Stuck and not contained: when its gate is tried again."""
    mending: bool = False
    """Stuck, and a :class:`~kiwid.core.actions.Retry` or ``Release`` is under way.

    Until that job answers (``Mended``, ``Released``, or a fault of its own), no gate
    is asked for the tenant: it would run after the release (its jobs run in order)
    and hold a tenant let go for good."""
    released: str | None = None
    """Released by an operator: what the release said (``RELEASED`` only)."""


@dataclass
class Class:
    """A tenant's class among the others: its policy, its rank, its entitled share."""

    policy: TenantPolicy = field(default_factory=TenantPolicy)
    """Its weight, priority, own TQ and swap policy."""
    rank: float = 0.0
    """Its place among priority classes: its priority, or first (infinity) once
    boosted. Kept by :meth:`set_policy` and :meth:`set_boost`."""
    boosted: bool = False
    """It waited ``max_wait`` behind higher classes: first in line for one quantum."""
    entitled_rate: float = 0.0
    """Its entitled share of GPU time now (0 unless its class bursts highest)."""
    accounted_at: float = 0.0
    """Until when ``ledger.entitled_s`` is booked."""

    def set_policy(self, policy: TenantPolicy) -> None:
        """Take a new policy (its rank follows)."""
        self.policy = policy
        self.rank = float("inf") if self.boosted else float(policy.priority)

    def set_boost(self, boosted: bool) -> None:
        """Boost it (first in line for one quantum) or end its boost."""
        self.boosted = boosted
        self.rank = float("inf") if boosted else float(self.policy.priority)


@dataclass
class TenantRecord:
    """Everything the scheduler knows of one tenant, grouped by concern."""

    id: TenantId
    gpus: frozenset[GpuId]
    seq: int
    """Queue order: lower is earlier (FIFO; re-drawn when it is queued again)."""
    state: TenantState = S.IDLE
    state_since: float = 0.0
    epoch: int = 0
    """Moves at every let-go, fault, operator's retry or release: every action carries
    it, and a result counts only at the epoch it was asked in (:mod:`kiwid.core.answers`)."""
    lever: Lever = Lever.OPEN
    """Where its gate stands (:mod:`kiwid.core.lever`)."""
    turn: Turn = field(default_factory=Turn)
    memory: Memory = field(default_factory=Memory)
    fault: FaultState = field(default_factory=FaultState)
    cls: Class = field(default_factory=Class)
    ledger: Ledger = field(default_factory=Ledger)

    @property
    def bursting(self) -> bool:
        """Whether it is in a burst (any state but idle and parked)."""
        return self.state is not S.IDLE and self.state is not S.PARKED

    @property
    def running(self) -> bool:
        """Whether it holds or co-runs and was let go (its quantum, if any, runs)."""
        return self.state in (S.HOLDER, S.CORUNNING) and not self.gated

    @property
    def starting(self) -> bool:
        """Granted but still gated: its memory is coming back, or room is being made."""
        return self.state is S.HOLDER and self.gated

    @property
    def movable(self) -> bool:
        """Whether its memory may be swapped out now (gated or about to be, no refusal)."""
        return (
            self.memory.swap_refusal is None
            and self.memory.unswappable is None
            and self.state is not S.STUCK
            and self.cls.policy.swap is TenantSwap.ALLOW
        )

    @property
    def gated(self) -> bool:
        """The scheduler asked for it to be gated and has not let it go since."""
        return self.lever.gated

    @property
    def gate_pending(self) -> bool:
        """A gate was asked and has not taken yet: it may still run."""
        return self.lever is Lever.CLOSING

    @property
    def ungate_pending(self) -> bool:
        """An ungate was asked and has not taken yet: it does not run yet (a slow unlock)."""
        return self.lever is Lever.OPENING

    @property
    def holds_nothing(self) -> bool:
        """Stuck with its gate in place, or released: it claims no GPU."""
        return (self.state is S.STUCK and not self.loose) or self.state is S.RELEASED

    @property
    def loose(self) -> bool:
        """Stuck and not contained: its gate failed, and it may run."""
        cause = self.fault.cause
        return cause is not None and not cause.contained

    @property
    def may_run(self) -> bool:
        """Whether it may be running GPU work now, as far as kiwid knows.

        Let go and in a burst, or asked to be gated and not confirmed yet, or stuck
        with a gate that did not take. Released tenants run too, on an operator's word,
        and are not counted: they keep nobody off a GPU.
        """
        if self.state is S.IDLE or self.state is S.RELEASED:
            return False  # no burst: it competes for no GPU time (it is gated at its next)
        return self.running or self.gate_pending or self.loose

    def entitled(self, now: float) -> float:
        """Its entitled GPU seconds up to ``now``."""
        cls = self.cls
        return self.ledger.entitled_s + cls.entitled_rate * max(0.0, now - cls.accounted_at)

    @property
    def sized(self) -> bool:
        """Whether what it needs is known or declared (a newcomer nobody knows is not)."""
        return self.memory.known or self.cls.policy.memory_bytes is not None

    def held(self, gpu: GpuId) -> int:
        """The memory it has on ``gpu`` by what was seen of it and its workload.

        What a swap-out of it moves (its declaration is room kept for it, not memory
        it holds).
        """
        memory = self.memory
        return max(memory.peak.get(gpu, 0), memory.footprint.get(gpu) or 0, memory.remembered)

    def size(self, gpu: GpuId) -> int:
        """The memory it takes on ``gpu`` when on the card: the room kept for it.

        The largest of what it was seen using, what its workload used before and what
        it declared: a declaration keeps room for what it will use, and never shrinks
        what it was seen using.
        """
        return max(self.held(gpu), self.cls.policy.memory_bytes or 0)
