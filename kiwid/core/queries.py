"""What the scheduling core answers about its tenants and GPUs, without changing them.

The read-only half of :class:`kiwid.core.scheduler.Scheduler`: the shell asks it
for status, for admission (would a burst wait?) and for what a converge must
drive the truth to (:meth:`SchedulerQueries.want`). Nothing here changes the
table; the handlers that do are :mod:`kiwid.core.scheduler`'s.
"""

from __future__ import annotations

from kiwid.core import memory, snapshot
from kiwid.core.actions import Want
from kiwid.core.ledger import LedgerView
from kiwid.core.model import GpuId, GpuPolicy, TenantId, TenantState
from kiwid.core.residency import Residency
from kiwid.core.table import TenantTable
from kiwid.core.view import SchedulerView

__all__ = ["SchedulerQueries"]

S = TenantState
R = Residency


class SchedulerQueries:
    """Read-only questions to the core's table (``_t``), for the shell."""

    _t: TenantTable

    def ledger(self, tenant: TenantId, now: float) -> LedgerView | None:
        """Return one tenant's ledger at ``now`` (``None``: unknown tenant)."""
        t = self._t.tenants.get(tenant)
        return None if t is None else t.ledger.view(t.state, t.state_since, now, t.entitled(now))

    def policies(self) -> dict[GpuId, GpuPolicy]:
        """Return the policy in force on every managed GPU."""
        return dict(self._t.policies)

    def policy(self, gpu: GpuId) -> GpuPolicy | None:
        """Return the policy in force on ``gpu`` (``None``: not managed)."""
        return self._t.policies.get(gpu)

    def tenant_state(self, tenant: TenantId) -> TenantState | None:
        """Return a tenant's state (``None``: unknown tenant)."""
        known = self._t.tenants.get(tenant)
        return None if known is None else known.state

    def residency(self, tenant: TenantId) -> Residency | None:
        """Where a tenant's memory is (``None``: unknown tenant)."""
        known = self._t.tenants.get(tenant)
        return None if known is None else known.memory.residency

    def gated(self, tenant: TenantId) -> bool:
        """Whether the scheduler has a tenant gated (asked, and not let go since)."""
        known = self._t.tenants.get(tenant)
        return known is not None and known.gated

    def epoch(self, tenant: TenantId) -> int | None:
        """A tenant's epoch now (``None``: unknown tenant)."""
        known = self._t.tenants.get(tenant)
        return None if known is None else known.epoch

    def want(self, tenant: TenantId) -> Want | None:
        """What the core wants of a tenant now, for a converge to drive the truth to.

        Gated while the scheduler holds it gated or it is stuck (a stuck one whose
        gate did not take is wanted gated all the same); its memory on the card
        while it runs, where the scheduler has it while gated and settled, and
        wherever it is (``None``) while a move is asked or it is stuck.
        """
        t = self._t.tenants.get(tenant)
        if t is None:
            return None
        stuck = t.state is S.STUCK
        gated = (t.gated or stuck) and t.state is not S.RELEASED
        residency = t.memory.residency
        where: Residency | None = None
        if not gated or (not stuck and residency.on_card):
            where = R.RESIDENT
        elif not stuck and residency is R.HOST:
            where = R.HOST
        sizes = {g: memory.host_size(t, g, self._t.policies.get(g)) for g in sorted(t.gpus)}
        return Want(tenant, t.epoch, gated, where, sizes, t.fault.cause if stuck else None)

    def peak(self, tenant: TenantId) -> dict[GpuId, int]:
        """The most memory a tenant was seen using, per GPU (empty: unknown)."""
        known = self._t.tenants.get(tenant)
        return {} if known is None else dict(known.memory.peak)

    def tenant_ids(self) -> frozenset[TenantId]:
        """Return every tenant the core knows."""
        return frozenset(self._t.tenants)

    def would_wait(self, tenant: TenantId) -> bool:
        """Whether a burst of ``tenant`` now would wait: a GPU it needs is held or claimed."""
        table = self._t
        t = table.tenants.get(tenant)
        if t is None:
            return False
        gating = table.gating(t.gpus, extra=t)
        need = t.gpus & gating
        return bool(need & table.claimed(gating, table.closure(set(need)), exclude=t))

    def view(self, now: float) -> SchedulerView:
        """Return a read-only snapshot for status displays."""
        return snapshot.view(self._t, now)
