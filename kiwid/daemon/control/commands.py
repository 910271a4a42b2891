"""The control commands kiwictl and kiwi-hook send, as one table.

The control adapter (:mod:`kiwid.adapters.control`) owns the wire: framing, the
argument schema (names and types) and who may send what. This module owns what
each command means, one handler per name; :data:`HANDLERS` covers exactly the
adapter's commands (a test checks it). Values are judged here: a refusal raises
:class:`~kiwid.adapters.control.ControlError` ``invalid-value`` and changes nothing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from kiwid import __version__
from kiwid.adapters.control import ControlError, EncodedResult, Peer, check_command_table
from kiwid.adapters.sim import SimBackend
from kiwid.config.reader import SHORT_TQ_S
from kiwid.core.model import GpuPolicy, TenantPolicy
from kiwid.daemon.context import Context
from kiwid.daemon.control import operator, waking
from kiwid.daemon.control.admission import Admission
from kiwid.daemon.control.status import StatusCache, tenant_json
from kiwid.daemon.logs import seconds
from kiwid.linux.proc import uids

log = logging.getLogger("kiwid")

Result = dict[str, Any] | EncodedResult
Handler = Callable[["Commands", dict[str, Any], Peer], Awaitable[Result]]

SHORT_TQ_WARNING = (
    "a TQ of 5 s or less is discouraged: each hand-over moves the tenant's GPU memory, "
    "so with a short quantum the application spends its window waiting for its data"
)
MAX_TQ_S = 86400.0


class Commands:
    """Answers control requests (already parsed, typed and authorised by the adapter)."""

    def __init__(self, ctx: Context, status: StatusCache, admission: Admission) -> None:
        """Answer from ``ctx``; ``status`` serves reads, ``admission`` containers.

        Raises:
            CommandTableMismatch: the handlers do not cover the protocol's commands
                exactly (a programming error, caught by the tests).
        """
        check_command_table(HANDLERS)
        self.ctx = ctx
        self.status = status
        self.admission = admission

    async def handle(self, cmd: str, args: dict[str, Any], peer: Peer) -> Result:
        """Answer one request.

        Raises:
            ControlError: the request is refused; its code and message say why.
        """
        handler = HANDLERS.get(cmd)
        if handler is None:
            raise ControlError("unknown-command", f"unknown command {cmd!r}")
        return await handler(self, args, peer)

    def apply_policies(self) -> tuple[dict[str, GpuPolicy], dict[str, GpuPolicy]]:
        """Tell the scheduler the policies in force now; return (before, after)."""
        before = self.ctx.engine.scheduler.policies()
        event = self.ctx.configured()
        self.ctx.engine.apply([event])
        self.status.invalidate()
        return before, dict(event.policies)


async def _ping(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    return {"version": __version__}


async def _status(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    return c.status.encoded()


async def _tenants(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    engine, now = c.ctx.engine, c.ctx.clock()
    resolved = c.ctx.tenant_policies.resolved
    return {
        "tenants": [
            tenant_json(
                engine.tracker.tenants.get(t.tenant),
                t,
                resolved.get(t.tenant),
                now,
                c.ctx.workloads.workload(t.tenant),
                wakes_on=c.ctx.waker.wakes_on.get(t.tenant, ()),
            )
            for t in engine.scheduler.view(now).tenants
        ]
    }


async def _workloads(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    book = c.ctx.workloads
    return {
        "now_unix": book.now(),
        "retry_after_s": book.retry_after_s(),
        "workloads": book.listing(),
    }


async def _forget_workload(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    workload = args["workload"]
    try:
        saved = c.ctx.workloads.forget(workload)
    except KeyError:
        raise ControlError(
            "invalid-value",
            f"no remembered workload {workload!r} (kiwictl workloads lists them)",
        ) from None
    log.info(
        "Forgot workload %s (uid %d): its next run is a newcomer; tenants running it now "
        "keep what they were told",
        workload,
        peer.uid,
    )
    return {"forgotten": workload, "saved": saved}


async def _set_tq(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    tq = args["tq"]
    if not math.isfinite(tq) or tq <= 0:
        raise ControlError("invalid-value", f"TQ must be a number of seconds > 0, not {tq!r}")
    if tq > MAX_TQ_S:
        raise ControlError("invalid-value", f"TQ of {tq:g} s is more than a day; refusing")
    overrides = c.ctx.overrides
    if args.get("gpu") is None:
        gpu = None
        gpus = [str(d.index) for d in c.ctx.devices]
    else:
        gpu = c.ctx.gpu_of(args["gpu"])
        if gpu is None:
            known = ", ".join(str(d.index) for d in c.ctx.devices) or "none"
            raise ControlError(
                "invalid-value", f"no GPU {args['gpu']!r} on this node (GPUs: {known})"
            )
        gpus = [gpu]
    if gpu is None:
        overrides.tq = float(tq)
        overrides.gpu_tq.clear()
    else:
        overrides.gpu_tq[gpu] = float(tq)
    before, after = c.apply_policies()
    log.info(
        "Runtime TQ change by uid %d (not persisted; %s keeps its value)",
        peer.uid,
        c.ctx.config_path,
    )
    log_tq_changes(before, after)
    warning = SHORT_TQ_WARNING if tq <= SHORT_TQ_S else None
    if warning:
        log.warning("TQ %s s: %s", seconds(tq), warning)
    return {"tq": float(tq), "gpus": gpus, "warning": warning}


async def _set_mode(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    mode = args["mode"]
    if mode not in ("exclusive", "auto", "off", "on"):
        raise ControlError(
            "invalid-value", f"mode must be exclusive, auto, off or on, not {mode!r}"
        )
    overrides = c.ctx.overrides
    overrides.scheduling_off = mode == "off"
    if mode == "on":
        overrides.mode = None
    elif mode != "off":
        overrides.mode = mode
    _, policies = c.apply_policies()
    modes = sorted({p.mode.value for p in policies.values()})
    log.info(
        "Scheduling mode = %s (runtime change by uid %d, not persisted)", "/".join(modes), peer.uid
    )
    return {"mode": "/".join(modes) or mode, "gpus": sorted(policies)}


def _sim(c: Commands, cmd: str) -> SimBackend:
    backend = c.ctx.backend
    if not isinstance(backend, SimBackend):
        raise ControlError("unavailable", f'{cmd} needs [gpu] backend = "sim"')
    return backend


async def _sim_attach(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    backend = _sim(c, "sim-attach")
    pid = args["pid"]
    owner = uids(pid) if pid > 0 else None
    if owner is None:
        raise ControlError("invalid-value", f"no running process with pid {pid}")
    if peer.uid != 0 and peer.uid not in owner:
        raise ControlError(
            "forbidden",
            f"pid {pid} belongs to uid {owner[0]}: only root may attach another user's process",
        )
    try:
        backend.attach(
            pid,
            args.get("gpu", 0),
            args.get("memory_bytes", 0),
            args.get("activity", "cpu"),
        )
    except ValueError as err:
        raise ControlError("invalid-value", str(err)) from None
    return {"attached": pid}


async def _sim_detach(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    return {"detached": _sim(c, "sim-detach").detach(args["pid"])}


async def _sim_foreign(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    """Memory on a simulated GPU that no process shows (to test safe restores)."""
    backend = _sim(c, "sim-foreign")
    try:
        backend.set_foreign(args["gpu"], args["memory_bytes"])
    except ValueError as err:
        raise ControlError("invalid-value", str(err)) from None
    return {"gpu": args["gpu"], "foreign_bytes": args["memory_bytes"]}


async def _sim_fault(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    """A fault in the simulated GPU's swaps of one process (to test kiwid's handling)."""
    backend = _sim(c, "sim-fault")
    pid, op, fault = args["pid"], args["op"], args["fault"]
    times = args.get("times", 1)
    attached = any(a.pid == pid for a in backend.attached())
    if not attached and not (fault == "none" and backend.faults.knows(pid)):
        raise ControlError(
            "invalid-value", f"pid {pid} is not attached to a simulated GPU (sim-attach it first)"
        )
    try:
        backend.faults.inject(pid, op, fault, times)
    except ValueError as err:
        raise ControlError("invalid-value", str(err)) from None
    if fault == "none":
        log.warning("Cleared the injected fault of %s of pid %d (uid %d)", op, pid, peer.uid)
    else:
        log.warning(
            "Injected fault by uid %d: %s of pid %d: %s x%d", peer.uid, op, pid, fault, times
        )
    return {"pid": pid, "op": op, "fault": fault, "times": None if fault == "none" else times}


def _tenant_key(c: Commands, ref: str) -> str:
    if ref not in c.ctx.engine.tracker.tenants:
        raise ControlError(
            "invalid-value",
            f"no tenant {ref!r} (a tenant id as `kiwictl tenants` lists them; kiwictl "
            "set-weight also takes a name, pod, container id or pid)",
        )
    return ref


def _apply_runtime(c: Commands, key: str, field_name: str, value: float, peer: Peer) -> Result:
    ctx = c.ctx
    ctx.tenant_policies.set_runtime(key, field_name, value)
    ctx.engine.apply(ctx.tenant_policies.events(ctx.engine.tracker.tenants))
    c.status.invalidate()
    resolved = ctx.tenant_policies.resolved[key]
    log.info(
        "Runtime %s of %s = %s by uid %d (not persisted: it lasts until the next reload)",
        field_name,
        key,
        f"{value:g}",
        peer.uid,
    )
    return {"tenant": key, "policy": resolved.as_json()}


async def _set_weight(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    weight = args["weight"]
    refusal = TenantPolicy.weight_refusal(weight)
    if refusal is not None:
        raise ControlError("invalid-value", refusal)
    return _apply_runtime(c, _tenant_key(c, args["tenant"]), "weight", float(weight), peer)


async def _set_priority(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    priority = args["priority"]
    refusal = TenantPolicy.priority_refusal(priority)
    if refusal is not None:
        raise ControlError("invalid-value", refusal)
    return _apply_runtime(c, _tenant_key(c, args["tenant"]), "priority", priority, peer)


async def _retry(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    return await operator.retry(c.ctx, args["tenant"], peer)


async def _release(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    return await operator.release(c.ctx, args["tenant"], peer)


async def _wake(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    answer = waking.wake(c.ctx, args["tenant"], peer)
    c.status.invalidate()
    return answer


async def _register(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    return await c.admission.register(args, peer)


async def _unregister(c: Commands, args: dict[str, Any], peer: Peer) -> Result:
    return await c.admission.unregister(args, peer)


HANDLERS: dict[str, Handler] = {
    "ping": _ping,
    "status": _status,
    "tenants": _tenants,
    "workloads": _workloads,
    "forget-workload": _forget_workload,
    "set-tq": _set_tq,
    "set-mode": _set_mode,
    "sim-attach": _sim_attach,
    "sim-foreign": _sim_foreign,
    "sim-fault": _sim_fault,
    "sim-detach": _sim_detach,
    "set-weight": _set_weight,
    "set-priority": _set_priority,
    "retry": _retry,
    "release": _release,
    "wake": _wake,
    "register": _register,
    "unregister": _unregister,
}
"""Command name -> handler: exactly the commands of the control adapter's schema."""


def log_tq_changes(before: dict[str, GpuPolicy], after: dict[str, GpuPolicy]) -> None:
    """Log ``[INFO] New TQ = 20`` (or one line per GPU) for what changed."""
    changed = {g: p.tq_s for g, p in after.items() if g not in before or before[g].tq_s != p.tq_s}
    if not changed:
        return
    values = set(changed.values())
    if len(changed) == len(after) and len(values) == 1:
        log.info("New TQ = %s", seconds(values.pop()))
        return
    for gpu, tq in sorted(changed.items()):
        log.info("New TQ = %s on GPU %s", seconds(tq), gpu)
