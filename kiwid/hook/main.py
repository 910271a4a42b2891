"""``kiwi-hook``: the OCI hook that tells kiwid about GPU containers.

Kiwi's CDI spec (`kiwid.adapters.cdi`) makes the container engine run::

    kiwi-hook [--socket PATH] [--timeout S] [--admission hold|none] create     # createRuntime
    kiwi-hook [--socket PATH] [--timeout S] poststop                           # poststop

with the container's OCI state JSON on stdin (``id``, ``pid``, ``bundle``,
``annotations``). ``create`` finds the container's cgroup, its names (pod,
namespace and container from the Kubernetes runtimes' annotations, or podman's
container store), its GPUs (the ``KIWI_GPU_<index>`` variables Kiwi's CDI devices
set, else ``NVIDIA_VISIBLE_DEVICES``) and, on Kubernetes, the device IDs Kiwi's
device plugin gave it (annotation ``kiwi.io/device-ids``, else ``KIWI_DEVICE_IDS``;
kiwid finds the pod by them when the annotations lack its names), the weight and
priority its pod asks for (annotations ``kiwi.io/weight`` and ``kiwi.io/priority``;
kiwid caps them by the matching ``[[tenants]]`` rule, docs/scheduling.md), and sends
kiwid ``register``; ``poststop`` sends ``unregister``.

A hook must never hang or fail a container start, so:

* the whole run is bounded by ``--timeout`` (default 5 s; the spec gives the OCI
  hook a longer timeout, so this one always fires first), enforced by the socket
  timeouts and by a ``SIGALRM`` backstop;
* when kiwid is down, slow or refuses, the hook logs a warning (stderr, which the
  engine logs, and syslog) and exits 0: the container starts ungated;
* an annotation ``kiwi.io/weight`` or ``kiwi.io/priority`` that is not a number is
  left out with a warning (the tenant gets what the rules give it), and one outside
  the range kiwid takes is brought within it with a warning: kiwid refuses a whole
  registration with a value out of range, and the container would run ungated;
* a malformed state on stdin is treated the same way (warning, exit 0). It means
  a runtime bug or a hook wired up by hand; failing would turn a Kiwi problem
  into a container that cannot start at all, on every start, while running it
  ungated loses only the scheduling of that one container;
* only a command line without a known action exits 2 (usage); unknown options are
  ignored with a warning, so that a newer spec works with an older hook.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import select
import signal
import sys
import syslog
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from kiwid.adapters.control import ControlError, DaemonUnreachable, request
from kiwid.linux.proc import parse_proc_cgroup

__all__ = ["ContainerInfo", "container_info", "main", "parse_state"]

DEFAULT_SOCKET = "/run/kiwi/kiwid.sock"
DEFAULT_TIMEOUT_S = 5.0
MAX_TIMEOUT_S = 60.0
EXIT_OK = 0
EXIT_USAGE = 2
GPU_ENV_PREFIX = "KIWI_GPU_"  # kiwid.adapters.cdi.GPU_ENV_PREFIX (adapters do not share)
# Set by the device plugin (kiwid.adapters.deviceplugin.devices): the slots a container got.
DEVICE_IDS_ANNOTATION = "kiwi.io/device-ids"
DEVICE_IDS_ENV = "KIWI_DEVICE_IDS"
# What a pod asks of the scheduler; kiwid caps it by the matching [[tenants]] rule.
WEIGHT_ANNOTATION = "kiwi.io/weight"
PRIORITY_ANNOTATION = "kiwi.io/priority"
# The range kiwid takes: a weight as a [[tenants]] rule may set it (kiwid.config.rules),
# a priority as register accepts it (kiwid.daemon.admission.MAX_PRIORITY; the hook does
# not import the daemon, tests/hook checks that the two agree).
MIN_WEIGHT = 0.01
MAX_WEIGHT = 1000.0
MAX_PRIORITY = 1000
_NUMBER = re.compile(r"\+?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_INTEGER = re.compile(r"[-+]?[0-9]+")
_CREATE = frozenset({"create", "createRuntime", "prestart"})
_POSTSTOP = frozenset({"poststop"})
_MAX_STATE_BYTES = 1024 * 1024
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


class _OutOfTime(Exception):
    """The hook's time is up (raised by the SIGALRM backstop)."""


class MalformedState(ValueError):
    """The OCI state on stdin is not what the runtime spec describes."""


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

    def register_args(self, hold: bool) -> dict[str, Any]:
        """The ``register`` command's arguments (docs/control-protocol.md).

        Args:
            hold: Ask kiwid to start the container frozen if its GPU is busy.

        Returns:
            The arguments; ``device_ids``, ``weight`` and ``priority`` only when there
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
        return args


def parse_state(raw: bytes) -> dict[str, Any]:
    """Parse and check an OCI container state.

    Args:
        raw: The bytes read from stdin.

    Returns:
        The state: ``id`` a non-empty string, ``pid`` an int or absent,
        ``bundle`` a string or absent, ``annotations`` a string map (``{}`` if absent).

    Raises:
        MalformedState: Not UTF-8 JSON, not an object, or a field of the wrong type.
    """
    try:
        state = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedState(f"the OCI state on stdin is not JSON: {exc}") from None
    if not isinstance(state, dict):
        raise MalformedState("the OCI state on stdin is not a JSON object")
    cid = state.get("id")
    if not isinstance(cid, str) or not cid:
        raise MalformedState("the OCI state on stdin has no container 'id'")
    pid = state.get("pid")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid < 0):
        raise MalformedState(f"the OCI state's 'pid' is not a process id: {pid!r}")
    bundle = state.get("bundle")
    if bundle is not None and not isinstance(bundle, str):
        raise MalformedState("the OCI state's 'bundle' is not a path")
    annotations = state.get("annotations") or {}
    if not isinstance(annotations, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()
    ):
        raise MalformedState("the OCI state's 'annotations' is not a map of strings")
    return {**state, "pid": pid or None, "annotations": annotations}


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
        problems=tuple(p for p in (weight_problem, priority_problem) if p),
    )


def _weight(value: str | None) -> tuple[float | None, str | None]:
    """The weight a ``kiwi.io/weight`` annotation asks for, and what was wrong with it.

    Returns:
        ``(None, None)`` without the annotation; ``(None, why)`` for one that is not a
        positive decimal number; ``(weight, why)`` for one brought within
        `MIN_WEIGHT`..`MAX_WEIGHT`; else ``(weight, None)``.
    """
    if value is None:
        return None, None
    text = value.strip()
    weight = float(text) if _NUMBER.fullmatch(text) else math.nan
    if not weight > 0:  # not a number, or zero
        return None, f"ignoring {WEIGHT_ANNOTATION}={_shown(value)}: not a positive number"
    within = min(max(weight, MIN_WEIGHT), MAX_WEIGHT)
    if within != weight:
        return within, (
            f"{WEIGHT_ANNOTATION}={_shown(value)} is outside {MIN_WEIGHT:g}..{MAX_WEIGHT:g}, "
            f"what kiwid takes; asking for {within:g}"
        )
    return weight, None


def _shown(value: str, limit: int = 40) -> str:
    """An annotation's value for a warning: quoted, and cut short if long."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def _priority(value: str | None) -> tuple[int | None, str | None]:
    """The priority a ``kiwi.io/priority`` annotation asks for, and what was wrong with it.

    Returns:
        ``(None, None)`` without the annotation; ``(None, why)`` for one that is not a
        decimal integer; ``(priority, why)`` for one brought within ±`MAX_PRIORITY`;
        else ``(priority, None)``.
    """
    if value is None:
        return None, None
    text = value.strip()
    if not _INTEGER.fullmatch(text):
        return None, f"ignoring {PRIORITY_ANNOTATION}={_shown(value)}: not an integer"
    # int() of a long enough string raises (sys.set_int_max_str_digits): out of range.
    digits = text.lstrip("+-").lstrip("0")
    priority = int(digits or "0") if len(digits) <= 9 else MAX_PRIORITY + 1
    priority = -priority if text.startswith("-") else priority
    within = min(max(priority, -MAX_PRIORITY), MAX_PRIORITY)
    if within != priority:
        return within, (
            f"{PRIORITY_ANNOTATION}={_shown(value)} is outside -{MAX_PRIORITY}..{MAX_PRIORITY}, "
            f"what kiwid takes; asking for {within}"
        )
    return priority, None


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


def _cgroups_from_proc(proc: Path, pid: int) -> tuple[str | None, str | None]:
    """(cgroup2 path, v1 freezer path) of a process; ``None`` for what is unknown."""
    try:
        text = (proc / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None, None
    paths = parse_proc_cgroup(text)
    v2, v1 = paths.v2, paths.v1_freezer
    # The root cgroup holds the whole machine: never a container's own.
    return (v2 if v2 not in (None, "/") else None), (v1 if v1 not in (None, "/") else None)


def _cgroup_from_config(config: Mapping[str, Any]) -> str | None:
    """The cgroup path that ``linux.cgroupsPath`` names, or ``None`` if it cannot tell."""
    linux = config.get("linux")
    raw = linux.get("cgroupsPath") if isinstance(linux, dict) else None
    if not isinstance(raw, str) or not raw:
        return None
    if raw.startswith("/"):
        return raw  # cgroupfs driver: the same path in every hierarchy
    parts = raw.split(":")
    if len(parts) == 3:  # systemd driver: "slice:prefix:name"
        return _systemd_path(*parts)
    return None  # relative: the runtime chose where, /proc would have told


def _systemd_path(slice_: str, prefix: str, name: str) -> str:
    """Expand systemd's ``slice:prefix:name`` the way runc's systemd driver does."""
    path = ""
    if slice_ and slice_ != "-.slice":
        stem = slice_.removesuffix(".slice")
        words = stem.split("-")
        path = "".join("/" + "-".join(words[: i + 1]) + ".slice" for i in range(len(words)))
    unit = name if name.endswith(".slice") else f"{prefix}-{name}.scope" if prefix else name
    return f"{path}/{unit}"


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


def _read_stdin(deadline: float) -> bytes:
    """Read stdin to its end, at most ``_MAX_STATE_BYTES``, before ``deadline``."""
    fd = sys.stdin.fileno()
    data = bytearray()
    while len(data) <= _MAX_STATE_BYTES:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _OutOfTime("stdin did not end in time")
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return bytes(data)
        data += chunk
    raise MalformedState(f"the OCI state on stdin is larger than {_MAX_STATE_BYTES} bytes")


def _log(priority: int, message: str, *, to_stderr: bool) -> None:
    if to_stderr:
        print(f"kiwi-hook: {message}", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError):
        syslog.syslog(priority, message)


def _warn(message: str) -> None:
    _log(syslog.LOG_WARNING, f"warning: {message}", to_stderr=True)


@contextlib.contextmanager
def _alarm(timeout_s: float) -> Iterator[None]:
    """Raise `_OutOfTime` in the main thread once ``timeout_s`` has passed."""

    def ring(signum: int, frame: FrameType | None) -> None:
        raise _OutOfTime(f"no answer within {timeout_s:g} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiwi-hook",
        description="OCI hook: register a container with kiwid (create) or forget it "
        "(poststop). Reads the OCI state JSON on stdin; never blocks a container: "
        "with kiwid down it warns and exits 0.",
    )
    parser.add_argument(
        "--socket",
        default=os.environ.get("KIWI_SOCKET", DEFAULT_SOCKET),
        help=f"kiwid's control socket (default: $KIWI_SOCKET or {DEFAULT_SOCKET})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds the whole hook may take (default {DEFAULT_TIMEOUT_S:g}, "
        f"at most {MAX_TIMEOUT_S:g}); keep it below the OCI hook timeout",
    )
    parser.add_argument(
        "--admission",
        choices=("hold", "none"),
        default="hold",
        help="hold: a container whose GPU is busy starts frozen and waits for its "
        "turn (default); none: it starts at once",
    )
    parser.add_argument("action", choices=sorted(_CREATE | _POSTSTOP))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kiwi-hook``.

    Args:
        argv: The arguments after the program name; ``None`` means ``sys.argv[1:]``.

    Returns:
        0 whatever happened to kiwid or the state (see the module docstring), 2 for a
        command line without a known action.
    """
    with contextlib.suppress(OSError):
        syslog.openlog("kiwi-hook", syslog.LOG_PID, syslog.LOG_DAEMON)
    try:
        args, unknown = _parser().parse_known_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or no known action (2)
        return EXIT_OK if not exc.code else EXIT_USAGE
    if unknown:
        _warn(f"ignoring unknown arguments {' '.join(unknown)}")
    timeout_s = args.timeout
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        _warn(f"--timeout {timeout_s:g} is out of range; using {DEFAULT_TIMEOUT_S:g}")
        timeout_s = DEFAULT_TIMEOUT_S
    deadline = time.monotonic() + timeout_s
    what = "register" if args.action in _CREATE else "unregister"
    cid = "?"
    try:
        with _alarm(timeout_s):
            state = parse_state(_read_stdin(deadline))
            cid = state["id"]
            if what == "register":
                _register(args.socket, container_info(state), args.admission == "hold", deadline)
            else:
                _unregister(args.socket, cid, deadline)
    except MalformedState as exc:
        _warn(f"{exc}; the container runs without Kiwi")
    except (_OutOfTime, DaemonUnreachable) as exc:
        _warn(f"cannot {what} container {cid} with kiwid: {exc}; it runs ungated")
    except ControlError as exc:
        _warn(f"kiwid refused to {what} container {cid} ({exc.code}): {exc.message}")
    except Exception as exc:  # noqa: BLE001 - a hook bug must not fail the container start
        _warn(f"failed to {what} container {cid}: {type(exc).__name__}: {exc}")
    return EXIT_OK


def _register(socket: str, info: ContainerInfo, hold: bool, deadline: float) -> None:
    for problem in info.problems:
        _warn(f"container {info.id}: {problem}")
    if info.cgroup_v2 is None and info.cgroup_v1_freezer is None:
        _warn(f"found no cgroup for container {info.id}; kiwid cannot gate it")
    result = request(socket, "register", info.register_args(hold), _remaining(deadline))
    held = " (held: its GPU is busy, it waits for its turn)" if result.get("held") else ""
    who = info.name or info.id
    _log(syslog.LOG_INFO, f"registered {who} as {result.get('tenant')}{held}", to_stderr=False)


def _unregister(socket: str, cid: str, deadline: float) -> None:
    result = request(socket, "unregister", {"id": cid}, _remaining(deadline))
    if result.get("removed"):
        _log(syslog.LOG_INFO, f"unregistered container {cid}", to_stderr=False)


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _OutOfTime("the time ran out before kiwid was asked")
    return remaining


if __name__ == "__main__":
    sys.exit(main())
