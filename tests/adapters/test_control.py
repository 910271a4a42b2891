"""The control socket against real Unix sockets, real clients and a real second uid."""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from kiwid.adapters.control import (
    ControlError,
    ControlServer,
    DaemonUnreachable,
    Handler,
    Peer,
    SocketInUse,
    peer_of,
    request,
)
from tests.readable import kiwid_copy

NOBODY = 65534
ADMIN_GID = 4242  # any gid works: membership is what the kernel reports, no group entry needed
FORBIDDEN = "changing the scheduler needs root or membership of group 'kiwi' (you are uid 65534)"

MINIMAL_STATUS: dict[str, Any] = {
    "version": "0.1.0",
    "gpus": [{"id": "0", "tq": 30.0, "mode": "exclusive", "mode_configured": "exclusive"}],
}
SIM: dict[str, Any] = {"pid": 1, "gpu": 0, "memory_bytes": 10, "activity": "idle"}


class FakeDaemon:
    """A small real handler: keeps a TQ and a mode, records every call it gets."""

    def __init__(self, status: dict[str, Any] | None = None, pad_bytes: int = 0) -> None:
        self.status = copy.deepcopy(status or MINIMAL_STATUS)
        self.calls: list[tuple[str, dict[str, Any], Peer]] = []
        self.pad = "x" * pad_bytes

    async def __call__(self, cmd: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        self.calls.append((cmd, args, peer))
        gpu = self.status["gpus"][0]
        if cmd == "ping":
            return {"version": "0.1.0"}
        if cmd == "status":
            return {**self.status, "pad": self.pad} if self.pad else self.status
        if cmd == "tenants":
            return {"tenants": gpu.get("tenants", [])}
        if cmd == "set-tq":
            tq = float(args["tq"])
            if not 0 < tq <= 3600:
                raise ControlError("invalid-value", f"TQ must be in (0, 3600] seconds, not {tq:g}")
            gpu["tq"] = tq
            warning = "a TQ of 5 s or less is discouraged: hand-overs eat it" if tq <= 5 else None
            return {"tq": tq, "gpus": ["0"], "warning": warning}
        if cmd == "set-mode":
            gpu["mode"] = gpu["mode_configured"] if args["mode"] == "on" else args["mode"]
            return {"mode": gpu["mode"], "gpus": ["0"]}
        if cmd == "sim-attach":
            return {"not-json": {1, 2}}  # a handler bug: the result cannot be encoded
        raise RuntimeError("simulated handler bug")  # sim-detach


class ServerThread:
    """A real ControlServer on its own event loop in a background thread."""

    def __init__(self, path: Path, handler: Handler, admin_gid: int | None, **kw: Any) -> None:
        self.path = path
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = ControlServer(path, handler, admin_gid, "kiwi", **kw)

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A directory under /tmp that uid nobody can traverse (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="kiwi-ctl-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def serve(sock_dir: Path) -> Iterator[Callable[..., ServerThread]]:
    """Start servers on ``sock_dir/kiwid.sock``; all are closed after the test."""
    running: list[ServerThread] = []

    def start(
        handler: Handler | None = None, admin_gid: int | None = ADMIN_GID, **kw: Any
    ) -> ServerThread:
        st = ServerThread(sock_dir / "kiwid.sock", handler or FakeDaemon(), admin_gid, **kw)
        running.append(st)
        st.call(st.server.start())
        return st

    yield start
    for st in reversed(running):
        st.stop()


class Raw:
    """A hand-driven client, for what `request` would never send."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(path))
        self.buf = b""

    def send(self, data: bytes | dict[str, Any]) -> None:
        self.sock.sendall(data if isinstance(data, bytes) else json.dumps(data).encode() + b"\n")

    def recv(self) -> dict[str, Any] | None:
        """The next answer, or None at end of stream."""
        while b"\n" not in self.buf:
            try:
                chunk = self.sock.recv(1 << 20)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)  # type: ignore[no-any-return]

    def ask(self, data: bytes | dict[str, Any]) -> dict[str, Any]:
        self.send(data)
        answer = self.recv()
        assert answer is not None
        return answer

    def close(self) -> None:
        self.sock.close()


class LogEvent(logging.Handler):
    """Sets an event when ``kiwid.control`` logs a message containing ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()

    def __enter__(self) -> threading.Event:
        logging.getLogger("kiwid.control").addHandler(self)
        return self.event

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("kiwid.control").removeHandler(self)


@pytest.fixture
def raw() -> Iterator[Callable[[Path], Raw]]:
    opened: list[Raw] = []

    def connect(path: Path) -> Raw:
        opened.append(Raw(path))
        return opened[-1]

    yield connect
    for r in opened:
        r.close()


# ---- round trips ---------------------------------------------------------------------


def test_round_trip(serve: Callable[..., ServerThread]) -> None:
    st = serve()
    assert request(st.path, "ping") == {"version": "0.1.0"}
    assert request(st.path, "set-tq", {"tq": 20}) == {"tq": 20.0, "gpus": ["0"], "warning": None}
    assert request(st.path, "status")["gpus"][0]["tq"] == 20.0


def test_several_requests_on_one_connection_answered_in_order(serve: Any, raw: Any) -> None:
    st = serve()
    r = raw(st.path)
    cmds = ["ping", "status", "tenants", "nope"]
    lines = [{"v": 1, "id": i, "cmd": c} for i, c in enumerate(cmds)]
    r.send(b"".join(json.dumps(x).encode() + b"\n" for x in lines))  # pipelined, one write
    answers = [r.recv() or {} for _ in lines]
    assert [(a["v"], a["id"], a["ok"]) for a in answers] == [
        (1, 0, True),
        (1, 1, True),
        (1, 2, True),
        (1, 3, False),  # errors echo the id too
    ]
    assert r.ask({"v": 1, "id": {"any": ["json"]}, "cmd": "ping"})["id"] == {"any": ["json"]}


@pytest.mark.parametrize(
    ("line", "code", "fragment"),
    [
        (b"{not json", "bad-request", "not valid JSON"),
        (b"\xff\xfe{}", "bad-request", "not valid JSON"),
        (b'{"v": 1, "cmd": "set-tq", "args": {"tq": NaN}}', "bad-request", "NaN"),
        (b'{"v": 1, "cmd": "set-tq", "args": {"tq": 1e999}}', "bad-request", "out of range"),
        (b"[" * 60000, "bad-request", "not valid JSON"),
        (b"[1, 2]", "bad-request", "JSON object"),
        (b'{"v": 2, "cmd": "ping"}', "bad-request", "version 2"),
        (b'{"v": true, "cmd": "ping"}', "bad-request", "version"),
        (b'{"cmd": "ping"}', "bad-request", "version None"),
        (b'{"v": 1}', "bad-request", "'cmd'"),
        (b'{"v": 1, "cmd": "ping", "extra": 1}', "bad-request", "extra"),
        (b'{"v": 1, "cmd": "ping", "args": []}', "bad-request", "'args'"),
        (b'{"v": 1, "cmd": "ping", "args": {"x": 1}}', "bad-request", "no argument(s) x"),
        (b'{"v": 1, "cmd": "set-tq", "args": {}}', "bad-request", "needs argument 'tq'"),
        (b'{"v": 1, "cmd": "set-tq", "args": {"tq": "20"}}', "bad-request", "must be a number"),
        (b'{"v": 1, "cmd": "set-tq", "args": {"tq": true}}', "bad-request", "must be a number"),
        (b'{"v": 1, "cmd": "set-tq", "args": {"tq": 9, "gpu": 0}}', "bad-request", "string"),
        (b'{"v": 1, "cmd": "sim-detach", "args": {"pid": 1.5}}', "bad-request", "integer"),
        (b'{"v": 1, "cmd": "reboot"}', "unknown-command", "'reboot'"),
        (b'{"v": 1, "cmd": "set-tq", "args": {"tq": 0}}', "invalid-value", "not 0"),
    ],
)
def test_bad_requests_are_answered_and_the_connection_lives_on(
    serve: Any, raw: Any, line: bytes, code: str, fragment: str
) -> None:
    daemon = FakeDaemon()
    r = raw(serve(daemon).path)
    answer = r.ask(line + b"\n")
    assert answer["ok"] is False
    assert answer["error"]["code"] == code
    assert fragment in answer["error"]["message"]
    assert r.ask({"v": 1, "cmd": "ping"})["result"] == {"version": "0.1.0"}
    handled = ["set-tq", "ping"] if code == "invalid-value" else ["ping"]
    assert [c[0] for c in daemon.calls] == handled  # the handler sees valid requests only


def test_blank_lines_are_ignored_and_a_last_line_needs_no_newline(serve: Any, raw: Any) -> None:
    r = raw(serve().path)
    r.send(b'\n  \n{"v": 1, "id": 1, "cmd": "ping"}')
    r.sock.shutdown(socket.SHUT_WR)
    answer = r.recv()
    assert answer is not None
    assert answer["id"] == 1
    assert r.recv() is None


@pytest.mark.parametrize("tail", [b"\n", b""])
def test_oversized_line_gets_too_large_then_close(serve: Any, raw: Any, tail: bytes) -> None:
    r = raw(serve(max_line=1024).path)
    answer = r.ask(b'{"v": 1, "cmd": "ping", "id": "' + b"x" * 2000 + b'"}' + tail)
    assert answer["error"]["code"] == "too-large"
    assert "1024 bytes" in answer["error"]["message"]
    assert r.recv() is None


def test_line_of_exactly_max_line_is_accepted(serve: Any, raw: Any) -> None:
    r = raw(serve(max_line=100).path)
    line = b'{"v": 1, "cmd": "ping", "id": "'
    line += b"x" * (100 - len(line) - 2) + b'"}'
    assert len(line) == 100
    assert r.ask(line + b"\n")["ok"] is True


# ---- slow, idle, greedy and too many clients -------------------------------------------


def test_half_sent_line_does_not_delay_others_and_times_out(serve: Any, raw: Any) -> None:
    st = serve(idle_timeout_s=0.5)
    slow = raw(st.path)
    slow.send(b'{"v": 1, "cmd": "pi')
    assert request(st.path, "ping", timeout_s=2.0) == {"version": "0.1.0"}
    answer = slow.recv()  # the idle timeout fires: an explanation, then end of stream
    assert answer is not None
    assert answer["error"]["code"] == "bad-request"
    assert "within 0.5 s" in answer["error"]["message"]
    assert slow.recv() is None


def test_client_that_never_reads_is_dropped_without_blocking_others(serve: Any, raw: Any) -> None:
    st = serve(FakeDaemon(pad_bytes=64 * 1024), idle_timeout_s=0.5)
    greedy = raw(st.path)
    with LogEvent("answers unread") as dropped:
        greedy.send(b'{"v": 1, "cmd": "status"}\n' * 300)  # ~20 MB of answers, never read
        assert request(st.path, "ping", timeout_s=2.0) == {"version": "0.1.0"}
        assert dropped.wait(10)
    answers = 0
    while greedy.recv() is not None:  # drains what reached the kernel, then end of stream
        answers += 1
    assert answers < 300
    assert request(st.path, "ping", timeout_s=2.0) == {"version": "0.1.0"}


def test_hundred_concurrent_clients(serve: Any, raw: Any) -> None:
    st = serve()
    clients = [raw(st.path) for _ in range(100)]
    for i, c in enumerate(clients):
        c.send({"v": 1, "id": i, "cmd": "status"})
    for i, c in enumerate(clients):
        answer = c.recv()
        assert answer is not None
        assert answer["id"] == i
        assert answer["ok"] is True


def test_clients_beyond_max_clients_are_refused_not_queued(serve: Any, raw: Any) -> None:
    st = serve(max_clients=3)
    held = [raw(st.path) for _ in range(3)]
    for c in held:  # an answer proves the server counts this connection
        assert c.ask({"v": 1, "cmd": "ping"})["ok"] is True
    extra = raw(st.path)
    answer = extra.recv()
    assert answer is not None
    assert answer["error"]["code"] == "unavailable"
    assert "3 control clients" in answer["error"]["message"]
    assert extra.recv() is None
    held[0].close()
    codes = []
    for _ in range(1000):  # the slot frees once the server has seen the close
        try:
            assert request(st.path, "ping") == {"version": "0.1.0"}
        except ControlError as exc:
            codes.append(exc.code)
        else:
            break
    else:
        pytest.fail("the freed slot was never reused")
    assert set(codes) <= {"unavailable"}


def test_close_disconnects_clients_and_removes_the_socket(serve: Any, raw: Any) -> None:
    st = serve()
    r = raw(st.path)
    assert r.ask({"v": 1, "cmd": "ping"})["ok"] is True
    st.call(st.server.close())
    assert r.recv() is None
    assert not st.path.exists()


# ---- handler failures ----------------------------------------------------------------


def test_handler_crash_becomes_internal_and_is_logged(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    st = serve()
    with caplog.at_level(logging.ERROR, logger="kiwid.control"):
        for cmd, args in [("sim-detach", {"pid": 1}), ("sim-attach", SIM)]:
            with pytest.raises(ControlError) as err:
                request(st.path, cmd, args)
            assert err.value.code == "internal"
            assert "journalctl -u kiwid" in err.value.message
    assert any("sim-detach" in r.getMessage() and r.exc_info for r in caplog.records)
    assert request(st.path, "ping") == {"version": "0.1.0"}


# ---- socket file lifecycle -----------------------------------------------------------


def test_creates_directory_0755_and_socket_0666(sock_dir: Path) -> None:
    st = ServerThread(sock_dir / "run" / "kiwi" / "kiwid.sock", FakeDaemon(), None)
    try:
        st.call(st.server.start())
        assert (sock_dir / "run" / "kiwi").stat().st_mode & 0o777 == 0o755
        assert st.path.stat().st_mode & 0o777 == 0o666
    finally:
        st.stop()
    assert not st.path.exists()


def test_stale_socket_file_is_replaced(sock_dir: Path, serve: Any) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(sock_dir / "kiwid.sock"))  # closing leaves the file behind
    with pytest.raises(DaemonUnreachable, match="nothing listens"):
        request(sock_dir / "kiwid.sock", "ping")
    st = serve()
    assert request(st.path, "ping") == {"version": "0.1.0"}


def test_live_socket_is_not_taken_over(serve: Any) -> None:
    first = serve()
    with pytest.raises(SocketInUse, match="already serving"):
        serve()
    assert request(first.path, "ping") == {"version": "0.1.0"}


def test_path_that_is_not_a_socket_is_left_alone(sock_dir: Path, serve: Any) -> None:
    (sock_dir / "kiwid.sock").write_text("precious")
    with pytest.raises(SocketInUse, match="not a socket"):
        serve()
    assert (sock_dir / "kiwid.sock").read_text() == "precious"


def test_close_keeps_a_successors_socket(sock_dir: Path, serve: Any) -> None:
    old = serve()
    old.path.unlink()  # e.g. an operator cleaned up, and a new daemon started
    new = serve()
    old.call(old.server.close())
    assert request(new.path, "ping") == {"version": "0.1.0"}


# ---- client errors -------------------------------------------------------------------


def test_request_to_missing_socket_says_where_and_why(sock_dir: Path) -> None:
    with pytest.raises(DaemonUnreachable) as err:
        request(sock_dir / "nope.sock", "ping")
    assert str(sock_dir / "nope.sock") in str(err.value)
    assert "is kiwid running? (systemctl status kiwid)" in str(err.value)


def test_request_times_out_on_a_daemon_that_never_answers(sock_dir: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hung:
        hung.bind(str(sock_dir / "hung.sock"))
        hung.listen()
        with pytest.raises(DaemonUnreachable, match=r"did not answer .* within 0.2 s"):
            request(sock_dir / "hung.sock", "ping", timeout_s=0.2)


@pytest.mark.parametrize(
    ("reply", "code"),
    [
        (b"", None),  # closed without answering: unreachable
        (b"garbage\n", "internal"),
        (b'{"v": 1, "ok": true, "result": [1]}\n', "internal"),
        (b'{"v": 1, "ok": false, "error": {"code": "from-the-future", "message": "m"}}\n', None),
    ],
)
def test_request_copes_with_odd_answers(sock_dir: Path, reply: bytes, code: str | None) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as odd:
        odd.bind(str(sock_dir / "odd.sock"))
        odd.listen()

        def answer_once() -> None:
            conn, _ = odd.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(reply)

        server = threading.Thread(target=answer_once)
        server.start()
        with pytest.raises((ControlError, DaemonUnreachable)) as err:
            request(sock_dir / "odd.sock", "ping")
        server.join(5)
    if not reply:
        assert isinstance(err.value, DaemonUnreachable)
        assert "without answering" in str(err.value)
    else:
        assert isinstance(err.value, ControlError)
        assert err.value.code == (code or "from-the-future")


# ---- credentials and authorisation with a real second uid ----------------------------


def test_peer_of_reads_kernel_credentials() -> None:
    a, b = socket.socketpair()
    with a, b:
        peer = peer_of(a)
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.geteuid(), os.getegid())
    assert set(os.getgroups()) | {os.getegid()} == peer.groups


def control_py() -> Path:
    """control.py where uid nobody can read it (the checkout may be under /root)."""
    return kiwid_copy() / "kiwid" / "adapters" / "control.py"


NOBODY_CLIENT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("kiwi_control", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
sys.modules["kiwi_control"] = mod
spec.loader.exec_module(mod)
try:
    out = {"ok": True, "result": mod.request(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))}
except mod.ControlError as exc:
    out = {"ok": False, "code": exc.code, "message": exc.message}
except mod.DaemonUnreachable as exc:
    out = {"ok": False, "code": "unreachable", "message": str(exc)}
print(json.dumps(out))
"""


@functools.cache
def nobody_python() -> str:
    """An interpreter uid nobody can run (the venv's base may sit under /root)."""
    for candidate in (sys.executable, "/usr/bin/python3"):
        try:
            subprocess.run(
                [candidate, "-c", "pass"], user=NOBODY, group=NOBODY, cwd="/", check=True
            )
        except (OSError, subprocess.CalledProcessError):
            continue
        return candidate
    pytest.skip("no Python interpreter is runnable by uid nobody")


def as_nobody(
    path: Path, cmd: str, args: dict[str, Any] | None = None, **ids: Any
) -> dict[str, Any]:
    """Run a stdlib-only client as uid 65534; ``ids`` may set group and extra_groups."""
    ids = {"group": NOBODY, "extra_groups": [], **ids}
    extra = [json.dumps(args or {})]
    proc = subprocess.run(
        [nobody_python(), "-I", "-c", NOBODY_CLIENT, str(control_py()), str(path), cmd, *extra],
        user=NOBODY,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        **ids,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching uid needs root")


@needs_root
def test_nobody_may_read_but_not_change_the_scheduler(serve: Any) -> None:
    daemon = FakeDaemon()
    st = serve(daemon)
    assert as_nobody(st.path, "status")["result"]["version"] == "0.1.0"
    refused = as_nobody(st.path, "set-tq", {"tq": 10})
    assert refused == {"ok": False, "code": "forbidden", "message": FORBIDDEN}
    assert [c[0] for c in daemon.calls] == ["status"]  # the handler never saw set-tq
    peer = daemon.calls[0][2]
    assert (peer.uid, peer.gid, peer.groups) == (NOBODY, NOBODY, frozenset({NOBODY}))


@needs_root
def test_admin_group_member_may_change_the_scheduler(serve: Any) -> None:
    daemon = FakeDaemon()
    st = serve(daemon)
    allowed = as_nobody(st.path, "set-tq", {"tq": 10}, extra_groups=[ADMIN_GID])
    assert allowed["result"]["tq"] == 10.0
    assert ADMIN_GID in daemon.calls[-1][2].groups
    primary = as_nobody(st.path, "set-mode", {"mode": "off"}, group=ADMIN_GID)
    assert primary["result"]["mode"] == "off"


@needs_root
def test_without_an_admin_group_only_root_may_change(serve: Any) -> None:
    st = serve(admin_gid=None)
    refused = as_nobody(st.path, "set-tq", {"tq": 10}, extra_groups=[ADMIN_GID])
    assert refused["code"] == "forbidden"
    assert "needs root (no admin group is configured) (you are uid 65534)" in refused["message"]
    assert request(st.path, "set-tq", {"tq": 10})["tq"] == 10.0  # we are root


@needs_root
def test_socket_permission_denied_is_explained(sock_dir: Path, serve: Any) -> None:
    st = serve()
    sock_dir.chmod(0o700)
    answer = as_nobody(st.path, "ping")
    assert answer["code"] == "unreachable"
    assert f"permission denied on {st.path}" in answer["message"]
