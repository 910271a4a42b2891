"""What kiwi-hook tells kiwid about a container: `ContainerInfo` and `container_info`.

From the container's OCI state and bundle: its names (the Kubernetes runtimes'
annotations, or podman's container store), its GPUs and device IDs (its
environment in ``config.json``, the device plugin's annotation), the weight and
priority its pod asks for (brought within what kiwid takes), the GPU memory it
declares (``kiwi.io/gpu-memory``, a Kubernetes quantity) and its cgroup
(`kiwid.hook.cgroup`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiwid.core.model import TenantPolicy
from kiwid.core.quantity import MEMORY_RANGE, QuantityError, declared_bytes
from kiwid.hook.cgroup import _cgroup_from_config, _cgroups_from_proc

GPU_ENV_PREFIX = "KIWI_GPU_"  # kiwid.adapters.cdi.GPU_ENV_PREFIX (adapters do not share)
# Set by the device plugin (kiwid.adapters.deviceplugin.devices): the slots a container got.
DEVICE_IDS_ANNOTATION = "kiwi.io/device-ids"
DEVICE_IDS_ENV = "KIWI_DEVICE_IDS"
# What a pod asks of the scheduler; kiwid caps it by the matching [[tenants]] rule.
WEIGHT_ANNOTATION = "kiwi.io/weight"
PRIORITY_ANNOTATION = "kiwi.io/priority"
# The GPU memory per GPU it declares it needs: unlike a weight, a wrong one fails its start.
MEMORY_ANNOTATION = "kiwi.io/gpu-memory"
# "false": the container never parks when idle (it takes its turns); the rule may say so too.
PARK_ANNOTATION = "kiwi.io/park"
_NUMBER = re.compile(r"\+?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_INTEGER = re.compile(r"[-+]?[0-9]+")
# A priority with more digits reads as infinite, as a weight too large for a float
# does: int() refuses thousands of digits, and the warning names the number read.
_PRIORITY_DIGITS = 40
_MAX_CONFIG_BYTES = 8 * 1024 * 1024
_PROC = Path("/proc")

# Annotation keys, most specific first: Kiwi's own, containerd's CRI plugin, CRI-O.
_NAME_KEYS = ("kiwi.io/name", "io.kubernetes.cri.container-name", "io.kubernetes.container.name")
_POD_KEYS = ("kiwi.io/pod", "io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name")
_NAMESPACE_KEYS = (
    "kiwi.io/namespace",
    "io.kubernetes.cri.sandbox-namespace",
    "io.kubernetes.pod.namespace",
)


@dataclass(frozen=True)
class ContainerInfo:
    """What kiwid is told about a container at ``register``.

    Attributes:
        id: The runtime's container id.
        pid: Host PID of its init process, if the state had one.
        cgroup_v2: Its cgroup in the cgroup2 hierarchy, e.g. ``/kubepods.slice/...``.
        cgroup_v1_freezer: Its cgroup in the v1 freezer hierarchy, if mounted.
        name: The container's name, if known.
        pod: Its pod's name (Kubernetes), if known.
        namespace: Its pod's namespace (Kubernetes), if known.
        gpus: The GPUs (UUIDs or indices) it was given; empty: unknown, i.e. all.
        device_ids: The device plugin's slots the kubelet gave it (Kubernetes), if known.
        weight: The weight its ``kiwi.io/weight`` annotation asks for, if any.
        priority: The priority its ``kiwi.io/priority`` annotation asks for, if any.
        problems: What was wrong with those annotations, for the hook to warn about.
        memory: The GPU memory per GPU (bytes) its ``kiwi.io/gpu-memory`` declares.
        park: What its ``kiwi.io/park`` annotation says (``False``: never park).
        refusal: Why it must not start (a ``kiwi.io/gpu-memory`` that is no memory
            size): running it ungated would let it take memory kiwid never counts.
    """

    id: str
    pid: int | None
    cgroup_v2: str | None
    cgroup_v1_freezer: str | None
    name: str | None
    pod: str | None
    namespace: str | None
    gpus: tuple[str, ...]
    device_ids: tuple[str, ...] = ()
    weight: float | None = None
    priority: int | None = None
    problems: tuple[str, ...] = ()
    memory: int | None = None
    refusal: str | None = None
    park: bool | None = None

    def register_args(self, hold: bool) -> dict[str, Any]:
        """The ``register`` command's arguments (docs/control-protocol.md).

        Args:
            hold: Ask kiwid to start the container frozen if its GPU is busy.

        Returns:
            The arguments; ``device_ids``, ``weight``, ``priority`` and
            ``memory_bytes`` (with ``memory_source`` ``annotation``) only when there
            are some, so that a kiwid older than those arguments still accepts
            containers that do not use them.
        """
        args: dict[str, Any] = {
            "id": self.id,
            "cgroup_v2": self.cgroup_v2,
            "cgroup_v1_freezer": self.cgroup_v1_freezer,
            "pid": self.pid,
            "name": self.name,
            "pod": self.pod,
            "namespace": self.namespace,
            "gpus": list(self.gpus),
            "hold": hold,
        }
        if self.device_ids:
            args["device_ids"] = list(self.device_ids)
        if self.weight is not None:
            args["weight"] = self.weight
        if self.priority is not None:
            args["priority"] = self.priority
        if self.park is not None:
            args["park"] = self.park
        if self.memory is not None:
            args["memory_bytes"] = self.memory
            args["memory_source"] = "annotation"
        return args


def container_info(state: Mapping[str, Any], proc: Path = _PROC) -> ContainerInfo:
    """Work out a container's cgroup, names and GPUs from its state and bundle.

    The cgroup comes from ``/proc/PID/cgroup`` when the init process is there (the
    kernel's answer, whatever cgroup driver the runtime used), else from
    ``linux.cgroupsPath`` in the bundle's ``config.json`` (cgroupfs paths and the
    systemd driver's ``slice:prefix:name``).

    Args:
        state: A state from `parse_state`.
        proc: The proc filesystem (a test may point elsewhere).

    Returns:
        What kiwid needs to know.
    """
    pid: int | None = state.get("pid")
    annotations: Mapping[str, str] = state.get("annotations", {})
    bundle = state.get("bundle")
    config = _read_config(Path(bundle)) if bundle else {}
    v2, v1 = _cgroups_from_proc(proc, pid) if pid else (None, None)
    if v2 is None and v1 is None:
        v2 = v1 = _cgroup_from_config(config)
    name = _first(annotations, _NAME_KEYS) or (
        _podman_name(Path(bundle), state["id"]) if bundle else None
    )
    weight, weight_problem = _weight(annotations.get(WEIGHT_ANNOTATION))
    priority, priority_problem = _priority(annotations.get(PRIORITY_ANNOTATION))
    memory, refusal = _memory(annotations.get(MEMORY_ANNOTATION))
    park, park_problem = _park(annotations.get(PARK_ANNOTATION))
    return ContainerInfo(
        id=state["id"],
        pid=pid,
        cgroup_v2=v2,
        cgroup_v1_freezer=v1,
        name=name,
        pod=_first(annotations, _POD_KEYS),
        namespace=_first(annotations, _NAMESPACE_KEYS),
        gpus=_gpus_from_env(config),
        device_ids=_device_ids(annotations.get(DEVICE_IDS_ANNOTATION))
        or _device_ids(_env(config).get(DEVICE_IDS_ENV)),
        weight=weight,
        priority=priority,
        problems=tuple(p for p in (weight_problem, priority_problem, park_problem) if p),
        memory=memory,
        refusal=refusal,
        park=park,
    )


def _park(value: str | None) -> tuple[bool | None, str | None]:
    """What a ``kiwi.io/park`` annotation says, and what was wrong with it.

    Returns:
        ``(None, None)`` without it; ``(None, why)`` for one that is neither ``"true"``
        nor ``"false"`` (parking then goes as the rules say); else ``(bool, None)``.
    """
    if value is None:
        return None, None
    text = value.strip().lower()
    if text in ("true", "false"):
        return text == "true", None
    return None, f'ignoring {PARK_ANNOTATION}={_shown(value)}: not "true" or "false"'


def _memory(value: str | None) -> tuple[int | None, str | None]:
    """The GPU memory a ``kiwi.io/gpu-memory`` annotation declares, or why it is none.

    Read as Kubernetes reads a quantity (kiwid.core.quantity), with no spaces around
    it: ``"40Gi"`` is 40 GiB, ``"40GB"`` is no quantity.

    Returns:
        ``(None, None)`` without the annotation; ``(None, why)`` for one that is no
        memory size (the container must not start); else ``(bytes, None)``.
    """
    if value is None:
        return None, None
    try:
        return declared_bytes(value), None
    except QuantityError as err:
        return None, (
            f"annotation {MEMORY_ANNOTATION}={_shown(value)} must be {MEMORY_RANGE}: {err}"
        )


def _weight(value: str | None) -> tuple[float | None, str | None]:
    """The weight a ``kiwi.io/weight`` annotation asks for, and what was wrong with it.

    Returns:
        ``(None, None)`` without the annotation; ``(None, why)`` for one that is not a
        positive decimal number; ``(weight, why)`` for one brought within the range
        kiwid takes (``TenantPolicy``'s, ``why`` in its words); else ``(weight, None)``.
    """
    if value is None:
        return None, None
    text = value.strip()
    weight = float(text) if _NUMBER.fullmatch(text) else math.nan
    if not weight > 0:  # not a number, or zero
        return None, f"ignoring {WEIGHT_ANNOTATION}={_shown(value)}: not a positive number"
    within = TenantPolicy.clamp_weight(weight)
    refusal = TenantPolicy.weight_refusal(weight)
    if refusal is None:
        return within, None
    return within, f"{WEIGHT_ANNOTATION}={_shown(value)}: {refusal}; asking for {within:g}"


def _shown(value: str, limit: int = 40) -> str:
    """An annotation's value for a warning: quoted, and cut short if long."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def _priority(value: str | None) -> tuple[int | None, str | None]:
    """The priority a ``kiwi.io/priority`` annotation asks for, and what was wrong with it.

    Returns:
        ``(None, None)`` without the annotation; ``(None, why)`` for one that is not a
        decimal integer; ``(priority, why)`` for one brought within the range kiwid
        takes (``TenantPolicy``'s, ``why`` in its words); else ``(priority, None)``.
    """
    if value is None:
        return None, None
    text = value.strip()
    if not _INTEGER.fullmatch(text):
        return None, f"ignoring {PRIORITY_ANNOTATION}={_shown(value)}: not an integer"
    digits = text.lstrip("+-").lstrip("0")
    read: float = int(digits or "0") if len(digits) <= _PRIORITY_DIGITS else math.inf
    priority = -read if text.startswith("-") else read
    within = TenantPolicy.clamp_priority(priority)
    refusal = TenantPolicy.priority_refusal(priority)
    if refusal is None:
        return within, None
    return within, f"{PRIORITY_ANNOTATION}={_shown(value)}: {refusal}; asking for {within}"


def _first(annotations: Mapping[str, str], keys: Sequence[str]) -> str | None:
    return next((annotations[k] for k in keys if annotations.get(k)), None)


def _read_json(path: Path, limit: int) -> Any:
    """A JSON file's content, or ``None`` if missing, too large or broken."""
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            return None
        return json.loads(data.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _read_config(bundle: Path) -> dict[str, Any]:
    config = _read_json(bundle / "config.json", _MAX_CONFIG_BYTES)
    return config if isinstance(config, dict) else {}


def _podman_name(bundle: Path, cid: str) -> str | None:
    """The name podman gave a container, from its store's ``containers.json``.

    podman puts no name in the OCI spec; its bundle is
    ``<storage root>/<driver>-containers/<id>/userdata``, beside the store's index.
    """
    if bundle.name != "userdata" or bundle.parent.name != cid:
        return None
    entries = _read_json(bundle.parent.parent / "containers.json", _MAX_CONFIG_BYTES)
    if not isinstance(entries, list):
        return None
    for entry in entries:
        if isinstance(entry, dict) and entry.get("id") == cid:
            names = entry.get("names")
            if isinstance(names, list) and names and isinstance(names[0], str):
                return names[0]
    return None


def _env(config: Mapping[str, Any]) -> dict[str, str]:
    """A container's environment, from ``process.env`` in ``config.json``."""
    process = config.get("process")
    env = process.get("env") if isinstance(process, dict) else None
    if not isinstance(env, list):
        return {}
    return dict(item.partition("=")[::2] for item in env if isinstance(item, str))


def _device_ids(value: str | None) -> tuple[str, ...]:
    """The device IDs in a comma-separated list (empty items skipped)."""
    return tuple(dict.fromkeys(d.strip() for d in (value or "").split(",") if d.strip()))


def _gpus_from_env(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The GPUs a container was given, from its environment in ``config.json``."""
    values = _env(config)
    if not values:
        return ()
    kiwi = sorted(
        (int(k.removeprefix(GPU_ENV_PREFIX)), v)
        for k, v in values.items()
        if k.startswith(GPU_ENV_PREFIX) and k.removeprefix(GPU_ENV_PREFIX).isdigit() and v
    )
    if kiwi:
        return tuple(dict.fromkeys(v for _, v in kiwi))
    nvidia = values.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if nvidia in ("", "all", "none", "void"):
        return ()
    return tuple(dict.fromkeys(g.strip() for g in nvidia.split(",") if g.strip()))
