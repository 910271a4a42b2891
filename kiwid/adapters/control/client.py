"""The control socket's client: one request, one answer (kiwictl, kiwi-hook, tests)."""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path
from typing import Any

from kiwid.adapters.control.schema import PROTOCOL_VERSION
from kiwid.adapters.control.wire import ControlError, DaemonUnreachable, decode, encode

CLIENT_MAX_RESPONSE = 16 * 1024 * 1024  # bytes; a status of many GPUs stays far below


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
    payload = encode({"v": PROTOCOL_VERSION, "id": 1, "cmd": cmd, "args": args or {}})
    hint = "is kiwid running? (systemctl status kiwid)"
    deadline = time.monotonic() + timeout_s
    data = bytearray()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(path))
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(payload)  # kiwid may have refused us already: read why
            while b"\n" not in data and len(data) < CLIENT_MAX_RESPONSE:
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
        reply = decode(line)
        if not reply["ok"]:
            error = reply["error"]
            arg = error.get("arg")
            raise ControlError(
                str(error["code"]), str(error["message"]), arg if isinstance(arg, str) else None
            )
        result = reply["result"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ControlError("internal", f"kiwid sent an unreadable answer: {exc}") from None
    if not isinstance(result, dict):
        raise ControlError("internal", "kiwid sent a result that is not an object")
    return result
