"""Requests waiting on a tenant's sockets, read through sock_diag: real processes, real sockets.

The tenants are ``socket_tenant.py`` processes started by the ``lab`` fixture
(tests/adapters/socket_lab.py); the clients are this test process's sockets.
These tests are the rules: the accept queue, unread bytes and unanswered
requests over TCP (IPv4, IPv6) and Unix sockets, frozen and not.
test_sockets_netns.py reads tenants in other network namespaces.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kiwid.adapters.cgroups import Freezer
from kiwid.adapters.sockets import (
    ACCEPT,
    UNANSWERED,
    UNREAD,
    Listening,
    Waiting,
    listening,
    waiting,
)
from tests.adapters.conftest import Sandbox, wait_until
from tests.adapters.socket_lab import (
    FAMILIES,
    Lab,
    kinds,
    ms_since_data_in,
    wait_until_found,
    where,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (setns, other /proc/PID/fd)")


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
