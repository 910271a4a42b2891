"""A gate whose driver call returned after kiwid gave up on it, on the driver double.

kiwid gives up on a job past its deadline and deals with its tenant since (a fence,
an operator's release, its next turn). The job's call may still return: a gate
given up on locks nothing more, and a lock that was in flight and took late is
settled, recorded where kiwid holds the tenant, undone where kiwid lets it run;
never left locked with no record, where neither a stop nor ``kiwid recover`` would
find it. The tenants are real ``cuda_tenant.py`` processes; the lock is kiwid's own
adapter over the stand-in libcuda.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest

from kiwid.adapters.cudalock import CudaLock, ProcessState
from kiwid.core.events import TenantFaulted
from kiwid.daemon.engine import gate_jobs
from kiwid.daemon.engine.executor import Job, Kind
from kiwid.daemon.engine.tools import Tools
from kiwid.daemon.gating import recovery
from kiwid.daemon.gating.cudagate import CudaLockGate
from kiwid.daemon.gating.gates import GateError
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.gating.state import StateFile
from kiwid.daemon.gating.swap import CheckpointSwapper
from kiwid.daemon.tenants.tracker import Identity, TenantInfo
from tests.adapters.conftest import cuda_library, double
from tests.stand_ins.cudadouble import CudaTenant, DriverDouble

__all__ = ["cuda_library", "double"]  # the fixtures, shared with the adapter tests

GiB = 2**30
RUNNING, LOCKED = ProcessState.RUNNING, ProcessState.LOCKED
CHECKPOINTED = ProcessState.CHECKPOINTED
KEY = "cgroup:/late"


@pytest.fixture
def tools(double: DriverDouble, tmp_path: Path) -> Tools:
    return Tools(CudaLockGate(CudaLock(str(double.library)), timeout_s=1), StateFile(tmp_path))


def info_of(tenant: CudaTenant) -> TenantInfo:
    return TenantInfo(Identity(KEY, "cgroup", "/late"), set(tenant.pids()), frozenset({"0"}))


def settle(tools: Tools, tenant: CudaTenant, *, hold: bool) -> list:
    job = Job(0, KEY, Kind.SETTLE, frozenset({"0"}), info_of(tenant))
    if hold:  # kiwid holds the tenant gated as the settle starts
        job.hold.set()
    return gate_jobs.settle(tools, job)


def lock(tools: Tools) -> CudaLock:
    assert isinstance(tools.gate, CudaLockGate)
    return tools.gate.lock


def test_a_late_lock_on_a_tenant_kiwid_lets_run_is_undone(
    double: DriverDouble, tools: Tools
) -> None:
    tenant = double.spawn_tenant(GiB)
    lock(tools).lock(tenant.pid, 1000)  # what the late call did
    assert settle(tools, tenant, hold=False) == []
    assert lock(tools).state(tenant.pid) is RUNNING
    assert KEY not in tools.state.records


def test_a_late_lock_on_a_tenant_kiwid_holds_is_recorded_beside_what_is(
    double: DriverDouble, tools: Tools
) -> None:
    tenant = double.spawn_tenant(GiB, processes=2)
    first, second = tenant.pids()
    info = info_of(tenant)
    recorded = tools.gate.prepare(info)
    kept = replace(recorded, pids=(first,), starts=recorded.starts[:1])
    tools.state.put(kept)
    for pid in (first, second):
        lock(tools).lock(pid, 1000)
    assert settle(tools, tenant, hold=True) == []
    record = tools.state.records[KEY]
    assert record.pids == (first, second)  # the late lock is named: recover undoes it
    assert record.starts == recorded.starts
    assert lock(tools).state(second) is LOCKED  # kiwid holds it gated: it stays


def test_a_late_lock_with_no_record_on_a_held_tenant_gets_one(
    double: DriverDouble, tools: Tools
) -> None:
    tenant = double.spawn_tenant(GiB)
    lock(tools).lock(tenant.pid, 1000)
    assert settle(tools, tenant, hold=True) == []
    assert tools.state.records[KEY].pids == (tenant.pid,)
    assert lock(tools).state(tenant.pid) is LOCKED


def test_a_late_lock_that_will_not_undo_is_stuck_and_stays_recorded(
    double: DriverDouble, tools: Tools
) -> None:
    tenant = double.spawn_tenant(GiB)
    lock(tools).lock(tenant.pid, 1000)
    double.fault(tenant.pid, "unlock", "fail", 999, times=1000)
    (fault,) = settle(tools, tenant, hold=False)
    assert isinstance(fault, TenantFaulted)
    assert fault.operation == "ungate" and fault.pid == tenant.pid
    assert not fault.contained  # no fence here: it may run, kiwid says so
    assert tools.state.records[KEY].pids == (tenant.pid,)  # so recover finds the lock
    double.clear(tenant.pid, "unlock")


def test_nothing_locked_late_is_nothing_to_settle(double: DriverDouble, tools: Tools) -> None:
    tenant = double.spawn_tenant(GiB)
    assert settle(tools, tenant, hold=False) == settle(tools, tenant, hold=True) == []
    assert KEY not in tools.state.records
    assert lock(tools).state(tenant.pid) is RUNNING


def test_a_gate_given_up_on_locks_nothing_more_and_undoes_nothing(
    double: DriverDouble, tools: Tools
) -> None:
    tenant = double.spawn_tenant(GiB, processes=2)
    first, second = tenant.pids()
    record = tools.gate.prepare(info_of(tenant))
    given_up = threading.Event()
    real_lock = lock(tools).lock

    def lock_then_give_up(pid: int, timeout_ms: int) -> None:
        real_lock(pid, timeout_ms)
        given_up.set()  # the deadline passes while the first lock runs

    lock(tools).lock = lock_then_give_up  # type: ignore[method-assign]
    with pytest.raises(GateError, match="gave up"):
        tools.gate.gate(record, given_up.is_set)
    assert lock(tools).state(first) is LOCKED  # kiwid fenced it since: left to it
    assert lock(tools).state(second) is RUNNING  # never locked after the give-up
    lock(tools).lock = real_lock  # type: ignore[method-assign]
    lock(tools).unlock(first)


@pytest.mark.parametrize("give_up", [False, True])
def test_a_lock_that_fails_after_the_give_up_undoes_none_of_the_others(
    double: DriverDouble, tools: Tools, give_up: bool
) -> None:
    # Before the give-up, a failed lock unlocks the ones it took (the gate leaves
    # the tenant running); after it, kiwid has fenced and recorded them: they stay.
    tenant = double.spawn_tenant(GiB, processes=2)
    first, second = tenant.pids()
    double.fault(second, "lock", "fail", 999)
    given_up = threading.Event()
    real_lock = lock(tools).lock

    def lock_then_fail(pid: int, timeout_ms: int) -> None:
        if pid == second and give_up:
            given_up.set()  # the deadline passes during the failing call
        real_lock(pid, timeout_ms)

    lock(tools).lock = lock_then_fail  # type: ignore[method-assign]
    try:
        with pytest.raises(GateError, match=f"pid {second}"):
            tools.gate.gate(tools.gate.prepare(info_of(tenant)), given_up.is_set)
    finally:
        lock(tools).lock = real_lock  # type: ignore[method-assign]
    assert lock(tools).state(first) is (LOCKED if give_up else RUNNING)
    assert lock(tools).state(second) is RUNNING
    if give_up:
        lock(tools).unlock(first)


def test_a_release_given_up_on_during_its_restore_unlocks_nothing(
    double: DriverDouble, tools: Tools
) -> None:
    # The restore of an operator's release returned after kiwid gave up on it (and
    # fenced the tenant): the release went on and unlocked it behind kiwid's back.
    tenant = double.spawn_tenant(GiB)
    (pid,) = tenant.pids()
    record = tools.gate.prepare(info_of(tenant))
    tools.gate.gate(record)
    lock(tools).checkpoint(pid)
    away = replace(record, swapped={"0": GiB}, swap_method="checkpoint")
    swapper = CheckpointSwapper(lock(tools))
    given_up = threading.Event()

    def restore_past_the_deadline(record: GatedRecord) -> None:
        swapper.swap_in(record)
        given_up.set()  # the deadline passed while the restore ran

    undo = recovery.Undo(tools.gate.ungate, restore_past_the_deadline)
    try:
        why = recovery.release(away, undo, cancelled=given_up.is_set)
        assert why is not None and "gave up" in why, why
        assert lock(tools).state(pid) is LOCKED  # restored, held: kiwid deals with it
    finally:
        if lock(tools).state(pid) is CHECKPOINTED:
            lock(tools).restore(pid)
        if lock(tools).state(pid) is LOCKED:
            lock(tools).unlock(pid)
