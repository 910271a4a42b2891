"""An operator's retry of a stuck tenant whose gate did not take, in process.

A real :class:`~kiwid.daemon.server.Daemon` on the sim backend with real (sleeping)
processes and a scripted gate that refuses to gate one tenant while a test wants:
the freeze that never takes, which a real cgroup cannot be made to do on demand.
Such a tenant is stuck and may still run: nobody else is let go on its GPU, and no
wait there has a bound. ``retry`` tries its gate at once and answers when it took.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest

from kiwid.adapters.control import ControlError, request
from kiwid.adapters.sim import SimBackend
from kiwid.config import load_config
from kiwid.daemon.gating.gates import GateError
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.main import assemble
from kiwid.daemon.tenants.identify import identify
from tests.daemon.test_shell import CONFIG, GiB, Pinger, ScriptedGate, key, sleepers, until

__all__ = ["sleepers"]  # the fixture, shared with the shell tests


class RefusingGate(ScriptedGate):
    """A scripted gate whose freeze of the tenants in ``refuse`` fails (EBUSY, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse: set[str] = set()

    def gate(self, record: GatedRecord) -> None:
        if record.tenant in self.refuse:
            raise GateError(f"{record.tenant}: the freeze did not take", answer="EBUSY")
        super().gate(record)


def test_a_retry_of_a_tenant_whose_gate_did_not_take_tries_it_now(tmp_path: Path, sleepers) -> None:
    config = tmp_path / "kiwi.toml"
    text = CONFIG.format(d=tmp_path, tq=30, idle_release=30, shutdown=5)
    config.write_text(text.replace("[gpu]\n", "[gpu]\ndriver_timeout = 1\ngate_timeout = 1\n"))
    sim = SimBackend(devices=2, memory_bytes=80 * GiB, persist=tmp_path / "state" / "sim.json")
    gate, pinger = RefusingGate(), Pinger()
    daemon = assemble(
        config,
        load_config(config),
        backend=sim,
        gate=gate,  # type: ignore[arg-type]
        identify=identify,
        notifier=pinger,  # type: ignore[arg-type]
    )
    sock = tmp_path / "kiwid.sock"
    a, b, c = sleepers(), sleepers(), sleepers()
    gate.refuse.add(key(b))

    def ask(cmd: str, args: dict[str, Any] | None = None) -> Any:
        return asyncio.to_thread(request, sock, cmd, args, 10.0)

    def entry(status: dict[str, Any], tenant: str) -> dict[str, Any]:
        return next(t for t in status["gpus"][0]["tenants"] if t["id"] == tenant)

    async def scenario() -> dict[str, Any]:
        run = asyncio.create_task(daemon.run())
        await until(lambda: "READY=1" in pinger.messages, "kiwid to be ready")
        state = daemon.engine.scheduler.tenant_state
        sim.attach(a.pid, 0, GiB, "active")
        await until(lambda: str(state(key(a))) == "holder", "a to hold GPU 0")
        sim.attach(b.pid, 0, GiB, "active")
        await until(lambda: str(state(key(b))) == "stuck", "b's gate to fail for good")
        sim.attach(c.pid, 0, GiB, "active")
        await until(lambda: gate.did("gate", key(c)), "c to be gated")
        told = f"1 waiting, 1 stuck ({key(b)})"
        await until(lambda: any(told in m for m in pinger.messages), "systemd told of it")
        status = await ask("status")
        gpu = status["gpus"][0]
        reason = entry(status, key(b))["stuck_reason"]
        assert (reason["operation"], reason["contained"], reason["answer"]) == (
            "gate",
            False,
            "EBUSY",
        )
        assert entry(status, key(b))["gate_failure"]
        assert gpu["blocked_by"] == key(b) and gpu["stuck"] == [key(b)]
        waiter = next(w for w in gpu["waiters"] if w["tenant"] == key(c))
        assert waiter["wait_bound_s"] is None
        assert waiter["wait_bound_reason"].startswith(f"{key(b)} is stuck and may still run")
        with pytest.raises(ControlError) as refused:
            await ask("release", {"tenant": key(c)})
        assert refused.value.code == "invalid-value"
        assert refused.value.message == (
            f"{key(c)} is waiting, not stuck: kiwid lets it go at its turn"
        )

        gate.refuse.clear()
        answer = await ask("retry", {"tenant": key(b)})
        assert gate.did("gate", key(b)), "the retry gated it (not the next TQ's try)"
        status = await ask("status")
        daemon.handle_exit(signal.SIGTERM)
        assert await run == 0
        return {"answer": answer, "status": status}

    done = asyncio.run(scenario())
    answer, status = done["answer"], done["status"]
    assert (answer["state"], answer["pending"], answer["stuck_reason"]) == ("waiting", False, None)
    assert answer["residency"] == "resident"
    gpu = status["gpus"][0]
    assert (gpu["blocked_by"], gpu["stuck"]) == (None, [])
    assert all(w["wait_bound_s"] is not None for w in gpu["waiters"])
