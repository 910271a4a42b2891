"""Requests waiting on a tenant's sockets, read through sock_diag: real processes, real sockets.

The tenants are ``socket_tenant.py`` processes started here (some in network
namespaces of their own, under ``unshare --net``); the clients are this test
process's sockets or another ``socket_tenant.py``. Teardown kills every process
(a namespace made by ``unshare`` goes with its last process) and closes every
socket, whatever happened in the test.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kiwid.adapters.cgroups import Freezer
from kiwid.adapters.sockets import (
    ACCEPT,
    UNANSWERED,
    UNREAD,
    Listening,
    Probe,
    SocketDiagError,
    Waiting,
    listening,
    probe,
    probe_many,
    sockets_of,
    waiting,
)
from kiwid.adapters.sockets.diag import SOCK_DIAG_BY_FAMILY, dump, open_diag_socket
from tests.adapters.conftest import Sandbox, wait_until

TENANT = Path(__file__).with_name("socket_tenant.py")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (setns, other /proc/PID/fd)")


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


FAMILIES = [
    pytest.param(("tcp", "127.0.0.1"), id="ipv4"),
    pytest.param(
        ("tcp6", "::1"),
        id="ipv6",
        marks=pytest.mark.skipif(not _has_ipv6_loopback(), reason="no ::1 on this machine"),
    ),
]


def where(proto: str, host: str, port: int) -> str:
    return f"[{host}]:{port}" if proto == "tcp6" else f"{host}:{port}"


class Program:
    """A running socket_tenant.py, asked one command at a time."""

    def __init__(self, prefix: list[str]) -> None:
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(TENANT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ask(self, line: str) -> str:
        """Send a command; its answer comes once the sockets are in that state."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        reply = self.proc.stdout.readline()
        assert reply.startswith("ok"), f"{line!r} -> {reply!r}"
        return reply[2:].strip()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=5)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


class Lab:
    """The test's programs and its own (client) sockets."""

    def __init__(self) -> None:
        self.programs: list[Program] = []
        self.sockets: list[socket.socket] = []

    def start(self, *, netns: str = "") -> Program:
        """A program in this namespace, a new one (``new``), or a program's (``PID``)."""
        prefix = []
        if netns == "new":
            prefix = ["unshare", "--net", "--"]
        elif netns:
            prefix = ["nsenter", f"--net=/proc/{netns}/ns/net", "--"]
        program = Program(prefix)
        self.programs.append(program)
        if netns == "new":
            program.ask("lo-up")
        return program

    def connect(self, proto: str, *address: str | int) -> socket.socket:
        family = {"tcp": socket.AF_INET, "tcp6": socket.AF_INET6, "unix": socket.AF_UNIX}[proto]
        sock = socket.socket(family, socket.SOCK_STREAM)
        self.sockets.append(sock)
        sock.connect(address[0] if proto == "unix" else address)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        for program in self.programs:
            program.kill()


@pytest.fixture
def lab() -> Iterator[Lab]:
    box = Lab()
    try:
        yield box
    finally:
        box.close()


def ms_since_data_in(sock: socket.socket) -> int:
    """``tcpi_last_data_recv`` of one of this test's own TCP sockets."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return int(struct.unpack_from("=I", info, 52)[0])


def kinds(found: list[Waiting]) -> list[tuple[str, str]]:
    return [(w.kind, w.socket) for w in found]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_connection_nobody_accepted_waits_in_the_accept_queue(
    lab: Lab, family: tuple[str, str]
) -> None:
    proto, host = family
    tenant = lab.start()
    port = int(tenant.ask(f"listen {proto} {host} 0").split()[1])
    address = where(proto, host, port)
    assert waiting([tenant.pid], frozen=True) == []
    assert listening([tenant.pid]) == [Listening(proto, address)]

    lab.connect(proto, host, port)
    lab.connect(proto, host, port)

    # The kernel completes the handshakes and queues them, tenant or no tenant.
    expected = [Waiting(ACCEPT, f"{proto} {address}", "2 connections not accepted (backlog 16)")]
    wait_until(lambda: waiting([tenant.pid], frozen=True) == expected, what="2 in the queue")
    assert waiting([tenant.pid], frozen=False) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_bytes_nobody_read_are_unread_until_read(lab: Lab, family: tuple[str, str]) -> None:
    proto, host = family
    tenant = lab.start()
    listener, port = tenant.ask(f"listen {proto} {host} 0").split()
    client = lab.connect(proto, host, int(port))
    connection = tenant.ask(f"accept {listener}")
    remote = where(proto, host, client.getsockname()[1])
    name = f"{proto} {where(proto, host, int(port))} <- {remote}"
    assert waiting([tenant.pid], frozen=True) == []

    client.sendall(b"GET /")

    expected = [Waiting(UNREAD, name, "5 bytes unread")]
    wait_until(lambda: waiting([tenant.pid], frozen=True) == expected, what="5 bytes unread")
    assert tenant.ask(f"recv {connection} 5") == "GET /"
    assert waiting([tenant.pid], frozen=True) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_a_request_read_and_not_answered_is_unanswered_when_not_frozen(
    lab: Lab, family: tuple[str, str]
) -> None:
    proto, host = family
    tenant = lab.start()
    listener, port = tenant.ask(f"listen {proto} {host} 0").split()
    ignored, answered = lab.connect(proto, host, int(port)), lab.connect(proto, host, int(port))
    ignored_id, answered_id = tenant.ask(f"accept {listener}"), tenant.ask(f"accept {listener}")
    here = where(proto, host, int(port))
    ignored_name = f"{proto} {here} <- {where(proto, host, ignored.getsockname()[1])}"
    answered_name = f"{proto} {here} <- {where(proto, host, answered.getsockname()[1])}"

    ignored.sendall(b"req")
    answered.sendall(b"req")
    tenant.ask(f"recv {ignored_id} 3")
    tenant.ask(f"recv {answered_id} 3")
    tenant.ask(f"send {answered_id} ans")

    def unanswered() -> list[Waiting]:
        return waiting([tenant.pid], frozen=False, unanswered_after_s=0.1)

    found = wait_until_found(unanswered)
    assert kinds(found) == [(UNANSWERED, ignored_name)]
    assert found[0].detail.endswith("never answered"), found[0].detail
    # Frozen, the CPU side answers nothing: 'unanswered' tells nothing there.
    assert waiting([tenant.pid], frozen=True) == []
    assert waiting([tenant.pid], frozen=False, unanswered_after_s=60) == []

    # A second request on the answered connection, read and not answered. It comes
    # a few clock ticks after the answer: within one tick the two are simultaneous
    # to the kernel (HZ), and that reads as answered.
    assert answered.recv(3) == b"ans"
    wait_until(lambda: ms_since_data_in(answered) >= 20, what="20 ms after the answer")
    answered.sendall(b"two")
    tenant.ask(f"recv {answered_id} 3")
    found = wait_until_found(unanswered, count=2)
    assert kinds(found) == sorted([(UNANSWERED, ignored_name), (UNANSWERED, answered_name)])
    again = next(w for w in found if w.socket == answered_name)
    assert "last answer" in again.detail, again.detail


def wait_until_found(read: Callable[[], list[Waiting]], count: int = 1) -> list[Waiting]:
    """Poll ``read`` until it returns ``count`` waits or more; return them."""
    found: list[Waiting] = []

    def enough() -> bool:
        found[:] = read()
        return len(found) >= count

    wait_until(enough, what=f"{count} unanswered request(s)")
    return found


def test_a_frozen_tenant_still_shows_new_connections_and_bytes(sandbox: Sandbox, lab: Lab) -> None:
    """The kernel completes handshakes and queues bytes for frozen processes."""
    tenant = lab.start()
    listener, port = tenant.ask("listen tcp 127.0.0.1 0").split()
    kept = lab.connect("tcp", "127.0.0.1", int(port))
    tenant.ask(f"accept {listener}")
    ref = sandbox.cgroup("tenant")
    sandbox.move(tenant.pid, ref)
    freezer = Freezer(sandbox.layout)
    freezer.freeze(ref)
    try:
        lab.connect("tcp", "127.0.0.1", int(port))
        kept.sendall(b"GET /")
        here = f"127.0.0.1:{port}"
        expected = [
            Waiting(ACCEPT, f"tcp {here}", "1 connection not accepted (backlog 16)"),
            Waiting(UNREAD, f"tcp {here} <- 127.0.0.1:{kept.getsockname()[1]}", "5 bytes unread"),
        ]
        wait_until(lambda: waiting([tenant.pid], frozen=True) == expected, what="both seen")
        assert freezer.is_frozen(ref)
    finally:
        freezer.thaw(ref)


def test_the_tenants_own_client_connections_are_outbound_and_never_unanswered(lab: Lab) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    lab.sockets.append(server)
    port = server.getsockname()[1]
    tenant = lab.start()
    tenant.ask(f"connect tcp 127.0.0.1 {port}")
    accepted, _ = server.accept()
    lab.sockets.append(accepted)
    # The tenant asked (it sent) and got its answer (it received, more recently):
    # a client's normal idle state, not a request waiting on the tenant.
    tenant.ask("send 0 query")
    assert accepted.recv(5) == b"query"
    # Ticks apart, so the reply is strictly the later (see the unanswered test).
    wait_until(lambda: ms_since_data_in(accepted) >= 20, what="20 ms after the query")
    accepted.sendall(b"reply")
    local = where("tcp", "127.0.0.1", accepted.getpeername()[1])
    name = f"tcp {local} -> 127.0.0.1:{port}"
    expected = [Waiting(UNREAD, name, "5 bytes unread", inbound=False)]
    wait_until(lambda: waiting([tenant.pid], frozen=False) == expected, what="the reply unread")
    tenant.ask("recv 0 5")
    assert waiting([tenant.pid], frozen=False, unanswered_after_s=0) == []
    assert listening([tenant.pid]) == []


def test_unix_listener_queue_and_unread_bytes(lab: Lab, tmp_path: Path) -> None:
    path = str(tmp_path / "app.sock")
    tenant = lab.start()
    listener = tenant.ask(f"listen unix {path}")
    assert listening([tenant.pid]) == [Listening("unix", path)]
    first = lab.connect("unix", path)
    lab.connect("unix", path)
    expected = [Waiting(ACCEPT, f"unix {path}", "2 connections not accepted (backlog 16)")]
    assert waiting([tenant.pid], frozen=True) == expected

    connection = tenant.ask(f"accept {listener}")
    first.sendall(b"hello")
    found = waiting([tenant.pid], frozen=False)
    assert found == [
        Waiting(ACCEPT, f"unix {path}", "1 connection not accepted (backlog 16)"),
        Waiting(UNREAD, f"unix {path}", "5 bytes unread"),
    ]
    tenant.ask(f"recv {connection} 5")
    assert kinds(waiting([tenant.pid], frozen=True)) == [(ACCEPT, f"unix {path}")]


def test_unix_client_of_the_tenant_is_named_by_its_peer(lab: Lab, tmp_path: Path) -> None:
    path = str(tmp_path / "db.sock")
    server = socket.socket(socket.AF_UNIX)
    lab.sockets.append(server)
    server.bind(path)
    server.listen()
    tenant = lab.start()
    tenant.ask(f"connect unix {path}")
    accepted, _ = server.accept()
    lab.sockets.append(accepted)
    accepted.sendall(b"row")
    expected = [Waiting(UNREAD, f"unix -> {path}", "3 bytes unread", inbound=False)]
    assert waiting([tenant.pid], frozen=True) == expected


def test_a_tenant_in_its_own_network_namespace_is_read_from_outside(lab: Lab) -> None:
    before = _thread_namespaces()
    tenant = lab.start(netns="new")
    tenant.ask("listen tcp 127.0.0.1 8000")
    tenant.ask("listen unix @kiwi-sockets-test")
    # A client in the tenant's namespace, with a listener and a queue of its own.
    client = lab.start(netns=str(tenant.pid))
    client.ask("connect tcp 127.0.0.1 8000")
    client.ask("connect unix @kiwi-sockets-test")
    client.ask("listen tcp 127.0.0.1 9000")
    client.ask("connect tcp 127.0.0.1 9000")
    # And a tenant in kiwid's own namespace.
    host = lab.start()
    host_port = int(host.ask("listen tcp 127.0.0.1 0").split()[1])
    lab.connect("tcp", "127.0.0.1", host_port)
    assert os.stat(f"/proc/{tenant.pid}/ns/net").st_ino != before[threading.get_native_id()]

    found = probe([tenant.pid], frozen=False)

    one = "1 connection not accepted (backlog 16)"
    assert found.waiting == (
        Waiting(ACCEPT, "tcp 127.0.0.1:8000", one),
        Waiting(ACCEPT, "unix @kiwi-sockets-test", one),
    )
    assert found.listening == (
        Listening("tcp", "127.0.0.1:8000"),
        Listening("unix", "@kiwi-sockets-test"),
    )
    assert kinds(waiting([client.pid], frozen=True)) == [(ACCEPT, "tcp 127.0.0.1:9000")]
    both = waiting([tenant.pid, host.pid], frozen=True)
    assert kinds(both) == sorted(
        [
            (ACCEPT, "tcp 127.0.0.1:8000"),
            (ACCEPT, f"tcp 127.0.0.1:{host_port}"),
            (ACCEPT, "unix @kiwi-sockets-test"),
        ]
    )
    # No thread of ours stayed in (or went to) the tenant's namespace.
    assert not any(t.name == "kiwi-sockdiag-netns" for t in threading.enumerate())
    after = _thread_namespaces()
    assert {tid: after[tid] for tid in before if tid in after} == {
        tid: ino for tid, ino in before.items() if tid in after
    }
    assert set(after.values()) == set(before.values())


def test_probe_many_reads_several_tenants_each_as_probe_would(lab: Lab) -> None:
    queued = lab.start()
    queued_port = int(queued.ask("listen tcp 127.0.0.1 0").split()[1])
    lab.connect("tcp", "127.0.0.1", queued_port)
    asked = lab.start()
    listener, port = asked.ask("listen tcp 127.0.0.1 0").split()
    client = lab.connect("tcp", "127.0.0.1", int(port))
    connection = asked.ask(f"accept {listener}")
    client.sendall(b"req")
    asked.ask(f"recv {connection} 3")
    apart = lab.start(netns="new")
    apart.ask("listen tcp 127.0.0.1 8000")
    apart.ask("connect tcp 127.0.0.1 8000")
    reaped = subprocess.Popen(["true"])
    reaped.wait()
    tenants = {
        "queued": [queued.pid],
        "asked": [asked.pid],
        "asked, frozen": [asked.pid],
        "apart": [apart.pid],
        "gone": [reaped.pid],
    }
    frozen = {key: key.endswith("frozen") for key in tenants}
    wait_until_found(lambda: waiting([asked.pid], frozen=False))  # 50 ms after the read

    many = probe_many(tenants, frozen=frozen)

    assert set(many) == set(tenants)
    for key, pids in tenants.items():
        found, alone = many[key], probe(pids, frozen=frozen[key])
        assert isinstance(found, Probe), (key, found)
        assert kinds(list(found.waiting)) == kinds(list(alone.waiting)), key
        assert (found.listening, found.sockets) == (alone.listening, alone.sockets), key
    assert [w.kind for key in ("queued", "asked", "apart") for w in many[key].waiting] == [
        ACCEPT,
        UNANSWERED,
        ACCEPT,
    ]
    assert many["asked, frozen"].waiting == many["gone"].waiting == ()


def _thread_namespaces() -> dict[int, int]:
    found = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            found[int(task.name)] = (task / "ns" / "net").stat().st_ino
        except FileNotFoundError:
            continue
    return found


def test_processes_that_exit_before_or_during_the_read_are_skipped(lab: Lab) -> None:
    leaving = lab.start(netns="new")
    leaving.ask("listen tcp 127.0.0.1 8000")
    leaving.ask("connect tcp 127.0.0.1 8000")
    staying = lab.start()
    port = int(staying.ask("listen tcp 127.0.0.1 0").split()[1])
    lab.connect("tcp", "127.0.0.1", port)
    reaped = subprocess.Popen(["true"])
    reaped.wait()
    zombie = subprocess.Popen(["sleep", "60"])
    try:
        zombie.kill()
        wait_until(lambda: _state(zombie.pid) == "Z", what="a zombie")

        def pids() -> Iterator[int]:
            yield leaving.pid  # read: its sockets and namespace...
            leaving.kill()  # ...then it exits before the dump
            yield from (staying.pid, reaped.pid, zombie.pid)

        found = probe(pids(), frozen=False)
        assert kinds(list(found.waiting)) == [(ACCEPT, f"tcp 127.0.0.1:{port}")]
        assert probe([reaped.pid, zombie.pid], frozen=False).sockets == 0
    finally:
        zombie.wait()


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def test_a_tenant_without_sockets_has_an_empty_answer(lab: Lab) -> None:
    tenant = lab.start()
    assert sockets_of([tenant.pid]) == frozenset()
    found = probe([tenant.pid], frozen=False)
    assert (found.waiting, found.listening, found.sockets) == ((), (), 0)


def test_sockets_of_are_the_inodes_in_proc_fd(lab: Lab) -> None:
    tenant = lab.start()
    tenant.ask("listen tcp 127.0.0.1 0")
    tenant.ask("listen unix @kiwi-sockets-inodes")
    links = [os.readlink(p) for p in Path(f"/proc/{tenant.pid}/fd").iterdir()]
    inodes = {int(link[8:-1]) for link in links if link.startswith("socket:[")}
    assert len(inodes) == 2
    assert sockets_of([tenant.pid]) == inodes


def test_a_refusal_is_a_socket_diag_error() -> None:
    """Without root, another user's /proc/PID/fd cannot be read: the error says so."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # drop to nobody and try to read pid 1's sockets
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            try:
                probe([1], frozen=True)
            except SocketDiagError as err:
                os.write(write, f"{err.errno} {err}".encode())
                code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        said = pipe.read()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, said
    assert said.startswith(f"{errno.EACCES} ") and "process 1" in said, said


def test_a_request_the_kernel_refuses_is_a_socket_diag_error() -> None:
    """A family past AF_MAX: the kernel answers NLMSG_ERROR with -EINVAL."""
    with open_diag_socket() as sock, pytest.raises(SocketDiagError) as caught:
        list(dump(sock, SOCK_DIAG_BY_FAMILY, bytes([255]) + bytes(23), "family 255"))
    assert caught.value.errno == errno.EINVAL
