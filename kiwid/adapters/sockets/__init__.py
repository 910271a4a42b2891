"""Does a parked tenant have a request waiting? Read from the kernel's socket diagnostics.

What is read: the socket inodes the tenant's processes hold (``/proc/PID/fd/*``
-> ``socket:[INODE]``), then, in each network namespace those processes live in
(a pod has its own; a host-network process shares the host's), one
NETLINK_SOCK_DIAG dump of TCP sockets (IPv4 and IPv6 together) and one of Unix
stream/seqpacket sockets. The
tenant's own sockets are picked by inode, always (a host namespace holds everyone
else's too). From them :func:`probe` says what waits (a listener's accept queue,
unread bytes, and when the tenant is not frozen a TCP request that was read and
not answered) and where the tenant listens. The rules are in :mod:`.reader`.

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

Cost per call: reading ``/proc/PID/fd`` (one ``readlink`` per descriptor), and per
namespace where the tenant holds sockets one thread (unless it is kiwid's own),
one netlink socket and two dumps; the TCP dump's kernel time dominates (see
:mod:`.diag`). Sockets that are not the tenant's cost one
``struct.unpack_from`` each; ``tcp_info`` is asked for only when not frozen.
``bench/sockets_probe.py`` measures it.

Needs root (``CAP_SYS_PTRACE`` to read other users' ``/proc/PID/fd`` and
``ns/net``, ``CAP_SYS_ADMIN`` for ``setns``); otherwise :class:`SocketDiagError`
says what was refused. A tenant with no sockets gets an empty answer.

Library decision: our own ~300 lines of ``socket`` + ``struct``, not pyroute2
(0.9.7 evaluated). pyroute2's ``DiagSocket.get_sock_stats`` does dump inet with
``tcp_info`` and Unix with ``UDIAG_SHOW_RQLEN``, and decodes them correctly here,
but: (1) its namespace support forks a child process (``os.fork`` in a daemon
with gRPC threads) and, given a path with its default ``O_CREAT`` flag, creates a
namespace when it finds none there; (2) ``DiagSocket`` ignores a ``fileno``
passed to it, so a socket opened by our own thread in the namespace cannot be
handed to it; (3) the call is marked "WIP, the signature will change"; (4)
importing it takes ~170 ms and 160 modules (asyncio included) and the package is
5 MB, for what is here a handful of fixed C structs of a stable kernel ABI
(listed in :mod:`.diag`) and a ``recv`` loop. The hard part, the namespace, it
would not have done for us.
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
    "sockets_of",
    "waiting",
]
