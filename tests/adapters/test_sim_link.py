"""The simulated link: each direction at its own rate, shared within a direction."""

from __future__ import annotations

import threading

import pytest

from kiwid.adapters.sim.link import Link

GB = 1e9


def test_one_transfer_takes_bytes_over_rate() -> None:
    link = Link({"out": 2 * GB, "in": 5 * GB})
    t = link.start(0, "out", int(10 * GB), now=100.0)
    assert link.finish_at(t) == pytest.approx(105.0)


def test_a_checkpoint_and_a_restore_do_not_slow_each_other() -> None:
    link = Link({"out": 2 * GB, "in": 5 * GB})
    out = link.start(0, "out", int(10 * GB), now=0.0)
    back = link.start(0, "in", int(10 * GB), now=0.0)
    assert link.finish_at(out) == pytest.approx(5.0)
    assert link.finish_at(back) == pytest.approx(2.0)


def test_transfers_one_way_share_its_rate() -> None:
    link = Link({"out": 2 * GB, "in": 5 * GB})
    a = link.start(0, "out", int(10 * GB), now=0.0)
    b = link.start(0, "out", int(10 * GB), now=0.0)
    assert link.finish_at(a) == link.finish_at(b) == pytest.approx(10.0)  # each at 1 GB/s
    # Halfway, a third joins: 5 GB left each, now at 2/3 GB/s.
    link.advance(5.0)
    c = link.start(0, "out", int(1 * GB), now=5.0)
    assert link.finish_at(c) == pytest.approx(6.5)
    link.advance(6.5)
    assert link.done(c)
    link.end(c, 6.5)
    # a and b moved 1 GB each meanwhile: 4 GB left at 1 GB/s each.
    assert link.finish_at(a) == pytest.approx(10.5)


def test_links_of_different_gpus_are_apart() -> None:
    link = Link({"out": 2 * GB, "in": 5 * GB})
    a = link.start(0, "out", int(10 * GB), now=0.0)
    link.start(1, "out", int(10 * GB), now=0.0)
    assert link.finish_at(a) == pytest.approx(5.0)


def test_bad_rates_and_directions_are_refused() -> None:
    with pytest.raises(ValueError, match="'in' rate"):
        Link({"out": 1.0, "in": 0.0})
    with pytest.raises(ValueError, match="direction"):
        Link({"out": 1.0, "in": 1.0}).start(0, "sideways", 1, now=0.0)


def test_transfer_blocks_until_the_model_says_and_frees_the_link() -> None:
    now = [0.0]
    link = Link({"out": 1e6, "in": 1e6}, clock=lambda: now[0])
    finished = threading.Event()

    def run() -> None:
        link.transfer({0: 1000}, "out")
        finished.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert not finished.wait(0.05)  # the clock stands still: nothing moves
    now[0] = 0.002  # past 1000 bytes at 1 MB/s
    thread.join(5)
    assert finished.is_set()
    assert link._active == {}
