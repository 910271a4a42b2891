"""``[[tenants]]`` rules: which tenants a rule matches, and the policy it gives them.

Plain frozen values like the rest of :mod:`kiwid.config.schema` (which holds them in
``Settings.tenants``); :mod:`kiwid.config.rules` checks each key's value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TENANT_SWAPS = ("allow", "never")
"""Per-tenant swap policies, see :attr:`TenantRule.swap`."""


@dataclass(frozen=True)
class TenantMatch:
    """What a ``[[tenants]]`` rule matches: every key given must match (globs).

    A key left out matches anything; ``match = {}`` matches every tenant.
    """

    name: str | None = None
    """Glob on the tenant's name (a container's name, a unit, ``pid N``)."""
    pod: str | None = None
    """Glob on its Kubernetes pod's name."""
    namespace: str | None = None
    """Glob on its pod's namespace."""
    container_id: str | None = None
    """Glob on its container ID (full, 64 hex characters)."""
    cgroup: str | None = None
    """Glob on its cgroup path (cgroup2, else the v1 freezer's)."""
    unit: str | None = None
    """Glob on the systemd unit its cgroup is (``train.service``, ``docker-….scope``)."""


@dataclass(frozen=True)
class TenantRule:
    """One ``[[tenants]]`` rule: the policy of the tenants it matches (the first wins)."""

    match: TenantMatch = field(default_factory=TenantMatch)
    weight: float | None = None
    """Its quantum is TQ x weight; shares within a priority class follow the weights.
    ``None``: 1, or what the pod's ``kiwi.io/weight`` asks within ``max_weight``."""
    priority: int | None = None
    """Higher first; a higher class preempts a lower holder. ``None``: 0, or what the
    pod's ``kiwi.io/priority`` asks within ``max_priority``."""
    tq: float | None = None
    """Its own TQ in seconds (``None``: the GPU's)."""
    swap: str | None = None
    """``"allow"`` (as ``memory.swap`` says) or ``"never"`` (its memory stays on the card)."""
    park: bool | None = None
    """``false``: its tenants never park, they take their turns in the rotation even
    when idle (``None``: as ``memory.park`` says, or the pod's ``kiwi.io/park``)."""
    max_weight: float | None = None
    """The most a pod's ``kiwi.io/weight`` annotation may ask (``None``: the rule's weight)."""
    max_priority: int | None = None
    """The most a pod's ``kiwi.io/priority`` may ask (``None``: the rule's priority)."""
    memory: int | None = None
    """The GPU memory its tenants need on each of their GPUs, in bytes (written as a
    Kubernetes quantity, ``"40Gi"``, or bytes): their first turn makes room for that
    much, not the whole card. ``None``: none declared, unless the pod's
    ``kiwi.io/gpu-memory`` (within ``max_memory``) or ``register`` declares it."""
    max_memory: int | None = None
    """The most a pod's ``kiwi.io/gpu-memory`` (or ``register``'s ``memory_bytes``) may
    declare, in bytes (``None``: the rule's ``memory``, or no bound without one)."""
