"""What goes into the scheduling core (events) and what comes out (actions)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kiwid.core.model import GpuId, GpuPolicy, TenantId

# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class GpusConfigured:
    """The set of managed GPUs and each one's policy (start, reload, runtime change).

    GPUs missing from ``policies`` are no longer arbitrated: their tenants stop
    waiting for them.
    """

    policies: Mapping[GpuId, GpuPolicy]


@dataclass(frozen=True)
class TenantAttached:
    """A tenant appeared on ``gpus``, or its set of GPUs changed."""

    tenant: TenantId
    gpus: frozenset[GpuId]


@dataclass(frozen=True)
class TenantDetached:
    """A tenant is gone (its processes exited). No action is emitted for it."""

    tenant: TenantId


@dataclass(frozen=True)
class ActivitySeen:
    """The tenant did GPU work in the last sampling window."""

    tenant: TenantId


@dataclass(frozen=True)
class FootprintSeen:
    """The tenant's GPU memory on one GPU, in bytes (``None``: unknown)."""

    tenant: TenantId
    gpu: GpuId
    used_bytes: int | None


@dataclass(frozen=True)
class SwapFinished:
    """The shell carried out a :class:`SwapOut` or :class:`SwapIn` (or could not).

    A failed swap-out leaves the tenant's memory on the card (gated, intact); a
    failed swap-in leaves it in host RAM (gated). Either way the rotation goes on.
    """

    tenant: TenantId
    direction: str
    """``"out"`` or ``"in"``."""
    ok: bool
    moved_bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class Ungated:
    """The shell carried out an :class:`Ungate`: the tenant runs from now.

    A grant that moves memory takes seconds to carry out; its holder's quantum
    and idle time count from this event, not from the grant.
    """

    tenant: TenantId


@dataclass(frozen=True)
class TenantSwapped:
    """A known tenant's memory is in host RAM (found at start in the state file).

    It is gated (locked and checkpointed) and waits for its turn to come back.
    """

    tenant: TenantId
    footprint: Mapping[GpuId, int]


@dataclass(frozen=True)
class Tick:
    """Only time passed (the shell woke for ``next_deadline``)."""


Event = (
    GpusConfigured
    | TenantAttached
    | TenantDetached
    | ActivitySeen
    | FootprintSeen
    | SwapFinished
    | Ungated
    | TenantSwapped
    | Tick
)

# ---------------------------------------------------------------- actions


@dataclass(frozen=True)
class Gate:
    """Stop the tenant's GPU work (freeze its cgroup, or take its CUDA lock)."""

    tenant: TenantId


@dataclass(frozen=True)
class Ungate:
    """Let the tenant's GPU work go on."""

    tenant: TenantId


@dataclass(frozen=True)
class SwapOut:
    """Move a gated tenant's GPU memory to host RAM (lock held, checkpoint)."""

    tenant: TenantId


@dataclass(frozen=True)
class SwapIn:
    """Bring a gated tenant's memory back to the GPU (restore; it stays gated)."""

    tenant: TenantId


Action = Gate | Ungate | SwapOut | SwapIn
