"""Kiwi configuration: grouped frozen settings and their TOML loader."""

from __future__ import annotations

from kiwid.config.loader import (
    DEFAULT_PATH,
    ConfigError,
    LoadedConfig,
    check_config_main,
    load_config,
    parse_config,
    service_limits,
)
from kiwid.config.reader import SHORT_TQ_S
from kiwid.config.schema import (
    BACKENDS,
    LOG_LEVELS,
    MODES,
    ControlSettings,
    DaemonSettings,
    EffectivePolicy,
    GpuOverride,
    GpuOverrides,
    GpuSettings,
    KubernetesSettings,
    MemorySettings,
    MetricsSettings,
    SchedulerSettings,
    ServiceLimits,
    Settings,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_PATH",
    "LOG_LEVELS",
    "MODES",
    "SHORT_TQ_S",
    "ConfigError",
    "ControlSettings",
    "DaemonSettings",
    "EffectivePolicy",
    "GpuOverride",
    "GpuOverrides",
    "GpuSettings",
    "KubernetesSettings",
    "LoadedConfig",
    "MemorySettings",
    "MetricsSettings",
    "SchedulerSettings",
    "ServiceLimits",
    "Settings",
    "check_config_main",
    "load_config",
    "parse_config",
    "service_limits",
]
