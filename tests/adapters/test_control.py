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
from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from kiwid.adapters.control import (
    COMMANDS,
    ERROR_CODES,
    MAX_DEPTH,
    MAX_INT_DIGITS,
    Access,
    Arg,
    CommandTableMismatch,
    ControlError,
    ControlServer,
    DaemonUnreachable,
    Handler,
    Kind,
    Peer,
    SocketInUse,
    check_command_table,
    peer_of,
    request,
)
from tests.readable import kiwid_copy

REPO = Path(__file__).resolve().parents[2]
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
        if cmd == "register":
            return {"tenant": f"container:{args['id']}", "held": False}
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


class LogRecords(logging.Handler):
    """Collects what ``kiwid.control`` logs, at every level, from any thread."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._logger = logging.getLogger("kiwid.control")
        self._level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> list[logging.LogRecord]:
        self._logger.addHandler(self)
        self._logger.setLevel(logging.DEBUG)
        return self.records

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


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
        (b'{"v": 1, "cmd": "set-tq", "args": {"tq": Infinity}}', "bad-request", "Infinity"),
        (b'{"v": 1, "cmd": "set-tq", "args": {"tq": -Infinity}}', "bad-request", "-Infinity"),
        (b'{"v": 1, "cmd": "set-tq", "args": {"tq": -1e999}}', "bad-request", "out of range"),
        (b'{"v": 1, "cmd": "ping", "id": ' + b"9" * 5000 + b"}", "bad-request", "5000 digits"),
        (
            b'{"v": 1, "cmd": "ping", "id": -' + b"9" * 65 + b"}",
            "bad-request",
            "65 digits; kiwid reads at most 64",
        ),
        (
            b'{"v": 1, "cmd": "sim-detach", "args": {"pid": 9223372036854775808}}',
            "bad-request",
            "64-bit",
        ),
        (
            b'{"v": 1, "cmd": "sim-detach", "args": {"pid": -9223372036854775809}}',
            "bad-request",
            "64-bit",
        ),
        (b'{"v": 1, "cmd": "sim-detach", "args": {"pid": 1e3}}', "bad-request", "integer"),
        (
            b'{"v": 1, "cmd": "set-tq", "args": {"tq": ' + b"9" * 64 + b"}}",
            "invalid-value",
            "not 1e+64",
        ),
        (
            b'{"v": 1, "cmd": "set-tq", "args": {"tq": 1' + b"0" * 400 + b".5}}",
            "bad-request",
            "out of range",
        ),
        (b'{"v": 1, "cmd": "ping", "id": "a\xed\xa0\x80"}', "bad-request", "not valid JSON"),
        (b'{"v": 1, "cmd": "ping", "id": "\xc0\xaf"}', "bad-request", "not valid JSON"),
        (b'\xef\xbb\xbf{"v": 1, "cmd": "ping"}', "bad-request", "not valid JSON"),
        (b'{"v": 1, "cmd": "ping", "id": "a\x00b"}', "bad-request", "not valid JSON"),
        (b'{"v": 1, "cmd": "ping"}\x00', "bad-request", "not valid JSON"),
        (b'{"v": 1, "cmd": "set-mode", "args": {"mode": "off\\u0000"}}', "bad-request", "NUL"),
        (b'{"v": 1, "cmd": "ping", "id": {"\\u0000": 1}}', "bad-request", "NUL"),
        (b"[1, 2]", "bad-request", "JSON object"),
        (b"null", "bad-request", "JSON object"),
        (b'"ping"', "bad-request", "JSON object"),
        (b'{"v": 1, "cmd": ["ping"]}', "bad-request", "'cmd'"),
        (b'{"v": 1, "cmd": null}', "bad-request", "'cmd'"),
        (b'{"v": "1", "cmd": "ping"}', "bad-request", "version '1'"),
        (b'{"v": 1, "cmd": "ping", "args": null}', "bad-request", "'args'"),
        (b'{"v": 1, "cmd": "set-mode", "args": {"mode": null}}', "bad-request", "must be a string"),
        (b'{"v": 1, "cmd": "register", "args": {"id": "c", "gpus": "0"}}', "bad-request", "list"),
        (b'{"v": 1, "cmd": "register", "args": {"id": "c", "gpus": [0]}}', "bad-request", "list"),
        (b'{"v": 1, "cmd": "register", "args": {"id": "c", "hold": 1}}', "bad-request", "boolean"),
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


@pytest.mark.parametrize(
    ("line", "rid", "where"),
    [
        (rb'{"v": 1, "id": "\ud800", "cmd": "ping"}', None, "the string at id"),
        (rb'{"v": 1, "id": ["ok", {"k": "\udfff"}], "cmd": "ping"}', None, "id[1].k"),
        (rb'{"v": 1, "id": 7, "cmd": "\udc00"}', 7, "the string at cmd"),
        (rb'{"v": 1, "id": 7, "cmd": "ping", "\ud800": 1}', 7, "a key of the request"),
        (rb'{"v": 1, "id": 7, "cmd": "ping", "args": {"\ud800": 1}}', 7, "a key of args"),
        (
            rb'{"v": 1, "id": 7, "cmd": "register", "args": {"id": "c1", "name": "x\ud800"}}',
            7,
            "the string at args.name",
        ),
        (
            rb'{"v": 1, "id": 7, "cmd": "register", "args": {"id": "c1", "gpus": ["0", "\udbff"]}}',
            7,
            "args.gpus[1]",
        ),
    ],
)
def test_lone_surrogates_are_refused_and_the_connection_keeps_its_answers(
    serve: Any, raw: Any, caplog: pytest.LogCaptureFixture, line: bytes, rid: Any, where: str
) -> None:
    daemon = FakeDaemon()
    r = raw(serve(daemon).path)
    with caplog.at_level(logging.DEBUG, logger="kiwid.control"):
        r.send(
            b'{"v": 1, "id": 1, "cmd": "ping"}\n' + line + b'\n{"v": 1, "id": 3, "cmd": "ping"}\n'
        )
        answers = [r.recv(), r.recv(), r.recv()]
    assert [a and (a["id"], a["ok"]) for a in answers] == [(1, True), (rid, False), (3, True)]
    error = (answers[1] or {})["error"]
    assert error["code"] == "bad-request"
    assert where in error["message"]
    assert "not valid Unicode" in error["message"]
    assert [c[0] for c in daemon.calls] == ["ping", "ping"]  # never reaches the handler
    assert not [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR]


def test_every_nesting_depth_is_answered_and_deep_ids_are_not_echoed(serve: Any, raw: Any) -> None:
    """Below the parser's recursion limit too: there, echoing a deep id overflowed the stack."""
    r = raw(serve().path)
    for depth in range(1, 1100):
        rid = b"[" * depth + b"]" * depth
        answer = r.ask(b'{"v": 1, "cmd": "ping", "id": ' + rid + b"}\n")
        if depth < MAX_DEPTH:  # the request is level 1, its id's outer list level 2
            assert (answer["id"], answer["ok"]) == (json.loads(rid), True), depth
        else:
            assert (answer["id"], answer["ok"]) == (None, False), depth
            assert answer["error"]["code"] == "bad-request", depth
    assert r.ask({"v": 1, "id": "after", "cmd": "ping"})["ok"] is True


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


# ---- property: every line gets exactly one answer --------------------------------------

ANY_CHAR = hst.characters(exclude_categories=())  # lone surrogates and NUL included
EDGES = ["\0", "x\0", "\ud800", "a\udfffb", 2**63, -(2**63) - 1, 10**64, -(10**70), 1e308]
JSON_VALUES = hst.recursive(
    hst.none()
    | hst.booleans()
    | hst.integers()
    | hst.floats()
    | hst.text(ANY_CHAR, max_size=8)
    | hst.sampled_from(EDGES),
    lambda kids: (
        hst.lists(kids, max_size=4)
        | hst.dictionaries(hst.text(ANY_CHAR, max_size=6), kids, max_size=4)
    ),
    max_leaves=12,
)
VALID_REQUESTS: list[dict[str, Any]] = [
    {"v": 1, "id": 1, "cmd": "ping"},
    {"v": 1, "id": "s", "cmd": "status", "args": {}},
    {"v": 1, "cmd": "tenants"},
    {"v": 1, "id": 2, "cmd": "set-tq", "args": {"tq": 20, "gpu": "0"}},
    {"v": 1, "id": 3, "cmd": "set-mode", "args": {"mode": "off"}},
    {"v": 1, "id": 4, "cmd": "sim-attach", "args": SIM},
    {"v": 1, "id": 5, "cmd": "sim-detach", "args": {"pid": 1}},
    {
        "v": 1,
        "id": [6],
        "cmd": "register",
        "args": {"id": "c1", "cgroup_v2": None, "pid": 7, "name": "n", "pod": "p"}
        | {"namespace": "ns", "gpus": ["0"], "hold": True, "device_ids": ["d"]},
    },
    {"v": 1, "id": 7, "cmd": "unregister", "args": {"id": "c1"}},
]
SPECIAL_LINES = [
    b"",
    b" \t\r",
    b"NaN",
    b"-Infinity",
    b"[" * 3000,
    b"[" * 900 + b"]" * 900,
    b"9" * 5000,
    b"\x00",
    b"\xef\xbb\xbf{}",
    b'{"v": 1, "cmd": "ping", "id": "\\ud800"}',
    b'{"v": 1, "cmd": "ping", "id": "\\u0000"}',
]


def _dump(value: Any, ascii_only: bool) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@hst.composite
def mutated_requests(draw: hst.DrawFn) -> bytes:
    """A valid request with fields replaced or removed, then perhaps a few bytes edited.

    Replacements favour the fields a request already has and strings and edge values,
    so that many mutants are still valid and reach the handler.
    """
    req = copy.deepcopy(draw(hst.sampled_from(VALID_REQUESTS)))
    for _ in range(draw(hst.integers(0, 3))):
        args = req.get("args")
        target = args if isinstance(args, dict) and draw(hst.booleans()) else req
        if target and draw(hst.integers(0, 3)) == 0:
            del target[draw(hst.sampled_from(sorted(target)))]
        else:
            names = hst.sampled_from(sorted(target) or ["id"]) | hst.text(ANY_CHAR, max_size=4)
            value = hst.sampled_from(EDGES) | hst.text(ANY_CHAR, max_size=8) | JSON_VALUES
            target[draw(names)] = draw(value)
    data = _dump(req, draw(hst.sampled_from([True, True, True, False])))
    for _ in range(draw(hst.sampled_from([0, 0, 0, 0, 1, 2]))):
        at = draw(hst.integers(0, len(data)))
        data = data[:at] + draw(hst.binary(max_size=3)) + data[at + draw(hst.integers(0, 3)) :]
    return data


LINES = (
    hst.binary(max_size=64)
    | hst.builds(_dump, JSON_VALUES, hst.booleans())
    | mutated_requests()
    | hst.sampled_from(SPECIAL_LINES)
).map(lambda line: line.replace(b"\n", b""))


def _handler_safe(value: Any) -> bool:
    """No NUL, lone surrogate or integer beyond 64 digits anywhere in ``value``."""
    if isinstance(value, str):
        return "\0" not in value and not any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, int):
        return abs(value) < 10**MAX_INT_DIGITS
    if isinstance(value, list):
        return all(_handler_safe(v) for v in value)
    if isinstance(value, dict):
        return all(_handler_safe(k) and _handler_safe(v) for k, v in value.items())
    return True


async def echo(cmd: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
    """Answers with what it was given; fails (so: internal) on what should not get here."""
    if not _handler_safe(args):
        raise AssertionError(f"the handler got {args!r}")
    return {"cmd": cmd, "args": args}


def read_answers(r: Raw) -> list[dict[str, Any]]:
    """Every answer line up to the end of the stream, each checked to be strict JSON."""
    data = b""
    while chunk := r.sock.recv(1 << 20):
        data += chunk
    *lines, rest = data.split(b"\n")
    assert rest == b"", "an answer without its newline"
    answers = []
    for line in lines:
        answer = json.loads(line.decode("utf-8"), parse_constant=pytest.fail)
        assert isinstance(answer, dict)
        assert answer["v"] == 1
        assert "id" in answer
        if answer["ok"] is True:
            assert "result" in answer
        else:
            assert answer["ok"] is False
            assert answer["error"]["code"] in ERROR_CODES - {"internal"}, answer
            assert isinstance(answer["error"]["message"], str)
            assert answer["error"]["message"]
        answers.append(answer)
    return answers


def test_any_lines_get_one_answer_each_in_order(serve: Any, raw: Any) -> None:
    server = serve(echo)
    with LogRecords() as records:

        @settings(max_examples=300, deadline=None)
        @given(hst.lists(LINES, max_size=8), hst.booleans())
        def one_connection(lines: list[bytes], last_newline: bool) -> None:
            r = raw(server.path)
            payload = b""
            for i, line in enumerate(lines):
                payload += line + b"\n" + b'{"v": 1, "cmd": "ping", "id": "m%d"}\n' % i
            r.send(payload if last_newline else payload.removesuffix(b"\n"))
            r.sock.shutdown(socket.SHUT_WR)
            answers = read_answers(r)
            r.close()
            expected: list[str | None] = []  # None: any answer; blank lines get none
            for i, line in enumerate(lines):
                expected += [None, f"m{i}"] if line.strip() else [f"m{i}"]
            assert len(answers) == len(expected)
            for answer, marker in zip(answers, expected, strict=True):
                if marker is not None:
                    assert (answer["id"], answer["ok"]) == (marker, True)

        one_connection()
        assert request(server.path, "ping") == {"cmd": "ping", "args": {}}
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING or r.exc_info] == []


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
    st = serve(max_clients=3, reserved_clients=0)  # nothing kept for root, which we are
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


# The client runs from a world-readable copy of kiwid (tests/readable.py): uid nobody may
# not read the checkout (a clone under /root is 0700). The control package is stdlib only.
NOBODY_CLIENT = """
import json, sys
sys.path.insert(0, sys.argv.pop(1))
import kiwid.adapters.control as mod
try:
    out = {"ok": True, "result": mod.request(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))}
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
        [nobody_python(), "-I", "-c", NOBODY_CLIENT, str(kiwid_copy()), str(path), cmd, *extra],
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


@needs_root
def test_register_and_unregister_need_root_even_for_the_admin_group(serve: Any) -> None:
    daemon = FakeDaemon()
    st = serve(daemon)
    why = "needs root: the container runtime runs kiwi-hook as root (you are uid 65534)"
    for cmd, args in [("register", {"id": "c1", "hold": True}), ("unregister", {"id": "c1"})]:
        for groups in ([], [ADMIN_GID]):
            refused = as_nobody(st.path, cmd, args, extra_groups=groups)
            assert refused == {"ok": False, "code": "forbidden", "message": f"{cmd} {why}"}
    assert daemon.calls == []  # the handler never saw them
    assert request(st.path, "register", {"id": "c1"})["tenant"] == "container:c1"  # we are root


@needs_root
def test_set_weight_and_set_priority_are_for_the_admin_group(serve: Any) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    async def handler(cmd: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        calls.append((cmd, args))
        return {}

    st = serve(handler)
    weight, priority = {"tenant": "pod:a", "weight": 2.5}, {"tenant": "pod:a", "priority": -3}
    assert as_nobody(st.path, "set-weight", weight)["code"] == "forbidden"
    assert as_nobody(st.path, "set-priority", priority)["code"] == "forbidden"
    assert as_nobody(st.path, "set-weight", weight, extra_groups=[ADMIN_GID])["ok"] is True
    assert as_nobody(st.path, "set-priority", priority, extra_groups=[ADMIN_GID])["ok"] is True
    assert calls == [("set-weight", weight), ("set-priority", priority)]


@needs_root
def test_retry_and_release_are_for_the_admin_group(serve: Any) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    async def handler(cmd: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        calls.append((cmd, args))
        return {}

    st = serve(handler)
    for cmd in ("retry", "release"):
        assert as_nobody(st.path, cmd, {"tenant": "pod:a"})["code"] == "forbidden"
        answer = as_nobody(st.path, cmd, {"tenant": "pod:a"}, extra_groups=[ADMIN_GID])
        assert answer["ok"] is True
    assert calls == [("retry", {"tenant": "pod:a"}), ("release", {"tenant": "pod:a"})]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({"cmd": "retry", "args": {}}, "needs argument 'tenant' (string)"),
        ({"cmd": "release", "args": {"tenant": 7}}, "'tenant' must be a string"),
        ({"cmd": "set-weight", "args": {"tenant": "a"}}, "needs argument 'weight' (number)"),
        ({"cmd": "set-weight", "args": {"tenant": 1, "weight": 1}}, "'tenant' must be a string"),
        ({"cmd": "set-weight", "args": {"tenant": "a", "weight": "2"}}, "must be a number"),
        ({"cmd": "set-priority", "args": {"tenant": "a", "priority": 1.5}}, "64-bit integer"),
        ({"cmd": "set-priority", "args": {"tenant": "a", "priority": True}}, "64-bit integer"),
        ({"cmd": "set-priority", "args": {"tenant": "a", "priority": 1, "x": 1}}, "argument(s) x"),
    ],
)
def test_new_commands_check_their_argument_types(
    serve: Any, raw: Any, args: dict[str, Any], fragment: str
) -> None:
    daemon = FakeDaemon()
    answer = raw(serve(daemon).path).ask({"v": 1, **args})
    assert answer["error"]["code"] == "bad-request"
    assert fragment in answer["error"]["message"]
    assert daemon.calls == []


def test_the_command_table_is_public_and_typed() -> None:
    levels = {name: spec.access for name, spec in COMMANDS.items()}
    assert levels == {
        **dict.fromkeys(["ping", "status", "tenants", "workloads"], Access.READ),
        **dict.fromkeys(["set-tq", "set-mode", "set-weight", "set-priority"], Access.ADMIN),
        **dict.fromkeys(["forget-workload", "retry", "release"], Access.ADMIN),
        **dict.fromkeys(["sim-attach", "sim-detach", "sim-foreign", "sim-fault"], Access.ADMIN),
        **dict.fromkeys(["register", "unregister"], Access.ROOT),
        "wake": Access.OWNER,
    }
    assert COMMANDS["set-weight"].args == {"tenant": Arg(Kind.STRING), "weight": Arg(Kind.NUMBER)}
    assert COMMANDS["set-priority"].args["priority"] == Arg(Kind.INTEGER)
    assert COMMANDS["forget-workload"].args == {"workload": Arg(Kind.STRING)}
    assert COMMANDS["retry"].args == COMMANDS["release"].args == {"tenant": Arg(Kind.STRING)}
    assert COMMANDS["register"].args["pod"] == Arg(Kind.STRING, required=False, nullable=True)
    with pytest.raises(TypeError):
        COMMANDS["ping"] = COMMANDS["status"]  # type: ignore[index]
    with pytest.raises(TypeError):
        COMMANDS["set-tq"].args["x"] = Arg(Kind.STRING)  # type: ignore[index]


def test_check_command_table_names_what_is_missing_and_what_is_unknown() -> None:
    check_command_table(list(COMMANDS))
    check_command_table(dict.fromkeys(COMMANDS).keys())
    table = set(COMMANDS) - {"set-weight", "set-priority"} | {"reboot"}
    with pytest.raises(CommandTableMismatch) as err:
        check_command_table(table)
    assert err.value.missing == {"set-weight", "set-priority"}
    assert err.value.unknown == {"reboot"}
    assert str(err.value) == (
        "the command table lacks set-priority, set-weight; "
        "has commands the protocol does not: reboot"
    )


def test_the_protocol_document_gives_every_command_its_level() -> None:
    """Each command has a ### heading in docs/control-protocol.md, labelled (admin)/(root)."""
    doc = (REPO / "docs" / "control-protocol.md").read_text()
    headings = [line for line in doc.splitlines() if line.startswith("### ")]
    for name, spec in COMMANDS.items():
        mine = [h for h in headings if f"`{name}`" in h]
        assert len(mine) == 1, name
        label = next((w for w in ("(root", "(admin or owner", "(admin") if w in mine[0]), None)
        expected = {
            Access.READ: None,
            Access.ADMIN: "(admin",
            Access.ROOT: "(root",
            Access.OWNER: "(admin or owner",
        }
        assert label == expected[spec.access], mine[0]


# ---- connection limits per uid, with a real second (and third) uid ---------------------

# Socket code only, so that uid nobody needs nothing from the checkout. It opens
# argv[2] connections one after the other, sends a ping on each and prints the
# answer (null at end of stream), then "holding", and keeps those accepted open
# until its stdin ends. Each line "swap" on stdin hands the oldest connection back (it waits
# for kiwid's end of it to close, by then its slot is free) and opens another.
HOLDER = """
import json, socket, sys

def open_one(i):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(sys.argv[1])
    try:
        s.sendall(b'{"v": 1, "id": %d, "cmd": "ping"}\\n' % i)
    except OSError:
        pass  # refused, and closed already: its answer says why
    data = b""
    while not data.endswith(b"\\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    answer = json.loads(data) if data else None
    print(json.dumps(answer), flush=True)
    if answer and answer["ok"]:
        held.append(s)
    else:
        s.close()

held = []
for i in range(int(sys.argv[2])):
    open_one(i)
print("holding", flush=True)
for _ in sys.stdin:
    old = held.pop(0)
    old.shutdown(socket.SHUT_WR)
    while old.recv(65536):
        pass
    old.close()
    open_one(-1)
"""


class Holder:
    """A process of another uid holding control connections open until `release`."""

    def __init__(self, path: Path, count: int, uid: int, groups: list[int]) -> None:
        self.proc = subprocess.Popen(
            [nobody_python(), "-I", "-c", HOLDER, str(path), str(count)],
            user=uid,
            group=NOBODY,
            extra_groups=groups,
            cwd="/",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        lines = [self.stdout.readline() for _ in range(count + 1)]
        if lines[-1] != "holding\n":
            self.release()
            pytest.fail(f"the holder failed after {lines}")
        self.answers: list[dict[str, Any] | None] = [json.loads(x) for x in lines[:-1]]

    def accepted(self) -> int:
        return sum(1 for a in self.answers if a and a["ok"])

    def refusals(self) -> list[str]:
        """The messages of the refused connections (each answered unavailable, id null)."""
        refused = [a for a in self.answers if not (a and a["ok"])]
        assert all(a and (a["id"], a["error"]["code"]) == (None, "unavailable") for a in refused)
        return [a["error"]["message"] for a in refused if a]

    def swap(self) -> dict[str, Any] | None:
        """Hand the oldest connection back, open another: the new one's answer."""
        self.stdin.write("swap\n")
        self.stdin.flush()
        answer: dict[str, Any] | None = json.loads(self.stdout.readline())
        return answer

    def release(self) -> None:
        """Close its stdin: it exits, closing its connections; wait for that."""
        self.stdin.close()
        self.proc.wait(30)
        self.stdout.close()


@pytest.fixture
def hold() -> Iterator[Callable[..., Holder]]:
    holders: list[Holder] = []

    def start(path: Path, count: int, uid: int = NOBODY, groups: Iterable[int] = ()) -> Holder:
        holders.append(Holder(path, count, uid, list(groups)))
        return holders[-1]

    yield start
    for h in holders:
        h.release()


@needs_root
def test_a_user_holding_every_connection_cannot_lock_out_root(
    serve: Any, raw: Any, hold: Any
) -> None:
    """The attack: one local user opens max_clients connections and keeps them busy."""
    st = serve(max_clients=8)
    with LogEvent("refused a control client, uid 65534") as logged:
        greedy = hold(st.path, 12)
    assert greedy.accepted() == 8  # the per-uid limit (16) is above max_clients here
    assert all("8 control clients" in m for m in greedy.refusals())
    assert request(st.path, "ping") == {"version": "0.1.0"}  # root, as kiwictl
    assert request(st.path, "register", {"id": "c1"})["tenant"] == "container:c1"  # kiwi-hook
    roots = [raw(st.path) for _ in range(4)]  # several at once, as in a burst of containers
    assert all(r.ask({"v": 1, "cmd": "ping"})["ok"] for r in roots)
    assert logged.is_set()  # logged before the refusal was answered


@needs_root
def test_an_ordinary_uid_holds_at_most_max_clients_per_uid(serve: Any, hold: Any) -> None:
    st = serve(max_clients_per_uid=3)
    greedy = hold(st.path, 5)
    assert greedy.accepted() == 3
    refusals = greedy.refusals()
    assert len(refusals) == 2
    assert refusals[0] == (
        "uid 65534 already holds 3 control connections, the most one user may; "
        "close one and try again"
    )
    other = hold(st.path, 3, uid=NOBODY - 1)  # another user is not affected
    assert other.accepted() == 3
    admin = hold(st.path, 5, uid=NOBODY - 2, groups=[ADMIN_GID])  # no cap per uid for it
    assert admin.accepted() == 5
    for _ in range(5):  # a slot handed back is free again for the same uid
        answer = greedy.swap()
        assert answer is not None
        assert answer["ok"] is True


@needs_root
def test_slots_beyond_max_clients_are_kept_for_root_and_the_admin_group(
    serve: Any, raw: Any, hold: Any
) -> None:
    st = serve(max_clients=4, max_clients_per_uid=4, reserved_clients=2)
    assert hold(st.path, 4).accepted() == 4  # the general pool is full
    late = hold(st.path, 1, uid=NOBODY - 1)
    assert late.accepted() == 0
    assert late.refusals() == [
        "kiwid already serves 4 control clients, the most it takes from users other than "
        "root and group 'kiwi'; try again later"
    ]
    admin = hold(st.path, 3, uid=NOBODY - 1, groups=[ADMIN_GID])
    assert admin.accepted() == 2  # the reserve, then full even for the admin group
    assert admin.refusals() == [
        "kiwid already serves 6 control clients, the most it takes (4, and 2 kept for root "
        "and group 'kiwi'); try again later"
    ]
    for _ in range(2):  # root keeps 2 of its own beyond all that
        assert raw(st.path).ask({"v": 1, "cmd": "ping"})["ok"] is True
    third = raw(st.path)
    refused = third.recv()
    assert refused is not None
    assert (refused["id"], refused["error"]["code"]) == (None, "unavailable")
    assert refused["error"]["message"] == (
        "kiwid already serves 8 control clients, 2 of them root's; try again later"
    )
    assert third.recv() is None
