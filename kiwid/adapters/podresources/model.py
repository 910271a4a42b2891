"""What the PodResources adapter answers, and its error (no gRPC here)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ContainerRef", "PodResourcesError"]


@dataclass(frozen=True)
class ContainerRef:
    """A container of a pod, by its Kubernetes names.

    Attributes:
        namespace: The pod's namespace.
        pod: The pod's name.
        container: The container's name in the pod spec.
    """

    namespace: str
    pod: str
    container: str


class PodResourcesError(Exception):
    """The kubelet did not answer ``List``: no socket, kubelet down, API off or unimplemented.

    Attributes:
        status: The gRPC status name (``UNAVAILABLE``, ``UNIMPLEMENTED``,
            ``DEADLINE_EXCEEDED``...), or ``NO_SOCKET`` when the socket file is missing.
    """

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status
