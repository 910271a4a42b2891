"""CDI (Container Device Interface) spec files: Kiwi's own, and a look at NVIDIA's.

Kiwi publishes its GPUs to container engines as CDI devices ``kiwi.io/gpu=<index>``
and ``kiwi.io/gpu=<uuid>`` (podman ``--device kiwi.io/gpu=0``; CRI-O and containerd
through the kubelet device plugin). What a device adds to a container:

* the environment variable ``KIWI_GPU_<index>=<uuid>``, which tells kiwi-hook which
  GPU the container was given (nothing in the container reads it);
* the device nodes ``/dev/nvidia<index>``, ``/dev/nvidiactl`` and the UVM nodes,
  unless NVIDIA's own CDI spec (``nvidia-ctk cdi generate``) is used beside ours;
* once per container, whatever devices it asks for: the OCI hooks
  ``createRuntime`` and ``poststop`` that run ``kiwi-hook``, which registers the
  container with kiwid and unregisters it when it is gone.

The applications inside need nothing from Kiwi: no library and no socket.

`build_spec` is pure; `write_spec` replaces the file atomically (a reader never
sees half a spec) and only when its content changes; `find_devices` reads which
device names another vendor's spec declares. Standard library only. The format:
https://github.com/cncf-tags/container-device-interface/blob/main/SPEC.md
"""

from __future__ import annotations

import contextlib
import json
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kiwid.linux.files import write_atomic

__all__ = [
    "CDI_DIRS",
    "CDI_VERSION",
    "DEFAULT_DIR",
    "DEFAULT_NAME",
    "GPU_ENV_PREFIX",
    "KIND",
    "NVIDIA_KIND",
    "DeviceNodes",
    "GpuRef",
    "build_spec",
    "find_device_nodes",
    "find_devices",
    "hook_args",
    "remove_spec",
    "write_spec",
]

CDI_VERSION = "0.5.0"
"""The spec version written: podman 4.3 (Debian 12) accepts 0.3.0 to 0.5.0, and
newer engines read old versions."""
KIND = "kiwi.io/gpu"
"""Kiwi's CDI kind (vendor ``kiwi.io``, class ``gpu``)."""
NVIDIA_KIND = "nvidia.com/gpu"
"""The kind of the spec that NVIDIA's container toolkit generates."""
DEFAULT_DIR = "/var/run/cdi"
"""Where kiwid writes its spec: the directory for generated, per-boot specs."""
DEFAULT_NAME = "kiwi.io-gpu.json"
"""The spec's file name (CDI recommends ``<vendor>-<class>``)."""
CDI_DIRS = ("/etc/cdi", "/var/run/cdi")
"""The directories every CDI consumer scans, lowest priority first."""
GPU_ENV_PREFIX = "KIWI_GPU_"
"""``KIWI_GPU_<index>=<uuid>``: set by each Kiwi device, read by kiwi-hook."""
HOOK_TIMEOUT_S = 5.0
"""kiwi-hook's own time limit per run, seconds; the OCI timeout is larger."""
_HOOK_GRACE_S = 5
"""Seconds the OCI hook timeout adds to kiwi-hook's own: a runtime that kills a
hook at its timeout fails the container, so kiwi-hook must always end first."""
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
_SHARED_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
_YAML_KIND_RE = re.compile(r"""^kind:\s*["']?([^"'\s#]+)""", re.MULTILINE)
_YAML_NAME_RE = re.compile(r"""^\s*(?:-\s+)?name:\s*["']?([^"'\s#]+)""", re.MULTILINE)
_MAX_SPEC_BYTES = 16 * 1024 * 1024


class GpuRef(Protocol):
    """What the spec needs to know of a GPU (`kiwid.adapters.gpu.DeviceInfo` fits)."""

    @property
    def index(self) -> int:
        """The driver's device index."""
        ...

    @property
    def uuid(self) -> str:
        """The GPU's UUID, e.g. ``GPU-5f0c...``."""
        ...


@dataclass(frozen=True)
class DeviceNodes:
    """The NVIDIA device nodes a spec gives containers when NVIDIA's spec is not used.

    Attributes:
        per_gpu: GPU index -> its nodes, e.g. ``{0: ("/dev/nvidia0",)}``.
        shared: Nodes every GPU container needs, e.g. ``/dev/nvidiactl``.
    """

    per_gpu: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    shared: tuple[str, ...] = ()


def find_device_nodes(indices: Iterable[int], dev_root: str | Path = "/dev") -> DeviceNodes:
    """List the NVIDIA device nodes that exist for the given GPUs.

    A CDI device node must exist on the host when a container is created (the
    engine reads its major and minor numbers), so only character devices that are
    there now are listed.

    Args:
        indices: The GPU indices.
        dev_root: Where device nodes live (a test may point elsewhere).

    Returns:
        The nodes found.
    """
    root = Path(dev_root)
    per_gpu = {
        i: tuple(str(p) for p in (root / f"nvidia{i}",) if _is_char_device(p)) for i in indices
    }
    shared = tuple(str(root / n) for n in _SHARED_NODES if _is_char_device(root / n))
    return DeviceNodes(per_gpu, shared)


def _is_char_device(path: Path) -> bool:
    try:
        return stat.S_ISCHR(path.stat().st_mode)
    except OSError:
        return False


def hook_args(
    kiwi_socket: str, action: str, *, admission: str = "hold", timeout_s: float = HOOK_TIMEOUT_S
) -> list[str]:
    """Build kiwi-hook's argument vector (``argv[0]`` included) for one hook.

    Args:
        kiwi_socket: kiwid's control socket.
        action: ``"create"`` or ``"poststop"``.
        admission: ``"hold"`` or ``"none"`` (only used by ``create``).
        timeout_s: kiwi-hook's own time limit, seconds.

    Returns:
        The argument vector.
    """
    args = ["kiwi-hook", "--socket", kiwi_socket, "--timeout", f"{timeout_s:g}"]
    if action == "create":
        args += ["--admission", admission]
    return [*args, action]


def build_spec(
    devices: Sequence[GpuRef],
    hook_path: str,
    nvidia_cdi: bool,
    kiwi_socket: str,
    *,
    admission: str = "hold",
    hook_timeout_s: float = HOOK_TIMEOUT_S,
    device_nodes: DeviceNodes | None = None,
) -> dict[str, Any]:
    """Build Kiwi's CDI spec for the given GPUs.

    Each GPU is one device under two names, its index and its UUID. The spec-wide
    ``containerEdits`` (applied once per container, whichever devices it asks for)
    carry the ``createRuntime`` and ``poststop`` hooks that run kiwi-hook.

    Args:
        devices: The GPUs, e.g. the GPU backend's ``devices()``.
        hook_path: Absolute path of the kiwi-hook executable on the host.
        nvidia_cdi: NVIDIA's CDI spec is used beside this one (Kubernetes asks for
            both names; it gives the device nodes and driver libraries), so this
            spec adds no device nodes.
        kiwi_socket: kiwid's control socket, passed to kiwi-hook.
        admission: ``"hold"``: a container created while its GPU is busy starts
            frozen and waits for its turn; ``"none"``: it starts at once.
        hook_timeout_s: kiwi-hook's own time limit, seconds; the OCI timeout is
            ``_HOOK_GRACE_S`` longer.
        device_nodes: Nodes to add when ``nvidia_cdi`` is false (see
            `find_device_nodes`); ``None`` adds none (the simulated backend).

    Returns:
        The spec as a JSON-ready dict.

    Raises:
        ValueError: A relative hook path, an unknown admission, or a GPU whose
            UUID is not a valid CDI device name.
    """
    if not Path(hook_path).is_absolute():
        raise ValueError(f"the hook path must be absolute, not {hook_path!r}")
    if admission not in ("hold", "none"):
        raise ValueError(f"admission must be 'hold' or 'none', not {admission!r}")
    nodes = DeviceNodes() if nvidia_cdi or device_nodes is None else device_nodes
    entries: list[dict[str, Any]] = []
    for gpu in sorted(devices, key=lambda d: d.index):
        if not _NAME_RE.match(gpu.uuid):
            raise ValueError(f"GPU {gpu.index}'s UUID {gpu.uuid!r} is not a valid CDI name")
        edits: dict[str, Any] = {"env": [f"{GPU_ENV_PREFIX}{gpu.index}={gpu.uuid}"]}
        own_nodes = nodes.per_gpu.get(gpu.index, ())
        if own_nodes:
            edits["deviceNodes"] = [{"path": p} for p in own_nodes]
        entries += [
            {"name": str(gpu.index), "containerEdits": edits},
            {"name": gpu.uuid, "containerEdits": edits},
        ]
    oci_timeout = int(hook_timeout_s) + _HOOK_GRACE_S
    common: dict[str, Any] = {
        "hooks": [
            {
                "hookName": "createRuntime",
                "path": hook_path,
                "args": hook_args(
                    kiwi_socket, "create", admission=admission, timeout_s=hook_timeout_s
                ),
                "timeout": oci_timeout,
            },
            {
                "hookName": "poststop",
                "path": hook_path,
                "args": hook_args(kiwi_socket, "poststop", timeout_s=hook_timeout_s),
                "timeout": oci_timeout,
            },
        ]
    }
    if nodes.shared:
        common["deviceNodes"] = [{"path": p} for p in nodes.shared]
    return {"cdiVersion": CDI_VERSION, "kind": KIND, "devices": entries, "containerEdits": common}


def write_spec(
    spec: Mapping[str, Any], directory: str | Path = DEFAULT_DIR, name: str = DEFAULT_NAME
) -> bool:
    """Write a spec file atomically, and only if its content changed.

    The text goes to a hidden temporary file in the same directory (CDI consumers
    read only ``*.json`` and ``*.yaml``), is flushed to disk, made world-readable,
    and renamed over the spec: an engine that rescans sees the old spec or the
    new one, never a part. An unchanged spec is not rewritten, so the engines'
    directory watches are not woken for nothing.

    Args:
        spec: The spec (`build_spec`).
        directory: The CDI directory; created (0755) if missing.
        name: The file name, ending in ``.json``.

    Returns:
        True if the file was written, False if it already had this content.

    Raises:
        ValueError: ``name`` is not a plain ``*.json`` file name.
        OSError: The directory or the file cannot be written.
    """
    if Path(name).name != name or not name.endswith(".json"):
        raise ValueError(f"a spec file name must be a plain *.json name, not {name!r}")
    folder = Path(directory)
    target = folder / name
    text = json.dumps(spec, indent=2, sort_keys=True) + "\n"
    with contextlib.suppress(OSError):
        if target.read_text(encoding="utf-8") == text:
            return False
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    write_atomic(target, text.encode(), 0o644)
    return True


def remove_spec(directory: str | Path = DEFAULT_DIR, name: str = DEFAULT_NAME) -> bool:
    """Remove a spec file written by `write_spec`.

    Args:
        directory: The CDI directory.
        name: The file name.

    Returns:
        True if a file was removed, False if there was none.

    Raises:
        OSError: The file exists but cannot be removed.
    """
    try:
        (Path(directory) / name).unlink()
    except FileNotFoundError:
        return False
    return True


def find_devices(kind: str, dirs: Sequence[str | Path] = CDI_DIRS) -> frozenset[str]:
    """List the device names that CDI specs of one kind declare.

    JSON specs are parsed; YAML specs (what ``nvidia-ctk cdi generate`` writes by
    default) are scanned for their top-level ``kind:`` and every ``name:`` key,
    which in a CDI spec name only devices. Unreadable or broken files are skipped:
    this answers "can an engine resolve ``kind=name``", not "is the spec valid".

    Args:
        kind: E.g. ``"nvidia.com/gpu"``.
        dirs: The directories to scan.

    Returns:
        The device names, e.g. ``{"0", "GPU-5f0c...", "all"}``; empty if none.
    """
    names: set[str] = set()
    for folder in dirs:
        try:
            files = sorted(Path(folder).iterdir())
        except OSError:
            continue
        for path in files:
            if path.suffix not in (".json", ".yaml", ".yml") or path.name.startswith("."):
                continue
            names |= _devices_in(path, kind)
    return frozenset(names)


def _devices_in(path: Path, kind: str) -> set[str]:
    try:
        if path.stat().st_size > _MAX_SPEC_BYTES:
            return set()
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return set()
    if path.suffix == ".json":
        try:
            spec = json.loads(text)
            if not isinstance(spec, dict) or spec.get("kind") != kind:
                return set()
            return {str(d["name"]) for d in spec.get("devices", []) if "name" in d}
        except (ValueError, TypeError, KeyError):
            return set()
    found = _YAML_KIND_RE.search(text)
    if found is None or found.group(1) != kind:
        return set()
    return set(_YAML_NAME_RE.findall(text))
