"""Stuck tenants as an operator meets them: status, explain, ``kiwictl retry`` and ``release``.

A real kiwid on the simulated GPU, real processes in real cgroups. ``sim-fault``
makes a tenant stuck on demand: a ``stuck`` restore fails and leaves its memory in
host RAM (operation ``swap-in``); a ``hang`` holds the restore past its deadline.
With ``checkpoint`` swapping on a 10 GiB card, ``b`` goes to host RAM while ``a``
holds and is restored at each of its turns.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from kiwid.adapters.control import ControlError
from tests.daemon.conftest import Kiwid, wait_for
from tests.daemon.test_swap_e2e import GiB, a_holds_b_waits, holder, swap_config, swapped


def entry(k: Kiwid, key: str) -> dict[str, Any]:
    return next(t for t in k.status()["gpus"][0]["tenants"] if t["id"] == key)


def logged(k: Kiwid, asked: str, key: str, outcome: str) -> None:
    """The one INFO line of an operator's retry or release, naming the tenant and the uid."""
    line = re.compile(
        rf"\[INFO\] Operator {asked} of (\S+ \()?{re.escape(key)}\)? by uid 0: {outcome}"
    )
    wait_for(lambda: line.search(k.log_text()), 5, f"the log line of the {asked}")


def stuck_b(start_kiwid, tenants, workdir: Path, **kw: Any):
    """``a`` holds, ``b`` is stuck: its restore failed and left it in host RAM."""
    k, a, b = a_holds_b_waits(start_kiwid, tenants, workdir, tq=1, **kw)
    k.call("sim-fault", {"pid": b.pid, "op": "restore", "fault": "stuck"})
    wait_for(lambda: k.tenant_states().get(b.key) == "stuck", 10, "b to be stuck")
    return k, a, b


def test_a_stuck_tenant_is_shown_explained_and_mended_by_retry(
    start_kiwid, tenants, workdir
) -> None:
    before = time.time()
    k, a, b = stuck_b(start_kiwid, tenants, workdir)
    status = k.status()
    gpu = status["gpus"][0]
    reason = entry(k, b.key)["stuck_reason"]
    assert {k: reason[k] for k in ("operation", "pid", "answer", "contained", "mending")} == {
        "operation": "swap-in",
        "pid": b.pid,
        "answer": "injected: stuck",
        "contained": True,
        "mending": False,
    }, reason
    assert before <= reason["at_unix"] <= time.time()
    assert f"restore of pid {b.pid}" in reason["reason"]
    assert gpu["stuck"] == [b.key] and gpu["blocked_by"] is None
    held = {h["tenant"]: h["waiting_for"] for h in gpu["held_back"]}
    assert held[b.key].startswith("stuck (swap-in): "), held
    assert status["state_file"]["path"] == str(workdir / "state" / "state.json")
    assert status["state_file"]["trouble"] is None
    # The others rotate on: a holds and runs; b stays gated, in host RAM.
    wait_for(lambda: holder(k) == a.key and not a.frozen(), 5, "a to hold and run")
    assert b.frozen() and swapped(workdir, b)

    text = k.ctl("status")
    assert text.returncode == 0, text.stderr
    assert f"stuck    {b.key}: its restore of pid {b.pid} failed with injected: stuck" in (
        text.stdout
    )
    said = k.ctl("explain", b.key)
    assert said.returncode == 0, said.stderr
    assert f"is STUCK: its restore of pid {b.pid} failed with injected: stuck at " in said.stdout
    assert f"`kiwictl retry {b.key}` tries again" in said.stdout
    assert "stays gated and holds nothing while the others rotate" in said.stdout

    refused = k.ctl("retry", a.key)
    assert refused.returncode == 1
    assert f"{a.key} is holder, not stuck: it holds its GPU now" in refused.stderr
    with pytest.raises(ControlError) as err:
        k.call("retry", {"tenant": "cgroup:/nobody"})
    assert err.value.code == "invalid-value" and "no tenant 'cgroup:/nobody'" in err.value.message

    k.call("sim-fault", {"pid": b.pid, "op": "restore", "fault": "none"})
    done = k.ctl("retry", b.key)
    assert done.returncode == 0, (done.stdout, done.stderr, k.log_text())
    assert done.stdout.startswith(f"[INFO] {b.key}: mended; "), done.stdout
    logged(k, "retry", b.key, "mended")
    wait_for(lambda: holder(k) == b.key and not b.frozen(), 10, "b's turn, after the retry")
    assert entry(k, b.key)["stuck_reason"] is None


def test_release_lets_a_stuck_tenant_run_outside_the_rotation_until_a_retry(
    start_kiwid, tenants, workdir
) -> None:
    k, a, b = stuck_b(start_kiwid, tenants, workdir)
    failed = k.ctl("release", b.key)  # its memory cannot come back: the fault holds
    assert failed.returncode == 1, failed.stdout
    assert failed.stderr.startswith(f"[ERROR] {b.key} is still stuck: the operator's release"), (
        failed.stderr
    )
    assert entry(k, b.key)["stuck_reason"]["operation"] == "release"
    assert b.frozen()

    k.call("sim-fault", {"pid": b.pid, "op": "restore", "fault": "none"})
    released = k.ctl("release", b.key)
    assert released.returncode == 0, (released.stderr, k.log_text())
    assert released.stdout.startswith(f"[INFO] {b.key}: released"), released.stdout
    logged(k, "release", b.key, "released")
    wait_for(lambda: not b.frozen(), 5, "b to run ungated")
    assert not swapped(workdir, b)
    me = entry(k, b.key)
    assert (me["state"], me["stuck_reason"]) == ("released", None)
    assert me["released"]
    assert k.status()["gpus"][0]["stuck"] == []
    wait_for(lambda: holder(k) == a.key and not a.frozen(), 5, "a to hold beside it")
    said = k.ctl("explain", b.key).stdout
    assert f"is RELEASED: an operator let it run ungated ({me['released']})" in said
    again = k.ctl("release", b.key)
    assert again.returncode == 1 and "is released already" in again.stderr

    back = k.ctl("retry", b.key)
    assert back.returncode == 0, back.stderr
    assert back.stdout == f"[INFO] {b.key}: back in the rotation; it queues at its next GPU work.\n"
    # Busy, it bursts at once and takes its turns again (gated while a holds).
    wait_for(lambda: b.frozen() or holder(k) == b.key, 10, "b back in the rotation")


def test_a_retry_waits_behind_a_hung_driver_call_and_says_so(start_kiwid, tenants, workdir) -> None:
    # A restore's deadline: twice gpu.driver_timeout plus twice its time at the link's rate.
    timeouts = "[gpu]\ndriver_timeout = 1\ngate_timeout = 1\n"
    (workdir / "kiwi.toml").write_text(swap_config(workdir, tq=1).replace("[gpu]\n", timeouts, 1))
    k = start_kiwid()
    a, b = tenants("a"), tenants("b")
    k.attach(a.pid, memory=4 * GiB)
    wait_for(lambda: holder(k) == a.key, 5, "a to hold the GPU")
    k.attach(b.pid, memory=4 * GiB)
    wait_for(lambda: swapped(workdir, b), 5, "b's memory in host RAM")
    k.call("sim-fault", {"pid": b.pid, "op": "restore", "fault": "hang"})
    wait_for(lambda: k.tenant_states().get(b.key) == "stuck", 15, "b's restore past its deadline")
    reason = entry(k, b.key)["stuck_reason"]
    assert reason["operation"] == "swap-in" and "ran past its deadline" in reason["reason"]

    queued = k.ctl("retry", b.key)
    assert queued.returncode == 1, queued.stdout
    assert f"{b.key}: the retry waits behind its swap-in, whose driver call has not " in (
        queued.stderr
    )
    assert "it runs as soon as that call returns" in queued.stderr
    assert "queued behind its swap-in" in k.log_text()
    again = k.ctl("retry", b.key)  # one at a time: the first is under way
    assert again.returncode == 1 and "under way already" in again.stderr, again.stderr

    k.call("sim-fault", {"pid": b.pid, "op": "restore", "fault": "none"})
    k.wait_log("that ran past its deadline returned after", 10)
    # The hung restore did its work once cleared; the retry, behind it, mends b: it
    # finds it on the card (where it is later depends on the rotation: checkpoint mode
    # sends a waiter's memory to host RAM at once).
    k.wait_log("Mended ", 10)
    assert ": gated, its memory on the card" in k.log_text()
    wait_for(lambda: holder(k) == b.key and not b.frozen(), 10, "b's turn, after the retry")


def test_a_wait_has_no_bound_while_a_restore_waits_for_memory_nobody_kiwid_knows(
    start_kiwid, tenants, workdir
) -> None:
    k, a, b = a_holds_b_waits(start_kiwid, tenants, workdir, tq=2)
    assert all(w["wait_bound_s"] is not None for w in k.status()["gpus"][0]["waiters"])
    # 6 GiB no process shows: once a leaves the 10 GiB card, 4 GiB are free, short
    # of b's 4 GiB plus the 1 GiB reserve, although kiwid's count has room.
    k.call("sim-foreign", {"gpu": 0, "memory_bytes": 6 * GiB})

    def unbounded() -> list[dict[str, Any]]:
        waiters = k.status()["gpus"][0]["waiters"]
        return [w for w in waiters if w["wait_bound_s"] is None and w["wait_bound_reason"]]

    waiter = wait_for(unbounded, 15, "a waiter whose wait bound cannot hold")[0]
    assert "free memory that no tenant kiwid knows holds" in waiter["wait_bound_reason"]
    assert "the driver reports" in waiter["wait_bound_reason"]
    assert "(no wait bound: " in k.ctl("status").stdout
    k.call("sim-foreign", {"gpu": 0, "memory_bytes": 0})

    def bounded() -> bool:
        waiters = k.status()["gpus"][0]["waiters"]
        return bool(waiters) and all(w["wait_bound_s"] is not None for w in waiters)

    wait_for(bounded, 15, "the bounds back once the memory is free")
    assert {a.key, b.key} == set(k.tenant_states())


def test_a_release_behind_a_hung_checkpoint_brings_the_memory_back(
    start_kiwid, tenants, workdir
) -> None:
    # Found by the fault matrix (--sim, checkpoint/hang): a's checkpoint hung past its
    # deadline, the operator released a (it runs), and then the checkpoint finished:
    # a ran with its memory in host RAM and no record, and kiwid dropped it as gone.
    # Now the release waits behind the checkpoint, and brings its memory back.
    timeouts = "[gpu]\ndriver_timeout = 1\ngate_timeout = 1\n"
    (workdir / "kiwi.toml").write_text(swap_config(workdir, tq=1).replace("[gpu]\n", timeouts, 1))
    k = start_kiwid()
    a, b = tenants("a"), tenants("b")
    k.attach(a.pid, memory=4 * GiB)
    wait_for(lambda: holder(k) == a.key, 5, "a to hold the GPU")
    k.call("sim-fault", {"pid": a.pid, "op": "checkpoint", "fault": "hang"})
    k.attach(b.pid, memory=4 * GiB)  # a's turn ends: its memory is to go out
    wait_for(
        lambda: k.tenant_states().get(a.key) == "stuck", 15, "a's checkpoint past its deadline"
    )
    released = k.ctl("release", a.key)
    assert released.returncode == 1, (released.stdout, k.log_text())
    assert "the release waits behind its swap-out" in released.stderr
    k.call("sim-fault", {"pid": a.pid, "op": "checkpoint", "fault": "none"})  # it finishes
    k.wait_log("that ran past its deadline returned after", 10)
    wait_for(lambda: k.tenant_states().get(a.key) == "released", 10, "a released")
    assert not swapped(workdir, a)

    def runs() -> bool:
        return not a.frozen() and k.tenant_states().get(a.key) == "released"

    wait_for(runs, 15, "a to run again")
