"""kiwid's CDI spec: ``kiwi.io/gpu=<index|uuid>`` devices that run kiwi-hook.

Written at start and refreshed at each good reload. Everything in it that names
where kiwid is bound (the control socket, the directory) comes from the settings
kiwid started with: a reload that changes ``control.socket`` must not send hooks
to a socket nobody serves yet.
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

from kiwid.adapters import cdi
from kiwid.daemon.context import Context

log = logging.getLogger("kiwid")


def write_cdi_spec(ctx: Context) -> None:
    """Write (or refresh) the CDI spec.

    Off when ``kubernetes.cdi_dir`` is empty. A missing kiwi-hook or an
    unwritable directory is logged, not fatal: containers then start ungated.
    """
    directory = ctx.running.kubernetes.cdi_dir  # restart-only
    if not directory:
        return
    hook = shutil.which("kiwi-hook") or str(Path(sys.executable).with_name("kiwi-hook"))
    if not Path(hook).is_file():
        log.warning("No kiwi-hook executable found: not writing the CDI spec in %s", directory)
        return
    nvidia = bool(cdi.find_devices(cdi.NVIDIA_KIND))
    nodes = None
    if ctx.backend.name == "nvml" and not nvidia:
        nodes = cdi.find_device_nodes(d.index for d in ctx.devices)
    try:
        spec = cdi.build_spec(
            ctx.devices,
            hook,
            nvidia,
            ctx.running.control.socket,  # restart-only: the socket kiwid serves
            admission=ctx.settings.kubernetes.admission,
            device_nodes=nodes,
        )
        if cdi.write_spec(spec, directory):
            log.info(
                "CDI spec written: %s/%s (%d GPU(s)%s)",
                directory,
                cdi.DEFAULT_NAME,
                len(ctx.devices),
                ", beside NVIDIA's spec" if nvidia else "",
            )
    except (OSError, ValueError) as err:
        log.warning("Cannot write the CDI spec in %s: %s", directory, err)
