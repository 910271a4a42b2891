"""Each tenant's weight, priority, TQ, swap and memory: rules, annotations, kiwictl.

Precedence, documented in docs/scheduling.md:

1. a runtime ``kiwictl set-weight`` / ``set-priority`` (until the next reload or
   restart, like ``-T``);
2. the pod's ``kiwi.io/weight`` / ``kiwi.io/priority`` / ``kiwi.io/gpu-memory``
   annotations (kiwi-hook passes them; a client's own ``register`` may declare
   ``memory_bytes`` too), capped by the matching rule's ``max_weight`` /
   ``max_priority`` / ``max_memory`` — by default the rule's own value, so a pod may
   lower itself but never raise itself above what the operator allows (a rule
   without ``memory`` nor ``max_memory`` bounds no declaration);
3. the first ``[[tenants]]`` rule that matches the tenant;
4. the defaults: weight 1, priority 0, the GPU's TQ, swap as ``memory.swap`` says,
   parking as ``memory.park`` says, no declared memory.

Parking: a rule's ``park = false`` keeps its tenants in the rotation whatever their
pods say; without it, a pod's ``kiwi.io/park`` annotation decides for its container.

:class:`PolicyBook` owns what was resolved and sent to the scheduler; it resolves
a tenant again only when its identity, the rules or the runtime values changed.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kiwid.config.tenant_rules import TenantMatch, TenantRule
from kiwid.core.events import TenantPolicySet
from kiwid.core.model import TenantPolicy, TenantSwap
from kiwid.core.quantity import shown_bytes
from kiwid.daemon.tenants.tracker import Identity, TenantInfo

DEFAULT = TenantPolicy()


@dataclass(frozen=True)
class Resolved:
    """A tenant's policy and where each part of it came from."""

    policy: TenantPolicy
    rule: int | None
    """The index of the rule that matched (``None``: none did)."""
    sources: Mapping[str, str]
    """Per field (weight, priority, tq, swap, park): ``runtime``, ``annotation``,
    ``rule N`` or ``default``."""
    capped: tuple[str, ...] = ()
    """Annotations that asked for more than the rule allows, and were capped."""
    declared_source: str | None = None
    """Where ``policy.memory_bytes`` came from: ``annotation``, ``register`` or
    ``rule N`` (``None``: nothing declared)."""

    def as_json(self) -> dict[str, object]:
        """The ``policy`` object of a tenant in the status."""
        return {
            "weight": self.policy.weight,
            "priority": self.policy.priority,
            "tq": self.policy.tq_s,
            "swap": self.policy.swap.value,
            "park": self.policy.park,
            "rule": self.rule,
            "sources": dict(self.sources),
            "capped": list(self.capped),
            "runtime": "runtime" in self.sources.values(),
        }


def unit_of(cgroup: str | None) -> str | None:
    """The systemd unit a cgroup path is (its last part, if a ``.service`` or ``.scope``)."""
    if not cgroup:
        return None
    last = cgroup.rstrip("/").rsplit("/", 1)[-1]
    return last if last.endswith((".service", ".scope")) else None


def matches(match: TenantMatch, ident: Identity) -> bool:
    """Whether every key of ``match`` matches ``ident`` (globs, case-sensitive)."""
    cgroup = ident.cgroup_v2 if ident.cgroup_v2 not in (None, "", "/") else ident.cgroup_v1_freezer
    facts = {
        "name": ident.name,
        "pod": ident.pod,
        "namespace": ident.namespace,
        "container_id": ident.container_id,
        "cgroup": cgroup,
        "unit": unit_of(cgroup),
    }
    for key, pattern in facts.items():
        wanted = getattr(match, key)
        if wanted is not None and (pattern is None or not fnmatch.fnmatchcase(pattern, wanted)):
            return False
    return True


def resolve(
    rules: Sequence[TenantRule],
    ident: Identity,
    runtime: Mapping[str, float] | None = None,
) -> Resolved:
    """A tenant's policy by the precedence in the module docstring."""
    index = next((i for i, rule in enumerate(rules) if matches(rule.match, ident)), None)
    rule = rules[index] if index is not None else TenantRule()
    where = "default" if index is None else f"rule {index}"
    sources = {
        "weight": where if rule.weight is not None else "default",
        "priority": where if rule.priority is not None else "default",
        "tq": where if rule.tq is not None else "default",
        "swap": where if rule.swap is not None else "default",
        "park": where if rule.park is not None else "default",
    }
    weight = rule.weight if rule.weight is not None else DEFAULT.weight
    priority = rule.priority if rule.priority is not None else DEFAULT.priority
    capped: list[str] = []
    if ident.requested_weight is not None:
        cap = rule.max_weight if rule.max_weight is not None else weight
        capped += ["weight"] if ident.requested_weight > cap else []
        weight, sources["weight"] = min(ident.requested_weight, cap), "annotation"
    if ident.requested_priority is not None:
        cap_p = rule.max_priority if rule.max_priority is not None else priority
        capped += ["priority"] if ident.requested_priority > cap_p else []
        priority, sources["priority"] = min(ident.requested_priority, cap_p), "annotation"
    memory, declared_source = rule.memory, where if rule.memory is not None else None
    if ident.requested_memory is not None:
        cap_m = rule.max_memory if rule.max_memory is not None else rule.memory
        capped += ["memory"] if cap_m is not None and ident.requested_memory > cap_m else []
        memory = ident.requested_memory if cap_m is None else min(ident.requested_memory, cap_m)
        declared_source = ident.memory_source or "register"
    # A rule's park = false wins; else the pod's kiwi.io/park, else memory.park's word.
    park = rule.park if rule.park is not None else DEFAULT.park
    if rule.park is not False and ident.requested_park is not None:
        park, sources["park"] = ident.requested_park, "annotation"
    runtime = runtime or {}
    if "weight" in runtime:
        weight, sources["weight"] = float(runtime["weight"]), "runtime"
    if "priority" in runtime:
        priority, sources["priority"] = int(runtime["priority"]), "runtime"
    policy = TenantPolicy(
        weight=weight,
        priority=priority,
        tq_s=rule.tq,
        swap=TenantSwap(rule.swap) if rule.swap is not None else TenantSwap.ALLOW,
        memory_bytes=memory,
        park=park,
    )
    return Resolved(policy, index, sources, tuple(capped), declared_source)


@dataclass
class PolicyBook:
    """What each tenant's policy is, as resolved and told to the scheduler."""

    rules: tuple[TenantRule, ...] = ()
    runtime: dict[str, dict[str, float]] = field(default_factory=dict)
    """``kiwictl set-weight`` / ``set-priority`` values, by tenant (until a reload)."""
    resolved: dict[str, Resolved] = field(default_factory=dict)
    _seen: dict[str, tuple[Identity, int]] = field(default_factory=dict)
    _version: int = 0
    _overran: set[str] = field(default_factory=set)
    """Tenants already told to have used more than they declared (once each)."""

    def reload(self, rules: tuple[TenantRule, ...]) -> None:
        """New rules from the file; runtime values end (the file is the persistent truth)."""
        self.rules = rules
        self.runtime.clear()
        self._version += 1

    def set_runtime(self, tenant: str, field_name: str, value: float) -> None:
        """A runtime weight or priority for one tenant."""
        self.runtime.setdefault(tenant, {})[field_name] = value
        self._version += 1

    def events(self, tenants: Mapping[str, TenantInfo]) -> list[TenantPolicySet]:
        """The policy changes to tell the scheduler.

        Each tenant is resolved again only when its identity, the rules or the
        runtime values changed.
        """
        out: list[TenantPolicySet] = []
        for key in [k for k in self.resolved if k not in tenants]:
            del self.resolved[key]
            self._seen.pop(key, None)
        for key, info in tenants.items():
            stamp = (info.identity, self._version)
            if self._seen.get(key) == stamp:
                continue
            self._seen[key] = stamp
            resolved = resolve(self.rules, info.identity, self.runtime.get(key))
            before = self.resolved.get(key)
            self.resolved[key] = resolved
            if (before.policy if before else DEFAULT) != resolved.policy:
                out.append(TenantPolicySet(key, resolved.policy))
        return out

    def overruns(self, tenants: Mapping[str, TenantInfo]) -> list[str]:
        """Say, once per tenant, that it uses more GPU memory than it declared.

        Nothing stops it (Kiwi caps nothing at run time); the scheduler sizes it by
        the larger value from now on. A tenant that leaves is forgotten.
        """
        self._overran &= set(tenants)
        lines: list[str] = []
        for key, info in tenants.items():
            resolved = self.resolved.get(key)
            if resolved is None or key in self._overran:
                continue
            declared = resolved.policy.memory_bytes
            over = [
                (gpu, used)
                for gpu, used in sorted(info.footprint.items())
                if used is not None and declared is not None and used > declared
            ]
            if not over or declared is None:
                continue
            self._overran.add(key)
            gpu, used = over[0]
            lines.append(
                f"Tenant {info.identity.name} ({key}) uses {shown_bytes(used)} on GPU {gpu}, "
                f"more than the {shown_bytes(declared)} it declared "
                f"({resolved.declared_source or 'register'}): it is sized by what it uses"
            )
        return lines
