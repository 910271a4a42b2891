"""A fake kubelet PodResources service: real gRPC on a Unix socket, for adapter and daemon tests.

It serves ``v1.PodResourcesLister`` (``List``, ``GetAllocatableResources``, ``Get``)
with method paths taken from the proto's descriptor, not from the client's code.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kiwid.adapters.podresources._generated import api_pb2 as pb

WAIT_S = 10.0


def pod(
    namespace: str, name: str, containers: Mapping[str, Mapping[str, Sequence[str]]]
) -> pb.PodResources:
    """A pod's resources: ``{container: {resource: [device IDs]}}``."""
    return pb.PodResources(
        name=name,
        namespace=namespace,
        containers=[
            pb.ContainerResources(
                name=container,
                devices=[
                    pb.ContainerDevices(resource_name=resource, device_ids=list(ids))
                    for resource, ids in resources.items()
                ],
            )
            for container, resources in containers.items()
        ],
    )


@dataclass
class FakePodResources:
    """The kubelet's PodResources service, as much of it as a client sees.

    Attributes:
        path: The socket it serves on.
        pods: What ``List`` answers (change it between calls at will).
        with_api: ``False``: a kubelet that answers gRPC but lacks this API.
        hold: When set, ``List`` waits for it to be set (a kubelet too slow to answer).
        calls: The methods called, in order (``List``, ``Get``...).
    """

    path: Path
    pods: list[pb.PodResources] = field(default_factory=list)
    with_api: bool = True
    hold: threading.Event | None = None
    calls: queue.Queue[str] = field(default_factory=queue.Queue)
    server: grpc.Server | None = None

    def start(self) -> None:
        handlers = [self._handler()] if self.with_api else []
        server = grpc.server(futures.ThreadPoolExecutor(4), handlers=handlers)
        server.add_insecure_port(f"unix://{self.path}")
        server.start()
        self.server = server

    def stop(self) -> None:
        if self.hold is not None:
            self.hold.set()
        if self.server is not None:
            self.server.stop(0).wait(5)
            self.server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def next_call(self) -> str:
        return self.calls.get(timeout=WAIT_S)

    def _handler(self) -> grpc.GenericRpcHandler:
        desc = pb.DESCRIPTOR.services_by_name["PodResourcesLister"]

        def unary(method: str, request: Any, response: Any, body: Any) -> Any:
            def call(req: Any, context: grpc.ServicerContext) -> Any:
                self.calls.put(method)
                return body(req, context)

            return grpc.unary_unary_rpc_method_handler(
                call,
                request_deserializer=request.FromString,
                response_serializer=response.SerializeToString,
            )

        return grpc.method_handlers_generic_handler(
            desc.full_name,
            {
                "List": unary(
                    "List", pb.ListPodResourcesRequest, pb.ListPodResourcesResponse, self._list
                ),
                "GetAllocatableResources": unary(
                    "GetAllocatableResources",
                    pb.AllocatableResourcesRequest,
                    pb.AllocatableResourcesResponse,
                    self._allocatable,
                ),
                "Get": unary(
                    "Get", pb.GetPodResourcesRequest, pb.GetPodResourcesResponse, self._get
                ),
            },
        )

    def _list(self, request: Any, context: grpc.ServicerContext) -> pb.ListPodResourcesResponse:
        if self.hold is not None:
            self.hold.wait(WAIT_S)
        return pb.ListPodResourcesResponse(pod_resources=self.pods)

    def _allocatable(
        self, request: Any, context: grpc.ServicerContext
    ) -> pb.AllocatableResourcesResponse:
        devices = [d for p in self.pods for c in p.containers for d in c.devices]
        return pb.AllocatableResourcesResponse(devices=devices)

    def _get(
        self, request: pb.GetPodResourcesRequest, context: grpc.ServicerContext
    ) -> pb.GetPodResourcesResponse:
        for p in self.pods:
            if (p.namespace, p.name) == (request.pod_namespace, request.pod_name):
                return pb.GetPodResourcesResponse(pod_resources=p)
        context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.pod_name} not found")
        raise AssertionError  # abort raises
