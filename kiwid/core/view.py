"""Read-only snapshots of the scheduler, for status displays."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kiwid.core.ledger import LedgerView
from kiwid.core.model import GpuId, GpuPolicy, TenantId, TenantPolicy, TenantState
from kiwid.core.residency import Residency


@dataclass(frozen=True)
class WaiterView:
    """One tenant in a GPU's queue."""

    tenant: TenantId
    since: float
    """Monotonic time it started waiting."""
    position: int
    """1 is next."""
    ahead_s: float = 0.0
    """The quanta of the waiters ahead of it (each its own: TQ x weight, or the rest
    of one a higher class cut short)."""
    outranked: bool = False
    """A higher priority class holds or waits ahead: its wait has no bound but
    ``max_wait``."""


@dataclass(frozen=True)
class HandoverView:
    """A GPU's hand-over under way (:mod:`kiwid.core.handover`)."""

    to: TenantId
    from_: TenantId | None
    since: float
    """Monotonic time of the grant."""
    phase: str | None
    """``gating the holder``, ``making room``, ``restoring`` or ``letting go``."""


@dataclass(frozen=True)
class GpuView:
    """One GPU: who holds it and who waits."""

    gpu: GpuId
    policy: GpuPolicy
    gating: bool
    """Whether tenants take turns on it now."""
    holder: TenantId | None
    holder_since: float | None
    preempt_at: float | None
    """When the holder must yield (``None``: nobody waits, it may keep the GPU)."""
    waiters: tuple[WaiterView, ...]
    memory_in_use_bytes: int
    holder_quantum_s: float | None = None
    """The holder's whole quantum (``None``: nobody holds)."""
    free_bytes: int | None = None
    """Its free memory by the driver's last reading (``None``: none yet)."""
    handover_waits_for: TenantId | None = None
    """The holder's quantum is over; the hand-over waits for this tenant's memory."""
    stuck: tuple[TenantId, ...] = ()
    """Its stuck tenants (they hold nothing and wait for an operator)."""
    blocked_by: TenantId | None = None
    """A stuck tenant whose gate did not take: nobody else is let go on this GPU."""
    held_back: tuple[TenantId, ...] = ()
    """Tenants kept gated on it although it does not gate now (their memory cannot come
    back yet, or they are stuck): each one's ``waiting_for`` or fault says why."""
    handover: HandoverView | None = None
    """The hand-over under way: granted, not running yet (``None``: none)."""


@dataclass(frozen=True)
class FaultView:
    """Why a tenant is stuck."""

    operation: str
    reason: str
    since: float
    """Monotonic time it got stuck."""
    contained: bool
    """Whether kiwid knows it does not run (else it keeps the others off its GPUs)."""
    mending: bool = False
    """An operator's retry or release is under way."""
    pid: int | None = None
    answer: str | None = None


@dataclass(frozen=True)
class TenantView:
    """One tenant's scheduling facts."""

    tenant: TenantId
    state: TenantState
    since: float
    gpus: frozenset[GpuId]
    last_active: float | None
    footprint: Mapping[GpuId, int | None]
    ledger: LedgerView
    resident: bool = True
    """Whether its memory is on the GPU (``False``: swapped to host RAM)."""
    peak: Mapping[GpuId, int] | None = None
    """The most memory it was seen using, per GPU."""
    residency: Residency = Residency.RESIDENT
    """Where its memory is, or which way it is moving."""
    gated: bool = False
    """Whether the scheduler has it gated (waiting, or granted and not let go yet)."""
    waiting_for: str | None = None
    """Why a gated tenant is not let go although nothing may be ahead of it."""
    swap_refusal: str | None = None
    """Why its memory may not be moved for now."""
    gate_failure: str | None = None
    """Why its last gate did not take (it runs on)."""
    policy: TenantPolicy = field(default_factory=TenantPolicy)
    """Its weight, priority, own TQ and swap policy."""
    quantum_s: float | None = None
    """Its quantum on its GPUs now (the rest of one, after a higher class cut it)."""
    boosted: bool = False
    """It waited ``max_wait``: first in line (or holding) for one quantum."""
    entitled_share: float = 0.0
    """Its entitled share of its GPUs now (0 unless its class bursts highest there)."""
    last_preemption: tuple[float, str, TenantId | None] | None = None
    """When it was last preempted (monotonic s), why, and for whom."""
    remembered: int = 0
    """The peak footprint its workload had in an earlier run (0: none remembered)."""
    fault: FaultView | None = None
    """Why it is stuck (``None`` unless it is)."""
    gate_pending: bool = False
    """A gate was asked and not confirmed yet (it may still run)."""
    released_note: str | None = None
    """Released by an operator: what the release reported."""
    foreign_short: str | None = None
    """Gated in host RAM, its restore waits for free memory that the driver's reading
    lacks although the scheduler's own count has room: memory nobody kiwid knows
    holds (why, in words; ``None``: not so). No wait bound holds while it lasts."""
    last_wake: tuple[float, str, str] | None = None
    """When it was last woken from parked (monotonic s), why, and what woke it."""
    parks: str | None = None
    """``None`` if it parks when idle; else why it may not (a rule, its GPU's policy)."""


@dataclass(frozen=True)
class SchedulerView:
    """Everything a status display needs, at ``now``."""

    now: float
    gpus: tuple[GpuView, ...]
    tenants: tuple[TenantView, ...]
    wakes: Mapping[str, int] = field(default_factory=dict)
    """Parked tenants woken since start, by reason."""
    restores_wasted: int = 0
    """Restores since start after which the tenant did no GPU work in its turn."""
