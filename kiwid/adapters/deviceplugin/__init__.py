"""Kiwi's kubelet device plugin (API v1beta1 over gRPC); the only importer of ``grpc``.

* `config`: `PluginConfig`, the settings (``[kubernetes]`` in kiwi.toml).
* `devices`: slots per GPU, their health (`BackendHealth` over a GPU backend), the
  preferred allocation and ``Allocate``'s answer (CDI device names); no gRPC.
* `server`: the ``DevicePlugin`` gRPC service on the plugin's Unix socket.
* `register`: registration with the kubelet and `DevicePlugin`, the plugin's life
  (serve, register, re-register after a kubelet restart).

The messages come from ``proto/deviceplugin/v1beta1/api.proto`` through protoc
(``_generated``, see ``proto/generate.py``).
"""

from __future__ import annotations

from kiwid.adapters.deviceplugin.config import API_VERSION, PluginConfig
from kiwid.adapters.deviceplugin.devices import (
    HEALTHY,
    UNHEALTHY,
    BackendHealth,
    GpuHealth,
    Inventory,
)
from kiwid.adapters.deviceplugin.register import DevicePlugin, RegistrationError, register
from kiwid.adapters.deviceplugin.server import PluginServerError

__all__ = [
    "API_VERSION",
    "HEALTHY",
    "UNHEALTHY",
    "BackendHealth",
    "DevicePlugin",
    "GpuHealth",
    "Inventory",
    "PluginConfig",
    "PluginServerError",
    "RegistrationError",
    "register",
]
