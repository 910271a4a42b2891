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
kiwid caps them by the matching ``[[tenants]]`` rule, docs/scheduling.md), the GPU
memory it declares (``kiwi.io/gpu-memory``, a Kubernetes quantity; docs/memory.md),
whether it may park when idle (``kiwi.io/park``, ``"true"`` or ``"false"``), and
sends kiwid ``register``; ``poststop`` sends ``unregister``.

A hook must never hang, and fails a container start for one reason only: a GPU
memory declaration that is no memory size, or that kiwid refuses because none of
the container's GPUs could ever hold it (exit 1, the reason on stderr, which the
runtime reports, and in syslog). Such a container could never run as it says it
must, and run ungated it would take memory kiwid never counts. Otherwise:

* the whole run is bounded by ``--timeout`` (default 5 s; the spec gives the OCI
  hook a longer timeout, so this one always fires first), enforced by the socket
  timeouts and by a ``SIGALRM`` backstop;
* when kiwid is down, slow or refuses, the hook logs a warning (stderr, which the
  engine logs, and syslog) and exits 0: the container starts ungated;
* an annotation ``kiwi.io/weight`` or ``kiwi.io/priority`` that is not a number is
  left out with a warning (the tenant gets what the rules give it), and one outside
  the range kiwid takes is brought within it with a warning: kiwid refuses a whole
  registration with a value out of range, and the container would run ungated; a
  ``kiwi.io/park`` that is neither ``"true"`` nor ``"false"`` is left out alike;
* a malformed state on stdin is treated the same way (warning, exit 0). It means
  a runtime bug or a hook wired up by hand; failing would turn a Kiwi problem
  into a container that cannot start at all, on every start, while running it
  ungated loses only the scheduling of that one container;
* only a command line without a known action exits 2 (usage); unknown options are
  ignored with a warning, so that a newer spec works with an older hook.

This module is the command line and the requests to kiwid; `kiwid.hook.state`
parses the OCI state, `kiwid.hook.container` works out what kiwid is told about
the container, and `kiwid.hook.cgroup` finds its cgroup.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import sys
import syslog
import time
from collections.abc import Iterator, Sequence
from types import FrameType

from kiwid.adapters.control import ControlError, DaemonUnreachable, request
from kiwid.hook.container import ContainerInfo, container_info
from kiwid.hook.state import MalformedState, parse_state

# Re-exported from kiwid.hook.container and kiwid.hook.state, where they live:
# the state's error, which tests/hook imports from here.
__all__ = [
    "ContainerInfo",
    "MalformedState",
    "container_info",
    "main",
    "parse_state",
]

DEFAULT_SOCKET = "/run/kiwi/kiwid.sock"
DEFAULT_TIMEOUT_S = 5.0
MAX_TIMEOUT_S = 60.0
EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
_CREATE = frozenset({"create", "createRuntime", "prestart"})
_POSTSTOP = frozenset({"poststop"})
_MAX_STATE_BYTES = 1024 * 1024


class _OutOfTime(Exception):
    """The hook's time is up (raised by the SIGALRM backstop)."""


class _Refused(Exception):
    """The container must not start; ``str()`` says why."""


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
        1 for a container whose GPU memory declaration is no size or can never fit
        (it must not start), 2 for a command line without a known action, else 0
        whatever happened to kiwid or the state (see the module docstring).
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
    except _Refused as exc:
        _log(syslog.LOG_ERR, f"error: {exc}; the container does not start", to_stderr=True)
        return EXIT_REFUSED
    except MalformedState as exc:
        _warn(f"{exc}; the container runs without Kiwi")
    except (_OutOfTime, DaemonUnreachable) as exc:
        _warn(f"cannot {what} container {cid} with kiwid: {exc}; it runs ungated")
    except ControlError as exc:
        if exc.code == "invalid-value" and exc.arg == "memory_bytes":
            message = f"{exc.message} (kiwid refused it)"
            _log(syslog.LOG_ERR, f"error: {message}; the container does not start", to_stderr=True)
            return EXIT_REFUSED
        _warn(f"kiwid refused to {what} container {cid} ({exc.code}): {exc.message}")
    except Exception as exc:  # noqa: BLE001 - a hook bug must not fail the container start
        _warn(f"failed to {what} container {cid}: {type(exc).__name__}: {exc}")
    return EXIT_OK


def _register(socket: str, info: ContainerInfo, hold: bool, deadline: float) -> None:
    if info.refusal is not None:
        raise _Refused(f"container {info.id}: {info.refusal}")
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
