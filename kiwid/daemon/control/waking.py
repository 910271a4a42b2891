"""``wake``: a parked tenant joins the queue on an operator's or a router's word.

A parked tenant is idle with its memory in host RAM (kiwid.core.parking); kiwid
wakes it by itself when a request waits on one of its sockets. A gateway that
knows a request is coming for a model (before any connection reaches the model's
server) wakes its server with this command, and so may the user whose tenant it
is: waking moves nobody else's memory, it only puts the tenant in the queue.
"""

from __future__ import annotations

import logging
from typing import Any

from kiwid.adapters.control import ControlError, Peer
from kiwid.core.events import WakeAsked
from kiwid.core.model import TenantState
from kiwid.core.parking import OPERATOR
from kiwid.daemon.context import Context
from kiwid.linux.proc import uids

log = logging.getLogger("kiwid")


def owners(ctx: Context, tenant: str) -> set[int]:
    """The real user IDs the tenant's live processes run as."""
    info = ctx.engine.tracker.tenants.get(tenant)
    found = {uids(pid) for pid in (info.pids if info is not None else ())}
    return {ids[0] for ids in found if ids is not None}


def wake(ctx: Context, tenant: str, peer: Peer) -> dict[str, Any]:
    """Wake ``tenant`` if it is parked; say where it stands either way.

    Raises:
        ControlError: ``invalid-value`` for an unknown tenant; ``forbidden`` for a
            peer that is neither root, the admin group nor the tenant's own user.
    """
    scheduler = ctx.engine.scheduler
    state = scheduler.tenant_state(tenant)
    if state is None:
        raise ControlError(
            "invalid-value",
            f"no tenant {tenant!r} (a tenant id as `kiwictl tenants` lists them; kiwictl "
            "wake also takes a name, pod, container id or pid)",
        )
    if not peer.admin:
        mine = owners(ctx, tenant)
        if mine != {peer.uid}:
            runs_as = ", ".join(map(str, sorted(mine))) or "nobody kiwid can read"
            raise ControlError(
                "forbidden",
                f"waking {tenant} needs root, the admin group or the user its processes run "
                f"as ({runs_as}); you are uid {peer.uid}",
            )
    woken = state is TenantState.PARKED
    if woken:
        ctx.engine.apply([WakeAsked(tenant, OPERATOR, f"kiwictl wake by uid {peer.uid}")])
        log.info("Wake of %s by uid %d: it joins the queue", tenant, peer.uid)
    now = scheduler.tenant_state(tenant)
    return {
        "tenant": tenant,
        "woken": woken,
        "state": now.value if now is not None else "gone",
        "was": state.value,
    }
