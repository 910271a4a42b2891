"""Driver faults against a real kiwid on the driver double (issue 17).

A real ``python -m kiwid`` with ``backend = "nvml"``, ``gate = "cuda-lock"`` and
``swap = "checkpoint"`` over the stand-in ``libcuda.so.1``; the faults are the
double's (``DriverDouble.fault``), injected per process and per call, as a real
driver's come: a call that fails, hangs, or leaves the process checkpointed for
good (NVIDIA/cuda-checkpoint issue 44). Each test is one finding of the issue:
on kiwid before the fix, it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from tests.daemon.conftest import DOUBLE_FOREIGN, KIWID, Card, Kiwid
from tests.daemon.test_driver_double_e2e import TENANT, config, holder
from tests.stand_ins import cudadir
from tests.stand_ins.cudadouble import Fault

CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_UNKNOWN = 999


def start(start_kiwid, workdir: Path, card: Card, tq: float = 1, timeout: float = 2) -> Kiwid:
    text = config(workdir, tq=tq).replace(
        'gate = "cuda-lock"', f'gate = "cuda-lock"\ndriver_timeout = {timeout}'
    )
    (workdir / "kiwi.toml").write_text(text)
    k = start_kiwid(env=card.double.env())
    k.wait_log("Gate: the CUDA driver's process lock")
    return k


def running_tenants(card: Card, tenants: dict) -> list[str]:
    procs = card.double.processes()
    return [
        name
        for name, t in tenants.items()
        if any(procs.get(pid) and procs[pid].state == cudadir.RUNNING for pid in t.pids())
    ]


def records(workdir: Path) -> dict[str, dict]:
    """The state file's records, by tenant (none before its first write)."""
    path = workdir / "state" / "state.json"
    return json.loads(path.read_text())["gated"] if path.exists() else {}


def recover(workdir: Path, card: Card) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KIWID, "recover", "--state-dir", str(workdir / "state")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **card.double.env()},
    )


def test_a_swap_out_whose_rollback_fails_keeps_the_host_copy_and_recover_brings_it_back(
    start_kiwid, workdir: Path, card: Card
) -> None:
    # Item 1: a two-process tenant; its second checkpoint runs out of memory, and the
    # restore of the first (the rollback) fails too. Before: the record forgot the
    # host copy, the tenant stayed locked for good, and recover could not help.
    double = card.double
    k = start(start_kiwid, workdir, card)
    a = card.arrive("a")
    k.until(lambda: holder(k) == card.key(a), 10, "a to hold the GPU")
    # The faults hold from b's start: set after it, kiwid could swap b out first
    # (then b's swap-in is what fails: CI saw it once).
    b = card.arrive(
        "b",
        TENANT // 2,
        processes=2,
        faults=(
            Fault("checkpoint", "fail", CUDA_ERROR_OUT_OF_MEMORY, times=100, process=1),
            Fault("restore", "fail", CUDA_ERROR_UNKNOWN, times=100, process=0),
        ),
    )
    first = b.pid
    (second,) = set(b.pids()) - {first}
    key = card.key(b)
    k.until(lambda: k.tenant(key).get("state") == "stuck", 15, "b to be stuck")
    entry = k.tenant(key)
    reason = entry["stuck_reason"]
    assert reason["operation"] == "swap-out", f"{reason}\n{k.log_text()[-3000:]}"
    assert str(second) in reason["reason"] and "CUDA_ERROR_OUT_OF_MEMORY" in reason["reason"]
    assert entry["residency"] == "unknown" and entry["gated"], entry
    assert double.state(first) == cudadir.CHECKPOINTED  # split: half in host RAM
    record = (workdir / "state" / "state.json").read_text()
    assert '"swapped": {' in record, "the host copy stays recorded"
    # The others rotate on while b is stuck; b never runs.
    c = card.arrive("c")
    (c_pid,) = c.pids()
    k.until(lambda: double.state(c_pid) != cudadir.RUNNING, 10, "c, new, to be gated")
    deadline = time.monotonic() + 6
    turns: set[str] = set()
    while time.monotonic() < deadline:
        now = running_tenants(card, {"a": a, "b": b, "c": c})
        assert "b" not in now and len(now) <= 1, now
        turns |= set(now)
        time.sleep(0.05)
    assert turns == {"a", "c"}, turns
    # kiwid dies; the driver mends; recover brings the host copy back and unlocks.
    k.proc.kill()
    k.proc.wait()
    double.clear(first, "restore")
    double.clear(second, "checkpoint")
    double.set_foreign(0)
    out = recover(workdir, card)
    assert out.returncode == 0, out.stderr
    assert double.state(first) == double.state(second) == cudadir.RUNNING


def test_a_holder_whose_lock_hangs_is_fenced_and_the_others_rotate(
    start_kiwid, workdir: Path, card: Card
) -> None:
    # Item 5: no driver call had a deadline. A lock that blocks: before, the scheduler
    # granted turns (7/6/6) while only the first tenant ever ran in the driver.
    double = card.double
    k = start(start_kiwid, workdir, card)
    tenants = {"a": card.arrive("a")}
    k.until(lambda: holder(k) == card.key(tenants["a"]), 10, "a to hold the GPU")
    (a_pid,) = tenants["a"].pids()
    double.fault(a_pid, "lock", "hang")  # until cleared
    tenants["b"] = card.arrive("b")
    tenants["c"] = card.arrive("c")
    key = card.key(tenants["a"])
    k.until(lambda: k.tenant(key).get("state") == "stuck", 20, "a to be stuck")
    assert k.tenant(key)["stuck_reason"]["operation"] == "gate"
    k.until(lambda: (k.tenant(key).get("stuck_reason") or {}).get("contained"), 10, "a fenced")
    # Fenced (frozen): a makes no progress; b and c take turns, one at a time.
    stalled = tenants["a"].progress()
    progress = {n: tenants[n].progress() for n in ("b", "c")}
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        now = [n for n in running_tenants(card, tenants) if n != "a"]
        assert len(now) <= 1, now
        time.sleep(0.05)
    assert tenants["a"].progress() == stalled
    for n in ("b", "c"):
        assert tenants[n].progress() > progress[n], f"{n} got no turn while a was stuck"
    # The operator clears the driver, and retries: a takes turns again.
    double.clear(a_pid, "lock")
    done = k.ctl("retry", key)
    assert done.returncode == 0, done.stdout + done.stderr
    k.until(lambda: tenants["a"].progress() > stalled, 20, "a to work again")


def test_a_checkpoint_that_hangs_makes_its_tenant_stuck_not_everyone_idle(
    start_kiwid, workdir: Path, card: Card
) -> None:
    # Item 5: a checkpoint that blocks left nobody running for 90 % of the time.
    double = card.double
    k = start(start_kiwid, workdir, card)
    tenants = {"a": card.arrive("a")}
    k.until(lambda: holder(k) == card.key(tenants["a"]), 10, "a to hold the GPU")
    tenants["b"] = card.arrive("b")
    (b_pid,) = tenants["b"].pids()
    k.until(lambda: double.state(b_pid) == cudadir.CHECKPOINTED, 10, "b in host RAM")
    (a_pid,) = tenants["a"].pids()
    double.fault(a_pid, "checkpoint", "hang")
    key = card.key(tenants["a"])
    k.until(lambda: k.tenant(key).get("state") == "stuck", 30, "a to be stuck")
    assert k.tenant(key)["stuck_reason"]["operation"] == "swap-out"
    # b runs on; a never does.
    before = tenants["b"].progress()
    k.until(lambda: tenants["b"].progress() > before, 20, "b to run")
    assert "a" not in running_tenants(card, tenants)
    double.clear(a_pid, "checkpoint")  # the operator mends the driver: the call returns
    k.wait_log("that ran past its deadline returned", 20)
    release = k.ctl("release", key)
    assert release.returncode == 0, release.stdout + release.stderr
    assert k.tenant(key)["state"] == "released"


def test_an_ungate_the_driver_refuses_makes_the_tenant_stuck_not_the_holder(
    start_kiwid, workdir: Path, card: Card
) -> None:
    # Item 2: a failed ungate was dropped; status showed the tenant holding while
    # it stayed locked, and its quantum was counted.
    double = card.double
    double.set_foreign(0)
    k = start(start_kiwid, workdir, card)
    a = card.arrive("a")
    k.until(lambda: holder(k) == card.key(a), 10, "a to hold the GPU")
    b = card.arrive("b")
    (b_pid,) = b.pids()
    k.until(lambda: double.state(b_pid) != cudadir.RUNNING, 10, "b to be gated")
    double.fault(b_pid, "unlock", "fail", CUDA_ERROR_UNKNOWN, times=1000)
    key = card.key(b)
    k.until(lambda: k.tenant(key).get("state") == "stuck", 20, "b to be stuck")
    entry = k.tenant(key)
    assert entry["stuck_reason"]["operation"] == "ungate", entry
    assert "CUDA_ERROR_UNKNOWN" in (entry["stuck_reason"]["answer"] or ""), entry
    assert holder(k) != key
    quanta = entry["ledger"]["quanta"]
    k.until(lambda: holder(k) == card.key(a), 10, "a to hold again")
    assert k.tenant(key)["ledger"]["quanta"] == quanta, "no quantum counted while stuck"
    double.clear(b_pid, "unlock")


def test_a_waiting_tenants_new_process_is_locked_and_follows_it_to_host_ram(
    start_kiwid, workdir: Path, card: Card
) -> None:
    # Item 6: the CUDA-lock gate locked only the pids it saw when gating; a process a
    # gated tenant started later ran unlocked beside the holder. Locked, it kept its
    # memory on the card while the rest of its tenant was in host RAM: room the
    # holder counts on (and CI saw a swap-in fail on such a split).
    double = card.double
    (workdir / "kiwi.toml").write_text(config(workdir, tq=30))
    k = start_kiwid(env=double.env())
    k.wait_log("Gate: the CUDA driver's process lock")
    b = card.arrive("b")
    k.until(lambda: holder(k) == card.key(b), 10, "b to hold the GPU")
    # Two processes now, a third (a new context) 3 s after the start.
    a = card.arrive("a", TENANT // 2, processes=2, spawn_later=3)
    first = a.pids()
    k.until(lambda: k.tenant_states().get(card.key(a)) == "waiting", 10, "a to wait")
    k.until(lambda: double.state(first[0]) == cudadir.CHECKPOINTED, 10, "a in host RAM")
    k.until(lambda: len(a.pids()) == 3, 10, "a's new process")
    assert holder(k) == card.key(b), "a got its turn before its new process came"
    (newcomer,) = set(a.pids()) - set(first)

    def running() -> list[int]:
        return [p for p in a.pids() if double.state(p) == cudadir.RUNNING]

    k.until(lambda: not running(), 5, "a's new process to be locked")
    assert holder(k) == card.key(b)
    k.until(
        lambda: double.state(newcomer) == cudadir.CHECKPOINTED,
        10,
        f"a's new process to join the rest in host RAM\n{k.log_text()[-2000:]}",
    )
    swapped = records(workdir)[card.key(a)]["swapped"]
    assert swapped == {"0": 3 * (TENANT // 2)}, "the state file counts it with the rest"
    assert not running(), f"a's processes {running()} run while a waits"
    # a's turn: all of it comes back, and all three processes work.
    assert k.ctl("-T", "1").returncode == 0
    k.until(lambda: holder(k) == card.key(a), 40, "a's turn")

    def done() -> dict[int, int]:
        return {p: cudadir.read_progress(double.directory, p)[0] for p in a.pids()}

    before = done()
    k.until(lambda: all(n > before[p] for p, n in done().items()), 10, "a's three to work")
    assert DOUBLE_FOREIGN  # the card is oversubscribed as the fixture says
