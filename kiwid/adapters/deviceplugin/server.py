"""The kubelet's ``DevicePlugin`` service for Kiwi's shared GPUs, over a Unix socket.

``ListAndWatch`` sends the full device list at once and again whenever a GPU's
health changes (every message is the whole list, as the kubelet expects);
``GetPreferredAllocation`` and ``Allocate`` apply the policy in
`kiwid.adapters.deviceplugin.devices`. The method paths are bound here with grpc's
generic handlers (``/v1beta1.DevicePlugin/<Method>``); the messages are the protoc
output in ``_generated``. This package is the only importer of ``grpc``.
"""

from __future__ import annotations

import contextlib
import logging
import stat
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc

from kiwid.adapters.deviceplugin._generated import api_pb2 as pb
from kiwid.adapters.deviceplugin.config import PluginConfig
from kiwid.adapters.deviceplugin.devices import (
    HEALTHY,
    CdiNames,
    GpuHealth,
    Inventory,
    allocate_response,
    preferred_allocation,
)

__all__ = [
    "METHODS",
    "SERVICE",
    "DevicePluginService",
    "PluginServer",
    "PluginServerError",
    "socket_identity",
]

log = logging.getLogger("kiwid.deviceplugin")

SERVICE = "v1beta1.DevicePlugin"
METHODS = (
    "GetDevicePluginOptions",
    "ListAndWatch",
    "GetPreferredAllocation",
    "Allocate",
    "PreStartContainer",
)
_STREAM_RECHECK_S = 5.0  # a ListAndWatch stream re-checks that it is wanted this often


class DevicePluginService:
    """The ``v1beta1.DevicePlugin`` methods, served by one `PluginServer`.

    Args:
        inventory: The GPUs and their health.
        config: The plugin settings.
        cdi_names: Looks up CDI device names (``kiwid.adapters.cdi.find_devices``).
    """

    def __init__(self, inventory: Inventory, config: PluginConfig, cdi_names: CdiNames) -> None:
        self._inventory = inventory
        self._config = config
        self._cdi_names = cdi_names
        self._stopping = threading.Event()

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler that binds the five methods to their paths."""
        unary = grpc.unary_unary_rpc_method_handler
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "GetDevicePluginOptions": unary(
                    self.get_device_plugin_options,
                    request_deserializer=pb.Empty.FromString,
                    response_serializer=pb.DevicePluginOptions.SerializeToString,
                ),
                "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                    self.list_and_watch,
                    request_deserializer=pb.Empty.FromString,
                    response_serializer=pb.ListAndWatchResponse.SerializeToString,
                ),
                "GetPreferredAllocation": unary(
                    self.get_preferred_allocation,
                    request_deserializer=pb.PreferredAllocationRequest.FromString,
                    response_serializer=pb.PreferredAllocationResponse.SerializeToString,
                ),
                "Allocate": unary(
                    self.allocate,
                    request_deserializer=pb.AllocateRequest.FromString,
                    response_serializer=pb.AllocateResponse.SerializeToString,
                ),
                "PreStartContainer": unary(
                    self.pre_start_container,
                    request_deserializer=pb.PreStartContainerRequest.FromString,
                    response_serializer=pb.PreStartContainerResponse.SerializeToString,
                ),
            },
        )

    def stop(self) -> None:
        """End every ``ListAndWatch`` stream of this service."""
        self._stopping.set()
        self._inventory.wake()

    def get_device_plugin_options(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        """No PreStartContainer call needed; GetPreferredAllocation is available."""
        return pb.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )

    def list_and_watch(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        """Send the full device list now and after every change, until the stream ends."""
        if not context.add_callback(self._inventory.wake):
            return  # the call already ended
        generation, devices = self._inventory.snapshot()
        log.info("ListAndWatch: sending %d devices", len(devices))
        yield pb.ListAndWatchResponse(devices=devices)
        while context.is_active() and not self._stopping.is_set():
            if self._inventory.wait(generation, _STREAM_RECHECK_S) == generation:
                continue
            generation, devices = self._inventory.snapshot()
            unhealthy = sum(d.health != HEALTHY for d in devices)
            log.info("ListAndWatch: %d devices, %d unhealthy", len(devices), unhealthy)
            yield pb.ListAndWatchResponse(devices=devices)

    def get_preferred_allocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        """Prefer distinct, least loaded GPUs for each container (`preferred_allocation`)."""
        order = {g.uuid: g.index for g in self._inventory.gpus()}
        answers = [
            pb.ContainerPreferredAllocationResponse(
                deviceIDs=preferred_allocation(
                    list(r.available_deviceIDs),
                    list(r.must_include_deviceIDs),
                    r.allocation_size,
                    self._inventory.replicas,
                    order,
                )
            )
            for r in request.container_requests
        ]
        return pb.PreferredAllocationResponse(container_responses=answers)

    def allocate(
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateResponse:
        """Give each container the CDI devices (and environment) of its slots' GPUs.

        Each container also carries its device IDs, by which kiwid finds its pod.
        """
        answers = []
        for container in request.container_requests:
            gpus: dict[str, GpuHealth] = {}
            for device in container.devices_ids:
                gpu = self._inventory.gpu_of(device)
                if gpu is None:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown device {device!r}")
                gpus.setdefault(gpu.uuid, gpu)
            chosen = sorted(gpus.values(), key=lambda g: g.index)
            answers.append(
                allocate_response(chosen, self._config, self._cdi_names, container.devices_ids)
            )
            log.info(
                "Allocate %s -> %s",
                ",".join(container.devices_ids),
                ",".join(d.name for d in answers[-1].cdi_devices) or "no CDI devices",
            )
        return pb.AllocateResponse(container_responses=answers)

    def pre_start_container(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        """Nothing to do before a container starts (kiwi-hook does it)."""
        return pb.PreStartContainerResponse()


class PluginServerError(Exception):
    """The plugin's socket cannot be served (path in use by something else, no access)."""


class PluginServer:
    """A gRPC server for one `DevicePluginService` on one Unix socket.

    A kubelet restart removes the socket; the owner then stops this server and
    starts a new one (`kiwid.adapters.deviceplugin.register.DevicePlugin`).

    Args:
        service: What to serve.
        path: The socket path; a stale socket there is replaced.
        max_workers: Threads for calls; each ``ListAndWatch`` stream holds one.
    """

    def __init__(self, service: DevicePluginService, path: Path, max_workers: int = 16) -> None:
        self._service = service
        self._path = path
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self._identity: tuple[int, int] | None = None

    @property
    def path(self) -> Path:
        """The socket path."""
        return self._path

    def start(self) -> None:
        """Bind the socket and start serving.

        Raises:
            PluginServerError: The path is not a socket, or cannot be bound.
        """
        _remove_socket(self._path)
        server = grpc.server(
            futures.ThreadPoolExecutor(self._max_workers, thread_name_prefix="kiwi-deviceplugin"),
            handlers=[self._service.handler()],
        )
        try:
            bound = server.add_insecure_port(f"unix://{self._path}")
        except RuntimeError as exc:
            raise PluginServerError(f"cannot serve on {self._path}: {exc}") from None
        if not bound:
            raise PluginServerError(f"cannot serve on {self._path}")
        server.start()
        self._server = server
        self._identity = socket_identity(self._path)

    def serving(self) -> bool:
        """True while the socket file is still the one this server bound."""
        return self._server is not None and socket_identity(self._path) == self._identity

    def stop(self, grace_s: float = 1.0) -> None:
        """End the streams, stop serving and remove the socket if it is still ours.

        Args:
            grace_s: Time the calls in flight get to finish, seconds.
        """
        self._service.stop()
        if self._server is not None:
            self._server.stop(grace_s).wait(grace_s + 5)
            self._server = None
        if self._identity is not None and socket_identity(self._path) == self._identity:
            with contextlib.suppress(OSError):
                self._path.unlink()
        self._identity = None


def socket_identity(path: Path) -> tuple[int, int] | None:
    """(inode, change time) of a socket file: tells a recreated one apart."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_ctime_ns)


def _remove_socket(path: Path) -> None:
    """Remove a leftover socket file; refuse to remove anything else."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise PluginServerError(f"cannot use {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise PluginServerError(f"{path} exists and is not a socket; not removing it")
    path.unlink()
