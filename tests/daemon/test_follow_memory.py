"""A swapped-out tenant's new process: locked, then its memory joins the rest in host RAM.

The follow job of the CUDA-lock gate, run as kiwid runs it (``gate_jobs.follow``),
with kiwid's own lock and checkpoint adapters over the driver double, on real
``cuda_tenant.py`` processes. The tenant's first two processes are in host RAM,
as a swap-out left them; the third is the one it started since. Last, the
engine's part: it asks for the move only where the scheduler has the tenant's
memory in host RAM.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from kiwid.adapters.cudalock import CudaLock, ProcessState
from kiwid.core.events import ActivitySeen, TenantAttached, TenantFaulted
from kiwid.core.model import GpuPolicy, Mode, SwapMode
from kiwid.core.residency import Residency
from kiwid.daemon.engine import gate_jobs, swap_jobs
from kiwid.daemon.engine.executor import Job, Kind, Lanes
from kiwid.daemon.engine.tools import Tools
from kiwid.daemon.gating.cudagate import CudaLockGate
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.gating.state import StateFile
from kiwid.daemon.gating.swap import CheckpointSwapper
from kiwid.daemon.tenants.tracker import Identity, TenantInfo
from tests.adapters.conftest import cuda_library, double
from tests.daemon.test_engine_properties import Harness
from tests.daemon.test_gate_faults_e2e import read_only
from tests.stand_ins import cudadir
from tests.stand_ins.cudadouble import DriverDouble, Fault

__all__ = ["cuda_library", "double"]  # the fixtures, shared with the adapter tests

GiB = 2**30
SIZE = GiB // 2
LOCKED, CHECKPOINTED = ProcessState.LOCKED, ProcessState.CHECKPOINTED
KEY = "cgroup:/follow"
GPU = frozenset({"0"})
CUDA_ERROR_OUT_OF_MEMORY = 2
Tenant = set[int]
"""A tenant's processes, as the tracker lists them."""


@pytest.fixture
def tools(double: DriverDouble, tmp_path: Path) -> Tools:
    lock = CudaLock(str(double.library))
    (tmp_path / "state").mkdir()  # apart from the card's directory
    state = StateFile(tmp_path / "state")
    return Tools(CudaLockGate(lock, timeout_s=1), state, CheckpointSwapper(lock))


def lock(tools: Tools) -> CudaLock:
    assert isinstance(tools.gate, CudaLockGate)
    return tools.gate.lock


def swapped_out(double: DriverDouble, tools: Tools, *faults: Fault) -> tuple[Tenant, int]:
    """A tenant's two processes in host RAM, recorded; and a third it started since."""
    tenant = double.spawn_tenant(SIZE, processes=2)
    pids = set(tenant.pids())
    record = tools.gate.prepare(TenantInfo(Identity(KEY, "cgroup", "/follow"), pids))
    record = replace(record, swapped={"0": 2 * SIZE}, swap_method="checkpoint")
    tools.state.put(record)
    tools.gate.gate(record)
    assert tools.swapper is not None
    tools.swapper.swap_out(record)
    assert {lock(tools).state(p) for p in pids} == {CHECKPOINTED}
    third = double.spawn_tenant(SIZE, faults=faults).pid  # what matters: a pid of its own
    return pids | {third}, third


def job(pids: Tenant, third: int, *, memory: bool = True) -> Job:
    info = TenantInfo(Identity(KEY, "cgroup", "/follow"), set(pids), frozenset({"0"}))
    sizes = {"0": SIZE} if memory else {}
    start = cudadir.start_ticks(third) or 0
    return Job(0, KEY, Kind.FOLLOW, frozenset({"0"}), info, SIZE, sizes, {third: start})


def follow(tools: Tools, pids: Tenant, third: int, *, memory: bool = True) -> list:
    return gate_jobs.follow(tools, job(pids, third, memory=memory), swap_jobs.follow_out)


def record(tools: Tools) -> GatedRecord:
    return tools.state.records[KEY]


def test_the_new_process_goes_to_host_ram_and_the_record_counts_it(
    double: DriverDouble, tools: Tools
) -> None:
    tenant, third = swapped_out(double, tools)
    assert follow(tools, tenant, third) == []
    assert lock(tools).state(third) is CHECKPOINTED
    assert third in record(tools).pids  # recover restores and unlocks it with the rest
    assert record(tools).swapped == {"0": 3 * SIZE}
    assert tools.swapper is not None
    assert tools.swapper.placement(record(tools)).where is Residency.HOST


def test_without_sizes_it_is_locked_only(double: DriverDouble, tools: Tools) -> None:
    # The scheduler has the tenant's memory on the card: theirs stays there too.
    tenant, third = swapped_out(double, tools)
    assert follow(tools, tenant, third, memory=False) == []
    assert lock(tools).state(third) is LOCKED
    assert record(tools).swapped == {"0": 2 * SIZE}


def test_a_checkpoint_that_fails_leaves_it_locked_on_the_card_and_the_tenant_waiting(
    double: DriverDouble, tools: Tools
) -> None:
    oom = Fault("checkpoint", "fail", CUDA_ERROR_OUT_OF_MEMORY, times=10, process=0)
    tenant, third = swapped_out(double, tools, oom)
    assert follow(tools, tenant, third) == []  # not stuck: its restore brings the rest
    assert lock(tools).state(third) is LOCKED
    assert record(tools).swapped == {"0": 2 * SIZE}, "its bytes were never moved"
    assert third in record(tools).pids


def test_a_checkpoint_that_leaves_it_out_of_step_makes_the_tenant_stuck(
    double: DriverDouble, tools: Tools
) -> None:
    # It fails, and leaves the process checkpointed for good (cuda-checkpoint issue
    # 44's kind): memory where the call said it is not.
    stuck = Fault("checkpoint", "stuck", times=10, process=0)
    tenant, third = swapped_out(double, tools, stuck)
    (fault,) = follow(tools, tenant, third)
    assert isinstance(fault, TenantFaulted)
    assert fault.operation == "swap-out" and fault.pid == third
    assert not fault.answers, "no swap-out was asked for: it answers none"
    assert record(tools).swapped == {"0": 3 * SIZE}, "kept: recover restores it"
    double.clear(third, "checkpoint")


def test_a_follow_given_up_on_during_its_lock_moves_nothing(
    double: DriverDouble, tools: Tools
) -> None:
    tenant, third = swapped_out(double, tools)
    given_up = threading.Event()
    real_lock = lock(tools).lock

    def lock_then_give_up(pid: int, timeout_ms: int) -> None:
        real_lock(pid, timeout_ms)
        given_up.set()  # the deadline passes while the lock runs

    lock(tools).lock = lock_then_give_up  # type: ignore[method-assign]
    following = replace(job(tenant, third), given_up=given_up)
    assert gate_jobs.follow(tools, following, swap_jobs.follow_out) == []
    lock(tools).lock = real_lock  # type: ignore[method-assign]
    assert lock(tools).state(third) is LOCKED  # kiwid deals with the tenant since
    assert record(tools).swapped == {"0": 2 * SIZE}


def test_a_record_changed_meanwhile_is_not_written_over(double: DriverDouble, tools: Tools) -> None:
    tenant, third = swapped_out(double, tools)
    stale = record(tools)
    tools.state.put(replace(stale, fenced=True))  # a fence, say, since the job read it
    lock(tools).lock(third, 1000)
    assert (
        swap_jobs.follow_out(tools, job(tenant, third), stale.with_pids({third: 0}), (third,)) == []
    )
    assert lock(tools).state(third) is LOCKED
    assert record(tools) == replace(stale, fenced=True)
    lock(tools).unlock(third)


def test_a_state_file_that_cannot_be_written_moves_nothing(
    double: DriverDouble, tools: Tools, tmp_path: Path
) -> None:
    # Unrecorded, a checkpoint would leave memory in host RAM that neither a restart
    # nor `kiwid recover` knows of: the new process stays on the card, locked.
    tenant, third = swapped_out(double, tools)
    real_lock = lock(tools).lock
    with contextlib.ExitStack() as stack:

        def lock_then_lose_the_state_dir(pid: int, timeout_ms: int) -> None:
            real_lock(pid, timeout_ms)
            stack.enter_context(read_only(tmp_path / "state"))  # /run turns read-only (or full)

        lock(tools).lock = lock_then_lose_the_state_dir  # type: ignore[method-assign]
        assert follow(tools, tenant, third) == []
        lock(tools).lock = real_lock  # type: ignore[method-assign]
        assert lock(tools).state(third) is LOCKED
    assert record(tools).swapped == {"0": 2 * SIZE}
    assert third in record(tools).pids


@pytest.mark.parametrize("swap", [SwapMode.CHECKPOINT, SwapMode.NONE])
def test_the_engine_moves_theirs_only_where_the_scheduler_has_the_tenant_in_host_ram(
    swap: SwapMode,
) -> None:
    policy = GpuPolicy(
        tq_s=300, idle_release_s=300, mode=Mode.EXCLUSIVE, capacity_bytes=40 * GiB,
        reserve_bytes=GiB, swap=swap,
    )  # fmt: skip
    h = Harness({"0": policy}, ["ok"], Lanes())
    try:
        for tenant in ("t0", "t1"):  # t0 holds; t1 waits, gated (and swapped out)
            h.feed(TenantAttached(tenant, GPU))
            h.feed(ActivitySeen(tenant))
            h.drain([0])
        in_host = swap is SwapMode.CHECKPOINT
        expected = Residency.HOST if in_host else Residency.RESIDENT
        assert h.engine.scheduler.residency("t1") is expected
        h.engine.follow("t1", {4242: 0})
        (job,) = [j for j in h.runner.pending if j.kind is Kind.FOLLOW]
        assert bool(job.sizes) is in_host
    finally:
        h.close()
