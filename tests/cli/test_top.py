"""``kiwictl top``: frames rendered from canned status objects, shares, and the loop on a pty."""

from __future__ import annotations

import copy
import io
import os
import pty
import signal
import termios
from collections.abc import Iterator
from typing import Any

import pytest

from kiwid.cli.kiwictl import main
from kiwid.cli.top import ShareTracker, render, run
from tests.adapters.test_control import FakeDaemon, serve, sock_dir
from tests.cli.test_explain import STATUS as EXPLAIN_STATUS

__all__ = ["serve", "sock_dir"]  # fixtures shared with the control socket tests

STATUS: dict[str, Any] = copy.deepcopy(EXPLAIN_STATUS)
STATUS["gpus"][0].update(
    name="NVIDIA H200",
    tq_configured=20.0,
    contended=True,
    swap={
        "tenant": "pid:777",
        "direction": "in",
        "bytes": 4 * 2**30,
        "done_bytes": 2**30,
        "rate_bytes_s": 2 * 2**30,
    },
    handover_seconds={"buckets": [["+Inf", 4]], "sum": 0.1, "count": 4},
)


def with_holding(status: dict[str, Any], uptime: float, held: dict[str, float]) -> dict[str, Any]:
    """A copy of ``status`` at ``uptime`` in which tenants have held the GPU so long."""
    new = copy.deepcopy(status)
    new["uptime_s"] = uptime
    for t in new["gpus"][0]["tenants"]:
        t["ledger"]["holding_s"] = held.get(t["id"], 0.0)
    return new


def frame(status: dict[str, Any], **kw: Any) -> str:
    shares = ShareTracker(300)
    shares.add(status, 0.0)
    return "\n".join(render(status, shares, node="gpu-node-1", **kw))


def test_a_frame_shows_header_holder_queue_swap_and_tenants() -> None:
    text = frame(STATUS)
    first = text.splitlines()[0]
    assert first.startswith(
        "kiwi top · gpu-node-1 · kiwid 0.1.0 (pid 1) · up 1h02m · scheduling on"
    )
    assert first.endswith("q quits")
    assert "GPU 0 · NVIDIA H200 · TQ 30.0 s (file 20.0 s) · exclusive, contended" in text
    assert "4 hand-overs, mean 25 ms" in text
    assert "  holder   docker:ab12cd34ef56  held 12.3 s, quantum ends in 17.7 s  " in text
    assert "  queue    1. pid:777  waiting 20.0 s, turn in 17.7 s" in text
    assert "           2. podman:3f2a1b4c5d6e  waiting 12.3 s, turn in 47.7 s" in text
    assert "  swap     in pid:777  1.0 GiB of 4.0 GiB (25%) at 2.0 GiB/s" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("  ")}
    assert rows["TENANT"][:3] == ["TENANT", "STATE", "SHARE"]
    assert rows["docker:ab12cd34ef56"][1] == "holder"
    assert rows["docker:ab12cd34ef56"][2] == "8.3%"  # 310 s held of 3725 s up: since start
    assert rows["podman:3f2a1b4c5d6e"][6:9] == ["5m10s", "11", "4m02s"]


def test_a_frame_shows_weights_priorities_and_entitled_shares() -> None:
    status = copy.deepcopy(STATUS)
    tenant = status["gpus"][0]["tenants"][0]
    tenant["policy"] = {"weight": 2.0, "priority": 10}
    tenant["share"] = {"entitled": 0.667, "received": 0.5}
    rows = {
        line.split()[0]: line.split()
        for line in frame(status).splitlines()
        if line.startswith("  ")
    }
    assert "ENTITLED" in rows["TENANT"] and "W/PRIO" in rows["TENANT"]
    row = rows[tenant["id"]]
    assert "66.7%" in row and "2/10" in row


def test_a_free_gpu_an_empty_queue_and_an_older_daemon() -> None:
    status = copy.deepcopy(STATUS)
    gpu = status["gpus"][0]
    gpu.update(holder=None, waiters=[], swap=None, healthy=False)
    assert "  holder   none (the GPU is free)" in frame(status)
    assert "  queue    empty" in frame(status)
    assert "UNHEALTHY" in frame(status)
    old = copy.deepcopy(EXPLAIN_STATUS)
    del old["uptime_s"]
    for t in old["gpus"][0]["tenants"]:
        del t["ledger"]
    for w in old["gpus"][0]["waiters"]:
        del w["eta_s"]
    text = frame(old)
    assert "turn in ~47.7 s" in text  # estimated: 17.7 s left + one TQ
    assert " up " not in text.splitlines()[0]
    row = next(line for line in text.splitlines() if line.startswith("  pid:777"))
    assert row.split()[1:6] == ["waiting", "-", "-", "-", "-"]
    status["gpus"][0]["holder"] = {"tenant": "pid:1", "since_s": 3.0, "remaining_s": None}
    assert "held 3.0 s, keeps it while nobody waits" in frame(status)
    assert "no GPUs" in frame({**status, "gpus": []})


def test_lines_are_cut_to_the_width_and_the_height() -> None:
    lines = frame(STATUS, width=40, height=6).splitlines()
    assert len(lines) == 6
    assert all(len(line) <= 40 for line in lines)
    assert lines[0].endswith("…")
    assert lines[-1].startswith("… ")
    assert "more lines" in lines[-1]


def test_unreachable_daemon_frame() -> None:
    shares = ShareTracker()
    lines = render(None, shares, node="n", error="kiwid unreachable: gone")
    assert lines[0].startswith("kiwi top · n · ")
    assert lines[-1] == "kiwid unreachable: gone"


def test_share_is_since_start_until_the_window_fills_then_over_the_window() -> None:
    shares = ShareTracker(window_s=60)
    a, b = "docker:ab12cd34ef56", "pid:777"
    shares.add(with_holding(STATUS, 30, {a: 30, b: 0}), 0)
    assert shares.label() == "SHARE all"
    assert shares.share(a, "0") == 1.0
    assert shares.share(b, "0") == 0.0
    assert shares.share("pid:nobody", "0") is None
    shares.add(with_holding(STATUS, 60, {a: 40, b: 20}), 0)
    assert shares.share(a, "0") == pytest.approx(40 / 60)
    # From uptime 100 on, the samples span the 60 s window: shares over it alone.
    for uptime, held_a, held_b in ((90, 40, 50), (100, 40, 60), (150, 40, 110)):
        shares.add(with_holding(STATUS, uptime, {a: held_a, b: held_b}), 0)
    assert shares.label() == "SHARE 1m"
    assert shares.share(a, "0") == pytest.approx(0.0)  # held nothing since uptime 90
    assert shares.share(b, "0") == pytest.approx(60 / 60)
    # kiwid restarted: the history starts again (shares since the new start).
    shares.add(with_holding(STATUS, 10, {a: 5}), 0)
    assert shares.share(a, "0") == pytest.approx(0.5)


def test_share_without_uptime_uses_this_clients_clock() -> None:
    status = copy.deepcopy(EXPLAIN_STATUS)
    del status["uptime_s"]
    shares = ShareTracker(window_s=60)
    a = "docker:ab12cd34ef56"
    status["gpus"][0]["tenants"][0]["ledger"]["holding_s"] = 10.0
    shares.add(status, 1000.0)
    assert shares.share(a, "0") is None  # one sample: no span yet
    status["gpus"][0]["tenants"][0]["ledger"]["holding_s"] = 15.0
    shares.add(status, 1010.0)
    assert shares.share(a, "0") == pytest.approx(0.5)
    assert ShareTracker().share(a, "0") is None


class KeyAfterFrame(io.StringIO):
    """Frames go here; once the first is out, the user presses ``q``."""

    def __init__(self, master: int) -> None:
        super().__init__()
        self.master = master

    def flush(self) -> None:
        if "\x1b[H" in self.getvalue():
            os.write(self.master, b"q")


@pytest.fixture
def terminal() -> Iterator[tuple[int, io.TextIOWrapper]]:
    """A pseudo-terminal: (its master fd, its slave side as a text file)."""
    master, slave = pty.openpty()
    keys = open(slave, closefd=True)  # noqa: SIM115 - closed below
    yield master, keys
    keys.close()
    os.close(master)


def test_the_loop_draws_frames_quits_on_q_and_restores_the_terminal(
    serve, terminal, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve(FakeDaemon(STATUS))
    master, keys = terminal
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("LINES", "30")
    before = termios.tcgetattr(keys.fileno())
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    out = KeyAfterFrame(master)
    assert run(server.path, interval=5, out=out, keys=keys) == 0
    text = out.getvalue()
    assert text.startswith("\x1b[?1049h\x1b[?25l\x1b[H")  # alternate screen, cursor hidden
    assert text.endswith("\x1b[?25h\x1b[?1049l")  # and back
    assert "holder   docker:ab12cd34ef56" in text
    assert termios.tcgetattr(keys.fileno()) == before
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers


def test_the_loop_shows_an_absent_daemon_and_quits_on_sigterm(
    terminal, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, keys = terminal
    out = io.StringIO()

    def term_on_wait(_fd: Any, _timeout: float) -> str:
        os.kill(os.getpid(), signal.SIGTERM)  # as `kill` would, while it waits for a key
        return ""

    monkeypatch.setattr("kiwid.cli.top._wait_key", term_on_wait)
    assert run(tmp_path / "none.sock", interval=0.5, out=out, keys=keys) == 0
    text = " ".join(out.getvalue().replace("\x1b[K", "").split())
    assert "kiwid unreachable: control socket" in text
    assert "retrying every 0.5 s" in text
    assert out.getvalue().endswith("\x1b[?25h\x1b[?1049l")


def test_kiwictl_top_once(serve, capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    server = serve(FakeDaemon(STATUS))
    assert main(["--socket", str(server.path), "top", "--once"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # no screen control for scripts
    assert "  queue    1. pid:777" in out
    assert main(["--socket", str(tmp_path / "none.sock"), "top", "--once"]) == 3
    assert main(["top", "--interval", "0"]) == 2
