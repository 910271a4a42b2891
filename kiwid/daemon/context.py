"""What the daemon's parts share: the settings in force, the GPUs, the engine.

One owner per fact: each value below lives here and nowhere else; the lifecycle,
the reload, the control commands, admission and status read and change it here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiwid.adapters.gpu import DeviceInfo, GpuBackend, GpuBackendError
from kiwid.adapters.notify import Notifier
from kiwid.config import Settings
from kiwid.core.events import GpusConfigured
from kiwid.core.model import GpuPolicy
from kiwid.daemon import gpu_policy
from kiwid.daemon.engine.engine import Engine
from kiwid.daemon.engine.executor import Lanes
from kiwid.daemon.gating.state import StateFile
from kiwid.daemon.tenants.policy import PolicyBook
from kiwid.daemon.tenants.waker import Waker
from kiwid.daemon.tenants.workloads import WorkloadBook


@dataclass
class ReloadRecord:
    """How the configuration got to be what it is."""

    loaded_at_unix: float = field(default_factory=time.time)
    ok: bool = True
    error: str | None = None
    at_unix: float = field(default_factory=time.time)
    counts: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})
    restart_pending: tuple[str, ...] = ()
    """Restart-only settings the file changed since start (they wait for a restart)."""

    def as_json(self) -> dict[str, Any]:
        """The ``last_reload`` object of the status."""
        return {"ok": self.ok, "at_unix": self.at_unix, "error": self.error}


@dataclass
class Context:
    """The daemon's shared facts."""

    config_path: Path
    settings: Settings
    """The configuration in force (the file's, since the last good reload)."""
    running: Settings
    """The configuration kiwid started with: its restart-only values are in force."""
    backend: GpuBackend
    engine: Engine
    state: StateFile
    workloads: WorkloadBook
    """The workloads remembered across runs (peak footprints, failed checkpoints)."""
    notifier: Notifier
    clock: Callable[[], float]
    can_swap: bool = False
    """Whether something here can move memory (``memory.swap`` needs it)."""
    devices: list[DeviceInfo] = field(default_factory=list)
    unhealthy: set[str] = field(default_factory=set)
    """GPUs (by index) that were lost: not managed until they answer again."""
    read_failures: dict[str, str] = field(default_factory=dict)
    """GPUs that could not be read at the last poll (a passing fault), and why."""
    overrides: gpu_policy.RuntimeOverrides = field(default_factory=gpu_policy.RuntimeOverrides)
    reload: ReloadRecord = field(default_factory=ReloadRecord)
    tenant_policies: PolicyBook = field(default_factory=PolicyBook)
    """Each tenant's weight, priority, TQ and swap policy, and where they came from."""
    waker: Waker = field(default_factory=Waker)
    """What the parked tenants' sockets showed: where each wakes, and its reads' troubles."""
    started: float = 0.0
    """Monotonic time kiwid started at."""
    state_trouble: str | None = None
    """Why the state file kiwid found at start could not be used (``None``: it could)."""

    def policies(self) -> dict[str, GpuPolicy]:
        """The policy in force on every healthy GPU."""
        healthy = [d for d in self.devices if str(d.index) not in self.unhealthy]
        return gpu_policy.policies(self.settings, self.overrides, healthy, can_swap=self.can_swap)

    def configured(self) -> GpusConfigured:
        """The event that tells the scheduler the GPUs and settings in force."""
        return GpusConfigured(self.policies(), self.settings.memory.host_floor_mib * gpu_policy.MIB)

    def lanes(self) -> Lanes:
        """How many swaps may run at once on one GPU, by the settings in force."""
        return Lanes(out=self.settings.memory.checkpoint_lanes)

    def free_bytes(self, gpu: str) -> int | None:
        """A managed GPU's free memory by the driver now (``None``: it cannot be read)."""
        try:
            return self.backend.free_memory(int(gpu))
        except (GpuBackendError, ValueError):
            return None

    def gpu_of(self, ref: object) -> str | None:
        """The index of the GPU ``ref`` names (an index or a UUID), or ``None``."""
        for device in self.devices:
            if ref in (str(device.index), device.uuid):
                return str(device.index)
        return None
