"""The waker: a parked tenant's real sockets, read through the kernel, wake it or not."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kiwid.core.events import WakeAsked
from kiwid.daemon.tenants.waker import Waker

LISTENER = (
    "import socket, sys\n"
    "s = socket.socket()\n"
    "s.bind(('127.0.0.1', 0))\n"
    "s.listen(4)\n"
    "print(s.getsockname()[1], flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.fixture
def listener() -> Iterator[tuple[int, int]]:
    """A process that listens on a TCP port and never accepts: (pid, port)."""
    with subprocess.Popen(
        [sys.executable, "-c", LISTENER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        try:
            yield proc.pid, int(proc.stdout.readline())
        finally:
            proc.kill()


def test_a_connection_waiting_to_be_accepted_wakes_a_parked_tenant(listener) -> None:
    pid, port = listener
    waker = Waker()
    assert waker.events({"s": frozenset({pid})}, frozen={"s"}) == []
    assert waker.wakes_on == {"s": (f"tcp 127.0.0.1:{port}",)}
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        (wake,) = waker.events({"s": frozenset({pid})}, frozen={"s"})
    assert isinstance(wake, WakeAsked) and (wake.tenant, wake.reason) == ("s", "request")
    assert f"127.0.0.1:{port}" in wake.detail
    # No longer parked: forgotten.
    assert waker.events({}, frozen=set()) == [] and waker.wakes_on == {}


def test_a_tenant_whose_sockets_cannot_be_read_is_told_once_and_wakes_nobody(caplog) -> None:
    waker = Waker()
    gone = 2**22 + 12345  # above pid_max's default: no such process
    for _ in range(2):
        assert waker.events({"x": frozenset({gone})}, frozen=set()) == []
    assert "x" not in waker.wakes_on or waker.wakes_on["x"] == ()
    told = [r for r in caplog.records if "Cannot read the sockets of parked x" in r.message]
    assert len(told) <= 1
