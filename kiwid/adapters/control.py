"""The control socket: JSON lines over a Unix stream socket, server and tiny client.

The daemon owns the meaning of each command (it supplies a `Handler`); this module
owns everything a hostile or clumsy local client could do to it: framing, size
limits, text that is not Unicode, idle and slow clients, connection limits per uid,
the envelope, argument types and authorisation by the peer's credentials
(``SO_PEERCRED``), the last two from one table, `COMMANDS`, which the daemon's
handlers must match (`check_command_table`). The wire format is described in
``docs/control-protocol.md``. Standard library only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import json
import logging
import math
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

logger = logging.getLogger("kiwid.control")

PROTOCOL_VERSION = 1
ERROR_CODES = frozenset(
    {"bad-request", "too-large", "unknown-command", "forbidden", "invalid-value"}
    | {"unavailable", "internal"}
)
_ENVELOPE = ("v", "id", "cmd", "args")


class Access(enum.Enum):
    """Who may send a command, by the credentials the kernel reports for the peer."""

    READ = "read"
    """Everyone who can open the socket (mode 0666: every local user)."""
    ADMIN = "admin"
    """Root, or a member (primary or supplementary) of the admin group."""
    ROOT = "root"
    """Only uid 0."""


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


_REFUSAL_LOG_INTERVAL_S = 60.0  # one warning for a flood of refused connections
_CLIENT_MAX_RESPONSE = 16 * 1024 * 1024  # bytes; a status of many GPUs stays far below
MAX_DEPTH = 32  # levels of objects and arrays in a request, the request itself being 1
MAX_INT_DIGITS = 64  # digits of an integer in a request; an int64 has 19


class ControlError(Exception):
    """A refused request: the handler raises it, `request` re-raises the daemon's.

    Attributes:
        code: One of `ERROR_CODES` (a newer daemon may send others).
        message: One readable sentence for a person.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class DaemonUnreachable(Exception):
    """No answer from kiwid: socket missing, refused, not permitted or timed out."""


class SocketInUse(Exception):
    """Another process answers on the socket path, or the path is not a socket."""


@dataclass(frozen=True)
class Peer:
    """Who is on the other end of a connection, as the kernel saw it at connect.

    Attributes:
        pid: Process id in kiwid's pid namespace (0 when not visible there).
        uid: Effective user id.
        gid: Effective group id.
        groups: Supplementary groups plus ``gid`` (only ``gid`` if unreadable).
    """

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]


class EncodedResult(bytes):
    """A result the handler already encoded as one JSON object (UTF-8, no newline).

    The daemon hands its cached status over like this, so that a hundred
    ``kiwictl status`` callers cost one encoding, not a hundred.
    """


Handler = Callable[[str, dict[str, Any], Peer], Awaitable[dict[str, Any] | EncodedResult]]


def peer_of(sock: Any) -> Peer:
    """Read the peer's credentials from a connected Unix socket.

    Args:
        sock: A connected ``AF_UNIX`` socket (or asyncio's ``TransportSocket``).

    Returns:
        The peer, with supplementary groups from ``/proc/<pid>/status``.
    """
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid, _groups_of(pid, uid, gid))


def _groups_of(pid: int, uid: int, gid: int) -> frozenset[int]:
    """Supplementary groups of ``pid``, trusted only if its ids still match."""
    try:
        text = Path(f"/proc/{pid}/status").read_text(encoding="ascii", errors="replace")
        fields = {k: v.split() for k, _, v in (ln.partition(":") for ln in text.splitlines())}
        same = int(fields["Uid"][1]) == uid and int(fields["Gid"][1]) == gid
        groups = {int(g) for g in fields.get("Groups", [])}
    except (OSError, KeyError, IndexError, ValueError):
        return frozenset({gid})
    # A different process may have taken the pid since connect: ignore its groups.
    return frozenset(groups | {gid}) if same else frozenset({gid})


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        shown = text if len(text) <= 24 else f"{text[:20]}...({len(text)} characters)"
        raise ValueError(f"number {shown} is out of range")
    return value


def _bounded_int(text: str) -> int:
    # Our own limit, below Python's (4300 digits, whose message names a Python call).
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {digits} digits; kiwid reads at most {MAX_INT_DIGITS}")
    return int(text)


def _decode(line: bytes) -> Any:
    """Parse one request line strictly (UTF-8, no NaN/Infinity, finite numbers)."""
    return json.loads(
        line.decode("utf-8"),
        parse_constant=_reject_constant,
        parse_float=_finite_float,
        parse_int=_bounded_int,
    )


def _text_problem(text: str) -> str | None:
    """Why kiwid refuses this string (a lone surrogate cannot be encoded, NUL), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"is not valid Unicode: it holds a lone surrogate U+{ord(text[exc.start]):04X}"
    if "\0" in text:  # no name, id or path has one; many C and kernel interfaces stop at it
        return "contains a NUL character (U+0000)"
    return None


def _refusal(value: Any, path: str = "", depth: int = 1) -> str | None:
    """The first string or key kiwid refuses in ``value``, or nesting too deep; or None.

    Walks without recursion, in document order, so that no nesting the JSON parser
    accepted can exhaust the stack here. ``path`` names ``value`` (``""``: the request).
    """
    stack = [(value, path, depth)]
    while stack:
        item, where, level = stack.pop()
        if isinstance(item, str):
            if problem := _text_problem(item):
                return f"the string at {where} {problem}" if where else f"the request {problem}"
        elif isinstance(item, dict | list):
            if level > MAX_DEPTH:
                return f"{where or 'the request'} is nested deeper than {MAX_DEPTH} levels"
            if isinstance(item, list):
                named = [(f"{where}[{i}]", v) for i, v in enumerate(item)]
            else:
                for key in item:
                    if problem := _text_problem(key):
                        return f"a key of {where or 'the request'} {problem}"
                named = [(f"{where}.{k}" if where else k, v) for k, v in item.items()]
            stack.extend((v, name, level + 1) for name, v in reversed(named))
    return None


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, ensure_ascii=False, allow_nan=False).encode("utf-8") + b"\n"


def _error(rid: Any, code: str, message: str) -> dict[str, Any]:
    error = {"code": code, "message": message}
    return {"v": PROTOCOL_VERSION, "id": rid, "ok": False, "error": error}


def _check_envelope(req: Any) -> tuple[str, dict[str, Any]]:
    """Validate a parsed request; return ``(cmd, args)`` or raise `ControlError`."""
    if problem := _refusal(req):  # first: no message below may quote such a string
        raise ControlError("bad-request", f"request refused: {problem}")
    if not isinstance(req, dict):
        raise ControlError("bad-request", "a request must be a JSON object")
    extra = sorted(set(req) - set(_ENVELOPE))
    if extra:
        raise ControlError("bad-request", f"unknown request field(s) {', '.join(extra)}")
    v = req.get("v")
    if isinstance(v, bool) or v != PROTOCOL_VERSION:
        raise ControlError(
            "bad-request", f"unsupported protocol version {v!r}; kiwid speaks version 1"
        )
    cmd = req.get("cmd")
    if not isinstance(cmd, str):
        raise ControlError("bad-request", "field 'cmd' must be a command name (string)")
    if cmd not in COMMANDS:
        known = ", ".join(sorted(COMMANDS))
        raise ControlError("unknown-command", f"unknown command {cmd!r}; known: {known}")
    args = req.get("args", {})
    if not isinstance(args, dict):
        raise ControlError("bad-request", "field 'args' must be a JSON object")
    return cmd, args


def _check_args(cmd: str, args: dict[str, Any]) -> None:
    spec = COMMANDS[cmd].args
    extra = sorted(set(args) - set(spec))
    if extra:
        raise ControlError("bad-request", f"{cmd} takes no argument(s) {', '.join(extra)}")
    for name, arg in spec.items():
        if name not in args:
            if arg.required:
                raise ControlError(
                    "bad-request", f"{cmd} needs argument {name!r} ({arg.type_name})"
                )
        elif not arg.accepts(args[name]):
            raise ControlError("bad-request", f"{cmd} argument {name!r} must be a {arg.type_name}")


class ControlServer:
    """Asyncio server for the control socket; one task per client, answers in order.

    Args:
        path: Socket path; its directory is created (0755) if missing.
        handler: The daemon's ``(cmd, args, peer) -> result``, called only for valid,
            authorised requests; it raises `ControlError` to refuse.
        admin_gid: Group allowed `Access.ADMIN` commands besides root; ``None``: root only.
        admin_group_name: That group's name, for error messages.
        max_line: Longest request line accepted, bytes without the newline.
        idle_timeout_s: Seconds a client may take to send a whole line, or to read
            an answer, before it is disconnected.
        max_clients: Connections served at once to everyone together; beyond it,
            users other than root and the admin group get ``unavailable``.
        max_clients_per_uid: Connections one uid other than root and the admin
            group's members may hold at once.
        reserved_clients: Connections beyond ``max_clients`` kept for root and the
            admin group; and as many again kept for root alone, so that whoever
            else holds every other slot, kiwictl run as root and kiwi-hook get in.
    """

    def __init__(
        self,
        path: str | Path,
        handler: Handler,
        admin_gid: int | None,
        admin_group_name: str = "kiwi",
        *,
        max_line: int = 65536,
        idle_timeout_s: float = 30.0,
        max_clients: int = 256,
        max_clients_per_uid: int = 16,
        reserved_clients: int = 16,
    ) -> None:
        self.path = Path(path)
        self._handler = handler
        self._admin_gid = admin_gid
        self._admin_group_name = admin_group_name
        self._max_line = max_line
        self._idle_timeout_s = idle_timeout_s
        self._max_clients = max_clients
        self._max_per_uid = max_clients_per_uid
        self._reserved = reserved_clients
        self._server: asyncio.AbstractServer | None = None
        self._inode: tuple[int, int] | None = None
        self._clients: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._per_uid: collections.Counter[int] = collections.Counter()
        self._refusal_logged_at = -math.inf  # loop time of the last refusal logged
        self._refusals_unlogged = 0

    async def start(self) -> None:
        """Bind the socket (mode 0666; authorisation is per request) and start serving.

        Raises:
            SocketInUse: Another process answers on ``path``, or it is not a socket.
            OSError: The directory cannot be created or the socket bound.
        """
        parent = self.path.parent
        if not parent.exists():
            parent.mkdir(mode=0o755, parents=True)
            parent.chmod(0o755)
        await self._remove_stale()
        self._server = await asyncio.start_unix_server(
            self._serve, path=str(self.path), backlog=self._max_clients + 2 * self._reserved
        )
        self.path.chmod(0o666)
        st = self.path.stat()
        self._inode = (st.st_dev, st.st_ino)
        logger.info("control socket listening on %s", self.path)

    async def _remove_stale(self) -> None:
        try:
            mode = self.path.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise SocketInUse(f"{self.path} exists and is not a socket; refusing to remove it")
        try:
            async with asyncio.timeout(2.0):
                _, writer = await asyncio.open_unix_connection(str(self.path))
        except ConnectionRefusedError:
            logger.info("removing stale control socket %s", self.path)
            self.path.unlink(missing_ok=True)
            return
        except TimeoutError:
            pass  # something holds the socket but is too busy to accept: treat as live
        else:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        raise SocketInUse(
            f"another kiwid is already serving {self.path}; stop it first "
            "(systemctl stop kiwid) or choose another socket path"
        )

    async def close(self) -> None:
        """Stop listening, disconnect every client and remove our socket file."""
        if self._server is not None:
            self._server.close()
        clients = list(self._clients.items())
        for task, writer in clients:
            writer.transport.abort()  # do not wait for slow readers to take their answers
            task.cancel()
        await asyncio.gather(*(task for task, _ in clients), return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            st = self.path.stat()
            if (st.st_dev, st.st_ino) == self._inode:  # not a successor's socket
                self.path.unlink()
        self._inode = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = peer_of(writer.get_extra_info("socket"))
        if refusal := self._admission(peer):
            self._log_refusal(peer, refusal)
            writer.write(_encode(_error(None, "unavailable", refusal)))
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None  # always: the stream protocol runs us in a task
        self._clients[task] = writer
        self._per_uid[peer.uid] += 1
        try:
            await self._session(reader, writer, peer)
        except ConnectionError:
            writer.transport.abort()  # it went away mid-answer
        except TimeoutError:  # only writes time out here: it does not read its answers
            logger.warning(
                "dropping control client uid %d pid %d: answers unread for %gs",
                peer.uid,
                peer.pid,
                self._idle_timeout_s,
            )
            writer.transport.abort()
        except Exception:
            # A bug: log it, and close gently below so that answers already queued
            # on this connection still reach the client.
            logger.exception("control connection failed")
        finally:
            self._clients.pop(task, None)
            self._per_uid[peer.uid] -= 1
            if not self._per_uid[peer.uid]:
                del self._per_uid[peer.uid]
            writer.close()
            try:
                async with asyncio.timeout(self._idle_timeout_s):
                    await writer.wait_closed()
            except (OSError, TimeoutError):
                writer.transport.abort()

    def _admission(self, peer: Peer) -> str | None:
        """Why ``peer`` may not open another connection now, or None if it may."""
        total, mine = len(self._clients), self._per_uid[peer.uid]
        ceiling = self._max_clients + self._reserved
        if peer.uid == 0:
            if total < ceiling or mine < self._reserved:
                return None
            return (
                f"kiwid already serves {total} control clients, {mine} of them root's; "
                "try again later"
            )
        privileged = "root"
        if self._admin_gid is not None:
            privileged += f" and group {self._admin_group_name!r}"
        if self._is_admin(peer):
            if total < ceiling:
                return None
            return (
                f"kiwid already serves {total} control clients, the most it takes "
                f"({self._max_clients}, and {self._reserved} kept for {privileged}); "
                "try again later"
            )
        if mine >= self._max_per_uid:
            return (
                f"uid {peer.uid} already holds {mine} control connections, the most one "
                "user may; close one and try again"
            )
        if total >= self._max_clients:
            return (
                f"kiwid already serves {total} control clients, the most it takes from "
                f"users other than {privileged}; try again later"
            )
        return None

    def _log_refusal(self, peer: Peer, refusal: str) -> None:
        """Log a refused connection, at most once a minute: a refused client may retry at will."""
        now = asyncio.get_running_loop().time()
        if now - self._refusal_logged_at < _REFUSAL_LOG_INTERVAL_S:
            self._refusals_unlogged += 1
            return
        more = f" ({self._refusals_unlogged} more refused since)" if self._refusals_unlogged else ""
        logger.warning(
            "refused a control client, uid %d pid %d: %s%s", peer.uid, peer.pid, refusal, more
        )
        self._refusal_logged_at, self._refusals_unlogged = now, 0

    async def _session(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Peer
    ) -> None:
        buf = bytearray()
        loop = asyncio.get_running_loop()
        while True:
            deadline = loop.time() + self._idle_timeout_s  # for the whole line: no slowloris
            while (end := buf.find(b"\n")) < 0 and len(buf) <= self._max_line:
                try:
                    async with asyncio.timeout_at(deadline):
                        chunk = await reader.read(65536)
                except TimeoutError:
                    if buf.strip():
                        msg = f"no complete request line within {self._idle_timeout_s:g} s"
                        writer.write(_encode(_error(None, "bad-request", msg)))
                    return
                if not chunk:  # EOF: a last line without newline still counts
                    if buf.strip() and len(buf) <= self._max_line:
                        await self._answer(writer, bytes(buf), peer)
                    return
                buf += chunk
            if end < 0 or end > self._max_line:
                msg = f"request line longer than {self._max_line} bytes; closing the connection"
                await self._send(writer, _error(None, "too-large", msg))
                return
            line = bytes(buf[:end])
            del buf[: end + 1]
            if line.strip():
                await self._answer(writer, line, peer)

    async def _send(self, writer: asyncio.StreamWriter, message: dict[str, Any] | bytes) -> None:
        writer.write(message if isinstance(message, bytes) else _encode(message))
        if writer.transport.get_write_buffer_size():  # the client is slow to read: wait, bounded
            async with asyncio.timeout(self._idle_timeout_s):
                await writer.drain()

    async def _answer(self, writer: asyncio.StreamWriter, line: bytes, peer: Peer) -> None:
        rid: Any = None
        response: dict[str, Any] | bytes
        try:
            try:
                req = _decode(line)
            except (ValueError, RecursionError) as exc:
                raise ControlError("bad-request", f"request is not valid JSON: {exc}") from None
            if isinstance(req, dict) and not _refusal(req.get("id"), "id", 2):
                rid = req.get("id")  # echoed only if it can be: else the answer's id is null
            cmd, args = _check_envelope(req)
            self._authorise(cmd, peer)
            _check_args(cmd, args)
            if COMMANDS[cmd].access is not Access.READ:
                logger.info("uid %d (pid %d): %s %s", peer.uid, peer.pid, cmd, args)
            response = await self._call(cmd, args, peer, rid)
        except ControlError as exc:
            response = _error(rid, exc.code, exc.message)
        await self._send(writer, response)

    def _is_admin(self, peer: Peer) -> bool:
        """Root, or a member (primary or supplementary) of the admin group."""
        admin_gid = self._admin_gid
        return peer.uid == 0 or (admin_gid is not None and admin_gid in peer.groups | {peer.gid})

    def _authorise(self, cmd: str, peer: Peer) -> None:
        spec = COMMANDS[cmd]
        if spec.access is Access.READ or peer.uid == 0:
            return
        if spec.access is Access.ADMIN and self._is_admin(peer):
            return
        logger.info("refused %s from uid %d (pid %d)", cmd, peer.uid, peer.pid)
        if spec.access is Access.ROOT:
            raise ControlError(
                "forbidden", f"{cmd} needs root: {spec.root_reason} (you are uid {peer.uid})"
            )
        if self._admin_gid is None:
            need = "root (no admin group is configured)"
        else:
            need = f"root or membership of group {self._admin_group_name!r}"
        raise ControlError(
            "forbidden", f"changing the scheduler needs {need} (you are uid {peer.uid})"
        )

    async def _call(self, cmd: str, args: dict[str, Any], peer: Peer, rid: Any) -> bytes:
        try:
            result = await self._handler(cmd, args, peer)
            if isinstance(result, EncodedResult):
                head = json.dumps({"v": PROTOCOL_VERSION, "id": rid, "ok": True, "result": None})
                response = head[: -len("null}")].encode() + result + b"}\n"
            else:
                # Encoded once, here: a result that is not JSON fails as internal.
                response = _encode({"v": PROTOCOL_VERSION, "id": rid, "ok": True, "result": result})
        except ControlError:
            raise
        except Exception:
            logger.exception("control command %s %s failed", cmd, args)
            msg = f"kiwid failed while handling {cmd!r}; see its log (journalctl -u kiwid)"
            raise ControlError("internal", msg) from None
        return response


def request(
    path: str | Path, cmd: str, args: dict[str, Any] | None = None, timeout_s: float = 5.0
) -> dict[str, Any]:
    """Send one command to kiwid and wait for its answer (blocking).

    Args:
        path: The control socket.
        cmd: Command name, e.g. ``"status"``.
        args: Its arguments (default none).
        timeout_s: Limit for the whole exchange, seconds.

    Returns:
        The ``result`` object of a successful answer.

    Raises:
        ControlError: kiwid refused the request; ``code`` says why.
        DaemonUnreachable: No answer; the message names the socket and a likely cause.
    """
    payload = _encode({"v": PROTOCOL_VERSION, "id": 1, "cmd": cmd, "args": args or {}})
    hint = "is kiwid running? (systemctl status kiwid)"
    deadline = time.monotonic() + timeout_s
    data = bytearray()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(path))
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(payload)  # kiwid may have refused us already: read why
            while b"\n" not in data and len(data) < _CLIENT_MAX_RESPONSE:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError as exc:
        why = {
            FileNotFoundError: f"control socket {path} does not exist; {hint}",
            ConnectionRefusedError: f"nothing listens on {path} (stale socket); {hint}",
            PermissionError: f"permission denied on {path}; check its and its directory's modes",
            TimeoutError: f"kiwid did not answer on {path} within {timeout_s:g} s; is it hung? "
            "(journalctl -u kiwid)",
        }.get(type(exc), f"cannot talk to kiwid on {path}: {exc.strerror}; {hint}")
        raise DaemonUnreachable(why) from None
    line, newline, _ = bytes(data).partition(b"\n")
    if not newline:
        raise DaemonUnreachable(f"kiwid closed {path} without answering; see its log")
    try:
        reply = _decode(line)
        if not reply["ok"]:
            raise ControlError(str(reply["error"]["code"]), str(reply["error"]["message"]))
        result = reply["result"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ControlError("internal", f"kiwid sent an unreadable answer: {exc}") from None
    if not isinstance(result, dict):
        raise ControlError("internal", "kiwid sent a result that is not an object")
    return result
