"""kiwid's real GPU path, end to end, on the driver double.

A real ``python -m kiwid`` with ``backend = "nvml"``, ``gate = "cuda-lock"`` and
``swap = "checkpoint"`` loads the stand-in ``libcuda.so.1``
(``tests/stand_ins/libcuda_standin.c``) through ``LD_LIBRARY_PATH`` and the
stand-in pynvml through ``PYTHONPATH``; both show one card, the double's
directory. The tenants are ``cuda_tenant.py`` processes, each in a cgroup of its
own: they work while RUNNING and stop while locked or checkpointed, as a CUDA
job does. What the double holds (who is RUNNING, LOCKED, CHECKPOINTED, what is
on the card) is read under its lock: one consistent snapshot.

The fault-free path and ``kiwid recover`` after SIGKILL; the faults are in
``test_driver_faults_e2e.py``.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.daemon.conftest import (
    DOUBLE_CAPACITY,
    DOUBLE_FOREIGN,
    KIWID,
    Card,
    Kiwid,
    wait_for,
)
from tests.daemon.test_swap_e2e import swap_lines
from tests.stand_ins import cudadir
from tests.stand_ins.cudadouble import CudaTenant, DriverDouble

GiB = 2**30
CAPACITY = DOUBLE_CAPACITY
TENANT = GiB
FOREIGN = DOUBLE_FOREIGN  # three tenants and it do not fit (4.5 > 4); two and it do


def config(d: Path, tq: float = 1) -> str:
    return f"""\
[scheduler]
tq = {tq}
idle_release = 0.5
[gpu]
backend = "nvml"
poll_interval = 0.05
gate = "cuda-lock"
[memory]
swap = "checkpoint"
reserve_mib = 256
host_floor_mib = 0
[control]
socket = "{d / "kiwid.sock"}"
[daemon]
state_dir = "{d / "state"}"
shutdown_timeout = 10
[kubernetes]
cdi_dir = ""
"""


def holder(k: Kiwid) -> str | None:
    h = k.status()["gpus"][0]["holder"]
    return h["tenant"] if h else None


def snapshot(double: DriverDouble, tenants: dict[str, CudaTenant]) -> dict[str, cudadir.Proc]:
    procs = double.processes()
    return {name: procs[t.pid] for name, t in tenants.items() if t.pid in procs}


def start(start_kiwid: Callable[..., Kiwid], workdir: Path, card: Card) -> Kiwid:
    (workdir / "kiwi.toml").write_text(config(workdir))
    k = start_kiwid(env=card.double.env())
    k.wait_log("Gate: the CUDA driver's process lock")
    assert "memory.swap = checkpoint is off" not in k.log_text()
    return k


def test_three_tenants_larger_than_the_card_rotate_and_recover_after_sigkill(
    start_kiwid, workdir: Path, card: Card
) -> None:
    double = card.double
    k = start(start_kiwid, workdir, card)
    tenants = {"a": card.arrive("a")}
    wait_for(lambda: holder(k) == card.key(tenants["a"]), 10, "a to hold the GPU")
    for name in ("b", "c"):  # each gated, its memory sent to host RAM
        tenants[name] = card.arrive(name)
        key = card.key(tenants[name])
        wait_for(lambda key=key: ("out", key) in swap_lines(k), 10, f"{name} swapped out")
    names = {card.key(t): n for n, t in tenants.items()}
    assert all(len(t.pids()) == 1 for t in tenants.values())

    # They rotate: one RUNNING at a time (a hand-over locks the holder before it
    # unlocks the next), each memory moving to host RAM and back, and the card
    # never holding more than it has.
    turns: list[str] = []
    seen: dict[str, set[int]] = {n: set() for n in tenants}
    progress_before = {n: t.progress() for n, t in tenants.items()}
    deadline = time.monotonic() + 20
    while len(turns) < 7 and time.monotonic() < deadline:
        now = snapshot(double, tenants)
        assert set(now) == set(tenants), f"a tenant lost its context: {now}\n{k.log_text()}"
        running = [n for n, p in now.items() if p.state == cudadir.RUNNING]
        assert len(running) <= 1, f"{running} run at once: {now}\n{k.log_text()}"
        on_card = cudadir.resident_bytes({p.pid: p for p in now.values()}) + FOREIGN
        assert on_card <= CAPACITY, f"{on_card} bytes on a {CAPACITY}-byte card: {now}"
        for n, p in now.items():
            seen[n].add(p.state)
        if running and (not turns or turns[-1] != running[0]):
            turns.append(running[0])
        time.sleep(0.02)
    assert len(turns) >= 6, f"too few turns in 20 s: {turns}\n{k.log_text()}"
    for i in range(len(turns) - 3):
        assert sorted(turns[i : i + 3]) == ["a", "b", "c"], f"not round-robin: {turns}"
    for n, tenant in tenants.items():
        assert {cudadir.RUNNING, cudadir.CHECKPOINTED} <= seen[n], (n, seen[n])
        assert tenant.progress() > progress_before[n], f"{n} made no progress"
    moves = swap_lines(k)
    for key, n in names.items():
        assert ("out", key) in moves and ("in", key) in moves, (n, moves)

    # Hand-overs stop (TQ 60 s); once no swap is in flight, kiwid dies outright.
    k.call("set-tq", {"tq": 60})

    def settled() -> dict[str, cudadir.Proc] | None:
        now = snapshot(double, tenants)
        busy = k.status()["gpus"][0]["swap"] is not None or any(p.moving for p in now.values())
        running = [p for p in now.values() if p.state == cudadir.RUNNING]
        return None if busy or len(running) != 1 else now

    before = wait_for(settled, 10, "one tenant running, no swap in flight")
    k.proc.kill()
    k.proc.wait()
    gated = [n for n, p in before.items() if p.state != cudadir.RUNNING]
    assert len(gated) == 2
    after = snapshot(double, tenants)
    assert [after[n].state for n in gated] == [before[n].state for n in gated]
    assert any(after[n].state == cudadir.CHECKPOINTED for n in gated), after
    stalled = {n: tenants[n].progress() for n in gated}

    # The other job ends: now everyone fits, and kiwid recover brings them back.
    double.set_foreign(0)
    out = subprocess.run(
        [*KIWID, "recover", "--state-dir", str(workdir / "state")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**os.environ, **double.env()},
    )
    assert out.returncode == 0, out.stderr
    final = snapshot(double, tenants)
    assert {n: p.state for n, p in final.items()} == dict.fromkeys(tenants, cudadir.RUNNING)
    assert double.resident_bytes() == 3 * TENANT, "all memory back on the card"
    for n in gated:
        assert f"Ungated {card.key(tenants[n])}" in out.stderr, out.stderr
        wait_for(lambda n=n: tenants[n].progress() > stalled[n], 5, f"{n} to work again")
    assert not (workdir / "state" / "state.json").exists()
