"""``retry`` and ``release``: an operator's word on a stuck tenant.

A tenant is stuck when an operation on it failed for good, ran past its deadline
(``gpu.driver_timeout``) or left the driver out of step; it waits for an operator
while the others rotate. ``retry`` tries again (the engine mends it, or it stays
stuck with the new reason); a retry of a released tenant brings it back into the
rotation. ``release`` lets it run ungated, outside the rotation. Both answer once
the engine has carried the request out (or after a bound: it goes on, and status
shows how it ends), never blocking the event loop meanwhile. A tenant's jobs run
one at a time, also past a deadline: while a driver call of it hangs, the
operator's word waits behind it (the tenant is fenced meanwhile where it may
run), and the answer says so at once (``queued_behind``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kiwid.adapters.control import ControlError, Peer
from kiwid.core.events import ReleaseAsked, RetryAsked
from kiwid.core.model import TenantState
from kiwid.core.residency import Residency
from kiwid.core.view import TenantView
from kiwid.daemon.context import Context
from kiwid.daemon.control.stuck import fault_json

log = logging.getLogger("kiwid")

S = TenantState
GRACE_S = 5.0
"""Beyond twice ``gpu.driver_timeout``, how long an answer waits for the outcome."""
POLL_S = 0.02
"""How often the outcome is looked for (only a change of the engine's generation
makes it read the scheduler again)."""

_NOT_STUCK = {
    S.IDLE: "it runs free until its next GPU work",
    S.WAITING: "kiwid lets it go at its turn",
    S.HOLDER: "it holds its GPU now",
    S.CORUNNING: "it runs ungated beside others: its GPUs do not gate now",
    S.PARKED: "it is parked, idle in host RAM, until a request or `kiwictl wake`",
}


async def retry(ctx: Context, tenant: str, peer: Peer) -> dict[str, Any]:
    """Try a stuck tenant again, or bring a released one back into the rotation.

    A tenant's jobs run one at a time: while a driver call of it hangs, the retry
    waits behind it, and the answer says so at once.

    Raises:
        ControlError: ``invalid-value``: an unknown tenant, one neither stuck nor
            released, or one whose retry or release is under way.
    """
    _judge(ctx, tenant, "retry", (S.STUCK, S.RELEASED))
    ctx.engine.apply([RetryAsked(tenant)])
    return await _outcome(ctx, tenant, "retry", peer)


async def release(ctx: Context, tenant: str, peer: Peer) -> dict[str, Any]:
    """Let a stuck tenant run ungated, outside the rotation, on the operator's word.

    As a retry, it waits behind a driver call of the tenant that hangs.

    Raises:
        ControlError: ``invalid-value``: an unknown tenant, one that is not stuck,
            or one whose retry or release is under way.
    """
    _judge(ctx, tenant, "release", (S.STUCK,))
    ctx.engine.apply([ReleaseAsked(tenant)])
    return await _outcome(ctx, tenant, "release", peer)


def _view(ctx: Context, tenant: str) -> TenantView | None:
    return next(
        (t for t in ctx.engine.scheduler.view(ctx.clock()).tenants if t.tenant == tenant), None
    )


def _judge(ctx: Context, tenant: str, asked: str, allowed: tuple[TenantState, ...]) -> TenantView:
    """The tenant's view if ``asked`` may be done to it now; else refuse, saying why."""
    view = _view(ctx, tenant)
    if view is None:
        raise ControlError(
            "invalid-value",
            f"no tenant {tenant!r} (a tenant id as `kiwictl tenants` lists them; kiwictl "
            f"{asked} also takes a name, pod, container id or pid)",
        )
    if view.state not in allowed:
        if view.state is S.RELEASED:
            why = (
                f"{tenant} is released already: it runs ungated, outside the rotation; "
                f"`kiwictl retry {tenant}` brings it back"
            )
        else:
            why = f"{tenant} is {view.state.value}, not stuck: {_NOT_STUCK[view.state]}"
        raise ControlError("invalid-value", why)
    if view.fault is not None and view.fault.mending:
        raise ControlError(
            "invalid-value",
            f"a retry or release of {tenant} is under way already; `kiwictl status` shows "
            "how it ends",
        )
    return view


def _settled(view: TenantView | None) -> bool:
    """Whether the engine has answered: no retry or release of it runs, no gate is pending."""
    if view is None or view.fault is None:
        return True
    return not view.fault.mending and not view.gate_pending


async def _outcome(ctx: Context, tenant: str, asked: str, peer: Peer) -> dict[str, Any]:
    """Wait (bounded, asynchronously) for the engine's answer; say where the tenant stands.

    Behind a hung driver call of the tenant it does not wait: it says what it waits for.
    """
    engine = ctx.engine
    started = ctx.clock()
    deadline = started + 2 * ctx.settings.gpu.driver_deadline_s + GRACE_S
    hung = engine.hung(tenant)
    seen = -1
    view = None
    while hung is None:
        if engine.generation != seen:
            seen = engine.generation
            view = _view(ctx, tenant)
            if _settled(view):
                break
        if ctx.clock() >= deadline:
            break
        await asyncio.sleep(POLL_S)
    now = ctx.clock()
    if hung is not None:
        view = _view(ctx, tenant)
    pending = not _settled(view)
    answer = {
        "tenant": tenant,
        "asked": asked,
        "state": view.state.value if view is not None else "gone",
        "residency": view.residency.value if view is not None else None,
        "stuck_reason": fault_json(view.fault, now) if view is not None else None,
        "released": view.released_note if view is not None and view.state is S.RELEASED else None,
        "waiting_for": view.waiting_for if view is not None else None,
        "pending": pending,
        "seconds": round(now - started, 3),
        "queued_behind": None if hung is None else _behind(hung[0].kind.value, hung[1], now),
    }
    info = engine.tracker.tenants.get(tenant)
    name = info.identity.name if info is not None else tenant
    who = f"{name} ({tenant})" if name != tenant else tenant
    said = _said(view, pending, now - started)
    if hung is not None:
        said = f"queued behind its {hung[0].kind.value}, whose call has not returned"
    log.info("Operator %s of %s by uid %d: %s", asked, who, peer.uid, said)
    return answer


def _behind(job: str, started: float, now: float) -> dict[str, Any]:
    """What an operator's word waits behind: a job whose driver call hangs, since when."""
    return {
        "job": job,
        "since_unix": round(time.time() - (now - started), 3),
        "seconds": round(now - started, 3),
    }


def _said(view: TenantView | None, pending: bool, seconds: float) -> str:
    """The outcome in words, for the log line."""
    if view is None:
        return "it left meanwhile"
    if pending:
        return f"still under way after {seconds:.0f} s (status shows how it ends)"
    if view.state is S.STUCK and view.fault is not None:
        return f"still stuck ({view.fault.operation}): {view.fault.reason}"
    if view.state is S.RELEASED:
        note = view.released_note or "nothing to say"
        return f"released ({note}): it runs ungated, outside the rotation"
    if view.state is S.IDLE:
        return "back in the rotation: it queues at its next GPU work"
    return f"mended: {view.state.value}, its memory {where(view.residency)}"


def where(residency: Residency) -> str:
    """Where a mended tenant's memory is, in words."""
    if residency.on_card:
        return "on the card"
    return "in host RAM" if residency is Residency.HOST else f"{residency.value}"
