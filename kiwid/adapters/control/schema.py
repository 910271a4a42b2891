"""The control protocol's command table: every command, its arguments and who may send it.

The daemon's handlers must cover exactly these commands (`check_command_table`);
the server checks each request's types and sender against it before any handler
runs. Standard library only.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

PROTOCOL_VERSION = 1
ERROR_CODES = frozenset(
    {"bad-request", "too-large", "unknown-command", "forbidden", "invalid-value"}
    | {"unavailable", "internal"}
)
ENVELOPE = ("v", "id", "cmd", "args")


class Access(enum.Enum):
    """Who may send a command, by the credentials the kernel reports for the peer."""

    READ = "read"
    """Everyone who can open the socket (mode 0666: every local user)."""
    ADMIN = "admin"
    """Root, or a member (primary or supplementary) of the admin group."""
    ROOT = "root"
    """Only uid 0."""
    OWNER = "owner"
    """Root, the admin group, or the user whose tenant it names: the adapter lets
    everyone through with ``Peer.admin`` set, and the daemon judges the tenant's owner."""


class Kind(enum.Enum):
    """The JSON type an argument must have; its value is the daemon's to judge."""

    NUMBER = "number"
    """An integer or a finite float (never a boolean)."""
    INTEGER = "64-bit integer"
    """An integer from -2**63 to 2**63 - 1 (never a boolean)."""
    STRING = "string"
    BOOLEAN = "boolean"
    STRINGS = "list of strings"


@dataclass(frozen=True)
class Arg:
    """One argument of a command.

    Attributes:
        kind: Its JSON type.
        required: Must be present.
        nullable: ``null`` is accepted too.
    """

    kind: Kind
    required: bool = True
    nullable: bool = False

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` (parsed JSON) has this argument's type."""
        if value is None:
            return self.nullable
        if self.kind is Kind.BOOLEAN:
            return isinstance(value, bool)
        if self.kind is Kind.STRINGS:
            return isinstance(value, list) and all(isinstance(v, str) for v in value)
        if self.kind is Kind.STRING:
            return isinstance(value, str)
        if isinstance(value, bool):
            return False
        if self.kind is Kind.INTEGER:
            return isinstance(value, int) and value in _INT64
        return isinstance(value, int | float)

    @property
    def type_name(self) -> str:
        """The type in words, for messages: e.g. ``string or null``."""
        return f"{self.kind.value} or null" if self.nullable else self.kind.value


@dataclass(frozen=True)
class CommandSpec:
    """What the server checks for one command before the daemon's handler sees it.

    Attributes:
        access: Who may send it.
        args: Its arguments by name; any other argument is refused.
        root_reason: For `Access.ROOT`: why, quoted to a refused peer.
    """

    access: Access
    args: Mapping[str, Arg] = field(default_factory=lambda: MappingProxyType({}))
    root_reason: str = ""


def _args(**args: Arg) -> Mapping[str, Arg]:
    return MappingProxyType(args)


_STRING_OR_NULL = Arg(Kind.STRING, required=False, nullable=True)
_INT64 = range(-(2**63), 2**63)  # Kind.INTEGER: what the daemon can hand to the kernel

COMMANDS: Mapping[str, CommandSpec] = MappingProxyType(
    {
        "ping": CommandSpec(Access.READ),
        "status": CommandSpec(Access.READ),
        "tenants": CommandSpec(Access.READ),
        "workloads": CommandSpec(Access.READ),
        "forget-workload": CommandSpec(Access.ADMIN, _args(workload=Arg(Kind.STRING))),
        "set-tq": CommandSpec(
            Access.ADMIN,
            _args(tq=Arg(Kind.NUMBER), gpu=Arg(Kind.STRING, required=False)),
        ),
        "set-mode": CommandSpec(Access.ADMIN, _args(mode=Arg(Kind.STRING))),
        "set-weight": CommandSpec(
            Access.ADMIN, _args(tenant=Arg(Kind.STRING), weight=Arg(Kind.NUMBER))
        ),
        "set-priority": CommandSpec(
            Access.ADMIN, _args(tenant=Arg(Kind.STRING), priority=Arg(Kind.INTEGER))
        ),
        # An operator's word on a stuck tenant: try again, or let it run ungated.
        "retry": CommandSpec(Access.ADMIN, _args(tenant=Arg(Kind.STRING))),
        "release": CommandSpec(Access.ADMIN, _args(tenant=Arg(Kind.STRING))),
        # A parked tenant joins the queue: an operator's word, or a router's that saw
        # a request for it (its owner may send it too).
        "wake": CommandSpec(Access.OWNER, _args(tenant=Arg(Kind.STRING))),
        "sim-attach": CommandSpec(
            Access.ADMIN,
            _args(
                pid=Arg(Kind.INTEGER),
                gpu=Arg(Kind.INTEGER),
                memory_bytes=Arg(Kind.INTEGER),
                activity=Arg(Kind.STRING),
            ),
        ),
        "sim-detach": CommandSpec(Access.ADMIN, _args(pid=Arg(Kind.INTEGER))),
        "sim-foreign": CommandSpec(
            Access.ADMIN, _args(gpu=Arg(Kind.INTEGER), memory_bytes=Arg(Kind.INTEGER))
        ),
        "sim-fault": CommandSpec(
            Access.ADMIN,
            _args(
                pid=Arg(Kind.INTEGER),
                op=Arg(Kind.STRING),
                fault=Arg(Kind.STRING),
                times=Arg(Kind.INTEGER, required=False),
            ),
        ),
        # From kiwi-hook (OCI createRuntime / poststop): a container, its names and, on
        # Kubernetes, the device plugin's device IDs it was given.
        "register": CommandSpec(
            Access.ROOT,
            _args(
                id=Arg(Kind.STRING),
                cgroup_v2=_STRING_OR_NULL,
                cgroup_v1_freezer=_STRING_OR_NULL,
                pid=Arg(Kind.INTEGER, required=False, nullable=True),
                name=_STRING_OR_NULL,
                pod=_STRING_OR_NULL,
                namespace=_STRING_OR_NULL,
                gpus=Arg(Kind.STRINGS, required=False),
                hold=Arg(Kind.BOOLEAN, required=False),
                device_ids=Arg(Kind.STRINGS, required=False),
                weight=Arg(Kind.NUMBER, required=False, nullable=True),
                priority=Arg(Kind.INTEGER, required=False, nullable=True),
                # Its pod's kiwi.io/park: false keeps it in the rotation when idle.
                park=Arg(Kind.BOOLEAN, required=False, nullable=True),
                # GPU memory per GPU it declares (bytes): its pod's kiwi.io/gpu-memory
                # ("annotation", from kiwi-hook) or its own ("register", the default).
                memory_bytes=Arg(Kind.INTEGER, required=False, nullable=True),
                memory_source=_STRING_OR_NULL,
            ),
            root_reason="the container runtime runs kiwi-hook as root",
        ),
        "unregister": CommandSpec(
            Access.ROOT,
            _args(id=Arg(Kind.STRING)),
            root_reason="the container runtime runs kiwi-hook as root",
        ),
    }
)
"""Every command: its arguments and who may send it. The daemon's handler table must
name exactly these (`check_command_table`); docs/control-protocol.md describes them."""

READ_COMMANDS = frozenset(c for c, spec in COMMANDS.items() if spec.access is Access.READ)
ADMIN_COMMANDS = frozenset(c for c, spec in COMMANDS.items() if spec.access is Access.ADMIN)
ROOT_COMMANDS = frozenset(c for c, spec in COMMANDS.items() if spec.access is Access.ROOT)


class CommandTableMismatch(ValueError):
    """A handler table that does not name exactly the commands of `COMMANDS`.

    Attributes:
        missing: Commands of the schema that it lacks.
        unknown: Names it has that the schema does not.
    """

    def __init__(self, missing: frozenset[str], unknown: frozenset[str]) -> None:
        parts = []
        if missing:
            parts.append(f"lacks {', '.join(sorted(missing))}")
        if unknown:
            parts.append(f"has commands the protocol does not: {', '.join(sorted(unknown))}")
        super().__init__(f"the command table {'; '.join(parts)}")
        self.missing = missing
        self.unknown = unknown


def check_command_table(handled: Iterable[str]) -> None:
    """Check that a handler table covers exactly the commands of `COMMANDS`.

    Args:
        handled: The command names the daemon handles (e.g. its table's keys).

    Raises:
        CommandTableMismatch: Some are missing or unknown; the message names them.
    """
    names = frozenset(handled)
    missing, unknown = frozenset(COMMANDS) - names, names - frozenset(COMMANDS)
    if missing or unknown:
        raise CommandTableMismatch(missing, unknown)
