"""Weights and priorities against a real kiwid (sim backend), real busy processes in
real cgroups, policies from real [[tenants]] rules and kiwictl."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kiwid.adapters.control import ControlError
from tests.daemon.conftest import V2_ROOT, Kiwid, config_text, wait_for
from tests.daemon.test_swap_e2e import sim_memory, swap_config, swapped

GiB = 2**30


def rules(*entries: str) -> str:
    return "".join(f"\n[[tenants]]\n{entry}\n" for entry in entries)


def entry(k: Kiwid, key: str) -> dict[str, Any]:
    """The tenant as kiwid lists it ({} while it is not listed yet)."""
    return next((t for t in k.call("tenants")["tenants"] if t["id"] == key), {})


def holder(k: Kiwid) -> str | None:
    h = k.status()["gpus"][0]["holder"]
    return h["tenant"] if h else None


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_weights_one_two_three_share_the_gpu_one_two_three(start_kiwid, tenants, workdir) -> None:
    text = config_text(workdir, tq=1, idle_release=0.5, poll=0.05)
    text += rules(*(f'match = {{ cgroup = "*/w{w}" }}\nweight = {w}' for w in (1, 2, 3)))
    (workdir / "kiwi.toml").write_text(text)
    k = start_kiwid()
    ts = [tenants(f"w{w}") for w in (1, 2, 3)]
    for t in ts:
        k.attach(t.pid)
    wait_for(lambda: sum(t.frozen() for t in ts) == 2, 5, "two of three gated")
    assert [entry(k, t.key)["policy"]["weight"] for t in ts] == [1.0, 2.0, 3.0]
    assert entry(k, ts[2].key)["quantum_s"] == 3.0
    before = [t.cpu_ticks() for t in ts]
    time.sleep(60)  # the run whose CPU shares are measured: 10 rotations of 6 s
    used = [t.cpu_ticks() - b for t, b in zip(ts, before, strict=True)]
    shares = [u / sum(used) for u in used]
    print("CPU shares over 60 s, weights 1:2:3:", ", ".join(f"{x:.1%}" for x in shares))
    for share, want in zip(shares, (1 / 6, 2 / 6, 3 / 6), strict=True):
        assert abs(share - want) <= 0.03, shares
    on_gpu = {t["id"]: t for t in k.status()["gpus"][0]["tenants"]}
    assert on_gpu[ts[2].key]["share"]["entitled"] == pytest.approx(0.5, abs=0.02)
    assert on_gpu[ts[2].key]["share"]["received"] == pytest.approx(0.5, abs=0.03)


@pytest.mark.serial
def test_a_higher_priority_tenant_suspends_the_holder_at_once(
    start_kiwid, tenants, workdir
) -> None:
    text = config_text(workdir, tq=30, poll=0.05)
    text += rules('match = { cgroup = "*/vip" }\npriority = 10')
    (workdir / "kiwi.toml").write_text(text)
    k = start_kiwid()
    low, vip = tenants("low"), tenants("vip")
    k.attach(low.pid)
    wait_for(lambda: holder(k) == low.key, 5, "low to hold the GPU")
    k.attach(vip.pid)
    # vip holds within 1 s: low is frozen (suspended, not killed) and vip runs.
    wait_for(
        lambda: holder(k) == vip.key and low.frozen() and not vip.frozen(),
        1.0,
        "vip to hold and low to be frozen within 1 s",
    )
    assert low.proc.poll() is None
    suspended = entry(k, low.key)
    assert suspended["ledger"]["preempted_priority"] == 1
    assert suspended["last_preemption"]["reason"] == "priority"
    assert suspended["last_preemption"]["by"] == vip.key
    out = k.ctl("explain", low.key)
    assert out.returncode == 0, out.stderr
    assert f"it is waiting behind priority 10 tenant {vip.key}" in out.stdout, out.stdout
    assert "It was preempted" in out.stdout and f"for {vip.key}" in out.stdout
    assert "suspended, not killed" in out.stdout
    # vip keeps the GPU while only a lower class waits.
    status = k.status()["gpus"][0]
    assert status["holder"]["remaining_s"] is None


def test_kiwictl_sets_weight_and_priority_until_the_next_reload(start_kiwid, tenants) -> None:
    k = start_kiwid(tq=10, poll=0.05)
    a = tenants("a")
    k.attach(a.pid)
    wait_for(lambda: a.key in k.tenant_states(), 5, "a to be seen")
    out = k.ctl("set-weight", a.key, "2.5")
    assert out.returncode == 0, out.stderr
    assert "weight 2.5 until the next reload" in out.stdout
    assert k.ctl("set-priority", str(a.pid), "4").returncode == 0  # found by its pid
    policy = entry(k, a.key)["policy"]
    assert (policy["weight"], policy["priority"], policy["runtime"]) == (2.5, 4, True)
    assert policy["sources"]["weight"] == "runtime"
    bad = k.ctl("set-weight", a.key, "0")
    assert bad.returncode == 1, bad.stderr  # refused as invalid, nothing changed
    assert "weight must be a number from 0.01 to 1000, not 0" in bad.stderr
    assert entry(k, a.key)["policy"]["weight"] == 2.5
    refused = k.ctl("set-weight", "nobody-at-all", "2")
    assert refused.returncode == 1
    k.write_config(k.config.read_text())  # a reload: the file is the persistent truth
    wait_for(lambda: not entry(k, a.key)["policy"]["runtime"], 5, "the runtime values to end")
    assert entry(k, a.key)["policy"]["weight"] == 1.0


WEIGHTS = "weight must be a number from 0.01 to 1000"  # the core's words (TenantPolicy)
PRIORITIES = "priority must be an integer from -1000 to 1000"


def test_register_and_kiwictl_take_the_cores_range_and_no_more(start_kiwid, tenants) -> None:
    k = start_kiwid(tq=10, poll=0.05)
    c = tenants("c", busy=False)
    cgroup = "/" + str(c.v2.relative_to(V2_ROOT))
    container = {"id": "c0", "cgroup_v2": cgroup, "pid": c.pid, "hold": False}
    for bad, words in (
        ({"weight": 0.001}, f"container c0: {WEIGHTS}, not 0.001"),
        ({"weight": 1000.5}, f"container c0: {WEIGHTS}, not 1000.5"),
        ({"priority": 1001}, f"container c0: {PRIORITIES}, not 1001"),
    ):
        with pytest.raises(ControlError) as err:
            k.call("register", {**container, **bad})
        assert (err.value.code, err.value.message) == ("invalid-value", words)
    assert k.tenant_states() == {}  # nothing registered
    k.call("register", {**container, "weight": 0.01, "priority": -1000})
    wait_for(lambda: c.key in k.tenant_states(), 5, "c to be registered")
    assert entry(k, c.key)["policy"]["sources"]["weight"] == "annotation"
    for command, value, words in (
        ("set-weight", "0.001", f"{WEIGHTS}, not 0.001"),
        ("set-weight", "1000.5", f"{WEIGHTS}, not 1000.5"),
        ("set-priority", "1001", f"{PRIORITIES}, not 1001"),
        ("set-priority", "-1001", f"{PRIORITIES}, not -1001"),
    ):
        out = k.ctl(command, c.key, value)
        assert (out.returncode, out.stderr) == (1, f"[ERROR] {words}\n")
    policy = entry(k, c.key)["policy"]
    assert (policy["weight"], policy["priority"], policy["runtime"]) == (0.01, -1000, False)
    for command, value in (("set-weight", "1000"), ("set-priority", "1000")):
        assert k.ctl(command, c.key, value).returncode == 0
    policy = entry(k, c.key)["policy"]
    assert (policy["weight"], policy["priority"]) == (1000.0, 1000)
    assert k.ctl("set-weight", c.key, "0.01").returncode == 0
    assert entry(k, c.key)["policy"]["weight"] == 0.01
    assert "Traceback" not in k.log_text()


def test_a_preempted_tenant_is_suspended_to_host_ram_and_comes_back_and_never_means_never(
    start_kiwid, tenants, workdir
) -> None:
    text = swap_config(workdir, tq=30)
    text += rules(
        'match = { cgroup = "*/vip" }\npriority = 10',
        'match = { cgroup = "*/pinned" }\nswap = "never"',
    )
    (workdir / "kiwi.toml").write_text(text)
    k = start_kiwid()
    low, vip, pinned = tenants("low"), tenants("vip"), tenants("pinned")
    k.attach(low.pid, memory=4 * GiB)
    wait_for(lambda: holder(k) == low.key, 5, "low to hold the GPU")
    k.attach(pinned.pid, memory=2 * GiB)  # waits behind low, on the card
    wait_for(pinned.frozen, 5, "pinned to wait")
    k.attach(vip.pid, memory=4 * GiB)
    wait_for(lambda: holder(k) == vip.key and not vip.frozen(), 10, "vip to hold")
    wait_for(lambda: swapped(workdir, low), 10, "low's memory in host RAM")
    out_bytes = sim_memory(workdir)[low.pid][0]
    assert low.frozen() and low.proc.poll() is None
    assert not swapped(workdir, pinned), "swap = never: its memory stays on the card"
    # vip's burst ends: low comes back first (the front of its class), whole.
    vip.proc.kill()
    vip.proc.wait()
    wait_for(lambda: holder(k) == low.key and not low.frozen(), 15, "low to run again")
    assert not swapped(workdir, low)
    assert sim_memory(workdir)[low.pid][0] == out_bytes
    ledger = entry(k, low.key)["ledger"]
    assert ledger["swapped_out_bytes"] == ledger["swapped_in_bytes"] == out_bytes
    assert "Swapped out" not in "".join(
        line for line in k.log_text().splitlines() if pinned.key in line
    )
    assert entry(k, pinned.key)["policy"]["swap"] == "never"


def test_a_tenant_starved_past_max_wait_is_boosted_and_told_why(
    start_kiwid, tenants, workdir
) -> None:
    tq = 2
    text = config_text(workdir, tq=tq, poll=0.05).replace("[gpu]", "max_wait = 2\n[gpu]", 1)
    text += rules('match = { cgroup = "*/vip" }\npriority = 5')
    (workdir / "kiwi.toml").write_text(text)
    k = start_kiwid()
    vip, low = tenants("vip"), tenants("low")
    k.attach(vip.pid)
    wait_for(lambda: holder(k) == vip.key, 5, "vip to hold")
    k.attach(low.pid)
    wait_for(lambda: entry(k, low.key).get("boosted"), 10, "low to be boosted after max_wait")
    out = k.ctl("explain", low.key)
    assert "max_wait" in out.stdout, out.stdout
    # Boosted, it gets one whole quantum (TQ x weight 1), and runs in it, though the
    # higher class waits all along; then the higher class holds again.
    wait_for(lambda: holder(k) == low.key and not low.frozen(), 10, "low to hold")
    assert entry(k, low.key)["quantum_s"] == tq
    ran_from = low.cpu_ticks()
    wait_for(lambda: holder(k) == vip.key, 3 * tq, "vip to hold again after low's quantum")
    held = entry(k, low.key)["ledger"]
    assert held["holding_s"] >= tq - 0.01, held  # kiwid's own account: not cut short
    assert low.cpu_ticks() > ran_from, "low ran in its quantum"
    wait_for(low.frozen, 5, "low to wait again, frozen")
