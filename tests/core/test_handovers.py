"""Oversubscribed hand-overs: prefetch that fits the quantum, safe restores, known workloads.

The figures of the H200 run (3 x 51.3 GiB with contexts on a 140.4 GiB card,
checkpoints at 2.3 GB/s, restores at 6.3 GB/s, TQ 30 s) on a card whose swaps
take their time (:class:`~tests.core.timed_card.TimedCard`).
"""

from __future__ import annotations

import pytest

from kiwid.core.actions import SwapIn, SwapOut, Ungate
from kiwid.core.events import MemoryFreeSeen, SwapFinished, TenantUnswappable
from kiwid.core.model import Newcomer, SwapMode, TenantState
from kiwid.core.residency import Residency
from tests.core.timed_card import GiB, TimedCard

S = TenantState
TENANT_GIB = 51.3


def three_tenants(card: TimedCard) -> None:
    for name in ("a", "b", "c"):
        card.join(name, TENANT_GIB)


def steady_from(card: TimedCard) -> float:
    """When every tenant has held once (the steady rotation starts)."""
    first: dict[str, float] = {}
    for tenant, start, _ in card.turns():
        first.setdefault(tenant, start)
    assert len(first) == len(card.sizes), f"not every tenant ran: {card.turns()}"
    return max(first.values())


def test_a_steady_hand_over_only_moves_the_gate() -> None:
    card = TimedCard()
    three_tenants(card)
    card.run(600)
    since = steady_from(card)
    stalls = card.stalls(since)
    assert len(stalls) >= 10
    # Each checkpoint (24 s) and restore (8.7 s) together take longer than a
    # quantum: the holder works on until the next one is back, so no hand-over
    # waits for memory.
    assert stalls == [0.0] * len(stalls)
    turns = [t for t in card.turns() if t[1] >= since]
    assert all(card.tq <= end - start <= 2 * card.tq for _, start, end in turns)
    # Round-robin all the same.
    order = [tenant for tenant, _, _ in turns]
    assert all(order[i] != order[i + 1] for i in range(len(order) - 1))
    assert {order.count(t) for t in "abc"} <= {len(order) // 3, len(order) // 3 + 1}


def test_the_card_never_holds_more_than_it_has() -> None:
    card = TimedCard()
    three_tenants(card)  # all three allocated at once: over the card until two leave
    card.run(60)
    peak = 0
    for _ in range(600):
        card.run(1)
        peak = max(peak, sum(card.on_card.values()))
    assert peak <= card.policy.capacity_bytes - card.policy.reserve_bytes
    assert len(card.restores) >= 10
    # Every restore, the first two too (they run once the over-full start has been
    # checkpointed): the driver's last reading had its bytes and the reserve free.
    for tenant, free in card.restores:
        assert free >= card.sizes[tenant] + card.policy.reserve_bytes


def test_a_stuck_restore_keeps_the_holder_one_more_tq_at_most() -> None:
    card = TimedCard()
    three_tenants(card)
    card.run(400)
    stuck_at = card.clock.now()
    card.stuck.update(card.sizes)  # the next restore never ends
    card.run(4 * card.tq)
    after = [end - start for _, start, end in card.turns() if end > stuck_at]
    assert after, "nobody yielded"
    assert max(after) == pytest.approx(2 * card.tq)  # its quantum, then one more TQ


def test_a_restore_waits_while_the_driver_shows_too_little_free_memory() -> None:
    def run(readings: bool) -> TimedCard:
        card = TimedCard(
            foreign=40 * GiB, readings=readings, watch_status=True
        )  # memory nobody shows
        three_tenants(card)
        card.run(60)  # two of them leave the card
        card.restores.clear()
        card.run(300)
        return card

    card = run(readings=True)
    assert any(text.startswith("waiting for free memory on GPU 0") for text in card.seen)
    assert any("memory.reserve_mib" in text for text in card.seen)
    assert len(card.restores) >= 5
    for tenant, free in card.restores:
        assert free >= card.sizes[tenant] + card.policy.reserve_bytes
    # Counting only what it knows, the scheduler would restore into memory that is not there.
    blind = run(readings=False)
    assert min(free - blind.sizes[t] for t, free in blind.restores) < 0


def test_a_holder_waiting_for_free_memory_steps_aside_after_a_tq() -> None:
    card = TimedCard(foreign=115 * GiB, watch_status=True)  # 25 GiB left: neither fits
    card.join("a", 30)
    card.join("b", 30)
    card.run(200)
    assert any(text.endswith("It tries again at its turn after 30 s") for text in card.seen)
    assert any("for 30 s" in text for text in card.seen)
    restores = len(card.restores)
    card.foreign = 0  # the other user leaves
    card.run(120)
    assert len(card.restores) > restores
    assert {tenant for tenant, _, _ in card.turns()} == {"a", "b"}


def test_a_restore_refused_by_the_shell_waits_without_penalty() -> None:
    card = TimedCard(stuck={"a", "b", "c"})  # the first restore stays in flight
    three_tenants(card)
    card.run(120)
    victim = next(iter(card.inflight))
    assert card.sched.residency(victim) in (Residency.SWAPPING_IN, Residency.PREFETCHING)
    # The shell's own check (a fresh reading) refused it before it started.
    del card.inflight[victim]
    card.on_card.pop(victim)
    card.stuck.clear()
    refused = "waiting for free memory on GPU 0: the driver reports 2.0 GiB free"
    card.do(MemoryFreeSeen("0", 2 * GiB))  # the shell's fresh reading comes first
    epoch = card.sched.epoch(victim) or 0
    card.do(SwapFinished(victim, "in", ok=False, reason=refused, deferred=True, epoch=epoch))
    assert card.sched.residency(victim) is Residency.HOST
    view = {t.tenant: t for t in card.sched.view(card.clock.now()).tenants}
    assert (view[victim].waiting_for or "").startswith("waiting for free memory on GPU 0")
    # No retry penalty: the next reading with room brings it back at once.
    asked = card.clock.now()
    card.do(MemoryFreeSeen("0", card.free()))
    assert card.at(SwapIn(victim), after=asked - 1e-9) == asked


def test_a_known_workload_comes_back_like_a_steady_tenant() -> None:
    def first_turn(remember: bool) -> tuple[float, int]:
        card = TimedCard()
        card.join("a", TENANT_GIB)
        card.join("b", TENANT_GIB)
        card.run(200)
        joined = card.clock.now()
        card.join("c", TENANT_GIB, remembered=int(TENANT_GIB * GiB) if remember else None)
        card.run(200)
        first = next(start for tenant, start, _ in card.turns() if tenant == "c")
        before = max(end for _, _, end in card.turns() if end <= first)
        outs = sum(1 for t, a in card.log if isinstance(a, SwapOut) and joined <= t <= first)
        return first - before, outs

    known_stall, _ = first_turn(remember=True)
    new_stall, new_outs = first_turn(remember=False)
    assert known_stall == 0.0  # prefetched like any steady hand-over
    assert new_stall > 20  # a newcomer gets the whole card: everyone out, then back
    assert new_outs >= 2


def test_newcomer_free_takes_only_what_it_showed() -> None:
    whole = TimedCard(swap=SwapMode.AUTO)
    free = TimedCard(swap=SwapMode.AUTO, newcomer=Newcomer.FREE)
    for card in (whole, free):
        card.join("a", 30)
        card.join("b", 30)
        card.run(60)
    outs = {
        "whole": sum(isinstance(a, SwapOut) for _, a in whole.log),
        "free": sum(isinstance(a, SwapOut) for _, a in free.log),
    }
    # 30 + 30 GiB fit: a newcomer that takes only what it showed moves nothing.
    assert outs == {"whole": outs["whole"], "free": 0}
    assert outs["whole"] >= 1


def test_an_unswappable_tenant_stays_on_the_card_and_the_rotation_goes_on() -> None:
    card = TimedCard()
    for name in ("a", "b", "c"):
        card.join(name, 45)
    card.do(TenantUnswappable("b", "it uses NCCL across processes"))
    card.run(600)
    assert not any(a == SwapOut("b") for _, a in card.log[3:])
    view = {t.tenant: t for t in card.sched.view(card.clock.now()).tenants}
    assert view["b"].swap_refusal == "it uses NCCL across processes"
    ran = {tenant for tenant, _, _ in card.turns()}
    assert ran == {"a", "b", "c"}
    assert {sum(1 for t, _, _ in card.turns() if t == x) for x in "abc"} != {0}
    assert card.free() >= 0


def test_a_checkpoint_the_driver_refuses_for_good_pins_the_tenant() -> None:
    card = TimedCard(refuse={"b"})
    card.join("a", 30)
    card.join("b", 30)
    card.run(300)
    assert [a for _, a in card.log].count(SwapOut("b")) == 1  # asked once, never again
    view = {t.tenant: t for t in card.sched.view(card.clock.now()).tenants}
    assert view["b"].swap_refusal == "the driver cannot checkpoint it"
    assert any(a == Ungate("b") for _, a in card.log)
    assert any(a == SwapOut("a") for _, a in card.log)


def test_free_memory_readings_alone_never_move_anyone() -> None:
    card = TimedCard()
    card.join("a", 30)
    before = list(card.log)
    for free in (GiB, 100 * GiB, 10 * GiB):
        card.do(MemoryFreeSeen("0", free))
    assert card.log == before
