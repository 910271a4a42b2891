"""Registration with the kubelet, and the plugin's life around it.

The kubelet's device manager serves ``v1beta1.Registration`` on
``<device_plugin_dir>/kubelet.sock``. A plugin serves its own socket first, then
registers (version, endpoint, resource name, options); the kubelet then dials the
endpoint and opens ``ListAndWatch``. When the kubelet restarts it removes every
socket in the directory and creates ``kubelet.sock`` anew, and forgets the
plugins: `DevicePlugin` notices either change (the plugin's socket gone, or the
kubelet's socket a different file), serves a fresh socket and registers again.
"""

from __future__ import annotations

import logging
import threading

import grpc

from kiwid.adapters.deviceplugin._generated import api_pb2 as pb
from kiwid.adapters.deviceplugin.config import API_VERSION, PluginConfig
from kiwid.adapters.deviceplugin.devices import CdiNames, HealthSource, Inventory
from kiwid.adapters.deviceplugin.server import DevicePluginService, PluginServer, socket_identity

__all__ = ["REGISTER_METHOD", "DevicePlugin", "RegistrationError", "register"]

log = logging.getLogger("kiwid.deviceplugin")

REGISTER_METHOD = "/v1beta1.Registration/Register"


class RegistrationError(Exception):
    """The kubelet could not be reached, or refused the registration."""


def register(config: PluginConfig) -> None:
    """Register the plugin's endpoint and resource with the kubelet.

    Args:
        config: The plugin settings (kubelet socket, endpoint, resource name).

    Raises:
        RegistrationError: No kubelet answered within ``register_timeout_s``, or it
            refused (e.g. another plugin holds the resource name); the message has
            the gRPC status and details.
    """
    request = pb.RegisterRequest(
        version=API_VERSION,
        endpoint=config.endpoint,
        resource_name=config.resource_name,
        options=pb.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        ),
    )
    with grpc.insecure_channel(f"unix://{config.kubelet_socket}") as channel:
        call = channel.unary_unary(
            REGISTER_METHOD,
            request_serializer=pb.RegisterRequest.SerializeToString,
            response_deserializer=pb.Empty.FromString,
        )
        try:
            call(request, timeout=config.register_timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            code, details = getattr(exc, "code", None), getattr(exc, "details", None)
            status = code().name if callable(code) else "UNKNOWN"
            why = details() if callable(details) else str(exc)
            raise RegistrationError(
                f"registering {config.resource_name} with the kubelet at "
                f"{config.kubelet_socket} failed: {status}: {why}"
            ) from None


class DevicePlugin:
    """The device plugin's whole life: health checks, serving, registering again.

    Args:
        config: The plugin settings.
        health: Reports the GPUs and their health (``BackendHealth`` over NVML).
        cdi_names: Looks up CDI device names for ``Allocate``.

    Attributes:
        inventory: The managed GPUs and their health.
        registrations: How many times the plugin has registered so far.
    """

    def __init__(self, config: PluginConfig, health: HealthSource, cdi_names: CdiNames) -> None:
        self._config = config
        self._health = health
        self._cdi_names = cdi_names
        self.inventory = Inventory(config.replicas, config.gpus)
        self.registrations = 0

    def check_health(self) -> bool:
        """Ask the health source once and update the inventory.

        Returns:
            True if anything changed (the streams were woken).
        """
        try:
            gpus = self._health()
        except Exception:
            log.exception("the GPU health check failed; keeping the last known state")
            return False
        return self.inventory.update(gpus)

    def run(self, stop: threading.Event) -> None:
        """Serve, register and keep registered until ``stop`` is set.

        Waits for the kubelet's socket to appear, retries failed registrations
        with a backoff (up to ``retry_max_s``), and re-registers after a kubelet
        restart. Returns once ``stop`` is set, with the socket removed.

        Args:
            stop: Set it (e.g. from a signal handler) to end the plugin.

        Raises:
            PluginServerError: The plugin's socket path cannot be served.
        """
        config = self._config
        self.check_health()
        done = threading.Event()
        monitor = threading.Thread(
            target=self._monitor, args=(done,), name="kiwi-deviceplugin-health", daemon=True
        )
        monitor.start()
        server: PluginServer | None = None
        registered_to: tuple[int, int] | None = None
        backoff = config.watch_interval_s
        waiting_logged = False
        try:
            while not stop.is_set():
                kubelet = socket_identity(config.kubelet_socket)
                if kubelet is None:
                    if not waiting_logged:
                        log.info("waiting for the kubelet's socket %s", config.kubelet_socket)
                        waiting_logged = True
                    registered_to = None
                    stop.wait(config.watch_interval_s)
                    continue
                waiting_logged = False
                if server is not None and server.serving() and kubelet == registered_to:
                    stop.wait(config.watch_interval_s)
                    continue
                if server is not None:
                    log.info("the kubelet restarted (or removed our socket): registering again")
                    server.stop()
                server = PluginServer(
                    DevicePluginService(self.inventory, config, self._cdi_names),
                    config.endpoint_path,
                )
                server.start()
                try:
                    register(config)
                except RegistrationError as exc:
                    log.warning("%s; retrying in %g s", exc, backoff)
                    registered_to = None
                    stop.wait(backoff)
                    backoff = min(backoff * 2, config.retry_max_s)
                    continue
                registered_to = kubelet
                backoff = config.watch_interval_s
                self.registrations += 1
                log.info(
                    "registered %s (%d GPUs x %d replicas) with the kubelet, serving %s",
                    config.resource_name,
                    len(self.inventory.gpus()),
                    config.replicas,
                    config.endpoint_path,
                )
        finally:
            done.set()
            if server is not None:
                server.stop()
            monitor.join()

    def _monitor(self, done: threading.Event) -> None:
        while not done.wait(self._config.health_interval_s):
            self.check_health()
