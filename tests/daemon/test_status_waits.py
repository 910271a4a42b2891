"""Wait bounds that cannot hold, and stuck tenants in the status: from the real scheduler.

The scheduling core is driven with events (its own fake time); the status helpers
read its view as ``build_status`` does.
"""

from __future__ import annotations

from typing import Any

from kiwid.core.actions import Gate, SwapIn, SwapOut, Ungate
from kiwid.core.events import (
    ActivitySeen,
    FootprintSeen,
    Gated,
    MemoryFreeSeen,
    SwapFinished,
    TenantAttached,
    TenantFaulted,
    Tick,
    Ungated,
)
from kiwid.core.model import GpuPolicy, SwapMode, TenantState
from kiwid.core.scheduler import Scheduler
from kiwid.daemon.control.status import summary_line
from kiwid.daemon.control.stuck import fault_json, held_back_json
from kiwid.daemon.control.waits import waiter_json

GiB = 2**30


class Card:
    """A scheduler on one GPU; gates take at once, swaps finish when told."""

    def __init__(self, **policy: Any) -> None:
        self.now = 100.0
        self.sched = Scheduler({"0": GpuPolicy(**{"tq_s": 30, "idle_release_s": 5, **policy})})
        self.swaps: list[Any] = []

    def do(self, event: Any) -> list[Any]:
        out: list[Any] = []
        todo = [event]
        while todo:
            actions = self.sched.handle(todo.pop(0), self.now)
            out += actions
            todo += [Gated(a.tenant, epoch=a.epoch) for a in actions if isinstance(a, Gate)]
            todo += [Ungated(a.tenant, epoch=a.epoch) for a in actions if isinstance(a, Ungate)]
            self.swaps += [a for a in actions if isinstance(a, SwapOut | SwapIn)]
        return out

    def burst(self, *names: str, size: int = GiB) -> None:
        for name in names:
            self.do(TenantAttached(name, frozenset({"0"})))
            self.do(FootprintSeen(name, "0", size))
            self.do(ActivitySeen(name))

    def waiters(self, allowance: float = 2.0) -> list[dict[str, Any]]:
        view = self.sched.view(self.now)
        gpus = {g.gpu: g for g in view.gpus}
        tenants = {t.tenant: t for t in view.tenants}
        gpu = gpus["0"]
        return [
            waiter_json(gpu, w, self.now, allowance, gpus=gpus, tenants=tenants)
            for w in gpu.waiters
        ]


def test_a_stuck_tenant_that_may_run_leaves_every_wait_on_its_gpu_unbounded() -> None:
    card = Card(idle_release_s=60)  # a keeps working
    card.burst("a", "b", "c")
    # the holder's quantum, the quanta ahead, one allowance
    assert [w["wait_bound_s"] for w in card.waiters()] == [32.0, 62.0]
    card.now += 31
    asked = card.sched.handle(Tick(), card.now)  # a's quantum is over: it is to be gated
    assert Gate("a") in asked
    gate = next(a for a in asked if a == Gate("a"))
    failed = TenantFaulted("a", "gate", "the freeze timed out", contained=False, epoch=gate.epoch)
    card.sched.handle(failed, card.now)
    view = card.sched.view(card.now)
    assert view.gpus[0].blocked_by == "a"
    waiters = card.waiters()
    assert waiters, "somebody still waits"
    for w in waiters:
        assert w["wait_bound_s"] is None
        assert w["wait_bound_reason"].startswith("a is stuck and may still run on GPU 0")
        assert "`kiwictl release a`" in w["wait_bound_reason"]
    stuck = next(t for t in view.tenants if t.tenant == "a")
    assert stuck.state is TenantState.STUCK and stuck.gate_failure == "the freeze timed out"
    reason = fault_json(stuck.fault, card.now)
    assert reason is not None
    assert (reason["operation"], reason["contained"], reason["mending"]) == ("gate", False, False)


def test_a_restore_short_of_memory_nobody_kiwid_knows_holds_leaves_no_bound() -> None:
    card = Card(swap=SwapMode.CHECKPOINT, capacity_bytes=10 * GiB, reserve_bytes=GiB)
    card.burst("a", "b", "c", size=3 * GiB)
    for swap in list(card.swaps):  # b and c go to host RAM while a holds
        card.do(SwapFinished(swap.tenant, "out", ok=True, moved_bytes=3 * GiB, epoch=swap.epoch))
    card.swaps.clear()
    assert all(w["wait_bound_s"] is not None for w in card.waiters())
    # The driver says 3 GiB are free where kiwid counts 7: something else holds 4.
    card.do(MemoryFreeSeen("0", 3 * GiB))
    waiters = card.waiters()
    assert [w["wait_bound_s"] for w in waiters] == [None, None]
    assert waiters[0]["wait_bound_reason"].startswith(
        "its own restore waits for free memory that no tenant kiwid knows holds"
    )
    assert "the driver reports 3.0 GiB free" in waiters[0]["wait_bound_reason"]
    assert waiters[1]["wait_bound_reason"].startswith(f"the restore of {waiters[0]['tenant']}")
    # Memory kiwid's own count explains is no reason: the rotation frees it.
    card.do(MemoryFreeSeen("0", 7 * GiB))
    assert all(w["wait_bound_s"] is not None for w in card.waiters())


def test_held_back_tenants_say_why_and_the_summary_names_the_stuck() -> None:
    card = Card()
    card.burst("a", "b")
    epoch = card.sched.epoch("b") or 0
    card.do(
        TenantFaulted("b", "swap-in", "restore of pid 7 failed", pid=7, answer="E (1)", epoch=epoch)
    )
    view = card.sched.view(card.now)
    tenants = {t.tenant: t for t in view.tenants}
    assert view.gpus[0].stuck == ("b",)
    assert held_back_json(view.gpus[0], tenants) == [
        {"tenant": "b", "waiting_for": "stuck (swap-in): restore of pid 7 failed"}
    ]
    gpu = {"id": "0", "tq": 30.0, "mode": "exclusive", "holder": {"tenant": "a"}, "waiters": []}
    assert summary_line({"gpus": [gpu]}) == "GPU 0: TQ 30 s, exclusive, holder a, 0 waiting"
    many = {**gpu, "stuck": ["b", "c", "d", "e"]}
    assert summary_line({"gpus": [many]}) == (
        "GPU 0: TQ 30 s, exclusive, holder a, 0 waiting, 4 stuck (b, c, d and 1 more)"
    )
