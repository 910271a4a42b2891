"""A client of the kubelet's PodResources API: which container holds which device.

The kubelet serves ``v1.PodResourcesLister`` on a Unix socket
(``/var/lib/kubelet/pod-resources/kubelet.sock``). ``List`` names every active pod
of the node with, per container, the device IDs each device plugin's resource gave
it; for Kiwi's resource those are the slots its device plugin advertised
(``<uuid>::<n>``). `list_owners` asks once, with a bounded timeout, over a fresh
channel (a kubelet restart replaces the socket), and maps each device ID of one
resource to its `ContainerRef`. The method path is bound here; the messages are the
protoc output in ``_generated``.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from kiwid.adapters.podresources._generated import api_pb2 as pb
from kiwid.adapters.podresources.model import ContainerRef, PodResourcesError

__all__ = ["LIST_METHOD", "METHODS", "SERVICE", "list_owners", "owners_of"]

SERVICE = "v1.PodResourcesLister"
METHODS = ("List", "GetAllocatableResources", "Get")
LIST_METHOD = f"/{SERVICE}/List"
# The kubelet's own clients accept answers this large (a node full of pods).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def list_owners(socket: str | Path, resource: str, timeout_s: float) -> dict[str, ContainerRef]:
    """`kiwid.adapters.podresources.list_owners` (which documents it), with gRPC loaded.

    Raises:
        PodResourcesError: No socket, or the call failed.
    """
    path = Path(socket)
    if not path.exists():
        raise PodResourcesError(
            "NO_SOCKET", f"{path} does not exist (no kubelet on this node, or it is not running)"
        )
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    with grpc.insecure_channel(f"unix://{path}", options=options) as channel:
        call = channel.unary_unary(
            LIST_METHOD,
            request_serializer=pb.ListPodResourcesRequest.SerializeToString,
            response_deserializer=pb.ListPodResourcesResponse.FromString,
        )
        try:
            response = call(pb.ListPodResourcesRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            code, details = getattr(exc, "code", None), getattr(exc, "details", None)
            status = code().name if callable(code) else "UNKNOWN"
            why = details() if callable(details) else str(exc)
            raise PodResourcesError(
                status, f"the kubelet's PodResources List at {path} failed: {status}: {why}"
            ) from None
    return owners_of(response, resource)


def owners_of(response: pb.ListPodResourcesResponse, resource: str) -> dict[str, ContainerRef]:
    """Device ID -> container, for the devices of ``resource`` in a ``List`` answer.

    Args:
        response: The kubelet's answer.
        resource: The extended resource whose devices count.

    Returns:
        The mapping; a device listed twice (never, from a sane kubelet) keeps the
        first container.
    """
    owners: dict[str, ContainerRef] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            ref = ContainerRef(pod.namespace, pod.name, container.name)
            for devices in container.devices:
                if devices.resource_name == resource:
                    for device in devices.device_ids:
                        owners.setdefault(device, ref)
    return owners
