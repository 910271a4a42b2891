"""What comes out of the scheduling core: the actions the shell carries out.

Every action about one tenant carries the tenant's *epoch* as the core had it
when it asked; the result the shell reports (:mod:`kiwid.core.events`) echoes it.
A result of an older epoch is old news: the core asks for a :class:`Converge`,
which reads the truth and drives it to the :class:`Want` of now.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kiwid.core.model import Fault, GpuId, TenantId
from kiwid.core.residency import Residency


@dataclass(frozen=True)
class Gate:
    """Stop the tenant's GPU work (freeze its cgroup, or take its CUDA lock)."""

    tenant: TenantId
    epoch: int = field(default=0, compare=False, kw_only=True)
    """The tenant's epoch when it was asked (its answer echoes it)."""


@dataclass(frozen=True)
class Ungate:
    """Let the tenant's GPU work go on (only ever while its memory is on the card)."""

    tenant: TenantId
    epoch: int = field(default=0, compare=False, kw_only=True)
    """The tenant's epoch when it was asked (its answer echoes it)."""


@dataclass(frozen=True)
class SwapOut:
    """Move a gated tenant's GPU memory to host RAM (lock held, checkpoint).

    Answered by :class:`SwapFinished`; nothing else of this tenant is asked for
    until then.
    """

    tenant: TenantId
    sizes: tuple[tuple[GpuId, int], ...] = field(default=(), compare=False)
    """What leaves, per GPU, by the scheduler's own count (the state file records
    it ahead of the checkpoint): one owner of where memory is."""
    epoch: int = field(default=0, compare=False, kw_only=True)
    """The tenant's epoch when it was asked (its answer echoes it)."""


@dataclass(frozen=True)
class SwapIn:
    """Bring a gated tenant's memory back to the GPU (restore; it stays gated).

    Asked for only when the card has room for it; answered by :class:`SwapFinished`.
    """

    tenant: TenantId
    epoch: int = field(default=0, compare=False, kw_only=True)
    """The tenant's epoch when it was asked (its answer echoes it)."""


@dataclass(frozen=True)
class Retry:
    """Mend a stuck tenant: find where its memory is, gate it (lock, or freeze) whole.

    Answered by :class:`Mended`, or by another :class:`TenantFaulted`.
    """

    tenant: TenantId
    epoch: int = field(default=0, compare=False, kw_only=True)
    """The tenant's epoch when it was asked (its answer echoes it)."""


@dataclass(frozen=True)
class Release:
    """Let a stuck tenant run on an operator's word: restore, unlock, thaw what can be.

    Answered by :class:`Released`.
    """

    tenant: TenantId
    epoch: int = field(default=0, compare=False, kw_only=True)
    """The tenant's epoch when it was asked (its answer echoes it)."""


@dataclass(frozen=True)
class Converge:
    """Read the truth of a tenant and drive it to what the core wants now.

    Asked after every fault, after a result of an old epoch, and when a gated
    tenant in host RAM has processes on the card. The shell asks the core for the
    :class:`Want` as the job starts (level-triggered: what is wanted then, not
    when it was asked) and answers :class:`Converged`, or :class:`TenantFaulted`
    where it could not reach it.
    """

    tenant: TenantId
    epoch: int = field(default=0, compare=False, kw_only=True)
    """The tenant's epoch when it was asked (its answer echoes it)."""


@dataclass(frozen=True)
class Fence:
    """Freeze a tenant whose driver call hangs and may leave it running.

    The freezer never calls the driver: it is the one thing that runs beside a
    hung driver call of the same tenant. Answered by :class:`Converged`.
    """

    tenant: TenantId
    epoch: int = field(default=0, compare=False, kw_only=True)
    """The tenant's epoch when it was asked (its answer echoes it)."""


Action = Gate | Ungate | SwapOut | SwapIn | Retry | Release | Converge | Fence


@dataclass(frozen=True)
class Want:
    """What the core wants of a tenant now (a converge drives the truth to it)."""

    tenant: TenantId
    epoch: int
    gated: bool
    """Every process of it locked (or its cgroup frozen); else all of it runs."""
    memory: Residency | None
    """Where its memory belongs: ``RESIDENT`` (on the card), ``HOST``, or ``None``:
    wherever it is (a move is asked, or it is stuck): only said, never moved."""
    host_bytes: Mapping[GpuId, int] = field(default_factory=dict)
    """Its size per GPU, what the state file records when its memory is in host RAM."""
    fault: Fault | None = None
    """Why it is stuck (``None``: it is not): the state file keeps it, so that a
    restarted kiwid keeps it stuck."""
