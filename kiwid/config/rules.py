"""What each TOML key accepts: one :class:`Rule` per key, grouped by table.

The loader (:mod:`kiwid.config.loader`) walks a document and asks these rules;
they know nothing of files, and report nothing themselves.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kiwid.config.schema import (
    ADMISSIONS,
    BACKENDS,
    GATES,
    LOG_LEVELS,
    MODES,
    NEWCOMERS,
    PARKS,
    SWAPS,
    ServiceLimits,
)
from kiwid.config.tenant_rules import TENANT_SWAPS
from kiwid.core.model import TenantPolicy
from kiwid.core.quantity import MEMORY_RANGE, QuantityError, declared_bytes

SOCKET_PATH_MAX_BYTES = 107
"""The longest Unix socket path, in bytes: ``sun_path`` is 108 including the NUL."""

_INT64 = range(-(2**63), 2**63)  # TOML integers; tomllib accepts longer ones


def _no_objection(_: Any) -> str | None:
    return None


@dataclass(frozen=True)
class Rule:
    """How one TOML value is checked, and which dataclass field it fills."""

    attr: str
    kind: type[bool] | type[int] | type[float] | type[str] | type[list[Any]] | tuple[type, ...]
    """Its TOML type (float accepts ints too); a tuple: any of them."""
    expects: str  # completes "must be ..."
    accepts: Callable[[Any], bool]
    objects: Callable[[Any], str | None] = _no_objection
    """Asked first, for a value of the right kind: the whole reason it is refused
    (``"must not ..."``), or ``None`` to go on to ``accepts``."""
    convert: Callable[[Any], Any] | None = None
    """What an accepted value is stored as (``None``: as its kind says)."""


def _above_zero(attr: str, unit: str) -> Rule:
    """A finite number of ``unit`` > 0; integers are accepted."""
    return Rule(attr, float, f"a number of {unit} > 0", lambda v: 0 < v < math.inf)


def _within(
    attr: str, kind: type[int] | type[float], unit: str, low: float, high: float | None = None
) -> Rule:
    """A number of ``kind`` from ``low`` to ``high`` inclusive; no ``high``: no upper bound."""
    noun = "an integer number" if kind is int else "a number"
    bounds = f">= {_num(low)}" if high is None else f"from {_num(low)} to {_num(high)}"
    top = math.inf if high is None else high
    return Rule(attr, kind, f"{noun} of {unit} {bounds}", lambda v: low <= v <= top)


def _num(value: float) -> str:
    """A bound as a message writes it: whole numbers in full (31536000, not 3.1536e+07)."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _choice(attr: str, options: Collection[str]) -> Rule:
    return Rule(attr, str, "one of " + ", ".join(map(json.dumps, options)), options.__contains__)


def _abs_path(attr: str, max_bytes: int = 4095, empty: str = "") -> Rule:
    """An absolute path of at most ``max_bytes`` in UTF-8, without control characters.

    With ``empty`` (what ``""`` means, e.g. ``"no CDI spec"``) the empty string is
    accepted too.
    """
    expects = f"an absolute path of at most {max_bytes} bytes"
    expects += f', or "" ({empty})' if empty else ""

    def accepts(value: str) -> bool:
        if not value:
            return bool(empty)
        return value[:1] == "/" and len(value.encode()) <= max_bytes

    return Rule(attr, str, expects, accepts, _unprintable_path)


def _unprintable_path(value: str) -> str | None:
    """Why ``value`` cannot be a path kiwid creates, shows or passes on, if it cannot.

    A NUL ends the path early in every system call (Python refuses it outright),
    and other control characters make log lines and ``kiwictl`` output lie.
    Unpaired surrogates cannot even be encoded; only text from no file has them.
    """
    bad = {c: unicodedata.category(c) for c in value if unicodedata.category(c) in ("Cc", "Cs")}
    if not bad:
        return None
    what = " or ".join(
        name
        for category, name in (("Cc", "control characters"), ("Cs", "unpaired surrogates"))
        if category in bad.values()
    )
    return f"must not contain {what} (found {', '.join(f'U+{ord(c):04X}' for c in bad)})"


OVERRIDE_RULES = {
    "tq": _above_zero("tq", "seconds"),
    "idle_release": _above_zero("idle_release", "seconds"),
    "mode": _choice("mode", MODES),
}
SCHEDULER_RULES = {
    **OVERRIDE_RULES,
    "handover_allowance": _above_zero("handover_allowance", "seconds"),
    "preempt_after": _within("preempt_after", float, "seconds", 0, 86400),
    "max_wait": _within("max_wait", float, "seconds (0: no bound)", 0, 86400),
}
GPU_RULES = {
    "backend": _choice("backend", BACKENDS),
    "poll_interval": _within("poll_interval", float, "seconds", 0.05, 60),
    "gate": _choice("gate", GATES),
    "gate_timeout": _within("gate_timeout", float, "seconds", 0.1, 60),
    "driver_timeout": _within("driver_timeout", float, "seconds", 1, 3600),
}
SIM_RULES = {
    "devices": _within("sim_devices", int, "devices", 1, 64),
    "memory_gib": _above_zero("sim_memory_gib", "GiB"),
    "swap_out_gbps": _above_zero("sim_swap_out_gbps", "GB/s"),
    "swap_in_gbps": _above_zero("sim_swap_in_gbps", "GB/s"),
}
CONTROL_RULES = {
    "socket": _abs_path("socket", SOCKET_PATH_MAX_BYTES),
    "admin_group": Rule("admin_group", str, "a group name", lambda v: bool(v) and v.isprintable()),
}
DAEMON_RULES = {
    "state_dir": _abs_path("state_dir"),
    "shutdown_timeout": _above_zero("shutdown_timeout", "seconds"),
    "log_level": _choice("log_level", LOG_LEVELS),
}
MEMORY_RULES = {
    "reserve_mib": _within("reserve_mib", int, "MiB", 0),
    "swap": _choice("swap", SWAPS),
    "park": _choice("park", PARKS),
    "host_floor_mib": _within("host_floor_mib", int, "MiB", 0),
    "checkpoint_lanes": _within("checkpoint_lanes", int, "concurrent checkpoints", 1, 8),
    "newcomer": _choice("newcomer", NEWCOMERS),
    "checkpoint_retry_after": _within("checkpoint_retry_after", float, "seconds", 0, 365 * 86400),
}
METRICS_RULES = {
    "listen": Rule("listen", str, '"host:port" or "" (off)', lambda v: v == "" or _host_port(v)),
}
KUBERNETES_RULES = {
    "resource": Rule(
        "resource",
        str,
        'an extended resource name like "kiwi.io/gpu"',
        lambda v: bool(
            re.fullmatch(
                r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", v
            )
        ),
    ),
    "replicas": _within("replicas", int, "slots", 1, 64),
    "admission": _choice("admission", ADMISSIONS),
    "cdi_dir": _abs_path("cdi_dir", empty="no CDI spec"),
    "device_plugin_dir": _abs_path("device_plugin_dir"),
    "gpus": Rule(
        "gpus",
        list,
        'a list of GPU indices or UUIDs, e.g. ["0", "GPU-..."] ([] for all)',
        lambda v: all(isinstance(g, str) and g for g in v),
    ),
    "pod_resources_socket": _abs_path(
        "pod_resources_socket", SOCKET_PATH_MAX_BYTES, empty="no PodResources lookups"
    ),
}


def _glob(attr: str) -> Rule:
    return Rule(
        attr,
        str,
        "a non-empty glob (*, ?, [...]) of printable characters",
        lambda v: bool(v) and v.isprintable() and len(v) <= 1024,
    )


MATCH_RULES = {
    key: _glob(key) for key in ("name", "pod", "namespace", "container_id", "cgroup", "unit")
}


def _weight(attr: str) -> Rule:
    """A weight as the core takes it (its range and words are ``TenantPolicy``'s)."""
    return Rule(
        attr,
        float,
        TenantPolicy.WEIGHT_RANGE,
        lambda v: TenantPolicy.weight_refusal(v) is None,
    )


def _priority(attr: str) -> Rule:
    """A priority as the core takes it."""
    return Rule(
        attr,
        int,
        TenantPolicy.PRIORITY_RANGE,
        lambda v: TenantPolicy.priority_refusal(v) is None,
    )


def _memory(attr: str) -> Rule:
    """GPU memory per GPU: a Kubernetes quantity (``"40Gi"``) or bytes, as the core reads it."""
    return Rule(
        attr,
        (str, int),
        MEMORY_RANGE,
        lambda v: True,  # what objects() let through is a declaration
        _memory_objection,
        convert=declared_bytes,
    )


def _memory_objection(value: str | int) -> str | None:
    try:
        declared_bytes(value)
    except QuantityError as err:
        return f"must be {MEMORY_RANGE}: {err}"
    return None


TENANT_RULES = {
    "weight": _weight("weight"),
    "priority": _priority("priority"),
    "tq": _above_zero("tq", "seconds"),
    "swap": _choice("swap", TENANT_SWAPS),
    "park": Rule("park", bool, "true or false", lambda v: True),
    "max_weight": _weight("max_weight"),
    "max_priority": _priority("max_priority"),
    "memory": _memory("memory"),
    "max_memory": _memory("max_memory"),
}
SECTIONS = (
    "scheduler",
    "gpu",
    "control",
    "daemon",
    "memory",
    "metrics",
    "kubernetes",
    "tenants",
)


def _host_port(value: str) -> bool:
    """Whether ``value`` is ``host:port`` (IPv6 in brackets) with a port 0-65535."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        return False
    if host.startswith("["):
        return host.endswith("]") and len(host) > 2
    return ":" not in host


def has_kind(value: object, kind: type | tuple[type, ...]) -> bool:
    """Whether ``value`` has TOML type ``kind`` (or one of them, for a tuple).

    A bool is no number, an int is a float. An integer beyond 64 bits is no TOML
    integer (and may not fit in a float).
    """
    if isinstance(kind, tuple):
        return any(has_kind(value, one) for one in kind)
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, int) and value not in _INT64:
        return False
    wanted = (int, float) if kind is float else kind
    return isinstance(value, wanted) and not isinstance(value, bool)


def type_name(value: object) -> str:
    """Name ``value``'s TOML type as a message does: ``"an integer"``, ``"a table"``..."""
    if isinstance(value, int) and not isinstance(value, bool) and value not in _INT64:
        return "an integer beyond 64 bits"
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}
    names |= {list: "an array", dict: "a table"}
    return names.get(type(value), "a date or time")


def service_rules(
    service: ServiceLimits,
) -> tuple[Mapping[str, Rule], Mapping[str, Rule]]:
    """The ``[gpu]`` and ``[daemon]`` rules, with the bounds the service sets."""
    gate = service.max_gate_timeout_s
    gate_why = (
        f"half the {service.watchdog_s:g} s service watchdog ({service.watchdog_source}): "
        f"kiwid pings the watchdog every {gate:g} s from the loop that waits for gates, so a "
        "longer gate could let the watchdog expire, and systemd would kill kiwid"
    )
    stop = service.max_shutdown_timeout_s
    stop_why = (
        f"the shipped unit gives a stop {service.stop_timeout_s:g} s "
        f"(TimeoutStopSec={service.stop_timeout_s:g}s) and then runs `kiwid recover` "
        "(ExecStopPost=) to thaw what a forced stop left gated, which needs the last "
        f"{service.recover_s:g} s"
    )
    gpu = dict(GPU_RULES)
    gpu["gate_timeout"] = replace(gpu["gate_timeout"], objects=_at_most(gate, f", {gate_why}"))
    daemon = dict(DAEMON_RULES)
    daemon["shutdown_timeout"] = replace(
        daemon["shutdown_timeout"], objects=_at_most(stop, f": {stop_why}")
    )
    return gpu, daemon


def _at_most(limit: float, why: str) -> Callable[[Any], str | None]:
    """An objection to numbers above ``limit`` seconds; ``why`` ends the message.

    Numbers below the rule's own range, and NaN, are left to its ``accepts``.
    """
    return lambda value: f"must be at most {limit:g} s{why}" if value > limit else None
