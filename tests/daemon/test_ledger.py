"""The per-tenant ledger, driven through a real rotation (sim backend, real cgroups)."""

from __future__ import annotations

import time

from tests.daemon.conftest import wait_for

POLL = 0.05


def test_ledger_adds_up_to_wall_time_and_counts_the_rotation(start_kiwid, tenants) -> None:
    k = start_kiwid(tq=1, idle_release=0.5, poll=POLL)
    a, b = tenants("a"), tenants("b")
    seen_at = {}
    for t in (a, b):
        k.attach(t.pid)
        wait_for(lambda t=t: t.key in k.tenant_states(), 5, f"{t.name} to be seen")
        seen_at[t.key] = time.monotonic()

    def both_preempted() -> bool:
        gpu = k.status()["gpus"][0]
        ledgers = {t["id"]: t["ledger"] for t in gpu["tenants"]}
        # A hand-over is timed once its freeze and thaw are done: a moment after the
        # scheduler counted the preemption.
        done = gpu["handover_seconds"]["count"] >= 4
        return done and all(ledgers[t.key]["preempted"] >= 2 for t in (a, b))

    wait_for(both_preempted, 15, "two full rotations")
    before = time.monotonic()
    gpu = k.status()["gpus"][0]
    after = time.monotonic()
    for entry in gpu["tenants"]:
        ledger = entry["ledger"]
        total = ledger["holding_s"] + ledger["waiting_s"] + ledger["idle_s"] + ledger["corunning_s"]
        wall = before - seen_at[entry["id"]]
        # First seen up to one poll before our look-up returned; the status may be 0.1 s old.
        assert wall - 0.1 - (after - before) <= total <= wall + POLL + (after - before) + 0.05, (
            entry["id"],
            total,
            wall,
        )
        assert ledger["quanta"] >= ledger["preempted"] >= 2
        assert ledger["holding_s"] > 1.0
        assert ledger["waiting_s"] > 1.0
    assert gpu["handover_seconds"]["count"] >= 4
    assert gpu["handover_seconds"]["buckets"][-1] == ["+Inf", gpu["handover_seconds"]["count"]]
    waiter = gpu["waiters"][0]
    # Its turn: the rest of the holder's 1 s quantum, plus one hand-over allowance.
    allowance = k.status()["handover_allowance_s"]
    assert allowance <= waiter["eta_s"] <= 1.0 + allowance
    assert waiter["wait_bound_s"] == 1.0 + allowance


def test_a_departed_tenant_keeps_its_ledger_for_a_while(start_kiwid, tenants) -> None:
    k = start_kiwid(tq=30, poll=POLL)
    a = tenants("a")
    k.attach(a.pid)
    wait_for(lambda: k.tenant_states().get(a.key) == "holder", 5, "a to hold the GPU")
    a.proc.kill()
    a.proc.wait()
    departed = wait_for(lambda: k.status()["departed"], 5, "a to be listed as departed")
    assert departed[0]["id"] == a.key
    assert departed[0]["ledger"]["quanta"] == 1
    k.wait_log(f"({a.key}) left the GPU")
    lines = k.log_text().splitlines()
    assert any(line.startswith("[INFO] Grant: ") and a.key in line for line in lines)
    assert any(line.startswith("[INFO] Gone: ") and a.key in line for line in lines)
