"""Kubernetes probes against gated tenants: what docs/kubernetes.md ("Probes") says.

1. The freeze gate, with real runc containers on the simulated GPU: two containers,
   each serving HTTP (busybox ``httpd``) and burning CPU (the sim's GPU activity),
   take turns. While one holds, the waiting one is frozen: a TCP connection to it
   is made by the kernel (a ``tcpSocket`` probe passes), an HTTP request on it gets
   no answer (an ``httpGet`` probe times out), and ``runc exec`` (an ``exec``
   probe) does not succeed. Its ``wait_bound_s`` (status and metric) is a number;
   once its turn comes, the same connection is answered: it waited in the listen
   queue.
2. The CUDA lock, on the driver double: the stand-in libcuda cannot serve a process
   in a container (it finds its processes by their PIDs, which a container's PID
   namespace renumbers), so the tenant is plain processes in a cgroup of its own, as
   in test_driver_double_e2e.py: a CUDA job and an HTTP server beside it (the CPU
   side). While the tenant is locked its server answers ``/healthz``; a request whose
   handler needs the GPU (``/gpu``: one more iteration of the CUDA job) waits for
   its turn.

Needs what tests/daemon/test_containers_e2e.py needs (root, runc, busybox-static,
keyctl); the second, a C compiler for the stand-in libcuda. Every container and
process is ended and every cgroup thawed and removed afterwards, whatever happened.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.daemon.conftest import V1_FREEZER, V2_ROOT, Card, Kiwid, config_text, status_json
from tests.daemon.test_containers_e2e import (  # noqa: F401 - fixtures, asked for by name
    frozen,
    hook_path,
    make_bundle,
    root_only,
    rootfs,
    runc,
    runc_pid,
    runc_run_detached,
    tenant,
    test_cgroup,
)
from tests.daemon.test_driver_double_e2e import config as double_config
from tests.daemon.test_metrics_e2e import free_port, scrape
from tests.stand_ins import cudadir

pytestmark = [pytest.mark.slow, pytest.mark.cgroups]  # its containers' cgroups too

TQ = 30.0
"""Long enough that a waiter stays gated through its probes: the test ends the
holder's turn itself (``set-tq``), when it has seen what it came to see."""
ALLOWANCE = 2.0  # scheduler.handover_allowance, by default
PROBE_TIMEOUT = 2.0
"""A probe's ``timeoutSeconds``: no answer within it is a failed probe."""
PORT = 8080
REQUEST = b"GET /healthz HTTP/1.0\r\nHost: localhost\r\n\r\n"
CLONE_NEWNET = 0x40000000


# ---- probing ------------------------------------------------------------------------


def connect_in(pid: int, port: int) -> socket.socket:
    """A TCP connection to 127.0.0.1:``port`` in ``pid``'s network namespace.

    The kubelet reaches a pod's address from the host; a connection to the loopback
    inside the namespace meets the same listening socket and the same accept queue.
    A helper thread enters the namespace (``setns`` acts on one thread) and makes
    the socket there, which stays in that namespace.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    made: list[socket.socket | BaseException] = []

    def enter_and_connect() -> None:
        try:
            with open(f"/proc/{pid}/ns/net", "rb") as ns:
                if libc.setns(ns.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns into the container's netns")
            made.append(socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT))
        except BaseException as err:  # handed to the caller
            made.append(err)

    helper = threading.Thread(target=enter_and_connect)
    helper.start()
    helper.join()
    (result,) = made
    if isinstance(result, BaseException):
        raise result
    return result


def read_answer(conn: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes; ``TimeoutError`` if it says nothing."""
    conn.settimeout(timeout)
    chunks = []
    while chunk := conn.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks)


def http_get(pid: int, port: int = PORT, path: str = "/healthz") -> bytes | None:
    """An ``httpGet`` probe: the answer, or ``None`` where none came (or no connection)."""
    try:
        with connect_in(pid, port) as conn:
            conn.sendall(REQUEST.replace(b"/healthz", path.encode()))
            return read_answer(conn, PROBE_TIMEOUT)
    except OSError:  # refused, or timed out
        return None


def answered(reply: bytes | None) -> bool:
    return reply is not None and reply.startswith(b"HTTP/1.") and b" 200 " in reply


def serves(pid: int) -> bool:
    return answered(http_get(pid))


# ---- 1. the freeze gate, real containers ----------------------------------------------

SERVE_AND_BURN = f"httpd -p {PORT} -h /www && while :; do :; done"
"""busybox httpd goes to the background; the container's first process then burns
CPU, which the simulated GPU takes for GPU work (``sim-attach``, activity ``cpu``)."""


def thaw(cgroup: str) -> None:
    for path, value in (
        (V2_ROOT / cgroup.lstrip("/") / "cgroup.freeze", "0"),
        (V1_FREEZER / cgroup.lstrip("/") / "freezer.state", "THAWED"),
    ):
        with contextlib.suppress(OSError):
            path.write_text(value)


@dataclass
class Pods:
    """A kiwid and the serving containers started beside it."""

    kiwid: Kiwid
    runc: list[str]
    """runc, with the test's own state directory."""
    start: Callable[[str], Box]


@dataclass
class Box:
    """One running container."""

    cid: str
    cgroup: str
    pid: int
    """Its first process (the one that burns CPU)."""

    @property
    def key(self) -> str:
        return f"cgroup:{self.cgroup}"


@pytest.fixture
def containers(
    request: pytest.FixtureRequest, workdir: Path, start_kiwid: Callable[..., Kiwid]
) -> Iterator[Pods]:
    """A kiwid (freeze gate, TQ 30 s, metrics on) and a starter of serving containers.

    ``start(name)`` runs container ``PARENT-name`` in cgroup ``/PARENT/name`` with
    runc and kiwi-hook. Afterwards kiwid is stopped (it thaws what it froze), every
    cgroup is thawed all the same, and every container is deleted.
    """
    runc_path, root, hook, parent = (
        request.getfixturevalue(name) for name in ("runc", "rootfs", "hook_path", "test_cgroup")
    )
    (root / "www").mkdir()
    (root / "www" / "healthz").write_text("ok\n")
    (root / "bin" / "httpd").symlink_to("busybox")
    port = free_port()
    text = config_text(workdir, tq=TQ, poll=0.05).replace(
        'backend = "sim"', 'backend = "sim"\ngate = "freeze"'
    )
    (workdir / "kiwi.toml").write_text(text + f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    k = start_kiwid()
    k.extra["metrics_port"] = port
    runc_cmd = [runc_path, "--root", str(workdir / "runc-state")]
    started: list[tuple[str, str]] = []

    def start(name: str) -> Box:
        (workdir / name).mkdir()
        cgroup = f"/{parent}/{name}"
        bundle = make_bundle(runc_path, workdir / name, root, hook, k, cgroup)
        config = json.loads((bundle / "config.json").read_text())
        config["process"]["args"] = ["sh", "-c", SERVE_AND_BURN]
        (bundle / "config.json").write_text(json.dumps(config))
        cid = f"{parent}-{name}"
        started.append((cid, cgroup))
        log = workdir / f"runc-{name}.log"
        assert runc_run_detached(runc_cmd, bundle, cid, log).wait(60) == 0, log.read_text()
        return Box(cid, cgroup, runc_pid(runc_cmd, cid))

    try:
        yield Pods(k, runc_cmd, start)
    finally:
        k.stop()
        for cid, cgroup in started:
            thaw(cgroup)
            subprocess.run([*runc_cmd, "delete", "--force", cid], capture_output=True, timeout=60)


def exec_probe(runc_cmd: list[str], cid: str) -> subprocess.CompletedProcess[str] | None:
    """An ``exec`` probe (``cat /www/healthz`` in the container); ``None``: it timed out."""
    try:
        return subprocess.run(
            [*runc_cmd, "exec", cid, "cat", "/www/healthz"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT + 3,  # runc's own start-up besides the probe's time
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None


def test_a_frozen_waiter_takes_probe_connections_but_answers_nothing_until_its_turn(
    containers: Pods,
) -> None:
    k = containers.kiwid
    a, b = containers.start("a"), containers.start("b")
    k.until(lambda: tenant(k, a.key) and tenant(k, b.key), 10, "both containers as tenants")
    for box in (a, b):  # both serve, ungated, before either touches the GPU
        k.until(functools.partial(serves, box.pid), 10, f"{box.cid} to serve HTTP")

    k.attach(a.pid)
    k.until(lambda: k.tenant_states().get(a.key) == "holder", 10, "a to hold the GPU")
    k.attach(b.pid)
    k.until(lambda: k.tenant_states().get(b.key) == "waiting", 10, "b to wait for its turn")
    k.until(lambda: frozen(b.cgroup), 5, "b to be frozen")

    # tcpSocket: the kernel completes the handshake for a frozen listener.
    conn = connect_in(b.pid, PORT)
    try:
        # httpGet: the request waits, unanswered, past the probe's timeout.
        conn.sendall(REQUEST)
        with pytest.raises(TimeoutError):
            read_answer(conn, PROBE_TIMEOUT)
        # exec: no answer either (runc refuses a paused container, or the probe's
        # process joins the frozen cgroup and hangs until its timeout).
        probe = exec_probe(containers.runc, b.cid)
        assert probe is None or probe.returncode != 0, probe
        # All of it while b was frozen and waiting, and a held the GPU throughout.
        assert frozen(b.cgroup), "b was thawed meanwhile: the probes proved nothing"
        assert k.tenant_states()[b.key] == "waiting"
        assert k.status()["gpus"][0]["holder"]["tenant"] == a.key
        assert answered(http_get(a.pid)), "the holder answers"

        # What kiwid exports for b: the holder's quantum plus the allowance.
        status = status_json(k)
        assert status["gate"] == "freeze"
        (gpu,) = status["gpus"]
        (waiter,) = gpu["waiters"]
        assert waiter["tenant"] == b.key
        assert waiter["wait_bound_s"] == TQ + ALLOWANCE, waiter
        samples = scrape(k.extra["metrics_port"])["kiwi_waiter_wait_bound_seconds"]
        assert {s.labels["tenant"]: s.value for s in samples} == {b.key: TQ + ALLOWANCE}

        # b's turn: the request that waited in its listen queue is answered now.
        k.call("set-tq", {"tq": 1})
        k.until(lambda: k.tenant_states().get(b.key) == "holder", 10, "b's turn")
        assert answered(read_answer(conn, 10))
    finally:
        conn.close()


# ---- 2. the CUDA lock, on the driver double --------------------------------------------

SERVER = r"""
import socket, sys, threading, time
from pathlib import Path
import cudadir

listener = socket.socket(fileno=int(sys.argv[1]))
directory, job = Path(sys.argv[2]), int(sys.argv[3])

def serve(conn):
    with conn:
        request = conn.recv(4096)
        if b" /gpu " in request:  # one more iteration of the CUDA job: needs the GPU
            done = cudadir.read_progress(directory, job)[0]
            while cudadir.read_progress(directory, job)[0] == done:
                time.sleep(0.01)
        conn.sendall(b"HTTP/1.0 200 OK\r\n\r\nok\n")

while True:
    conn, _ = listener.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""
"""The tenant's CPU side: an HTTP server with a thread per request. ``/healthz``
answers at once; ``/gpu`` answers once the tenant's CUDA job (``job``) has done one
more iteration, as a handler that makes a CUDA call returns once the call does."""


def serve_beside(card: Card, job: int, cgroup: Path) -> tuple[subprocess.Popen[bytes], int]:
    """Start :data:`SERVER` in ``cgroup``, serving the progress of ``job``; and its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    join = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
    argv = [sys.executable, "-c", SERVER, str(listener.fileno()), str(card.double.directory)]
    server = subprocess.Popen(
        ["sh", "-c", join, str(cgroup), *argv, str(job)],
        pass_fds=(listener.fileno(),),
        env={**os.environ, "PYTHONPATH": str(Path(cudadir.__file__).parent)},
    )
    port = int(listener.getsockname()[1])
    listener.close()  # the server holds it
    return server, port


def test_a_locked_waiters_cpu_side_answers_probes_and_only_gpu_work_waits(
    start_kiwid: Callable[..., Kiwid], workdir: Path, card: Card
) -> None:
    # A holder that a loaded machine lets go quiet for a moment keeps its turn.
    text = double_config(workdir, tq=TQ).replace("idle_release = 0.5", "idle_release = 10")
    (workdir / "kiwi.toml").write_text(text)
    k = start_kiwid(env=card.double.env())
    k.wait_log("Gate: the CUDA driver's process lock")
    a = card.arrive("a")
    k.until(lambda: k.status()["gpus"][0]["holder"], 10, "a to hold the GPU")
    b = card.arrive("b")
    b_key = card.key(b)
    server, port = serve_beside(card, b.pid, card.parent / "b")
    me = os.getpid()  # the server listens in our network namespace
    try:

        def gated() -> bool:
            proc = card.double.processes().get(b.pid)
            waiting = k.tenant_states().get(b_key) == "waiting"
            return waiting and proc is not None and proc.state != cudadir.RUNNING

        k.until(gated, 10, "b to wait, its CUDA job locked")
        k.until(lambda: answered(http_get(me, port)), 10, "b's server to answer")
        # The GPU side waits: a request whose handler needs the GPU gets no answer.
        conn = connect_in(me, port)
        with conn:
            conn.sendall(REQUEST.replace(b"/healthz", b"/gpu"))
            with pytest.raises(TimeoutError):
                read_answer(conn, PROBE_TIMEOUT)
            # The CPU side answers, beside it.
            assert answered(http_get(me, port))
            # All of it while b was locked, not frozen, and waiting behind a.
            assert gated(), "b ran meanwhile: the probes proved nothing"
            assert "frozen 1" not in (card.parent / "b" / "cgroup.events").read_text()
            assert k.status()["gpus"][0]["holder"]["tenant"] == card.key(a)
            status = status_json(k)
            assert status["gate"] == "cuda-lock"
            (waiter,) = status["gpus"][0]["waiters"]
            # Memory swaps here: one more TQ for the hand-over that brings it back.
            assert waiter["wait_bound_s"] == TQ + ALLOWANCE + TQ, waiter

            # b's turn: its CUDA job runs again, and the request is answered.
            k.call("set-tq", {"tq": 1})
            assert answered(read_answer(conn, 20))
    finally:
        server.kill()
        server.wait()
