"""``kiwictl top`` in tmux, ``kiwictl explain`` and the metrics, against a real kiwid."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiwid.adapters.metrics import MetricsServer
from tests.daemon.conftest import KIWICTL, REPO, wait_for

pytestmark = pytest.mark.slow


class Tmux:
    """A private tmux server (its own socket), so nothing else is touched."""

    def __init__(self) -> None:
        self.server = f"kiwi-test-{uuid.uuid4().hex[:8]}"

    def __call__(self, *args: str) -> str:
        out = subprocess.run(
            ["tmux", "-L", self.server, *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        assert out.returncode == 0, f"tmux {args[0]} failed: {out.stderr}"
        return out.stdout

    def alive(self) -> bool:
        probe = ["tmux", "-L", self.server, "has-session", "-t", "top"]
        return subprocess.run(probe, capture_output=True, timeout=10, check=False).returncode == 0

    def kill(self) -> None:
        subprocess.run(
            ["tmux", "-L", self.server, "kill-server"], capture_output=True, timeout=10, check=False
        )


@pytest.fixture
def tmux() -> Iterator[Tmux]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (scripts/bootstrap --dev installs it)")
    t = Tmux()
    try:
        yield t
    finally:
        t.kill()


def pane_view(pane: str) -> tuple[str | None, list[str]]:
    """The holder and the queued tenants shown on the first GPU of a captured frame."""
    holder = re.search(r"^  holder   (\S+)  held ", pane, re.MULTILINE)
    queued = re.findall(r"^  (?:queue   |         ) \d+\. (\S+)  waiting ", pane, re.MULTILINE)
    return (holder.group(1) if holder else None), queued


def test_top_shows_the_holder_and_queue_and_follows_the_rotation(
    start_kiwid, tenants, tmux: Tmux, workdir: Path
) -> None:
    k = start_kiwid(tq=1, idle_release=0.5, poll=0.05)
    a, b = tenants("a"), tenants("b")
    k.attach(a.pid)
    k.attach(b.pid)
    wait_for(lambda: k.status()["gpus"][0]["waiters"], 5, "one tenant to queue behind the other")
    rc_file = workdir / "top.rc"
    top = shlex.join([*KIWICTL, "--socket", str(k.socket), "top", "--interval", "0.2"])
    tmux(
        "new-session", "-d", "-s", "top", "-x", "200", "-y", "40", "-c", str(REPO),
        f"{top}; echo $? > {rc_file}",
    )  # fmt: skip
    keys = {a.key, b.key}
    holders: list[str] = []
    panes: list[str] = []

    def rotated() -> bool:
        pane = tmux("capture-pane", "-p", "-t", "top")
        holder, queued = pane_view(pane)
        if holder is None:
            return False
        panes.append(pane)
        assert holder in keys, pane
        assert queued == sorted(keys - {holder}), pane  # the other one, and only it, waits
        if not holders or holders[-1] != holder:
            holders.append(holder)
        return len(holders) >= 3  # a → b → a (or b → a → b): the view follows the rotation

    wait_for(rotated, 15, "top to show the holder change twice")
    assert set(holders) == keys
    assert panes[-1].startswith("kiwi top · ")
    assert "GPU 0 · " in panes[-1] and "TQ 1.0 s" in panes[-1]

    def ledger_shown() -> str | None:
        """A frame with kiwid's uptime in the header and each tenant's share of GPU time."""
        pane = tmux("capture-pane", "-p", "-t", "top")
        rows = [ln for ln in pane.splitlines() if ln.startswith(tuple(f"  {k} " for k in keys))]
        shares = [re.search(r" \d+\.\d% ", row) for row in rows]
        up = " · up " in pane.split("\n", 1)[0]
        return pane if up and len(rows) == 2 and all(shares) else None

    wait_for(ledger_shown, 5, "the uptime and both tenants' shares of GPU time")
    k.stop()  # kiwid goes away: top says so and keeps retrying

    def unreachable() -> bool:
        return "kiwid unreachable: " in tmux("capture-pane", "-p", "-t", "top")

    wait_for(unreachable, 5, "top to say that kiwid went away")
    assert tmux.alive()
    tmux("send-keys", "-t", "top", "q")
    wait_for(lambda: not tmux.alive(), 5, "top to quit on q")
    assert rc_file.read_text().strip() == "0"


def test_explain_says_why_a_tenant_waits_and_whom_for(start_kiwid, tenants) -> None:
    k = start_kiwid(tq=30, idle_release=5, poll=0.05)
    a, b = tenants("a"), tenants("b")
    k.attach(a.pid)
    wait_for(lambda: k.status()["gpus"][0]["holder"], 5, "a to hold the GPU")
    k.attach(b.pid)
    wait_for(b.frozen, 5, "b to be gated behind a")
    out = k.ctl("explain", str(b.pid))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith(f"{b.key} is WAITING for GPU 0 since ")
    assert f"the GPU is held by {a.key} whose quantum ends in " in text
    assert "it is next in line. Estimated turn in " in text
    assert "Estimated turn in about" not in text  # kiwid's own ETA, not a client estimate
    assert re.search(r"Ledger \(since kiwid started [^)]+\): held 0\.0 s in 0 quanta", text), text
    facts = json.loads(k.ctl("explain", b.key, "--json").stdout)
    (gpu,) = facts["gpus"]
    assert gpu["holder"]["tenant"] == a.key
    # The rest of a's quantum, plus one hand-over allowance (scheduler.handover_allowance).
    allowance = k.status()["handover_allowance_s"]
    assert 0 < gpu["eta_s"] <= 30 + allowance
    assert gpu["eta_s"] == pytest.approx(gpu["holder"]["remaining_s"] + allowance, abs=1.0)
    assert facts["ledger"]["waiting_s"] > 0
    holder = k.ctl("explain", a.key)
    assert holder.returncode == 0, holder.stderr
    assert f"{a.key} HOLDS GPU 0" in holder.stdout
    assert f"1 tenant waits ({b.key}), so its quantum ends in " in holder.stdout
    missing = k.ctl("explain", "no-such-tenant")
    assert missing.returncode == 1
    assert "kiwictl tenants" in missing.stderr


def test_metrics_from_a_real_kiwids_status_parse_and_keep_departed_tenants(
    start_kiwid, tenants
) -> None:
    """The collector against what kiwid really answers (the daemon serves it the same way)."""
    k = start_kiwid(tq=30, idle_release=5, poll=0.05)
    a, b = tenants("a"), tenants("b")
    k.attach(a.pid)
    wait_for(lambda: k.status()["gpus"][0]["holder"], 5, "a to hold the GPU")
    k.attach(b.pid)
    wait_for(b.frozen, 5, "b to be gated behind a")
    server = MetricsServer("127.0.0.1:0", k.status)
    server.start()
    try:
        samples = scrape(server)
        assert samples[("kiwi_gpu_holder_info", (("gpu", "0"), ("tenant", a.key)))] == 1
        assert samples[("kiwi_gpu_queue_length", (("gpu", "0"),))] == 1
        assert samples[("kiwi_reloads_total", (("result", "ok"),))] == 0
        assert samples[("kiwi_gpu_tq_seconds", (("gpu", "0"),))] == 30
        quanta = {
            dict(lb)["tenant"]: v
            for (n, lb), v in samples.items()
            if n == "kiwi_tenant_quanta_total"
        }
        assert quanta == {a.key: 1, b.key: 0}
        # The policy, the split preemptions and the waiter's bound, under the names
        # the real status object uses: b waits first in line, 1 x TQ 30 s + 2 s.
        for tenant in (a.key, b.key):
            mine = {
                (n, dict(lb).get("reason")): v
                for (n, lb), v in samples.items()
                if ("tenant", tenant) in lb and n.startswith("kiwi_tenant_")
            }
            assert mine[("kiwi_tenant_weight", None)] == 1
            assert mine[("kiwi_tenant_priority", None)] == 0
            assert mine[("kiwi_tenant_preemptions_total", "quantum")] == 0
            assert mine[("kiwi_tenant_preemptions_total", "priority")] == 0
        bound = ("kiwi_waiter_wait_bound_seconds", (("gpu", "0"), ("tenant", b.key)))
        assert samples[bound] == 32
        assert ("kiwi_handover_duration_seconds_count", (("gpu", "0"),)) in samples
        a.proc.kill()
        a.proc.wait()
        wait_for(lambda: not b.frozen(), 5, "b to be let go when a exits")

        def departed_and_handed_over() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            now = scrape(server)
            return now if ("kiwi_gpu_holder_info", (("gpu", "0"), ("tenant", b.key))) in now else {}

        samples = wait_for(departed_and_handed_over, 5, "b to hold the GPU in the metrics")
        held = {
            dict(lb)["tenant"]: v
            for (n, lb), v in samples.items()
            if n == "kiwi_tenant_holding_seconds_total"
        }
        assert set(held) == {a.key, b.key}  # a is gone but still exported (grace period)
        assert held[a.key] > 0
    finally:
        server.stop()


def scrape(server: MetricsServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    url = f"http://127.0.0.1:{server.port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
