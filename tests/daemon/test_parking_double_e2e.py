"""A request to a parked server wakes it under the CUDA lock, on the driver double (issue 26).

A real kiwid over the driver double (``gate = "cuda-lock"``, ``swap =
"checkpoint"``, ``memory.park`` by default ``"idle"``, TQ 1 s, ``idle_release``
0.5 s). The server is ``cuda_tenant.py --serve``: a 3 GiB model behind a TCP port,
idle between requests. Two busy trainers arrive beside it and fill the 4 GiB card
(no other job on it): the first holds, the second waits, and at its turn it needs
the room (a newcomer gets the whole card): kiwid sends the idle server's memory to
host RAM and the server parks: gated, out of the queue, its memory kept in host RAM.
An idle tenant let go stays on the card until then: a trainer that holds ungated
from its start (the first) makes no room.

The CUDA lock gates only the GPU side: the parked server is never frozen, so its
CPU side accepts a request and reads it, then blocks at its first CUDA call (the
double's process is LOCKED or CHECKPOINTED). kiwid's waker sees a request read and
not answered on one of its sockets (or, should its poll fall in the few milliseconds
before the server accepts and reads it, one not yet accepted or read) and wakes it:
it waits for its turn, is restored and answers. Before parking (039ea3c) the server
was never parked: it waited in the queue and came back at every turn, for nothing.

A sampler reads the double's truth every 50 ms, as in test_lanes_e2e.py: which
tenants have a process RUNNING (unlocked) on the card, and which cgroups are frozen.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.conftest import Card, Kiwid
from tests.daemon.test_driver_double_e2e import start
from tests.daemon.test_swap_e2e import swap_lines
from tests.stand_ins import cudadir
from tests.stand_ins.cudadouble import CudaTenant

GiB = 2**30
SERVER = 3 * GiB
TRAINER = GiB // 2
"""The server and two trainers fill the card: each starts beside the others' memory."""
ASKED = 40
"""Iterations of GPU work per request: ~0.2 s of the server's turn (4 samples or more)."""
SAMPLE_S = 0.05


@dataclass(frozen=True)
class Sample:
    """One reading of the double and the cgroups."""

    at: float
    states: dict[str, int | None]
    """Each tenant's process state (``None``: no context on the card)."""
    frozen: frozenset[str]

    def running(self) -> set[str]:
        """Tenants whose process may do GPU work now: RUNNING, in a cgroup not frozen."""
        return {n for n, s in self.states.items() if s == cudadir.RUNNING} - self.frozen


@dataclass
class Sampler:
    """Who runs on the card and who is frozen, every 50 ms, by the double's truth."""

    card: Card
    tenants: dict[str, CudaTenant] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            procs = self.card.double.processes()  # one snapshot, under the card's lock
            tenants = list(self.tenants.items())
            states = {n: p.state if (p := procs.get(t.pid)) else None for n, t in tenants}
            frozen = frozenset(n for n, t in tenants if frozen_now(t))
            self.samples.append(Sample(time.monotonic(), states, frozen))

    def since(self, at: float, until: float = float("inf")) -> list[Sample]:
        return [s for s in list(self.samples) if at <= s.at <= until]


def frozen_now(tenant: CudaTenant) -> bool:
    assert tenant.cgroup is not None
    try:
        return "frozen 1" in (tenant.cgroup / "cgroup.events").read_text()
    except OSError:  # gone at the end
        return False


@pytest.fixture
def sampled(card: Card) -> Iterator[Sampler]:
    sampler = Sampler(card)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    try:
        yield sampler
    finally:
        sampler._stop.set()
        thread.join(5)


def entry(k: Kiwid, key: str) -> dict[str, Any]:
    """The tenant as status lists it (with its parking fields)."""
    for gpu in k.status()["gpus"]:
        for tenant in gpu["tenants"]:
            if tenant["id"] == key:
                return tenant
    return {}


def turns(samples: list[Sample]) -> list[str]:
    """Who ran, in order, one name per turn."""
    order: list[str] = []
    for sample in samples:
        for name in sorted(sample.running()):
            if not order or order[-1] != name:
                order.append(name)
    return order


@dataclass
class Parked:
    """kiwid, and the server it parked (since ``parked_at``, a monotonic time)."""

    k: Kiwid
    server: CudaTenant
    key: str
    port: int
    parked_at: float


def a_server_parks(start_kiwid, workdir: Path, card: Card, sampled: Sampler) -> Parked:
    """The server starts idle; the trainers come, and the second one's turn parks it."""
    card.double.set_foreign(0)
    k = start(start_kiwid, workdir, card)
    port_file = workdir / "server.port"
    server = card.arrive("server", SERVER, serve=port_file)
    sampled.tenants["server"] = server
    key = card.key(server)
    k.until(port_file.exists, 10, "the server to listen")
    port = int(port_file.read_text())
    k.until(lambda: k.tenant(key).get("state") == "idle", 10, "kiwid to see the idle server")
    for name in ("a", "b"):
        sampled.tenants[name] = card.arrive(name, TRAINER)
    k.until(lambda: entry(k, key).get("state") == "parked", 20, "the server to park")
    k.until(
        lambda: card.double.state(server.pid) == cudadir.CHECKPOINTED,
        20,
        "the server's memory in host RAM",
    )
    parked = entry(k, key)
    assert parked["state"] == "parked" and parked["parked_since"] is not None, parked
    assert parked["resident"] is False, parked
    k.until(
        lambda: entry(k, key).get("wakes_on") == [f"tcp 127.0.0.1:{port}"],
        10,
        "status to say where the parked server wakes",
    )
    return Parked(k, server, key, port, time.monotonic())


@pytest.mark.serial  # who runs, sampled every 50 ms; a busy neighbour would skew it
def test_a_request_to_a_parked_server_wakes_it_under_the_cuda_lock(
    start_kiwid, workdir: Path, card: Card, sampled: Sampler
) -> None:
    p = a_server_parks(start_kiwid, workdir, card, sampled)
    k, key = p.k, p.key
    # The trainers take turns; the server stays parked: no turn, no restore.
    k.until(lambda: len(turns(sampled.since(p.parked_at))) >= 4, 30, "four of the trainers' turns")
    assert entry(k, key)["state"] == "parked"
    assert ("in", key) not in swap_lines(k), "the parked server was restored"
    assert {s.states["server"] for s in sampled.since(p.parked_at)} == {cudadir.CHECKPOINTED}

    with socket.create_connection(("127.0.0.1", p.port), timeout=30) as client:
        client.sendall(f"{ASKED}\n".encode())
        with client.makefile("r") as reader:
            try:  # once woken: its turn, its restore and its work
                answer = reader.readline()
            except TimeoutError:
                pytest.fail(f"no answer from the server; kiwid logged:\n{k.log_text()[-6000:]}")
    assert answer == f"done {ASKED}\n", answer
    assert p.server.progress() == ASKED
    worked_until = cudadir.read_progress(card.double.directory, p.server.pid)[1] / 1e9

    woke = entry(k, key)["last_wake"]
    assert woke is not None and woke["reason"] == "request", woke
    assert f"127.0.0.1:{p.port}" in woke["detail"], woke
    assert k.status()["counters"]["wakes"] == {"request": 1}
    moves = swap_lines(k)
    assert ("in", key) in moves[moves.index(("out", key)) :], moves
    # Parked, woken, queued, at its turn: it ran only alone, with its memory on
    # the card, and the lock froze nobody (its CPU side took the request).
    window = sampled.since(p.parked_at, worked_until)
    assert len(window) > 20, "the sampler kept up"
    assert not [s for s in sampled.samples if s.frozen], "a cgroup was frozen"
    assert [s for s in window if len(s.running()) > 1] == []
    # RUNNING: unlocked, and the double unlocks only a process whose memory is back.
    assert any(s.running() == {"server"} for s in window), "the server's turn went unseen"


def test_kiwictl_wake_wakes_a_parked_server_on_the_double(
    start_kiwid, workdir: Path, card: Card, sampled: Sampler
) -> None:
    p = a_server_parks(start_kiwid, workdir, card, sampled)
    k, key = p.k, p.key
    quanta = entry(k, key)["ledger"]["quanta"]
    woken = k.ctl("wake", key)
    assert woken.returncode == 0, woken.stdout + woken.stderr
    assert "Woke" in woken.stdout, woken.stdout
    assert "it is waiting" in woken.stdout, woken.stdout  # queued behind the trainers
    k.until(lambda: entry(k, key)["ledger"]["quanta"] > quanta, 20, "the server's turn")
    k.until(lambda: ("in", key) in swap_lines(k), 20, "the server restored")
    k.until(
        lambda: any("server" in s.running() for s in sampled.since(p.parked_at)),
        10,
        "the server let go, its memory back",
    )
    assert entry(k, key)["last_wake"]["reason"] == "operator"
    assert k.status()["counters"]["wakes"] == {"operator": 1}
    # No request came: the turn bought no GPU work, and it parks again.
    k.until(lambda: entry(k, key).get("state") == "parked", 20, "the server to park again")
    assert k.status()["counters"]["restores_wasted"] >= 1
    assert not [s for s in sampled.samples if s.frozen], "a cgroup was frozen"
