"""Containers announced by kiwi-hook: ``register``, ``unregister`` and the hold.

kiwi-hook runs as the container runtime's OCI hook, as root. ``register`` names a
container (its cgroup, a process in it, its pod and GPUs); kiwid accepts only a
cgroup that holds that process and only a container's own cgroup: never the
root, a login session, a parent slice with every service under it, or a cgroup
the process is not in. With ``kubernetes.admission = "hold"`` a container whose
GPU is busy is queued at once and gated before its first instruction; whether it
must wait is the scheduler's call (:class:`~kiwid.core.events.Admitted`).

A container that declares more GPU memory than one of its GPUs can ever give it
(the card less ``memory.reserve_mib``; its pod's ``kiwi.io/gpu-memory``, its own
``memory_bytes`` or its rule's ``memory``) is refused (``invalid-value`` naming
``memory_bytes``): it could never run, and kiwi-hook fails its start rather than
letting it run ungated.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kiwid.adapters.control import ControlError, Peer
from kiwid.core.events import Admitted
from kiwid.core.model import TenantPolicy
from kiwid.core.quantity import shown_bytes
from kiwid.daemon.context import Context
from kiwid.daemon.engine.executor import Kind
from kiwid.daemon.gpu_policy import MIB
from kiwid.daemon.sampling import poll
from kiwid.daemon.tenants.identify import identity_of_container
from kiwid.daemon.tenants.pods import PodNames
from kiwid.daemon.tenants.policy import resolve
from kiwid.daemon.tenants.tracker import Identity, Registration
from kiwid.linux.proc import comm, read_stat

log = logging.getLogger("kiwid")

HOLD_EXEC_TIMEOUT_S = 30.0
"""How long a container's program may take to replace the runtime's init."""
SETTLE_TIMEOUT_S = 5.0
"""How long ``register`` waits for a hold's gate to take before it answers."""
_RUNTIMES = ("runc", "crun", "youki", "runsc", "kata")
_MEMORY_SOURCES = ("annotation", "register")
_SOURCE_WORDS = {
    "annotation": "its pod's annotation kiwi.io/gpu-memory",
    "register": "its registration's memory_bytes",
}


class Admission:
    """Registers containers and holds newcomers until their turn."""

    def __init__(self, ctx: Context) -> None:
        """Admit into ``ctx`` (a hold waiting for an exec ends with :meth:`close`)."""
        self._ctx = ctx
        self.pods = PodNames(ctx.engine.tracker, lambda: ctx.settings.kubernetes)
        self._holds: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Stop the pod-name lookups and the holds waiting for an exec."""
        for task in self._holds:
            task.cancel()
        await asyncio.gather(*self._holds, return_exceptions=True)
        await self.pods.close()

    async def register(self, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        """A container announced by kiwi-hook (OCI createRuntime), with its names.

        Raises:
            ControlError: not root, or the cgroup or process is not acceptable.
        """
        ctx = self._ctx
        if peer.uid != 0:
            raise ControlError("forbidden", "register needs root (the container runtime)")
        cid = args["id"]
        pid = args.get("pid")
        weight, priority = args.get("weight"), args.get("priority")
        memory, memory_source = args.get("memory_bytes"), args.get("memory_source")
        for value, refusal_of in (
            (weight, TenantPolicy.weight_refusal),
            (priority, TenantPolicy.priority_refusal),
            (memory, TenantPolicy.memory_refusal),
        ):
            refusal = None if value is None else refusal_of(value)
            if refusal is not None:
                arg = "memory_bytes" if value is memory else None
                raise ControlError("invalid-value", f"container {cid}: {refusal}", arg)
        if memory_source not in (None, *_MEMORY_SOURCES):
            raise ControlError(
                "invalid-value",
                f"container {cid}: memory_source must be one of {', '.join(_MEMORY_SOURCES)}, "
                f"not {memory_source!r}",
            )
        if pid is None or pid <= 0:
            raise ControlError("invalid-value", f"container {cid}: a process id is needed")
        try:
            ident = identity_of_container(
                cid,
                args.get("cgroup_v2"),
                args.get("cgroup_v1_freezer"),
                pid,
                name=args.get("name"),
                pod=args.get("pod"),
                namespace=args.get("namespace"),
                weight=weight,
                priority=priority,
                memory=memory,
                memory_source=memory_source or "register",
                park=args.get("park"),
            )
        except ValueError as err:
            raise ControlError("invalid-value", f"container {cid}: {err}") from None
        wanted = args.get("gpus") or [str(d.index) for d in ctx.devices]
        gpus: set[str] = set()
        for ref in wanted:
            gpu = ctx.gpu_of(ref)
            if gpu is None:
                known = ", ".join(str(d.index) for d in ctx.devices) or "none"
                raise ControlError("invalid-value", f"no GPU {ref!r} on this node (GPUs: {known})")
            gpus.add(gpu)
        self._check_declaration(cid, ident, gpus)
        engine = ctx.engine
        stat = read_stat(pid)  # with the pid, its start names the process for good
        starts = {pid: stat.start_ticks if stat is not None else None}
        engine.tracker.register(Registration(cid, ident, frozenset(gpus), frozenset({pid}), starts))
        if ident.pod is None:
            self.pods.want(ident.key, args.get("device_ids") or ())
        else:
            self.pods.forget(ident.key)
        engine.apply(poll(ctx))
        held = False
        if bool(args.get("hold", True)) and ctx.settings.kubernetes.admission == "hold":
            held = await self._hold(ident.key, pid)
        where = f" (pod {ident.namespace or '-'}/{ident.pod})" if ident.pod else ""
        log.info(
            "Registered container %s%s as %s on GPU %s%s",
            ident.name,
            where,
            ident.key,
            ",".join(sorted(gpus)),
            ": held until its turn" if held else "",
        )
        return {"tenant": ident.key, "held": held}

    def _check_declaration(self, cid: str, ident: Identity, gpus: set[str]) -> None:
        """Refuse a container that declares more memory than one of its GPUs can give.

        Raises:
            ControlError: ``invalid-value`` (``arg`` ``memory_bytes``), naming the
                container, what it declared and where, and the card's size.
        """
        ctx = self._ctx
        resolved = resolve(ctx.tenant_policies.rules, ident)
        declared = resolved.policy.memory_bytes
        if declared is None:
            return
        reserve = ctx.settings.memory.reserve_mib * MIB
        for device in sorted(ctx.devices, key=lambda d: d.index):
            room = device.memory_total_bytes - reserve
            if str(device.index) not in gpus or declared <= room:
                continue
            source = resolved.declared_source or "register"
            where = _SOURCE_WORDS.get(source, f"{source} of {ctx.config_path}")
            who = f"{ident.name} ({cid})" if ident.name != cid else cid
            asked, left = shown_bytes(declared), shown_bytes(max(0, room))
            if asked == left:  # rounded alike: say the bytes
                asked, left = f"{asked} ({declared} bytes)", f"{left} ({room} bytes)"
            raise ControlError(
                "invalid-value",
                f"container {who} declares {asked} of GPU memory per GPU ({where}), more "
                f"than GPU {device.index} can ever give it: its "
                f"{shown_bytes(device.memory_total_bytes)} less memory.reserve_mib "
                f"({shown_bytes(reserve)}) leave {left}",
                "memory_bytes",
            )

    async def _hold(self, key: str, pid: int) -> bool:
        """Queue a newcomer whose GPU is busy; whether it waits."""
        engine = self._ctx.engine
        exe = comm(pid)
        if exe is not None and _is_runtime(exe):
            # Called from the createRuntime hook: freezing now would hold the
            # runtime itself (runc waits for its init). Queue it the moment the
            # container's own program has started instead.
            task = asyncio.get_running_loop().create_task(self._hold_after_exec(key, pid, exe))
            self._holds = {t for t in self._holds if not t.done()} | {task}
            return engine.scheduler.would_wait(key)
        engine.apply([Admitted(key)])
        await self._settled(key)
        return engine.scheduler.gated(key)

    async def _settled(self, key: str) -> None:
        """Wait (without holding up the loop) until the tenant's gate has been done."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_TIMEOUT_S
        executor = self._ctx.engine.executor  # (a follow beside its lane is no gate)
        while executor.pending(key, Kind.GATE) and loop.time() < deadline:
            await asyncio.sleep(0.005)

    async def _hold_after_exec(self, key: str, pid: int, runtime_exe: str) -> None:
        """Queue a registered container once its program replaced the runtime's init.

        Bounded: after HOLD_EXEC_TIMEOUT_S it is queued anyway (a container that is
        never started is not waited for forever).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HOLD_EXEC_TIMEOUT_S
        while loop.time() < deadline:
            exe = comm(pid)
            if exe is None or exe != runtime_exe:
                break
            await asyncio.sleep(0.005)
        engine = self._ctx.engine
        if key in engine.tracker.registered and comm(pid) is not None:
            engine.apply([Admitted(key)])
            if engine.scheduler.gated(key):
                log.info("Held %s from its first instruction until its turn", key)

    async def unregister(self, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        """A container is gone (OCI poststop): forget it, ungating what remains.

        Raises:
            ControlError: not root.
        """
        if peer.uid != 0:
            raise ControlError("forbidden", "unregister needs root (the container runtime)")
        key = self._ctx.engine.tracker.unregister(args["id"])
        if key is not None:
            self.pods.forget(key)
            self._ctx.engine.apply(poll(self._ctx))
            log.info("Unregistered container %s (%s)", args["id"], key)
        return {"removed": key is not None}


def _is_runtime(exe: str) -> bool:
    """Whether ``exe`` (a ``comm``) is an OCI runtime's init, e.g. ``runc:[2:INIT]``."""
    return any(runtime in exe for runtime in _RUNTIMES)
