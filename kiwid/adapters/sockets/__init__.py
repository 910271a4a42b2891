"""Does a parked tenant have a request waiting? Read from the kernel's socket diagnostics.

What is read: the socket inodes the tenant's processes hold (``/proc/PID/fd/*``
-> ``socket:[INODE]``), then, in each network namespace those processes live in
(a pod has its own; a host-network process shares the host's), one
NETLINK_SOCK_DIAG dump of TCP sockets (IPv4 and IPv6 together) and one of Unix
stream/seqpacket sockets. The tenant's own sockets are picked by inode, always (a
host namespace holds everyone else's too). From them :func:`probe` says what
waits (a listener's accept queue, unread bytes, and when the tenant is not frozen
a TCP request that was read and not answered) and where the tenant listens. The
rules, and what they cannot see, are in :mod:`.reader`.

Why it is safe: sock_diag only reads kernel tables; it does not touch the
sockets, their queues or their timers, and works the same on a frozen cgroup's
sockets (the kernel keeps completing handshakes into the accept queue and
queueing bytes while the processes are frozen, up to the backlog and buffers).
Nothing runs in the tenant's namespace: no ``nsenter``, no process started
there. A helper thread of kiwid calls ``setns(fd, CLONE_NEWNET)`` on itself
only, with ``fd`` an open ``/proc/PID/ns/net``, creates the netlink socket (which
stays bound to the namespace it was created in) and ends; kiwid's other threads
never change namespace (:mod:`.netns` says why a thread rather than a fork).
Holding the namespace open from ``/proc/PID/ns/net`` to the dump means the
process may exit meanwhile: its sockets are then simply gone from the answer.

Cost per call: reading ``/proc/PID/fd`` (one ``readlink`` per descriptor); one
helper thread, unless every namespace is kiwid's own; and per namespace where
the tenant holds sockets one netlink socket and two dumps. The TCP dump's kernel
time dominates (see :mod:`.diag`). Sockets that are not the tenant's cost one
``struct.unpack_from`` each; ``tcp_info`` is asked for only when not frozen.
:func:`probe_many` reads several tenants with one dump per namespace among them
all: host-network tenants then share the host's dump, the dearest.
``bench/sockets_probe.py`` measures it.

Needs root (``CAP_SYS_PTRACE`` to read other users' ``/proc/PID/fd`` and
``ns/net``, ``CAP_SYS_ADMIN`` for ``setns``); otherwise :class:`SocketDiagError`
says what was refused. A tenant with no sockets gets an empty answer.

Library decision: our own module of ``socket`` + ``struct`` (:mod:`.diag`), not
pyroute2 (0.9.7 evaluated, installed and run here). Its ``DiagSocket`` does dump
TCP with ``tcp_info`` and Unix sockets with ``UDIAG_SHOW_RQLEN``, decoded
correctly, but it does not do the part that is hard here, the namespace:
``DiagSocket(fileno=None)`` takes no namespace and ignores the ``fileno`` it is
given, so neither it nor a socket our own thread opened in the tenant's
namespace can be used; pyroute2's namespace helper (``netns.create_socket``)
forks a child process for each socket (``os.fork`` in a daemon with gRPC
threads), and by default (``O_CREAT``) creates a namespace of the given name if
it finds none. ``get_sock_stats`` is marked "WIP, the signature will change".
Importing it costs ~120-270 ms and ~160 modules (asyncio among them; this
package: ~40 ms with kiwid's own), the package is 5 MB, its dumps took longer
here (TCP v4 and v6: 5.2 ms against 2.2; Unix: 0.5 ms against 0.04), and what
it would save is a handful of fixed C structs of a stable kernel ABI and a
``recv`` loop.
"""

from __future__ import annotations

from kiwid.adapters.sockets.diag import SocketDiagError
from kiwid.adapters.sockets.reader import (
    ACCEPT,
    UNANSWERED,
    UNREAD,
    Listening,
    Probe,
    Waiting,
    listening,
    probe,
    probe_many,
    sockets_of,
    waiting,
)

__all__ = [
    "ACCEPT",
    "UNANSWERED",
    "UNREAD",
    "Listening",
    "Probe",
    "SocketDiagError",
    "Waiting",
    "listening",
    "probe",
    "probe_many",
    "sockets_of",
    "waiting",
]
