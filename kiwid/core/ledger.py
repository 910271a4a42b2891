"""Per-tenant GPU-time accounting, kept by the scheduling core.

Every state change closes the time spent in the previous state, so at any
moment ``holding + waiting + corunning + idle + parked + stuck + released`` equals the
time since the tenant was first seen. Counters say how the GPU was handed over. The ledger
lives as long as the daemon (it survives reloads; a restart resets it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiwid.core.model import TenantState


@dataclass
class Ledger:
    """One tenant's account (mutable; the core owns it)."""

    seconds: dict[TenantState, float] = field(
        default_factory=lambda: dict.fromkeys(TenantState, 0.0)
    )
    quanta: int = 0
    """Times it was granted the GPU(s)."""
    preempted: int = 0
    """Times it was preempted: its quantum ended and someone waited, or a tenant of a
    higher priority wanted its GPU (``preempted_priority`` of them)."""
    preempted_priority: int = 0
    entitled_s: float = 0.0
    """GPU time it was entitled to: ``weight / sum of weights`` of the bursting
    tenants of its priority class on its GPUs, while its class was the highest
    bursting there (received time is ``holding``)."""
    early_releases: int = 0
    """Times it yielded before its quantum ended, for lack of GPU work."""
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    swap_s: float = 0.0
    """Time its memory spent moving between the GPU and host RAM."""
    restores_wasted: int = 0
    """Restores of its memory after which it did no GPU work in its turn."""
    wakes: int = 0
    """Times it was woken from parked."""

    def close(self, state: TenantState, since: float, now: float) -> None:
        """Book the time from ``since`` to ``now`` to ``state``."""
        self.seconds[state] += max(0.0, now - since)

    def view(
        self, state: TenantState, since: float, now: float, entitled_s: float | None = None
    ) -> LedgerView:
        """Return a snapshot that includes the time in the current ``state``.

        ``entitled_s`` is the entitlement up to ``now`` (default: as booked).
        """
        seconds = dict(self.seconds)
        seconds[state] += max(0.0, now - since)
        return LedgerView(
            holding_s=seconds[TenantState.HOLDER],
            waiting_s=seconds[TenantState.WAITING],
            corunning_s=seconds[TenantState.CORUNNING],
            idle_s=seconds[TenantState.IDLE],
            quanta=self.quanta,
            preempted=self.preempted,
            early_releases=self.early_releases,
            preempted_priority=self.preempted_priority,
            entitled_s=self.entitled_s if entitled_s is None else entitled_s,
            swapped_out_bytes=self.swapped_out_bytes,
            swapped_in_bytes=self.swapped_in_bytes,
            swap_s=self.swap_s,
            stuck_s=seconds[TenantState.STUCK],
            released_s=seconds[TenantState.RELEASED],
            parked_s=seconds[TenantState.PARKED],
            restores_wasted=self.restores_wasted,
            wakes=self.wakes,
        )


@dataclass(frozen=True)
class LedgerView:
    """A tenant's account at one moment (seconds and counts)."""

    holding_s: float
    waiting_s: float
    corunning_s: float
    idle_s: float
    quanta: int
    preempted: int
    early_releases: int
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    swap_s: float = 0.0
    preempted_priority: int = 0
    entitled_s: float = 0.0
    stuck_s: float = 0.0
    """Time it spent stuck (gated, holding nothing, waiting for an operator)."""
    released_s: float = 0.0
    """Time it ran ungated, outside the rotation, released by an operator."""
    parked_s: float = 0.0
    """Time it spent parked (idle, its memory in host RAM, out of the queue)."""
    restores_wasted: int = 0
    """Restores after which it did no GPU work in its turn."""
    wakes: int = 0
    """Times it was woken from parked."""

    @property
    def total_s(self) -> float:
        """Time since the tenant was first seen."""
        return (
            self.holding_s
            + self.waiting_s
            + self.corunning_s
            + self.idle_s
            + self.parked_s
            + self.stuck_s
            + self.released_s
        )
