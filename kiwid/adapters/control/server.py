"""The control socket's server: framing, limits per uid, authorisation, answers in order.

The daemon owns the meaning of each command (it supplies a `Handler`); this
module owns everything a hostile or clumsy local client could do to it: framing,
size limits, idle and slow clients, connection limits per uid, and authorisation
by the peer's credentials (``SO_PEERCRED``) against the command table.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import math
import socket
import stat
import struct
from pathlib import Path
from typing import Any

from kiwid.adapters.control.schema import COMMANDS, PROTOCOL_VERSION, Access
from kiwid.adapters.control.wire import (
    ControlError,
    EncodedResult,
    Handler,
    Peer,
    SocketInUse,
    check_args,
    check_envelope,
    decode,
    encode,
    error_message,
    refusal,
)

logger = logging.getLogger("kiwid.control")

_REFUSAL_LOG_INTERVAL_S = 60.0  # one warning for a flood of refused connections


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
            writer.write(encode(error_message(None, "unavailable", refusal)))
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None  # always: the stream protocol runs us in a task
        self._clients[task] = writer
        self._per_uid[peer.uid] += 1
        try:
            await self._session(reader, writer, peer)
        except asyncio.CancelledError:
            # close() ends the session (kiwid stops). The task ends normally all the
            # same: asyncio's stream callback (Python 3.11) asks a cancelled task for
            # its exception, which raises, and logs a traceback at ERROR.
            writer.transport.abort()
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
                        writer.write(encode(error_message(None, "bad-request", msg)))
                    return
                if not chunk:  # EOF: a last line without newline still counts
                    if buf.strip() and len(buf) <= self._max_line:
                        await self._answer(writer, bytes(buf), peer)
                    return
                buf += chunk
            if end < 0 or end > self._max_line:
                msg = f"request line longer than {self._max_line} bytes; closing the connection"
                await self._send(writer, error_message(None, "too-large", msg))
                return
            line = bytes(buf[:end])
            del buf[: end + 1]
            if line.strip():
                await self._answer(writer, line, peer)

    async def _send(self, writer: asyncio.StreamWriter, message: dict[str, Any] | bytes) -> None:
        writer.write(message if isinstance(message, bytes) else encode(message))
        if writer.transport.get_write_buffer_size():  # the client is slow to read: wait, bounded
            async with asyncio.timeout(self._idle_timeout_s):
                await writer.drain()

    async def _answer(self, writer: asyncio.StreamWriter, line: bytes, peer: Peer) -> None:
        rid: Any = None
        response: dict[str, Any] | bytes
        try:
            try:
                req = decode(line)
            except (ValueError, RecursionError) as exc:
                raise ControlError("bad-request", f"request is not valid JSON: {exc}") from None
            if isinstance(req, dict) and not refusal(req.get("id"), "id", 2):
                rid = req.get("id")  # echoed only if it can be: else the answer's id is null
            cmd, args = check_envelope(req)
            self._authorise(cmd, peer)
            check_args(cmd, args)
            if COMMANDS[cmd].access is not Access.READ:
                logger.info("uid %d (pid %d): %s %s", peer.uid, peer.pid, cmd, args)
            if COMMANDS[cmd].access is Access.OWNER:
                peer = dataclasses.replace(peer, admin=self._is_admin(peer))
            response = await self._call(cmd, args, peer, rid)
        except ControlError as exc:
            response = error_message(rid, exc.code, exc.message, exc.arg)
        await self._send(writer, response)

    def _is_admin(self, peer: Peer) -> bool:
        """Root, or a member (primary or supplementary) of the admin group."""
        admin_gid = self._admin_gid
        return peer.uid == 0 or (admin_gid is not None and admin_gid in peer.groups | {peer.gid})

    def _authorise(self, cmd: str, peer: Peer) -> None:
        spec = COMMANDS[cmd]
        if spec.access in (Access.READ, Access.OWNER) or peer.uid == 0:
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
                response = encode({"v": PROTOCOL_VERSION, "id": rid, "ok": True, "result": result})
        except ControlError:
            raise
        except Exception:
            logger.exception("control command %s %s failed", cmd, args)
            msg = f"kiwid failed while handling {cmd!r}; see its log (journalctl -u kiwid)"
            raise ControlError("internal", msg) from None
        return response
