"""Declared GPU memory, end to end: a real kiwid on the simulated GPU, real processes
in real cgroups, declarations through ``register`` and ``[[tenants]]`` rules.

The card is 10 GiB with a 1 GiB reserve (tests/daemon/test_swap_e2e.py): 9 GiB for
tenants.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiwid.adapters.control import ControlError
from tests.daemon.conftest import V2_ROOT, Kiwid, wait_for
from tests.daemon.test_metrics_e2e import free_port, scrape
from tests.daemon.test_swap_e2e import holder, sim_memory, swap_config

GiB = 2**30


def cgroup_of(t: Any) -> str:
    return "/" + str(t.v2.relative_to(V2_ROOT))


def entry(k: Kiwid, key: str) -> dict[str, Any]:
    return next(t for t in k.call("tenants")["tenants"] if t["id"] == key)


def register(k: Kiwid, t: Any, cid: str, **extra: Any) -> dict[str, Any]:
    args = {"id": cid, "cgroup_v2": cgroup_of(t), "pid": t.pid, "hold": False, **extra}
    return k.call("register", args)


@pytest.mark.parametrize(("declared", "evicted"), [(4 * GiB, {"b"}), (None, {"a", "b"})])
def test_a_declared_newcomer_evicts_only_what_its_declaration_needs(
    start_kiwid, tenants, workdir: Path, declared: int | None, evicted: set[str]
) -> None:
    # a holds the GPU and b sits idle, 3 GiB each; the newcomer shows 1 GiB and waits
    # for its turn (a's quantum is 1 s, its own 30 s). Memory moves only when the
    # next one does not fit ("auto"). With 4 GiB declared, 3 + 3 + 4 > 9: one of them
    # makes room (b, which ran least recently). With nothing declared, a newcomer
    # nobody knows gets the whole card: both go.
    config = swap_config(workdir, tq=30, idle_release=5, swap="auto")
    config += '[[tenants]]\nmatch = { cgroup = "*/a" }\ntq = 1\n'
    (workdir / "kiwi.toml").write_text(config)
    k = start_kiwid()
    a, b = tenants("a"), tenants("b", busy=False)
    k.attach(a.pid, memory=3 * GiB)
    wait_for(lambda: holder(k) == a.key, 5, "a to hold the GPU")
    k.attach(b.pid, memory=3 * GiB, activity="idle")
    newcomer = tenants("newcomer")
    extra = {} if declared is None else {"memory_bytes": declared}
    register(k, newcomer, "n0", **extra)
    k.attach(newcomer.pid, memory=GiB)
    wait_for(
        lambda: holder(k) == newcomer.key and not entry(k, newcomer.key)["gated"],
        10,
        "the newcomer's turn",
    )
    memory = sim_memory(workdir)
    gone = {t.name for t in (a, b) if memory[t.pid][1]}
    assert gone == evicted, k.log_text()
    assert not memory[newcomer.pid][1]
    assert entry(k, newcomer.key)["declared_bytes"] == declared
    assert entry(k, newcomer.key)["declared_source"] == ("register" if declared else None)


def test_status_says_what_each_tenant_declared_and_where_it_came_from(
    start_kiwid, tenants, workdir: Path
) -> None:
    config = swap_config(workdir, tq=30)
    config += '[[tenants]]\nmatch = { name = "ruled" }\nmemory = "2Gi"\nmax_memory = "5Gi"\n'
    (workdir / "kiwi.toml").write_text(config)
    k = start_kiwid()
    ruled, asking = tenants("ruled", busy=False), tenants("c1", busy=False)
    greedy = tenants("c2", busy=False)
    register(k, ruled, "r0", name="ruled")
    register(k, asking, "c1", name="ruled", memory_bytes=3 * GiB, memory_source="annotation")
    register(k, greedy, "c2", name="ruled", memory_bytes=8 * GiB, memory_source="annotation")
    keys = (ruled.key, asking.key, greedy.key)
    wait_for(lambda: set(keys) <= set(k.tenant_states()), 5, "all three registered")
    seen = [(entry(k, key)["declared_bytes"], entry(k, key)["declared_source"]) for key in keys]
    assert seen == [(2 * GiB, "rule 0"), (3 * GiB, "annotation"), (5 * GiB, "annotation")]
    assert entry(k, greedy.key)["policy"]["capped"] == ["memory"]
    out = k.ctl("status", "--json")
    assert out.returncode == 0 and '"declared_bytes": 5368709120' in out.stdout


def test_a_declaration_larger_than_the_card_is_refused_and_changes_nothing(
    start_kiwid, tenants, workdir: Path
) -> None:
    config = swap_config(workdir) + '[[tenants]]\nmatch = { name = "huge" }\nmemory = "12Gi"\n'
    (workdir / "kiwi.toml").write_text(config)
    k = start_kiwid()
    c = tenants("c", busy=False)
    for extra, words in (
        (
            {"name": "trainer", "memory_bytes": 40 * GiB, "memory_source": "annotation"},
            "container trainer (c0) declares 40 GiB of GPU memory per GPU (its pod's "
            "annotation kiwi.io/gpu-memory), more than GPU 0 can ever give it: its 10 GiB "
            "less memory.reserve_mib (1 GiB) leave 9 GiB",
        ),
        (
            {"memory_bytes": 9 * GiB + 1},
            f"container {cgroup_of(c)} (c0) declares 9 GiB (9663676417 bytes) of GPU memory "
            "per GPU (its registration's memory_bytes), more than GPU 0 can ever give it: its "
            "10 GiB less memory.reserve_mib (1 GiB) leave 9 GiB (9663676416 bytes)",
        ),
        (
            {"name": "huge"},
            "container huge (c0) declares 12 GiB of GPU memory per GPU (rule 0 of "
            f"{workdir / 'kiwi.toml'}), more than GPU 0 can ever give it",
        ),
        ({"memory_bytes": 0}, "container c0: memory_bytes 0: it must be more than 0 bytes"),
        ({"memory_bytes": -1}, "container c0: memory_bytes -1: it must be more than 0 bytes"),
    ):
        with pytest.raises(ControlError) as err:
            register(k, c, "c0", **extra)
        assert (err.value.code, err.value.arg) == ("invalid-value", "memory_bytes")
        assert err.value.message.startswith(words), err.value.message
    with pytest.raises(ControlError, match="memory_source must be one of annotation, register"):
        register(k, c, "c0", memory_bytes=GiB, memory_source="rumour")
    assert k.tenant_states() == {}  # nothing registered, nothing gated
    assert not c.frozen()
    assert register(k, c, "c0", memory_bytes=9 * GiB)["tenant"] == c.key  # exactly fits


def test_a_tenant_growing_past_its_declaration_is_told_once_in_the_log_explain_and_metrics(
    start_kiwid, tenants, workdir: Path
) -> None:
    port = free_port()
    config = swap_config(workdir) + f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
    (workdir / "kiwi.toml").write_text(config)
    k = start_kiwid()
    t = tenants("grower")
    register(k, t, "g0", name="grower", memory_bytes=2 * GiB, memory_source="annotation")
    k.attach(t.pid, memory=GiB)
    wait_for(lambda: entry(k, t.key)["peak_bytes"] == GiB, 5, "its first footprint")
    out = k.ctl("explain", t.key)
    assert "It declared 2 GiB of GPU memory per GPU (its pod's annotation" in out.stdout
    assert "uses 1 GiB at most so far" in out.stdout
    overrun = "more than the 2 GiB it declared (annotation): it is sized by what it uses"
    assert overrun not in k.log_text()

    k.attach(t.pid, memory=3 * GiB)  # it allocates more than it declared
    wait_for(lambda: entry(k, t.key)["peak_bytes"] == 3 * GiB, 5, "it to grow")
    out = k.ctl("explain", t.key)
    assert "It declared 2 GiB, uses 3 GiB: more than it declared" in out.stdout, out.stdout
    labels = {"tenant": t.key, "name": "grower", "pod": "", "namespace": "", "gpu": "0"}

    def sizes() -> tuple[float, float] | None:
        families = scrape(port)
        used = [s.value for s in families["kiwi_tenant_footprint_bytes"] if s.labels == labels]
        told = [s.value for s in families["kiwi_tenant_declared_bytes"] if s.labels == labels]
        return (used[0], told[0]) if used and told and used[0] == 3 * GiB else None

    assert wait_for(sizes, 5, "the metrics to show it") == (3 * GiB, 2 * GiB)
    k.wait_log(f"Tenant grower ({t.key}) uses 3 GiB on GPU 0, {overrun}")
    k.attach(t.pid, memory=4 * GiB)  # and more: it was told already
    wait_for(lambda: entry(k, t.key)["peak_bytes"] == 4 * GiB, 5, "it to grow again")
    assert k.log_text().count(overrun) == 1
