"""Does a tenant have a request waiting, and what is it watched on: the judgement.

One call reads the tenant's socket inodes (:mod:`.owners`), opens one sock_diag
socket per network namespace they live in (:mod:`.netns`), dumps TCP (v4 and v6
together) and Unix sockets there once each (:mod:`.diag`), keeps the tenant's
own by inode and judges them. The rules are in :func:`probe`.

What the rules cannot see:

* The kernel's ``tcp_info`` times tick with ``HZ`` (1-10 ms). A request that
  comes within one tick of the answer before it, on the same connection, reads
  as answered, and stays so until more data moves. A parked tenant is idle: its
  next request comes long after its last answer.
* A client that sends what needs no answer (HTTP/2 ``WINDOW_UPDATE`` or
  ``SETTINGS`` acks, an upload stream, a pub/sub subscription) leaves an idle
  connection looking ``unanswered``. Take ``unanswered`` as a strong hint, not a
  proof; ``accept`` and ``unread`` are facts.
* Unix sockets have no such times: only ``accept`` and ``unread`` there.
  Datagram sockets (UDP, Unix datagram) are not read at all.
* Connections still in their handshake are not in the accept queue; a full
  queue (the backlog) stops growing while clients retry.
* A socket passed in from another namespace is found only if one of the
  tenant's processes lives in that namespace.
"""

from __future__ import annotations

import socket
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from kiwid.adapters.sockets.diag import (
    TCP_CLOSE_WAIT,
    TCP_ESTABLISHED,
    TCP_LISTEN,
    InetSocket,
    SocketDiagError,
    UnixSocket,
    dump_tcp,
    dump_unix,
)
from kiwid.adapters.sockets.netns import diag_sockets
from kiwid.adapters.sockets.owners import NamespaceKey, Owners, read_owners

__all__ = [
    "Listening",
    "Probe",
    "Waiting",
    "listening",
    "probe",
    "probe_many",
    "sockets_of",
    "waiting",
]

ACCEPT = "accept"
UNREAD = "unread"
UNANSWERED = "unanswered"
# CLOSE_WAIT: the peer sent, then shut down; its request may still wait.
_STATES = (TCP_LISTEN, TCP_ESTABLISHED, TCP_CLOSE_WAIT)
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Waiting:
    """A request that waits on one of the tenant's sockets.

    Attributes:
        kind: ``accept`` (connections in a listener's accept queue), ``unread``
            (bytes received and not read) or ``unanswered`` (read, no answer sent
            since; TCP only, and only when not frozen).
        socket: Which socket, e.g. ``tcp 10.0.0.5:8000 <- 10.0.0.9:51234``,
            ``tcp6 [::]:8000``, ``unix /run/app.sock``, ``unix -> /run/db.sock``.
        detail: How much and since when, for the operator.
        inbound: Whether a client of the tenant waits: a listener, or a
            connection accepted on one (its local port or Unix address is one the
            tenant listens on). ``False``: a connection the tenant opened itself,
            e.g. a database's reply waiting unread.
    """

    kind: str
    socket: str
    detail: str
    inbound: bool = True


@dataclass(frozen=True)
class Listening:
    """A socket the tenant accepts connections on ("wakes on ...").

    Attributes:
        proto: ``tcp``, ``tcp6`` or ``unix``.
        where: ``0.0.0.0:8000``, ``[::]:8000``, a path, or ``@name`` (abstract).
    """

    proto: str
    where: str

    def __str__(self) -> str:
        return f"{self.proto} {self.where}"


@dataclass(frozen=True)
class Probe:
    """What one read of a tenant's sockets found.

    Attributes:
        waiting: Requests that wait, sorted.
        listening: Where it listens, sorted.
        sockets: How many of its sockets were found in the dumps.
    """

    waiting: tuple[Waiting, ...]
    listening: tuple[Listening, ...]
    sockets: int


def _where(address: str, port: int, family: int) -> str:
    return f"[{address}]:{port}" if family == socket.AF_INET6 else f"{address}:{port}"


def _proto(family: int) -> str:
    return "tcp6" if family == socket.AF_INET6 else "tcp"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _unanswered(sock: InetSocket, after_ms: float) -> str | None:
    """Why a connection's last data in came after its last data out, or ``None``.

    The kernel's clocks tick every 1-10 ms (``HZ``), so data in and out within
    one tick read as simultaneous: that counts as answered (a health check
    answered at once), unless nothing ever went out.
    """
    times = sock.times
    if times is None or times.last_data_recv_ms < after_ms:
        return None
    recv_s = times.last_data_recv_ms / 1000
    if times.data_segs_in is not None and times.data_segs_out is not None:
        if times.data_segs_in == 0:
            return None
        if times.data_segs_out == 0:
            return f"request {recv_s:.2f} s ago, never answered"
    if times.last_data_recv_ms < times.last_data_sent_ms:
        return f"request {recv_s:.2f} s ago, last answer {times.last_data_sent_ms / 1000:.2f} s ago"
    return None


def _judge_inet(sockets: list[InetSocket], frozen: bool, after_ms: float) -> list[Waiting]:
    ports = {s.local_port for s in sockets if s.state == TCP_LISTEN}
    found: list[Waiting] = []
    for sock in sockets:
        proto = _proto(sock.family)
        local = _where(sock.local, sock.local_port, sock.family)
        if sock.state == TCP_LISTEN:
            if sock.rqueue:
                what = f"{_plural(sock.rqueue, 'connection')} not accepted (backlog {sock.wqueue})"
                found.append(Waiting(ACCEPT, f"{proto} {local}", what))
            continue
        inbound = sock.local_port in ports
        remote = _where(sock.remote, sock.remote_port, sock.family)
        name = f"{proto} {local} <- {remote}" if inbound else f"{proto} {local} -> {remote}"
        if sock.rqueue:
            found.append(Waiting(UNREAD, name, f"{_plural(sock.rqueue, 'byte')} unread", inbound))
        elif not frozen and inbound and (why := _unanswered(sock, after_ms)) is not None:
            # Only a server's end: on a connection the tenant opened, the last
            # data in is the answer to what it sent, the normal idle state.
            found.append(Waiting(UNANSWERED, name, why, inbound))
    return found


def _judge_unix(sockets: list[UnixSocket]) -> list[Waiting]:
    names = {s.name for s in sockets if s.state == TCP_LISTEN and s.name}
    found: list[Waiting] = []
    for sock in sockets:
        if sock.state == TCP_LISTEN:
            if sock.rqueue:
                what = f"{_plural(sock.rqueue, 'connection')} not accepted (backlog {sock.wqueue})"
                found.append(Waiting(ACCEPT, f"unix {sock.name or '(unnamed)'}", what))
            continue
        if not sock.rqueue:
            continue
        inbound = bool(sock.name) and sock.name in names
        if sock.name:
            name = f"unix {sock.name}"
        else:
            name = f"unix -> {sock.peer_name}" if sock.peer_name else "unix (unnamed)"
        found.append(Waiting(UNREAD, name, f"{_plural(sock.rqueue, 'byte')} unread", inbound))
    return found


def _listening(inet: list[InetSocket], unix: list[UnixSocket]) -> set[Listening]:
    found = {
        Listening(_proto(s.family), _where(s.local, s.local_port, s.family))
        for s in inet
        if s.state == TCP_LISTEN
    }
    found.update(Listening("unix", s.name or "(unnamed)") for s in unix if s.state == TCP_LISTEN)
    return found


def probe(pids: Iterable[int], *, frozen: bool, unanswered_after_s: float = 0.05) -> Probe:
    """Read a tenant's sockets in their network namespaces and judge them.

    A request waits when:

    * a listener has connections in its accept queue (``accept``);
    * a connected socket has bytes nobody read (``unread``);
    * not ``frozen`` only, on a TCP connection accepted on one of the tenant's
      listeners: data came in after data last went out (or none ever went out),
      at least ``unanswered_after_s`` ago (``unanswered``): the request was read
      and its handler is stuck, e.g. at its first CUDA call under the CUDA lock.

    Args:
        pids: The tenant's processes; those that exited meanwhile are skipped.
        frozen: Whether the tenant is frozen (its CPU side runs nothing), which
            makes ``unanswered`` meaningless and skips reading ``tcp_info``.
        unanswered_after_s: How long a read request must stay unanswered.

    Returns:
        What waits and where it listens; empty for a tenant without sockets.

    Raises:
        SocketDiagError: The sockets cannot be read (not root, a namespace that
            cannot be entered, netlink refused).
    """
    found = probe_many({0: pids}, frozen={0: frozen}, unanswered_after_s=unanswered_after_s)[0]
    if isinstance(found, SocketDiagError):
        raise found
    return found


class _Seen:
    """What one tenant's probe has gathered so far, namespace by namespace."""

    def __init__(self) -> None:
        self.waits: list[Waiting] = []
        self.listens: set[Listening] = set()
        self.count = 0

    def add(self, inet: list[InetSocket], unix: list[UnixSocket], frozen: bool, ms: float) -> None:
        self.count += len(inet) + len(unix)
        self.waits += _judge_inet(inet, frozen, ms) + _judge_unix(unix)
        self.listens |= _listening(inet, unix)

    def probe(self) -> Probe:
        waits = sorted(self.waits, key=lambda w: (w.kind, w.socket))
        return Probe(tuple(waits), tuple(sorted(self.listens, key=str)), self.count)


def probe_many(
    tenants: Mapping[K, Iterable[int]],
    *,
    frozen: Mapping[K, bool],
    unanswered_after_s: float = 0.05,
) -> dict[K, Probe | SocketDiagError]:
    """:func:`probe` several tenants with one dump per network namespace for them all.

    Tenants that share a namespace (host-network ones share the host's, whose
    dump costs most) are read from the same dumps.

    Args:
        tenants: Tenant key -> its processes.
        frozen: Tenant key -> whether it is frozen (as for :func:`probe`).
        unanswered_after_s: As for :func:`probe`.

    Returns:
        Tenant key -> what :func:`probe` would return, or the error it would raise.
    """
    results: dict[K, Probe | SocketDiagError] = {}
    owned: dict[K, Owners] = {}
    spaces: dict[K, set[NamespaceKey]] = {}
    namespaces: dict[NamespaceKey, int] = {}
    sockets: dict[NamespaceKey, socket.socket | SocketDiagError] = {}
    try:
        for key, pids in tenants.items():
            try:
                owned[key] = owners = read_owners(pids)
            except SocketDiagError as err:
                results[key] = err
                continue
            spaces[key] = set(owners.namespaces)
            for space, fd in owners.namespaces.items():
                namespaces.setdefault(space, fd)  # the others' copies are closed below
        sockets = diag_sockets(namespaces)
    finally:
        for owners in owned.values():
            owners.close()
    seen = {key: _Seen() for key in owned}
    inodes = set().union(*(owners.inodes for owners in owned.values()))
    try:
        for space, sock in sockets.items():
            here = [key for key in owned if space in spaces[key]]
            try:
                if isinstance(sock, SocketDiagError):
                    raise sock
                live = any(not frozen[key] for key in here)
                tcp = dump_tcp(sock, _STATES, inodes.__contains__, times=live)
                unix = dump_unix(sock, inodes.__contains__)
            except SocketDiagError as err:
                for key in here:
                    there = ", ".join(map(str, owned[key].pids[space]))
                    results[key] = SocketDiagError(f"processes {there}: {err}", err.errno)
                continue
            for key in here:
                mine = owned[key].inodes
                seen[key].add(
                    [s for s in tcp if s.inode in mine],
                    [s for s in unix if s.inode in mine],
                    frozen[key],
                    unanswered_after_s * 1000,
                )
    finally:
        for sock in sockets.values():
            if isinstance(sock, socket.socket):
                sock.close()
    for key in owned:
        results.setdefault(key, seen[key].probe())
    return results


def waiting(
    pids: Iterable[int], *, frozen: bool, unanswered_after_s: float = 0.05
) -> list[Waiting]:
    """The requests that wait on a tenant's sockets: :attr:`probe`'s ``waiting``.

    Raises:
        SocketDiagError: As for :func:`probe`.
    """
    return list(probe(pids, frozen=frozen, unanswered_after_s=unanswered_after_s).waiting)


def listening(pids: Iterable[int]) -> list[Listening]:
    """Where a tenant listens (TCP address:port, Unix paths), for its status.

    Raises:
        SocketDiagError: As for :func:`probe`.
    """
    return list(probe(pids, frozen=True).listening)


def sockets_of(pids: Iterable[int]) -> frozenset[int]:
    """The inodes of the sockets the processes hold (``/proc/PID/fd``).

    Raises:
        SocketDiagError: A process's files cannot be read.
    """
    owners = read_owners(pids)
    owners.close()
    return frozenset(owners.inodes)
