"""The simulated GPU's fault table (``sim-fault``): what each swap meets, and for how long."""

from __future__ import annotations

import threading

import pytest

from kiwid.adapters.sim import SimBackend, SimFault, SimFaults


def test_a_fault_is_met_as_often_as_told_then_gone() -> None:
    faults = SimFaults()
    faults.inject(7, "checkpoint", "fail", times=2)
    assert faults.take([3, 7], "restore") is None, "another op"
    assert faults.take([3], "checkpoint") is None, "another pid"
    assert faults.active() == {"7 checkpoint": "fail x2"}
    assert faults.take([3, 7], "checkpoint") == SimFault(7, "checkpoint", "fail")
    assert faults.take([7], "checkpoint") == SimFault(7, "checkpoint", "fail")
    assert faults.take([7], "checkpoint") is None
    assert faults.active() == {}


def test_none_clears_and_a_later_fault_replaces() -> None:
    faults = SimFaults()
    faults.inject(7, "restore", "fail", times=5)
    faults.inject(7, "restore", "hang")  # one fault per pid and op: the last wins
    assert faults.active() == {"7 restore": "hang x1"}
    faults.inject(7, "restore", "none")
    assert faults.take([7], "restore") is None
    assert faults.knows(7), "a cleared pid may be cleared again"
    assert not faults.knows(8)


def test_stuck_sticks_to_every_later_restore_until_none() -> None:
    faults = SimFaults()
    faults.inject(7, "checkpoint", "stuck")
    assert faults.take([7], "checkpoint") == SimFault(7, "checkpoint", "stuck")
    assert faults.take([7], "checkpoint") is None, "the swap-outs go on"
    for _ in range(3):
        assert faults.take([7], "restore") == SimFault(7, "restore", "stuck")
    assert faults.active() == {"7 restore": "stuck"}
    faults.inject(7, "checkpoint", "none")  # none for any op un-sticks it
    assert faults.take([7], "restore") is None


def test_a_hang_waits_until_cleared_without_spinning() -> None:
    faults = SimFaults(poll_s=10)  # the wake-up comes from none, not from polling
    faults.inject(7, "restore", "hang", times=2)
    first = faults.take([7], "restore")
    assert first is not None and first.kind == "hang"
    ended = threading.Event()

    def swap() -> None:
        faults.wait_cleared(first)
        ended.set()

    worker = threading.Thread(target=swap, daemon=True)
    worker.start()
    assert not ended.wait(0.2), "it must block"
    faults.inject(7, "restore", "none")
    assert ended.wait(5), "none ends the hang"
    worker.join(5)
    # The second hang was cleared with the first: the table is empty.
    assert faults.take([7], "restore") is None
    # A hang taken after a none waits for the next none, not the last one.
    faults.inject(7, "restore", "hang")
    second = faults.take([7], "restore")
    assert second is not None and second.clears == 1
    cleared = threading.Thread(target=faults.wait_cleared, args=(second,), daemon=True)
    cleared.start()
    cleared.join(0.1)
    assert cleared.is_alive()
    faults.inject(7, "restore", "none")
    cleared.join(5)
    assert not cleared.is_alive()


@pytest.mark.parametrize(
    ("op", "fault", "times", "message"),
    [
        ("swap", "fail", 1, "op must be one of checkpoint, restore, not 'swap'"),
        ("restore", "crash", 1, "fault must be one of fail, hang, stuck, none, not 'crash'"),
        ("restore", "fail", -1, "times must be an integer >= 1, not -1"),
        ("restore", "fail", 0, "times must be an integer >= 1, not 0"),
        ("restore", "fail", True, "times must be an integer >= 1, not True"),
    ],
)
def test_bad_faults_are_refused_and_change_nothing(op, fault, times, message) -> None:
    faults = SimFaults()
    with pytest.raises(ValueError) as err:
        faults.inject(7, op, fault, times)
    assert str(err.value) == message
    assert faults.active() == {}


def test_each_simulated_gpu_backend_has_its_table() -> None:
    a, b = SimBackend(devices=1), SimBackend(devices=1)
    try:
        a.faults.inject(7, "restore", "fail")
        assert b.faults.active() == {}
    finally:
        a.close()
        b.close()
