"""What a swap asks before it starts: free memory for a restore, a checkpointable tenant.

Real parts: a simulated GPU backend with a real process attached, its swapper and
link model, a real state file; only time is the link's (fast rates).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiwid.adapters.sim import SimBackend
from kiwid.core.actions import SwapIn, SwapOut
from kiwid.core.events import MemoryFreeSeen, SwapFinished
from kiwid.daemon.engine.effects import Effects, SwapGuards
from kiwid.daemon.engine.executor import Executor
from kiwid.daemon.gating.gates import NullGate
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.gating.state import StateFile
from kiwid.daemon.gating.swap import SimSwapper

GiB = 2**30


@pytest.fixture
def sleeper() -> Iterator[int]:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) as p:
        try:
            yield p.pid
        finally:
            p.kill()


class World:
    def __init__(self, tmp_path: Path, pid: int, unswappable: str | None = None) -> None:
        self.backend = SimBackend(devices=1, memory_bytes=10 * GiB)
        self.backend.attach(pid, 0, 4 * GiB, "idle")
        self.failed: list[tuple[str, str]] = []
        self.state = StateFile(tmp_path / "state")
        self.state.lock()
        self.state.put(GatedRecord("t", "none", None, None, (pid,)))
        self.effects = Effects(
            NullGate(),
            self.state,
            SimSwapper(self.backend, 400e9, 400e9),
            guards=SwapGuards(
                free_bytes=lambda gpu: self.backend.free_memory(int(gpu)),
                reserve_bytes=lambda: GiB,
                unswappable=lambda pids: unswappable,
                checkpoint_failed=lambda t, why, permanent: self.failed.append((t, why)),
            ),
        )
        self.executor = Executor()

    def do(self, action: SwapOut | SwapIn) -> list[object]:
        self.executor.job(action, "t", frozenset({"0"}), sizes={"0": 4 * GiB})
        [started] = self.executor.startable()
        events = self.effects.carry_out(started)
        self.executor.finish(started)
        return events

    def close(self) -> None:
        self.state.unlock()
        self.backend.close()


def test_a_restore_waits_while_the_card_lacks_free_memory(tmp_path: Path, sleeper: int) -> None:
    w = World(tmp_path, sleeper)
    try:
        out = w.do(SwapOut("t"))
        done = out[-1]
        assert isinstance(done, SwapFinished)
        assert done == SwapFinished("t", "out", True, 4 * GiB, done.seconds, epoch=done.epoch)
        assert out[0] == MemoryFreeSeen("0", 10 * GiB)  # a fresh reading after the swap
        w.backend.set_foreign(0, 6 * GiB)  # 4 GiB free: not 4 + 1 reserve
        refused = w.do(SwapIn("t"))
        assert refused[0] == MemoryFreeSeen("0", 4 * GiB)
        last = refused[-1]
        assert isinstance(last, SwapFinished) and last.deferred and not last.ok
        assert last.reason.startswith("waiting for free memory on GPU 0")
        assert w.backend.swapped_of([sleeper]) == {0: 4 * GiB}  # not started: still out
        assert w.state.records["t"].swapped == {"0": 4 * GiB}
        w.backend.set_foreign(0, 0)
        back = w.do(SwapIn("t"))
        assert isinstance(back[-1], SwapFinished) and back[-1].ok
        assert w.backend.resident_of([sleeper]) == {0: 4 * GiB}
        assert w.failed == []
    finally:
        w.close()


def test_a_tenant_the_driver_cannot_checkpoint_is_never_swapped(
    tmp_path: Path, sleeper: int
) -> None:
    w = World(tmp_path, sleeper, unswappable="it uses NCCL between processes")
    try:
        events = w.do(SwapOut("t"))
        last = events[-1]
        assert isinstance(last, SwapFinished)
        assert (last.ok, last.unswappable, last.reason) == (
            False,
            True,
            "it uses NCCL between processes",
        )
        assert w.backend.resident_of([sleeper]) == {0: 4 * GiB}
        assert w.state.records["t"].swapped is None
        assert w.failed == [("t", "it uses NCCL between processes")]
    finally:
        w.close()
