"""Gate a process's CUDA calls with the driver's checkpoint lock (ctypes, stdlib only).

``cuCheckpointProcessLock(pid, args)`` (libcuda, driver r550 and newer) blocks
every further CUDA call of another process until ``cuCheckpointProcessUnlock``;
the process's CPU work goes on. A lock outlives the process that took it, so
kiwid must unlock what it locked, also after a crash (see DESIGN.md).

Why ctypes rather than NVIDIA's ``cuda-bindings`` package, which wraps the same
functions: kiwid must import and :func:`probe` cleanly on machines without a GPU
or driver (CI, the simulated backend), and should add no heavy dependency for
four C calls. ``cuda-bindings`` is a large compiled wheel tied to a CUDA major
version; ctypes is in the standard library, loads ``libcuda.so.1`` only when
asked, and lets a missing library or symbol become a plain "unavailable" answer.

The C declarations used (``cuda.h``)::

    CUresult cuInit(unsigned int flags);
    CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args);
    CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args);
    CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state);
    CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args);
    CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args);
    CUresult cuGetErrorName(CUresult error, const char **name);

Checkpoint copies a LOCKED process's whole device memory to host RAM and frees
the GPU (the process then vanishes from NVML's process list); restore brings it
back, leaving the process LOCKED. Both are optional: a driver with the lock but
without them can gate but not swap (:attr:`CudaLock.can_swap`).

**One call per process at a time.** The driver serialises the calls on one
process: on an H200 (driver 580.159.04) a ``GetState`` asked while a checkpoint
of the same process ran waited for that checkpoint, tens of seconds for tens of
GiB. So a :class:`CudaLock` makes at most one call per process at a time, and a
caller that must not wait (kiwid's follow, which runs beside its tenant's
checkpoint) asks with ``wait=False``: if a call on that process is in flight, it
gets :class:`CudaLockBusy` at once instead of a place in the driver's queue.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import threading
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "CudaLock",
    "CudaLockBusy",
    "CudaLockError",
    "CudaLockSupport",
    "CudaLockUnavailable",
    "ProcessState",
    "probe",
]

LIBRARY = "libcuda.so.1"
_SYMBOLS = (
    "cuInit",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)
# Names of the CUresult codes these calls return, for drivers without cuGetErrorName.
_NAMES = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    100: "CUDA_ERROR_NO_DEVICE",
    401: "CUDA_ERROR_ILLEGAL_STATE",
    600: "CUDA_ERROR_NOT_READY",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    909: "CUDA_ERROR_TIMEOUT",
    999: "CUDA_ERROR_UNKNOWN",
}


class ProcessState(enum.IntEnum):
    """``CUprocessState``: where a process stands in the checkpoint life cycle."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class CudaLockError(Exception):
    """A driver call failed.

    Attributes:
        code: The ``CUresult`` code (-1 when the library itself is unusable).
        name: Its name, e.g. ``CUDA_ERROR_ILLEGAL_STATE``.
    """

    def __init__(self, code: int, name: str, detail: str = "") -> None:
        super().__init__(f"{name} ({code}){': ' + detail if detail else ''}")
        self.code = code
        self.name = name


class CudaLockBusy(CudaLockError):
    """A call on this process is in flight, and the caller asked not to wait for it."""

    def __init__(self, pid: int) -> None:
        super().__init__(-2, "KIWI_CALL_IN_FLIGHT", f"a call on pid {pid} is in flight")
        self.pid = pid


class CudaLockUnavailable(CudaLockError):
    """The CUDA lock cannot be used on this machine (no libcuda, or too old a driver).

    Attributes:
        reason: Why, for the operator.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(-1, "CUDA_LOCK_UNAVAILABLE", reason)
        self.reason = reason


@dataclass(frozen=True)
class CudaLockSupport:
    """Whether the CUDA lock can be used here.

    Attributes:
        available: ``True`` if libcuda loads, has the symbols and ``cuInit`` works.
        reason: Why not, or what was found.
    """

    available: bool
    reason: str


class _LockArgs(ctypes.Structure):
    _fields_ = (
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    )


class _UnlockArgs(ctypes.Structure):
    _fields_ = (("reserved", ctypes.c_uint64 * 8),)


class _CheckpointArgs(ctypes.Structure):  # also the restore's: all reserved, zeroed
    _fields_ = (("reserved", ctypes.c_uint64 * 8),)


_SWAP_SYMBOLS = ("cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore")


def _error_name(lib: ctypes.CDLL, code: int) -> str:
    name = ctypes.c_char_p()
    get_name = getattr(lib, "cuGetErrorName", None)
    if get_name is not None and get_name(code, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode(errors="replace")
    return _NAMES.get(code, "CUDA_ERROR")


def _load(library: str) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(library)
    except OSError as exc:
        raise CudaLockUnavailable(
            f"{library} cannot be loaded ({exc}); is the NVIDIA driver installed?"
        ) from exc
    missing = [symbol for symbol in _SYMBOLS if not hasattr(lib, symbol)]
    if missing:
        raise CudaLockUnavailable(
            f"{library} lacks {', '.join(missing)}; the CUDA lock needs driver r550 or newer"
        )
    return lib


class CudaLock:
    """Lock, unlock and query other processes' CUDA state through libcuda.

    ``cuInit(0)`` runs once, lazily, under a lock, before the first call.
    """

    def __init__(self, library: str = LIBRARY) -> None:
        """Load the driver library.

        Args:
            library: The library to load.

        Raises:
            CudaLockUnavailable: The library or one of its symbols is missing.
        """
        self._lib = _load(library)
        self._init_lock = threading.Lock()
        self._initialised = False
        self.can_swap = all(hasattr(self._lib, symbol) for symbol in _SWAP_SYMBOLS)
        """Whether the driver can also checkpoint and restore (swap memory out)."""
        self._in_flight: set[int] = set()
        """The processes a call of this object is on now (one at a time each)."""
        self._turns = threading.Condition()

    def init(self) -> None:
        """Call ``cuInit(0)`` unless done already; the other methods do it themselves.

        Raises:
            CudaLockError: ``cuInit`` failed, e.g. ``CUDA_ERROR_NO_DEVICE``.
        """
        with self._init_lock:
            if not self._initialised:
                self._check("cuInit", self._lib.cuInit(0))
                self._initialised = True

    def _call(self, function: str, pid: int, *args: object, wait: bool = True) -> None:
        self.init()
        with self._one_call(pid, wait):
            self._check(function, getattr(self._lib, function)(ctypes.c_int(pid), *args))

    @contextlib.contextmanager
    def _one_call(self, pid: int, wait: bool) -> Iterator[None]:
        """Hold ``pid``'s one place for a call; wait for it, or raise CudaLockBusy."""
        with self._turns:
            while pid in self._in_flight:
                if not wait:
                    raise CudaLockBusy(pid)
                self._turns.wait()
            self._in_flight.add(pid)
        try:
            yield
        finally:
            with self._turns:
                self._in_flight.discard(pid)
                self._turns.notify_all()

    def _check(self, function: str, code: int) -> None:
        if code != 0:
            raise CudaLockError(code, _error_name(self._lib, code), function)

    def lock(self, pid: int, timeout_ms: int, *, wait: bool = True) -> None:
        """Block the CUDA calls of ``pid`` once its in-flight work has finished.

        Args:
            pid: The CUDA process to lock.
            timeout_ms: How long the driver may try, in milliseconds; 0 waits forever.
            wait: Whether to wait for a call on ``pid`` in flight (else CudaLockBusy).

        Raises:
            ValueError: ``timeout_ms`` is negative.
            CudaLockBusy: ``wait`` is false and a call on ``pid`` is in flight.
            CudaLockError: The driver refused, e.g. ``CUDA_ERROR_ILLEGAL_STATE`` when
                the process is not RUNNING, or a timeout.
        """
        if timeout_ms < 0:
            raise ValueError(f"timeout_ms must be >= 0, not {timeout_ms}")
        args = _LockArgs(timeoutMs=timeout_ms)
        self._call("cuCheckpointProcessLock", pid, ctypes.byref(args), wait=wait)

    def unlock(self, pid: int) -> None:
        """Let the CUDA calls of ``pid`` go on.

        Args:
            pid: A LOCKED CUDA process.

        Raises:
            CudaLockError: The driver refused (e.g. the process is not LOCKED).
        """
        args = _UnlockArgs()
        self._call("cuCheckpointProcessUnlock", pid, ctypes.byref(args))

    def checkpoint(self, pid: int) -> None:
        """Copy the device memory of a LOCKED ``pid`` to host RAM and free the GPU.

        Raises:
            CudaLockError: The driver refused (not LOCKED, no host memory...), or
                cannot checkpoint at all (``CUDA_LOCK_UNAVAILABLE``).
        """
        self._swap_call("cuCheckpointProcessCheckpoint", pid)

    def restore(self, pid: int) -> None:
        """Bring a CHECKPOINTED ``pid``'s memory back to the GPU; it stays LOCKED.

        Raises:
            CudaLockError: The driver refused (e.g. out of device memory).
        """
        self._swap_call("cuCheckpointProcessRestore", pid)

    def _swap_call(self, function: str, pid: int) -> None:
        if not self.can_swap:
            raise CudaLockUnavailable(f"this driver lacks {function}")
        args = _CheckpointArgs()
        self._call(function, pid, ctypes.byref(args))

    def state(self, pid: int, *, wait: bool = True) -> ProcessState:
        """Return the checkpoint state of ``pid``.

        Args:
            pid: A CUDA process.
            wait: Whether to wait for a call on ``pid`` in flight (else CudaLockBusy).

        Returns:
            Its state.

        Raises:
            CudaLockBusy: ``wait`` is false and a call on ``pid`` is in flight.
            CudaLockError: The driver refused (e.g. ``pid`` is no CUDA process).
        """
        value = ctypes.c_int(-1)
        self._call("cuCheckpointProcessGetState", pid, ctypes.byref(value), wait=wait)
        try:
            return ProcessState(value.value)
        except ValueError as exc:
            raise CudaLockError(-1, "UNKNOWN_PROCESS_STATE", f"state {value.value}") from exc


def probe(library: str = LIBRARY) -> CudaLockSupport:
    """Say whether the CUDA lock can be used here; never raises.

    Args:
        library: The library to load.

    Returns:
        Availability and its reason.
    """
    try:
        CudaLock(library).init()
    except CudaLockUnavailable as exc:
        return CudaLockSupport(False, exc.reason)
    except CudaLockError as exc:
        return CudaLockSupport(False, f"cuInit failed: {exc}")
    return CudaLockSupport(True, f"{library} has the checkpoint lock and cuInit succeeded")
