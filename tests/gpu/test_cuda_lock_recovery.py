"""On a GPU machine: a CUDA lock outlives the process that took it; recovery undoes it.

DESIGN.md: after the locker was SIGKILLed the target stayed locked until another
root process unlocked it. kiwid records every lock before taking it, so
``kiwid recover`` (systemd ExecStopPost=) unlocks what a killed kiwid left.
Skipped where there is no driver with the checkpoint API, or no CuPy/PyTorch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiwid.adapters import cudalock

pytestmark = pytest.mark.gpu

WORKER = """
import sys, time
try:
    import torch
    x = torch.ones(1 << 20, device="cuda")
    step = lambda: (x.mul_(1.0000001), torch.cuda.synchronize())
except ImportError:
    import cupy
    x = cupy.ones(1 << 20)
    step = lambda: (x.__imul__(1.0000001), cupy.cuda.Device().synchronize())
print("ready", flush=True)
while True:
    step()
    print("tick", time.monotonic(), flush=True)
    time.sleep(0.01)
"""

LOCKER = """
import sys
from kiwid.adapters.cudalock import CudaLock
CudaLock().lock(int(sys.argv[1]), 5000)
print("locked", flush=True)
sys.stdin.read()  # wait to be killed
"""


@pytest.fixture
def cuda_worker():
    if not cudalock.probe().available:
        pytest.skip(f"no CUDA process lock here: {cudalock.probe().reason}")
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        if first.strip() != "ready":
            pytest.skip("neither torch nor cupy could run a CUDA worker")
        yield proc
    finally:
        if cudalock.probe().available:
            lock = cudalock.CudaLock()
            try:
                if lock.state(proc.pid) is cudalock.ProcessState.LOCKED:
                    lock.unlock(proc.pid)
            except cudalock.CudaLockError:
                pass
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_recover_unlocks_what_a_killed_locker_left(cuda_worker, tmp_path: Path) -> None:
    pid = cuda_worker.pid
    # The repo first, then whatever path the caller set up (kiwid's dependencies may
    # live in a carried folder on a GPU machine without a venv).
    paths = [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    locker = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(pid)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert locker.stdout is not None
    assert locker.stdout.readline().strip() == "locked"
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    start = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    (state_dir / "state.json").write_text(
        json.dumps(
            {
                "version": 2,
                "gated": {
                    f"pid:{pid}": {
                        "method": "cuda-lock",
                        "cgroup_v2": None,
                        "cgroup_v1_freezer": None,
                        "cgroup_ids": [None, None],
                        "pids": [[pid, start]],
                    }
                },
            }
        )
    )
    locker.send_signal(signal.SIGKILL)
    locker.wait()
    locker.stdout.close()
    assert locker.stdin is not None
    locker.stdin.close()
    lock = cudalock.CudaLock()
    assert lock.state(pid) is cudalock.ProcessState.LOCKED, "the lock outlives its taker"
    out = subprocess.run(
        [sys.executable, "-m", "kiwid", "recover", "--state-dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    unlocked_at = time.monotonic()  # CLOCK_MONOTONIC: the worker's clock too
    assert lock.state(pid) is cudalock.ProcessState.RUNNING
    # And the worker makes GPU progress again: a step that ended after the unlock
    # (lines it printed before the lock, still in the pipe, do not count).
    assert cuda_worker.stdout is not None
    deadline = unlocked_at + 10
    while True:
        line = cuda_worker.stdout.readline()
        if line.startswith("tick") and float(line.split()[1]) > unlocked_at:
            break
        assert time.monotonic() < deadline, "no GPU step finished after the unlock"
