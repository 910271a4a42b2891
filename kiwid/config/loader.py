"""TOML text to validated :class:`~kiwid.config.schema.Settings`.

Every problem in a file is collected and reported together, one line each, naming
the file, the dotted key and the bad value, so an operator fixes a file in one pass.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from kiwid.config.reader import Reader, printable, show_value
from kiwid.config.rules import (
    CONTROL_RULES,
    KUBERNETES_RULES,
    MATCH_RULES,
    MEMORY_RULES,
    METRICS_RULES,
    OVERRIDE_RULES,
    SCHEDULER_RULES,
    SECTIONS,
    SIM_RULES,
    TENANT_RULES,
    service_rules,
    type_name,
)
from kiwid.config.schema import (
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
from kiwid.config.tenant_rules import TenantMatch, TenantRule
from kiwid.linux.files import NotRegularFile, TooLarge, describe_mode, read_regular

DEFAULT_PATH = Path("/etc/kiwi.toml")
"""Where ``kiwid check-config`` looks when given no path."""

MAX_CONFIG_BYTES = 1 << 20
"""The largest configuration file read, in bytes (1 MiB). The shipped file, every
key commented, is about 6 KiB; anything this large is the wrong file."""

_GPU_KEY = re.compile(r"0|[1-9][0-9]*|(?:GPU|MIG)-\S+")
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


def _scheduler(reader: Reader, doc: Mapping[str, Any]) -> SchedulerSettings:
    table = reader.table(doc, "scheduler")
    values = reader.fields(table, "scheduler", SCHEDULER_RULES, ("gpu",))
    overrides: dict[str, GpuOverride] = {}
    for key in reader.table(table, "gpu", "scheduler.gpu"):
        dotted = f"scheduler.gpu.{printable(json.dumps(key, ensure_ascii=False), toml=True)}"
        if not _GPU_KEY.fullmatch(key):
            reader.problem(
                f'{dotted}: a GPU key must be a decimal index such as "0" '
                'or a UUID starting with "GPU-" or "MIG-"'
            )
            continue
        gpu_table = reader.table(table["gpu"], key, dotted)
        overrides[key] = GpuOverride(**reader.fields(gpu_table, dotted, OVERRIDE_RULES))
    return SchedulerSettings(gpu=GpuOverrides(overrides), **values)


def _tenants(reader: Reader, doc: Mapping[str, Any]) -> tuple[TenantRule, ...]:
    """The ``[[tenants]]`` rules, in order; problems name the rule's index and key."""
    value = doc.get("tenants", [])
    if not isinstance(value, list):
        reader.problem(
            f"tenants = {show_value(value)}: must be an array of tables ([[tenants]] ...), "
            f"not {type_name(value)}"
        )
        return ()
    rules: list[TenantRule] = []
    for index, entry in enumerate(value):
        dotted = f"tenants[{index}]"
        if not isinstance(entry, dict):
            reader.problem(
                f"{dotted} = {show_value(entry)}: must be a table, not {type_name(entry)}"
            )
            continue
        fields = reader.fields(entry, dotted, TENANT_RULES, ("match",))
        if "match" not in entry:
            reader.problem(
                f'{dotted}: needs a match table, e.g. match = {{ pod = "train-*" }} '
                "(match = {} for every tenant)"
            )
            continue
        match = reader.fields(
            reader.table(entry, "match", f"{dotted}.match"), f"{dotted}.match", MATCH_RULES
        )
        rules.append(TenantRule(TenantMatch(**match), **fields))
    return tuple(rules)


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


def _build(reader: Reader, doc: Mapping[str, Any], service: ServiceLimits) -> Settings:
    reader.fields(doc, "", {}, SECTIONS)  # only reports unknown top-level keys
    gpu_rules, daemon_rules = service_rules(service)
    scheduler = _scheduler(reader, doc)
    gpu = reader.table(doc, "gpu")
    gpu_values = reader.fields(gpu, "gpu", gpu_rules, ("sim",))
    gpu_values |= reader.fields(reader.table(gpu, "sim", "gpu.sim"), "gpu.sim", SIM_RULES)
    settings = Settings(
        scheduler,
        GpuSettings(**gpu_values),
        ControlSettings(**reader.section(doc, "control", CONTROL_RULES)),
        DaemonSettings(**reader.section(doc, "daemon", daemon_rules)),
        MemorySettings(**reader.section(doc, "memory", MEMORY_RULES)),
        MetricsSettings(**reader.section(doc, "metrics", METRICS_RULES)),
        KubernetesSettings(**reader.section(doc, "kubernetes", KUBERNETES_RULES)),
        _tenants(reader, doc),
    )
    _check_state_dir(reader, settings)
    return settings


def _check_state_dir(reader: Reader, settings: Settings) -> None:
    """Check that the state directory can be one, and that the socket lies outside it.

    Values already refused are not looked at again; defaults are (a default
    ``state_dir`` may still exist as a file on this host).
    """
    state_dir, socket = settings.daemon.state_dir, settings.control.socket
    if "daemon.state_dir" in reader.refused:
        return
    shown = f"daemon.state_dir = {show_value(state_dir)}"
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
    reader.problem(f"control.socket = {show_value(socket)}: {why}")


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
    label = printable(str(source))
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{label}: invalid TOML: {exc}"]) from exc
    except ValueError as exc:  # Python's limit on digits in int(), not a TOML error
        raise ConfigError([f"{label}: invalid TOML: an integer with too many digits"]) from exc
    reader = Reader(label)
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
    label = printable(str(path))
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
        shown = printable(" ".join(args))
        print(f"{usage}\nerror: unexpected arguments: {shown}", file=sys.stderr)
        return 2
    path = Path(args[0]) if args else DEFAULT_PATH
    try:
        loaded = load_config(path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    label = printable(str(path))
    for warning in loaded.warnings:
        print(f"warning: {label}: {warning}", file=sys.stderr)
    print(f"{label}: OK")
    return 0
