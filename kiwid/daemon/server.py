"""kiwid's lifecycle: start, loop, stop (the uvicorn ``Server`` shape).

One asyncio loop: it wakes for the next poll, the scheduler's next deadline,
the systemd watchdog, a signal, a config-file change or a control command,
whichever comes first, and never waits on a gate or a swap (the engine runs
those on threads). Signal handlers only record (STYLE habit 7); reloads from
SIGHUP and from the file watcher run one transaction (:mod:`kiwid.daemon.control.reload`);
the meaning of each control command lives in :mod:`kiwid.daemon.control.commands`.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import math
import signal
import threading
from typing import Any

from kiwid import __version__
from kiwid.adapters.control import ControlServer, SocketInUse
from kiwid.adapters.gpu import GpuBackendError
from kiwid.adapters.metrics import MetricsError, MetricsServer
from kiwid.adapters.watch import ConfigWatcher, WatchError
from kiwid.daemon import adoption
from kiwid.daemon.cdi_spec import write_cdi_spec
from kiwid.daemon.context import Context
from kiwid.daemon.control import reload
from kiwid.daemon.control.admission import Admission
from kiwid.daemon.control.commands import Commands
from kiwid.daemon.control.status import StatusCache, summary_line
from kiwid.daemon.engine.engine import Engine
from kiwid.daemon.engine.runner import ThreadRunner
from kiwid.daemon.gating import recovery
from kiwid.daemon.gating.state import StateError
from kiwid.daemon.logs import seconds
from kiwid.daemon.sampling import poll

log = logging.getLogger("kiwid")

RUNTIME_FAILURE = 1
STARTUP_FAILURE = 3


class StartupError(Exception):
    """kiwid cannot start; the message says why and what to do."""


class Daemon:
    """The running daemon: start-up, the main loop, shutdown; nothing else."""

    def __init__(
        self, ctx: Context, status: StatusCache, admission: Admission, commands: Commands
    ) -> None:
        """Run the parts :func:`kiwid.daemon.main.assemble` wired; :meth:`run` starts them."""
        self.ctx = ctx
        self.status = status
        self.admission = admission
        self.commands = commands
        self.should_exit = False
        self.force_exit = False
        self._reasons: list[str] = []
        self._wake = asyncio.Event()  # set to wake the loop early
        self._forced = asyncio.Event()  # set by a second SIGINT
        self._server: ControlServer | None = None
        self._watcher: ConfigWatcher | None = None
        self._metrics: MetricsServer | None = None
        self._runner: ThreadRunner | None = None
        ctx.engine.on_failure = self._engine_failed

    @property
    def engine(self) -> Engine:
        """The engine (scheduler, tenant table, executor)."""
        return self.ctx.engine

    # ------------------------------------------------------------ signals

    def handle_exit(self, sig: int) -> None:
        """SIGTERM/SIGINT: ask the loop to stop; a second SIGINT forces."""
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
            self._forced.set()
        self.should_exit = True
        self._poke()

    def handle_hup(self) -> None:
        """SIGHUP: queue a reload."""
        self.request_reload("SIGHUP")

    def _engine_failed(self, err: Exception) -> None:
        """The scheduler failed (a bug): stop, letting every tenant go (exit 1)."""
        self.should_exit = True
        self._poke()

    def request_reload(self, reason: str) -> None:
        """Queue a reload (from a signal, the file watcher or a test)."""
        self._reasons.append(reason)
        self._poke()

    def _poke(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------ life cycle

    async def run(self) -> int:
        """Run until SIGTERM/SIGINT; return the process exit code."""
        loop = asyncio.get_running_loop()
        installed = self._install_signals(loop)
        try:
            try:
                await self.startup(loop)
            except StartupError as err:
                log.error("%s", err)
                await self.shutdown()
                return STARTUP_FAILURE
            status = self.status.status()
            self.ctx.notifier.ready(summary_line(status))
            log.info(
                "kiwid %s ready: %d GPU(s), TQ %s s, mode %s, control socket %s",
                __version__,
                len(self.ctx.devices),
                seconds(self.ctx.settings.scheduler.tq),
                self.ctx.settings.scheduler.mode,
                self.ctx.running.control.socket,
            )
            try:
                await self.main_loop()
            except Exception:
                if self.engine.failed is None:  # else logged where the engine failed
                    log.exception("kiwid's main loop failed; ungating every tenant")
                await self.shutdown()
                return RUNTIME_FAILURE
            code = await self.shutdown()
            return RUNTIME_FAILURE if self.engine.failed is not None else code
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

    async def startup(self, loop: asyncio.AbstractEventLoop) -> None:
        """Take the state directory, re-adopt what a previous kiwid left, serve.

        Raises:
            StartupError: the GPUs cannot be listed, another kiwid holds the state
                directory, or the control socket or metrics address is taken.
        """
        ctx = self.ctx
        try:
            ctx.devices = list(ctx.backend.devices())
        except GpuBackendError as err:
            raise StartupError(f"cannot list GPUs: {err}") from err
        try:
            ctx.state.lock()
        except StateError as err:
            raise StartupError(f"daemon.state_dir: {err}") from err
        self._runner = ThreadRunner(self.engine, loop)
        self.engine.runner = self._runner
        adoption.readopt(ctx, poll)
        write_cdi_spec(ctx)
        gid = _group_id(ctx.running.control.admin_group)
        self._server = ControlServer(
            ctx.running.control.socket, self.commands.handle, gid, ctx.running.control.admin_group
        )
        try:
            await self._server.start()
        except (SocketInUse, OSError) as err:
            self._server = None
            raise StartupError(f"control socket {ctx.running.control.socket}: {err}") from err
        if ctx.running.metrics.listen:
            try:
                self._metrics = MetricsServer(
                    ctx.running.metrics.listen, lambda: self._status_from_thread(loop)
                )
                self._metrics.start()
            except MetricsError as err:
                self._metrics = None
                raise StartupError(f"metrics.listen: {err}") from err
            log.info("Metrics on http://%s/metrics", ctx.running.metrics.listen)

        def changed() -> None:  # on the watcher's thread
            loop.call_soon_threadsafe(self.request_reload, "file changed")

        self._watcher = ConfigWatcher(ctx.config_path, changed)
        try:
            self._watcher.start()
        except WatchError as err:
            self._watcher = None
            log.warning("Not watching %s (%s): use systemctl reload kiwid", ctx.config_path, err)

    def _status_from_thread(self, loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
        """The status for a metrics scrape (HTTP thread): built on the loop."""

        async def build() -> dict[str, Any]:
            return self.status.status()

        return asyncio.run_coroutine_threadsafe(build(), loop).result(timeout=5.0)

    async def main_loop(self) -> None:
        """Poll, tick, ping and serve until asked to stop."""
        ctx = self.ctx
        next_poll = ctx.clock()
        watchdog_every = ctx.notifier.watchdog_interval_s()
        next_ping = ctx.clock()
        while not self.should_exit:
            if self._reasons:
                reasons = ", ".join(dict.fromkeys(self._reasons))
                self._reasons.clear()
                reload.reload(ctx, self.status, reasons, lambda: write_cdi_spec(ctx))
            now = ctx.clock()
            if now >= next_poll:
                self.engine.apply(poll(ctx))
                next_poll = now + ctx.settings.gpu.poll_interval
            deadline = self.engine.scheduler.next_deadline()
            if deadline is not None and deadline <= ctx.clock():
                self.engine.tick()
                deadline = self.engine.scheduler.next_deadline()
            overdue = self.engine.next_deadline()  # a job whose driver call hangs
            if overdue is not None and overdue <= ctx.clock():
                self.engine.expire()
                overdue = self.engine.next_deadline()
            deadline = min((d for d in (deadline, overdue) if d is not None), default=None)
            if watchdog_every is not None and ctx.clock() >= next_ping:
                ctx.notifier.watchdog()  # from the loop: a hung loop stops the pings
                next_ping = ctx.clock() + watchdog_every
            self.status.tell_systemd()
            wake_at = min(next_poll, math.inf if deadline is None else deadline)
            if watchdog_every is not None:
                wake_at = min(wake_at, next_ping)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, wake_at - ctx.clock()))
            self._wake.clear()

    async def shutdown(self) -> int:
        """Stop serving, let work in progress end, let go of every tenant.

        Bounded by ``daemon.shutdown_timeout`` (0.5 s after a second SIGINT).
        Returns 0 if nothing stays gated, else RUNTIME_FAILURE (the state file
        keeps what stays, for ``kiwid recover``).
        """
        ctx = self.ctx
        ctx.notifier.stopping()
        log.info("Stopping: ungating every tenant")
        if self._watcher is not None:
            self._watcher.stop()
        if self._server is not None:
            await self._server.close()
        await self.admission.close()
        if self._metrics is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._metrics.stop)
        if not ctx.state.locked:  # it never took the state directory: nothing is ours
            with contextlib.suppress(GpuBackendError):
                ctx.backend.close()
            return 0
        timeout = 0.5 if self.force_exit else ctx.settings.daemon.shutdown_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.engine.stopping = True
        self.engine.executor.drop_queued()  # moot: everyone is let go now
        if self._runner is not None:
            await self._bounded(self._runner.wait_idle(), deadline)
        undo = recovery.undo_with(
            ctx.state.dir, self.engine.effects.gate, self.engine.effects.swapper
        )
        records = list(ctx.state.records.values())
        release: asyncio.Future[dict[str, str]] = loop.create_future()

        def work() -> None:  # a daemon thread: a stuck driver call cannot keep kiwid alive
            kept = recovery.release_all(ctx.state, records, undo)
            with contextlib.suppress(RuntimeError):  # the loop is gone: kiwid gave up waiting
                loop.call_soon_threadsafe(_set_result, release, kept)

        threading.Thread(target=work, name="kiwid-release", daemon=True).start()
        kept = await self._bounded(release, deadline)
        with contextlib.suppress(GpuBackendError):
            ctx.backend.close()
        ctx.workloads.save()
        # A job that outlived the wait may have recorded a tenant since: only an
        # empty record set is removed, and anything left is said.
        if kept is None or kept or not ctx.state.remove_if_empty():
            left = sorted(ctx.state.records)
            log.error(
                "Still gated after %s s: %s; run `kiwid recover` (it reads %s)",
                seconds(timeout),
                ", ".join(left) or "?",
                ctx.state.path,
            )
            ctx.state.unlock()
            return RUNTIME_FAILURE
        ctx.state.unlock()
        log.info("Stopped; no tenant is gated")
        return 0

    async def _bounded(self, awaitable: Any, deadline: float) -> Any:
        """Await ``awaitable`` until ``deadline`` or a forced exit; ``None`` if cut short."""
        task = asyncio.ensure_future(awaitable)
        forced = asyncio.ensure_future(self._forced.wait())
        remaining = max(0.0, deadline - asyncio.get_running_loop().time())
        done, _ = await asyncio.wait(
            {task, forced}, timeout=remaining, return_when="FIRST_COMPLETED"
        )
        forced.cancel()
        if task in done:
            return task.result()
        task.cancel()
        return None


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _group_id(name: str) -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        log.warning("Group %r does not exist: only root may change the scheduler", name)
        return None
