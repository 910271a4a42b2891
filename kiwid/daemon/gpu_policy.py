"""Per-GPU policies: the config file, overridden by runtime changes (kiwictl).

Runtime changes last until the next reload or restart: the file is the
persistent truth (documented Kiwi behaviour).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kiwid.adapters.gpu import DeviceInfo
from kiwid.config import Settings
from kiwid.core.model import GpuPolicy, Mode, Newcomer, SwapMode

MIB = 2**20


@dataclass
class RuntimeOverrides:
    """What ``kiwictl`` changed since the last (re)load."""

    tq: float | None = None
    gpu_tq: dict[str, float] = field(default_factory=dict)
    scheduling_off: bool = False
    mode: str | None = None
    gpu_mode: dict[str, str] = field(default_factory=dict)


def configured(settings: Settings, device: DeviceInfo) -> tuple[float, float, str]:
    """Return (tq, idle_release, mode) that the file gives ``device``."""
    eff = settings.scheduler.for_gpu(device.index, device.uuid)
    return eff.tq, eff.idle_release, eff.mode


def effective(
    settings: Settings, overrides: RuntimeOverrides, device: DeviceInfo, *, can_swap: bool = False
) -> GpuPolicy:
    """Return the policy in force on ``device``: file, then runtime changes.

    ``memory.swap`` applies only where a swapper exists (``can_swap``).
    """
    tq, idle_release, mode = configured(settings, device)
    gpu = str(device.index)
    if overrides.tq is not None:
        tq = overrides.tq
    tq = overrides.gpu_tq.get(gpu, tq)
    if overrides.mode is not None:
        mode = overrides.mode
    mode = overrides.gpu_mode.get(gpu, mode)
    if overrides.scheduling_off:
        mode = "off"
    return GpuPolicy(
        tq_s=tq,
        idle_release_s=idle_release,
        mode=Mode(mode),
        capacity_bytes=device.memory_total_bytes,
        reserve_bytes=settings.memory.reserve_mib * MIB,
        swap=SwapMode(settings.memory.swap) if can_swap else SwapMode.NONE,
        preempt_after_s=settings.scheduler.preempt_after,
        max_wait_s=settings.scheduler.max_wait or None,
        newcomer=Newcomer(settings.memory.newcomer),
        park=settings.memory.park == "idle",
        link_bytes_per_s=_link(settings),
    )


def _link(settings: Settings) -> tuple[float, float] | None:
    """The swap rates (out, in) the simulated GPU's link is set to (``None``: a real GPU)."""
    if settings.gpu.backend != "sim":
        return None
    return settings.gpu.sim_swap_out_gbps * 1e9, settings.gpu.sim_swap_in_gbps * 1e9


def policies(
    settings: Settings,
    overrides: RuntimeOverrides,
    devices: Sequence[DeviceInfo],
    *,
    can_swap: bool = False,
) -> dict[str, GpuPolicy]:
    """Return every managed GPU's policy, keyed by index."""
    return {str(d.index): effective(settings, overrides, d, can_swap=can_swap) for d in devices}
