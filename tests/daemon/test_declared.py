"""Where a tenant's declared GPU memory comes from: rules, annotations, register, caps."""

from __future__ import annotations

from kiwid.config.tenant_rules import TenantMatch, TenantRule
from kiwid.daemon.tenants.policy import PolicyBook, resolve
from kiwid.daemon.tenants.tracker import Identity, TenantInfo

Gi = 2**30
POD = Identity("cgroup:/kubepods/x", "cgroup", "train", pod="train-1", namespace="ml")
RULES = (
    TenantRule(TenantMatch(namespace="other"), memory=8 * Gi),
    TenantRule(TenantMatch(namespace="ml"), memory=40 * Gi, max_memory=64 * Gi),
    TenantRule(TenantMatch(namespace="big"), memory=40 * Gi),
    TenantRule(TenantMatch(namespace="free"), weight=2),
)


def declared(ident: Identity, rules: tuple[TenantRule, ...] = RULES) -> tuple:
    resolved = resolve(rules, ident)
    return resolved.policy.memory_bytes, resolved.declared_source, resolved.capped


def asks(memory: int, source: str = "annotation", namespace: str = "ml") -> Identity:
    return Identity(
        POD.key,
        POD.kind,
        POD.name,
        pod=POD.pod,
        namespace=namespace,
        requested_memory=memory,
        memory_source=source,
    )


def test_the_first_matching_rule_declares_what_its_tenants_need() -> None:
    assert declared(POD) == (40 * Gi, "rule 1", ())
    assert declared(POD, ()) == (None, None, ())
    assert declared(asks(8 * Gi, namespace="free")) == (8 * Gi, "annotation", ())


def test_a_pods_annotation_wins_within_the_rules_max_memory() -> None:
    assert declared(asks(20 * Gi)) == (20 * Gi, "annotation", ())  # less than the rule's
    assert declared(asks(60 * Gi)) == (60 * Gi, "annotation", ())  # up to max_memory
    assert declared(asks(80 * Gi)) == (64 * Gi, "annotation", ("memory",))  # capped


def test_without_max_memory_the_rules_own_memory_caps_a_declaration() -> None:
    assert declared(asks(60 * Gi, namespace="big")) == (40 * Gi, "annotation", ("memory",))
    assert declared(asks(60 * Gi, namespace="none")) == (60 * Gi, "annotation", ())  # no rule


def test_a_clients_own_register_is_named_so_and_capped_alike() -> None:
    assert declared(asks(30 * Gi, source="register")) == (30 * Gi, "register", ())
    assert declared(asks(90 * Gi, source="register")) == (64 * Gi, "register", ("memory",))


def test_a_tenant_past_its_declaration_is_told_once_and_forgotten_when_it_leaves() -> None:
    book = PolicyBook(rules=RULES)
    info = TenantInfo(POD, pids={1}, gpus=frozenset({"0"}), footprint={"0": 30 * Gi})
    tenants = {POD.key: info}
    book.events(tenants)
    assert book.overruns(tenants) == []  # 30 GiB of the 40 its rule declares
    info.footprint["0"] = 52 * Gi
    (line,) = book.overruns(tenants)
    assert line == (
        f"Tenant train ({POD.key}) uses 52 GiB on GPU 0, more than the 40 GiB it declared "
        "(rule 1): it is sized by what it uses"
    )
    info.footprint["0"] = 60 * Gi
    assert book.overruns(tenants) == []  # once
    assert book.overruns({}) == []  # it left
    book.events(tenants)
    assert len(book.overruns(tenants)) == 1  # a new run of it is told again


def test_parking_comes_from_the_file_then_the_pod_and_a_rules_false_wins() -> None:
    def parks(ident: Identity, rules: tuple[TenantRule, ...]) -> tuple[bool, str]:
        resolved = resolve(rules, ident)
        return resolved.policy.park, resolved.sources["park"]

    pod = Identity(POD.key, POD.kind, POD.name, pod=POD.pod, namespace="ml")
    never = (TenantRule(TenantMatch(namespace="ml"), park=False),)
    assert parks(pod, ()) == (True, "default")  # memory.park says for the GPU
    assert parks(pod, never) == (False, "rule 0")
    asks_not = Identity(POD.key, POD.kind, POD.name, pod=POD.pod, requested_park=False)
    assert parks(asks_not, ()) == (False, "annotation")
    asks_to = Identity(POD.key, POD.kind, POD.name, namespace="ml", requested_park=True)
    assert parks(asks_to, never) == (False, "rule 0")  # a pod cannot park against its rule
