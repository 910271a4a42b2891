"""The follow, the converge and the fence, on the driver double.

Run as kiwid runs them (``side_jobs.follow``, ``converge_jobs.converge``,
``side_jobs.fence``), with kiwid's own lock and checkpoint adapters over the
stand-in libcuda, on real ``cuda_tenant.py`` processes in real cgroups:

* a process with no CUDA context when its tenant is gated is not locked, nor
  named in the record, and stays to lock: the follow locks it once it has one;
* a process a swapped-out tenant started since is on the card: the follow says
  so, and the converge moves it to host RAM with the rest, counting its bytes
  (its footprint, or the tenant's size: never 0);
* a converge drives the truth to what the core wants: a lock taken late undone, a
  checkpoint that ended late brought back, a process that will not lock fenced;
* a fence is written again even where the record says so already, so that an
  unlock returning late does not thaw it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kiwid.adapters.cgroups import CgroupLayout
from kiwid.adapters.cudalock import CudaLock, ProcessState
from kiwid.core.actions import Want
from kiwid.core.events import Converged, Gated, MemorySplit, SwapFinished, TenantFaulted, Ungated
from kiwid.core.model import Fault
from kiwid.core.residency import Residency
from kiwid.daemon.engine import converge_jobs, gate_jobs, side_jobs, swap_jobs
from kiwid.daemon.engine.executor import Job, Kind
from kiwid.daemon.engine.tools import SwapGuards, Tools
from kiwid.daemon.gating.cudagate import CudaLockGate
from kiwid.daemon.gating.gates import FreezeGate
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.gating.state import StateFile
from kiwid.daemon.gating.swap import CheckpointSwapper, restore_checkpointed
from kiwid.daemon.tenants.tracker import Identity, TenantInfo
from tests.adapters.conftest import cuda_library, double
from tests.helpers import wait_for
from tests.stand_ins import cudadir
from tests.stand_ins.cudadouble import CudaTenant, DriverDouble
from tests.stand_ins.cudadouble import Fault as DriverFault

__all__ = ["cuda_library", "double"]  # the fixtures, shared with the adapter tests

GiB = 2**30
SIZE = GiB // 2
RUNNING, LOCKED = ProcessState.RUNNING, ProcessState.LOCKED
CHECKPOINTED = ProcessState.CHECKPOINTED
KEY = "cgroup:/follow"
GPU = frozenset({"0"})
CUDA_ERROR_UNKNOWN = 999
V2_ROOT = Path("/sys/fs/cgroup/unified") if Path("/sys/fs/cgroup/unified").is_dir() else None


@pytest.fixture
def cgroup() -> Iterator[Path]:
    """A v2 cgroup of the test's own (the fence freezes it); emptied and removed after."""
    root = V2_ROOT or Path("/sys/fs/cgroup")
    path = root / f"kiwi-test-follow-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            (path / "cgroup.freeze").write_text("0")
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        wait_for(lambda: "populated 0" in (path / "cgroup.events").read_text(), 5, "it empty")
        path.rmdir()


@pytest.fixture
def tools(double: DriverDouble, tmp_path: Path) -> Tools:
    lock = CudaLock(str(double.library))
    (tmp_path / "state").mkdir()  # apart from the card's directory
    fence = FreezeGate(CgroupLayout.detect())
    guards = SwapGuards(pid_bytes=lambda pid: {"0": SIZE})  # as NVML listed it
    return Tools(
        CudaLockGate(lock, timeout_s=1, fence=fence),
        StateFile(tmp_path / "state"),
        CheckpointSwapper(lock),
        guards,
    )


def lock(tools: Tools) -> CudaLock:
    assert isinstance(tools.gate, CudaLockGate)
    return tools.gate.lock


def info(cgroup: Path, *pids: int) -> TenantInfo:
    root = V2_ROOT or Path("/sys/fs/cgroup")
    ident = Identity(KEY, "cgroup", "/follow", f"/{cgroup.relative_to(root)}", None, True)
    return TenantInfo(ident, set(pids), GPU)


def job(kind: Kind, tenant: TenantInfo, want: Want | None = None, epoch: int = 7) -> Job:
    pids = {pid: cudadir.start_ticks(pid) or 0 for pid in tenant.pids}
    return Job(0, KEY, kind, GPU, epoch, tenant, pids=pids, want=want)


def want(*, gated: bool, memory: Residency | None, fault: Fault | None = None) -> Want:
    return Want(KEY, 7, gated, memory, {"0": 3 * GiB}, fault)


def record(tools: Tools) -> GatedRecord:
    return tools.state.records[KEY]


def spawn(double: DriverDouble, cgroup: Path, **kw: object) -> CudaTenant:
    return double.spawn_tenant(SIZE, cgroup=cgroup, **kw)  # type: ignore[arg-type]


def test_a_tenant_held_before_its_first_cuda_call_is_frozen_until_its_turn(
    double: DriverDouble, tools: Tools, cgroup: Path, tmp_path: Path
) -> None:
    # A container held at admission, before its first CUDA call: the lock answers
    # NOT_INITIALIZED, and holds nothing of it. It was recorded as gated, and ran
    # free: its first context ran beside the holder for its whole wait. Now the
    # freezer holds it (recorded as a fence, which its let-go thaws); the record
    # names no process as locked.
    first_call = tmp_path / "first-cuda-call"
    tenant = spawn(double, cgroup, context_when=first_call)
    held = info(cgroup, tenant.pid)
    assert gate_jobs.gate(tools, job(Kind.GATE, held)) == [Gated(KEY, epoch=7)]
    assert record(tools).pids == (), "named as locked, yet not locked"
    assert record(tools).fenced and "frozen 1" in (cgroup / "cgroup.events").read_text()
    first_call.touch()  # it would make its first CUDA call now: frozen, it cannot
    following = want(gated=True, memory=Residency.RESIDENT)
    assert side_jobs.follow(tools, job(Kind.FOLLOW, held, following)) == []
    assert double.state(tenant.pid) is None
    assert gate_jobs.ungate(tools, job(Kind.UNGATE, held)) == [Ungated(KEY, epoch=7)]
    assert "frozen 0" in (cgroup / "cgroup.events").read_text()
    wait_for(lambda: double.state(tenant.pid) == cudadir.RUNNING, 5, "its context, at its turn")


def test_without_a_freezer_a_first_context_is_locked_by_the_next_follow(
    double: DriverDouble, tools: Tools, cgroup: Path, tmp_path: Path
) -> None:
    tools.gate = CudaLockGate(lock(tools), timeout_s=1)  # no fence here
    first_call = tmp_path / "first-cuda-call"
    tenant = spawn(double, cgroup, context_when=first_call)
    held = info(cgroup, tenant.pid)
    assert gate_jobs.gate(tools, job(Kind.GATE, held)) == [Gated(KEY, epoch=7)]
    assert record(tools).pids == ()
    following = want(gated=True, memory=Residency.RESIDENT)
    assert side_jobs.follow(tools, job(Kind.FOLLOW, held, following)) == []  # still to lock
    first_call.touch()  # its first CUDA call: a context, RUNNING
    wait_for(lambda: double.state(tenant.pid) == cudadir.RUNNING, 5, "its context")
    assert side_jobs.follow(tools, job(Kind.FOLLOW, held, following)) == []
    assert lock(tools).state(tenant.pid) is LOCKED
    assert record(tools).pids == (tenant.pid,)  # recorded ahead of its lock


def swapped_out(double: DriverDouble, tools: Tools, cgroup: Path) -> tuple[TenantInfo, int]:
    """A tenant's process in host RAM, recorded; and a second it started since, running."""
    first = spawn(double, cgroup)
    held = info(cgroup, first.pid)
    gate_jobs.gate(tools, job(Kind.GATE, held))
    ahead = tools.state.put(replace(record(tools), swapped={"0": SIZE}, swap_method="checkpoint"))
    assert ahead is not None and tools.swapper is not None
    tools.swapper.swap_out(ahead)
    assert lock(tools).state(first.pid) is CHECKPOINTED
    second = spawn(double, cgroup).pid
    return info(cgroup, first.pid, second), second


def test_a_swapped_out_tenants_new_process_goes_to_host_ram_and_is_counted(
    double: DriverDouble, tools: Tools, cgroup: Path
) -> None:
    held, second = swapped_out(double, tools, cgroup)
    in_host = want(gated=True, memory=Residency.HOST)
    split = side_jobs.follow(tools, job(Kind.FOLLOW, held, in_host))
    assert split == [MemorySplit(KEY, (second,), epoch=7)]
    assert lock(tools).state(second) is LOCKED  # locked at once, beside the lane
    (found,) = converge_jobs.converge(tools, job(Kind.CONVERGE, held, in_host))
    assert isinstance(found, Converged), found
    assert (found.runs, found.memory) == (False, Residency.HOST)
    assert found.host_bytes == {"0": 2 * SIZE}  # the core hears what moved
    assert lock(tools).state(second) is CHECKPOINTED
    assert record(tools).swapped == {"0": 2 * SIZE} and second in record(tools).pids


def test_a_moved_out_process_that_ended_keeps_nothing_of_its_tenant_in_host_ram(
    double: DriverDouble, tools: Tools, cgroup: Path
) -> None:
    # Matrix checkpoint/newproc: the new process, moved to host RAM with the rest,
    # ended; its record still named it, and each swap asked the driver its state
    # first: NOT_INITIALIZED, taken for a failure. The tenant's restore failed at
    # its turn (stuck), its checkpoint failed (kept on the card), and `kiwid
    # recover` left its first process in host RAM. A process gone has nothing to move.
    held, second = swapped_out(double, tools, cgroup)
    in_host = want(gated=True, memory=Residency.HOST)
    side_jobs.follow(tools, job(Kind.FOLLOW, held, in_host))
    converge_jobs.converge(tools, job(Kind.CONVERGE, held, in_host))
    assert lock(tools).state(second) is CHECKPOINTED and second in record(tools).pids
    newcomer = next(t for t in double.tenants if t.pid == second)
    double.close([replace(newcomer, cgroup=None)])  # it ends alone, not its cgroup
    first = min(held.pids)
    back = swap_jobs.swap(tools, job(Kind.SWAP_IN, held))[-1]
    assert isinstance(back, SwapFinished) and back.ok, back
    assert lock(tools).state(first) is LOCKED
    assert second in record(tools).pids, "still named: a swap-out must pass it over too"
    out = replace(job(Kind.SWAP_OUT, held), sizes={"0": SIZE})
    gone = swap_jobs.swap(tools, out)[-1]
    assert isinstance(gone, SwapFinished) and gone.ok, gone
    assert lock(tools).state(first) is CHECKPOINTED
    restore_checkpointed(lock(tools), record(tools))  # as `kiwid recover` restores it
    assert lock(tools).state(first) is LOCKED


def test_a_new_process_whose_footprint_nobody_says_counts_as_the_tenants_size(
    double: DriverDouble, tools: Tools, cgroup: Path
) -> None:
    held, _ = swapped_out(double, tools, cgroup)
    tools.guards = SwapGuards()  # the driver says no process's memory
    in_host = want(gated=True, memory=Residency.HOST)
    side_jobs.follow(tools, job(Kind.FOLLOW, held, in_host))
    (found,) = converge_jobs.converge(tools, job(Kind.CONVERGE, held, in_host))
    assert isinstance(found, Converged) and found.host_bytes == {"0": SIZE + 3 * GiB}
    assert record(tools).swapped == {"0": SIZE + 3 * GiB}, "never 0: a restore needs room"


def test_a_converge_undoes_a_lock_taken_late_on_a_tenant_that_runs(
    double: DriverDouble, tools: Tools, cgroup: Path
) -> None:
    tenant = spawn(double, cgroup)
    held = info(cgroup, tenant.pid)
    gate_jobs.gate(tools, job(Kind.GATE, held))  # a gate whose call returned late
    runs = want(gated=False, memory=Residency.RESIDENT)
    (found,) = converge_jobs.converge(tools, job(Kind.CONVERGE, held, runs))
    assert found == Converged(KEY, True, Residency.RESIDENT, note=found.note, epoch=7)
    assert lock(tools).state(tenant.pid) is RUNNING
    assert KEY not in tools.state.records


def test_a_converge_brings_back_a_checkpoint_that_ended_after_its_tenant_was_let_go(
    double: DriverDouble, tools: Tools, cgroup: Path
) -> None:
    held, _ = swapped_out(double, tools, cgroup)
    first = min(held.pids)
    runs = want(gated=False, memory=Residency.RESIDENT)
    (found,) = converge_jobs.converge(tools, job(Kind.CONVERGE, held, runs))
    assert isinstance(found, Converged) and found.runs
    assert lock(tools).state(first) is RUNNING  # restored, then unlocked
    assert KEY not in tools.state.records


def test_a_converge_of_a_stuck_tenant_fences_what_will_not_lock_and_records_why(
    double: DriverDouble, tools: Tools, cgroup: Path
) -> None:
    refuse = DriverFault("lock", "fail", CUDA_ERROR_UNKNOWN, times=100)
    tenant = spawn(double, cgroup, faults=(refuse,))
    held = info(cgroup, tenant.pid)
    why = Fault("gate", "its lock ran past its deadline", 0.0, False)
    stuck = want(gated=True, memory=None, fault=why)
    (found,) = converge_jobs.converge(tools, job(Kind.CONVERGE, held, stuck))
    assert isinstance(found, Converged) and not found.runs, found
    assert "fenced" in found.note
    assert "frozen 1" in (cgroup / "cgroup.events").read_text()
    assert record(tools).fenced and record(tools).fault is not None
    assert record(tools).fault.reason == why.reason  # a restarted kiwid keeps it stuck
    tools.gate.ungate(record(tools))  # what recover does: unlocks, thaws
    assert "frozen 0" in (cgroup / "cgroup.events").read_text()


def test_a_gated_tenant_found_running_is_a_fault_the_core_hears(
    double: DriverDouble, tools: Tools, cgroup: Path
) -> None:
    refuse = DriverFault("lock", "fail", CUDA_ERROR_UNKNOWN, times=100)
    tenant = spawn(double, cgroup, faults=(refuse,))
    held = info(cgroup, tenant.pid)
    tools.gate = CudaLockGate(lock(tools), timeout_s=1)  # and no freezer to fence it
    gated = want(gated=True, memory=Residency.RESIDENT)
    (fault,) = converge_jobs.converge(tools, job(Kind.CONVERGE, held, gated))
    assert isinstance(fault, TenantFaulted) and not fault.contained, fault
    assert fault.epoch == 7 and "runs though it is gated" in fault.reason


def test_a_fence_written_again_is_not_thawed_by_an_unlock_that_read_it_before(
    double: DriverDouble, tools: Tools, cgroup: Path
) -> None:
    tenant = spawn(double, cgroup)
    held = info(cgroup, tenant.pid)
    gate_jobs.gate(tools, job(Kind.GATE, held))
    fence = job(Kind.FENCE, held, epoch=8)
    (first,) = side_jobs.fence(tools, fence)
    assert first == Converged(KEY, False, None, note=first.note, epoch=8)
    read = record(tools)  # what an ungate reads as it starts; then its unlock hangs
    assert read.fenced
    side_jobs.fence(tools, fence)  # the call ran past its deadline: fenced again
    assert record(tools).version == read.version + 1, "the same record, written again"
    tools.gate.ungate(read, tools.state.unchanged)  # the hung unlock returns
    assert lock(tools).state(tenant.pid) is RUNNING  # its unlock went through, late
    assert "frozen 1" in (cgroup / "cgroup.events").read_text(), "the fence thawed"
    tools.gate.ungate(record(tools), tools.state.unchanged)
    assert "frozen 0" in (cgroup / "cgroup.events").read_text()
