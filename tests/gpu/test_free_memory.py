"""On a GPU machine: NVML's free memory is what kiwid's safe restores rely on.

A restore starts only when the driver's free memory covers it (docs/memory.md).
Here a process allocates 4 GiB and the backend's reading drops by about that
much; after a checkpoint through the driver's API it comes back, and after the
restore it drops again. Skipped without a GPU, the checkpoint API, or torch/cupy.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kiwid.adapters import cudalock
from kiwid.adapters.gpu import DriverUnavailable
from kiwid.adapters.nvml import NvmlBackend
from tests.helpers import wait_for

pytestmark = pytest.mark.gpu

GiB = 2**30
HOLDER = """
import sys
try:
    import torch
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
except ImportError:
    import cupy
    x = cupy.empty(4 << 30, dtype=cupy.uint8)
print("ready", flush=True)
sys.stdin.read()
"""


def test_free_memory_follows_allocation_checkpoint_and_restore() -> None:
    backend = NvmlBackend()
    try:
        backend.devices()
    except DriverUnavailable as err:
        pytest.skip(f"no NVIDIA driver here: {err}")
    support = cudalock.probe()
    if not support.available:
        pytest.skip(f"no checkpoint API here: {support.reason}")
    before = backend.free_memory(0)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    lock = cudalock.CudaLock()
    try:
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "ready":
            pytest.skip("neither torch nor cupy could allocate")
        allocated = before - backend.free_memory(0)
        assert 4 * GiB <= allocated <= 4 * GiB + 2 * GiB  # its 4 GiB and its context
        lock.lock(holder.pid, 10_000)
        lock.checkpoint(holder.pid)
        wait_for(lambda: backend.free_memory(0) >= before - 256 * 2**20, 10, "memory freed")
        lock.restore(holder.pid)
        assert before - backend.free_memory(0) >= 4 * GiB
    finally:
        try:
            state = lock.state(holder.pid)
            if state is cudalock.ProcessState.CHECKPOINTED:
                lock.restore(holder.pid)
                state = lock.state(holder.pid)
            if state is cudalock.ProcessState.LOCKED:
                lock.unlock(holder.pid)
        except cudalock.CudaLockError:
            pass
        holder.kill()
        holder.wait()
        for stream in (holder.stdin, holder.stdout):
            if stream is not None:
                stream.close()
        backend.close()
