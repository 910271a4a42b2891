"""The daemon's shell in process: lifecycle, shutdown, GPU loss, re-adoption, ordering.

A real :class:`~kiwid.daemon.server.Daemon` on the sim backend with real (sleeping)
processes, but a scripted gate: it records what it was asked and can hold a
gate or an ungate as long as a test wants (a freeze that hangs, a lock the driver
is slow to give), which a real cgroup cannot be made to do on demand. Where time
matters to the scheduler, the clock is a fake one the test moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kiwid.adapters.control import request
from kiwid.adapters.sim import SimBackend
from kiwid.config import load_config
from kiwid.core.clock import FakeClock
from kiwid.core.events import Gated
from kiwid.daemon.gating.gates import Guard, always
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.gating.state import StateFile
from kiwid.daemon.main import assemble
from kiwid.daemon.server import RUNTIME_FAILURE, Daemon
from kiwid.daemon.tenants.identify import identify
from kiwid.daemon.tenants.tracker import TenantInfo

GiB = 2**30


class ScriptedGate:
    """A gate that records each call, and holds one while a test's Event is unset."""

    method = "none"

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        """The calls that returned, in order."""
        self.started: list[tuple[str, str]] = []
        """The calls that began (a held one is here and not yet in ``calls``)."""
        self.hold: dict[tuple[str, str], threading.Event] = {}
        self._lock = threading.Lock()

    def prepare(self, tenant: TenantInfo) -> GatedRecord:
        return GatedRecord(tenant.key, self.method, None, None, tuple(sorted(tenant.pids)))

    def _call(self, what: str, tenant: str) -> None:
        with self._lock:
            self.started.append((what, tenant))
        held = self.hold.get((what, tenant))
        if held is not None:
            held.wait(30)
        with self._lock:
            self.calls.append((what, tenant))

    def gate(self, record: GatedRecord) -> None:
        self._call("gate", record.tenant)

    def ungate(self, record: GatedRecord, guard: Guard = always) -> None:
        self._call("ungate", record.tenant)

    def forget(self, tenant: str) -> None:
        """Nothing to drop."""

    def holds(self, tenant: TenantInfo) -> bool:
        """Nothing is held before kiwid gates it."""
        return False

    def did(self, what: str, tenant: str) -> bool:
        """Whether that call returned."""
        with self._lock:
            return (what, tenant) in self.calls

    def began(self, what: str, tenant: str) -> bool:
        """Whether that call began (it may still hang)."""
        with self._lock:
            return (what, tenant) in self.started


class Pinger:
    """A stand-in for systemd's notification socket: counts watchdog pings."""

    def __init__(self, every_s: float | None = None) -> None:
        self.every_s = every_s
        self.pings = 0
        self.messages: list[str] = []

    def ready(self, status: str | None = None) -> None:
        self.messages.append("READY=1")

    def reloading(self) -> None:
        self.messages.append("RELOADING=1")

    def stopping(self) -> None:
        self.messages.append("STOPPING=1")

    def status(self, text: str) -> None:
        self.messages.append(f"STATUS={text}")

    def watchdog(self) -> None:
        self.pings += 1

    def watchdog_interval_s(self) -> float | None:
        return self.every_s

    def close(self) -> None:
        """Nothing to close."""


CONFIG = """\
[scheduler]
tq = {tq}
idle_release = {idle_release}
[gpu]
backend = "sim"
poll_interval = 0.05
[gpu.sim]
devices = 2
[control]
socket = "{d}/kiwid.sock"
[daemon]
state_dir = "{d}/state"
shutdown_timeout = {shutdown}
[kubernetes]
cdi_dir = ""
"""


@pytest.fixture
def sleepers() -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    made: list[subprocess.Popen[bytes]] = []

    def spawn() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["sleep", "300"])
        made.append(proc)
        return proc

    yield spawn
    for proc in made:
        proc.kill()
        proc.wait()


def make_daemon(
    d: Path,
    gate: ScriptedGate,
    *,
    clock: Callable[[], float] | None = None,
    notifier: Pinger | None = None,
    tq: float = 30,
    idle_release: float = 5,
    shutdown: float = 5,
) -> tuple[Daemon, SimBackend]:
    config = d / "kiwi.toml"
    config.write_text(CONFIG.format(d=d, tq=tq, idle_release=idle_release, shutdown=shutdown))
    sim = SimBackend(devices=2, memory_bytes=80 * GiB, persist=d / "state" / "sim.json")
    kw: dict[str, Any] = {"clock": clock} if clock is not None else {}
    daemon = assemble(
        config,
        load_config(config),
        backend=sim,
        gate=gate,  # type: ignore[arg-type]
        identify=identify,
        notifier=notifier or Pinger(),  # type: ignore[arg-type]
        **kw,
    )
    return daemon, sim


async def until(predicate: Callable[[], object], what: str, timeout: float = 10) -> None:
    """Yield to the loop (the engine's jobs report through it) until ``predicate`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def key(proc: subprocess.Popen[bytes]) -> str:
    return f"pid:{proc.pid}"


def test_the_loop_pings_and_answers_while_a_gate_hangs(tmp_path: Path, sleepers) -> None:
    gate = ScriptedGate()
    pinger = Pinger(every_s=0.05)
    daemon, sim = make_daemon(tmp_path, gate, notifier=pinger)
    a, b = sleepers(), sleepers()
    release = threading.Event()
    gate.hold[("gate", key(b))] = release

    async def scenario() -> int:
        run = asyncio.create_task(daemon.run())
        await until(lambda: "READY=1" in pinger.messages, "kiwid to be ready")
        sim.attach(a.pid, 0, GiB, "active")
        await until(lambda: daemon.engine.scheduler.tenant_state(key(a)), "a to be seen")
        sim.attach(b.pid, 0, GiB, "active")
        await until(lambda: daemon.engine.executor.running, "b's gate to be under way")
        # b's freeze hangs: the loop keeps pinging systemd and answering kiwictl.
        before = pinger.pings
        await until(lambda: pinger.pings >= before + 5, "five watchdog pings")
        answer = await asyncio.to_thread(request, tmp_path / "kiwid.sock", "ping")
        assert "version" in answer
        assert not gate.did("gate", key(b))
        release.set()
        await until(lambda: gate.did("gate", key(b)), "b's gate to finish")
        daemon.handle_exit(signal.SIGTERM)
        return await run

    assert asyncio.run(scenario()) == 0
    assert gate.did("ungate", key(b)), "stopping lets everyone go"


@pytest.mark.parametrize("second_sigint", [True, False])
def test_a_stop_is_bounded_and_a_second_sigint_forces_it(
    tmp_path: Path, sleepers, second_sigint: bool
) -> None:
    gate = ScriptedGate()
    pinger = Pinger()
    # With a second SIGINT the 60 s shutdown timeout is cut short; without, 0.5 s ends it.
    daemon, sim = make_daemon(
        tmp_path, gate, notifier=pinger, shutdown=60 if second_sigint else 0.5
    )
    a, b = sleepers(), sleepers()
    stuck = threading.Event()
    gate.hold[("ungate", key(b))] = stuck
    # b's ungate hangs 5 s, then returns: far past the stop's bound (0.5 s), well
    # short of the 60 s timeout that only a second SIGINT cuts short. A stop that
    # waited for it would return after it, and the check below would see that.
    hang = threading.Timer(5.0, stuck.set)

    async def scenario() -> int:
        run = asyncio.create_task(daemon.run())
        await until(lambda: "READY=1" in pinger.messages, "kiwid to be ready")
        sim.attach(a.pid, 0, GiB, "active")
        await until(lambda: daemon.engine.scheduler.tenant_state(key(a)), "a to be seen")
        sim.attach(b.pid, 0, GiB, "active")
        await until(lambda: gate.did("gate", key(b)), "b to be gated")
        hang.start()
        daemon.handle_exit(signal.SIGINT)
        await until(lambda: "STOPPING=1" in pinger.messages, "the stop to begin")
        await until(lambda: gate.began("ungate", key(b)), "b's ungate to begin (and hang)")
        if second_sigint:
            daemon.handle_exit(signal.SIGINT)
        code = await asyncio.wait_for(run, 10)
        assert not gate.did("ungate", key(b)), "the stop waited for b's hanging ungate"
        # What stays gated stays recorded, for kiwid recover.
        assert key(b) in StateFile(tmp_path / "state").load()
        return code

    try:
        assert asyncio.run(scenario()) == RUNTIME_FAILURE
    finally:
        hang.cancel()
        stuck.set()


def test_a_lost_gpu_lets_its_tenants_go(tmp_path: Path, sleepers) -> None:
    gate = ScriptedGate()
    pinger = Pinger()
    daemon, sim = make_daemon(tmp_path, gate, notifier=pinger)
    a, b = sleepers(), sleepers()

    async def scenario() -> int:
        run = asyncio.create_task(daemon.run())
        await until(lambda: "READY=1" in pinger.messages, "kiwid to be ready")
        sim.attach(a.pid, 1, GiB, "active")
        await until(lambda: daemon.engine.scheduler.tenant_state(key(a)), "a to be seen")
        sim.attach(b.pid, 1, GiB, "active")
        await until(lambda: gate.did("gate", key(b)), "b to wait for GPU 1")
        sim.lose(1)
        await until(lambda: "1" in daemon.ctx.unhealthy, "GPU 1 to be unhealthy")
        await until(lambda: gate.did("ungate", key(b)), "b to be let go")
        assert not daemon.engine.scheduler.gated(key(b))
        status = await asyncio.to_thread(request, tmp_path / "kiwid.sock", "status")
        assert [g["healthy"] for g in status["gpus"]] == [True, False]
        daemon.handle_exit(signal.SIGTERM)
        return await run

    assert asyncio.run(scenario()) == 0


def test_a_restart_re_adopts_a_waiter_and_grants_it_after_its_patience(
    tmp_path: Path, sleepers
) -> None:
    waiter = sleepers()
    # What a previous kiwid left: the waiter gated, and attached to the simulated GPU.
    state = StateFile(tmp_path / "state")
    state.put(GatedRecord(key(waiter), "none", None, None, (waiter.pid,)))
    SimBackend(2, persist=tmp_path / "state" / "sim.json").attach(waiter.pid, 0, GiB, "active")
    gate = ScriptedGate()
    clock = FakeClock(1000.0)
    daemon, _ = make_daemon(tmp_path, gate, clock=clock.now, idle_release=5)

    async def scenario() -> None:
        await daemon.startup(asyncio.get_running_loop())
        try:
            scheduler = daemon.engine.scheduler
            assert scheduler.gated(key(waiter)), "re-adopted gated, never thawed"
            view = {t.tenant: t for t in scheduler.view(clock.now()).tenants}
            assert "re-adopted" in (view[key(waiter)].waiting_for or "")
            clock.advance(4.9)  # patience: running tenants may still show up
            daemon.engine.tick()
            assert scheduler.gated(key(waiter))
            clock.advance(0.2)  # nobody did: it is granted
            daemon.engine.tick()
            await until(lambda: gate.did("ungate", key(waiter)), "the waiter to be let go")
            assert ("gate", key(waiter)) not in gate.calls, "never gated twice"
        finally:
            daemon.handle_exit(signal.SIGTERM)
            await daemon.shutdown()

    asyncio.run(scenario())


def test_the_next_holder_runs_only_after_the_previous_one_is_gated(
    tmp_path: Path, sleepers
) -> None:
    gate = ScriptedGate()
    clock = FakeClock(1000.0)
    daemon, sim = make_daemon(tmp_path, gate, clock=clock.now, tq=30)
    a, b = sleepers(), sleepers()
    slow_freeze = threading.Event()
    gate.hold[("gate", key(a))] = slow_freeze

    async def scenario() -> None:
        await daemon.startup(asyncio.get_running_loop())
        engine = daemon.engine
        try:
            from kiwid.daemon.sampling import poll  # noqa: PLC0415

            sim.attach(a.pid, 0, GiB, "active")
            engine.apply(poll(daemon.ctx))
            sim.attach(b.pid, 0, GiB, "active")
            engine.apply(poll(daemon.ctx))
            await until(lambda: gate.did("gate", key(b)), "b to wait")
            clock.advance(30)  # a's quantum ends: a is gated (slowly), b granted
            engine.apply(poll(daemon.ctx))  # a was busy all along
            engine.tick()
            assert engine.scheduler.tenant_state(key(b)) is not None
            for _ in range(20):  # while a's freeze hangs, b is not let go
                await asyncio.sleep(0.01)
                assert not gate.did("ungate", key(b))
            slow_freeze.set()
            await until(lambda: gate.did("ungate", key(b)), "b to be let go")
            assert gate.calls.index(("gate", key(a))) < gate.calls.index(("ungate", key(b)))
        finally:
            slow_freeze.set()
            daemon.handle_exit(signal.SIGTERM)
            with contextlib.suppress(Exception):
                await daemon.shutdown()

    asyncio.run(scenario())


def test_a_scheduler_that_fails_stops_kiwid_and_lets_every_tenant_go(
    tmp_path: Path, sleepers, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 17, item 4: an exception in the engine's callbacks (a job's outcome fed to
    # the scheduler, on the loop) was only logged by asyncio, and could leave a tenant
    # half-done for good. Now the daemon stops, lets everyone go, and exits 1.
    gate = ScriptedGate()
    pinger = Pinger()
    daemon, sim = make_daemon(tmp_path, gate, notifier=pinger)
    a, b = sleepers(), sleepers()
    scheduler = daemon.engine.scheduler
    handle = scheduler.handle

    def failing(event: object, now: float) -> list[object]:
        if isinstance(event, Gated) and event.tenant == key(b):  # b's gate is reported
            raise RuntimeError("a bug in the scheduler")
        return handle(event, now)  # type: ignore[arg-type]

    scheduler.handle = failing  # type: ignore[method-assign]

    async def scenario() -> int:
        run = asyncio.create_task(daemon.run())
        await until(lambda: "READY=1" in pinger.messages, "kiwid to be ready")
        sim.attach(a.pid, 0, GiB, "active")
        await until(lambda: scheduler.tenant_state(key(a)), "a to be seen")
        sim.attach(b.pid, 0, GiB, "active")
        return await asyncio.wait_for(run, 20)

    with caplog.at_level(logging.INFO):
        assert asyncio.run(scenario()) == RUNTIME_FAILURE
    assert gate.did("gate", key(b)) and gate.did("ungate", key(b)), gate.calls
    assert not StateFile(tmp_path / "state").load(), "nothing is left recorded as gated"
    messages = [r.getMessage() for r in caplog.records]
    assert any("The scheduler failed on" in m for m in messages), messages
    assert not any("Exception in callback" in m for m in messages), messages
