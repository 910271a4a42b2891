"""The device plugin against a fake kubelet: real gRPC over Unix sockets, both ways.

The fake kubelet serves ``v1beta1.Registration`` on ``kubelet.sock`` in a private
device plugin directory and, like the kubelet, dials the endpoint a plugin
registers with a ``v1beta1.DevicePlugin`` client whose method paths come from the
proto's descriptor, not from the plugin's code. GPUs come from the simulated
backend; a GPU is lost with ``SimBackend.lose`` (NVML is not here).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Collection, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from kiwid.adapters import cdi
from kiwid.adapters.deviceplugin import (
    BackendHealth,
    DevicePlugin,
    GpuHealth,
    PluginConfig,
    RegistrationError,
    register,
)
from kiwid.adapters.deviceplugin._generated import api_pb2 as pb
from kiwid.adapters.deviceplugin.devices import Inventory, device_id, preferred_allocation
from kiwid.adapters.deviceplugin.server import (
    METHODS,
    SERVICE,
    DevicePluginService,
    PluginServer,
    PluginServerError,
)
from kiwid.adapters.gpu import DeviceInfo, DriverUnavailable, GpuBackendError, GpuLost, GpuProcess
from kiwid.adapters.sim import SimBackend
from tests.stand_ins import DIRECTORY as STANDINS
from tests.stand_ins import NVML_MACHINE

REPO = Path(__file__).resolve().parents[2]
UUID0, UUID1 = "GPU-sim-000000000000", "GPU-sim-000000000001"
WAIT_S = 10.0


def method_path(service: str, method: str) -> str:
    desc = pb.DESCRIPTOR.services_by_name[service]
    return f"/{desc.full_name}/{desc.methods_by_name[method].name}"


@dataclass
class FakeKubelet:
    """The kubelet's device manager, as much of it as a device plugin sees."""

    dir: Path
    refuse: list[str] = field(default_factory=list)  # messages for the next Registers
    registrations: queue.Queue[tuple[pb.RegisterRequest, bool]] = field(default_factory=queue.Queue)
    server: grpc.Server | None = None

    @property
    def socket(self) -> Path:
        return self.dir / "kubelet.sock"

    def start(self) -> None:
        def register(request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
            # "Serve before Register": the endpoint must already answer.
            serving = (self.dir / request.endpoint).exists()
            self.registrations.put((request, serving))
            if self.refuse:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.refuse.pop(0))
            return pb.Empty()

        handler = grpc.method_handlers_generic_handler(
            pb.DESCRIPTOR.services_by_name["Registration"].full_name,
            {
                "Register": grpc.unary_unary_rpc_method_handler(
                    register,
                    request_deserializer=pb.RegisterRequest.FromString,
                    response_serializer=pb.Empty.SerializeToString,
                )
            },
        )
        server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[handler])
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self.server = server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(0).wait(5)
            self.server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    def restart(self) -> None:
        """What a kubelet restart does: every socket in the directory goes, a new one comes."""
        self.stop()
        for path in self.dir.iterdir():
            if path.is_socket():
                path.unlink()
        self.start()

    def next_registration(self) -> tuple[pb.RegisterRequest, bool]:
        return self.registrations.get(timeout=WAIT_S)


class PluginClient:
    """The kubelet's side of the DevicePlugin service."""

    def __init__(self, endpoint: Path) -> None:
        self.channel = grpc.insecure_channel(f"unix://{endpoint}")

        def unary(name: str, req: Any, resp: Any) -> Any:
            return self.channel.unary_unary(
                method_path("DevicePlugin", name),
                request_serializer=req.SerializeToString,
                response_deserializer=resp.FromString,
            )

        self.options = unary("GetDevicePluginOptions", pb.Empty, pb.DevicePluginOptions)
        self.preferred = unary(
            "GetPreferredAllocation", pb.PreferredAllocationRequest, pb.PreferredAllocationResponse
        )
        self.allocate = unary("Allocate", pb.AllocateRequest, pb.AllocateResponse)
        self.pre_start = unary(
            "PreStartContainer", pb.PreStartContainerRequest, pb.PreStartContainerResponse
        )
        self._watch = self.channel.unary_stream(
            method_path("DevicePlugin", "ListAndWatch"),
            request_serializer=pb.Empty.SerializeToString,
            response_deserializer=pb.ListAndWatchResponse.FromString,
        )
        self.streams: list[Any] = []

    def list_and_watch(self) -> Any:
        stream = self._watch(pb.Empty(), timeout=60)
        self.streams.append(stream)
        return stream

    def close(self) -> None:
        for stream in self.streams:
            stream.cancel()
        self.channel.close()


def health_of(response: pb.ListAndWatchResponse) -> dict[str, str]:
    return {d.ID: d.health for d in response.devices}


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    # Unix socket paths are short (108 bytes): not pytest's long tmp_path.
    d = Path(tempfile.mkdtemp(prefix="kiwi-dp-", dir="/tmp"))
    yield d
    for path in d.iterdir():
        path.unlink()
    d.rmdir()


@pytest.fixture
def kubelet(plugin_dir: Path) -> Iterator[FakeKubelet]:
    k = FakeKubelet(plugin_dir)
    k.start()
    yield k
    k.stop()


@dataclass
class Running:
    plugin: DevicePlugin
    sim: SimBackend
    config: PluginConfig
    client: PluginClient


@pytest.fixture
def run_plugin(plugin_dir: Path) -> Iterator[Callable[..., Running]]:
    """Start a DevicePlugin in a thread (2 sim GPUs); always stopped afterwards."""
    stops: list[tuple[threading.Event, threading.Thread, PluginClient, SimBackend]] = []
    errors: list[BaseException] = []

    def start(
        cdi_names: Callable[[str], Collection[str]] = lambda kind: (),
        health_interval_s: float = 3600,
        **overrides: Any,
    ) -> Running:
        sim = SimBackend(devices=2)
        config = PluginConfig(
            **{
                "replicas": 2,
                "device_plugin_dir": str(plugin_dir),
                "watch_interval_s": 0.02,
                "health_interval_s": health_interval_s,
                "retry_max_s": 0.1,
                "register_timeout_s": 2,
                **overrides,
            }
        )
        plugin = DevicePlugin(config, BackendHealth(sim), cdi_names)
        stop = threading.Event()

        def body() -> None:
            try:
                plugin.run(stop)
            except BaseException as exc:
                errors.append(exc)
                raise

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        client = PluginClient(config.endpoint_path)
        stops.append((stop, thread, client, sim))
        return Running(plugin, sim, config, client)

    yield start
    for stop, thread, client, sim in stops:
        client.close()
        stop.set()
        thread.join(10)
        sim.close()
        assert not thread.is_alive()
    assert not errors


# --- registration and the service -----------------------------------------------------


def test_serves_then_registers_kiwi_gpu_with_its_options(
    kubelet: FakeKubelet, run_plugin: Callable[..., Running]
) -> None:
    running = run_plugin()

    request, serving = kubelet.next_registration()

    assert serving
    assert request.version == "v1beta1"
    assert request.endpoint == "kiwi.io_gpu.sock"
    assert request.resource_name == "kiwi.io/gpu"
    assert request.options.get_preferred_allocation_available
    assert not request.options.pre_start_required
    options = running.client.options(pb.Empty(), timeout=WAIT_S)
    assert options.get_preferred_allocation_available
    assert not options.pre_start_required
    assert running.client.pre_start(pb.PreStartContainerRequest(devices_ids=["x"]), timeout=5)


def test_list_and_watch_sends_the_full_list_and_again_when_a_gpu_is_lost(
    kubelet: FakeKubelet, run_plugin: Callable[..., Running]
) -> None:
    running = run_plugin()
    kubelet.next_registration()
    stream = running.client.list_and_watch()

    first = next(stream)
    assert health_of(first) == {
        f"{UUID0}::0": "Healthy",
        f"{UUID0}::1": "Healthy",
        f"{UUID1}::0": "Healthy",
        f"{UUID1}::1": "Healthy",
    }

    running.sim.lose(1)
    assert running.plugin.check_health()

    second = next(stream)
    assert health_of(second) == {
        f"{UUID0}::0": "Healthy",
        f"{UUID0}::1": "Healthy",
        f"{UUID1}::0": "Unhealthy",
        f"{UUID1}::1": "Unhealthy",
    }
    assert not running.plugin.check_health()  # nothing new: no message


def test_the_health_monitor_notices_a_lost_gpu_by_itself(
    kubelet: FakeKubelet, run_plugin: Callable[..., Running]
) -> None:
    running = run_plugin(health_interval_s=0.02)
    kubelet.next_registration()
    stream = running.client.list_and_watch()
    assert set(health_of(next(stream)).values()) == {"Healthy"}

    running.sim.lose(0)

    lost = health_of(next(stream))
    assert len(lost) == 4
    assert lost[f"{UUID0}::0"] == lost[f"{UUID0}::1"] == "Unhealthy"
    assert lost[f"{UUID1}::0"] == "Healthy"


def test_preferred_allocation_spreads_over_the_least_loaded_gpus(
    kubelet: FakeKubelet, run_plugin: Callable[..., Running]
) -> None:
    running = run_plugin(replicas=3)
    kubelet.next_registration()
    # GPU 0 has one slot given out already, GPU 1 none.
    available = [f"{UUID0}::1", f"{UUID0}::2", f"{UUID1}::0", f"{UUID1}::1", f"{UUID1}::2"]

    def ask(size: int, must: list[str] | None = None) -> list[str]:
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available,
                    must_include_deviceIDs=must or [],
                    allocation_size=size,
                )
            ]
        )
        answer = running.client.preferred(request, timeout=WAIT_S)
        return list(answer.container_responses[0].deviceIDs)

    assert ask(1) == [f"{UUID1}::0"]
    assert ask(2) == [f"{UUID1}::0", f"{UUID0}::1"]
    assert ask(1, must=[f"{UUID0}::2"]) == [f"{UUID0}::2"]
    assert ask(2, must=[f"{UUID0}::2"]) == [f"{UUID0}::2", f"{UUID1}::0"]


def test_allocate_returns_kiwi_and_nvidia_cdi_devices(
    kubelet: FakeKubelet, run_plugin: Callable[..., Running], plugin_dir: Path
) -> None:
    specs = plugin_dir / "cdi"
    gpus = [DeviceInfo(0, UUID0, "sim", 1), DeviceInfo(1, UUID1, "sim", 1)]
    cdi.write_spec(cdi.build_spec(gpus, "/usr/bin/kiwi-hook", True, "/run/kiwi/kiwid.sock"), specs)
    nvidia = {"kind": "nvidia.com/gpu", "devices": [{"name": UUID0}, {"name": "1"}]}
    (specs / "nvidia.json").write_text(json.dumps(nvidia))
    try:
        running = run_plugin(cdi_names=lambda kind: cdi.find_devices(kind, [specs]))
        kubelet.next_registration()

        answer = running.client.allocate(
            pb.AllocateRequest(
                container_requests=[
                    pb.ContainerAllocateRequest(devices_ids=[f"{UUID1}::1", f"{UUID0}::0"]),
                    pb.ContainerAllocateRequest(devices_ids=[f"{UUID0}::1", f"{UUID0}::0"]),
                ]
            ),
            timeout=WAIT_S,
        )
    finally:
        for path in specs.iterdir():
            path.unlink()
        specs.rmdir()

    both, one = answer.container_responses
    names = [d.name for d in both.cdi_devices]
    assert names == [
        f"kiwi.io/gpu={UUID0}",
        f"kiwi.io/gpu={UUID1}",
        f"nvidia.com/gpu={UUID0}",
        "nvidia.com/gpu=1",
    ]
    # The device IDs go into the container too: kiwid finds its pod by them.
    ids = f"{UUID1}::1,{UUID0}::0"
    assert dict(both.envs) == {"NVIDIA_VISIBLE_DEVICES": "void", "KIWI_DEVICE_IDS": ids}
    annotations = dict(both.annotations)
    assert annotations.pop("kiwi.io/device-ids") == ids
    ((key, value),) = annotations.items()
    assert key.startswith("cdi.k8s.io/kiwi-device-plugin_")
    assert value.split(",") == names
    # Two slots of one GPU are one GPU.
    assert [d.name for d in one.cdi_devices] == [f"kiwi.io/gpu={UUID0}", f"nvidia.com/gpu={UUID0}"]
    assert one.annotations["kiwi.io/device-ids"] == f"{UUID0}::1,{UUID0}::0"


def test_without_nvidias_cdi_spec_the_nvidia_runtime_gets_the_gpus_by_env(
    kubelet: FakeKubelet, run_plugin: Callable[..., Running]
) -> None:
    kiwi = {"0", "1", UUID0, UUID1}
    running = run_plugin(cdi_names=lambda kind: kiwi if kind == "kiwi.io/gpu" else ())
    kubelet.next_registration()

    answer = running.client.allocate(
        pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=[f"{UUID1}::0"])]
        ),
        timeout=WAIT_S,
    )

    (container,) = answer.container_responses
    assert [d.name for d in container.cdi_devices] == [f"kiwi.io/gpu={UUID1}"]
    assert dict(container.envs) == {
        "NVIDIA_VISIBLE_DEVICES": UUID1,
        "KIWI_DEVICE_IDS": f"{UUID1}::0",
    }


def test_allocate_refuses_unknown_devices(
    kubelet: FakeKubelet, run_plugin: Callable[..., Running]
) -> None:
    running = run_plugin()
    kubelet.next_registration()

    for bad in ("GPU-nope::0", f"{UUID0}::7", UUID0):
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=[bad])]
        )
        with pytest.raises(grpc.RpcError) as info:
            running.client.allocate(request, timeout=WAIT_S)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert bad in info.value.details()  # type: ignore[attr-defined]


# --- the kubelet's life ---------------------------------------------------------------


def test_a_kubelet_restart_is_followed_by_a_new_registration(
    kubelet: FakeKubelet, run_plugin: Callable[..., Running]
) -> None:
    running = run_plugin()
    kubelet.next_registration()
    old_stream = running.client.list_and_watch()
    next(old_stream)

    kubelet.restart()

    request, serving = kubelet.next_registration()
    assert serving
    assert request.resource_name == "kiwi.io/gpu"
    # The old stream ends with the old socket; the new socket has the full list.
    with pytest.raises((StopIteration, grpc.RpcError)):
        next(old_stream)
    client = PluginClient(running.config.endpoint_path)
    try:
        assert len(next(client.list_and_watch()).devices) == 4
    finally:
        client.close()
    assert running.plugin.registrations == 2


def test_the_plugin_waits_for_the_kubelet_and_retries_a_refused_registration(
    plugin_dir: Path, run_plugin: Callable[..., Running]
) -> None:
    running = run_plugin()  # no kubelet yet
    kubelet = FakeKubelet(plugin_dir, refuse=["resource busy"])
    kubelet.start()
    try:
        refused, _ = kubelet.next_registration()
        accepted, serving = kubelet.next_registration()
        assert refused == accepted
        assert serving
        client = PluginClient(running.config.endpoint_path)
        try:
            assert len(next(client.list_and_watch()).devices) == 4
        finally:
            client.close()
    finally:
        kubelet.stop()


def test_stopping_removes_the_plugins_socket(plugin_dir: Path, kubelet: FakeKubelet) -> None:
    config = PluginConfig(device_plugin_dir=str(plugin_dir), watch_interval_s=0.02)
    sim = SimBackend(devices=1)
    plugin = DevicePlugin(config, BackendHealth(sim), lambda kind: ())
    stop = threading.Event()
    thread = threading.Thread(target=plugin.run, args=(stop,))
    thread.start()
    try:
        kubelet.next_registration()
        assert config.endpoint_path.is_socket()
    finally:
        stop.set()
        thread.join(10)
    assert not config.endpoint_path.exists()
    assert kubelet.socket.exists()


def test_register_reports_an_absent_kubelet(plugin_dir: Path) -> None:
    config = PluginConfig(device_plugin_dir=str(plugin_dir), register_timeout_s=0.2)
    with pytest.raises(RegistrationError, match="kubelet"):
        register(config)


def test_the_plugin_socket_replaces_a_stale_socket_but_nothing_else(
    plugin_dir: Path,
) -> None:
    inventory = Inventory(1)
    service = DevicePluginService(inventory, PluginConfig(), lambda kind: ())
    path = plugin_dir / "plugin.sock"
    path.write_text("not a socket")
    with pytest.raises(PluginServerError, match="not a socket"):
        PluginServer(service, path).start()
    path.unlink()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    server = PluginServer(service, path)
    server.start()
    try:
        assert server.serving()
    finally:
        server.stop(0)
    assert not path.exists()


# --- pure parts -----------------------------------------------------------------------


def test_the_service_binds_every_method_of_the_proto() -> None:
    desc = pb.DESCRIPTOR.services_by_name["DevicePlugin"]
    assert desc.full_name == SERVICE == "v1beta1.DevicePlugin"
    assert set(METHODS) == set(desc.methods_by_name)
    assert pb.DESCRIPTOR.package == "v1beta1"


def test_the_generated_code_matches_the_proto() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "proto" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr


def test_preferred_allocation_without_enough_slots_gives_what_there_is() -> None:
    available = [device_id("A", 0), device_id("B", 0)]
    assert preferred_allocation(available, [], 3, replicas=1) == ["A::0", "B::0"]
    assert preferred_allocation([], [], 1, replicas=1) == []
    # Both free and equally loaded: the order (the GPU index) decides.
    assert preferred_allocation(available, [], 1, replicas=1, order={"B": 0, "A": 1}) == ["B::0"]
    # A GPU already used by this container comes after one it has not used.
    two = [device_id("A", 0), device_id("A", 1), device_id("B", 0)]
    assert preferred_allocation(two, ["A::0"], 2, replicas=2) == ["A::0", "B::0"]


def test_inventory_manages_only_the_configured_gpus() -> None:
    inventory = Inventory(2, only=["1"])
    assert inventory.update([GpuHealth(0, "A", True), GpuHealth(1, "B", True)])
    assert [d.ID for d in inventory.snapshot()[1]] == ["B::0", "B::1"]
    assert inventory.gpu_of("A::0") is None
    assert inventory.gpu_of("B::1") == GpuHealth(1, "B", True)
    assert not inventory.update([GpuHealth(0, "A", False), GpuHealth(1, "B", True)])


class FlakyBackend:
    """A GPU backend whose GPUs vanish, fail or whose driver goes away."""

    name = "flaky"

    def __init__(self) -> None:
        self.listed = [DeviceInfo(0, "A", "x", 1), DeviceInfo(1, "B", "x", 1)]
        self.lost: set[int] = set()
        self.slow: set[int] = set()
        self.driver_gone = False
        self.listing_fails = False

    def devices(self) -> list[DeviceInfo]:
        if self.driver_gone:
            raise DriverUnavailable("NVML: driver not loaded", "load it")
        if self.listing_fails:
            raise GpuBackendError("nvmlDeviceGetCount failed: Timeout")
        return self.listed

    def processes(self, index: int) -> list[GpuProcess]:
        if index in self.lost:
            raise GpuLost(index, "fell off the bus")
        if index in self.slow:
            raise GpuBackendError(f"nvmlDeviceGetComputeRunningProcesses on GPU {index}: Timeout")
        return []

    def active_pids(self, index: int, window_s: float) -> frozenset[int]:
        return frozenset()

    def free_memory(self, index: int) -> int:
        return 0

    def close(self) -> None:
        pass


def test_backend_health_keeps_vanished_gpus_as_unhealthy() -> None:
    backend = FlakyBackend()
    health = BackendHealth(backend)
    assert health() == [GpuHealth(0, "A", True), GpuHealth(1, "B", True)]

    backend.lost = {0}
    assert health() == [GpuHealth(0, "A", False), GpuHealth(1, "B", True)]

    # A transient error changes nothing, either way.
    backend.slow = {0, 1}
    assert health() == [GpuHealth(0, "A", False), GpuHealth(1, "B", True)]
    backend.listing_fails = True
    assert health() == [GpuHealth(0, "A", False), GpuHealth(1, "B", True)]
    backend.slow, backend.listing_fails = set(), False

    backend.lost = set()
    backend.listed = backend.listed[:1]
    assert health() == [GpuHealth(0, "A", True), GpuHealth(1, "B", False)]

    backend.driver_gone = True
    assert health() == [GpuHealth(0, "A", False), GpuHealth(1, "B", False)]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"resource_name": "gpu"}, "extended resource"),
        ({"resource_name": "kiwi.io/"}, "extended resource"),
        ({"replicas": 0}, "replicas"),
        ({"watch_interval_s": 0}, "watch_interval_s"),
    ],
)
def test_plugin_config_refuses_bad_values(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        PluginConfig(**kwargs)


def test_plugin_config_names_its_sockets() -> None:
    config = PluginConfig(resource_name="example.com/shared-gpu", device_plugin_dir="/d")
    assert config.endpoint == "example.com_shared-gpu.sock"
    assert config.endpoint_path == Path("/d/example.com_shared-gpu.sock")
    assert config.kubelet_socket == Path("/d/kubelet.sock")


# --- the console script -------------------------------------------------------------


def test_kiwi_device_plugin_registers_needs_no_kiwid_and_stops_on_sigterm(
    kubelet: FakeKubelet, plugin_dir: Path
) -> None:
    config = plugin_dir / "kiwi.toml"
    config.write_text(
        '[gpu]\nbackend = "sim"\n[gpu.sim]\ndevices = 3\n'
        '[control]\nsocket = "/nonexistent/kiwid.sock"\n'
        f'[kubernetes]\nreplicas = 2\ndevice_plugin_dir = "{plugin_dir}"\n'
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiwid.plugin.main", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        request, serving = kubelet.next_registration()
        assert serving
        client = PluginClient(plugin_dir / request.endpoint)
        try:
            assert len(next(client.list_and_watch()).devices) == 6
        finally:
            client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        log = proc.stdout.read()
        proc.stdout.close()
    assert "registered kiwi.io/gpu (3 GPUs x 2 replicas)" in log
    assert not (plugin_dir / request.endpoint).exists()


def test_kiwi_device_plugin_with_a_broken_config_fails_at_start(plugin_dir: Path) -> None:
    config = plugin_dir / "kiwi.toml"
    config.write_text("[kubernetes]\nreplicas = 0\n")
    out = subprocess.run(
        [sys.executable, "-m", "kiwid.plugin.main", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 3
    assert "replicas" in out.stderr
    assert os.listdir(plugin_dir) == ["kiwi.toml"]


def test_kiwi_device_plugin_without_a_gpu_names_its_config_file(plugin_dir: Path) -> None:
    config = plugin_dir / "node.toml"  # not /etc/kiwi.toml
    config.write_text(
        f'[gpu]\nbackend = "nvml"\n[kubernetes]\ndevice_plugin_dir = "{plugin_dir}"\n'
    )
    # The stand-in pynvml without a machine file: no libnvidia-ml.so.1, as on a machine
    # without a GPU.
    path = os.pathsep.join(filter(None, [str(STANDINS), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop(NVML_MACHINE, None)
    out = subprocess.run(
        [sys.executable, "-m", "kiwid.plugin.main", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env=env,
    )
    assert out.returncode == 3, out.stderr
    assert f'set [gpu] backend = "sim" in {config}\n' in out.stderr
    assert "/etc/kiwi.toml" not in out.stderr
