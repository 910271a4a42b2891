"""The reload transaction: one for SIGHUP, a saved file and a test alike.

systemd is told ``RELOADING=1``; the file is parsed and validated; then it is
swapped in at once (runtime changes from kiwictl end: the file is the persistent
truth), or refused whole, the old configuration staying in force. Settings that
shape what the daemon is bound to take effect at the next restart: a reload that
changes one says so in the log and status shows it as ``restart_pending``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kiwid.config import ConfigError, Settings, load_config
from kiwid.daemon import gpu_policy
from kiwid.daemon.context import Context
from kiwid.daemon.control.commands import log_tq_changes
from kiwid.daemon.control.status import StatusCache, summary_line
from kiwid.daemon.logs import set_level

log = logging.getLogger("kiwid")

RESTART_ONLY: tuple[tuple[str, Callable[[Settings], object]], ...] = (
    ("gpu.backend", lambda s: s.gpu.backend),
    (
        "gpu.sim",
        lambda s: (
            s.gpu.sim_devices,
            s.gpu.sim_memory_gib,
            s.gpu.sim_swap_out_gbps,
            s.gpu.sim_swap_in_gbps,
        ),
    ),
    ("gpu.gate", lambda s: s.gpu.gate),
    ("gpu.gate_timeout", lambda s: s.gpu.gate_timeout),
    ("control.socket", lambda s: s.control.socket),
    ("control.admin_group", lambda s: s.control.admin_group),
    ("daemon.state_dir", lambda s: s.daemon.state_dir),
    ("metrics.listen", lambda s: s.metrics.listen),
    ("kubernetes.cdi_dir", lambda s: s.kubernetes.cdi_dir),
)
"""Settings that only a restart changes (they shape what the daemon is bound to)."""


def restart_pending(running: Settings, loaded: Settings) -> tuple[str, ...]:
    """The restart-only settings in which ``loaded`` differs from what runs."""
    return tuple(name for name, get in RESTART_ONLY if get(loaded) != get(running))


def reload(ctx: Context, status: StatusCache, reason: str, on_change: Callable[[], None]) -> bool:
    """Reload ``ctx.config_path``; whether the new configuration is in force.

    ``on_change`` runs after a good reload (e.g. to refresh the CDI spec).
    """
    ctx.notifier.reloading()
    status.invalidate()
    log.info("Reloading %s (%s)", ctx.config_path, reason)
    record = ctx.reload
    record.at_unix = time.time()
    try:
        loaded = load_config(ctx.config_path)
    except ConfigError as err:
        record.ok, record.error = False, str(err)
        record.counts["failed"] += 1
        log.error("Reload failed; the running configuration stays in force:\n%s", err)
        ctx.notifier.ready(f"reload failed, running configuration kept: {err}")
        return False
    pending = restart_pending(ctx.running, loaded.settings)
    for name in pending:
        if name not in record.restart_pending:
            log.warning(
                "%s changed in %s: it takes effect at the next restart", name, ctx.config_path
            )
    record.restart_pending = pending
    for warning in loaded.warnings:
        log.warning("%s: %s", ctx.config_path, warning)
    before = ctx.engine.scheduler.policies()
    ctx.settings = loaded.settings
    ctx.overrides = gpu_policy.RuntimeOverrides()  # the file is the persistent truth
    ctx.tenant_policies.reload(ctx.settings.tenants)
    ctx.engine.executor.lanes = ctx.lanes()
    set_level(ctx.settings.daemon.log_level)
    event = ctx.configured()
    ctx.engine.apply([event, *ctx.tenant_policies.events(ctx.engine.tracker.tenants)])
    log_tq_changes(before, dict(event.policies))
    on_change()
    record.loaded_at_unix = record.at_unix
    record.ok, record.error = True, None
    record.counts["ok"] += 1
    status.invalidate()
    ctx.notifier.ready(summary_line(status.status()))
    return True
