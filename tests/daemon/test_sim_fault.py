"""``sim-fault``: faults injected into the simulated GPU's swaps, as the driver's would come.

First the swapper itself (a real process attached to a real sim backend), then a
real kiwid on the sim through its socket. What kiwid then does about a fault is
not judged here (its reaction to driver faults is its own concern); only that
the fault reaches it, and that a hang ends with ``none``.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from kiwid.adapters.control import ControlError
from kiwid.adapters.sim import SimBackend
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.gating.swap import SimSwapper, SwapError
from tests.daemon.conftest import wait_for
from tests.daemon.test_swap_e2e import TENANT, a_holds_b_waits, holder, start, swapped

GiB = 2**30


@pytest.fixture
def sim_tenant() -> Iterator[tuple[SimBackend, SimSwapper, GatedRecord]]:
    """A sleeping process with 4 GiB on a 10 GiB simulated GPU, and its swapper."""
    backend = SimBackend(devices=1, memory_bytes=10 * GiB)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) as proc:
        try:
            backend.attach(proc.pid, 0, 4 * GiB, "idle")
            record = GatedRecord(f"pid:{proc.pid}", "none", None, None, (proc.pid,))
            yield backend, SimSwapper(backend, 400e9, 400e9), record
        finally:
            proc.kill()
            backend.close()


def test_a_failed_swap_names_the_fault_and_moves_nothing(sim_tenant) -> None:
    backend, swapper, record = sim_tenant
    (pid,) = record.pids
    backend.faults.inject(pid, "checkpoint", "fail")
    with pytest.raises(SwapError, match=rf"injected fault \(sim-fault\): checkpoint of pid {pid}"):
        swapper.swap_out(record)
    assert backend.resident_of(record.pids) == {0: 4 * GiB}
    swapper.swap_out(record)  # once only
    backend.faults.inject(pid, "restore", "fail", times=2)
    for _ in range(2):
        with pytest.raises(SwapError, match=rf"restore of pid {pid}: fail"):
            swapper.swap_in(record)
    assert backend.swapped_of(record.pids) == {0: 4 * GiB}
    swapper.swap_in(record)
    assert backend.resident_of(record.pids) == {0: 4 * GiB}


def test_stuck_leaves_the_memory_in_host_ram_until_none(sim_tenant) -> None:
    backend, swapper, record = sim_tenant
    (pid,) = record.pids
    backend.faults.inject(pid, "checkpoint", "stuck")
    with pytest.raises(SwapError, match=rf"checkpoint of pid {pid}: stuck"):
        swapper.swap_out(record)
    assert backend.swapped_of(record.pids) == {0: 4 * GiB}, "the memory went all the same"
    for _ in range(2):
        with pytest.raises(SwapError, match=rf"restore of pid {pid}: stuck"):
            swapper.swap_in(record)
    backend.faults.inject(pid, "restore", "none")
    swapper.swap_in(record)
    assert backend.resident_of(record.pids) == {0: 4 * GiB}


def test_a_hung_swap_does_its_work_once_cleared(sim_tenant) -> None:
    backend, swapper, record = sim_tenant
    (pid,) = record.pids
    backend.faults.inject(pid, "checkpoint", "hang")
    worker = threading.Thread(target=swapper.swap_out, args=(record,), daemon=True)
    worker.start()
    worker.join(0.2)
    assert worker.is_alive(), "it hangs"
    assert backend.resident_of(record.pids) == {0: 4 * GiB}
    backend.faults.inject(pid, "checkpoint", "none")
    worker.join(5)
    assert not worker.is_alive()
    assert backend.swapped_of(record.pids) == {0: 4 * GiB}


BAD = [
    ({"op": "swap", "fault": "fail"}, "op must be one of checkpoint, restore, not 'swap'"),
    ({"op": "restore", "fault": "boom"}, "fault must be one of fail, hang, stuck, none"),
    ({"op": "restore", "fault": "fail", "times": -2}, "times must be an integer >= 1, not -2"),
    ({"op": "restore", "fault": "fail", "pid": 1}, "pid 1 is not attached"),
    ({"op": "restore", "fault": "none", "pid": 1}, "pid 1 is not attached"),
]


def test_bad_arguments_are_refused_with_what_is_wrong(start_kiwid, tenants, workdir) -> None:
    k = start(start_kiwid, workdir, tq=30)
    a = tenants("a")
    k.attach(a.pid, memory=TENANT)
    for args, message in BAD:
        with pytest.raises(ControlError) as err:
            k.call("sim-fault", {"pid": a.pid, **args})
        assert (err.value.code, message in err.value.message) == ("invalid-value", True), (
            args,
            err.value.message,
        )
    with pytest.raises(ControlError) as err:
        k.call("sim-fault", {"pid": a.pid, "op": "restore", "fault": "fail", "times": 1.5})
    assert err.value.code == "bad-request", "the protocol's type check: an integer"
    assert "Injected fault" not in k.log_text(), "nothing was injected"
    assert k.call("sim-fault", {"pid": a.pid, "op": "restore", "fault": "none"})["times"] is None


def test_a_hung_restore_holds_the_hand_over_until_none(start_kiwid, tenants, workdir) -> None:
    k, _a, b = a_holds_b_waits(start_kiwid, tenants, workdir, tq=1)
    answer = k.call("sim-fault", {"pid": b.pid, "op": "restore", "fault": "hang"})
    assert answer == {"pid": b.pid, "op": "restore", "fault": "hang", "times": 1}
    k.wait_log(f"injected fault (sim-fault): restore of pid {b.pid}: hang", 10)
    swap = k.status()["gpus"][0]["swap"]
    assert (swap["tenant"], swap["direction"]) == (b.key, "in"), swap
    assert swapped(workdir, b) and b.frozen(), "b waits in host RAM"
    assert k.call("ping"), "kiwid answers meanwhile"
    k.call("sim-fault", {"pid": b.pid, "op": "restore", "fault": "none"})
    wait_for(lambda: not swapped(workdir, b), 5, "b's memory back on the card")
    wait_for(lambda: holder(k) == b.key and not b.frozen(), 10, "b's turn")
    k.wait_log(f"Cleared the injected fault of restore of pid {b.pid}")


def test_a_failed_checkpoint_reaches_kiwid(start_kiwid, tenants, workdir) -> None:
    k, a, _b = a_holds_b_waits(start_kiwid, tenants, workdir, tq=1)
    k.call("sim-fault", {"pid": a.pid, "op": "checkpoint", "fault": "fail"})
    k.wait_log(f"injected fault (sim-fault): checkpoint of pid {a.pid}: fail", 10)
    assert k.call("ping"), "kiwid runs on"
