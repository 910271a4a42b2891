"""The NVML GPU backend: the only module that imports ``pynvml`` (package nvidia-ml-py).

NVML is initialised lazily, under a lock, on first use and shut down by
:meth:`NvmlBackend.close` or at interpreter exit. Every ``pynvml.NVMLError`` is
translated into the errors of :mod:`kiwid.adapters.gpu`:

* library missing, driver not loaded, no permission, library/driver version
  mismatch, uninitialised -> :class:`~kiwid.adapters.gpu.DriverUnavailable`
  (with a HINT for the operator);
* GPU is lost, reset required, unknown error on a device ->
  :class:`~kiwid.adapters.gpu.GpuLost`;
* anything else -> :class:`~kiwid.adapters.gpu.GpuBackendError`.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pynvml

from kiwid.adapters.gpu import DeviceInfo, DriverUnavailable, GpuBackendError, GpuLost, GpuProcess

__all__ = ["NvmlBackend", "translate_error"]

log = logging.getLogger(__name__)

DEFAULT_CONFIG = Path("/etc/kiwi.toml")
"""The config file the hint for a machine without a GPU names, unless told another."""

# NVML error code -> (reason, hint) for errors that make the whole backend unusable.
_FATAL: dict[int, tuple[str, str]] = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
        "the NVML library libnvidia-ml.so.1 was not found",
        "is the NVIDIA driver installed and loaded (nvidia-smi works)?",
    ),
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: (
        "the NVIDIA kernel driver is not loaded",
        "load it (modprobe nvidia) and check that nvidia-smi works.",
    ),
    pynvml.NVML_ERROR_NO_PERMISSION: (
        "NVML denied access",
        "run kiwid as root and allow the /dev/nvidia* nodes (DeviceAllow= in the unit)",
    ),
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "the NVML library and the loaded kernel driver have different versions",
        "the driver was upgraded without reloading the kernel module; reboot the node",
    ),
    pynvml.NVML_ERROR_UNINITIALIZED: (
        "NVML is not initialised",
        "something shut NVML down under kiwid; restart kiwid",
    ),
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: (
        "the NVIDIA driver is too old for a function kiwid needs",
        "upgrade the NVIDIA driver (r535 or newer)",
    ),
}
# The fatal errors of a machine that may have no GPU at all: their hint goes on to
# the simulated backend, in the config file kiwid was started with.
_NO_GPU = frozenset({pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED})
# NVML error codes that mean "this GPU is unusable".
_LOST = frozenset(
    {pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED, pynvml.NVML_ERROR_UNKNOWN}
)
# Versions of nvmlDeviceGetComputeRunningProcesses, newest first.
_RUNNING_PROCESSES = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
)
# Extra tries of the utilisation query when its sample count grew between pynvml's
# size query and its fetch.
_UTILIZATION_RETRIES = 2


def translate_error(
    err: Exception, what: str, index: int | None = None, *, config: Path = DEFAULT_CONFIG
) -> GpuBackendError:
    """Translate a ``pynvml.NVMLError`` into a Kiwi GPU backend error.

    Args:
        err: The error pynvml raised.
        what: The operation that failed, for the message (e.g. ``"nvmlInit"``).
        index: The GPU the operation was about, or ``None`` for library-wide calls.
        config: The config file in use: where the hint for a machine without a GPU
            says to choose the simulated backend.

    Returns:
        :class:`DriverUnavailable` for a missing library, unloaded driver, missing
        permission, version mismatch or uninitialised library; :class:`GpuLost` for
        a lost GPU, a GPU that needs a reset, or an unknown error on a device;
        :class:`GpuBackendError` otherwise.
    """
    code = getattr(err, "value", None)
    if code in _FATAL:
        reason, hint = _FATAL[code]
        if code in _NO_GPU:
            hint += f' On a machine without a GPU set [gpu] backend = "sim" in {config}'
        return DriverUnavailable(f"{what}: {reason} ({err})", hint)
    if index is not None and code in _LOST:
        return GpuLost(index, f"{what}: {err}")
    where = "" if index is None else f" on GPU {index}"
    return GpuBackendError(f"{what}{where} failed: {err}")


class NvmlBackend:
    """GPU backend on top of NVML; thread-safe (one lock serialises all NVML calls).

    Args:
        wall_clock: Returns wall-clock seconds since the epoch. NVML stamps its
            utilisation samples with CPU wall-clock microseconds, so this (and not a
            monotonic clock) is what :meth:`active_pids` needs.
        config: The config file in use, which the hint of a
            :class:`~kiwid.adapters.gpu.DriverUnavailable` names where the machine
            may have no GPU.
    """

    name = "nvml"

    def __init__(
        self, wall_clock: Callable[[], float] = time.time, *, config: Path = DEFAULT_CONFIG
    ) -> None:
        self._wall_clock = wall_clock
        self._config = config
        self._lock = threading.Lock()
        self._initialised = False
        self._handles: dict[int, Any] = {}
        self._running_processes: Callable[[Any], Any] | None = None

    def _ensure_init(self) -> None:
        """Initialise NVML once (call with the lock held).

        Raises:
            DriverUnavailable: ``NVMLError_LibraryNotFound``, ``DriverNotLoaded``,
                ``NoPermission`` or ``LibRmVersionMismatch`` from ``nvmlInit``.
            GpuBackendError: Any other ``NVMLError`` from ``nvmlInit``.
        """
        if self._initialised:
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise translate_error(err, "nvmlInit", config=self._config) from err
        self._initialised = True
        atexit.register(self.close)
        try:
            log.debug("NVML initialised, driver %s", pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError as err:
            log.debug("NVML initialised, driver version unknown: %s", err)

    def _handle(self, index: int) -> Any:
        """Return the cached device handle for ``index`` (call with the lock held).

        Raises:
            GpuLost: ``NVMLError_GpuIsLost`` / ``Unknown`` for this device.
            DriverUnavailable: See :meth:`_ensure_init`.
            GpuBackendError: Any other ``NVMLError``, e.g. ``InvalidArgument`` for an
                unknown index.
        """
        self._ensure_init()
        handle = self._handles.get(index)
        if handle is None:
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            except pynvml.NVMLError as err:
                raise translate_error(
                    err, "nvmlDeviceGetHandleByIndex", index, config=self._config
                ) from err
            self._handles[index] = handle
        return handle

    def _call(
        self, index: int, what: str, fn: Callable[..., Any], *args: Any, none_on: int = -1
    ) -> Any:
        """Call an NVML device function and translate its errors (lock held).

        Args:
            index: The GPU index; the function gets its handle as first argument.
            what: The NVML function's name, for messages.
            fn: The pynvml function.
            *args: Further arguments for ``fn``.
            none_on: An NVML error code that means "nothing to report": return ``None``.

        Raises:
            GpuLost: ``NVMLError_GpuIsLost`` / ``ResetRequired`` / ``Unknown``.
            DriverUnavailable: The driver or library became unusable.
            GpuBackendError: Any other ``NVMLError``.
        """
        try:
            return fn(self._handle(index), *args)
        except pynvml.NVMLError as err:
            if err.value == none_on:
                return None
            translated = translate_error(err, what, index, config=self._config)
            if isinstance(translated, GpuLost):
                self._handles.pop(index, None)
            raise translated from err

    def devices(self) -> Sequence[DeviceInfo]:
        """List the usable GPUs; a lost GPU is logged at WARNING and left out.

        Returns:
            The usable GPUs, ordered by index.

        Raises:
            DriverUnavailable: NVML cannot be initialised (``LibraryNotFound``,
                ``DriverNotLoaded``, ``NoPermission``, ``LibRmVersionMismatch``).
            GpuBackendError: ``nvmlDeviceGetCount`` or a per-device query failed
                with any other ``NVMLError``.
        """
        with self._lock:
            self._ensure_init()
            try:
                count = int(pynvml.nvmlDeviceGetCount())
            except pynvml.NVMLError as err:
                raise translate_error(err, "nvmlDeviceGetCount", config=self._config) from err
            found: list[DeviceInfo] = []
            for index in range(count):
                try:
                    uuid = self._call(index, "nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID)
                    name = self._call(index, "nvmlDeviceGetName", pynvml.nvmlDeviceGetName)
                    memory = self._call(
                        index, "nvmlDeviceGetMemoryInfo", pynvml.nvmlDeviceGetMemoryInfo
                    )
                except GpuLost as lost:
                    log.warning("leaving out %s", lost)
                    continue
                found.append(DeviceInfo(index, str(uuid), str(name), int(memory.total)))
            return found

    def processes(self, index: int) -> Sequence[GpuProcess]:
        """List the compute processes on a GPU (``nvmlDeviceGetComputeRunningProcesses``).

        The newest versioned symbol the driver has is probed once and logged at DEBUG.

        Args:
            index: The GPU index.

        Returns:
            One entry per process; ``used_memory_bytes`` is ``None`` when NVML
            reports ``NVML_VALUE_NOT_AVAILABLE``.

        Raises:
            GpuLost: ``NVMLError_GpuIsLost`` / ``ResetRequired`` / ``Unknown``.
            DriverUnavailable: NVML is unusable (see the module docstring).
            GpuBackendError: Any other ``NVMLError``, e.g. an unknown index.
        """
        with self._lock:
            procs = self._query_processes(index)
            return [GpuProcess(int(p.pid), _memory(p.usedGpuMemory)) for p in procs]

    def free_memory(self, index: int) -> int:
        """Return the GPU's free memory (``nvmlDeviceGetMemoryInfo``'s ``free``), in bytes.

        Raises:
            GpuLost: ``NVMLError_GpuIsLost`` / ``ResetRequired`` / ``Unknown``.
            DriverUnavailable: NVML is unusable (see the module docstring).
            GpuBackendError: Any other ``NVMLError``, e.g. an unknown index.
        """
        with self._lock:
            self._ensure_init()
            memory = self._call(index, "nvmlDeviceGetMemoryInfo", pynvml.nvmlDeviceGetMemoryInfo)
            return int(memory.free)

    def _query_processes(self, index: int) -> Any:
        """Call the newest available running-processes function (lock held).

        Raises:
            GpuLost: See :meth:`processes`.
            DriverUnavailable: No version of the function exists in the driver.
            GpuBackendError: Any other ``NVMLError``.
        """
        if self._running_processes is not None:
            return self._call(
                index, "nvmlDeviceGetComputeRunningProcesses", self._running_processes
            )
        for symbol in _RUNNING_PROCESSES:
            fn = getattr(pynvml, symbol, None)
            if fn is None:
                continue
            result = self._call(index, symbol, fn, none_on=pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            if result is None:  # the driver predates this version of the function
                log.debug("NVML: %s not found, trying an older version", symbol)
                continue
            log.debug("NVML: using %s", symbol)
            self._running_processes = fn
            return result
        reason, hint = _FATAL[pynvml.NVML_ERROR_FUNCTION_NOT_FOUND]
        raise DriverUnavailable(f"nvmlDeviceGetComputeRunningProcesses: {reason}", hint)

    def active_pids(self, index: int, window_s: float) -> frozenset[int]:
        """Return the PIDs with SM utilisation above zero in the last ``window_s`` seconds.

        ``nvmlDeviceGetProcessUtilization`` raising ``NVMLError_NotFound`` means no
        samples in the window (every process idle or frozen): the empty set.

        Args:
            index: The GPU index.
            window_s: Look-back window in seconds.

        Returns:
            The PIDs that had a sample with ``smUtil > 0`` in the window.

        Raises:
            GpuLost: ``NVMLError_GpuIsLost`` / ``ResetRequired`` / ``Unknown``.
            DriverUnavailable: NVML is unusable (see the module docstring).
            GpuBackendError: Any other ``NVMLError``, e.g. ``NotSupported``.
        """
        since_us = max(0, int((self._wall_clock() - window_s) * 1_000_000))
        with self._lock:
            samples = self._call(
                index,
                "nvmlDeviceGetProcessUtilization",
                _process_utilization,
                since_us,
                none_on=pynvml.NVML_ERROR_NOT_FOUND,
            )
        return frozenset(int(s.pid) for s in samples or () if s.smUtil > 0)

    def close(self) -> None:
        """Shut NVML down if this backend initialised it; safe to call more than once."""
        with self._lock:
            if not self._initialised:
                return
            self._initialised = False
            self._handles.clear()
            atexit.unregister(self.close)
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as err:
                log.debug("nvmlShutdown failed: %s", err)


def _process_utilization(handle: Any, since_us: int) -> Any:
    """Call ``nvmlDeviceGetProcessUtilization``, mapping pynvml's quirk to "no samples".

    pynvml raises ``NVMLError(NVML_SUCCESS)`` when the size query already succeeds,
    which the driver does when there are no samples to return. pynvml sizes its
    sample array by that first answer, without the head room it gives the process
    list, so a process whose first sample lands between its two calls makes the
    fetch fail with ``NVMLError_InsufficientSize`` (NVML documents that the count
    may change between calls): the query is then asked again, up to
    ``_UTILIZATION_RETRIES`` more times.

    Raises:
        pynvml.NVMLError: Any real NVML error (translated by the caller), including
            ``InsufficientSize`` when the count kept growing.
    """
    retries = _UTILIZATION_RETRIES
    while True:
        try:
            return pynvml.nvmlDeviceGetProcessUtilization(handle, since_us)
        except pynvml.NVMLError as err:
            if err.value == pynvml.NVML_SUCCESS:
                return []
            if err.value != pynvml.NVML_ERROR_INSUFFICIENT_SIZE or retries == 0:
                raise
            retries -= 1
            log.debug("NVML: more utilisation samples than a moment ago; asking again")


def _memory(value: int | None) -> int | None:
    """Return used memory in bytes, or ``None`` when NVML did not say.

    pynvml already reports ``NVML_VALUE_NOT_AVAILABLE`` as ``None``; the raw
    value is mapped too, for a binding that passes it through.
    """
    if value is None or value == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
        return None
    return int(value)
