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
from dataclasses import replace

from kiwid.adapters import procs
from kiwid.core.events import ActivitySeen, Event, TenantAdopted, TenantFaulted
from kiwid.core.residency import Residency
from kiwid.daemon.context import Context
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.gating.recovery import release_all, report_skipped, undo_with
from kiwid.daemon.gating.state import StateError
from kiwid.daemon.gating.swap import Placement

log = logging.getLogger("kiwid.recovery")


def readopt(ctx: Context, poll: Callable[[Context], list[Event]]) -> None:
    """At start: re-adopt what a previous kiwid (crash, SIGKILL, restart) left gated.

    Tenants gated another way than this daemon gates, or gone, are let go at once;
    the others are queued again, gated, by the scheduler (which gives running
    tenants ``idle_release`` seconds to show their activity first). Each is told
    where the driver has its memory, not only what the record says: a kiwid
    killed before its checkpoint began left the memory on the card, one killed
    half-way left it split (stuck until an operator retries). A tenant recorded
    stuck stays stuck. ``poll`` is the first poll, which attaches the tenants
    (those in host RAM too).

    A state file that cannot be read at all is set aside for the operator, and
    every tenant this daemon's gate holds now (a frozen cgroup, a locked process)
    is adopted as if it had been recorded: nobody but kiwid gates tenants here, so
    they are the tenants the file listed, and they get their turns again.
    """
    engine, state = ctx.engine, ctx.state
    unreadable = False
    try:
        records = state.load()
    except StateError as err:
        aside = state.set_aside()
        ctx.state_trouble = f"{err}" + (f"; set aside as {aside}" if aside else "")
        log.error("Cannot use the state file: %s", ctx.state_trouble)
        records, unreadable = {}, True
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
    events: list[Event] = []
    for record in adopted:
        events += _adopt(ctx, record)
    if unreadable:
        events += _orphans(ctx)
    engine.apply(events)
    engine.apply([e for e in first if isinstance(e, ActivitySeen)])
    state.remove_if_empty()  # a gate of the first poll's may be recording its tenant now


def _adopt(ctx: Context, record: GatedRecord) -> list[Event]:
    """What the scheduler hears of a recorded tenant: adopted, where the driver says."""
    tools = ctx.engine.effects.tools
    try:
        placement = tools.placement(record)
    except Exception as err:  # noqa: BLE001 - a driver that fails here tells nothing
        placement = Placement(Residency.UNKNOWN, False, f"its state cannot be read: {err}")
    swapped = record.swapped
    if swapped and placement.on_card_gated:
        # Killed after the write-ahead, before (or undone after) the checkpoint.
        log.info("%s: recorded in host RAM, yet all of it is on the card", record.tenant)
        ctx.state.put(replace(record, swapped=None, swap_method=None))
        swapped = None
    events: list[Event] = [TenantAdopted(record.tenant, swapped)]
    epoch = ctx.engine.scheduler.epoch(record.tenant) or 0  # (an adoption moves none)
    where = "its memory is in host RAM; " if swapped else ""
    log.info("Re-adopted %s: %sit waits for its turn", record.tenant, where)
    odd = placement.where is Residency.UNKNOWN or placement.runs
    if odd or (placement.where is Residency.HOST and not swapped):
        reason = f"a previous kiwid left it out of step with the driver: {placement.detail}"
        events.append(
            TenantFaulted(
                record.tenant, "adopt", reason, placement.where, not placement.runs, epoch=epoch
            )
        )
    elif record.fault is not None:
        fault = record.fault
        events.append(
            TenantFaulted(
                record.tenant,
                fault.operation,
                f"{fault.reason} (recorded before kiwid restarted)",
                None,
                True,
                fault.pid,
                fault.answer,
                epoch=epoch,
            )
        )
    return events


def _orphans(ctx: Context) -> list[Event]:
    """Adopt the tenants this daemon's gate holds now, though no record names them."""
    gate, state = ctx.engine.effects.gate, ctx.state
    events: list[Event] = []
    for key, info in sorted(ctx.engine.tracker.tenants.items()):
        if key in state.records or not gate.holds(info):
            continue
        try:
            state.put(gate.prepare(info))
        except Exception as err:  # noqa: BLE001 - one orphan's trouble strands no other
            log.error("Cannot record %s, found gated without a record: %s", key, err)
            continue
        log.warning("Adopted %s: it was gated, and the unreadable state file named it", key)
        events.append(TenantAdopted(key, None))
    return events


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
