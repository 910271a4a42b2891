"""sd_notify messages, received on a real AF_UNIX datagram socket."""

from __future__ import annotations

import os
import select
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiwid.adapters.notify import Notifier


@pytest.fixture
def listener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.settimeout(1.0)
    path = tmp_path / "notify.sock"
    sock.bind(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    try:
        yield sock
    finally:
        sock.close()


@pytest.fixture
def notifier() -> Iterator[Notifier]:
    sender = Notifier()
    try:
        yield sender
    finally:
        sender.close()


def _nothing_queued(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    return not readable


def test_each_message_is_one_exact_datagram(listener: socket.socket, notifier: Notifier) -> None:
    notifier.ready()
    notifier.ready("serving 2 GPUs")
    notifier.status("GPU 0: a holds, b waits")
    notifier.watchdog()
    notifier.stopping()
    received = [listener.recv(4096) for _ in range(5)]
    assert received == [
        b"READY=1",
        b"READY=1\nSTATUS=serving 2 GPUs",
        b"STATUS=GPU 0: a holds, b waits",
        b"WATCHDOG=1",
        b"STOPPING=1",
    ]
    assert _nothing_queued(listener)


def test_reloading_sends_monotonic_usec_in_the_same_datagram(
    listener: socket.socket, notifier: Notifier
) -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    first, second = listener.recv(4096).decode().split("\n")
    assert first == "RELOADING=1"
    key, value = second.split("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= after
    assert _nothing_queued(listener)


def test_status_is_utf8_and_one_line(listener: socket.socket, notifier: Notifier) -> None:
    notifier.status("tenant café → waiting\nREADY=1")
    assert listener.recv(4096) == "STATUS=tenant café → waiting READY=1".encode()


def test_abstract_socket(monkeypatch: pytest.MonkeyPatch, notifier: Notifier) -> None:
    name = f"kiwi-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.settimeout(1.0)
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        notifier.ready()
        assert sock.recv(4096) == b"READY=1"


def test_no_notify_socket_is_a_no_op(monkeypatch: pytest.MonkeyPatch, notifier: Notifier) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notifier.enabled is False
    notifier.ready()
    notifier.reloading()
    notifier.status("x")
    notifier.watchdog()
    notifier.stopping()


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # sdnotify drops its failed socket
def test_unreachable_socket_is_logged_and_retried(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    notifier: Notifier,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "later.sock"
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    notifier.ready()
    assert "sd_notify 'READY=1' failed" in caplog.text
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.settimeout(1.0)
        sock.bind(str(path))
        notifier.ready()
        assert sock.recv(4096) == b"READY=1"


def test_reconnects_after_the_listener_goes_away(
    tmp_path: Path, listener: socket.socket, notifier: Notifier, caplog: pytest.LogCaptureFixture
) -> None:
    notifier.watchdog()
    assert listener.recv(4096) == b"WATCHDOG=1"
    listener.close()
    notifier.watchdog()  # systemd gone: logged, not raised
    assert "sd_notify 'WATCHDOG=1' failed" in caplog.text
    path = tmp_path / "notify.sock"
    path.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.settimeout(1.0)
        sock.bind(str(path))
        notifier.watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("30000000", None, 15.0),
        ("30000000", "self", 15.0),
        ("30000000", "1", None),
        ("0", None, None),
        ("soon", None, None),
        (None, None, None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch,
    notifier: Notifier,
    usec: str | None,
    pid: str | None,
    expected: float | None,
) -> None:
    for key, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, str(os.getpid()) if value == "self" else value)
    assert notifier.watchdog_interval_s() == expected
