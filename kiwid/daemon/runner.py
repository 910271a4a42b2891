"""kiwid's main loop: the only place that waits, polls, and applies changes.

One asyncio loop: it wakes for the next poll, the scheduler's next deadline, the
systemd watchdog, a signal, a config-file change or a control command, whichever
comes first. Signal handlers only record (STYLE habit 7); reloads from SIGHUP
and from the file watcher run one and the same transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiwid import __version__
from kiwid.adapters import cdi, procs
from kiwid.adapters.control import ControlError, ControlServer, EncodedResult, Peer, SocketInUse
from kiwid.adapters.gpu import DeviceInfo, GpuBackend, GpuBackendError, GpuLost
from kiwid.adapters.metrics import MetricsError, MetricsServer
from kiwid.adapters.notify import Notifier
from kiwid.adapters.sim import SimBackend
from kiwid.adapters.watch import ConfigWatcher, WatchError
from kiwid.config import ConfigError, LoadedConfig, Settings, load_config
from kiwid.core.events import ActivitySeen, GpusConfigured, TenantSwapped
from kiwid.core.model import GpuPolicy, TenantState
from kiwid.core.scheduler import Scheduler
from kiwid.daemon import policy
from kiwid.daemon.engine import Engine
from kiwid.daemon.gates import GateError, TenantGate, ungate_record
from kiwid.daemon.identify import identity_of_container
from kiwid.daemon.logs import seconds, set_level
from kiwid.daemon.pods import PodNames
from kiwid.daemon.state import GatedRecord, StateError, StateFile
from kiwid.daemon.status import build_status, summary_line, tenant_json
from kiwid.daemon.swap import Swapper
from kiwid.daemon.tenants import GpuSample, Identity, Registration, TenantInfo, TenantTracker

log = logging.getLogger("kiwid")

STATUS_MAX_AGE_S = 0.1
RUNTIME_FAILURE = 1
STARTUP_FAILURE = 3
SHORT_TQ_WARNING = (
    "a TQ of 5 s or less is discouraged: each hand-over moves the tenant's GPU memory, "
    "so with a short quantum the application spends its window waiting for its data"
)
# Settings that only a restart can change (they shape what the daemon is bound to).
RESTART_ONLY = (
    ("gpu.backend", lambda s: s.gpu.backend),
    ("gpu.sim", lambda s: (s.gpu.sim_devices, s.gpu.sim_memory_gib)),
    ("gpu.gate", lambda s: (s.gpu.gate, s.gpu.gate_timeout)),
    ("control.socket", lambda s: s.control.socket),
    ("control.admin_group", lambda s: s.control.admin_group),
    ("daemon.state_dir", lambda s: s.daemon.state_dir),
    ("metrics.listen", lambda s: s.metrics.listen),
    ("kubernetes.cdi_dir", lambda s: s.kubernetes.cdi_dir),
)


class StartupError(Exception):
    """kiwid cannot start; the message says why and what to do."""


class Daemon:
    """The running daemon: settings, backend, engine, control socket, watcher."""

    def __init__(
        self,
        config_path: Path,
        loaded: LoadedConfig,
        *,
        backend: GpuBackend,
        gate: TenantGate,
        identify: Callable[[int], Identity | None],
        notifier: Notifier | None = None,
        clock: Callable[[], float] = time.monotonic,
        swapper: Swapper | None = None,
    ) -> None:
        """Prepare the daemon; :meth:`run` starts it."""
        self.config_path = config_path
        self.settings: Settings = loaded.settings
        self._running_settings = loaded.settings  # restart-only values in force
        self.overrides = policy.RuntimeOverrides()
        self.backend = backend
        self.notifier = notifier or Notifier()
        self._clock = clock
        self.state = StateFile(self.settings.daemon.state_dir)
        self.engine = Engine(
            Scheduler(),
            TenantTracker(identify),
            gate,
            self.state,
            clock,
            swapper=swapper,
            host_memory=procs.available_host_memory,
            host_floor_bytes=self.settings.memory.host_floor_mib * policy.MIB,
        )
        self.pods = PodNames(self.engine.tracker, lambda: self.settings.kubernetes)
        self.devices: list[DeviceInfo] = []
        self.unhealthy: set[str] = set()
        self._loaded_at = time.time()
        self._last_reload: dict[str, Any] = {"ok": True, "at_unix": self._loaded_at, "error": None}
        self._wake: asyncio.Event | None = None
        self._should_exit = False
        self._force_exit = False
        self._reload_reasons: list[str] = []
        self._server: ControlServer | None = None
        self._watcher: ConfigWatcher | None = None
        self._metrics: MetricsServer | None = None
        self._last_status_line = ""
        self._status_cache: tuple[float, int, dict[str, Any]] | None = None
        self._status_bytes: EncodedResult | None = None
        self._reloads = {"ok": 0, "failed": 0}
        self._status_line_generation = -1
        self._adopt: dict[str, GatedRecord] = {}
        self._hold_tasks: set[asyncio.Task[None]] = set()
        self._started = clock()
        for warning in loaded.warnings:
            log.warning("%s: %s", config_path, warning)

    # ------------------------------------------------------------ signals

    def handle_exit(self, sig: int) -> None:
        """SIGTERM/SIGINT: ask the loop to stop; a second SIGINT forces."""
        if self._should_exit and sig == signal.SIGINT:
            self._force_exit = True
        self._should_exit = True
        self._poke()

    def handle_hup(self) -> None:
        """SIGHUP: queue a reload."""
        self.request_reload("SIGHUP")

    def request_reload(self, reason: str) -> None:
        """Queue a reload (from a signal, the file watcher or a test)."""
        self._reload_reasons.append(reason)
        self._poke()

    def _status_from_thread(self, loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
        """The status for a metrics scrape (HTTP thread): built on the loop, fresh."""

        async def build() -> dict[str, Any]:
            return self.status()

        return asyncio.run_coroutine_threadsafe(build(), loop).result(timeout=5.0)

    def _from_thread(self, loop: asyncio.AbstractEventLoop, reason: str) -> None:
        loop.call_soon_threadsafe(self.request_reload, reason)

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------ life cycle

    async def run(self) -> int:
        """Run until SIGTERM/SIGINT; return the process exit code."""
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        installed = self._install_signals(loop)
        try:
            try:
                await self._startup(loop)
            except StartupError as err:
                log.error("%s", err)
                await self._shutdown()
                return STARTUP_FAILURE
            status = self.status()
            self.notifier.ready(summary_line(status))
            log.info(
                "kiwid %s ready: %d GPU(s), TQ %s s, mode %s, control socket %s",
                status["version"],
                len(self.devices),
                seconds(self.settings.scheduler.tq),
                self.settings.scheduler.mode,
                self.settings.control.socket,
            )
            try:
                await self._loop()
            except Exception:
                log.exception("kiwid's main loop failed; ungating every tenant")
                await self._shutdown()
                return RUNTIME_FAILURE
            return await self._shutdown()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> list[int]:
        try:
            loop.add_signal_handler(signal.SIGTERM, self.handle_exit, signal.SIGTERM)
            loop.add_signal_handler(signal.SIGINT, self.handle_exit, signal.SIGINT)
            loop.add_signal_handler(signal.SIGHUP, self.handle_hup)
        except (RuntimeError, ValueError):  # not the main thread (tests): none
            return []
        return [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]

    async def _startup(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self.devices = list(self.backend.devices())
        except GpuBackendError as err:
            raise StartupError(f"cannot list GPUs: {err}") from err
        self._recover_previous()
        await self.engine.apply([GpusConfigured(self.policies())])
        self._write_cdi_spec()
        admin_gid = _group_id(self.settings.control.admin_group)
        self._server = ControlServer(
            self.settings.control.socket,
            self.handle_command,
            admin_gid,
            self.settings.control.admin_group,
        )
        try:
            await self._server.start()
        except (SocketInUse, OSError) as err:
            self._server = None
            raise StartupError(f"control socket {self.settings.control.socket}: {err}") from err
        if self.settings.metrics.listen:
            try:
                self._metrics = MetricsServer(
                    self.settings.metrics.listen, lambda: self._status_from_thread(loop)
                )
                self._metrics.start()
            except MetricsError as err:
                self._metrics = None
                raise StartupError(f"metrics.listen: {err}") from err
            log.info("Metrics on http://%s/metrics", self.settings.metrics.listen)
        self._watcher = ConfigWatcher(
            self.config_path,
            lambda: self._from_thread(loop, "file changed"),
        )
        try:
            self._watcher.start()
        except WatchError as err:
            self._watcher = None
            log.warning("Not watching %s (%s): use systemctl reload kiwid", self.config_path, err)

    def _write_cdi_spec(self) -> None:
        """Write (or refresh) the CDI spec: ``kiwi.io/gpu=<index|uuid>`` with kiwi-hook.

        Off when ``kubernetes.cdi_dir`` is empty. A missing kiwi-hook or an
        unwritable directory is logged, not fatal: containers then start ungated.
        """
        directory = self._running_settings.kubernetes.cdi_dir  # restart-only
        if not directory:
            return
        hook = shutil.which("kiwi-hook") or str(Path(sys.executable).with_name("kiwi-hook"))
        if not Path(hook).is_file():
            log.warning("No kiwi-hook executable found: not writing the CDI spec in %s", directory)
            return
        nvidia = bool(cdi.find_devices(cdi.NVIDIA_KIND))
        nodes = None
        if self.backend.name == "nvml" and not nvidia:
            nodes = cdi.find_device_nodes(d.index for d in self.devices)
        try:
            spec = cdi.build_spec(
                self.devices,
                hook,
                nvidia,
                self.settings.control.socket,
                admission=self.settings.kubernetes.admission,
                device_nodes=nodes,
            )
            if cdi.write_spec(spec, directory):
                log.info(
                    "CDI spec written: %s/%s (%d GPU(s)%s)",
                    directory,
                    cdi.DEFAULT_NAME,
                    len(self.devices),
                    ", beside NVIDIA's spec" if nvidia else "",
                )
        except (OSError, ValueError) as err:
            log.warning("Cannot write the CDI spec in %s: %s", directory, err)

    def _recover_previous(self) -> None:
        """Read what a previous kiwid (crash, SIGKILL, restart) left gated.

        Tenants gated another way than this daemon gates are ungated at once;
        the rest wait for the first poll, which decides (:meth:`_adopt_previous`).
        """
        try:
            records = self.state.load()
        except StateError as err:
            log.warning("Ignoring the state file: %s", err)
            records = {}
        for record in records.values():
            if record.method == self.engine.gate.method:
                self._adopt[record.tenant] = record
                if record.swapped:
                    self._keep_swapped(record)
                continue
            try:
                ungate_record(record)
            except GateError as err:
                log.error(
                    "A previous kiwid left %s gated and it cannot be ungated: %s",
                    record.tenant,
                    err,
                )
                continue
            log.info("Ungated %s, left gated by a previous kiwid", record.tenant)
            self.state.drop(record.tenant)
        if not self.state.records:
            self.state.clear()

    def _keep_swapped(self, record: GatedRecord) -> None:
        """Keep a tenant that a previous kiwid swapped out, while its processes live.

        It is missing from the GPU's process list; the first poll attaches it and
        :meth:`_adopt_previous` queues it again.
        """
        live = [pid for pid in record.pids if procs.alive(pid)]
        identity = next((i for i in map(self.engine.tracker.identify, live) if i), None)
        if identity is None:
            return  # gone: the first poll releases the record
        info = TenantInfo(identity, set(live), frozenset(record.swapped or ()))
        self.engine.tracker.keep_swapped(info)

    async def _adopt_previous(self) -> None:
        """After a poll: queue the previous daemon's waiters again, or ungate them.

        They are frozen, so they show no GPU activity. One is re-adopted (queued
        again, and never thawed) as soon as someone runs on its GPUs; until then
        it stays frozen for at most ``idle_release`` seconds — the time in which
        a running tenant shows its activity — after which it is queued anyway
        and, with nobody ahead, granted. A tenant that is gone is ungated at once.
        Nothing stays gated that nobody manages.
        """
        known = self.engine.tracker.tenants
        scheduler = self.engine.scheduler
        swapped = {k: r for k, r in self._adopt.items() if r.swapped and k in known}
        if swapped:  # in host RAM: queued again, gated, to come back in its turn
            for key in swapped:
                self._adopt.pop(key)
            await self.engine.apply(
                [TenantSwapped(key, dict(r.swapped or {})) for key, r in swapped.items()]
            )
            for key in swapped:
                log.info("Re-adopted %s: its memory is in host RAM; it waits for its turn", key)
        patience = min((p.idle_release_s for p in self.policies().values()), default=0.0)
        waited_enough = self._clock() - self._started >= patience
        ready: list[str] = []
        for key in list(self._adopt):
            info = known.get(key)
            if info is None:
                record = self._adopt.pop(key)
                if await self.engine.release(record):
                    log.info("Ungated %s, left gated by a previous kiwid", key)
                continue
            running = any(
                scheduler.tenant_state(other) in (TenantState.HOLDER, TenantState.CORUNNING)
                for other, o in known.items()
                if other != key and o.gpus & info.gpus
            )
            if running or waited_enough:
                ready.append(key)
        if not ready:
            return
        records = {key: self._adopt.pop(key) for key in ready}
        await self.engine.apply([ActivitySeen(key) for key in ready])
        for key, record in records.items():
            if scheduler.tenant_state(key) is TenantState.WAITING:
                log.info("Re-adopted %s: still waiting for its turn", key)
            elif await self.engine.release(record):
                log.info("Ungated %s, left gated by a previous kiwid: its turn", key)

    async def _loop(self) -> None:
        assert self._wake is not None
        next_poll = self._clock()
        watchdog_every = self.notifier.watchdog_interval_s()
        next_ping = self._clock()
        while not self._should_exit:
            if self._reload_reasons:
                reasons = ", ".join(dict.fromkeys(self._reload_reasons))
                self._reload_reasons.clear()
                await self.reload(reasons)
            now = self._clock()
            if now >= next_poll:
                await self.poll()
                next_poll = now + self.settings.gpu.poll_interval
                if self._adopt:
                    await self._adopt_previous()
            deadline = self.engine.scheduler.next_deadline()
            if deadline is not None and deadline <= self._clock():
                await self.engine.tick()
                deadline = self.engine.scheduler.next_deadline()
            if watchdog_every is not None and self._clock() >= next_ping:
                self.notifier.watchdog()  # from the loop: a hung loop stops the pings
                next_ping = self._clock() + watchdog_every
            self._update_status_line()
            wake_at = min(next_poll, deadline if deadline is not None else math.inf)
            if watchdog_every is not None:
                wake_at = min(wake_at, next_ping)
            timeout = max(0.0, wake_at - self._clock())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()

    async def _shutdown(self) -> int:
        self.notifier.stopping()
        log.info("Stopping: ungating every tenant")
        if self._watcher is not None:
            self._watcher.stop()
        if self._server is not None:
            await self._server.close()
        await self.pods.close()
        if self._metrics is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._metrics.stop)
        timeout = 0.5 if self._force_exit else self.settings.daemon.shutdown_timeout
        try:
            failed = await asyncio.wait_for(self.engine.ungate_all(), timeout)
        except TimeoutError:
            failed = sorted(self.state.records)
        self.engine.close()
        with contextlib.suppress(GpuBackendError):
            self.backend.close()
        if failed:
            log.error(
                "Still gated after %s s: %s; run `kiwid recover` (it reads %s)",
                seconds(timeout),
                ", ".join(failed),
                self.state.path,
            )
            return RUNTIME_FAILURE
        self.state.clear()
        log.info("Stopped; no tenant is gated")
        return 0

    # ------------------------------------------------------------ work

    def policies(self) -> dict[str, GpuPolicy]:
        """The policy in force on every healthy GPU."""
        healthy = [d for d in self.devices if str(d.index) not in self.unhealthy]
        return policy.policies(
            self.settings, self.overrides, healthy, can_swap=self.engine.swapper is not None
        )

    async def poll(self) -> None:
        """Sample every GPU and feed the differences to the engine."""
        samples: list[GpuSample] = []
        lost: list[str] = []
        window = self.settings.gpu.poll_interval
        health_changed = False
        for device in self.devices:
            gid = str(device.index)
            try:
                procs = self.backend.processes(device.index)
                active = self.backend.active_pids(device.index, window)
            except GpuLost as err:
                lost.append(gid)
                if gid not in self.unhealthy:
                    self.unhealthy.add(gid)
                    health_changed = True
                    log.error("GPU %s is lost (%s): its tenants are no longer gated", gid, err)
                continue
            if gid in self.unhealthy:
                self.unhealthy.discard(gid)
                health_changed = True
                log.info("GPU %s is back", gid)
            samples.append(GpuSample(gid, procs, active))
        events = self.engine.tracker.observe(samples, self._clock(), lost)
        if health_changed:
            events.insert(0, GpusConfigured(self.policies()))
        await self.engine.apply(events)

    async def reload(self, reason: str) -> bool:
        """The reload transaction: parse and validate, then swap, or keep the old."""
        self.notifier.reloading()
        self._status_cache = None
        log.info("Reloading %s (%s)", self.config_path, reason)
        try:
            loaded = load_config(self.config_path)
        except ConfigError as err:
            self._last_reload = {"ok": False, "at_unix": time.time(), "error": str(err)}
            self._reloads["failed"] += 1
            self._status_cache = None
            log.error("Reload failed; the running configuration stays in force:\n%s", err)
            self.notifier.ready(f"reload failed, running configuration kept: {err}")
            return False
        for name, get in RESTART_ONLY:
            if get(loaded.settings) != get(self._running_settings):
                log.warning(
                    "%s changed in %s: it takes effect at the next restart", name, self.config_path
                )
        for warning in loaded.warnings:
            log.warning("%s: %s", self.config_path, warning)
        before = self.policies()
        self.settings = loaded.settings
        self.overrides = policy.RuntimeOverrides()  # the file is the persistent truth
        set_level(self.settings.daemon.log_level)
        self.engine.host_floor_bytes = self.settings.memory.host_floor_mib * policy.MIB
        after = self.policies()
        await self.engine.apply([GpusConfigured(after)])
        self._log_tq_changes(before, after)
        self._write_cdi_spec()
        self._loaded_at = time.time()
        self._last_reload = {"ok": True, "at_unix": self._loaded_at, "error": None}
        self._reloads["ok"] += 1
        self.notifier.ready(summary_line(self.status()))
        return True

    def _log_tq_changes(self, before: dict[str, GpuPolicy], after: dict[str, GpuPolicy]) -> None:
        changed = {
            g: p.tq_s for g, p in after.items() if g not in before or before[g].tq_s != p.tq_s
        }
        if not changed:
            return
        values = set(changed.values())
        if len(changed) == len(after) and len(values) == 1:
            log.info("New TQ = %s", seconds(values.pop()))
            return
        for gpu, tq in sorted(changed.items()):
            log.info("New TQ = %s on GPU %s", seconds(tq), gpu)

    def _update_status_line(self) -> None:
        generation = self.engine.generation
        if generation == self._status_line_generation:
            return
        self._status_line_generation = generation
        line = summary_line(self._cached_status())
        if line != self._last_status_line:
            self._last_status_line = line
            self.notifier.status(line)

    # ------------------------------------------------------------ control

    def _cached_status(self) -> dict[str, Any]:
        """The status, rebuilt at most every STATUS_MAX_AGE_S unless something changed.

        A hundred ``kiwictl status`` callers at once then cost one build, not a
        hundred; the times in it are at most that old.
        """
        now = self._clock()
        generation = self.engine.generation
        cached = self._status_cache
        if cached is None or cached[1] != generation or now - cached[0] > STATUS_MAX_AGE_S:
            self._status_cache = (now, generation, self.status())
            self._status_bytes = EncodedResult(
                json.dumps(self._status_cache[2], ensure_ascii=False, allow_nan=False).encode()
            )
        assert self._status_cache is not None
        return self._status_cache[2]

    def status(self) -> dict[str, Any]:
        """The status object (protocol v1)."""
        return build_status(
            pid=os.getpid(),
            config={
                "path": str(self.config_path),
                "loaded_at_unix": self._loaded_at,
                "last_reload": dict(self._last_reload),
            },
            scheduling_on=not self.overrides.scheduling_off,
            devices=self.devices,
            unhealthy=self.unhealthy,
            configured={str(d.index): policy.configured(self.settings, d) for d in self.devices},
            view=self.engine.scheduler.view(self._clock()),
            tenants=self.engine.tracker.tenants,
            gate_failures=self.engine.gate_failures,
            gate_method=self.engine.gate.method,
            handovers=self.engine.handovers,
            departed=self.engine.departed(self._clock()),
            swaps=self.engine.swaps,
            swap_refusals=self.engine.swap_refusals,
            host_floor_bytes=self.engine.host_floor_bytes,
            reloads=self._reloads,
            uptime_s=self._clock() - self._started,
        )

    async def handle_command(
        self, cmd: str, args: dict[str, Any], peer: Peer
    ) -> dict[str, Any] | EncodedResult:
        """Answer one control request (already validated and authorised).

        Raises:
            ControlError: the request is refused; its code and message say why.
        """
        if cmd == "ping":
            return {"version": __version__}
        if cmd == "status":
            self._cached_status()
            assert self._status_bytes is not None
            return self._status_bytes
        if cmd == "tenants":
            view = self.engine.scheduler.view(self._clock())
            return {
                "tenants": [
                    tenant_json(
                        self.engine.tracker.tenants.get(t.tenant),
                        t.tenant,
                        t.state,
                        self.engine.gate_failures.get(t.tenant),
                        t.ledger,
                        resident=t.resident,
                        swap_refusal=self.engine.swap_refusals.get(t.tenant),
                    )
                    for t in view.tenants
                ]
            }
        if cmd == "set-tq":
            return await self._set_tq(args, peer)
        if cmd == "set-mode":
            return await self._set_mode(args, peer)
        if cmd in ("sim-attach", "sim-detach"):
            return self._sim(cmd, args)
        if cmd == "register":
            return await self._register(args)
        if cmd == "unregister":
            return await self._unregister(args)
        raise ControlError("unknown-command", f"unknown command {cmd!r}")

    def _gpu_of(self, ref: object) -> str:
        for device in self.devices:
            if ref in (str(device.index), device.uuid):
                return str(device.index)
        known = ", ".join(str(d.index) for d in self.devices) or "none"
        raise ControlError("invalid-value", f"no GPU {ref!r} on this node (GPUs: {known})")

    async def _set_tq(self, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        tq = args.get("tq")
        if (
            isinstance(tq, bool)
            or not isinstance(tq, int | float)
            or not math.isfinite(tq)
            or tq <= 0
        ):
            raise ControlError("invalid-value", f"TQ must be a number of seconds > 0, not {tq!r}")
        if tq > 86400:
            raise ControlError("invalid-value", f"TQ of {tq:g} s is more than a day; refusing")
        before = self.policies()
        if args.get("gpu") is None:
            self.overrides.tq = float(tq)
            self.overrides.gpu_tq.clear()
            gpus = [str(d.index) for d in self.devices]
        else:
            gid = self._gpu_of(args["gpu"])
            self.overrides.gpu_tq[gid] = float(tq)
            gpus = [gid]
        after = self.policies()
        await self.engine.apply([GpusConfigured(after)])
        log.info(
            "Runtime TQ change by uid %d (not persisted; %s keeps its value)",
            peer.uid,
            self.config_path,
        )
        self._log_tq_changes(before, after)
        warning = SHORT_TQ_WARNING if tq <= 5 else None
        if warning:
            log.warning("TQ %s s: %s", seconds(tq), warning)
        return {"tq": float(tq), "gpus": gpus, "warning": warning}

    async def _set_mode(self, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        mode = args.get("mode")
        if mode not in ("exclusive", "auto", "off", "on"):
            raise ControlError(
                "invalid-value", f"mode must be exclusive, auto, off or on, not {mode!r}"
            )
        if mode == "on":
            self.overrides.scheduling_off = False
            self.overrides.mode = None
        elif mode == "off":
            self.overrides.scheduling_off = True
        else:
            self.overrides.scheduling_off = False
            self.overrides.mode = mode
        policies = self.policies()
        await self.engine.apply([GpusConfigured(policies)])
        modes = sorted({p.mode.value for p in policies.values()})
        log.info(
            "Scheduling mode = %s (runtime change by uid %d, not persisted)",
            "/".join(modes),
            peer.uid,
        )
        return {"mode": "/".join(modes) or mode, "gpus": sorted(policies)}

    async def _register(self, args: dict[str, Any]) -> dict[str, Any]:
        """A container announced by kiwi-hook (OCI createRuntime), with its names.

        With ``kubernetes.admission = "hold"`` and ``hold`` asked for, it is
        queued as if in a burst: if its GPU is busy it is frozen now, before its
        first instruction, and starts at its turn (never killed by an OOM).
        Without a pod name but with device IDs, its names are looked up in the
        kubelet's PodResources API, off the loop (`PodNames`).
        """
        try:
            ident = identity_of_container(
                args["id"],
                args.get("cgroup_v2"),
                args.get("cgroup_v1_freezer"),
                args.get("pid"),
                name=args.get("name"),
                pod=args.get("pod"),
                namespace=args.get("namespace"),
            )
        except ValueError as err:
            raise ControlError("invalid-value", f"container {args['id']}: {err}") from None
        wanted = args.get("gpus") or [str(d.index) for d in self.devices]
        gpus = frozenset(self._gpu_of(g) for g in wanted)
        pid = args.get("pid")
        self.engine.tracker.register(
            Registration(args["id"], ident, gpus, frozenset({pid}) if pid else frozenset())
        )
        if ident.pod is None:
            self.pods.want(ident.key, args.get("device_ids") or ())
        else:
            self.pods.forget(ident.key)
        await self.poll()
        hold = bool(args.get("hold", True)) and self.settings.kubernetes.admission == "hold"
        held = False
        if hold:
            busy = any(
                self.engine.scheduler.tenant_state(other)
                in (TenantState.HOLDER, TenantState.WAITING, TenantState.CORUNNING)
                for other, info in self.engine.tracker.tenants.items()
                if other != ident.key and info.gpus & gpus
            )
            exe = _exe(pid) if pid else None
            if exe is not None and _is_runtime(exe):
                # Called from the createRuntime hook: freezing now would hold the
                # runtime itself (runc waits for its init). Queue it the moment the
                # container's own program has started instead.
                held = busy
                self._hold_tasks.add(
                    asyncio.get_running_loop().create_task(
                        self._hold_after_exec(ident.key, pid or 0, exe)
                    )
                )
                self._hold_tasks = {t for t in self._hold_tasks if not t.done()}
            else:
                await self.engine.apply([ActivitySeen(ident.key)])
                held = self.engine.scheduler.tenant_state(ident.key) is TenantState.WAITING
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

    async def _hold_after_exec(self, key: str, pid: int, runtime_exe: str) -> None:
        """Queue a registered container once its program replaced the runtime's init.

        Bounded: after HOLD_EXEC_TIMEOUT_S it is queued anyway (a container that is
        never started is not waited for forever).
        """
        deadline = self._clock() + HOLD_EXEC_TIMEOUT_S
        while self._clock() < deadline and not self._should_exit:
            exe = _exe(pid)
            if exe is None or exe != runtime_exe:
                break
            await asyncio.sleep(0.005)
        if key in self.engine.tracker.registered and _exe(pid) is not None:
            await self.engine.apply([ActivitySeen(key)])
            if self.engine.scheduler.tenant_state(key) is TenantState.WAITING:
                log.info("Held %s from its first instruction until its turn", key)

    async def _unregister(self, args: dict[str, Any]) -> dict[str, Any]:
        """A container is gone (OCI poststop): forget it, ungating what remains."""
        key = self.engine.tracker.unregister(args["id"])
        if key is not None:
            self.pods.forget(key)
            await self.poll()
            log.info("Unregistered container %s (%s)", args["id"], key)
        return {"removed": key is not None}

    def _sim(self, cmd: str, args: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(self.backend, SimBackend):
            raise ControlError("unavailable", f'{cmd} needs [gpu] backend = "sim"')
        try:
            if cmd == "sim-attach":
                self.backend.attach(
                    int(args["pid"]),
                    int(args.get("gpu", 0)),
                    int(args.get("memory_bytes", 0)),
                    str(args.get("activity", "cpu")),
                )
                return {"attached": int(args["pid"])}
            return {"detached": self.backend.detach(int(args["pid"]))}
        except (KeyError, TypeError, ValueError) as err:
            raise ControlError("invalid-value", str(err)) from None


HOLD_EXEC_TIMEOUT_S = 30.0
_RUNTIMES = ("runc", "crun", "youki", "runsc", "kata")


def _exe(pid: int) -> str | None:
    """The name of the program a process runs (``None``: gone or unreadable).

    ``comm``, not the ``exe`` link: a runtime's init and the container's program
    live in another mount namespace, where the link reads just ``/``.
    """
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _is_runtime(exe: str) -> bool:
    """Whether ``exe`` (a ``comm``) is an OCI runtime's init, e.g. ``runc:[2:INIT]``."""
    return any(runtime in exe for runtime in _RUNTIMES)


def _group_id(name: str) -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        log.warning("Group %r does not exist: only root may change the scheduler", name)
        return None
