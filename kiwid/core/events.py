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
class Tick:
    """Only time passed (the shell woke for ``next_deadline``)."""


Event = GpusConfigured | TenantAttached | TenantDetached | ActivitySeen | FootprintSeen | Tick

# ---------------------------------------------------------------- actions


@dataclass(frozen=True)
class Gate:
    """Stop the tenant's GPU work (freeze its cgroup, or take its CUDA lock)."""

    tenant: TenantId


@dataclass(frozen=True)
class Ungate:
    """Let the tenant's GPU work go on."""

    tenant: TenantId


Action = Gate | Ungate
