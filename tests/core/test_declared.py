"""Tenants that declare their GPU memory: how the core sizes, fits and brings them back.

A declaration (``TenantPolicy.memory_bytes``) stands for what a tenant will use
before anyone saw it run: its first turn makes room for that much (never the whole
card), it is prefetched like a steady tenant, and in ``auto`` mode it decides who
fits together. A larger footprint, seen or remembered, always wins over it.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kiwid.core.actions import SwapOut
from kiwid.core.events import (
    ActivitySeen,
    FootprintRemembered,
    FootprintSeen,
    TenantAttached,
    TenantPolicySet,
)
from kiwid.core.model import GpuPolicy, Mode, Newcomer, SwapMode, TenantPolicy, TenantState
from kiwid.core.scheduler import Scheduler
from kiwid.core.tenant import Memory, TenantRecord
from tests.core.timed_card import GiB, TimedCard

S = TenantState


def outs_before_first_turn(card: TimedCard, name: str, since: float) -> int:
    """Swap-outs of others asked between ``since`` and ``name``'s first let-go."""
    first = next(start for tenant, start, _ in card.turns() if tenant == name)
    return sum(
        1
        for t, a in card.log
        if isinstance(a, SwapOut) and a.tenant != name and since <= t <= first
    )


def test_a_declared_newcomer_evicts_only_what_its_declaration_needs() -> None:
    def outs(declared: float | None, newcomer: Newcomer = Newcomer.WHOLE_CARD) -> int:
        card = TimedCard(swap=SwapMode.AUTO, newcomer=newcomer)
        card.join("a", 45)
        card.join("b", 45)
        card.run(100)  # both known now, and 90 GiB fit on the 139.4 GiB left: both stay
        assert set(card.on_card) == {"a", "b"} and not card.inflight
        joined = card.clock.now()
        card.join("c", 5, declared=declared)  # shows 5 GiB so far
        card.run(200)
        return outs_before_first_turn(card, "c", joined)

    assert outs(None) == 2  # a newcomer nobody knows: the whole card, both go
    assert outs(60) == 1  # 45 + 45 + 60 > 139.4: one of them makes room
    assert outs(40) == 0  # 45 + 45 + 40 fit: nobody moves
    assert outs(60, Newcomer.FREE) == 1  # "free" gives it what it declared, not what it showed


def test_a_declared_newcomer_comes_back_like_a_steady_tenant() -> None:
    def first_stall(declared: float | None) -> float:
        card = TimedCard()  # checkpoint: every waiter's memory goes to host RAM
        card.join("a", 47.5)
        card.join("b", 47.5)
        card.run(200)
        card.join("c", 47.5, declared=declared)
        card.run(200)
        first = next(start for tenant, start, _ in card.turns() if tenant == "c")
        return first - max(end for _, _, end in card.turns() if end <= first)

    assert first_stall(47.5) == 0.0  # prefetched before its turn: the hand-over moves the gate
    assert first_stall(None) > 20  # the whole card: everyone out first, then its turn


def test_the_largest_of_declared_seen_and_remembered_sizes_a_tenant() -> None:
    def size(declared: int | None, peak: int = 0, footprint: int = 0, remembered: int = 0) -> int:
        record = TenantRecord("t", frozenset({"0"}), 0, memory=Memory(remembered=remembered))
        record.cls.set_policy(TenantPolicy(memory_bytes=declared))
        record.memory.peak["0"], record.memory.footprint["0"] = peak, footprint
        return record.size("0")

    assert size(40 * GiB) == 40 * GiB  # nothing seen yet: the declaration
    assert size(40 * GiB, footprint=5 * GiB) == 40 * GiB  # it may still grow to it
    assert size(40 * GiB, peak=52 * GiB, footprint=30 * GiB) == 52 * GiB  # grew past it
    assert size(40 * GiB, remembered=60 * GiB) == 60 * GiB  # an earlier run needed more
    assert size(None, peak=7 * GiB) == 7 * GiB


sizes = st.integers(0, 200 * GiB)


@given(declared=st.one_of(st.none(), st.integers(1, 200 * GiB)), peak=sizes, seen=sizes, kept=sizes)
def test_a_declaration_never_shrinks_a_known_footprint(
    declared: int | None, peak: int, seen: int, kept: int
) -> None:
    record = TenantRecord("t", frozenset({"0"}), 0, memory=Memory(remembered=kept, known=True))
    record.cls.set_policy(TenantPolicy(memory_bytes=declared))
    record.memory.peak["0"], record.memory.footprint["0"] = peak, seen
    assert record.size("0") == max(peak, seen, kept, declared or 0)
    assert record.held("0") == max(peak, seen, kept)  # what a swap-out moves


def auto_card(*declared: int | None) -> Scheduler:
    """An ``auto`` 80 GiB card with tenants showing 10 GiB each, all bursting."""
    policy = GpuPolicy(mode=Mode.AUTO, capacity_bytes=80 * GiB, reserve_bytes=GiB)
    sched = Scheduler({"0": policy})
    for i, nbytes in enumerate(declared):
        name = f"t{i}"
        sched.handle(TenantAttached(name, frozenset({"0"})), 0.0)
        sched.handle(TenantPolicySet(name, TenantPolicy(memory_bytes=nbytes)), 0.0)
        sched.handle(FootprintSeen(name, "0", 10 * GiB), 0.0)
        sched.handle(ActivitySeen(name), 0.0)
    return sched


def test_in_auto_mode_declarations_decide_who_fits_together() -> None:
    states = {t.tenant: t.state for t in auto_card(None, None).view(0.0).tenants}
    assert states == {"t0": S.CORUNNING, "t1": S.CORUNNING}  # 20 GiB seen: they fit
    states = {t.tenant: t.state for t in auto_card(30 * GiB, 30 * GiB).view(0.0).tenants}
    assert states == {"t0": S.CORUNNING, "t1": S.CORUNNING}  # 60 GiB declared: they fit
    states = {t.tenant: t.state for t in auto_card(50 * GiB, 50 * GiB).view(0.0).tenants}
    assert sorted(states.values()) == [S.HOLDER, S.WAITING]  # 100 GiB declared: they take turns


def test_a_remembered_footprint_beyond_the_declaration_sizes_the_first_turn() -> None:
    card = TimedCard(swap=SwapMode.AUTO)
    card.join("a", 45)
    card.join("b", 45)
    card.run(100)
    joined = card.clock.now()
    card.do(TenantAttached("c", frozenset({"0"})))
    card.do(TenantPolicySet("c", TenantPolicy(memory_bytes=40 * GiB)))
    card.do(FootprintRemembered("c", 60 * GiB))  # its last run peaked at 60 GiB
    card.join("c", 5)
    card.run(200)
    assert outs_before_first_turn(card, "c", joined) == 1  # room for 60, not for 40


# ---------------------------------------------------------------- properties

tenant_specs = st.lists(
    st.tuples(
        st.one_of(st.none(), st.integers(1, 139)),  # declared GiB (None: none)
        st.integers(1, 139),  # GiB it shows when it appears
        st.one_of(st.none(), st.integers(1, 139)),  # GiB it grows to on its first turn
    ),
    min_size=2,
    max_size=5,
)


@settings(max_examples=80, deadline=None)
@given(
    swap=st.sampled_from([SwapMode.CHECKPOINT, SwapMode.AUTO]),
    newcomer=st.sampled_from(list(Newcomer)),
    specs=tenant_specs,
    gaps=st.lists(st.floats(0.0, 40.0), min_size=5, max_size=5),
)
def test_no_tenant_is_let_go_where_declared_and_resident_memory_exceed_the_card(
    swap: SwapMode,
    newcomer: Newcomer,
    specs: list[tuple[int | None, int, int | None]],
    gaps: list[float],
) -> None:
    """At every let-go, what is on the card, each tenant counted at the largest of what
    it declared, uses and was seen using, fits the card less its reserve: no
    declaration shrinks a footprint, no footprint hides a declaration."""
    card = TimedCard(tq=10.0, swap=swap, newcomer=newcomer)
    room = card.policy.capacity_bytes - card.policy.reserve_bytes
    grown: set[str] = set()
    grows = {f"t{i}": g for i, (_, _, g) in enumerate(specs) if g is not None}

    def check(tenant: str) -> None:
        on_card = {
            name: max(used, card.declared.get(name, 0), card.peaks.get(name, 0))
            for name, used in card.on_card.items()
        }
        assert sum(on_card.values()) <= room, (tenant, on_card, room)

    card.on_ungate = check
    for i, (declared, shows, _) in enumerate(specs):
        card.join(f"t{i}", shows, declared=declared)
        card.run(gaps[i])
        for name in sorted(card.running & set(grows) - grown):  # it allocates once let go
            grown.add(name)
            card.grow(name, grows[name])
    card.run(300)
    held = {t.tenant for t in card.sched.view(card.clock.now()).tenants if t.ledger.quanta}
    assert len(held) >= 2, card.log  # they rotated (the first holder may never have been gated)
