"""The driver double's injected faults, through kiwid's own CUDA lock adapter.

A fault is a file ``faults/PID.OP`` in the double's directory (see
``tests/stand_ins/libcuda_standin.c``); ``DriverDouble.fault`` and ``clear`` write
it. Each kind is checked for what the call returns, what it leaves behind and
how long it lasts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kiwid.adapters.cudalock import CudaLock, CudaLockError, ProcessState
from tests.helpers import wait_for
from tests.stand_ins.cudadouble import DriverDouble, Fault

GiB = 2**30


@pytest.fixture
def cuda(cuda_library: Path) -> CudaLock:
    return CudaLock(str(cuda_library))


def code_of(call: Callable[..., object], *args: object) -> tuple[int, str]:
    with pytest.raises(CudaLockError) as caught:
        call(*args)
    return caught.value.code, caught.value.name


class Call(threading.Thread):
    """A driver call on a thread of its own (kiwid makes them from worker threads)."""

    def __init__(self, call: Callable[..., object], *args: object) -> None:
        super().__init__(daemon=True)
        self.call, self.args = call, args
        self.error: CudaLockError | None = None

    def run(self) -> None:
        try:
            self.call(*self.args)
        except CudaLockError as err:
            self.error = err


def test_fail_returns_its_code_as_often_as_told(double: DriverDouble, cuda: CudaLock) -> None:
    pid = double.spawn_tenant(GiB).pid
    double.fault(pid, "lock", "fail", 909, times=2)
    assert code_of(cuda.lock, pid, 100) == (909, "CUDA_ERROR_TIMEOUT")
    assert double.faults() == {f"{pid}.lock": "fail 909 1"}
    assert code_of(cuda.lock, pid, 100) == (909, "CUDA_ERROR_TIMEOUT")
    assert double.faults() == {}, "over at 0"
    assert cuda.state(pid) is ProcessState.RUNNING, "a failed lock changed nothing"
    cuda.lock(pid, 100)
    double.fault(pid, "state", "fail", 999)
    assert code_of(cuda.state, pid) == (999, "CUDA_ERROR_UNKNOWN")
    assert cuda.state(pid) is ProcessState.LOCKED
    with pytest.raises(ValueError, match="CUresult"):
        double.fault(pid, "lock", "fail")
    with pytest.raises(ValueError, match="'wait'"):
        double.fault(pid, "wait", "fail", 1)


def test_oom_fails_a_restore_that_would_fit(double: DriverDouble, cuda: CudaLock) -> None:
    pid = double.spawn_tenant(GiB).pid
    cuda.lock(pid, 100)
    cuda.checkpoint(pid)
    double.fault(pid, "restore", "oom")
    assert code_of(cuda.restore, pid) == (2, "CUDA_ERROR_OUT_OF_MEMORY")
    assert cuda.state(pid) is ProcessState.CHECKPOINTED
    cuda.restore(pid)
    assert cuda.state(pid) is ProcessState.LOCKED


def test_stuck_leaves_it_checkpointed_until_cleared(double: DriverDouble, cuda: CudaLock) -> None:
    # cuda-checkpoint issue 44: the process stays CHECKPOINTED, restores fail with
    # 304 and unlock with 401, until the fault is cleared with "none".
    tenant = double.spawn_tenant(4 * GiB)
    pid = tenant.pid
    cuda.lock(pid, 100)
    cuda.checkpoint(pid)
    double.fault(pid, "restore", "stuck")
    assert code_of(cuda.restore, pid) == (304, "CUDA_ERROR_OPERATING_SYSTEM")
    assert double.faults() == {}, "the fault is spent, the process stays stuck"
    for _ in range(2):
        assert code_of(cuda.restore, pid) == (304, "CUDA_ERROR_OPERATING_SYSTEM")
    assert code_of(cuda.unlock, pid) == (401, "CUDA_ERROR_ILLEGAL_STATE")
    assert cuda.state(pid) is ProcessState.CHECKPOINTED
    assert double.resident_bytes() == 0
    double.clear(pid, "restore")
    cuda.restore(pid)
    cuda.unlock(pid)
    assert cuda.state(pid) is ProcessState.RUNNING
    assert double.faults() == {}


def test_a_stuck_checkpoint_takes_the_memory_off_the_card(
    double: DriverDouble, cuda: CudaLock
) -> None:
    pid = double.spawn_tenant(4 * GiB).pid
    cuda.lock(pid, 100)
    double.fault(pid, "checkpoint", "stuck")
    assert code_of(cuda.checkpoint, pid) == (304, "CUDA_ERROR_OPERATING_SYSTEM")
    assert cuda.state(pid) is ProcessState.CHECKPOINTED
    assert double.resident_bytes() == 0
    assert code_of(cuda.restore, pid)[0] == 304
    double.clear(pid, "checkpoint")  # a "none" for any op un-sticks it
    cuda.restore(pid)
    assert cuda.state(pid) is ProcessState.LOCKED


def test_a_hang_blocks_until_cleared_then_does_its_work(
    double: DriverDouble, cuda: CudaLock, cuda_library: Path
) -> None:
    pid = double.spawn_tenant(GiB).pid
    cuda.lock(pid, 100)
    double.fault(pid, "checkpoint", "hang")
    # From another CudaLock, as from another process: one CudaLock makes one call
    # per process at a time, and this is the double's own semantics.
    call = Call(CudaLock(str(cuda_library)).checkpoint, pid)
    call.start()
    # The call took the fault (its count is spent): it is blocked in the driver.
    wait_for(lambda: double.faults() == {f"{pid}.checkpoint": "hang 0 0"}, 5, "the hang")
    assert call.is_alive()
    assert cuda.state(pid) is ProcessState.LOCKED, "other calls go on"
    cuda.unlock(pid)  # meanwhile; the checkpoint, once let go, finds it RUNNING
    cuda.lock(pid, 100)
    double.clear(pid, "checkpoint")
    call.join(timeout=5)
    assert not call.is_alive(), "the hang ended with its fault"
    assert call.error is None
    assert cuda.state(pid) is ProcessState.CHECKPOINTED
    cuda.restore(pid)  # the next call consumes the "none"
    assert double.faults() == {}


def test_a_timed_hang_ends_by_itself(double: DriverDouble, cuda: CudaLock) -> None:
    pid = double.spawn_tenant(GiB).pid
    double.fault(pid, "lock", "hang", 0.3)
    started = time.monotonic()
    cuda.lock(pid, 0)  # no timeout: waits for the driver as long as it takes
    assert time.monotonic() - started >= 0.3
    assert cuda.state(pid) is ProcessState.LOCKED
    assert double.faults() == {}


def test_a_lock_gives_up_at_its_timeout(double: DriverDouble, cuda: CudaLock) -> None:
    pid = double.spawn_tenant(GiB).pid
    double.fault(pid, "lock", "hang", times=2)
    assert code_of(cuda.lock, pid, 50) == (909, "CUDA_ERROR_TIMEOUT")
    assert cuda.state(pid) is ProcessState.RUNNING
    assert double.faults() == {f"{pid}.lock": "hang 0 1"}
    assert code_of(cuda.lock, pid, 50)[0] == 909
    assert double.faults() == {}
    cuda.lock(pid, 50)


def test_concurrent_hangs_all_end_when_cleared(
    double: DriverDouble, cuda: CudaLock, cuda_library: Path
) -> None:
    tenant = double.spawn_tenant(GiB, processes=2)
    a, b = tenant.pids()
    for pid in (a, b):
        double.fault(pid, "lock", "hang", times=3)
    # Each from a CudaLock of its own, as from processes of their own.
    calls = [Call(CudaLock(str(cuda_library)).lock, pid, 0) for pid in (a, a, b)]
    for call in calls:
        call.start()
    wait_for(
        lambda: double.faults() == {f"{a}.lock": "hang 0 1", f"{b}.lock": "hang 0 2"},
        5,
        "three calls hanging",
    )
    double.clear(a, "lock")
    double.clear(b, "lock")
    for call in calls:
        call.join(timeout=5)
        assert not call.is_alive()
    # Two locks of a: one wins, the other finds it LOCKED.
    assert sorted(str(c.error and c.error.name) for c in calls[:2]) == [
        "CUDA_ERROR_ILLEGAL_STATE",
        "None",
    ]
    assert calls[2].error is None
    assert cuda.state(a) is cuda.state(b) is ProcessState.LOCKED


def test_faults_given_at_the_start_hold_before_the_process_is_listed(
    double: DriverDouble, cuda: CudaLock
) -> None:
    # Written by each process as it creates its context, under the card's lock:
    # whoever sees the process listed sees its faults too (no window to race).
    tenant = double.spawn_tenant(
        GiB // 2,
        processes=2,
        faults=(Fault("lock", "fail", 999, times=3, process=1), Fault("restore", "oom")),
    )
    (child,) = set(tenant.pids()) - {tenant.pid}
    assert double.faults() == {f"{child}.lock": "fail 999 3", f"{tenant.pid}.restore": "oom 1"}
    assert code_of(cuda.lock, child, 100) == (999, "CUDA_ERROR_UNKNOWN")
    cuda.lock(tenant.pid, 100)  # its own faults are for another call
    cuda.unlock(tenant.pid)


@pytest.mark.parametrize(
    "fault", [Fault("resume", "fail", 1), Fault("lock", "fail"), Fault("lock", "hang", times=0)]
)
def test_a_fault_the_double_has_no_meaning_for_is_refused(
    double: DriverDouble, fault: Fault
) -> None:
    with pytest.raises(ValueError, match="fault"):
        double.spawn_tenant(GiB, faults=(fault,))
    assert double.faults() == {}
