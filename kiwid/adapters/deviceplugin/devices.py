"""The devices Kiwi advertises, their health, and the allocation policy (no gRPC here).

Each managed GPU is advertised as `PluginConfig.replicas` devices ``<uuid>::<n>``
(shared slots). `preferred_allocation` gives each slot a container asks for to a
different GPU where it can, the least loaded first (fewest of its slots already
given out). `allocate_response` answers with CDI device names: Kiwi's
``kiwi.io/gpu=<uuid>`` (its hooks register the container with kiwid) plus NVIDIA's
``nvidia.com/gpu=<uuid>`` when NVIDIA's CDI spec is on the node (device nodes and
driver libraries); without it, ``NVIDIA_VISIBLE_DEVICES`` for the NVIDIA container
runtime. It also puts the container's device IDs into the container (annotation
``kiwi.io/device-ids``, variable ``KIWI_DEVICE_IDS``): kiwi-hook passes them to
kiwid, which finds the container's pod by them in the kubelet's PodResources API.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from kiwid.adapters.deviceplugin._generated import api_pb2 as pb
from kiwid.adapters.deviceplugin.config import PluginConfig
from kiwid.adapters.gpu import DriverUnavailable, GpuBackend, GpuBackendError, GpuLost

__all__ = [
    "DEVICE_IDS_ANNOTATION",
    "DEVICE_IDS_ENV",
    "HEALTHY",
    "UNHEALTHY",
    "BackendHealth",
    "CdiNames",
    "GpuHealth",
    "HealthSource",
    "Inventory",
    "allocate_response",
    "device_id",
    "preferred_allocation",
]

log = logging.getLogger("kiwid.deviceplugin")

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
_SEPARATOR = "::"
_ANNOTATION_PREFIX = "cdi.k8s.io/kiwi-device-plugin_"
# Both carry the container's device IDs, comma-separated. CRI-O passes every
# annotation into the OCI spec, containerd only those its runtime allows
# (container_annotations), so the variable is there for containerd.
DEVICE_IDS_ANNOTATION = "kiwi.io/device-ids"
DEVICE_IDS_ENV = "KIWI_DEVICE_IDS"


@dataclass(frozen=True)
class GpuHealth:
    """A GPU and whether it can be handed out.

    Attributes:
        index: The driver's device index.
        uuid: The GPU's UUID.
        healthy: False once the GPU is lost (fell off the bus, XID, driver gone).
    """

    index: int
    uuid: str
    healthy: bool


HealthSource = Callable[[], Sequence[GpuHealth]]
"""Returns the GPUs and their health now; must not raise."""
CdiNames = Callable[[str], Collection[str]]
"""Returns the device names that the node's CDI specs declare for a kind."""


def device_id(uuid: str, replica: int) -> str:
    """The device ID of one shared slot of a GPU, e.g. ``GPU-5f0c...::2``."""
    return f"{uuid}{_SEPARATOR}{replica}"


def _gpu_of_id(device: str) -> str:
    return device.rpartition(_SEPARATOR)[0] or device


class BackendHealth:
    """A `HealthSource` over a GPU backend (NVML, or the simulated one).

    A GPU is healthy while the backend lists it and can query it:

    * a GPU whose query raises `GpuLost` (fell off the bus, needs a reset) is
      unhealthy until a query succeeds again;
    * a GPU that vanishes from the list stays listed, unhealthy (the kubelet
      would otherwise forget its slots and the pods on them);
    * `DriverUnavailable` (driver unloaded, library gone) makes every GPU seen so
      far unhealthy;
    * any other backend error is taken as transient: the GPU keeps its last
      health (a new GPU counts as healthy), and it is logged.

    Args:
        backend: The GPU backend. Only ``devices()`` and ``processes()`` are used:
            NVML queries create no CUDA context, so the plugin uses no GPU.
    """

    def __init__(self, backend: GpuBackend) -> None:
        self._backend = backend
        self._known: dict[str, GpuHealth] = {}

    def __call__(self) -> list[GpuHealth]:
        """Check every GPU now.

        Returns:
            The GPUs ordered by index.
        """
        try:
            listed = list(self._backend.devices())
        except DriverUnavailable as exc:
            log.warning("the GPU driver is unusable, marking every GPU unhealthy: %s", exc)
            self._known = {u: replace(g, healthy=False) for u, g in self._known.items()}
            return self._sorted()
        except GpuBackendError as exc:
            log.warning("cannot list the GPUs now, keeping their last health: %s", exc)
            return self._sorted()
        seen = set()
        for device in listed:
            seen.add(device.uuid)
            before = self._known.get(device.uuid)
            try:
                self._backend.processes(device.index)
                healthy = True
            except (GpuLost, DriverUnavailable) as exc:
                healthy = False
                if before is None or before.healthy:
                    log.warning("GPU %d (%s) is unhealthy: %s", device.index, device.uuid, exc)
            except GpuBackendError as exc:
                healthy = True if before is None else before.healthy
                log.warning("GPU %d (%s) did not answer now: %s", device.index, device.uuid, exc)
            if healthy and before is not None and not before.healthy:
                log.info("GPU %d (%s) is healthy again", device.index, device.uuid)
            self._known[device.uuid] = GpuHealth(device.index, device.uuid, healthy)
        for uuid, gpu in list(self._known.items()):
            if uuid not in seen and gpu.healthy:
                log.warning("GPU %d (%s) is gone, marking it unhealthy", gpu.index, uuid)
                self._known[uuid] = replace(gpu, healthy=False)
        return self._sorted()

    def _sorted(self) -> list[GpuHealth]:
        return sorted(self._known.values(), key=lambda g: g.index)


class Inventory:
    """The managed GPUs and their health, shared by the streams (thread-safe).

    Every change bumps a generation number and wakes the ``ListAndWatch`` streams.

    Args:
        replicas: Slots per GPU.
        only: GPUs to manage, by index or UUID; empty manages all.
    """

    def __init__(self, replicas: int, only: Collection[str] = ()) -> None:
        self._replicas = replicas
        self._only = frozenset(only)
        self._gpus: dict[str, GpuHealth] = {}
        self._generation = 0
        self._cond = threading.Condition()

    @property
    def replicas(self) -> int:
        """Slots per GPU."""
        return self._replicas

    def update(self, gpus: Sequence[GpuHealth]) -> bool:
        """Replace the GPU list; wake the streams if anything changed.

        Args:
            gpus: What the health source saw.

        Returns:
            True if the list or a GPU's health changed.
        """
        managed = {
            g.uuid: g
            for g in gpus
            if not self._only or g.uuid in self._only or str(g.index) in self._only
        }
        with self._cond:
            if managed == self._gpus:
                return False
            self._gpus = managed
            self._generation += 1
            self._cond.notify_all()
        return True

    def gpus(self) -> list[GpuHealth]:
        """The managed GPUs, ordered by index."""
        with self._cond:
            return sorted(self._gpus.values(), key=lambda g: g.index)

    def snapshot(self) -> tuple[int, list[pb.Device]]:
        """The generation and the full device list, as ``ListAndWatch`` sends it."""
        with self._cond:
            generation = self._generation
            gpus = sorted(self._gpus.values(), key=lambda g: g.index)
        devices = [
            pb.Device(ID=device_id(g.uuid, n), health=HEALTHY if g.healthy else UNHEALTHY)
            for g in gpus
            for n in range(self._replicas)
        ]
        return generation, devices

    def gpu_of(self, device: str) -> GpuHealth | None:
        """The GPU a device ID belongs to, or ``None`` for an unknown ID."""
        uuid, sep, replica = device.rpartition(_SEPARATOR)
        if not sep or not replica.isdigit() or int(replica) >= self._replicas:
            return None
        with self._cond:
            return self._gpus.get(uuid)

    def wait(self, generation: int, timeout_s: float) -> int:
        """Wait until the generation moves past ``generation``, `wake`, or the timeout.

        Args:
            generation: The generation the caller has seen.
            timeout_s: The longest wait, seconds.

        Returns:
            The generation now.
        """
        with self._cond:
            if self._generation == generation:
                self._cond.wait(timeout_s)
            return self._generation

    def wake(self) -> None:
        """Wake every waiting stream so that it re-checks whether it is still wanted."""
        with self._cond:
            self._cond.notify_all()


def preferred_allocation(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    replicas: int,
    order: Mapping[str, int] | None = None,
) -> list[str]:
    """Choose ``size`` slots: distinct GPUs where possible, least loaded first.

    A GPU's load is how many of its slots are already given out (``replicas``
    minus its slots in ``available``). Each next slot goes to a GPU this container
    has no slot on yet if there is one, then to the least loaded, then to the
    lowest in ``order``. ``must_include`` comes first, always.

    Args:
        available: The slots the kubelet may give (healthy and free).
        must_include: The slots that must be in the answer.
        size: How many slots the container asks for.
        replicas: Slots per GPU.
        order: GPU UUID -> rank for ties (the GPU index); default first seen.

    Returns:
        The chosen slot IDs (fewer than ``size`` only if ``available`` is short).
    """
    free: dict[str, list[str]] = {}
    for device in available:
        free.setdefault(_gpu_of_id(device), []).append(device)
    known = order or {}
    rank = {g: known.get(g, len(known) + i) for i, g in enumerate(free)}
    load = {g: replicas - len(ids) for g, ids in free.items()}
    chosen = list(dict.fromkeys(must_include))
    used = set()
    for device in chosen:
        gpu = _gpu_of_id(device)
        used.add(gpu)
        if device in free.get(gpu, []):
            free[gpu].remove(device)
            load[gpu] += 1
    while len(chosen) < size:
        candidates = [g for g, ids in free.items() if ids]
        if not candidates:
            break
        gpu = min(candidates, key=lambda g: (g in used, load[g], rank[g], g))
        chosen.append(free[gpu].pop(0))
        used.add(gpu)
        load[gpu] += 1
    return chosen


def allocate_response(
    gpus: Sequence[GpuHealth],
    config: PluginConfig,
    cdi_names: CdiNames,
    device_ids: Sequence[str] = (),
) -> pb.ContainerAllocateResponse:
    """What one container gets for its GPUs.

    Args:
        gpus: The container's GPUs (distinct).
        config: The plugin settings (CDI kinds).
        cdi_names: Which CDI device names the node's specs declare.
        device_ids: The slots the kubelet allocated to the container.

    Returns:
        CDI device names (also as the ``cdi.k8s.io/`` annotation that containerd
        1.7 and CRI-O read when the kubelet does not pass CDI devices),
        ``NVIDIA_VISIBLE_DEVICES``: ``void`` when NVIDIA's CDI devices are used,
        else the GPUs' UUIDs for the NVIDIA container runtime, and the device IDs
        (`DEVICE_IDS_ANNOTATION`, `DEVICE_IDS_ENV`).
    """
    kiwi = _cdi_names(config.cdi_kind, gpus, cdi_names(config.cdi_kind))
    if len(kiwi) < len(gpus):
        log.warning(
            "kiwid's CDI spec (%s) lacks some of GPUs %s: their containers run ungated; "
            "is kiwid running?",
            config.cdi_kind,
            ", ".join(g.uuid for g in gpus),
        )
    nvidia = _cdi_names(config.nvidia_kind, gpus, cdi_names(config.nvidia_kind))
    envs: dict[str, str] = {}
    if gpus and len(nvidia) == len(gpus):
        envs["NVIDIA_VISIBLE_DEVICES"] = "void"
    else:
        nvidia = []
        envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(g.uuid for g in gpus) or "void"
    names = kiwi + nvidia
    annotations = {}
    if names:
        digest = hashlib.sha256(",".join(g.uuid for g in gpus).encode()).hexdigest()[:16]
        annotations[_ANNOTATION_PREFIX + digest] = ",".join(names)
    if device_ids:
        annotations[DEVICE_IDS_ANNOTATION] = envs[DEVICE_IDS_ENV] = ",".join(device_ids)
    return pb.ContainerAllocateResponse(
        envs=envs,
        annotations=annotations,
        cdi_devices=[pb.CDIDevice(name=n) for n in names],
    )


def _cdi_names(kind: str, gpus: Sequence[GpuHealth], declared: Collection[str]) -> list[str]:
    """``kind=<uuid>`` (or ``kind=<index>``) for each GPU the specs declare."""
    names = []
    for gpu in gpus:
        for candidate in (gpu.uuid, str(gpu.index)):
            if candidate in declared:
                names.append(f"{kind}={candidate}")
                break
    return names
