"""What the fault matrix (bench/driver_faults.py) found, each on a real kiwid.

A real ``python -m kiwid`` with ``backend = "nvml"``, ``gate = "cuda-lock"`` and
``swap = "checkpoint"`` over the driver double, as in test_driver_faults_e2e.py.
Each test is one finding of the matrix; on kiwid before its fix, it fails.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.daemon.conftest import Card, Kiwid
from tests.daemon.test_driver_double_e2e import TENANT, holder
from tests.daemon.test_driver_faults_e2e import CUDA_ERROR_UNKNOWN, records, recover, start
from tests.stand_ins import cudadir
from tests.stand_ins.cudadouble import CudaTenant, Fault


def frozen(cgroup: Path | None) -> bool:
    assert cgroup is not None
    return "frozen 1" in (cgroup / "cgroup.events").read_text()


def a_holds(start_kiwid, workdir: Path, card: Card, **kw: float) -> tuple[Kiwid, CudaTenant]:
    """kiwid on a card with no foreign memory, and ``a`` holding its GPU."""
    card.double.set_foreign(0)
    k = start(start_kiwid, workdir, card, **kw)
    a = card.arrive("a")
    k.until(lambda: holder(k) == card.key(a), 10, "a to hold the GPU")
    return k, a


def test_a_lock_that_leaves_its_process_checkpointed_keeps_the_tenant_stuck_not_gone(
    start_kiwid, workdir: Path, card: Card
) -> None:
    # A failed lock that left the process CHECKPOINTED (cuda-checkpoint issue 44's
    # kind): NVML no longer lists it, and kiwid dropped the tenant as gone. Nobody
    # could retry it; it stayed checkpointed and locked for good.
    double = card.double
    k, _a = a_holds(start_kiwid, workdir, card)
    b = card.arrive("b", faults=(Fault("lock", "stuck", times=1000),))  # from its start
    (b_pid,) = b.pids()
    key = card.key(b)
    k.until(lambda: k.tenant(key).get("state") == "stuck", 20, "b to be stuck")
    assert double.state(b_pid) == cudadir.CHECKPOINTED
    deadline = time.monotonic() + 3  # several polls that do not list b
    while time.monotonic() < deadline:
        assert k.tenant(key).get("state") == "stuck", f"b was dropped\n{k.log_text()[-3000:]}"
        time.sleep(0.1)
    done = b.progress()
    double.clear(b_pid, "lock")
    out = k.ctl("retry", key)
    assert out.returncode == 0, out.stdout + out.stderr
    k.until(lambda: b.progress() > done, 20, "b to work again")


def test_a_two_process_ungate_that_fails_half_way_is_held_again(
    start_kiwid, workdir: Path, card: Card
) -> None:
    # The first process unlocked, the second refused: the tenant was stuck as
    # "contained" while its first process ran beside the next holder. Now the
    # converge that follows the fault finds it running and locks it again (or,
    # should the lock fail, fences it with the freezer).
    double = card.double
    k, a = a_holds(start_kiwid, workdir, card)
    b = card.arrive("b", TENANT // 2, processes=2)
    first, second = b.pids()
    k.until(lambda: double.state(second) != cudadir.RUNNING, 10, "b to be gated")
    double.fault(second, "unlock", "fail", CUDA_ERROR_UNKNOWN, times=1000)
    key = card.key(b)
    k.until(lambda: k.tenant(key).get("state") == "stuck", 20, "b to be stuck")

    def held() -> bool:
        runs = double.state(first) == cudadir.RUNNING and not frozen(b.cgroup)
        return not runs and (k.tenant(key).get("stuck_reason") or {}).get("contained")

    k.until(held, 10, "b held again: its first process locked (or fenced)")
    assert k.tenant(key)["stuck_reason"]["operation"] == "ungate"
    stalled = b.progress()
    k.until(lambda: holder(k) == card.key(a), 10, "a to hold again")
    time.sleep(1)  # a stretch of a's turn: b's first process must not work in it
    assert b.progress() == stalled
    double.clear(second, "unlock")
    assert k.stop() == 0
    assert not frozen(b.cgroup)
    assert double.state(first) == double.state(second) == cudadir.RUNNING


def test_an_ungate_that_returns_after_its_deadline_keeps_the_fence_it_got_meanwhile(
    start_kiwid, workdir: Path, card: Card
) -> None:
    # The unlock hung past gpu.driver_timeout; kiwid fenced the tenant with the
    # freezer (recorded). Then the unlock returned, and its job dropped the record:
    # the tenant stayed frozen with nothing recorded to thaw it, even after a stop.
    double = card.double
    k, _a = a_holds(start_kiwid, workdir, card, timeout=1)
    b = card.arrive("b")
    (b_pid,) = b.pids()
    k.until(lambda: double.state(b_pid) != cudadir.RUNNING, 10, "b to be gated")
    double.fault(b_pid, "unlock", "hang")  # until cleared
    key = card.key(b)
    k.until(lambda: records(workdir).get(key, {}).get("fenced"), 20, "b fenced")
    double.clear(b_pid, "unlock")  # the hung unlock returns
    k.wait_log("ran past its deadline returned")
    assert records(workdir).get(key, {}).get("fenced"), "the fence's record is gone"
    assert k.stop() == 0
    assert not frozen(b.cgroup), "b left frozen"


def test_a_release_waits_behind_a_hung_checkpoint_and_then_brings_the_memory_back(
    start_kiwid, workdir: Path, card: Card
) -> None:
    # The checkpoint hung past its deadline; the operator released the tenant
    # (restored, unlocked: it runs), beside the hung call. Then the checkpoint
    # returned, refused (the process ran), and its job fenced the tenant: frozen
    # while kiwid said it ran. Now a tenant's jobs run one at a time: the release
    # waits behind the hung call and says so; once the call returns (and moved the
    # memory out), the release brings it back and lets the tenant run.
    double = card.double
    k = start(start_kiwid, workdir, card)
    a = card.arrive("a")
    k.until(lambda: holder(k) == card.key(a), 10, "a to hold the GPU")
    b = card.arrive("b")
    (b_pid,) = b.pids()
    k.until(lambda: double.state(b_pid) == cudadir.CHECKPOINTED, 10, "b in host RAM")
    (a_pid,) = a.pids()
    double.fault(a_pid, "checkpoint", "hang")
    key = card.key(a)
    k.until(lambda: k.tenant(key).get("state") == "stuck", 30, "a to be stuck")
    release = k.ctl("release", key)
    assert release.returncode == 1, release.stdout + release.stderr
    assert "waits behind its swap-out" in release.stderr, release.stderr
    assert k.tenant(key)["state"] == "stuck"
    double.clear(a_pid, "checkpoint")  # the hung call returns (its memory went out)
    k.until(lambda: k.tenant(key).get("state") == "released", 20, "a released")
    assert double.state(a_pid) == cudadir.RUNNING, k.log_text()[-3000:]
    assert not frozen(a.cgroup), f"a fenced after its release\n{k.log_text()[-3000:]}"
    done = a.progress()
    k.until(lambda: a.progress() > done, 10, "a, released, to work")


def test_a_holder_whose_unlock_is_slow_is_not_taken_for_idle(
    start_kiwid, workdir: Path, card: Card
) -> None:
    # An unlock that took 2.3 s, longer than idle_release (0.5 s) and shorter than
    # its deadline: kiwid took the new holder's silence for idleness and let the
    # next one go; when the unlock returned, both ran until the next poll gated one.
    double = card.double
    k, a = a_holds(start_kiwid, workdir, card, tq=5, timeout=10)  # b holds while watched
    b = card.arrive("b")
    (a_pid,), (b_pid,) = a.pids(), b.pids()
    k.until(lambda: double.state(b_pid) != cudadir.RUNNING, 10, "b to be gated")
    double.fault(b_pid, "unlock", "hang")  # until cleared: well within its deadline
    key = card.key(b)
    k.until(lambda: holder(k) == key, 20, "b's turn")
    k.until(lambda: double.state(a_pid) != cudadir.RUNNING, 10, "a gated for b's turn")
    watch = time.monotonic() + 2.0  # four idle_release: b could not run, a must not
    while time.monotonic() < watch:
        assert double.state(a_pid) != cudadir.RUNNING, (
            f"a let go while b's unlock may return\n{k.log_text()[-3000:]}"
        )
        time.sleep(0.02)
    assert holder(k) == key and k.tenant(key)["state"] == "holder"
    done = b.progress()
    double.clear(b_pid, "unlock")  # the unlock returns: b runs its turn
    k.until(lambda: b.progress() > done, 10, "b to work")
    k.until(lambda: holder(k) == card.key(a), 20, "a's turn again")
    mine = a.progress()
    k.until(lambda: a.progress() > mine, 10, "a to work")
    assert double.state(b_pid) != cudadir.RUNNING


def test_a_release_behind_a_hung_gate_undoes_the_lock_it_took_when_it_returns(
    start_kiwid, workdir: Path, card: Card
) -> None:
    # The gate's state call hung past its deadline; kiwid fenced the tenant and the
    # operator released it (it ran, unrecorded). Then the call returned, and the
    # gate went on to lock the released tenant: locked with no record, so neither a
    # stop nor `kiwid recover` ever unlocked it. Now the release waits behind the
    # hung gate; the gate's lock, taken late, is recorded ahead like any, and the
    # release undoes it.
    double = card.double
    # TQ 5 s: b's gate, stuck, is tried again only after the operator's release.
    k, _a = a_holds(start_kiwid, workdir, card, tq=5, timeout=1)
    b = card.arrive("b", faults=(Fault("state", "hang"),))  # b's gate asks first; until cleared
    (b_pid,) = b.pids()
    key = card.key(b)
    k.until(lambda: records(workdir).get(key, {}).get("fenced"), 20, "b fenced")
    assert k.tenant(key)["state"] == "stuck"
    release = k.ctl("release", key)
    assert release.returncode == 1 and "waits behind its gate" in release.stderr, release
    double.clear(b_pid, "state")  # the hung call returns, and the gate locks b
    k.until(lambda: k.tenant(key).get("state") == "released", 20, "b released")
    done = b.progress()
    k.until(lambda: b.progress() > done, 10, "b, released, to work")
    assert double.state(b_pid) == cudadir.RUNNING, k.log_text()[-3000:]
    assert not frozen(b.cgroup)
    k.proc.kill()  # and should anything still hold b, recovery must know it
    k.proc.wait()
    out = recover(workdir, card)
    assert out.returncode == 0, out.stdout + out.stderr
    assert double.state(b_pid) == cudadir.RUNNING
    assert not frozen(b.cgroup)


def test_a_release_that_runs_while_the_gate_comes_due_again_leaves_the_tenant_running(
    start_kiwid, workdir: Path, card: Card
) -> None:
    # Matrix unlock/multi: a two-process tenant whose unlock failed was fenced; the
    # operator's release failed (its first process unlocked, the fence still on:
    # kiwid counts it as free to run, so its gate is tried again a TQ later). The
    # second release ran while that gate came due: the gate, queued behind the
    # release, locked the tenant again once it was released. Locked, it made no
    # progress, and a retry put it "back in the rotation" where it never showed work.
    # Now the converge that follows the failed release holds its first process
    # again at once (no gate to come due), and the second release lets it run.
    double = card.double
    k, _a = a_holds(start_kiwid, workdir, card, tq=2, timeout=5)
    b = card.arrive("b", TENANT // 2, processes=2)
    first, second = b.pids()
    key = card.key(b)
    k.until(lambda: double.state(second) != cudadir.RUNNING, 10, "b to be gated")
    double.fault(second, "unlock", "fail", CUDA_ERROR_UNKNOWN, times=1000)
    k.until(lambda: k.tenant(key).get("state") == "stuck", 30, "b to be stuck")
    failed = k.ctl("release", key)
    assert failed.returncode != 0, failed.stdout + failed.stderr
    k.until(lambda: k.tenant(key)["stuck_reason"]["contained"], 10, "b held again")
    double.fault(second, "unlock", "hang", 3.0)  # (> TQ) the next unlock works, slowly
    release = k.ctl("release", key)
    assert release.returncode == 0, release.stdout + release.stderr
    assert k.tenant(key).get("state") == "released"
    done = b.progress()
    k.until(lambda: b.progress() > done, 10, f"b, released, to work\n{k.log_text()[-3000:]}")
    time.sleep(2 * 2)  # two TQs: nothing of kiwid's comes to gate it again
    assert double.state(first) == double.state(second) == cudadir.RUNNING
    assert not frozen(b.cgroup)
    assert k.tenant(key).get("state") == "released"
