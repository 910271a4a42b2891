"""The tenant tracker: announced containers expire by themselves once gone."""

from __future__ import annotations

import logging
import os

import pytest

from kiwid.daemon.tenants.tracker import Hidden, Identity, Registration, TenantTracker
from kiwid.linux.proc import read_stat

ME = os.getpid()


def start_of_me() -> int:
    stat = read_stat(ME)
    assert stat is not None
    return stat.start_ticks


def tracker_with(start: int | None, occupied: bool) -> TenantTracker:
    """A tracker with one container registered with this very process."""
    tracker = TenantTracker(lambda pid: None, occupied=lambda ident: occupied)
    ident = Identity("cgroup:/c", "cgroup", "c", cgroup_v2="/c", dedicated=True)
    tracker.register(Registration("c1", ident, frozenset({"0"}), frozenset({ME}), {ME: start}))
    tracker.observe([], 0.0)
    return tracker


def test_a_live_registered_process_keeps_its_container() -> None:
    tracker = tracker_with(start_of_me(), occupied=False)
    assert "cgroup:/c" in tracker.registered and "cgroup:/c" in tracker.tenants


def test_a_reused_pid_is_another_process_and_the_container_expires(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="kiwid"):
        tracker = tracker_with(start_of_me() + 1, occupied=False)
    assert tracker.registered == {} and tracker.tenants == {}
    (line,) = [r.getMessage() for r in caplog.records if "poststop" in r.getMessage()]
    assert "c1 (cgroup:/c)" in line and str(ME) in line


def test_a_cgroup_that_still_holds_a_process_keeps_its_container() -> None:
    tracker = tracker_with(start_of_me() + 1, occupied=True)
    assert "cgroup:/c" in tracker.registered and "cgroup:/c" in tracker.tenants


@pytest.mark.parametrize(("offset", "kept"), [(0, True), (1, False)])
def test_a_tenant_in_host_ram_is_kept_only_while_its_very_process_runs(
    offset: int, kept: bool
) -> None:
    ident = Identity("pid:me", "process", "me")
    tracker = TenantTracker(lambda pid: ident if pid == ME else None)
    hidden = Hidden(frozenset({ME}), frozenset({"0"}), {ME: start_of_me() + offset})
    tracker.observe([], 0.0, hidden={"cgroup:/swapped": hidden})
    assert ("cgroup:/swapped" in tracker.tenants) is kept
