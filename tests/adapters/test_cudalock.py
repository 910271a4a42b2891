"""The CUDA lock adapter: no driver here, a compiled stub for the C ABI, a GPU behind ``gpu``."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kiwid.adapters import cudalock
from kiwid.adapters.cudalock import (
    CudaLock,
    CudaLockError,
    CudaLockUnavailable,
    ProcessState,
    probe,
)

# A stand-in libcuda with the same C signatures, to check the ctypes marshalling
# (struct layout, out-parameters, error names) on machines without a driver.
STUB_C = r"""
#include <stddef.h>
typedef struct {
    unsigned int timeoutMs;
    unsigned int reserved0;
    unsigned long long reserved1[7];
} LockArgs;
typedef struct { unsigned long long reserved[8]; } UnlockArgs;
static int inited, state;
static unsigned int last_timeout;
int cuInit(unsigned int flags) {
#ifdef NO_DEVICE
    return 100;
#endif
    if (flags) return 1;
    inited = 1;
    return 0;
}
static int bad_args(const unsigned long long *r, int n) {
    for (int i = 0; i < n; i++) if (r[i]) return 1;
    return 0;
}
int cuCheckpointProcessLock(int pid, LockArgs *a) {
    if (!inited) return 3;
    if (pid <= 0 || a == NULL || a->reserved0 || bad_args(a->reserved1, 7)) return 1;
    if (state != 0) return 401;
    last_timeout = a->timeoutMs;
    state = 1;
    return 0;
}
int cuCheckpointProcessUnlock(int pid, UnlockArgs *a) {
    if (!inited) return 3;
    if (a != NULL && bad_args(a->reserved, 8)) return 1;
    if (state != 1) return 401;
    state = 0;
    return 0;
}
int cuCheckpointProcessGetState(int pid, int *out) {
    if (!inited) return 3;
    *out = pid == 424242 ? 9 : state;
    return 0;
}
#ifndef NO_NAMES
int cuGetErrorName(int error, const char **name) {
    if (error == 401) { *name = "CUDA_ERROR_ILLEGAL_STATE"; return 0; }
    return 1;
}
#endif
#ifndef NO_SWAP
static int restore_error;
int cuCheckpointProcessCheckpoint(int pid, UnlockArgs *a) {
    if (!inited) return 3;
    if (a == NULL || bad_args(a->reserved, 8)) return 1;
    if (state != 1) return 401;
    state = 2;
    return 0;
}
int cuCheckpointProcessRestore(int pid, UnlockArgs *a) {
    if (!inited) return 3;
    if (a == NULL || bad_args(a->reserved, 8)) return 1;
    if (state != 2) return 401;
    if (restore_error) return restore_error;
    state = 1;
    return 0;
}
void stub_set_restore_error(int e) { restore_error = e; }
#endif
unsigned int stub_last_timeout(void) { return last_timeout; }
"""


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stub libcuda")
    directory = tmp_path_factory.mktemp("stubcuda")
    source = directory / "stub.c"
    source.write_text(STUB_C)
    built = {}
    for variant, flags in (
        ("full", []),
        ("no_names", ["-DNO_NAMES"]),
        ("no_device", ["-DNO_DEVICE"]),
        ("no_swap", ["-DNO_SWAP", "-DNO_NAMES"]),
    ):
        library = directory / f"libcuda-{variant}.so"
        subprocess.run(
            [compiler, "-shared", "-fPIC", *flags, "-o", str(library), str(source)], check=True
        )
        built[variant] = library
    return built


def _has_libcuda() -> bool:
    try:
        ctypes.CDLL(cudalock.LIBRARY)
    except OSError:
        return False
    return True


@pytest.mark.skipif(_has_libcuda(), reason="this machine has an NVIDIA driver")
def test_probe_without_a_driver_names_libcuda() -> None:
    support = probe()
    assert not support.available
    assert "libcuda.so.1" in support.reason
    assert "NVIDIA driver" in support.reason
    with pytest.raises(CudaLockUnavailable, match="libcuda") as caught:
        CudaLock()
    assert isinstance(caught.value, CudaLockError)
    assert caught.value.code == -1


def test_probe_of_a_library_without_the_symbols_asks_for_r550() -> None:
    support = probe("libc.so.6")
    assert not support.available
    assert "cuCheckpointProcessLock" in support.reason
    assert "r550" in support.reason


def test_the_argument_structs_match_cuda_h() -> None:
    assert ctypes.sizeof(cudalock._LockArgs) == 64
    assert cudalock._LockArgs.reserved1.offset == 8
    assert ctypes.sizeof(cudalock._UnlockArgs) == 64
    assert ctypes.sizeof(cudalock._CheckpointArgs) == 64


def test_lock_state_unlock_through_the_c_abi(stubs: dict[str, Path]) -> None:
    assert probe(str(stubs["full"])).available
    cuda = CudaLock(str(stubs["full"]))
    assert cuda.state(1234) is ProcessState.RUNNING

    cuda.lock(1234, timeout_ms=1500)

    assert cuda.state(1234) is ProcessState.LOCKED
    assert ctypes.CDLL(str(stubs["full"])).stub_last_timeout() == 1500
    with pytest.raises(CudaLockError) as caught:
        cuda.lock(1234, timeout_ms=10)
    assert (caught.value.code, caught.value.name) == (401, "CUDA_ERROR_ILLEGAL_STATE")
    assert "cuCheckpointProcessLock" in str(caught.value)

    cuda.unlock(1234)

    assert cuda.state(1234) is ProcessState.RUNNING
    with pytest.raises(CudaLockError, match="UNKNOWN_PROCESS_STATE"):
        cuda.state(424242)
    with pytest.raises(ValueError, match="timeout_ms"):
        cuda.lock(1234, timeout_ms=-1)


def test_checkpoint_and_restore_through_the_c_abi(stubs: dict[str, Path]) -> None:
    cuda = CudaLock(str(stubs["full"]))
    assert cuda.can_swap
    with pytest.raises(CudaLockError, match="ILLEGAL_STATE"):
        cuda.checkpoint(77)  # the driver checkpoints only a LOCKED process
    cuda.lock(77, timeout_ms=100)
    cuda.checkpoint(77)
    assert cuda.state(77) is ProcessState.CHECKPOINTED
    ctypes.CDLL(str(stubs["full"])).stub_set_restore_error(2)
    with pytest.raises(CudaLockError) as caught:
        cuda.restore(77)
    assert caught.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert "cuCheckpointProcessRestore" in str(caught.value)
    assert cuda.state(77) is ProcessState.CHECKPOINTED  # nothing lost: still in host RAM
    ctypes.CDLL(str(stubs["full"])).stub_set_restore_error(0)
    cuda.restore(77)
    assert cuda.state(77) is ProcessState.LOCKED  # restore leaves it locked
    cuda.unlock(77)
    assert cuda.state(77) is ProcessState.RUNNING


def test_a_driver_without_checkpoint_can_lock_but_not_swap(stubs: dict[str, Path]) -> None:
    cuda = CudaLock(str(stubs["no_swap"]))
    assert not cuda.can_swap
    assert probe(str(stubs["no_swap"])).available  # the gate works all the same
    with pytest.raises(CudaLockUnavailable, match="cuCheckpointProcessCheckpoint"):
        cuda.checkpoint(77)


def test_error_names_fall_back_to_a_table(stubs: dict[str, Path]) -> None:
    cuda = CudaLock(str(stubs["no_names"]))
    with pytest.raises(CudaLockError) as caught:
        cuda.unlock(1234)  # not locked
    assert (caught.value.code, caught.value.name) == (401, "CUDA_ERROR_ILLEGAL_STATE")
    with pytest.raises(CudaLockError) as caught:
        cuda.lock(0, timeout_ms=10)
    assert caught.value.name == "CUDA_ERROR_INVALID_VALUE"


def test_a_failing_cuinit_makes_probe_unavailable(stubs: dict[str, Path]) -> None:
    support = probe(str(stubs["no_device"]))
    assert not support.available
    assert "cuInit failed" in support.reason
    assert "CUDA_ERROR_NO_DEVICE" in support.reason


CUDA_CHILD = textwrap.dedent("""
    import ctypes, sys, time
    cuda = ctypes.CDLL("libcuda.so.1")
    ctx, dev, mem = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_uint64()
    assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert cuda.cuCtxSetCurrent(ctx) == 0
    assert cuda.cuMemAlloc_v2(ctypes.byref(mem), 1 << 20) == 0
    print("ready", flush=True)
    while True:
        cuda.cuCtxSynchronize()
        time.sleep(0.01)
""")


@pytest.mark.gpu
def test_lock_and_unlock_a_real_cuda_process() -> None:
    support = probe()
    if not support.available:
        pytest.skip(f"no usable CUDA lock: {support.reason}")
    child = subprocess.Popen([sys.executable, "-c", CUDA_CHILD], stdout=subprocess.PIPE)
    cuda = CudaLock()
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"ready"
        assert cuda.state(child.pid) is ProcessState.RUNNING
        cuda.lock(child.pid, timeout_ms=5000)
        try:
            assert cuda.state(child.pid) is ProcessState.LOCKED
        finally:
            cuda.unlock(child.pid)  # a lock outlives its locker: always undo it
        assert cuda.state(child.pid) is ProcessState.RUNNING
    finally:
        child.kill()
        child.wait(timeout=10)


def test_the_gate_re_adopts_a_process_that_is_already_locked(stubs: dict[str, Path]) -> None:
    # A restarted kiwid gates the waiters a previous one left locked: that must
    # succeed (not fail and drop the record), and ungating must still unlock.
    from kiwid.daemon.gating.cudagate import CudaLockGate  # noqa: PLC0415
    from kiwid.daemon.gating.state import GatedRecord  # noqa: PLC0415

    cuda = CudaLock(str(stubs["full"]))
    gate = CudaLockGate(cuda)
    pid = os.getpid()  # a live process (the stub keeps one state for any PID)
    record = GatedRecord(f"pid:{pid}", "cuda-lock", None, None, (pid,))
    cuda.lock(pid, timeout_ms=100)  # left locked by a previous kiwid
    gate.gate(record)
    assert cuda.state(pid) is ProcessState.LOCKED
    gate.ungate(record)
    assert cuda.state(pid) is ProcessState.RUNNING
