"""The GPU backend interface: error types and their messages."""

from __future__ import annotations

import pytest

from kiwid.adapters.gpu import (
    DeviceInfo,
    DriverUnavailable,
    GpuBackend,
    GpuBackendError,
    GpuLost,
    GpuProcess,
)
from kiwid.adapters.nvml import NvmlBackend
from kiwid.adapters.sim import SimBackend


def test_driver_unavailable_carries_reason_and_hint() -> None:
    err = DriverUnavailable("driver not loaded", "run modprobe nvidia")
    assert str(err) == "driver not loaded. HINT: run modprobe nvidia"
    assert (err.reason, err.hint) == ("driver not loaded", "run modprobe nvidia")
    assert isinstance(err, GpuBackendError)


def test_gpu_lost_names_the_gpu() -> None:
    err = GpuLost(3, "fell off the bus")
    assert err.index == 3
    assert str(err) == "GPU 3 is lost: fell off the bus"
    assert isinstance(err, GpuBackendError)


def test_records_are_frozen() -> None:
    device = DeviceInfo(0, "GPU-x", "name", 1)
    process = GpuProcess(42, None)
    with pytest.raises(AttributeError):
        device.index = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        process.pid = 1  # type: ignore[misc]


@pytest.mark.parametrize("factory", [NvmlBackend, SimBackend])
def test_backends_implement_the_protocol(factory: type[GpuBackend]) -> None:
    backend: GpuBackend = factory()
    try:
        assert backend.name in {"nvml", "sim"}
        for method in ("devices", "processes", "active_pids", "close"):
            assert callable(getattr(backend, method))
    finally:
        backend.close()
