"""The NVML adapter: the no-driver path here, the real thing behind the gpu marker."""

from __future__ import annotations

from collections.abc import Iterator

import pynvml
import pytest

from kiwid.adapters.gpu import DriverUnavailable, GpuBackendError, GpuLost
from kiwid.adapters.nvml import NvmlBackend, translate_error


@pytest.fixture
def backend() -> Iterator[NvmlBackend]:
    nvml = NvmlBackend()
    try:
        yield nvml
    finally:
        nvml.close()


def _nvml_works() -> bool:
    probe = NvmlBackend()
    try:
        probe.devices()
    except GpuBackendError:
        return False
    finally:
        probe.close()
    return True


def test_no_driver_is_fatal_with_a_hint(backend: NvmlBackend) -> None:
    if _nvml_works():
        pytest.skip("this machine has a working NVIDIA driver")
    with pytest.raises(DriverUnavailable, match="HINT: ") as caught:
        backend.devices()
    assert "nvidia-smi" in caught.value.hint
    assert 'backend = "sim"' in caught.value.hint
    # Every query fails the same way, and close() stays safe.
    with pytest.raises(DriverUnavailable):
        backend.processes(0)
    with pytest.raises(DriverUnavailable):
        backend.active_pids(0, 0.5)
    backend.close()
    backend.close()


@pytest.mark.parametrize(
    ("code", "hint_words"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "nvidia-smi"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "modprobe nvidia"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "root"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "reboot"),
        (pynvml.NVML_ERROR_UNINITIALIZED, "restart kiwid"),
        (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, "upgrade"),
    ],
)
def test_unusable_driver_translates_to_driver_unavailable(code: int, hint_words: str) -> None:
    err = translate_error(pynvml.NVMLError(code), "nvmlInit")
    assert isinstance(err, DriverUnavailable)
    assert str(err).startswith("nvmlInit: ")
    assert hint_words in err.hint
    assert "HINT: " in str(err)


@pytest.mark.parametrize(
    "code",
    [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED, pynvml.NVML_ERROR_UNKNOWN],
)
def test_lost_gpu_translates_to_gpu_lost(code: int) -> None:
    err = translate_error(pynvml.NVMLError(code), "nvmlDeviceGetUUID", 2)
    assert isinstance(err, GpuLost)
    assert err.index == 2


def test_lost_without_a_device_and_other_errors_are_plain_backend_errors() -> None:
    for err in (
        translate_error(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST), "nvmlDeviceGetCount"),
        translate_error(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED), "nvmlX", 1),
    ):
        assert type(err) is GpuBackendError
    assert "nvmlX on GPU 1 failed" in str(err)


@pytest.mark.gpu
def test_real_gpu_lists_devices_processes_and_activity(backend: NvmlBackend) -> None:
    if not _nvml_works():
        pytest.skip("NVML cannot be initialised on this machine")
    devices = backend.devices()
    assert devices
    for device in devices:
        assert device.uuid.startswith(("GPU-", "MIG-"))
        assert device.memory_total_bytes > 0
        for process in backend.processes(device.index):
            assert process.pid > 0
            assert process.used_memory_bytes is None or process.used_memory_bytes >= 0
        assert isinstance(backend.active_pids(device.index, 1.0), frozenset)
    with pytest.raises(GpuBackendError):
        backend.processes(len(devices) + 100)
