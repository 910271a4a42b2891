"""A minimal NETLINK_SOCK_DIAG client: dump TCP (v4 and v6) and Unix sockets (stdlib only).

One dump request for TCP, one for Unix; the kernel answers with one message per
socket of the netlink socket's network namespace, then ``NLMSG_DONE``. Only the
fields the reader needs are decoded, and the attributes (``tcp_info``, the Unix
name and queue lengths) only for the sockets the caller asks about: on a host
namespace with thousands of sockets the cost is one ``struct.unpack_from`` per
socket that is not the tenant's.

TCP is asked for with ``TCPDIAG_GETSOCK`` (``struct inet_diag_req``, the request
``inet_diag`` has kept for compatibility since 2.6), which answers for IPv4 and
IPv6 at once, rather than with one ``SOCK_DIAG_BY_FAMILY`` per family: most of a
TCP dump's cost is the kernel walking every bucket of the established hash
table (``net.ipv4.tcp_ehash_entries``, sized by RAM and shared by all namespaces
unless ``net.ipv4.tcp_child_ehash_entries`` gave one its own), however few
sockets the namespace holds: ~1.4 ms for 262,144 buckets on a 2-core VM. One
walk instead of two halves a poll's cost. Unix sockets live in a small table:
their dump costs next to nothing.

The C layouts (``linux/netlink.h``, ``linux/sock_diag.h``, ``linux/inet_diag.h``,
``linux/unix_diag.h``, ``linux/tcp.h``), stable kernel ABI::

    struct nlmsghdr { u32 len; u16 type; u16 flags; u32 seq; u32 pid; };   16 bytes
    struct inet_diag_req { u8 family, src_len, dst_len, ext;
                           struct inet_diag_sockid id; u32 states, dbug; };  60 bytes
    struct inet_diag_sockid { be16 sport, dport; be32 src[4], dst[4];
                              u32 if; u32 cookie[2]; };                      48 bytes
    struct inet_diag_msg { u8 family, state, timer, retrans;
                           struct inet_diag_sockid id;
                           u32 expires, rqueue, wqueue, uid, inode; };       72 bytes
    struct unix_diag_req { u8 family, protocol; u16 pad;
                           u32 states, ino, show; u32 cookie[2]; };          24 bytes
    struct unix_diag_msg { u8 family, type, state, pad; u32 ino;
                           u32 cookie[2]; };                                 16 bytes
    struct nlattr { u16 len; u16 type; };  then the payload, 4-byte aligned

``tcp_info`` offsets used: ``tcpi_last_data_sent`` 44, ``tcpi_last_data_recv`` 52
(since Linux 2.6), ``tcpi_data_segs_in`` 152 and ``tcpi_data_segs_out`` 156
(Linux 4.6; read only when the kernel's struct is that long).
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

__all__ = [
    "NETLINK_SOCK_DIAG",
    "InetSocket",
    "SocketDiagError",
    "TcpTimes",
    "UnixSocket",
    "dump",
    "dump_tcp",
    "dump_unix",
    "open_diag_socket",
]

NETLINK_SOCK_DIAG = 4  # not in Python's socket module
TCPDIAG_GETSOCK = 18
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300  # NLM_F_ROOT | NLM_F_MATCH

# TCP states (include/net/tcp_states.h); Unix sockets use the same numbers.
TCP_ESTABLISHED = 1
TCP_CLOSE_WAIT = 8
TCP_LISTEN = 10

INET_DIAG_INFO = 2  # attribute type; requested as bit 1 << (type - 1) in idiag_ext
UNIX_DIAG_NAME = 0
UNIX_DIAG_PEER = 2
UNIX_DIAG_RQLEN = 4
UDIAG_SHOW_NAME = 0x01
UDIAG_SHOW_PEER = 0x04
UDIAG_SHOW_RQLEN = 0x10

_HEADER = struct.Struct("=IHHII")
_TCPDIAG_REQ = struct.Struct("=BxxB48xI4x")  # family, (lengths), ext, (id), states, (dbug)
_INET_HEAD = struct.Struct("=BB")
_INET_PORTS = struct.Struct(">HH")
_INET_TAIL = struct.Struct("=II4xI")  # from offset 56: rqueue, wqueue, (uid), inode
_INET_MSG_SIZE = 72
_UNIX_REQ = struct.Struct("=BBxxIII8x")
_UNIX_MSG = struct.Struct("=BBBxI8x")
_ATTR = struct.Struct("=HH")
_U32 = struct.Struct("=I")
_I32 = struct.Struct("=i")
_RQLEN = struct.Struct("=II")
_TCP_TIMES = struct.Struct("=I4xI")  # last_data_sent (44), last_data_recv (52)
_TCP_SEGS = struct.Struct("=II")  # data_segs_in (152), data_segs_out (156)
_RECV_BYTES = 1 << 16  # the kernel fills at most 32 KiB a message; room to spare
_TIMEOUT_S = 2.0


class SocketDiagError(Exception):
    """The sockets cannot be read: no permission, namespace gone, netlink refused.

    Attributes:
        errno: The kernel's error number, when it gave one.
    """

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.errno = code


@dataclass(frozen=True)
class TcpTimes:
    """When a TCP connection last moved data (``tcp_info``; kernel clock ticks, 1-10 ms).

    Attributes:
        last_data_sent_ms: Milliseconds since data last went out (since the
            connection was made if none ever did).
        last_data_recv_ms: Milliseconds since data last came in (likewise).
        data_segs_in: Data segments received so far (``None``: kernel < 4.6).
        data_segs_out: Data segments sent so far (``None``: kernel < 4.6).
    """

    last_data_sent_ms: int
    last_data_recv_ms: int
    data_segs_in: int | None
    data_segs_out: int | None


@dataclass(frozen=True)
class InetSocket:
    """One TCP socket from an ``inet_diag`` dump.

    Attributes:
        family: ``AF_INET`` or ``AF_INET6``.
        state: The TCP state (``TCP_LISTEN``, ``TCP_ESTABLISHED``, ...).
        local: Local address, as ``inet_ntop`` writes it.
        local_port: Local port.
        remote: Remote address (all zeros for a listener).
        remote_port: Remote port (0 for a listener).
        rqueue: Listener: connections in the accept queue; otherwise unread bytes.
        wqueue: Listener: the accept queue's limit (the backlog); otherwise unsent bytes.
        inode: The socket's inode (0 for one no process holds, e.g. not yet accepted).
        times: From ``tcp_info`` when asked for, else ``None``.
    """

    family: int
    state: int
    local: str
    local_port: int
    remote: str
    remote_port: int
    rqueue: int
    wqueue: int
    inode: int
    times: TcpTimes | None


@dataclass(frozen=True)
class UnixSocket:
    """One Unix stream or seqpacket socket from a ``unix_diag`` dump.

    Attributes:
        type: ``SOCK_STREAM`` or ``SOCK_SEQPACKET``.
        state: ``TCP_LISTEN`` or ``TCP_ESTABLISHED``.
        inode: The socket's inode.
        name: Its address: a path, ``@name`` for the abstract namespace, or ``""``
            when unbound. An accepted socket carries its listener's address.
        peer: The inode of the socket at the other end (0: none).
        peer_name: The other end's address (what a client's unnamed socket is
            connected to), if it has one and is in the namespace; else ``""``.
        rqueue: Listener: connections not yet accepted; otherwise unread bytes.
        wqueue: Listener: the accept queue's limit; otherwise unsent bytes.
    """

    type: int
    state: int
    inode: int
    name: str
    peer: int
    peer_name: str
    rqueue: int
    wqueue: int


def open_diag_socket() -> socket.socket:
    """A NETLINK_SOCK_DIAG socket in the calling thread's network namespace.

    Raises:
        SocketDiagError: The kernel refused one.
    """
    try:
        sock = socket.socket(
            socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG
        )
    except OSError as err:
        raise SocketDiagError(
            f"cannot open a sock_diag netlink socket: {err.strerror}", err.errno
        ) from err
    sock.settimeout(_TIMEOUT_S)  # the kernel answers at once; never hang a poll on it
    return sock


def dump(sock: socket.socket, kind: int, request: bytes, what: str) -> Iterator[memoryview]:
    """Send one dump request and yield each answer's payload until ``NLMSG_DONE``.

    Args:
        sock: From :func:`open_diag_socket`.
        kind: The request's message type (``SOCK_DIAG_BY_FAMILY``, ...).
        request: The request's payload.
        what: Names the dump in errors.

    Raises:
        SocketDiagError: The kernel refused it, or did not answer.
    """
    flags = NLM_F_REQUEST | NLM_F_DUMP
    header = _HEADER.pack(_HEADER.size + len(request), kind, flags, 1, 0)
    try:
        sock.sendto(header + request, (0, 0))
        while True:
            data = memoryview(sock.recv(_RECV_BYTES))
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, kind, _flags, _seq, _pid = _HEADER.unpack_from(data, offset)
                if length < _HEADER.size or offset + length > len(data):
                    raise SocketDiagError(f"{what}: malformed netlink message")
                body = data[offset + _HEADER.size : offset + length]
                if kind in (NLMSG_DONE, NLMSG_ERROR):
                    # Both carry an int: 0 or minus an errno (DONE: a dump that failed midway).
                    code = _I32.unpack_from(body)[0] if len(body) >= 4 else 0
                    if code < 0:
                        raise SocketDiagError(f"{what}: {os.strerror(-code)}", -code)
                    return
                yield body
                offset += (length + 3) & ~3
    except TimeoutError as err:
        raise SocketDiagError(f"{what}: the kernel did not answer") from err
    except OSError as err:
        raise SocketDiagError(f"{what}: {err.strerror}", err.errno) from err


def _attributes(body: memoryview, start: int) -> Iterator[tuple[int, memoryview]]:
    offset = start
    while offset + _ATTR.size <= len(body):
        length, kind = _ATTR.unpack_from(body, offset)
        if length < _ATTR.size:
            return
        yield kind & 0x3FFF, body[offset + _ATTR.size : offset + length]
        offset += (length + 3) & ~3


def _tcp_times(info: memoryview) -> TcpTimes | None:
    if len(info) < 56:
        return None
    sent, recv = _TCP_TIMES.unpack_from(info, 44)
    segs_in, segs_out = _TCP_SEGS.unpack_from(info, 152) if len(info) >= 160 else (None, None)
    return TcpTimes(sent, recv, segs_in, segs_out)


def dump_tcp(
    sock: socket.socket,
    states: Collection[int],
    wanted: Callable[[int], bool],
    *,
    times: bool,
) -> list[InetSocket]:
    """Dump the TCP sockets, IPv4 and IPv6, of the socket's namespace.

    One ``TCPDIAG_GETSOCK`` request (see the module's docstring for why not one
    ``SOCK_DIAG_BY_FAMILY`` per family).

    Args:
        sock: From :func:`open_diag_socket`.
        states: The TCP states to dump (the kernel filters).
        wanted: Which inodes to decode; the others are skipped.
        times: Ask for ``tcp_info`` and decode :class:`TcpTimes`.

    Returns:
        The wanted sockets.

    Raises:
        SocketDiagError: The dump failed.
    """
    mask = sum(1 << s for s in states)
    ext = 1 << (INET_DIAG_INFO - 1) if times else 0
    # The family is ignored by this request; AF_INET says what is meant.
    request = _TCPDIAG_REQ.pack(socket.AF_INET, ext, mask)
    found: list[InetSocket] = []
    for body in dump(sock, TCPDIAG_GETSOCK, request, "tcp socket dump"):
        if len(body) < _INET_MSG_SIZE:
            continue
        rqueue, wqueue, inode = _INET_TAIL.unpack_from(body, 56)
        if not wanted(inode):
            continue
        family, state = _INET_HEAD.unpack_from(body)
        sport, dport = _INET_PORTS.unpack_from(body, 4)
        size = 4 if family == socket.AF_INET else 16
        info = None
        for attr, payload in _attributes(body, _INET_MSG_SIZE) if times else ():
            if attr == INET_DIAG_INFO:
                info = payload
                break
        found.append(
            InetSocket(
                family=family,
                state=state,
                local=socket.inet_ntop(family, bytes(body[8 : 8 + size])),
                local_port=sport,
                remote=socket.inet_ntop(family, bytes(body[24 : 24 + size])),
                remote_port=dport,
                rqueue=rqueue,
                wqueue=wqueue,
                inode=inode,
                times=_tcp_times(info) if info is not None else None,
            )
        )
    return found


def _unix_name(raw: memoryview) -> str:
    data = bytes(raw)
    if data.startswith(b"\0"):  # abstract: shown as ss(8) does, with '@'
        return "@" + data[1:].decode("utf-8", "backslashreplace")
    return data.rstrip(b"\0").decode("utf-8", "backslashreplace")


def _unix_attributes(body: memoryview) -> tuple[str, int, int, int]:
    name, peer, rqueue, wqueue = "", 0, 0, 0
    for attr, payload in _attributes(body, _UNIX_MSG.size):
        if attr == UNIX_DIAG_NAME:
            name = _unix_name(payload)
        elif attr == UNIX_DIAG_PEER and len(payload) >= 4:
            peer = _U32.unpack_from(payload)[0]
        elif attr == UNIX_DIAG_RQLEN and len(payload) >= 8:
            rqueue, wqueue = _RQLEN.unpack_from(payload)
    return name, peer, rqueue, wqueue


def dump_unix(sock: socket.socket, wanted: Callable[[int], bool]) -> list[UnixSocket]:
    """Dump the listening and connected Unix stream/seqpacket sockets of the namespace.

    Args:
        sock: From :func:`open_diag_socket`.
        wanted: Which inodes to decode; the others are skipped, except that the
            peer of a wanted unnamed socket gives its name (``peer_name``).

    Returns:
        The wanted sockets.

    Raises:
        SocketDiagError: The dump failed.
    """
    show = UDIAG_SHOW_NAME | UDIAG_SHOW_PEER | UDIAG_SHOW_RQLEN
    states = (1 << TCP_LISTEN) | (1 << TCP_ESTABLISHED)
    request = _UNIX_REQ.pack(socket.AF_UNIX, 0, states, 0, show)
    found: list[tuple[int, int, int, str, int, int, int]] = []
    # Kept undecoded: a client's socket is unnamed, and its peer (the server's end,
    # which carries the listener's address) says what it is connected to.
    others: dict[int, memoryview] = {}
    for body in dump(sock, SOCK_DIAG_BY_FAMILY, request, "unix socket dump"):
        if len(body) < _UNIX_MSG.size:
            continue
        _family, kind, state, inode = _UNIX_MSG.unpack_from(body)
        if kind == socket.SOCK_DGRAM:
            continue
        if not wanted(inode):
            others[inode] = body
            continue
        found.append((kind, state, inode, *_unix_attributes(body)))
    names = {inode: name for _, _, inode, name, *_ in found}
    sockets: list[UnixSocket] = []
    for kind, state, inode, name, peer, rqueue, wqueue in found:
        peer_name = names.get(peer, "")
        if peer and not name and (other := others.get(peer)) is not None:
            peer_name = _unix_attributes(other)[0]
        sockets.append(UnixSocket(kind, state, inode, name, peer, peer_name, rqueue, wqueue))
    return sockets
