"""Idle tenants park in host RAM and wake on their next request (issue 26), end to end.

A real kiwid on the simulated GPU (the freezer gates, the sim moves memory at the
rates it is given), real processes in cgroups of their own: a server that listens
on TCP and does CPU work (what the sim counts as GPU work) for each request, and
busy trainers. On kiwid before parking, the idle server swapped out for room was
queued again, restored at its turn for nothing and swapped out again.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.daemon.conftest import KIWID, Kiwid, Tenant, wait_for
from tests.daemon.test_swap_e2e import GiB, start, swap_lines, swapped

pytestmark = pytest.mark.cgroups  # the tenants are frozen in cgroups of their own

NOBODY = 65534

# The server: optionally drops to another user, listens, says its port, and for
# each request line does 0.3 s of CPU work (the sim's GPU work), then answers.
SERVER = """
import os, socket, time
uid = int(os.environ.get("KIWI_TEST_UID", "0"))
if uid:
    os.setuid(uid)
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(16)
port_file = os.environ["KIWI_TEST_PORT_FILE"]
with open(port_file + ".tmp", "w") as f:
    f.write(str(s.getsockname()[1]))
os.rename(port_file + ".tmp", port_file)
while True:
    c, _ = s.accept()
    c.recv(1024)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    c.sendall(b"done\\n")
    c.close()
"""


@dataclass
class Server:
    tenant: Tenant
    port: int


@pytest.fixture
def serve(tenants, workdir: Path) -> Callable[..., Server]:
    ports = workdir / "ports"
    ports.mkdir(mode=0o777)
    ports.chmod(0o777)  # a server that runs as another user writes its port here

    def make(name: str, uid: int = 0) -> Server:
        port_file = ports / name
        os.environ["KIWI_TEST_PORT_FILE"] = str(port_file)
        os.environ["KIWI_TEST_UID"] = str(uid)
        try:
            tenant = tenants(name, busy=False, work=SERVER)
        finally:
            del os.environ["KIWI_TEST_PORT_FILE"], os.environ["KIWI_TEST_UID"]
        port = wait_for(lambda: port_file.exists() and int(port_file.read_text()), 5, "a port")
        return Server(tenant, port)

    return make


@dataclass
class Request:
    """One request to a server, sent from a thread: the answer, or why none came."""

    port: int
    answer: bytes | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def send(self) -> Request:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=60) as conn:
                conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
                self.answer = conn.recv(64)
        except OSError as err:
            self.error = str(err)
        finally:
            self.done.set()


def state_of(k: Kiwid, key: str) -> dict:
    """The tenant's entry in status (empty until kiwid sees it)."""
    return next((t for t in k.status()["gpus"][0]["tenants"] if t["id"] == key), {})


def park_a_server(start_kiwid, tenants, serve, workdir: Path, **kw) -> tuple[Kiwid, Server, list]:
    """An idle 3 GiB server, then two busy 6 GiB trainers that need its room."""
    uid = kw.pop("uid", 0)
    k = start(start_kiwid, workdir, **kw)
    s = serve("s", uid=uid)
    k.attach(s.tenant.pid, memory=3 * GiB)
    k.until(lambda: state_of(k, s.tenant.key).get("state") == "idle", 5, "the server idle")
    trainers = [tenants("t"), tenants("u")]
    for t in trainers:
        k.attach(t.pid, memory=6 * GiB)
    k.until(lambda: state_of(k, s.tenant.key).get("state") == "parked", 10, "the server parked")
    k.until(lambda: swapped(workdir, s.tenant), 10, "the parked server's memory in host RAM")
    return k, s, trainers


def test_an_idle_tenant_swapped_out_for_room_parks_and_is_not_restored(
    start_kiwid, tenants, serve, workdir
) -> None:
    k, s, (t, u) = park_a_server(start_kiwid, tenants, serve, workdir)
    key = s.tenant.key
    assert swapped(workdir, s.tenant) and s.tenant.frozen()
    # The trainers take turns through host RAM; the parked server holds none.
    turns = lambda: sum(1 for way, who in swap_lines(k) if way == "in" and who in (t.key, u.key))  # noqa: E731
    seen = turns()
    k.until(lambda: turns() >= seen + 4, 30, "four more turns of the trainers")
    assert ("in", key) not in swap_lines(k), "a parked tenant was restored for nothing"
    entry = state_of(k, key)
    assert entry["state"] == "parked" and entry["residency"] == "host"
    assert entry["wakes_on"] == [f"tcp 127.0.0.1:{s.port}"]
    assert entry["parked_since"] is not None and entry["park_refusal"] is None
    assert key not in [w["tenant"] for w in k.status()["gpus"][0]["waiters"]]
    said = k.ctl("status")
    assert "parked since" in said.stdout and f"tcp 127.0.0.1:{s.port}" in said.stdout, said
    explained = k.ctl("explain", key)
    assert "is PARKED since" in explained.stdout and "`kiwictl wake`" in explained.stdout


def test_a_request_to_a_frozen_parked_server_wakes_it_and_is_answered(
    start_kiwid, tenants, serve, workdir
) -> None:
    k, s, _ = park_a_server(start_kiwid, tenants, serve, workdir)
    key = s.tenant.key
    request = Request(s.port).send()
    k.until(request.done.is_set, 30, "the server's answer")
    assert request.answer == b"done\n", request.error
    assert ("in", key) in swap_lines(k), "its memory came back for the request"
    entry = state_of(k, key)
    assert entry["last_wake"]["reason"] == "request", entry
    assert f"127.0.0.1:{s.port}" in entry["last_wake"]["detail"]
    assert k.status()["counters"]["wakes"]["request"] >= 1
    # Served, it idles, and parks again at the next squeeze instead of taking turns.
    k.until(lambda: state_of(k, key)["state"] == "parked", 20, "the server parked again")


def test_kiwictl_wake_wakes_a_parked_tenant_for_its_owner_and_refuses_others(
    start_kiwid, tenants, serve, workdir
) -> None:
    k, s, (t, _u) = park_a_server(start_kiwid, tenants, serve, workdir, uid=NOBODY)
    key = s.tenant.key
    stranger = as_user(NOBODY - 1, k, {"cmd": "wake", "args": {"tenant": key}})
    assert stranger["error"]["code"] == "forbidden", stranger
    assert f"you are uid {NOBODY - 1}" in stranger["error"]["message"]
    assert state_of(k, key)["state"] == "parked", "a refusal changes nothing"
    owner = as_user(NOBODY, k, {"cmd": "wake", "args": {"tenant": key}})
    assert owner["result"]["woken"] is True and owner["result"]["was"] == "parked", owner
    k.until(lambda: ("in", key) in swap_lines(k), 20, "the woken server restored")
    # A busy trainer is never parked: nothing to wake, exit 0, and it says so.
    out = k.ctl("wake", t.key)
    assert out.returncode == 0 and "not parked" in out.stdout, out
    unknown = k.ctl("wake", "no-such-tenant")
    assert unknown.returncode == 1 and "no tenant" in unknown.stderr


def test_kiwictl_wake_as_root_wakes_a_parked_server(start_kiwid, tenants, serve, workdir) -> None:
    k, s, _ = park_a_server(start_kiwid, tenants, serve, workdir)
    out = k.ctl("wake", s.tenant.key)
    assert out.returncode == 0 and "Woke" in out.stdout, out
    k.until(lambda: ("in", s.tenant.key) in swap_lines(k), 20, "the woken server restored")
    assert state_of(k, s.tenant.key)["last_wake"]["reason"] == "operator"


def test_a_stop_restores_a_parked_tenant_and_recover_brings_back_the_rest(
    start_kiwid, tenants, serve, workdir
) -> None:
    k, s, (t, u) = park_a_server(start_kiwid, tenants, serve, workdir, tq=2)
    # A stop restores what fits (the holder runs on; the parked server fits beside
    # it or is kept swapped) and records the rest; recover brings back what is left.
    k.stop(signal.SIGTERM)
    log = k.log_text()
    kept = [x for x in (s.tenant, t, u) if swapped(workdir, x)]
    assert all(x.frozen() for x in kept), log
    assert s.tenant in kept or not s.tenant.frozen(), log
    for x in (t, u):
        if x in kept and x is not s.tenant:
            x.proc.kill()  # make room, as an operator would
            x.proc.wait()
    out = subprocess.run(
        [*KIWID, "recover", "--state-dir", str(workdir / "state")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert not swapped(workdir, s.tenant) and not s.tenant.frozen()
    request = Request(s.port).send()
    assert request.done.wait(30) and request.answer == b"done\n", request.error


def test_a_parked_tenant_that_exits_is_dropped(start_kiwid, tenants, serve, workdir) -> None:
    k, s, _ = park_a_server(start_kiwid, tenants, serve, workdir)
    s.tenant.proc.kill()
    s.tenant.proc.wait()
    k.until(lambda: s.tenant.key not in k.tenant_states(), 10, "the parked tenant dropped")
    records = lambda: json.loads((workdir / "state" / "state.json").read_text())["gated"]  # noqa: E731
    k.until(lambda: s.tenant.key not in records(), 10, "its record to go with it")
    k.stop(signal.SIGTERM)
    assert f"Kept swapped: {s.tenant.key}" not in k.log_text()


def as_user(uid: int, k: Kiwid, message: dict) -> dict:
    """Send one control request over the socket as ``uid`` (socket code only)."""
    code = (
        "import json, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.connect(sys.argv[1])\n"
        "s.sendall(sys.argv[2].encode() + b'\\n')\n"
        "print(s.makefile().readline())\n"
    )
    request = json.dumps({"v": 1, "id": 1, **message})
    out = subprocess.run(
        ["python3", "-c", code, str(k.socket), request],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
        user=uid,
    )
    return json.loads(out.stdout)
