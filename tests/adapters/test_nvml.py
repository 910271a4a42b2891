"""The NVML adapter: against the stand-in pynvml, without a driver, and behind the gpu marker.

Most tests hand the adapter ``tests/stand_ins/pynvml.py`` (nvidia-ml-py's shapes
over a simulated libnvidia-ml, see ``test_nvml_standin.py``), so its real code
paths run here; the no-driver test uses the installed nvidia-ml-py itself.
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from kiwid.adapters import nvml
from kiwid.adapters.gpu import DeviceInfo, DriverUnavailable, GpuBackendError, GpuLost, GpuProcess
from kiwid.adapters.nvml import NvmlBackend, translate_error
from tests.stand_ins import DIRECTORY, NVML_MACHINE, write_machine
from tests.stand_ins import pynvml as standin

REPO = Path(__file__).resolve().parents[2]
NOW_S = 1_796_036_071.5  # wall-clock seconds: the H200 probe's sample time
NOW_US = int(NOW_S * 1_000_000)
V3 = "nvmlDeviceGetComputeRunningProcesses_v3"
V2 = "nvmlDeviceGetComputeRunningProcesses_v2"
UTILIZATION = "nvmlDeviceGetProcessUtilization"
H200: dict[str, Any] = {
    "uuid": "GPU-aa0caf94-3e4a-fc56-e823-bae2d7d0090a",
    "name": "NVIDIA H200",
    "memory": {"total": 150754820096, "used": 4893769728},
    "processes": [
        {"pid": 452, "usedGpuMemory": 1050673152},
        {"pid": 474, "usedGpuMemory": 3198156800},
    ],
    "samples": [
        {"pid": 474, "timeStamp": NOW_US - 300_000, "smUtil": 14, "memUtil": 3},
        {"pid": 452, "timeStamp": NOW_US - 100_000, "smUtil": 83, "memUtil": 18},
    ],
}


class Machine:
    """The stand-in pynvml's simulated machine: edit ``spec``, then ``save()``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.spec: dict[str, Any] = copy.deepcopy(
            {"driver_version": "580.159.04", "devices": [H200]}
        )
        self.save()

    @property
    def gpu(self) -> dict[str, Any]:
        return self.spec["devices"][0]

    def save(self) -> None:
        write_machine(self.path, self.spec)

    def calls(self, symbol: str) -> int:
        return standin._standin_calls.count(symbol)


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Machine]:
    """One simulated H200, and the adapter bound to the stand-in pynvml."""
    standin._standin_reset()
    simulated = Machine(tmp_path / "nvml.json")
    monkeypatch.setenv(NVML_MACHINE, str(simulated.path))
    monkeypatch.setattr(nvml, "pynvml", standin)
    yield simulated
    standin._standin_reset()


@pytest.fixture
def gpus(machine: Machine) -> Iterator[NvmlBackend]:
    """An adapter on the stand-in whose wall clock reads ``NOW_S``."""
    backend = NvmlBackend(wall_clock=lambda: NOW_S)
    try:
        yield backend
    finally:
        backend.close()


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
    ("code", "sim"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, True),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, True),
        (pynvml.NVML_ERROR_NO_PERMISSION, False),  # a GPU is there: the sim is no answer
    ],
)
def test_the_sim_hint_names_the_config_file_in_use(code: int, sim: bool) -> None:
    config = Path("/srv/node/kiwi.toml")
    err = translate_error(pynvml.NVMLError(code), "nvmlInit", config=config)
    default = translate_error(pynvml.NVMLError(code), "nvmlInit")
    assert isinstance(err, DriverUnavailable) and isinstance(default, DriverUnavailable)
    assert err.hint.endswith(f' set [gpu] backend = "sim" in {config}') is sim
    assert default.hint.endswith(' set [gpu] backend = "sim" in /etc/kiwi.toml') is sim


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


# ------------------------------------------------------------------ the stand-in


def test_nothing_is_called_before_the_first_query_and_init_happens_once(
    machine: Machine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kiwid.adapters.nvml")
    backend = NvmlBackend()
    assert standin._standin_calls == []
    try:
        backend.devices()
        backend.processes(0)
        backend.active_pids(0, 0.5)
        assert machine.calls("nvmlInitWithFlags") == 1
        assert standin._standin_refcount() == 1
        assert "NVML initialised, driver 580.159.04" in caplog.text
    finally:
        backend.close()
    assert standin._standin_refcount() == 0


def test_devices_give_index_uuid_name_and_total_memory(machine: Machine, gpus: NvmlBackend) -> None:
    second = {**copy.deepcopy(H200), "uuid": "GPU-second", "memory": {"total": 2**34}}
    machine.spec["devices"].append(second)
    machine.save()
    assert list(gpus.devices()) == [
        DeviceInfo(0, H200["uuid"], "NVIDIA H200", 150754820096),
        DeviceInfo(1, "GPU-second", "NVIDIA H200", 2**34),
    ]


def test_a_lost_gpu_is_left_out_of_the_devices_with_a_warning(
    machine: Machine, gpus: NvmlBackend, caplog: pytest.LogCaptureFixture
) -> None:
    machine.spec["devices"] = [
        {**copy.deepcopy(H200), "errors": {"*": "GPU_IS_LOST"}},
        {**copy.deepcopy(H200), "uuid": "GPU-healthy"},
        {**copy.deepcopy(H200), "errors": {"nvmlDeviceGetMemoryInfo": "RESET_REQUIRED"}},
    ]
    machine.save()
    assert [(d.index, d.uuid) for d in gpus.devices()] == [(1, "GPU-healthy")]
    assert "leaving out GPU 0 is lost: nvmlDeviceGetHandleByIndex: GPU is lost" in caplog.text
    assert "leaving out GPU 2 is lost: nvmlDeviceGetMemoryInfo: GPU requires restart" in caplog.text


def test_a_failing_device_count_is_a_backend_error_not_a_lost_gpu(
    machine: Machine, gpus: NvmlBackend
) -> None:
    machine.spec["errors"] = {"nvmlDeviceGetCount_v2": "UNKNOWN"}
    machine.save()
    with pytest.raises(GpuBackendError, match="nvmlDeviceGetCount failed: Unknown Error") as err:
        gpus.devices()
    assert type(err.value) is GpuBackendError


def test_an_unknown_driver_version_is_only_logged(
    machine: Machine, gpus: NvmlBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kiwid.adapters.nvml")
    machine.spec["errors"] = {"nvmlSystemGetDriverVersion": "NOT_SUPPORTED"}
    machine.save()
    assert len(gpus.devices()) == 1
    assert "driver version unknown: Not Supported" in caplog.text


def test_processes_use_v3_probed_once(
    machine: Machine, gpus: NvmlBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kiwid.adapters.nvml")
    expected = [GpuProcess(452, 1050673152), GpuProcess(474, 3198156800)]
    assert list(gpus.processes(0)) == expected
    assert list(gpus.processes(0)) == expected
    assert f"NVML: using {V3}" in caplog.text
    assert caplog.text.count("NVML: using") == 1
    assert machine.calls(V2) == 0


def test_processes_fall_back_to_v2_when_the_driver_lacks_v3(
    machine: Machine, gpus: NvmlBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kiwid.adapters.nvml")
    machine.spec["missing"] = [V3]
    machine.save()
    assert [p.pid for p in gpus.processes(0)] == [452, 474]
    assert [p.pid for p in gpus.processes(0)] == [452, 474]
    assert f"{V3} not found, trying an older version" in caplog.text
    assert f"NVML: using {V2}" in caplog.text
    assert machine.calls(V3) == 0  # the symbol lookup failed: nothing was called
    assert machine.calls(V2) == 2 * 2  # each query asks for the size first


def test_processes_fall_back_to_v2_when_the_binding_lacks_v3(
    machine: Machine, gpus: NvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(standin, V3)  # nvidia-ml-py before 11.525 has no _v3
    assert [p.pid for p in gpus.processes(0)] == [452, 474]
    assert machine.calls(V2) == 2


def test_no_version_of_the_process_list_is_fatal_with_a_hint(
    machine: Machine, gpus: NvmlBackend
) -> None:
    machine.spec["missing"] = [V3, V2]
    machine.save()
    with pytest.raises(DriverUnavailable, match="upgrade the NVIDIA driver") as err:
        gpus.processes(0)
    assert err.value.reason.startswith("nvmlDeviceGetComputeRunningProcesses: ")


def test_memory_not_available_and_no_processes(machine: Machine, gpus: NvmlBackend) -> None:
    machine.gpu["processes"][1]["usedGpuMemory"] = None  # NVML_VALUE_NOT_AVAILABLE
    machine.save()
    assert list(gpus.processes(0)) == [GpuProcess(452, 1050673152), GpuProcess(474, None)]
    machine.gpu["processes"] = []
    machine.save()
    assert list(gpus.processes(0)) == []


def test_the_raw_not_available_value_is_none_too() -> None:
    assert nvml._memory(pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value) is None
    assert nvml._memory(None) is None
    assert nvml._memory(3198156800) == 3198156800


def test_active_pids_are_those_with_sm_samples_in_the_window(
    machine: Machine, gpus: NvmlBackend
) -> None:
    machine.gpu["samples"] = [
        {"pid": 10, "timeStamp": NOW_US - 800_000, "smUtil": 90},  # before the window
        {"pid": 11, "timeStamp": NOW_US - 400_000, "smUtil": 35},
        {"pid": 12, "timeStamp": NOW_US - 100_000, "smUtil": 0, "memUtil": 40},  # no SM work
        {"pid": 13, "timeStamp": NOW_US - 50_000, "smUtil": 1},
    ]
    machine.save()
    assert gpus.active_pids(0, 0.5) == {11, 13}
    assert gpus.active_pids(0, 1.0) == {10, 11, 13}
    assert gpus.active_pids(0, 0.01) == frozenset()  # NVMLError_NotFound: no samples


def test_no_samples_is_empty_whether_not_found_or_pynvml_success_quirk(
    machine: Machine, gpus: NvmlBackend
) -> None:
    machine.gpu["samples"] = []
    machine.save()
    assert gpus.active_pids(0, 0.5) == frozenset()
    machine.gpu["no_samples"] = "SUCCESS"  # pynvml then raises NVMLError(NVML_SUCCESS)
    machine.save()
    with pytest.raises(standin.NVMLError) as quirk:
        standin.nvmlDeviceGetProcessUtilization(standin.nvmlDeviceGetHandleByIndex(0), 0)
    assert quirk.value.value == standin.NVML_SUCCESS
    assert gpus.active_pids(0, 0.5) == frozenset()


def test_unsupported_utilisation_is_a_backend_error(machine: Machine, gpus: NvmlBackend) -> None:
    machine.gpu["errors"] = {UTILIZATION: "NOT_SUPPORTED"}
    machine.save()
    with pytest.raises(GpuBackendError, match=f"{UTILIZATION} on GPU 0 failed: Not Supported"):
        gpus.active_pids(0, 0.5)


@pytest.mark.parametrize("code", ["GPU_IS_LOST", "RESET_REQUIRED", "UNKNOWN"])
def test_a_lost_gpu_raises_gpu_lost_and_its_handle_is_fetched_again(
    machine: Machine, gpus: NvmlBackend, code: str
) -> None:
    assert len(gpus.processes(0)) == 2
    assert machine.calls("nvmlDeviceGetHandleByIndex_v2") == 1
    machine.gpu["errors"] = {V3: code, UTILIZATION: code}
    machine.save()
    for query in (lambda: gpus.processes(0), lambda: gpus.active_pids(0, 0.5)):
        with pytest.raises(GpuLost) as lost:
            query()
        assert lost.value.index == 0
    assert machine.calls("nvmlDeviceGetHandleByIndex_v2") == 2  # evicted after each loss
    machine.gpu["errors"] = {}  # back on the bus
    machine.save()
    assert len(gpus.processes(0)) == 2
    assert gpus.active_pids(0, 0.5) == {452, 474}
    assert machine.calls("nvmlDeviceGetHandleByIndex_v2") == 3


def test_a_gpu_lost_before_its_handle_is_gpu_lost(machine: Machine, gpus: NvmlBackend) -> None:
    machine.gpu["errors"] = {"*": "GPU_IS_LOST"}
    machine.save()
    with pytest.raises(GpuLost, match="GPU 0 is lost: nvmlDeviceGetHandleByIndex: GPU is lost"):
        gpus.active_pids(0, 0.5)


def test_an_unknown_index_is_a_backend_error(gpus: NvmlBackend) -> None:
    with pytest.raises(GpuBackendError, match="on GPU 7 failed: Invalid Argument") as err:
        gpus.processes(7)
    assert type(err.value) is GpuBackendError


@pytest.mark.parametrize(
    ("init", "hint_words"),
    [
        ("DRIVER_NOT_LOADED", "modprobe nvidia"),
        ("NO_PERMISSION", "root"),
        ("LIB_RM_VERSION_MISMATCH", "reboot"),
    ],
)
def test_an_unusable_driver_is_fatal_with_a_hint(
    machine: Machine, gpus: NvmlBackend, init: str, hint_words: str
) -> None:
    machine.spec["init"] = init
    machine.save()
    with pytest.raises(DriverUnavailable, match="HINT: ") as err:
        gpus.devices()
    assert err.value.reason.startswith("nvmlInit: ")
    assert hint_words in err.value.hint
    gpus.close()
    assert machine.calls("nvmlShutdown") == 0  # never initialised: nothing to shut down


def test_no_library_is_fatal_with_the_sim_hint(
    machine: Machine, gpus: NvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(NVML_MACHINE)
    with pytest.raises(DriverUnavailable, match=r"libnvidia-ml\.so\.1 was not found") as err:
        gpus.processes(0)
    assert 'backend = "sim"' in err.value.hint


def test_any_other_init_failure_is_a_backend_error(machine: Machine, gpus: NvmlBackend) -> None:
    machine.spec["init"] = "UNKNOWN"
    machine.save()
    with pytest.raises(GpuBackendError, match="nvmlInit failed: Unknown Error") as err:
        gpus.devices()
    assert type(err.value) is GpuBackendError


def test_nvml_shut_down_under_kiwid_says_restart(machine: Machine, gpus: NvmlBackend) -> None:
    gpus.devices()
    standin.nvmlShutdown()  # someone else in the process balanced our nvmlInit
    with pytest.raises(DriverUnavailable, match="restart kiwid"):
        gpus.processes(0)


def test_close_shuts_down_once_and_the_backend_can_start_again(
    machine: Machine, gpus: NvmlBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kiwid.adapters.nvml")
    gpus.close()  # never started: nothing to do
    gpus.devices()
    gpus.close()
    gpus.close()
    assert machine.calls("nvmlShutdown") == 1
    assert standin._standin_refcount() == 0
    assert len(gpus.processes(0)) == 2  # lazily initialised again
    assert machine.calls("nvmlInitWithFlags") == 2
    machine.spec["errors"] = {"nvmlShutdown": "UNKNOWN"}
    machine.save()
    gpus.close()
    assert "nvmlShutdown failed: Unknown Error" in caplog.text


def test_nvml_is_shut_down_at_exit_without_close(tmp_path: Path) -> None:
    """A real interpreter exits without close(): the atexit hook shuts NVML down."""
    path = tmp_path / "nvml.json"
    write_machine(path, {"devices": [H200]})
    code = (
        "import atexit, pynvml\n"
        # registered first, so it runs after the adapter's hook
        "atexit.register(lambda: print('refcount at exit', pynvml._standin_refcount()))\n"
        "from kiwid.adapters.nvml import NvmlBackend\n"
        "print(len(NvmlBackend().devices()), 'GPU', pynvml.__file__)\n"
    )
    env = {**os.environ, NVML_MACHINE: str(path)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(DIRECTORY), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert f"1 GPU {DIRECTORY / 'pynvml.py'}" in out.stdout
    assert "refcount at exit 0" in out.stdout


def _samples_arrive_after_each_size_query(
    machine: Machine, monkeypatch: pytest.MonkeyPatch, arrivals: list[int]
) -> None:
    """Simulate processes whose first sample lands between pynvml's two calls."""
    query = standin._Library.nvmlDeviceGetProcessUtilization

    def driver(self: Any, handle: Any, utilization: Any, count: Any, last_seen: Any) -> int:
        ret = query(self, handle, utilization, count, last_seen)
        if utilization is None and arrivals:  # the size query
            sample = {"pid": arrivals.pop(0), "timeStamp": NOW_US - 1_000, "smUtil": 7}
            machine.gpu["samples"].append(sample)
            machine.save()
        return ret

    monkeypatch.setattr(standin._Library, UTILIZATION, driver)


def test_a_sample_landing_between_size_query_and_fetch_is_asked_again(
    machine: Machine, gpus: NvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    _samples_arrive_after_each_size_query(machine, monkeypatch, [99])
    assert gpus.active_pids(0, 0.5) == {452, 474, 99}
    assert machine.calls(UTILIZATION) == 4  # size, fetch (too small), size, fetch


def test_a_sample_count_that_keeps_growing_is_a_backend_error(
    machine: Machine, gpus: NvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    _samples_arrive_after_each_size_query(machine, monkeypatch, list(range(100, 110)))
    with pytest.raises(GpuBackendError, match="failed: Insufficient Size"):
        gpus.active_pids(0, 0.5)
    assert machine.calls(UTILIZATION) == 2 * (1 + nvml._UTILIZATION_RETRIES)


def test_free_memory_is_the_drivers_reading(machine: Machine, gpus: NvmlBackend) -> None:
    machine.gpu["memory"] = {"total": 150754820096, "used": 100 * 2**30}
    machine.save()
    assert gpus.free_memory(0) == 150754820096 - 100 * 2**30
    machine.gpu["errors"] = {"nvmlDeviceGetMemoryInfo": "GPU_IS_LOST"}
    machine.save()
    with pytest.raises(GpuLost):
        gpus.free_memory(0)
    with pytest.raises(GpuBackendError):
        gpus.free_memory(7)
