"""Each waiter's estimated turn and the bound on its wait, or why no bound holds now.

A waiter's ``wait_bound_s`` is exported as a metric, and an alert fires when a wait
passes it; so it is given only while it can hold. It cannot while the GPU waits on
something the rotation does not end by itself: a stuck tenant that may still run
(nobody is let go beside it), or a restore that waits for free memory nobody kiwid
knows holds (another process's, the driver's). Then ``wait_bound_s`` is ``null`` and
``wait_bound_reason`` says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiwid.core.model import GpuId, SwapMode, TenantId
from kiwid.core.view import GpuView, TenantView, WaiterView


def waiter_json(
    gpu: GpuView,
    waiter: WaiterView,
    now: float,
    allowance: float,
    *,
    gpus: Mapping[GpuId, GpuView],
    tenants: Mapping[TenantId, TenantView],
) -> dict[str, Any]:
    """A waiter with its estimated turn and the bound on its wait.

    ``eta_s``: the holder uses the rest of its quantum and everyone ahead a full
    one of their own (TQ x weight), and every hand-over before its turn takes the
    allowance (holders that go idle yield earlier; multi-GPU waiters may wait for
    other GPUs too). ``wait_bound_s``, counted from when it started waiting: the
    holder's quantum and the quanta ahead, plus one allowance, plus one TQ per
    hand-over where memory swaps (a holder keeps the GPU up to one more TQ while
    the next one's memory comes back). Behind a higher priority class the only
    bound is ``scheduler.max_wait`` (then it goes first). ``None`` where no bound
    holds now, and ``wait_bound_reason`` says why (:func:`unbounded`).
    """
    remaining = max(0.0, gpu.preempt_at - now) if gpu.preempt_at is not None else 0.0
    policy = gpu.policy
    holder_q = gpu.holder_quantum_s or 0.0
    handover = policy.tq_s if policy.swap is not SwapMode.NONE else 0.0
    bound: float | None = holder_q + waiter.ahead_s + allowance + waiter.position * handover
    if waiter.outranked and policy.max_wait_s is not None:
        bound = policy.max_wait_s + holder_q + allowance + handover
    why = unbounded(gpu, waiter, gpus, tenants)
    return {
        "tenant": waiter.tenant,
        "waiting_s": round(now - waiter.since, 3),
        "position": waiter.position,
        "eta_s": round(remaining + waiter.ahead_s + waiter.position * allowance, 3),
        "wait_bound_s": None if why is not None or bound is None else round(bound, 3),
        "wait_bound_reason": why,
    }


def unbounded(
    gpu: GpuView,
    waiter: WaiterView,
    gpus: Mapping[GpuId, GpuView],
    tenants: Mapping[TenantId, TenantView],
) -> str | None:
    """Why no bound holds on ``waiter``'s wait now (``None``: one does).

    * a stuck tenant that may still run blocks one of its GPUs: nobody is let go
      there until its gate takes, or an operator releases it;
    * its own restore, or that of a tenant ahead of it on ``gpu`` (a granted holder
      whose memory is not back, a waiter ahead), waits for free memory that nobody
      kiwid knows holds: the rotation cannot free it;
    * a higher priority class is ahead and ``scheduler.max_wait`` is not set.
    """
    me = tenants.get(waiter.tenant)
    for gid in sorted(me.gpus if me is not None else {gpu.gpu}):
        other = gpus.get(gid)
        blocker = other.blocked_by if other is not None else None
        if blocker is not None and blocker != waiter.tenant:
            return (
                f"{blocker} is stuck and may still run on GPU {gid} (kiwid could not gate it): "
                "nobody is let go there until its gate takes (tried again every TQ; "
                f"`kiwictl retry {blocker}` tries now) or `kiwictl release {blocker}` lets it "
                "run outside the rotation"
            )
    ahead = [w.tenant for w in gpu.waiters if w.position <= waiter.position]
    holder = tenants.get(gpu.holder) if gpu.holder is not None else None
    if holder is not None and holder.gated:
        ahead.insert(0, holder.tenant)
    for tid in ahead:
        view = tenants.get(tid)
        if view is not None and view.foreign_short is not None:
            whose = "its own restore" if tid == waiter.tenant else f"the restore of {tid}"
            return (
                f"{whose} waits for free memory that no tenant kiwid knows holds "
                f"({view.foreign_short}): the rotation cannot free it"
            )
    if waiter.outranked and gpu.policy.max_wait_s is None:
        return "a higher priority class is ahead of it and scheduler.max_wait is not set"
    return None
