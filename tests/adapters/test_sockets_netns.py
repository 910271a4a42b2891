"""Tenants in network namespaces of their own, read from kiwid's side; exits and errors.

The tenants are ``socket_tenant.py`` processes started by the ``lab`` fixture
(tests/adapters/socket_lab.py), some under ``unshare --net``; a client in a
tenant's namespace is another one, started under ``nsenter``. Nothing of the
code under test enters a namespace but its helper thread: the tests check that
no thread of this process is left in another.
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiwid.adapters.sockets import (
    ACCEPT,
    UNANSWERED,
    Listening,
    Probe,
    SocketDiagError,
    Waiting,
    probe,
    probe_many,
    sockets_of,
    waiting,
)
from kiwid.adapters.sockets.diag import SOCK_DIAG_BY_FAMILY, dump, open_diag_socket
from tests.adapters.conftest import wait_until
from tests.adapters.socket_lab import Lab, kinds, wait_until_found

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (setns, other /proc/PID/fd)")


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
    # The helper thread has ended for Python; the kernel drops its task a moment later.
    wait_until(
        lambda: set(_thread_namespaces().values()) == set(before.values()),
        5,
        "the helper thread's task to be gone",
    )
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
