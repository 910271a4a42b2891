"""At start: re-adopt what a previous kiwid (crash, SIGKILL, restart) left gated.

The records of the state file are checked against what runs now: tenants gated
another way than this daemon gates, or gone, are let go at once
(:mod:`kiwid.daemon.gating.recovery`); the others are queued again, gated, by the
scheduler, which gives running tenants ``idle_release`` seconds to show their
activity first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kiwid.adapters import procs
from kiwid.core.events import ActivitySeen, Event, TenantAdopted
from kiwid.daemon.context import Context
from kiwid.daemon.gating.recovery import release_all, report_skipped, undo_with
from kiwid.daemon.gating.state import GatedRecord, StateError

log = logging.getLogger("kiwid.recovery")


def readopt(ctx: Context, poll: Callable[[Context], list[Event]]) -> None:
    """At start: re-adopt what a previous kiwid (crash, SIGKILL, restart) left gated.

    Tenants gated another way than this daemon gates, or gone, are let go at once;
    the others are queued again, gated, by the scheduler (which gives running
    tenants ``idle_release`` seconds to show their activity first). ``poll`` is
    the first poll, which attaches the tenants (those in host RAM too).
    """
    engine, state = ctx.engine, ctx.state
    try:
        records = state.load()
    except StateError as err:
        aside = state.set_aside()
        where = f"; moved to {aside}" if aside else ""
        log.error("Ignoring the state file: %s%s", err, where)
        records = {}
    report_skipped(state)
    if state.skipped:
        state.replace_all(records)
    undo = undo_with(state.dir, engine.effects.gate, engine.effects.swapper)
    foreign = [r for r in records.values() if r.method != engine.effects.gate.method]
    previous = ", left gated by a previous kiwid"
    release_all(state, foreign, undo, previous)
    engine.apply([ctx.configured()])
    # The first poll attaches the tenants (those in host RAM too). They are adopted
    # before any activity of this poll is applied: a gated tenant shows none, and
    # one that does (its gate gone meanwhile) then holds in its turn.
    first = poll(ctx)
    engine.apply([e for e in first if not isinstance(e, ActivitySeen)])
    adopted: list[GatedRecord] = []
    gone: list[GatedRecord] = []
    for key, record in state.records.items():
        (adopted if key in engine.tracker.tenants else gone).append(record)
    for record in gone:
        _say_if_reused(record)
    release_all(state, gone, undo, previous)
    engine.apply([TenantAdopted(r.tenant, r.swapped) for r in adopted])
    engine.apply([e for e in first if isinstance(e, ActivitySeen)])
    for record in adopted:
        where = "its memory is in host RAM; " if record.swapped else ""
        log.info("Re-adopted %s: %sit waits for its turn", record.tenant, where)
    if not state.records:
        state.clear()


def _say_if_reused(record: GatedRecord) -> None:
    """Log the recorded pids that another process has taken since (its start differs).

    Such a record is not re-adopted: the process is not the tenant, and is left
    alone (a swapped record is dropped with its host memory, nothing is restored
    into it).
    """
    reused = [
        pid
        for pid, start in record.pid_starts().items()
        if procs.alive(pid) and not procs.alive(pid, start)
    ]
    for pid in reused:
        log.info(
            "Not re-adopting %s: pid %d is another process now (its start time is not "
            "the recorded one)",
            record.tenant,
            pid,
        )
