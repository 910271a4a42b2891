"""Grouped, frozen settings for kiwid.

Every class here is a plain value: it can be built in code (``Settings()`` is the
default configuration), compared and hashed. Reading and validating TOML is the job of
:mod:`kiwid.config.loader`; the allowed values are documented on each field and
enforced there.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from kiwid.config.tenant_rules import TenantRule

MODES = ("exclusive", "auto", "off")
"""Scheduling modes, see :attr:`SchedulerSettings.mode`."""

BACKENDS = ("nvml", "sim")
"""GPU backends, see :attr:`GpuSettings.backend`."""

GATES = ("auto", "freeze", "cuda-lock")
"""Gate methods, see :attr:`GpuSettings.gate`."""

SWAPS = ("none", "checkpoint", "auto")
"""Memory swapping, see :attr:`MemorySettings.swap`."""

PARKS = ("idle", "off")
"""Parking idle tenants, see :attr:`MemorySettings.park`."""

NEWCOMERS = ("whole-card", "free")
"""What a newcomer gets, see :attr:`MemorySettings.newcomer`."""

LOG_LEVELS = ("debug", "info", "warning", "error")
"""Log levels, see :attr:`DaemonSettings.log_level`."""


@dataclass(frozen=True)
class GpuOverride:
    """Scheduler settings for one GPU; ``None`` keeps the global value.

    Keyed in :attr:`SchedulerSettings.gpu` by decimal index (``"0"``) or by UUID
    (``"GPU-…"``, ``"MIG-…"``); see :meth:`SchedulerSettings.for_gpu`.
    """

    tq: float | None = None
    """Time quantum on this GPU in seconds, or ``None`` for the global ``tq``."""

    idle_release: float | None = None
    """Idle release on this GPU in seconds, or ``None`` for the global value."""

    mode: str | None = None
    """Mode on this GPU (one of :data:`MODES`), or ``None`` for the global mode."""


class GpuOverrides(Mapping[str, GpuOverride]):
    """Read-only, hashable map from GPU key (index or UUID) to its override.

    A plain ``dict`` would make the settings mutable and unhashable, and a
    ``MappingProxyType`` is not hashable either; this small map is both immutable
    and hashable, so the frozen settings stay usable as values.
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, GpuOverride] | None = None) -> None:
        """Copy ``items`` (default: empty)."""
        self._items: dict[str, GpuOverride] = dict(items or {})

    def __getitem__(self, key: str) -> GpuOverride:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return f"GpuOverrides({self._items!r})"


class EffectivePolicy(NamedTuple):
    """The scheduler settings that apply to one GPU after overrides."""

    tq: float
    """Time quantum in seconds."""

    idle_release: float
    """Idle release in seconds."""

    mode: str
    """One of :data:`MODES`."""


@dataclass(frozen=True)
class SchedulerSettings:
    """How GPU time is shared: quantum, idle release and mode (``[scheduler]``)."""

    tq: float = 30.0
    """Time quantum in seconds: how long a tenant holds a GPU exclusively while others
    wait. Default 30. Each hand-over moves the tenant's GPU memory, so a large TQ
    favours throughput and a small one interactivity; 5 s or less draws a warning.
    Must be > 0."""

    idle_release: float = 5.0
    """Seconds without GPU activity after which the holder yields early, and after
    which a waiting tenant whose turn came goes back to idle. Default 5, so an idle
    holder does not waste a whole quantum. Must be > 0."""

    mode: str = "exclusive"
    """``"exclusive"`` always rotates bursts; ``"auto"`` only gates when the tenants'
    footprints do not fit in the card's memory minus ``memory.reserve_mib``;
    ``"off"`` does no gating. Default ``"exclusive"``: the safe, predictable choice."""

    gpu: Mapping[str, GpuOverride] = field(default=GpuOverrides())
    """Per-GPU overrides keyed by decimal index (``"0"``) or UUID (``"GPU-…"`` or
    ``"MIG-…"``). Default empty: every GPU uses the global values. Any mapping given
    is copied into an immutable :class:`GpuOverrides`."""

    preempt_after: float = 0.0
    """Seconds of a holder's quantum after which a waiting tenant of a higher priority
    preempts it (the holder is gated, keeps the rest of its quantum and waits at the
    front of its class). Default 0: at once. Must be >= 0."""

    max_wait: float = 0.0
    """The longest a tenant waits behind higher priority classes, in seconds, before
    it gets one quantum all the same. Default 0: no bound (a lower class waits as
    long as a higher one bursts). Must be >= 0."""

    handover_allowance: float = 2.0
    """Seconds budgeted for one hand-over (freeze, memory move, thaw) when bounding
    how long a tenant can starve, so the bound stays honest when memory moves are
    slow. Default 2. Must be > 0."""

    def __post_init__(self) -> None:
        """Freeze ``gpu`` so the settings stay immutable and hashable."""
        if not isinstance(self.gpu, GpuOverrides):
            object.__setattr__(self, "gpu", GpuOverrides(self.gpu))

    def for_gpu(self, index: int, uuid: str) -> EffectivePolicy:
        """Return the settings in force on one GPU.

        Each field is taken from the UUID override if it sets it, else from the index
        override, else from the global value.

        Args:
            index: The GPU's index as NVML numbers it.
            uuid: The GPU's UUID (``"GPU-…"`` or, for a MIG instance, ``"MIG-…"``).

        Returns:
            The effective ``(tq, idle_release, mode)``.
        """
        tq, idle_release, mode = self.tq, self.idle_release, self.mode
        for key in (str(index), uuid):  # later keys win
            override = self.gpu.get(key)
            if override is None:
                continue
            if override.tq is not None:
                tq = override.tq
            if override.idle_release is not None:
                idle_release = override.idle_release
            if override.mode is not None:
                mode = override.mode
        return EffectivePolicy(tq, idle_release, mode)


@dataclass(frozen=True)
class GpuSettings:
    """Where GPU facts come from (``[gpu]`` and ``[gpu.sim]``)."""

    backend: str = "nvml"
    """``"nvml"`` reads real GPUs through the NVIDIA driver; ``"sim"`` simulates
    ``sim_devices`` GPUs for tests and demos. Default ``"nvml"``."""

    poll_interval: float = 0.5
    """Seconds between polls of GPU activity and memory. Default 0.5: fine enough to
    notice idleness within ``idle_release``, cheap for NVML. Range 0.05 to 60."""

    gate: str = "auto"
    """How a waiting tenant is kept off the GPU: ``"freeze"`` freezes its cgroup
    (its CPU work stops too), ``"cuda-lock"`` takes the driver's process lock (only
    its CUDA calls stop; needs driver r550+), ``"auto"`` the lock where the driver
    has it, else the freezer. Default ``"auto"``: a frozen notebook or inference
    server stops answering, a locked one does not."""

    gate_timeout: float = 2.0
    """Seconds a gate may take (freeze until the cgroup reports frozen, or the
    driver's lock) before the tenant is let go again and runs on. Default 2.
    Range 0.1 to 60, and at most half the service watchdog
    (:attr:`ServiceLimits.max_gate_timeout_s`: 15 s under the shipped unit's
    ``WatchdogSec=30s``): kiwid pings the watchdog every half interval from the
    loop that waits for gates, so a longer gate could let it expire."""

    driver_timeout: float = 10.0
    """Seconds a driver call (lock, unlock, a process's state) or a gate that keeps
    failing may take before its tenant is stuck: it stays gated (fenced with the
    freezer if its lock cannot be trusted), holds nothing, and the others rotate on.
    A checkpoint or restore gets this plus twice its size at the slowest rate
    expected (1 GB/s out, 2 GB/s in; the simulated GPU's own rates). Default 10.
    Range 1 to 3600; a value below ``gate_timeout`` counts as ``gate_timeout`` (a
    lock may take that long before the driver answers)."""

    @property
    def driver_deadline_s(self) -> float:
        """``driver_timeout``, but never shorter than ``gate_timeout``."""
        return max(self.driver_timeout, self.gate_timeout)

    sim_devices: int = 1
    """Number of simulated GPUs (``[gpu.sim] devices``) for backend ``"sim"``.
    Default 1. Range 1 to 64."""

    sim_memory_gib: float = 80.0
    """Memory of each simulated GPU in GiB (``[gpu.sim] memory_gib``). Default 80,
    an H100-class card. Must be > 0."""

    sim_swap_out_gbps: float = 2.2
    """How fast the simulated GPU swaps memory out to host RAM, GB/s (``[gpu.sim]
    swap_out_gbps``): a swap-out of N bytes takes N / rate seconds. Default 2.2,
    the driver's checkpoint as measured on an H200. Must be > 0."""

    sim_swap_in_gbps: float = 5.5
    """How fast the simulated GPU swaps memory back in, GB/s (``[gpu.sim]
    swap_in_gbps``). Default 5.5, the driver's restore on an H200. Must be > 0."""


@dataclass(frozen=True)
class ControlSettings:
    """The ``kiwictl`` control socket (``[control]``)."""

    socket: str = "/run/kiwi/kiwid.sock"
    """Absolute path of the Unix control socket. Default ``/run/kiwi/kiwid.sock``,
    in the runtime directory systemd creates (mode 0755, so every user reaches the
    socket; kiwid checks who may change what). At most 107 bytes (the ``sun_path``
    limit), no control characters, and outside :attr:`DaemonSettings.state_dir`:
    that directory is mode 0700, so no one but root could reach a socket in it."""

    admin_group: str = "kiwi"
    """Group whose members may send commands (drain, pause) on the socket; others may
    only read status. Default ``"kiwi"``."""


@dataclass(frozen=True)
class DaemonSettings:
    """Daemon lifecycle and logging (``[daemon]``)."""

    state_dir: str = "/run/kiwi/state"
    """Absolute path of the directory for runtime state such as which cgroups are
    gated: mode 0700, its files 0600, because they hold other users' container and
    process names. Default ``/run/kiwi/state``: on a tmpfs cleared on boot, like the
    state itself, and beside (not above) the control socket. It must be a directory
    or not exist yet (kiwid creates it), hold no control characters, and neither be
    nor contain :attr:`ControlSettings.socket`."""

    shutdown_timeout: float = 10.0
    """Seconds a graceful shutdown waits for thawed tenants to settle before forcing
    its way out. Default 10. Must be > 0 and at most 75
    (:attr:`ServiceLimits.max_shutdown_timeout_s`): the shipped unit's
    ``TimeoutStopSec=90s`` less 15 s for ``kiwid recover``, which systemd runs next
    (``ExecStopPost=``) to thaw what a forced stop left gated."""

    log_level: str = "info"
    """Least severe level logged, one of :data:`LOG_LEVELS`. Default ``"info"``."""


@dataclass(frozen=True)
class MemorySettings:
    """GPU memory: fitting tenants together, swapping waiters out (``[memory]``)."""

    reserve_mib: int = 1024
    """MiB kept free on each card when deciding whether tenants fit together (mode
    ``"auto"``, and before swapping a tenant in). Default 1024, room for the CUDA
    context and allocator slack. Must be >= 0."""

    swap: str = "none"
    """What happens to a waiting tenant's GPU memory: ``"none"`` it stays on the card
    (every working set must fit together); ``"checkpoint"`` every waiter's memory
    goes to host RAM through the driver's checkpoint API, so working sets larger
    than the card run in turn; ``"auto"`` memory goes to host RAM only when the
    next tenant would not fit beside it. Swapping needs the CUDA lock gate
    (``gpu.gate = "cuda-lock"``, or ``"auto"`` on driver r550+); without it kiwid
    says so at start and swaps nothing. Default ``"none"``."""

    park: str = "idle"
    """What happens to an idle tenant whose memory went to host RAM: ``"idle"`` it
    parks (gated, out of the queue, its memory left in host RAM) until a request waits
    on one of its sockets or ``kiwictl wake`` wakes it; woken, it parks again after a
    turn in which it did no GPU work. ``"off"`` it is queued again like any waiter, restored
    at its turn whether it has work or not. Only where memory moves (``swap`` is not
    ``"none"``). Default ``"idle"``."""

    host_floor_mib: int = 4096
    """MiB of available host RAM that a swap-out must leave: one that would go below
    is not done (the tenant stays gated with its memory on the card, and status says
    why). Default 4096. Must be >= 0."""

    checkpoint_lanes: int = 1
    """How many swap-outs (checkpoints) may run at once on one GPU. A swap-in always
    runs beside them (the host link is full duplex), one at a time. Default 1: on an
    H200 with driver r580 concurrent checkpoints share the driver's copy rate (see
    docs/memory.md). Range 1 to 8."""

    newcomer: str = "whole-card"
    """What a tenant gets on its first turn when nobody knows its working set (it
    never held the GPU, and its workload never ran here before): ``"whole-card"``
    every other tenant's memory leaves first, so it may allocate all it wants, at
    the cost of one slow first hand-over; ``"free"`` only what it showed so far is
    made room for: a faster first turn, but a job that then grows beyond what is
    free runs out of memory. Default ``"whole-card"``."""

    checkpoint_retry_after: float = 86400.0
    """Seconds after which a workload whose checkpoint the driver failed is tried
    again (its runs are kept on the card until then). Drivers and applications
    change: an upgrade may checkpoint what an older driver could not, and the job
    may stop using CUDA IPC or managed memory. ``kiwictl workloads`` shows when
    each mark expires; ``kiwictl forget`` clears one at once. Default 86400 (a
    day); 0 tries again at every run. Range 0 to 31536000 (a year)."""


@dataclass(frozen=True)
class MetricsSettings:
    """Prometheus metrics (``[metrics]``)."""

    listen: str = ""
    """``"host:port"`` to serve ``/metrics`` on (e.g. ``"127.0.0.1:9417"``), or
    ``""`` for no metrics endpoint. Default ``""``: off, nothing listens unasked."""


ADMISSIONS = ("hold", "none")
"""Admission policies, see :attr:`KubernetesSettings.admission`."""


@dataclass(frozen=True)
class KubernetesSettings:
    """Kubernetes nodes: device plugin, CDI and container hooks (``[kubernetes]``)."""

    resource: str = "kiwi.io/gpu"
    """Extended resource name the device plugin advertises. Default ``"kiwi.io/gpu"``."""

    replicas: int = 4
    """Shared slots per managed GPU: how many pods may be given one GPU. Default 4.
    Range 1 to 64."""

    admission: str = "hold"
    """``"hold"``: a container registered while its GPU is busy starts frozen and
    waits for its turn (never killed by an out-of-memory error); ``"none"``: it
    starts at once and is gated at its first burst. Default ``"hold"``."""

    cdi_dir: str = "/var/run/cdi"
    """Directory kiwid writes its CDI spec into (absolute path), or ``""`` for none."""

    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"
    """The kubelet's device-plugin directory (absolute path; kubelet.sock lives there)."""

    gpus: tuple[str, ...] = ()
    """GPUs (indices or UUIDs) the device plugin hands out; empty: all. Leave the
    others to NVIDIA's device plugin so the two never hand out the same GPU."""

    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    """The kubelet's PodResources API socket (absolute path), or ``""`` for none.
    kiwid asks it for the pod and container of a registered container that carries
    the device plugin's device IDs but no names in its annotations."""


@dataclass(frozen=True)
class Settings:
    """The whole kiwid configuration; ``Settings()`` is the default."""

    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    """``[scheduler]``: quantum, idle release, mode and per-GPU overrides."""

    gpu: GpuSettings = field(default_factory=GpuSettings)
    """``[gpu]``: GPU backend and polling."""

    control: ControlSettings = field(default_factory=ControlSettings)
    """``[control]``: the control socket."""

    daemon: DaemonSettings = field(default_factory=DaemonSettings)
    """``[daemon]``: state directory, shutdown and logging."""

    memory: MemorySettings = field(default_factory=MemorySettings)
    """``[memory]``: memory reserve, swapping to host RAM and its floor."""

    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    """``[metrics]``: the Prometheus endpoint (off by default)."""

    kubernetes: KubernetesSettings = field(default_factory=KubernetesSettings)
    """``[kubernetes]``: device plugin, CDI spec and container admission."""

    tenants: tuple[TenantRule, ...] = ()
    """``[[tenants]]``: per-tenant weight, priority, TQ and swap; the first rule that
    matches a tenant wins. Hot-reloaded like TQ."""


@dataclass(frozen=True)
class ServiceLimits:
    """What the systemd service allows kiwid; some settings must fit inside.

    Not read from the TOML file: the defaults are the shipped unit's
    (``systemd/kiwid.service``), and :func:`kiwid.config.loader.service_limits` takes
    the watchdog systemd actually gave from the environment.
    """

    watchdog_s: float = 30.0
    """The service watchdog interval in seconds. Default 30, the shipped unit's
    ``WatchdogSec=30s``; ``WATCHDOG_USEC`` when systemd runs kiwid with a watchdog.
    kiwid pings at half of it from the loop that waits for gates, so
    ``gpu.gate_timeout`` may be at most that half."""

    watchdog_source: str = "WatchdogSec=30s in the shipped unit"
    """Where :attr:`watchdog_s` came from, for messages."""

    stop_timeout_s: float = 90.0
    """How long systemd lets a stop take before it kills kiwid, in seconds: the
    shipped unit's ``TimeoutStopSec=90s``."""

    recover_s: float = 15.0
    """Seconds of :attr:`stop_timeout_s` kept for ``kiwid recover``, which systemd
    runs next (``ExecStopPost=``) to thaw what a forced stop left gated. Default 15.
    ``daemon.shutdown_timeout`` may be at most ``stop_timeout_s - recover_s``."""

    @property
    def max_gate_timeout_s(self) -> float:
        """The longest ``gpu.gate_timeout`` the watchdog survives, in seconds."""
        return self.watchdog_s / 2

    @property
    def max_shutdown_timeout_s(self) -> float:
        """The longest ``daemon.shutdown_timeout`` that leaves time for recover, in seconds."""
        return self.stop_timeout_s - self.recover_s
