"""``kiwid``: the daemon's command line.

    kiwid [--config PATH]            run in the foreground (systemd runs it so)
    kiwid check-config [PATH]        validate a config file; exit 0 or 1
    kiwid recover [--config PATH]    let go of every tenant a dead kiwid left gated

Exit codes: 0 clean stop, 1 runtime failure (or tenants left gated),
2 usage error, 3 start-up failure (bad config, no driver, socket in use).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kiwid import __version__
from kiwid.adapters import cudalock
from kiwid.adapters.cgroups import CgroupError, CgroupLayout
from kiwid.adapters.gpu import DriverUnavailable, GpuBackend
from kiwid.adapters.notify import Notifier
from kiwid.adapters.sim import SimBackend  # stdlib only; the runner imports it anyway
from kiwid.config import ConfigError, LoadedConfig, Settings, check_config_main, load_config
from kiwid.core.scheduler import Scheduler
from kiwid.daemon import gpu_policy
from kiwid.daemon.context import Context
from kiwid.daemon.control.admission import Admission
from kiwid.daemon.control.commands import Commands
from kiwid.daemon.control.status import StatusCache
from kiwid.daemon.engine.deadlines import deadlines
from kiwid.daemon.engine.effects import Effects
from kiwid.daemon.engine.engine import Engine
from kiwid.daemon.engine.executor import Lanes
from kiwid.daemon.engine.tools import SwapGuards
from kiwid.daemon.gating import checkpointable, recovery
from kiwid.daemon.gating.cudagate import CudaLockGate
from kiwid.daemon.gating.gates import FreezeGate, NullGate, TenantGate
from kiwid.daemon.gating.state import StateError, StateFile, StateLocked
from kiwid.daemon.gating.swap import CheckpointSwapper, SimSwapper, Swapper
from kiwid.daemon.logs import setup_logging
from kiwid.daemon.server import STARTUP_FAILURE, Daemon
from kiwid.daemon.tenants.identify import identify
from kiwid.daemon.tenants.tracker import Identity, TenantTracker
from kiwid.daemon.tenants.workloads import WorkloadBook

log = logging.getLogger("kiwid")
DEFAULT_CONFIG = Path("/etc/kiwi.toml")

# Every form of the command, as the module docstring lists them: argparse's own
# usage line would show only the daemon's options (the commands have parsers of
# their own). The indent lines the forms up under the first, after "usage: ".
USAGE = """\
%(prog)s [--config PATH]
       %(prog)s check-config [PATH]
       %(prog)s recover [--config PATH]"""

EPILOG = """\
commands:
  (none)         run the daemon in the foreground
  check-config   validate a config file (default /etc/kiwi.toml); exit 0 if valid
  recover        let go of every tenant recorded as gated, when no kiwid runs
                 (systemd ExecStopPost=)

Reload: SIGHUP (systemctl reload kiwid) or saving the config file.
Exit codes: 0 stopped cleanly, 1 runtime failure or tenants left gated,
2 usage error, 3 start-up failure.
"""


def make_backend(settings: Settings, config_path: Path = DEFAULT_CONFIG) -> GpuBackend:
    """Open the configured GPU backend.

    Args:
        settings: The loaded configuration.
        config_path: The file it came from, which the hint for a machine without a
            GPU names.

    Raises:
        DriverUnavailable: ``nvml`` was asked for and the driver is not usable.
    """
    if settings.gpu.backend == "sim":
        return SimBackend(
            devices=settings.gpu.sim_devices,
            memory_bytes=int(settings.gpu.sim_memory_gib * 2**30),
            # A real GPU keeps its processes when kiwid restarts; so does the sim.
            persist=Path(settings.daemon.state_dir) / "sim.json",
        )
    from kiwid.adapters.nvml import NvmlBackend  # noqa: PLC0415 - loads libnvidia-ml lazily

    backend = NvmlBackend(config=config_path)
    backend.devices()  # fail now, with the HINT, rather than at the first poll
    return backend


def make_gate(settings: Settings) -> TenantGate:
    """The configured gate: the CUDA lock, the freezer, or none without the rights.

    ``auto`` and ``cuda-lock`` probe the driver's lock at start; without it they
    fall back to the freezer and say so.
    """
    method = settings.gpu.gate
    timeout = settings.gpu.gate_timeout
    if os.geteuid() != 0:
        log.warning("Not running as root: tenants will be scheduled and shown but not gated")
        return NullGate()
    if method in ("auto", "cuda-lock"):
        support = cudalock.probe()
        if support.available:
            log.info("Gate: the CUDA driver's process lock (gpu.gate = %s)", method)
            return CudaLockGate(cudalock.CudaLock(), timeout, fence=_fence(timeout))
        level = logging.WARNING if method == "cuda-lock" else logging.INFO
        log.log(
            level,
            "CUDA process lock unavailable (%s): gating with the cgroup freezer",
            support.reason,
        )
    try:
        gate: TenantGate = FreezeGate(CgroupLayout.detect(), timeout)
    except CgroupError as err:
        log.warning("No usable cgroup freezer (%s): tenants will not be gated", err)
        return NullGate()
    log.info("Gate: the cgroup freezer")
    return gate


def _fence(timeout: float) -> FreezeGate | None:
    """The freezer that holds a tenant whose CUDA lock cannot be trusted (``None``: none)."""
    try:
        return FreezeGate(CgroupLayout.detect(), timeout)
    except CgroupError as err:
        log.warning("No cgroup freezer to fence a tenant whose lock fails: %s", err)
        return None


def make_swapper(settings: Settings, backend: GpuBackend, gate: TenantGate) -> Swapper | None:
    """What can move waiting tenants' memory to host RAM here (``None``: nothing).

    Made whatever ``memory.swap`` says, so that a reload can turn swapping on.
    The driver's checkpoint needs the process locked, so it comes with the CUDA
    lock gate only; the simulated GPU swaps with any gate.
    """
    if isinstance(backend, SimBackend):
        gbps = 1e9
        return SimSwapper(
            backend, settings.gpu.sim_swap_out_gbps * gbps, settings.gpu.sim_swap_in_gbps * gbps
        )
    if isinstance(gate, CudaLockGate) and gate.lock.can_swap:
        return CheckpointSwapper(gate.lock)
    if settings.memory.swap != "none":
        why = (
            "the driver lacks cuCheckpointProcessCheckpoint"
            if isinstance(gate, CudaLockGate)
            else f"it needs the CUDA lock gate, and the gate is {gate.method!r}"
        )
        log.warning("memory.swap = %s is off: %s", settings.memory.swap, why)
    return None


def assemble(
    config_path: Path,
    loaded: LoadedConfig,
    *,
    backend: GpuBackend,
    gate: TenantGate,
    identify: Callable[[int], Identity | None],
    notifier: Notifier | None = None,
    clock: Callable[[], float] = time.monotonic,
    swapper: Swapper | None = None,
    lanes: Lanes | None = None,
) -> Daemon:
    """Wire the daemon's parts; :meth:`Daemon.run` starts them.

    The state file, the engine (scheduler, tenant tracker, effects), the shared
    context, the status cache, admission and the control commands.
    """
    settings = loaded.settings
    state = StateFile(settings.daemon.state_dir)
    workloads = WorkloadBook(settings.daemon.state_dir)
    effects = Effects(gate, state, swapper, clock)
    engine = Engine(Scheduler(), TenantTracker(identify), effects, clock, lanes=lanes)
    ctx = Context(
        config_path=config_path,
        settings=settings,
        running=settings,
        backend=backend,
        engine=engine,
        state=state,
        workloads=workloads,
        notifier=notifier or Notifier(),
        clock=clock,
        can_swap=swapper is not None,
        started=clock(),
    )
    ctx.tenant_policies.reload(settings.tenants)
    # memory.checkpoint_retry_after as in force now: read from the settings a reload swaps.
    workloads.retry_after_s = lambda: ctx.settings.memory.checkpoint_retry_after
    engine.executor.lanes = lanes or ctx.lanes()
    effects.tools.guards = SwapGuards(
        free_bytes=ctx.free_bytes,
        reserve_bytes=lambda: ctx.settings.memory.reserve_mib * gpu_policy.MIB,
        unswappable=checkpointable.why_not,
        checkpoint_failed=workloads.checkpoint_failed,
        pid_bytes=engine.tracker.memory_of,
    )
    # gpu.driver_timeout as in force now: a failing gate is tried again that long,
    # and each job gets its deadline from it (read from the settings a reload swaps).
    effects.tools.retry_for_s = lambda: ctx.settings.gpu.driver_deadline_s
    engine.deadline_s = deadlines(
        lambda: ctx.settings.gpu.driver_deadline_s, lambda: ctx.settings.gpu.gate_timeout, swapper
    )
    for warning in loaded.warnings:
        log.warning("%s: %s", config_path, warning)
    status = StatusCache(ctx)
    admission = Admission(ctx)
    return Daemon(ctx, status, admission, Commands(ctx, status, admission))


def run(argv: Sequence[str]) -> int:
    """``kiwid [--config PATH]``."""
    parser = argparse.ArgumentParser(
        prog="kiwid",
        usage=USAGE,
        description="Kiwi's GPU-sharing daemon: exclusive time quanta, round-robin.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG,
        metavar="PATH",
        help="config file (default %(default)s)",
    )
    parser.add_argument("--version", action="version", version=f"kiwid {__version__}")
    args = parser.parse_args(argv)
    setup_logging("info")
    try:
        loaded = load_config(args.config)
    except ConfigError as err:
        log.error("Cannot start:\n%s", err)
        return STARTUP_FAILURE
    setup_logging(loaded.settings.daemon.log_level)
    try:
        backend = make_backend(loaded.settings, args.config)
    except DriverUnavailable as err:
        log.error("Cannot start: %s", err)
        return STARTUP_FAILURE
    gate = make_gate(loaded.settings)
    daemon = assemble(
        args.config,
        loaded,
        backend=backend,
        gate=gate,
        identify=identify,
        swapper=make_swapper(loaded.settings, backend, gate),
    )
    return asyncio.run(daemon.run())


def recover(argv: Sequence[str]) -> int:
    """``kiwid recover``: let go of every tenant in the state file (no kiwid running)."""
    parser = argparse.ArgumentParser(
        prog="kiwid recover",
        description="Let go of every tenant that a kiwid recorded as gated: bring its memory "
        "back from host RAM if it was swapped, thaw or unlock it, forget the record. For after "
        "a crash or SIGKILL; systemd runs it as ExecStopPost=. It refuses (exit 3) while a "
        "kiwid runs on the same state directory: that kiwid manages those tenants.",
        epilog="Exit codes: 0 nothing is gated any more, 1 something stays gated or a record "
        "was unusable (the log says which), 2 usage error, 3 a kiwid is running.",
    )
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="config file (default %(default)s)"
    )
    parser.add_argument(
        "--state-dir", help="state directory (default: from the config file, else its default)"
    )
    args = parser.parse_args(argv)
    setup_logging("info")
    state_dir = args.state_dir
    if state_dir is None:
        try:
            state_dir = load_config(args.config).settings.daemon.state_dir
        except ConfigError as err:
            state_dir = Settings().daemon.state_dir
            log.warning("Config unreadable (%s); using %s", err, state_dir)
    state = StateFile(state_dir)
    if not state.dir.is_dir():
        log.info("Nothing is gated (no state directory %s)", state.dir)
        return 0
    try:
        state.lock()
    except StateLocked as err:
        log.error("Not recovering: %s", err)
        return STARTUP_FAILURE
    except StateError as err:
        log.error("%s", err)
        return 1
    try:
        try:
            records = state.load()
        except StateError as err:
            log.error("%s", err)
            return 1
        recovery.report_skipped(state)
        if state.skipped:
            state.replace_all(records)
        kept = recovery.release_all(state, records.values(), recovery.undo_with(state.dir))
        if kept or state.skipped:
            return 1
        state.remove_if_empty()
        log.info("Nothing is gated (%d tenant(s) let go)", len(records))
        return 0
    finally:
        state.unlock()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kiwid`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "check-config":
        return check_config_main(args[1:])
    if args and args[0] == "recover":
        return recover(args[1:])
    if args and args[0] == "run":
        args = args[1:]
    return run(args)
