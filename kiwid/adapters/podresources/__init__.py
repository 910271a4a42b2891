"""The kubelet's PodResources API (v1 over gRPC): which pod holds which device.

* `model`: `ContainerRef` (namespace, pod, container) and `PodResourcesError`.
* `client`: asks ``v1.PodResourcesLister/List`` over the kubelet's socket and maps
  each device ID of one resource to the container that holds it.

Beside the device plugin adapter, the only importer of ``grpc``, and only at the
first `list_owners` call: kiwid asks the kubelet only for containers that carry
device IDs (given out by Kiwi's device plugin), so a kiwid anywhere else never
loads gRPC (about 12 MB). The messages come from ``proto/podresources/v1/api.proto``
through protoc (``_generated``, see ``proto/generate.py``).
"""

from __future__ import annotations

from pathlib import Path

from kiwid.adapters.podresources.model import ContainerRef, PodResourcesError

__all__ = ["DEFAULT_TIMEOUT_S", "ContainerRef", "PodResourcesError", "list_owners"]

DEFAULT_TIMEOUT_S = 2.0


def list_owners(
    socket: str | Path, resource: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> dict[str, ContainerRef]:
    """Ask the kubelet which container holds each device ID of ``resource`` now.

    Blocks for at most ``timeout_s``: call it off an event loop.

    Args:
        socket: The kubelet's PodResources socket.
        resource: The extended resource, e.g. ``kiwi.io/gpu``; others are skipped.
        timeout_s: The longest the call may take, seconds (connecting included).

    Returns:
        Device ID -> the container it was given to; empty when no pod holds one.

    Raises:
        PodResourcesError: The socket is missing, or the call failed (kubelet down
            or restarting, the API not served, too slow); its message says which.
    """
    from kiwid.adapters.podresources import client  # noqa: PLC0415 - loads gRPC on first use

    return client.list_owners(socket, resource, timeout_s)
