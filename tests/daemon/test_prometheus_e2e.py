"""The shipped alerts, end to end: a real Prometheus scrapes a real kiwid and alerts.

kiwid runs on the simulated GPU with memory swapping whose hand-overs are far
slower than the allowance (a 4 GiB tenant at 0.5 GB/s each way): the waiting
tenant waits longer than its bound (the holder's quantum, the quanta ahead, the
allowance — 3 s, not the default 2 s, which the bound kiwid exports carries — and
one TQ per hand-over where memory swaps), and Prometheus
(Debian's package, started here on loopback with the files of etc/prometheus)
fires KiwiTenantWaitsTooLong. Prometheus is always stopped, whatever happened.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.conftest import REPO, wait_for
from tests.tools import need

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

GiB = 2**30
RULES = REPO / "etc" / "prometheus"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(d: Path, metrics_port: int) -> str:
    return f"""\
[scheduler]
tq = 1
idle_release = 5
handover_allowance = 3
[gpu]
backend = "sim"
poll_interval = 0.05
[gpu.sim]
devices = 1
memory_gib = 10
swap_out_gbps = 0.5
swap_in_gbps = 0.5
[memory]
swap = "checkpoint"
reserve_mib = 1024
host_floor_mib = 0
[control]
socket = "{d / "kiwid.sock"}"
[daemon]
state_dir = "{d / "state"}"
shutdown_timeout = 30
[kubernetes]
cdi_dir = ""
[metrics]
listen = "127.0.0.1:{metrics_port}"
"""


class Prometheus:
    """A Prometheus server of our own: its config, data and port, on loopback."""

    def __init__(self, workdir: Path, target: str) -> None:
        binary = need("prometheus", "scripts/bootstrap --dev installs Debian's package")
        self.dir = workdir / "prometheus"
        self.dir.mkdir()
        self.port = free_port()
        (self.dir / "prometheus.yml").write_text(
            json.dumps(  # JSON is YAML
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(RULES / "kiwi.rules.yml"), str(RULES / "kiwi.alerts.yml")],
                    "scrape_configs": [
                        {"job_name": "kiwid", "static_configs": [{"targets": [target]}]}
                    ],
                }
            )
        )
        self.log = self.dir / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={self.dir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        url = f"http://127.0.0.1:{self.port}{path}{query}"
        with urllib.request.urlopen(url, timeout=5) as reply:
            return json.loads(reply.read())

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2):
                return True
        except (urllib.error.URLError, ConnectionError):
            return False

    def alerts(self, name: str, state: str) -> list[dict[str, Any]]:
        found = self.get("/api/v1/alerts")["data"]["alerts"]
        return [a for a in found if a["labels"]["alertname"] == name and a["state"] == state]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def prometheus(workdir: Path) -> Iterator[list[Prometheus]]:
    started: list[Prometheus] = []
    yield started
    for server in started:
        server.stop()


def test_a_real_prometheus_fires_the_wait_alert_for_a_real_kiwid(
    start_kiwid, tenants, workdir: Path, prometheus: list[Prometheus]
) -> None:
    metrics_port = free_port()
    (workdir / "kiwi.toml").write_text(config(workdir, metrics_port))
    k = start_kiwid()
    server = Prometheus(workdir, f"127.0.0.1:{metrics_port}")
    prometheus.append(server)
    wait_for(server.ready, 30, "Prometheus to be ready")

    a, b = tenants("a"), tenants("b")
    k.attach(a.pid, memory=4 * GiB)
    wait_for(lambda: k.status()["gpus"][0]["holder"], 5, "a to hold the GPU")
    k.attach(b.pid, memory=4 * GiB)

    def firing() -> list[dict[str, Any]]:
        return server.alerts("KiwiTenantWaitsTooLong", "firing")

    alerts = wait_for(firing, 60, "KiwiTenantWaitsTooLong to fire")
    # Whichever of the two waits behind a slow hand-over at that moment (a, once b
    # has had its first turn).
    assert len(alerts) == 1 and alerts[0]["labels"]["tenant"] in (a.key, b.key), alerts
    assert alerts[0]["labels"]["job"] == "kiwid"
    # Its bound as Prometheus scraped it (in the last minute, should its wait have
    # ended since): first in line, the holder's quantum (TQ 1 s) + allowance 3 s +
    # 1 s for its hand-over (a holder may keep the GPU one more TQ for a restore).
    tenant = alerts[0]["labels"]["tenant"]
    scraped = f'max_over_time(kiwi_waiter_wait_bound_seconds{{tenant="{tenant}"}}[1m])'
    bound = server.get("/api/v1/query", query=scraped)["data"]["result"]
    assert [r["value"][1] for r in bound] == ["5"], bound
    assert float(alerts[0]["value"]) > 5
    up = server.get("/api/v1/query", query='up{job="kiwid"}')["data"]["result"]
    assert [r["value"][1] for r in up] == ["1"]
    assert not server.alerts("KiwidDown", "firing")
