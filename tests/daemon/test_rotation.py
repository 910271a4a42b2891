"""Real processes in real cgroups, rotated by a real kiwid (sim backend)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.daemon.conftest import KIWID, V2_ROOT, wait_for


def holder(k) -> str | None:
    h = k.status()["gpus"][0]["holder"]
    return h["tenant"] if h else None


def holder_and_waiter(start_kiwid, tenants, **config):
    """A kiwid (TQ 30 s) where busy tenant ``a`` holds the GPU and ``b`` is gated behind it."""
    k = start_kiwid(tq=30, poll=0.05, **config)
    a, b = tenants("a"), tenants("b")
    k.attach(a.pid)
    wait_for(lambda: holder(k) == a.key, 5, "a to hold the GPU")
    k.attach(b.pid)
    wait_for(b.frozen, 5, "b to be gated behind a")
    return k, a, b


def runnable(tenants) -> list[str] | None:
    """Which tenants are not frozen, from a consistent read (None if it moved)."""
    first = [t.frozen() for t in tenants]
    second = [t.frozen() for t in tenants]
    if first != second:
        return None
    return [t.name for t, frozen in zip(tenants, first, strict=True) if not frozen]


def holding(k, ts) -> list[float]:
    """Each tenant's holding seconds, from kiwid's ledger."""
    ledgers = {t["id"]: t["ledger"] for t in k.call("tenants")["tenants"]}
    return [ledgers[t.key]["holding_s"] for t in ts]


@pytest.mark.serial
def test_only_one_tenant_runs_and_the_order_is_round_robin(start_kiwid, tenants) -> None:
    k = start_kiwid(tq=1, idle_release=0.5, poll=0.05)
    ts = [tenants(name) for name in ("a", "b", "c")]
    idle = tenants("sleeper", busy=False)
    for t in [*ts, idle]:
        k.attach(t.pid)
    wait_for(lambda: sum(t.frozen() for t in ts) == 2, 5, "two of three to be gated")
    cpu_before = [t.cpu_ticks() for t in ts]
    held_before = holding(k, ts)
    order: list[str] = []
    samples = 0
    deadline = time.monotonic() + 7
    while time.monotonic() < deadline:
        now_running = runnable(ts)
        if now_running is not None:
            samples += 1
            assert len(now_running) <= 1, f"co-running at a sample: {now_running}"
        current = holder(k)
        if current and (not order or order[-1] != current):
            order.append(current)
        assert not idle.frozen(), "an idle tenant is never gated"
    keys = {t.key: t.name for t in ts}
    names = [keys[h] for h in order if h in keys]
    assert len(names) >= 5, names
    cycle = names[:3]
    assert sorted(cycle) == ["a", "b", "c"]
    assert names == (cycle * 4)[: len(names)], f"not round-robin: {names}"
    assert samples > 50
    # Each made progress only while it held the GPU (a frozen one makes none), and
    # over whole rotations they held it about equally: within one quantum.
    held = [after - before for after, before in zip(holding(k, ts), held_before, strict=True)]
    tick_s = os.sysconf("SC_CLK_TCK")
    cpu = [(t.cpu_ticks() - b) / tick_s for t, b in zip(ts, cpu_before, strict=True)]
    for name, used, holding_s in zip("abc", cpu, held, strict=True):
        assert used <= holding_s + 0.3, f"{name} ran {used:.2f} s while holding {holding_s:.2f} s"
    assert max(held) - min(held) <= 1.0 + 0.3, held


@pytest.mark.serial
def test_holder_that_exits_hands_over_at_once(start_kiwid, tenants) -> None:
    k, a, b = holder_and_waiter(start_kiwid, tenants, idle_release=5)
    a.proc.kill()
    a.proc.wait()
    started = time.monotonic()
    wait_for(lambda: not b.frozen(), 3, "b to be let go when a exits")
    assert time.monotonic() - started < 3 < 30  # not at the end of a's quantum
    assert holder(k) == b.key


def test_sigterm_thaws_everyone_and_clears_the_state(start_kiwid, tenants, workdir) -> None:
    k, a, b = holder_and_waiter(start_kiwid, tenants)
    assert (workdir / "state" / "state.json").exists()
    assert k.stop(signal.SIGTERM) == 0
    assert not b.frozen() and not a.frozen()
    assert not (workdir / "state" / "state.json").exists()
    assert "no tenant is gated" in k.log_text()


def test_after_sigkill_recover_thaws(start_kiwid, tenants, workdir) -> None:
    k, _a, b = holder_and_waiter(start_kiwid, tenants)
    k.proc.kill()
    k.proc.wait()
    assert b.frozen(), "SIGKILL leaves the tenant frozen: that is what recover is for"
    out = subprocess.run(
        [*KIWID, "recover", "--config", str(k.config)], capture_output=True, text=True, timeout=20
    )
    assert out.returncode == 0, out.stderr
    assert b.key in out.stderr
    assert not b.frozen()


def test_a_tenant_in_a_v1_freezer_cgroup_only_is_frozen_there(start_kiwid, tenants) -> None:
    """Hybrid hosts: a container whose cgroup2 path is the root but has a v1 freezer cgroup."""
    k = start_kiwid(tq=30, poll=0.05)
    a = tenants("a")
    b = tenants("b", v2=False)
    if b.v1 is None:
        pytest.skip("no cgroup v1 freezer on this host")
    k.attach(a.pid)
    wait_for(lambda: holder(k) == a.key, 5, "a to hold the GPU")
    k.attach(b.pid)
    state = b.v1 / "freezer.state"
    wait_for(lambda: state.read_text().strip() == "FROZEN", 5, "b frozen in the v1 freezer")
    a.proc.kill()
    a.proc.wait()
    wait_for(lambda: state.read_text().strip() == "THAWED", 5, "b thawed when a exits")


@pytest.mark.cgroups  # the freezer found in this host's hierarchy
def test_gate_choice_is_logged_and_falls_back_to_the_freezer(start_kiwid) -> None:
    k = start_kiwid()
    k.wait_log("CUDA process lock unavailable")
    k.wait_log("Gate: the cgroup freezer")
    assert k.status()["gate"] == "freeze"


@pytest.mark.cgroups  # kiwid's own cgroups, no fixture's
def test_bare_processes_are_isolated_frozen_alone_and_cleaned_up(start_kiwid, workdir) -> None:
    k = start_kiwid(tq=30, poll=0.05)
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        a, b = procs
        k.attach(a.pid)
        wait_for(lambda: holder(k) == f"pid:{a.pid}", 5, "a to hold the GPU")
        k.attach(b.pid)
        cgroup = V2_ROOT / "kiwi" / f"pid-{b.pid}"
        wait_for(
            lambda: cgroup.exists() and "frozen 1" in (cgroup / "cgroup.events").read_text(),
            5,
            "b isolated and frozen",
        )
        assert f"0::/kiwi/pid-{b.pid}" in Path(f"/proc/{b.pid}/cgroup").read_text()
        b.kill()
        b.wait()
        wait_for(lambda: not cgroup.exists(), 5, "the isolation cgroup to be removed")
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_restarted_kiwid_re_adopts_its_waiters_without_thawing_them(
    start_kiwid, tenants, workdir
) -> None:
    k, a, b = holder_and_waiter(start_kiwid, tenants)
    k.proc.kill()
    k.proc.wait()
    k2 = start_kiwid(wait_ready=False)
    thawed_at_some_point = False
    deadline = time.monotonic() + 10
    while "Re-adopted" not in k2.log_text():
        thawed_at_some_point |= not b.frozen()
        assert time.monotonic() < deadline, k2.log_text()
        assert k2.proc.poll() is None, k2.log_text()
    assert not thawed_at_some_point, "a re-adopted waiter must stay frozen"
    assert f"Re-adopted {b.key}" in k2.log_text()
    # It re-adopts before it serves its socket: ask once it answers.
    wait_for(lambda: k2.answers() and holder(k2) == a.key, 5, "a to hold the GPU again")
    assert b.frozen()
    assert k2.tenant_states()[b.key] == "waiting"


def test_a_restarted_kiwid_ungates_what_it_no_longer_sees(start_kiwid, tenants, workdir) -> None:
    k, _a, b = holder_and_waiter(start_kiwid, tenants)
    k.proc.kill()
    k.proc.wait()
    (workdir / "state" / "sim.json").unlink()  # the new kiwid sees no GPU processes
    k2 = start_kiwid()
    k2.wait_log(f"Ungated {b.key}, left gated by a previous kiwid")
    assert not b.frozen()
