"""Plain records the engine keeps for status and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiwid.core.ledger import LedgerView
from kiwid.daemon.tenants.tracker import TenantInfo

HANDOVER_BUCKETS_S = (0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


@dataclass(frozen=True)
class Departed:
    """A tenant that left, kept a while for its ledger."""

    tenant: str
    info: TenantInfo | None
    ledger: LedgerView
    gone_at: float


@dataclass(frozen=True)
class SwapProgress:
    """A swap being carried out (for status: what, how big, since when)."""

    tenant: str
    direction: str
    """``"out"`` (to host RAM) or ``"in"`` (back to the GPU)."""
    bytes: int
    started: float
    gpus: frozenset[str]
    expected_rate: float | None
    """Bytes per second of the last swap in this direction (``None``: first one)."""


@dataclass
class Histogram:
    """Cumulative-bucket histogram (Prometheus style) of durations in seconds."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(HANDOVER_BUCKETS_S) + 1))
    total_s: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        """Count one observation."""
        self.count += 1
        self.total_s += seconds
        for i, bound in enumerate(HANDOVER_BUCKETS_S):
            if seconds <= bound:
                self.counts[i] += 1
        self.counts[-1] += 1

    def as_json(self) -> dict[str, object]:
        """The histogram as the status object shows it."""
        bounds: list[object] = [*HANDOVER_BUCKETS_S, "+Inf"]
        return {
            "buckets": [[b, c] for b, c in zip(bounds, self.counts, strict=True)],
            "sum": self.total_s,
            "count": self.count,
        }
