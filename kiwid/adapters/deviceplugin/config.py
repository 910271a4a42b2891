"""The device plugin's settings (standard library only; built by ``kiwi-device-plugin``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["API_VERSION", "KUBELET_SOCKET", "PluginConfig"]

API_VERSION = "v1beta1"
"""The device plugin API version Kiwi speaks (``RegisterRequest.version``)."""
KUBELET_SOCKET = "kubelet.sock"
"""The kubelet's Registration socket, in the device plugin directory."""
_RESOURCE_RE = re.compile(
    r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


@dataclass(frozen=True)
class PluginConfig:
    """How the device plugin presents the node's GPUs to the kubelet.

    Attributes:
        resource_name: The extended resource pods ask for, ``vendor-domain/name``.
            Default ``kiwi.io/gpu`` (``kubernetes.resource`` in kiwi.toml).
        replicas: Shared slots advertised per GPU: at most this many containers
            are given one GPU, and Kiwi rotates them in exclusive time quanta.
            Default 4 (``kubernetes.replicas``); must be >= 1.
        device_plugin_dir: The kubelet's device plugin directory; its Registration
            socket ``kubelet.sock`` is there and the plugin's own socket goes there.
            Default ``/var/lib/kubelet/device-plugins``.
        gpus: The GPUs handed out, by index or UUID; empty (the default) means all.
            Leave the others to another device plugin (docs/kubernetes.md).
        cdi_kind: The CDI kind of Kiwi's devices (kiwid writes the spec).
        nvidia_kind: The CDI kind of NVIDIA's spec (``nvidia-ctk cdi generate``).
        cdi_dirs: The directories where CDI specs are looked up.
        health_interval_s: Seconds between two health checks of the GPUs (NVML).
        watch_interval_s: Seconds between two checks that the kubelet's socket and
            the plugin's own are still the ones registered (a kubelet restart
            recreates the first and removes the second).
        register_timeout_s: Limit for one ``Register`` call, seconds.
        retry_max_s: Longest wait between two failed registrations, seconds.
    """

    resource_name: str = "kiwi.io/gpu"
    replicas: int = 4
    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"
    gpus: tuple[str, ...] = ()
    cdi_kind: str = "kiwi.io/gpu"
    nvidia_kind: str = "nvidia.com/gpu"
    cdi_dirs: tuple[str, ...] = ("/etc/cdi", "/var/run/cdi")
    health_interval_s: float = 5.0
    watch_interval_s: float = 1.0
    register_timeout_s: float = 5.0
    retry_max_s: float = 10.0

    def __post_init__(self) -> None:
        """Check the values.

        Raises:
            ValueError: A value out of range, naming the field.
            TypeError: ``replicas`` is not an integer.
        """
        if not _RESOURCE_RE.match(self.resource_name):
            raise ValueError(
                f"resource {self.resource_name!r} is not an extended resource name "
                "such as 'kiwi.io/gpu'"
            )
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
            raise TypeError(f"replicas must be an integer, not {self.replicas!r}")
        if not 1 <= self.replicas <= 1024:
            raise ValueError(f"replicas must be between 1 and 1024, not {self.replicas}")
        for name in ("health_interval_s", "watch_interval_s", "register_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, not {getattr(self, name)!r}")
        if not self.retry_max_s >= self.watch_interval_s:
            raise ValueError("retry_max_s must be >= watch_interval_s")

    @property
    def endpoint(self) -> str:
        """The plugin's socket name in `device_plugin_dir`, e.g. ``kiwi.io_gpu.sock``."""
        return self.resource_name.replace("/", "_") + ".sock"

    @property
    def endpoint_path(self) -> Path:
        """The plugin's socket."""
        return Path(self.device_plugin_dir) / self.endpoint

    @property
    def kubelet_socket(self) -> Path:
        """The kubelet's Registration socket."""
        return Path(self.device_plugin_dir) / KUBELET_SOCKET
