"""kiwid's own /metrics endpoint, read by Prometheus' parser."""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.daemon.conftest import config_text, wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_metrics_endpoint_serves_the_ledger_and_queue(start_kiwid, tenants, workdir) -> None:
    port = free_port()
    (workdir / "kiwi.toml").write_text(
        config_text(workdir, tq=1, idle_release=0.5, poll=0.05)
        + f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
    )
    k = start_kiwid()
    a, b = tenants("a"), tenants("b")
    k.attach(a.pid)
    k.attach(b.pid)
    wait_for(
        lambda: any(t["ledger"]["preempted"] for t in k.status()["gpus"][0]["tenants"]),
        10,
        "a preemption",
    )

    def handed_over(families: dict) -> bool:
        return any(
            s.name.endswith("_count") and s.value >= 1
            for s in families["kiwi_handover_duration_seconds"]
        )

    # A hand-over is observed when the worker has carried it out, just after the
    # scheduler's preemption that status shows: wait for it.
    def scrape_after_a_handover() -> dict | None:
        families = scrape(port)
        return families if handed_over(families) else None

    families = wait_for(scrape_after_a_handover, 5, "a hand-over in the histogram")
    quanta = {s.labels["tenant"]: s.value for s in families["kiwi_tenant_quanta"]}
    assert set(quanta) == {a.key, b.key}
    assert sum(quanta.values()) >= 2
    assert [s.value for s in families["kiwi_gpu_tq_seconds"]] == [1.0]
    assert [s.value for s in families["kiwi_gpu_queue_length"]] == [1.0]
    assert "Metrics on http://127.0.0.1:" in k.log_text()


def test_a_taken_metrics_port_is_a_startup_failure(start_kiwid, workdir) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (workdir / "kiwi.toml").write_text(
            config_text(workdir) + f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
        )
        k = start_kiwid(wait_ready=False)
        assert k.proc.wait(timeout=20) == 3
    assert "metrics.listen" in k.log_text()
