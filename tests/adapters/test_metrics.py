"""The metrics adapter: a real HTTP server, read back by Prometheus's own parser."""

from __future__ import annotations

import copy
import re
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiwid.adapters.metrics import (
    METRIC_FAMILIES,
    Exposition,
    MetricsError,
    MetricsServer,
    parse_listen,
)

LEDGER = {
    "holding_s": 310.5,
    "waiting_s": 242.0,
    "idle_s": 12.0,
    "corunning_s": 0.0,
    "quanta": 11,
    "preempted": 3,
    "early_releases": 2,
    "swapped_out_bytes": 2**30,
    "swapped_in_bytes": 2**29,
    "swap_s": 1.5,
    "preempted_priority": 1,
    "entitled_s": 280.25,
}
STATUS: dict[str, Any] = {
    "version": "0.1.0",
    "pid": 1,
    "config": {"path": "/etc/kiwi.toml", "last_reload": {"ok": True, "error": None}},
    "scheduling": "on",
    "uptime_s": 600.0,
    "counters": {
        "reloads": {"ok": 4, "failed": 1},
        "wakes": {"request": 5, "operator": 1},
        "restores_wasted": 3,
    },
    "gpus": [
        {
            "id": "0",
            "uuid": "GPU-5a1c",
            "name": "NVIDIA H200",
            "healthy": True,
            "tq": 20.0,
            "mode": "exclusive",
            "memory_total_bytes": 80 * 2**30,
            "memory_resident_bytes": 3 * 2**30,
            "holder": {"tenant": "docker:ab12cd34ef56", "since_s": 2.3, "remaining_s": 17.7},
            "waiters": [
                {
                    "tenant": "pid:456",
                    "waiting_s": 12.3,
                    "position": 1,
                    "eta_s": 17.7,
                    "wait_bound_s": 22.0,
                }
            ],
            "handover_seconds": {
                "buckets": [
                    [0.005, 1],
                    [0.01, 3],
                    [0.05, 7],
                    [0.1, 8],
                    [0.5, 8],
                    [1.0, 9],
                    [5.0, 9],
                    [30.0, 9],
                    ["+Inf", 9],
                ],
                "sum": 1.25,
                "count": 9,
            },
            "tenants": [
                {
                    "id": "docker:ab12cd34ef56",
                    "name": "ab12cd34ef56",
                    "pod": "web-7f",
                    "namespace": "shop",
                    "state": "holder",
                    "footprint_bytes": 3 * 2**30,
                    "declared_bytes": 2 * 2**30,  # it grew past what it declared
                    "ledger": LEDGER,
                    "policy": {
                        "weight": 2.5,
                        "priority": 10,
                        "tq": None,
                        "swap": "never",
                        "rule": 0,
                        "sources": {
                            "weight": "annotation",
                            "priority": "rule 0",
                            "tq": "default",
                            "swap": "rule 0",
                        },
                        "capped": ["weight"],
                        "runtime": False,
                    },
                },
                {
                    "id": "pid:456",
                    "name": "pid 456",
                    "pod": None,
                    "namespace": None,
                    "state": "waiting",
                    "footprint_bytes": 2**30,
                    "ledger": {**LEDGER, "holding_s": 1.0, "quanta": 1},
                    "gate_failure": "freeze of /kiwi/pid-456 timed out after 2 s",
                    "swap_refusal": "host RAM floor: 1073741824 bytes would leave 5 of the ...",
                    "policy": {"weight": 1.0, "priority": 0, "tq": 5.0, "swap": "allow"},
                },
                {
                    "id": "pid:789",
                    "name": "pid 789",
                    "pod": None,
                    "namespace": None,
                    "state": "stuck",
                    "footprint_bytes": 2**30,
                    "ledger": LEDGER,
                    "gate_failure": None,
                    "stuck_reason": {
                        "operation": "swap-in",
                        "reason": "swap in: restore of pid 789 failed",
                        "pid": 789,
                        "answer": "CUDA_ERROR_OPERATING_SYSTEM (304)",
                        "at_unix": 1.0,
                        "contained": True,
                        "mending": False,
                    },
                    "policy": {"weight": 1.0, "priority": 0, "tq": None, "swap": "allow"},
                },
            ],
        },
        {
            "id": "1",
            "uuid": "GPU-77aa",
            "name": "NVIDIA H200",
            "healthy": False,
            "tq": 30.0,
            "mode": "auto",
            "holder": None,
            "waiters": [],
            "handover_seconds": {"buckets": [["+Inf", 0]], "sum": 0.0, "count": 0},
            "tenants": [],
        },
    ],
    "departed": [
        {
            "id": "pid:99",
            "name": "pid 99",
            "kind": "process",
            "pod": None,
            "namespace": None,
            "gpus": ["0", "1"],
            "ledger": {**LEDGER, "quanta": 5},
            "gone_for_s": 12.0,
        },
        {  # came back under the same id: its live series wins
            "id": "pid:456",
            "name": "pid 456",
            "gpus": ["0"],
            "ledger": {**LEDGER, "quanta": 999},
            "gone_for_s": 1.0,
        },
    ],
}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def serve() -> Iterator[Callable[..., MetricsServer]]:
    """Start metrics servers on 127.0.0.1:0; every one is stopped after the test."""
    started: list[MetricsServer] = []

    def start(snapshot: Callable[[], Any] = lambda: STATUS, listen: str = "127.0.0.1:0") -> Any:
        server = MetricsServer(listen, snapshot)
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop()


def scrape(server: MetricsServer, host: str = "127.0.0.1") -> str:
    url = f"http://{host}:{server.port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        return str(reply.read().decode())


def parse(text: str) -> tuple[dict[str, Any], Samples]:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {
        (s.name, frozenset(s.labels.items())): s.value for f in families.values() for s in f.samples
    }
    return families, samples


def labels(**kw: str) -> frozenset[tuple[str, str]]:
    return frozenset(kw.items())


HOLDER = labels(tenant="docker:ab12cd34ef56", name="ab12cd34ef56", pod="web-7f", namespace="shop")


def test_ledger_counters_carry_tenant_pod_and_gpu_labels(serve) -> None:
    families, samples = parse(scrape(serve()))
    holder = HOLDER | {("gpu", "0")}
    expected = {
        "kiwi_tenant_holding_seconds_total": 310.5,
        "kiwi_tenant_entitled_seconds_total": 280.25,
        "kiwi_tenant_waiting_seconds_total": 242.0,
        "kiwi_tenant_quanta_total": 11,
        "kiwi_tenant_early_releases_total": 2,
        "kiwi_tenant_swapped_out_bytes_total": 2**30,
        "kiwi_tenant_swapped_in_bytes_total": 2**29,
        "kiwi_tenant_swap_seconds_total": 1.5,
    }
    for name, value in expected.items():
        assert families[name.removesuffix("_total")].type == "counter"
        assert samples[(name, holder)] == value, name
    assert families["kiwi_tenant_footprint_bytes"].type == "gauge"
    assert samples[("kiwi_tenant_footprint_bytes", holder)] == 3 * 2**30
    bare = labels(tenant="pid:456", name="pid 456", pod="", namespace="", gpu="0")
    assert samples[("kiwi_tenant_quanta_total", bare)] == 1


def preemptions(samples: Samples, who: frozenset[tuple[str, str]]) -> dict[str, float]:
    """A tenant's preemption counters by reason."""
    return {
        dict(key)["reason"]: value
        for (name, key), value in samples.items()
        if name == "kiwi_tenant_preemptions_total" and who <= key
    }


def test_preemptions_are_counted_by_reason() -> None:
    """quantum: preempted less preempted_priority; priority: preempted_priority."""
    status = copy.deepcopy(STATUS)
    status["gpus"][0]["tenants"][1]["ledger"] = {**LEDGER, "preempted": 7, "preempted_priority": 0}
    del status["departed"][0]["ledger"]["preempted_priority"]  # a ledger from before priorities
    families, samples = parse(Exposition().render(status))
    assert families["kiwi_tenant_preemptions"].type == "counter"
    assert preemptions(samples, HOLDER | {("gpu", "0")}) == {"quantum": 2, "priority": 1}
    bare = labels(tenant="pid:456", name="pid 456", pod="", namespace="", gpu="0")
    assert preemptions(samples, bare) == {"quantum": 7, "priority": 0}
    gone = labels(tenant="pid:99", name="pid 99", pod="", namespace="", gpu="1")
    assert preemptions(samples, gone) == {"quantum": 3, "priority": 0}
    # Summed over the reasons, the counter is the ledger's preempted, as before.
    assert sum(preemptions(samples, HOLDER).values()) == LEDGER["preempted"]


def test_weight_and_priority_of_live_tenants() -> None:
    families, samples = parse(Exposition().render(STATUS))
    assert families["kiwi_tenant_weight"].type == "gauge"
    assert families["kiwi_tenant_priority"].type == "gauge"
    holder = HOLDER | {("gpu", "0")}
    bare = labels(tenant="pid:456", name="pid 456", pod="", namespace="", gpu="0")
    assert samples[("kiwi_tenant_weight", holder)] == 2.5
    assert samples[("kiwi_tenant_priority", holder)] == 10
    assert samples[("kiwi_tenant_weight", bare)] == 1
    assert samples[("kiwi_tenant_priority", bare)] == 0
    # A departed tenant has no policy any more: only its counters stay.
    policies = {
        dict(key)["tenant"]
        for (name, key), _ in samples.items()
        if name in ("kiwi_tenant_weight", "kiwi_tenant_priority")
    }
    assert policies == {"docker:ab12cd34ef56", "pid:456", "pid:789"}
    assert "pid:99" not in policies


def test_declared_memory_stands_beside_the_footprint() -> None:
    families, samples = parse(Exposition().render(STATUS))
    assert families["kiwi_tenant_declared_bytes"].type == "gauge"
    holder = HOLDER | {("gpu", "0")}
    assert samples[("kiwi_tenant_declared_bytes", holder)] == 2 * 2**30
    assert samples[("kiwi_tenant_footprint_bytes", holder)] == 3 * 2**30  # past it
    declared = {dict(key)["tenant"] for (name, key) in samples if name.endswith("declared_bytes")}
    assert declared == {"docker:ab12cd34ef56"}  # the others declared nothing


def test_departed_tenants_stay_until_the_daemon_drops_them(serve) -> None:
    status = copy.deepcopy(STATUS)
    server = serve(lambda: status)
    _, samples = parse(scrape(server))
    gone = {"tenant": "pid:99", "name": "pid 99", "pod": "", "namespace": ""}
    for gpu in ("0", "1"):  # the same series as when it was live on both GPUs
        assert samples[("kiwi_tenant_quanta_total", labels(**gone, gpu=gpu))] == 5
    assert ("kiwi_tenant_footprint_bytes", labels(**gone, gpu="0")) not in samples
    back = labels(tenant="pid:456", name="pid 456", pod="", namespace="", gpu="0")
    assert samples[("kiwi_tenant_quanta_total", back)] == 1  # not the departed 999
    status["departed"] = []
    _, samples = parse(scrape(server))
    assert not [k for k in samples if ("tenant", "pid:99") in k[1]]


def test_gpu_gauges(serve) -> None:
    families, samples = parse(scrape(serve()))
    assert samples[("kiwi_gpu_queue_length", labels(gpu="0"))] == 1
    assert samples[("kiwi_gpu_queue_length", labels(gpu="1"))] == 0
    holders = {k[1]: v for k, v in samples.items() if k[0] == "kiwi_gpu_holder_info"}
    assert holders == {labels(gpu="0", tenant="docker:ab12cd34ef56"): 1}
    assert samples[("kiwi_gpu_tq_seconds", labels(gpu="1"))] == 30
    assert samples[("kiwi_gpu_mode_info", labels(gpu="0", mode="exclusive"))] == 1
    assert samples[("kiwi_gpu_mode_info", labels(gpu="1", mode="auto"))] == 1
    assert samples[("kiwi_gpu_healthy", labels(gpu="0"))] == 1
    assert samples[("kiwi_gpu_healthy", labels(gpu="1"))] == 0
    assert samples[("kiwi_gpu_info", labels(gpu="1", uuid="GPU-77aa", model="NVIDIA H200"))] == 1
    assert families["kiwi_gpu_holder_info"].type == "gauge"


def test_handover_histogram_and_reload_counters(serve) -> None:
    families, samples = parse(scrape(serve()))
    assert families["kiwi_handover_duration_seconds"].type == "histogram"
    buckets = {
        dict(k[1])["le"]: v
        for k, v in samples.items()
        if k[0] == "kiwi_handover_duration_seconds_bucket" and ("gpu", "0") in k[1]
    }
    assert buckets == {
        "0.005": 1,
        "0.01": 3,
        "0.05": 7,
        "0.1": 8,
        "0.5": 8,
        "1.0": 9,
        "5.0": 9,
        "30.0": 9,
        "+Inf": 9,
    }
    assert samples[("kiwi_handover_duration_seconds_count", labels(gpu="0"))] == 9
    assert samples[("kiwi_handover_duration_seconds_sum", labels(gpu="0"))] == 1.25
    assert samples[("kiwi_handover_duration_seconds_count", labels(gpu="1"))] == 0
    assert samples[("kiwi_reloads_total", labels(result="ok"))] == 4
    assert samples[("kiwi_reloads_total", labels(result="failed"))] == 1
    assert "process_cpu_seconds" in families


def test_an_older_or_idle_daemon_still_gives_valid_metrics(serve) -> None:
    minimal = {"gpus": [{"id": "0", "holder": None, "waiters": [], "tenants": [{"id": "pid:1"}]}]}
    families, samples = parse(scrape(serve(lambda: minimal)))
    assert samples[("kiwi_reloads_total", labels(result="ok"))] == 0
    assert samples[("kiwi_gpu_queue_length", labels(gpu="0"))] == 0
    assert not families["kiwi_tenant_holding_seconds"].samples
    assert not families["kiwi_handover_duration_seconds"].samples


def test_ipv6_and_the_port_picked(serve) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    try:
        server = serve(listen="[::1]:0")
    except MetricsError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    assert server.port > 0
    _, samples = parse(scrape(server, host="[::1]"))
    assert samples[("kiwi_gpu_tq_seconds", labels(gpu="0"))] == 20


@pytest.mark.parametrize(
    ("listen", "why"),
    [
        ("9417", "not HOST:PORT"),
        (":9417", "not HOST:PORT"),
        ("localhost:9417", "needs an IP address"),
        ("127.0.0.1:http", "needs an IP address"),
        ("127.0.0.1:70000", "port must be in 0..65535"),
        ("::1:9417", "in brackets"),
        ("[127.0.0.1]:9417", "in brackets"),
    ],
)
def test_bad_listen_addresses_are_refused_with_the_reason(listen: str, why: str) -> None:
    with pytest.raises(MetricsError, match=why) as info:
        MetricsServer(listen, lambda: STATUS)
    assert repr(listen) in str(info.value)


def test_parse_listen() -> None:
    assert parse_listen("0.0.0.0:9417") == ("0.0.0.0", 9417)
    assert parse_listen("[::]:0") == ("::", 0)


def test_an_address_in_use_or_not_local_names_the_address(serve) -> None:
    first = serve()
    listen = f"127.0.0.1:{first.port}"
    with pytest.raises(
        MetricsError, match=rf"cannot serve metrics on {re.escape(listen)}: .*in use"
    ):
        MetricsServer(listen, lambda: STATUS).start()
    with pytest.raises(MetricsError, match=r"cannot serve metrics on 192\.0\.2\.1:9417"):
        MetricsServer("192.0.2.1:9417", lambda: STATUS).start()


def test_stop_frees_the_port_and_joins_the_thread(serve) -> None:
    server = serve()
    port = server.port
    scrape(server)
    server.stop()
    assert not [t for t in threading.enumerate() if t.name == "kiwid-metrics"]
    with pytest.raises(urllib.error.URLError):
        scrape(server)  # the listening socket is closed
    again = serve(listen=f"127.0.0.1:{port}")  # and the port can be bound again at once
    assert again.port == port
    scrape(again)
    server.stop()  # a second stop is harmless


def test_the_snapshot_is_taken_per_scrape_and_not_at_construction() -> None:
    calls: list[int] = []

    def snapshot() -> dict[str, Any]:
        calls.append(1)
        return STATUS

    server = MetricsServer("127.0.0.1:0", snapshot, process=False)
    assert calls == []
    families, _ = parse(server.body().decode())
    assert calls == [1]
    assert "kiwi_gpu_queue_length" in families
    assert not any(n.startswith("process_") for n in families)


def test_waiters_failures_and_daemon_gauges(serve) -> None:
    _, samples = parse(scrape(serve()))
    waiter = labels(gpu="0", tenant="pid:456")
    assert samples[("kiwi_waiter_wait_seconds", waiter)] == 12.3
    assert samples[("kiwi_waiter_position", waiter)] == 1
    assert samples[("kiwi_waiter_wait_bound_seconds", waiter)] == 22
    bare = labels(tenant="pid:456", name="pid 456", pod="", namespace="", gpu="0")
    assert samples[("kiwi_tenant_gate_failed", bare)] == 1
    assert samples[("kiwi_tenant_swap_refused", bare | {("reason", "host_floor")})] == 1
    holder = HOLDER | {("gpu", "0")}
    assert ("kiwi_tenant_gate_failed", holder) not in samples  # only while failing
    assert samples[("kiwi_gpu_memory_total_bytes", labels(gpu="0"))] == 80 * 2**30
    assert samples[("kiwi_gpu_memory_resident_bytes", labels(gpu="0"))] == 3 * 2**30
    assert samples[("kiwi_config_last_reload_successful", labels())] == 1
    assert samples[("kiwi_scheduling_enabled", labels())] == 1
    assert samples[("kiwi_build_info", labels(version="0.1.0"))] == 1
    status = copy.deepcopy(STATUS)
    status["config"]["last_reload"]["ok"] = False
    status["scheduling"] = "off"
    status["gpus"][0]["tenants"][1]["swap_refusal"] = "swapping is unavailable"
    _, samples = parse(Exposition().render(status))
    assert samples[("kiwi_config_last_reload_successful", labels())] == 0
    assert samples[("kiwi_scheduling_enabled", labels())] == 0
    assert samples[("kiwi_tenant_swap_refused", bare | {("reason", "other")})] == 1


def test_a_stuck_tenant_is_counted_by_the_operation_that_failed() -> None:
    _, samples = parse(Exposition().render(STATUS))
    stuck = labels(tenant="pid:789", name="pid 789", pod="", namespace="", gpu="0")
    assert samples[("kiwi_tenant_stuck", stuck | {("operation", "swap-in")})] == 1
    assert [k for k in samples if k[0] == "kiwi_tenant_stuck"] == [
        ("kiwi_tenant_stuck", stuck | {("operation", "swap-in")})
    ], "only the stuck tenant"
    assert ("kiwi_tenant_gate_failed", stuck) not in samples, "its gate holds"
    status = copy.deepcopy(STATUS)
    status["gpus"][0]["tenants"][2].update(state="waiting", stuck_reason=None)  # mended
    _, samples = parse(Exposition().render(status))
    assert not [k for k in samples if k[0] == "kiwi_tenant_stuck"]


def test_a_wait_without_a_bound_has_no_bound_series() -> None:
    """kiwid leaves the bound out where none can hold: the alert compares nothing."""
    status = copy.deepcopy(STATUS)
    status["gpus"][0]["waiters"][0].update(
        wait_bound_s=None, wait_bound_reason="pid:789 is stuck and may still run on GPU 0"
    )
    _, samples = parse(Exposition().render(status))
    waiter = labels(gpu="0", tenant="pid:456")
    assert samples[("kiwi_waiter_wait_seconds", waiter)] == 12.3
    assert ("kiwi_waiter_wait_bound_seconds", waiter) not in samples


def test_exported_families_are_exactly_the_declared_ones() -> None:
    families, _ = parse(Exposition().render(STATUS))
    declared = {name.removesuffix("_total") for name in METRIC_FAMILIES}
    assert set(families) == declared
    assert all(
        families[name].samples for name in families if name != "kiwi_tenant_corunning_seconds"
    )


def test_a_tenant_that_changes_is_shown_as_it_is_now() -> None:
    """The lines kept between scrapes never hide a change."""
    exposition = Exposition()
    status = copy.deepcopy(STATUS)
    parse(exposition.render(status))
    tenant = status["gpus"][0]["tenants"][0]
    tenant["ledger"] = {**tenant["ledger"], "quanta": 12}
    tenant["pod"] = 'we"b\\-8\n'
    tenant["gate_failure"] = "lock timed out"
    _, samples = parse(exposition.render(status))
    now = labels(
        tenant="docker:ab12cd34ef56",
        name="ab12cd34ef56",
        pod='we"b\\-8\n',
        namespace="shop",
        gpu="0",
    )
    assert samples[("kiwi_tenant_quanta_total", now)] == 12
    assert samples[("kiwi_tenant_gate_failed", now)] == 1
    assert not [k for k in samples if ("pod", "web-7f") in k[1]]
    status["gpus"][0]["tenants"] = []
    status["departed"] = []
    _, samples = parse(exposition.render(status))
    assert not [k for k in samples if k[0].startswith("kiwi_tenant_")]


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(status: dict[str, Any]) -> None:
        node: Any = status
        for step in path[:-1]:
            node = node[step]
        node[path[-1]] = value

    return change


HOLDER_AT = ("gpus", 0, "tenants", 0)
# One change to each input of a tenant's lines (a live one, and a departed one).
CHANGES = {
    **{
        f"ledger.{field}": _set((*HOLDER_AT, "ledger", field), 99)
        for field in LEDGER
        if field != "idle_s"  # not exported
    },
    "policy.weight": _set((*HOLDER_AT, "policy", "weight"), 4.0),
    "policy.priority": _set((*HOLDER_AT, "policy", "priority"), -1),
    "policy gone": _set((*HOLDER_AT, "policy"), None),
    "footprint": _set((*HOLDER_AT, "footprint_bytes"), 5),
    "declared": _set((*HOLDER_AT, "declared_bytes"), 7),
    "declared gone": _set((*HOLDER_AT, "declared_bytes"), None),
    "gate failure": _set((*HOLDER_AT, "gate_failure"), "freeze timed out"),
    "stuck": _set((*HOLDER_AT, "state"), "stuck"),
    "stuck operation": _set(("gpus", 0, "tenants", 2, "stuck_reason", "operation"), "retry"),
    "swap refusal": _set((*HOLDER_AT, "swap_refusal"), "host RAM floor: ..."),
    "namespace": _set((*HOLDER_AT, "namespace"), "shop-2"),
    "departed ledger": _set(("departed", 0, "ledger", "preempted_priority"), 2),
    "departed name": _set(("departed", 0, "name"), "pid 99 (old)"),
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_lines_kept_between_scrapes_are_those_a_fresh_render_writes(
    change: Callable[[dict[str, Any]], None],
) -> None:
    """A tenant's lines are a pure function of its cache key: every input is in it."""
    exposition = Exposition()
    status = copy.deepcopy(STATUS)
    before = exposition.render(status)
    change(status)
    after = exposition.render(status)
    assert after != before  # the change shows
    assert after == Exposition().render(status)


def test_parking_is_counted_per_tenant_and_wakes_by_reason() -> None:
    status = copy.deepcopy(STATUS)
    tenants = status["gpus"][0]["tenants"]
    tenants[1]["state"] = "parked"
    _, samples = parse(Exposition().render(status))
    parked = {
        dict(key)["tenant"]: value
        for (name, key), value in samples.items()
        if name == "kiwi_tenant_parked"
    }
    assert parked == {t["id"]: float(t["state"] == "parked") for t in tenants}
    assert parked[tenants[1]["id"]] == 1.0
    wakes = {
        dict(key)["reason"]: value
        for (name, key), value in samples.items()
        if name == "kiwi_wakes_total"
    }
    assert wakes == {"request": 5.0, "operator": 1.0, "policy": 0.0}
    assert samples["kiwi_restores_wasted_total", frozenset()] == 3.0
