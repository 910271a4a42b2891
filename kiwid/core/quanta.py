"""When a turn ends: a holder's quantum, its preemption, an idle release.

Read by the rotation (who yields now), the timers (when to look again), the
prefetch (how early to bring the next one back) and the snapshots (what status
shows); the table (:mod:`kiwid.core.table`) holds the facts they are computed from.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from kiwid.core.model import GpuId
from kiwid.core.table import TenantTable
from kiwid.core.tenant import TenantRecord


def quantum(table: TenantTable, holder: TenantRecord, gpus: Iterable[GpuId]) -> float:
    """Its quantum on ``gpus``, in seconds.

    The rest of one a higher class cut short, else its TQ (its own, or the
    shortest of the GPUs') times its weight.
    """
    if holder.turn.remaining_s is not None:
        return holder.turn.remaining_s
    tq = holder.cls.policy.tq_s
    if tq is None:
        tq = min((table.policies[g].tq_s for g in gpus if g in table.policies), default=30.0)
    return tq * holder.cls.policy.weight


def preempt_at(
    table: TenantTable,
    holder: TenantRecord,
    gating: frozenset[GpuId],
    wanted: dict[GpuId, tuple[float, int]] | None = None,
) -> tuple[float, str] | None:
    """When ``holder`` must yield, and why (``quantum`` or ``priority``).

    At the end of its quantum if one who ranks as high waits for one of its
    GPUs (a lower class waits while it bursts, unless ``max_wait`` boosted it);
    ``preempt_after`` into its quantum if one of a higher priority waits.
    ``wanted``: what waits per gated GPU (computed if not given).
    """
    if holder.turn.granted_at is None or holder.ungate_pending:
        return None  # its quantum has not begun (its memory is coming back, its unlock)
    if wanted is None:
        wanted = table.wanted(gating, table.closure(set(holder.gpus)))
    mine = [g for g in holder.gpus & gating if g in wanted]
    due: tuple[float, str] | None = None
    # A boosted holder's one quantum is over when anyone waits.
    contested = [g for g in mine if holder.cls.boosted or wanted[g][0] >= holder.cls.rank]
    if contested:
        due = (holder.turn.granted_at + quantum(table, holder, contested), "quantum")
    higher = [g for g in mine if wanted[g][1] > holder.cls.policy.priority]
    if higher and not holder.cls.boosted:
        after = holder.turn.granted_at + min(table.policies[g].preempt_after_s for g in higher)
        if due is None or after < due[0]:
            due = (after, "priority")
    return due


def idle_at(table: TenantTable, tenant: TenantRecord) -> float:
    """When a running holder or co-runner without further activity goes idle."""
    if tenant.gated or tenant.ungate_pending:
        return math.inf  # not let go yet, or its unlock is under way: it cannot run
    began = tenant.turn.began
    start = max((t for t in (began, tenant.turn.last_active) if t is not None), default=table.now)
    if tenant.turn.silent():
        start -= tenant.turn.quiet_s  # silent in its earlier turns too
    return start + table.policy_of(tenant).idle_release_s
