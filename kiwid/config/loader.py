"""TOML text to validated :class:`~kiwid.config.schema.Settings`.

Every problem in a file is collected and reported together, one line each, naming
the file, the dotted key and the bad value, so an operator fixes a file in one pass.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import sys
import tomllib
import unicodedata
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

from kiwid.config.schema import (
    ADMISSIONS,
    BACKENDS,
    GATES,
    LOG_LEVELS,
    MODES,
    SWAPS,
    ControlSettings,
    DaemonSettings,
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
from kiwid.linux.files import NotRegularFile, TooLarge, describe_mode, read_regular

DEFAULT_PATH = Path("/etc/kiwi.toml")
"""Where ``kiwid check-config`` looks when given no path."""

SHORT_TQ_S = 5.0
"""A TQ at or below this many seconds draws a warning."""

MAX_CONFIG_BYTES = 1 << 20
"""The largest configuration file read, in bytes (1 MiB). The shipped file, every
key commented, is about 6 KiB; anything this large is the wrong file."""

_SOCKET_PATH_MAX_BYTES = 107  # sun_path is 108 bytes including the final NUL
_GPU_KEY = re.compile(r"0|[1-9][0-9]*|(?:GPU|MIG)-\S+")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_INT64 = range(-(2**63), 2**63)  # TOML integers; tomllib accepts longer ones
_USEC = re.compile(r"[0-9]{1,18}")  # WATCHDOG_USEC as systemd writes it


class ConfigError(Exception):
    """A configuration that cannot be used; ``str()`` gives one line per problem.

    Attributes:
        problems: The problems, each naming the file, the dotted key and the value.
    """

    def __init__(self, problems: Sequence[str]) -> None:
        """Record ``problems`` (at least one)."""
        self.problems = tuple(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class LoadedConfig:
    """The result of a successful load."""

    settings: Settings
    """The validated settings."""

    warnings: tuple[str, ...]
    """Legal but discouraged values, one readable line each."""

    source: Path | None
    """The file read, or ``None`` for text that came from no file."""


def _no_objection(_: Any) -> str | None:
    return None


@dataclass(frozen=True)
class _Rule:
    """How one TOML value is checked, and which dataclass field it fills."""

    attr: str
    kind: type[int] | type[float] | type[str] | type[list[Any]]  # float accepts ints too
    expects: str  # completes "must be ..."
    accepts: Callable[[Any], bool]
    objects: Callable[[Any], str | None] = _no_objection
    """Asked first, for a value of the right kind: the whole reason it is refused
    (``"must not ..."``), or ``None`` to go on to ``accepts``."""


def _above_zero(attr: str, unit: str) -> _Rule:
    """A finite number of ``unit`` > 0; integers are accepted."""
    return _Rule(attr, float, f"a number of {unit} > 0", lambda v: 0 < v < math.inf)


def _within(
    attr: str, kind: type[int] | type[float], unit: str, low: float, high: float | None = None
) -> _Rule:
    """A number of ``kind`` from ``low`` to ``high`` inclusive; no ``high``: no upper bound."""
    noun = "an integer number" if kind is int else "a number"
    bounds = f">= {low:g}" if high is None else f"from {low:g} to {high:g}"
    top = math.inf if high is None else high
    return _Rule(attr, kind, f"{noun} of {unit} {bounds}", lambda v: low <= v <= top)


def _choice(attr: str, options: Collection[str]) -> _Rule:
    return _Rule(attr, str, "one of " + ", ".join(map(json.dumps, options)), options.__contains__)


def _abs_path(attr: str, max_bytes: int = 4095, empty: str = "") -> _Rule:
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

    return _Rule(attr, str, expects, accepts, _unprintable_path)


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


_OVERRIDE_RULES = {
    "tq": _above_zero("tq", "seconds"),
    "idle_release": _above_zero("idle_release", "seconds"),
    "mode": _choice("mode", MODES),
}
_SCHEDULER_RULES = {
    **_OVERRIDE_RULES,
    "handover_allowance": _above_zero("handover_allowance", "seconds"),
}
_GPU_RULES = {
    "backend": _choice("backend", BACKENDS),
    "poll_interval": _within("poll_interval", float, "seconds", 0.05, 60),
    "gate": _choice("gate", GATES),
    "gate_timeout": _within("gate_timeout", float, "seconds", 0.1, 60),
}
_SIM_RULES = {
    "devices": _within("sim_devices", int, "devices", 1, 64),
    "memory_gib": _above_zero("sim_memory_gib", "GiB"),
    "swap_out_gbps": _above_zero("sim_swap_out_gbps", "GB/s"),
    "swap_in_gbps": _above_zero("sim_swap_in_gbps", "GB/s"),
}
_CONTROL_RULES = {
    "socket": _abs_path("socket", _SOCKET_PATH_MAX_BYTES),
    "admin_group": _Rule("admin_group", str, "a group name", lambda v: bool(v) and v.isprintable()),
}
_DAEMON_RULES = {
    "state_dir": _abs_path("state_dir"),
    "shutdown_timeout": _above_zero("shutdown_timeout", "seconds"),
    "log_level": _choice("log_level", LOG_LEVELS),
}
_MEMORY_RULES = {
    "reserve_mib": _within("reserve_mib", int, "MiB", 0),
    "swap": _choice("swap", SWAPS),
    "host_floor_mib": _within("host_floor_mib", int, "MiB", 0),
}
_METRICS_RULES = {
    "listen": _Rule("listen", str, '"host:port" or "" (off)', lambda v: v == "" or _host_port(v)),
}
_KUBERNETES_RULES = {
    "resource": _Rule(
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
    "gpus": _Rule(
        "gpus",
        list,
        'a list of GPU indices or UUIDs, e.g. ["0", "GPU-..."] ([] for all)',
        lambda v: all(isinstance(g, str) and g for g in v),
    ),
    "pod_resources_socket": _abs_path(
        "pod_resources_socket", _SOCKET_PATH_MAX_BYTES, empty="no PodResources lookups"
    ),
}
_SECTIONS = ("scheduler", "gpu", "control", "daemon", "memory", "metrics", "kubernetes")


def _host_port(value: str) -> bool:
    """Whether ``value`` is ``host:port`` (IPv6 in brackets) with a port 0-65535."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        return False
    if host.startswith("["):
        return host.endswith("]") and len(host) > 2
    return ":" not in host


def _has_kind(value: object, kind: type) -> bool:
    """Whether ``value`` has TOML type ``kind``; a bool is no number, an int is a float.

    An integer beyond 64 bits is no TOML integer (and may not fit in a float).
    """
    if isinstance(value, int) and value not in _INT64:
        return False
    wanted = (int, float) if kind is float else kind
    return isinstance(value, wanted) and not isinstance(value, bool)


def _type_name(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value not in _INT64:
        return "an integer beyond 64 bits"
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}
    names |= {list: "an array", dict: "a table"}
    return names.get(type(value), "a date or time")


def _show(value: object) -> str:
    """Write ``value`` roughly as TOML would, shortened to fit on a line."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = _printable(json.dumps(value, ensure_ascii=False), toml=True)
    elif isinstance(value, list):
        text = "[" + ", ".join(map(_show, value)) + "]"
    elif isinstance(value, dict):
        text = "{ " + ", ".join(f"{_key(k)} = {_show(v)}" for k, v in value.items()) + " }"
    elif isinstance(value, int | float):
        text = repr(value)
    else:
        text = str(value)  # TOML dates and times
    return text if len(text) <= 60 else text[:59] + "…"


def _key(key: str) -> str:
    if _BARE_KEY.fullmatch(key):
        return key
    return _printable(json.dumps(key, ensure_ascii=False), toml=True)


def _printable(text: str, *, toml: bool = False) -> str:
    r"""Escape what cannot be shown on one line of a terminal or log.

    Control and other unprintable characters become ``\uXXXX``; with
    ``toml=False`` (file names) those below U+0100 become ``\xNN``, and so do
    the bytes a file name had that were no UTF-8 (``os.fsdecode`` turns byte NN
    into U+DCNN), so the name is shown as the bytes it is.
    """
    if text.isprintable():
        return text
    out = []
    for char in text:
        code = ord(char)
        if char.isprintable():
            out.append(char)
        elif not toml and 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\x{code - 0xDC00:02x}")
        elif not toml and code < 0x100:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return "".join(out)


class _Reader:
    """Walks a parsed document, collecting problems and warnings as it goes."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.refused: set[str] = set()  # dotted keys whose value was refused

    def problem(self, text: str) -> None:
        self.problems.append(f"{self.label}: {text}")

    def table(self, parent: Mapping[str, Any], name: str, dotted: str = "") -> dict[str, Any]:
        """Return ``parent[name]`` if it is a table (or absent: ``{}``), else note why."""
        value = parent.get(name, {})
        if isinstance(value, dict):
            return value
        self.problem(f"{dotted or name} = {_show(value)}: must be a table, not {_type_name(value)}")
        return {}

    def section(
        self, doc: Mapping[str, Any], name: str, rules: Mapping[str, _Rule]
    ) -> dict[str, Any]:
        """Check the top-level table ``name`` against ``rules``."""
        return self.fields(self.table(doc, name), name, rules)

    def fields(
        self,
        table: Mapping[str, Any],
        prefix: str,
        rules: Mapping[str, _Rule],
        subtables: Sequence[str] = (),
    ) -> dict[str, Any]:
        """Check every key of ``table``; return valid values keyed by dataclass field."""
        values: dict[str, Any] = {}
        for key, value in table.items():
            dotted = f"{prefix}.{_key(key)}" if prefix else _key(key)
            rule = rules.get(key)
            if rule is None:
                if key not in subtables:
                    known = ", ".join([*rules, *subtables])
                    self.problem(f"unknown key {dotted} (known keys: {known})")
                continue
            kind_ok = _has_kind(value, rule.kind)
            objection = rule.objects(value) if kind_ok else None
            if objection is not None:
                self.refused.add(dotted)
                self.problem(f"{dotted} = {_show(value)}: {objection}")
            elif kind_ok and rule.accepts(value):
                stored = value
                if rule.kind is float:
                    stored = float(value)
                elif rule.kind is list:
                    stored = tuple(value)  # frozen settings stay hashable
                values[rule.attr] = stored
                if rule.attr == "tq" and value <= SHORT_TQ_S:
                    self.warnings.append(
                        f"{dotted} = {_show(value)}: a TQ of {SHORT_TQ_S:g} s or less is "
                        "discouraged: each hand-over moves the tenant's GPU memory, so a "
                        "short quantum is spent waiting for data"
                    )
            else:
                got = "" if kind_ok else f", not {_type_name(value)}"
                self.refused.add(dotted)
                self.problem(f"{dotted} = {_show(value)}: must be {rule.expects}{got}")
        return values


def _scheduler(reader: _Reader, doc: Mapping[str, Any]) -> SchedulerSettings:
    table = reader.table(doc, "scheduler")
    values = reader.fields(table, "scheduler", _SCHEDULER_RULES, ("gpu",))
    overrides: dict[str, GpuOverride] = {}
    for key in reader.table(table, "gpu", "scheduler.gpu"):
        dotted = f"scheduler.gpu.{_printable(json.dumps(key, ensure_ascii=False), toml=True)}"
        if not _GPU_KEY.fullmatch(key):
            reader.problem(
                f'{dotted}: a GPU key must be a decimal index such as "0" '
                'or a UUID starting with "GPU-" or "MIG-"'
            )
            continue
        gpu_table = reader.table(table["gpu"], key, dotted)
        overrides[key] = GpuOverride(**reader.fields(gpu_table, dotted, _OVERRIDE_RULES))
    return SchedulerSettings(gpu=GpuOverrides(overrides), **values)


def _service_rules(
    service: ServiceLimits,
) -> tuple[Mapping[str, _Rule], Mapping[str, _Rule]]:
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
    gpu = dict(_GPU_RULES)
    gpu["gate_timeout"] = replace(gpu["gate_timeout"], objects=_at_most(gate, f", {gate_why}"))
    daemon = dict(_DAEMON_RULES)
    daemon["shutdown_timeout"] = replace(
        daemon["shutdown_timeout"], objects=_at_most(stop, f": {stop_why}")
    )
    return gpu, daemon


def _at_most(limit: float, why: str) -> Callable[[Any], str | None]:
    """An objection to numbers above ``limit`` seconds; ``why`` ends the message.

    Numbers below the rule's own range, and NaN, are left to its ``accepts``.
    """
    return lambda value: f"must be at most {limit:g} s{why}" if value > limit else None


def service_limits(environ: Mapping[str, str], pid: int | None = None) -> ServiceLimits:
    """The limits of the service that ``environ`` belongs to.

    Args:
        environ: The process environment, usually ``os.environ``.
        pid: This process's id (default ``os.getpid()``), to tell kiwid's own
            watchdog from one inherited from a parent.

    Returns:
        The shipped unit's limits, with the watchdog interval systemd gave in
        ``WATCHDOG_USEC`` when it is a positive number of microseconds meant for this
        process (``WATCHDOG_PID`` unset or ``pid``); see :class:`ServiceLimits`.
    """
    usec = environ.get("WATCHDOG_USEC", "")
    owner = environ.get("WATCHDOG_PID")
    mine = owner is None or owner == str(os.getpid() if pid is None else pid)
    if not (_USEC.fullmatch(usec) and int(usec) > 0 and mine):
        return ServiceLimits()
    return ServiceLimits(watchdog_s=int(usec) / 1e6, watchdog_source=f"WATCHDOG_USEC={usec}")


def _build(reader: _Reader, doc: Mapping[str, Any], service: ServiceLimits) -> Settings:
    reader.fields(doc, "", {}, _SECTIONS)  # only reports unknown top-level keys
    gpu_rules, daemon_rules = _service_rules(service)
    scheduler = _scheduler(reader, doc)
    gpu = reader.table(doc, "gpu")
    gpu_values = reader.fields(gpu, "gpu", gpu_rules, ("sim",))
    gpu_values |= reader.fields(reader.table(gpu, "sim", "gpu.sim"), "gpu.sim", _SIM_RULES)
    settings = Settings(
        scheduler,
        GpuSettings(**gpu_values),
        ControlSettings(**reader.section(doc, "control", _CONTROL_RULES)),
        DaemonSettings(**reader.section(doc, "daemon", daemon_rules)),
        MemorySettings(**reader.section(doc, "memory", _MEMORY_RULES)),
        MetricsSettings(**reader.section(doc, "metrics", _METRICS_RULES)),
        KubernetesSettings(**reader.section(doc, "kubernetes", _KUBERNETES_RULES)),
    )
    _check_state_dir(reader, settings)
    return settings


def _check_state_dir(reader: _Reader, settings: Settings) -> None:
    """Check that the state directory can be one, and that the socket lies outside it.

    Values already refused are not looked at again; defaults are (a default
    ``state_dir`` may still exist as a file on this host).
    """
    state_dir, socket = settings.daemon.state_dir, settings.control.socket
    if "daemon.state_dir" in reader.refused:
        return
    shown = f"daemon.state_dir = {_show(state_dir)}"
    why = _not_a_directory(state_dir)
    if why is not None:
        reader.problem(f"{shown}: {why}")
    if "control.socket" in reader.refused:
        return
    # Compared as the kernel will see them: "..", "//" and symbolic links resolved.
    state = PurePosixPath(os.path.realpath(state_dir))
    place = PurePosixPath(os.path.realpath(socket))
    if place == state:
        why = f"must not be {shown} itself"
    elif place.is_relative_to(state):
        why = (
            f"must not be inside {shown}: that directory is mode 0700, "
            "so no one but root could reach the socket"
        )
    elif state.is_relative_to(place):
        why = f"must not be a directory above {shown}"
    else:
        return
    reader.problem(f"control.socket = {_show(socket)}: {why}")


def _not_a_directory(path: str) -> str | None:
    """Why kiwid could not make or use ``path`` as a directory, or ``None``.

    An absent path is fine (kiwid creates it), and so is one this process may
    not look into: check-config may run unprivileged, kiwid runs as root.
    """
    try:
        mode = Path(path).stat().st_mode
    except FileNotFoundError:
        if Path(path).is_symlink():
            return "is a symbolic link to nothing, not a directory"
        return None
    except PermissionError:
        return None
    except NotADirectoryError:
        return "is no usable directory: a path above it is no directory"
    except OSError as exc:
        return f"is no usable directory: {exc.strerror or exc}"
    if stat.S_ISDIR(mode):
        return None
    return f"exists and is {describe_mode(mode)}, not a directory"


def parse_config(
    text: str, source: str | Path = "<string>", *, service: ServiceLimits | None = None
) -> LoadedConfig:
    """Parse and validate configuration text.

    Besides the text, this looks at the host: whether ``daemon.state_dir`` exists as
    something other than a directory, and where symbolic links in it lead.

    Args:
        text: The TOML document.
        source: The file it came from, used in messages. A name in angle brackets,
            such as the default ``"<string>"``, marks text from no file.
        service: What the systemd service allows; default
            ``service_limits(os.environ)``: the shipped unit's, with the watchdog
            systemd gave this process.

    Returns:
        The settings, with missing keys at their defaults, and any warnings.

    Raises:
        ConfigError: The text is not TOML, or has unknown keys or bad values; every
            problem found is listed.
    """
    label = _printable(str(source))
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{label}: invalid TOML: {exc}"]) from exc
    except ValueError as exc:  # Python's limit on digits in int(), not a TOML error
        raise ConfigError([f"{label}: invalid TOML: an integer with too many digits"]) from exc
    reader = _Reader(label)
    settings = _build(reader, doc, service_limits(os.environ) if service is None else service)
    if reader.problems:
        raise ConfigError(reader.problems)
    path = None if label.startswith("<") and label.endswith(">") else Path(source)
    return LoadedConfig(settings, tuple(reader.warnings), path)


def load_config(path: str | Path, *, service: ServiceLimits | None = None) -> LoadedConfig:
    """Read, parse and validate a configuration file.

    Args:
        path: The TOML file, UTF-8 encoded.
        service: What the systemd service allows, as for :func:`parse_config`.

    Returns:
        The settings, any warnings, and ``path`` as ``source``.

    Raises:
        ConfigError: The file cannot be read (the OS reason is given), is no regular
            file (a FIFO, a device, a directory), is over :data:`MAX_CONFIG_BYTES`,
            is not UTF-8 or not TOML, or has unknown keys or bad values.
    """
    path = Path(path)
    label = _printable(str(path))
    try:
        data = read_regular(path, MAX_CONFIG_BYTES)
    except NotRegularFile as exc:
        raise ConfigError([f"{label}: cannot read: it is {exc.kind}, not a regular file"]) from exc
    except TooLarge as exc:
        reason = "it is larger than 1 MiB, too large for a kiwid configuration"
        raise ConfigError([f"{label}: cannot read: {reason}"]) from exc
    except OSError as exc:
        raise ConfigError([f"{label}: cannot read: {exc.strerror or exc}"]) from exc
    except ValueError as exc:  # no OS call can take the name
        reason = "contains a NUL byte" if "\0" in str(path) else "is no valid file name"
        raise ConfigError([f"{label}: cannot read: the path {reason}"]) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{label}: not UTF-8 text: {exc.reason} at byte {exc.start}"]) from exc
    return parse_config(text, path, service=service)


def check_config_main(argv: Sequence[str] | None = None) -> int:
    """Run ``kiwid check-config [PATH]``: validate a file and report.

    Prints ``PATH: OK`` on stdout and any warnings on stderr when the file is usable,
    else the problems on stderr.

    Args:
        argv: The words after ``check-config``; ``None`` means ``sys.argv[2:]``.

    Returns:
        The exit status: 0 if the file is usable, 1 if not, 2 for a usage error.
    """
    args = list(sys.argv[2:] if argv is None else argv)
    usage = "usage: kiwid check-config [PATH]"
    if args[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\nValidate a kiwid configuration file (default {DEFAULT_PATH}).")
        return 0
    if len(args) > 1 or any(a.startswith("-") for a in args):
        shown = _printable(" ".join(args))
        print(f"{usage}\nerror: unexpected arguments: {shown}", file=sys.stderr)
        return 2
    path = Path(args[0]) if args else DEFAULT_PATH
    try:
        loaded = load_config(path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    label = _printable(str(path))
    for warning in loaded.warnings:
        print(f"warning: {label}: {warning}", file=sys.stderr)
    print(f"{label}: OK")
    return 0
