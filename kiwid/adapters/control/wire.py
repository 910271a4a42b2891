"""One request line: parsing it strictly, checking it, and the errors either side raises.

Strict JSON (no NaN, bounded nesting and integers), Unicode that can be echoed,
the envelope, and each argument against the command table. Standard library only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kiwid.adapters.control.schema import COMMANDS, ENVELOPE, PROTOCOL_VERSION

CLIENT_MAX_RESPONSE = 16 * 1024 * 1024  # bytes; a status of many GPUs stays far below
MAX_DEPTH = 32  # levels of objects and arrays in a request, the request itself being 1
MAX_INT_DIGITS = 64  # digits of an integer in a request; an int64 has 19


class ControlError(Exception):
    """A refused request: the handler raises it, `request` re-raises the daemon's.

    Attributes:
        code: One of `ERROR_CODES` (a newer daemon may send others).
        message: One readable sentence for a person.
        arg: The argument whose value is at fault, when one is (``invalid-value``):
            e.g. ``memory_bytes`` for a declaration no GPU of the container can hold.
    """

    def __init__(self, code: str, message: str, arg: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.arg = arg


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
        admin: Root or a member of the admin group (set by the server for
            ``Access.OWNER`` commands, whose handler judges everyone else).
    """

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]
    admin: bool = False


class EncodedResult(bytes):
    """A result the handler already encoded as one JSON object (UTF-8, no newline).

    The daemon hands its cached status over like this, so that a hundred
    ``kiwictl status`` callers cost one encoding, not a hundred.
    """


Handler = Callable[[str, dict[str, Any], Peer], Awaitable[dict[str, Any] | EncodedResult]]


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


def decode(line: bytes) -> Any:
    """Parse one request line strictly (UTF-8, no NaN/Infinity, finite numbers)."""
    return json.loads(
        line.decode("utf-8"),
        parse_constant=_reject_constant,
        parse_float=_finite_float,
        parse_int=_bounded_int,
    )


def text_problem(text: str) -> str | None:
    """Why kiwid refuses this string (a lone surrogate cannot be encoded, NUL), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"is not valid Unicode: it holds a lone surrogate U+{ord(text[exc.start]):04X}"
    if "\0" in text:  # no name, id or path has one; many C and kernel interfaces stop at it
        return "contains a NUL character (U+0000)"
    return None


def refusal(value: Any, path: str = "", depth: int = 1) -> str | None:
    """The first string or key kiwid refuses in ``value``, or nesting too deep; or None.

    Walks without recursion, in document order, so that no nesting the JSON parser
    accepted can exhaust the stack here. ``path`` names ``value`` (``""``: the request).
    """
    stack = [(value, path, depth)]
    while stack:
        item, where, level = stack.pop()
        if isinstance(item, str):
            if problem := text_problem(item):
                return f"the string at {where} {problem}" if where else f"the request {problem}"
        elif isinstance(item, dict | list):
            if level > MAX_DEPTH:
                return f"{where or 'the request'} is nested deeper than {MAX_DEPTH} levels"
            if isinstance(item, list):
                named = [(f"{where}[{i}]", v) for i, v in enumerate(item)]
            else:
                for key in item:
                    if problem := text_problem(key):
                        return f"a key of {where or 'the request'} {problem}"
                named = [(f"{where}.{k}" if where else k, v) for k, v in item.items()]
            stack.extend((v, name, level + 1) for name, v in reversed(named))
    return None


def encode(message: dict[str, Any]) -> bytes:
    """One message as a JSON line (UTF-8: every string in it passed :func:`refusal`)."""
    return json.dumps(message, ensure_ascii=False, allow_nan=False).encode("utf-8") + b"\n"


def error_message(rid: Any, code: str, message: str, arg: str | None = None) -> dict[str, Any]:
    """The answer that refuses request ``rid`` with ``code`` (``arg``: the argument at fault)."""
    error = {"code": code, "message": message}
    if arg is not None:
        error["arg"] = arg
    return {"v": PROTOCOL_VERSION, "id": rid, "ok": False, "error": error}


def check_envelope(req: Any) -> tuple[str, dict[str, Any]]:
    """Validate a parsed request; return ``(cmd, args)`` or raise `ControlError`."""
    if problem := refusal(req):  # first: no message below may quote such a string
        raise ControlError("bad-request", f"request refused: {problem}")
    if not isinstance(req, dict):
        raise ControlError("bad-request", "a request must be a JSON object")
    extra = sorted(set(req) - set(ENVELOPE))
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


def check_args(cmd: str, args: dict[str, Any]) -> None:
    """Check ``args`` against ``cmd``'s entry in the table; raise ``bad-request`` if off."""
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
