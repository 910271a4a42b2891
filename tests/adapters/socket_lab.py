"""The harness of the sock_diag tests (test_sockets*.py): real programs, real sockets.

A :class:`Lab` starts ``socket_tenant.py`` programs (in kiwid's network
namespace, in a new one under ``unshare --net``, or in another program's under
``nsenter``) and holds the test's own client sockets; :meth:`Lab.close` kills
every program (a namespace made by ``unshare`` goes with its last process) and
closes every socket. The ``lab`` fixture (conftest) closes it whatever happens.
"""

from __future__ import annotations

import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kiwid.adapters.sockets import Waiting
from tests.helpers import wait_for

TENANT = Path(__file__).with_name("socket_tenant.py")


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


def ms_since_data_in(sock: socket.socket) -> int:
    """``tcpi_last_data_recv`` of one of this test's own TCP sockets."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return int(struct.unpack_from("=I", info, 52)[0])


def kinds(found: list[Waiting]) -> list[tuple[str, str]]:
    return [(w.kind, w.socket) for w in found]


def wait_until_found(read: Callable[[], list[Waiting]], count: int = 1) -> list[Waiting]:
    """Poll ``read`` until it returns ``count`` waits or more; return them."""
    found: list[Waiting] = []

    def enough() -> bool:
        found[:] = read()
        return len(found) >= count

    wait_for(enough, 2.0, f"{count} request(s) waiting", max_delay=0.02)
    return found
