"""``kiwi-device-plugin``: hand Kiwi's shared GPUs to Kubernetes pods.

Runs beside kiwid on a GPU node (systemd unit ``kiwi-device-plugin.service``, or a
DaemonSet that mounts the kubelet's device plugin directory). Reads the
``[kubernetes]`` and ``[gpu]`` tables of /etc/kiwi.toml, advertises ``replicas``
slots of resource ``kiwi.io/gpu`` per GPU, watches their health through NVML and
answers ``Allocate`` with CDI device names (docs/kubernetes.md).

It needs no kiwid: it keeps serving while kiwid restarts (kiwid's CDI spec stays
in place, and kiwi-hook lets containers start ungated while kiwid is away). It
opens no CUDA context, so it uses no GPU of its own.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from kiwid import __version__
from kiwid.adapters import cdi
from kiwid.adapters.deviceplugin import BackendHealth, DevicePlugin, PluginConfig, PluginServerError
from kiwid.adapters.gpu import DriverUnavailable, GpuBackend, GpuBackendError
from kiwid.config import ConfigError, Settings, load_config

__all__ = ["main", "plugin_config"]

log = logging.getLogger("kiwid.deviceplugin")

DEFAULT_CONFIG = Path("/etc/kiwi.toml")
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_STARTUP = 3

_EPILOG = """\
Settings come from the [kubernetes] table of the config file: resource (default
"kiwi.io/gpu"), replicas (4 slots per GPU), device_plugin_dir
(/var/lib/kubelet/device-plugins), cdi_dir (/var/run/cdi); and [gpu] backend.

Exit codes: 0 stopped by SIGTERM/SIGINT, 1 runtime failure, 2 usage error,
3 start-up failure (invalid config, no NVIDIA driver)."""


def plugin_config(settings: Settings, device_plugin_dir: str | None = None) -> PluginConfig:
    """Build the plugin's settings from kiwid's.

    Args:
        settings: The loaded kiwi.toml.
        device_plugin_dir: Overrides ``kubernetes.device_plugin_dir``.

    Returns:
        The plugin settings.

    Raises:
        ValueError: A value the plugin cannot use.
    """
    k8s = settings.kubernetes
    return PluginConfig(
        resource_name=k8s.resource,
        replicas=k8s.replicas,
        device_plugin_dir=device_plugin_dir or k8s.device_plugin_dir,
        gpus=k8s.gpus,
        cdi_dirs=tuple(dict.fromkeys([*cdi.CDI_DIRS, k8s.cdi_dir])),
    )


def _make_backend(settings: Settings, config_path: Path) -> GpuBackend:
    """The configured GPU backend (only its device list and health are used).

    Args:
        settings: The loaded configuration.
        config_path: The file it came from, which the hint for a machine without a
            GPU names.
    """
    if settings.gpu.backend == "sim":
        from kiwid.adapters.sim import SimBackend  # noqa: PLC0415 - only when asked for

        return SimBackend(
            devices=settings.gpu.sim_devices,
            memory_bytes=int(settings.gpu.sim_memory_gib * 2**30),
        )
    from kiwid.adapters.nvml import NvmlBackend  # noqa: PLC0415 - loads libnvidia-ml lazily

    return NvmlBackend(config=config_path)


@contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM and SIGINT only set ``stop``; the previous handlers come back after."""

    def record(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, record) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kiwi-device-plugin`` until SIGTERM or SIGINT.

    Args:
        argv: The arguments after the program name; ``None`` means ``sys.argv[1:]``.

    Returns:
        The exit status (see ``--help``).
    """
    parser = argparse.ArgumentParser(
        prog="kiwi-device-plugin",
        description="Kubelet device plugin for Kiwi's shared GPUs (resource kiwi.io/gpu).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="config file (default %(default)s)"
    )
    parser.add_argument(
        "--device-plugin-dir",
        metavar="DIR",
        help="the kubelet's device plugin directory (default: kubernetes.device_plugin_dir)",
    )
    parser.add_argument("--version", action="version", version=f"kiwi-device-plugin {__version__}")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_OK if not exc.code else EXIT_USAGE
    logging.basicConfig(level=logging.INFO, format="[%(levelname)s] %(message)s", force=True)
    try:
        settings = load_config(args.config).settings
        config = plugin_config(settings, args.device_plugin_dir)
    except (ConfigError, ValueError, TypeError) as exc:
        log.error("Cannot start: %s", exc)
        return EXIT_STARTUP
    logging.getLogger().setLevel(settings.daemon.log_level.upper())
    backend = _make_backend(settings, args.config)
    try:
        devices = backend.devices()
    except (DriverUnavailable, GpuBackendError) as exc:
        log.error("Cannot start: %s", exc)
        backend.close()
        return EXIT_STARTUP
    log.info(
        "kiwi-device-plugin %s: %d GPUs (%s backend), %d replicas each, resource %s",
        __version__,
        len(devices),
        backend.name,
        config.replicas,
        config.resource_name,
    )
    plugin = DevicePlugin(
        config, BackendHealth(backend), lambda kind: cdi.find_devices(kind, config.cdi_dirs)
    )
    stop = threading.Event()
    try:
        with _stop_on_signals(stop):
            plugin.run(stop)
    except PluginServerError as exc:
        log.error("%s", exc)
        return EXIT_FAILURE
    finally:
        backend.close()
    log.info("kiwi-device-plugin stopped")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
