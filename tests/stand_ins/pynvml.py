"""A stand-in for nvidia-ml-py's ``pynvml`` module: NVML without a GPU, for tests.

kiwid's NVML adapter (``kiwid/adapters/nvml.py``) imports ``pynvml``. With this
directory first on ``PYTHONPATH`` a real ``python -m kiwid`` imports this module
instead; a unit test hands it to the adapter directly.

Built like the real thing, in two layers:

* a simulated ``libnvidia-ml.so.1`` (:class:`_Library`): the C functions under
  their exported symbol names, returning ``nvmlReturn_t`` codes and filling
  ctypes out-parameters as the NVML API reference documents them (two-call size
  queries, ``NVML_ERROR_INSUFFICIENT_SIZE``, ``NVML_ERROR_NOT_FOUND`` when no
  utilisation sample is newer than ``lastSeenTimeStamp``, ``UNINITIALIZED``
  after the last ``nvmlShutdown``, ``INVALID_ARGUMENT`` for an index past the
  count);
* the Python binding over it, following nvidia-ml-py's own code paths and
  shapes: ``NVMLError`` with ``.value`` whose constructor picks the per-code
  subclass (``NVMLError_GpuIsLost``, ``NVMLError_NotFound``, ...) made by the
  same mechanism, the same constants, a missing symbol raising
  ``NVMLError_FunctionNotFound``, ctypes structures for memory and utilisation
  samples, "friendly objects" for processes with ``usedGpuMemory = None`` for
  ``NVML_VALUE_NOT_AVAILABLE``, and pynvml's quirk of raising
  ``NVMLError(NVML_SUCCESS)`` when the driver answers the utilisation size
  query with success. ``tests/adapters/test_nvml_standin.py`` checks the names,
  values, signatures and structure fields against the installed nvidia-ml-py.

The simulated machine is the JSON file that ``KIWI_STANDIN_NVML`` names when
NVML is loaded. Without the variable, or without the file, loading fails as on
a machine without the driver: ``nvmlInit`` raises ``NVMLError_LibraryNotFound``.
The file is read again whenever it changes, so a test changes the GPUs under a
running process by rewriting it (write a temporary file, rename it over). Every
key is optional::

    {
      "init": "SUCCESS",            # what nvmlInitWithFlags returns, e.g. "DRIVER_NOT_LOADED"
      "driver_version": "580.159.04",
      "missing": ["nvmlDeviceGetComputeRunningProcesses_v3"],   # symbols the library lacks
      "errors": {"nvmlSystemGetDriverVersion": "NOT_SUPPORTED"}, # library-wide calls
      "devices": [{
        "uuid": "GPU-...", "name": "NVIDIA H200",
        "memory": {"total": 150754820096, "used": 644939776},     # bytes
        "errors": {"*": "GPU_IS_LOST"},      # per symbol, "*" for every call on the device
        "processes": [
          {"pid": 452, "usedGpuMemory": 1050673152},
          {"pid": 474, "usedGpuMemory": null},      # the driver reports NOT_AVAILABLE
          {"pid": 4242, "usedGpuMemory": 2147483648, "live": true}
        ],
        "samples": [{"pid": 452, "timeStamp": 1796036071333820, "smUtil": 83,
                     "memUtil": 18, "encUtil": 0, "decUtil": 0}],
        "no_samples": "NOT_FOUND"            # or "SUCCESS": what the driver says when none
      }]
    }

Error codes are ``NVML_ERROR_*`` names without the prefix, or numbers. The
utilisation query returns one sample per process, its latest, when that is
newer than ``lastSeenTimeStamp`` (as the H200 did). A ``live`` process is a real
one: it is listed while ``/proc/PID`` exists (and is not a zombie), and each
call of the utilisation function samples it, stamped with the current
wall-clock time (``smUtil`` 100 unless the entry says otherwise), while
``/proc/PID/stat`` says it is running (``R``). A process the cgroup freezer
holds (``S`` on cgroup v2, ``D`` on the v1 freezer) or that sleeps gets no new
samples, which is what the H200 showed for a frozen process. As on a real GPU,
a process that starts running between pynvml's size query and its fetch makes
the fetch fail with ``NVML_ERROR_INSUFFICIENT_SIZE``.

A device may take its card from the driver double instead (``"cuda":
"/path"``, the directory of ``tests/stand_ins/libcuda_standin.c``, see
:mod:`cudadir`): its total memory is the double's capacity, its used memory the
resident processes' plus the foreign memory, its compute processes the double's
processes that are not CHECKPOINTED (a checkpointed process vanishes from the
list, as on the H200), each ``live``, and sampled only while not LOCKED (a
locked process does no GPU work). The double's ``lost`` file makes every call
on the device fail with ``GPU_IS_LOST``.

The module's own test hooks, which pynvml lacks, start with ``_standin``.
"""

from __future__ import annotations

import json
import os
import string
import sys
import threading
import time
from collections.abc import Callable
from ctypes import POINTER, Structure, c_uint, c_ulonglong, create_string_buffer
from functools import wraps
from pathlib import Path
from typing import Any, ClassVar

if __package__:  # tests.stand_ins.pynvml
    from tests.stand_ins import cudadir as _cudadir
else:  # the top-level pynvml: tests/stand_ins is on sys.path
    import cudadir as _cudadir

_STANDIN_ENVIRONMENT = "KIWI_STANDIN_NVML"

# nvmlReturn_t
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30
NVML_ERROR_UNKNOWN = 999

NVML_VALUE_NOT_AVAILABLE_ulonglong = c_ulonglong(-1)
NVML_VALUE_NOT_AVAILABLE_uint = c_uint(-1)

NVML_DEVICE_UUID_V2_BUFFER_SIZE = 96
NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE = 80
NVML_DEVICE_NAME_V2_BUFFER_SIZE = 96

nvmlMemory_v2 = 0x02000028

# What libnvidia-ml's nvmlErrorString says for each code.
_ERROR_STRINGS = {
    NVML_SUCCESS: "Success",
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
    NVML_ERROR_INSUFFICIENT_POWER: "Insufficient External Power",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_IRQ_ISSUE: "Interrupt Request Issue",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_CORRUPTED_INFOROM: "Corrupted infoROM",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_OPERATING_SYSTEM: "The operating system has blocked the request.",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
    NVML_ERROR_MEMORY: "Insufficient Memory",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


# ------------------------------------------------------------------ errors


class NVMLError(Exception):
    """An NVML call failed; ``value`` is the ``nvmlReturn_t`` code.

    ``NVMLError(code)`` returns an instance of the code's subclass when there is
    one (``NVMLError(15)`` is an ``NVMLError_GpuIsLost``), as in pynvml.
    """

    _valClassMapping: ClassVar[dict[int, type[NVMLError]]] = {}
    _errcode_to_string: ClassVar[dict[int, str]] = {
        code: text for code, text in _ERROR_STRINGS.items() if code != NVML_SUCCESS
    }
    value: int

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self) -> str:
        try:
            if self.value not in NVMLError._errcode_to_string:
                NVMLError._errcode_to_string[self.value] = str(nvmlErrorString(self.value))
            return NVMLError._errcode_to_string[self.value]
        except NVMLError:
            return f"NVML Error with code {self.value}"

    def __eq__(self, other: object) -> bool:
        # pynvml compares codes (anything else has no .value) and so is unhashable.
        return bool(self.value == getattr(other, "value"))  # noqa: B009


def nvmlExceptionClass(nvmlErrorCode: int) -> type[NVMLError]:
    """The subclass of :class:`NVMLError` for a code (``ValueError`` if none)."""
    if nvmlErrorCode not in NVMLError._valClassMapping:
        raise ValueError(f"nvmlErrorCode {nvmlErrorCode} is not valid")
    return NVMLError._valClassMapping[nvmlErrorCode]


def _extractNVMLErrorsAsClasses() -> None:
    """One subclass per ``NVML_ERROR_*``: ``NVML_ERROR_GPU_IS_LOST`` -> ``NVMLError_GpuIsLost``."""
    module = sys.modules[__name__]
    for name in [n for n in dir(module) if n.startswith("NVML_ERROR_")]:
        words = string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        code = getattr(module, name)

        def fixed_code(value: int) -> Callable[..., NVMLError]:
            def new(cls: type[NVMLError], *_args: Any) -> NVMLError:
                return NVMLError.__new__(cls, value)

            return new

        subclass = type(f"NVMLError_{words}", (NVMLError,), {"__new__": fixed_code(code)})
        subclass.__module__ = __name__
        setattr(module, subclass.__name__, subclass)
        NVMLError._valClassMapping[code] = subclass


_extractNVMLErrorsAsClasses()


def _nvmlCheckReturn(ret: int) -> int:
    if ret != NVML_SUCCESS:
        raise NVMLError(ret)
    return ret


# ------------------------------------------------------------------ structures


class struct_c_nvmlDevice_t(Structure):
    """The device behind a handle (opaque in NVML; here it holds the index)."""

    _fields_: ClassVar = [("index", c_uint)]


c_nvmlDevice_t = POINTER(struct_c_nvmlDevice_t)


class _PrintableStructure(Structure):
    """A ctypes structure that prints its fields and hands out text as ``str``."""

    _fmt_: ClassVar[dict[str, str]] = {}

    def __str__(self) -> str:
        fields = []
        for key, *_ in self._fields_:
            fmt = self._fmt_.get(key, self._fmt_.get("<default>", "%s"))
            fields.append(f"{key}: " + fmt % (getattr(self, key),))
        return f"{type(self).__name__}({', '.join(fields)})"

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        return value.decode() if isinstance(value, bytes) else value


class c_nvmlMemory_t(_PrintableStructure):
    _fields_: ClassVar = [("total", c_ulonglong), ("free", c_ulonglong), ("used", c_ulonglong)]
    _fmt_: ClassVar = {"<default>": "%d B"}


class c_nvmlMemory_v2_t(_PrintableStructure):
    _fields_: ClassVar = [
        ("version", c_uint),
        ("total", c_ulonglong),
        ("reserved", c_ulonglong),
        ("free", c_ulonglong),
        ("used", c_ulonglong),
    ]
    _fmt_: ClassVar = {"<default>": "%d B"}


class c_nvmlProcessInfo_v2_t(_PrintableStructure):
    _fields_: ClassVar = [
        ("pid", c_uint),
        ("usedGpuMemory", c_ulonglong),
        ("gpuInstanceId", c_uint),
        ("computeInstanceId", c_uint),
    ]
    _fmt_: ClassVar = {"usedGpuMemory": "%d B"}


c_nvmlProcessInfo_v3_t = c_nvmlProcessInfo_v2_t
c_nvmlProcessInfo_t = c_nvmlProcessInfo_v3_t


class c_nvmlProcessUtilizationSample_t(_PrintableStructure):
    _fields_: ClassVar = [
        ("pid", c_uint),
        ("timeStamp", c_ulonglong),
        ("smUtil", c_uint),
        ("memUtil", c_uint),
        ("encUtil", c_uint),
        ("decUtil", c_uint),
    ]


class nvmlFriendlyObject:
    """A structure's fields as plain attributes (so ``usedGpuMemory`` may be ``None``)."""

    def __init__(self, dictionary: dict[str, Any]) -> None:
        for key, value in dictionary.items():
            setattr(self, key, value)

    def __str__(self) -> str:
        return str(self.__dict__)


def nvmlStructToFriendlyObject(struct: Structure) -> nvmlFriendlyObject:
    fields = {}
    for key, *_ in struct._fields_:
        value = getattr(struct, key)
        fields[key] = value.decode() if isinstance(value, bytes) else value
    return nvmlFriendlyObject(fields)


# ------------------------------------------------------------------ the simulated library

_STATE_RUNNING = "R"


def _code(value: int | str) -> int:
    """An error code from the JSON file: a number or an ``NVML_ERROR_*`` name sans prefix."""
    if isinstance(value, int):
        return value
    if value == "SUCCESS":
        return NVML_SUCCESS
    return int(globals()[f"NVML_ERROR_{value}"])


def _proc_state(pid: int) -> str | None:
    """The state letter in ``/proc/PID/stat``, or ``None`` when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _device_error(device: dict[str, Any], symbol: str) -> int:
    """The code a call on ``device`` returns before its work: its errors, a lost double."""
    if device.get("cuda") and _cudadir.lost(Path(device["cuda"])):
        return NVML_ERROR_GPU_IS_LOST
    errors = device.get("errors", {})
    return _code(errors.get(symbol, errors.get("*", NVML_SUCCESS)))


class _Library:
    """The simulated ``libnvidia-ml.so.1``: C functions by exported symbol name.

    Each returns an ``nvmlReturn_t`` and writes its results into the ctypes
    objects it is given, where the C function writes through its pointers.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._stamp: tuple[int, int, int] | None = None
        self._world: dict[str, Any] = {}
        self._refcount = 0
        self._lock = threading.RLock()
        self._live_samples: dict[int, dict[int, dict[str, int]]] = {}  # GPU -> PID -> latest
        self._read_world()

    # -- plumbing

    def _read_world(self) -> None:
        try:
            st = self._path.stat()
        except FileNotFoundError:
            return  # keep the last machine seen, as a half-written file would
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp != self._stamp:
            self._world = json.loads(self._path.read_text())
            self._stamp = stamp

    def symbol(self, name: str) -> Callable[..., Any]:
        """Look an exported function up (``AttributeError`` if this library lacks it)."""
        self._read_world()
        if name in self._world.get("missing", ()) or not name.startswith("nvml"):
            raise AttributeError(name)
        fn = getattr(self, name)

        @wraps(fn)
        def exported(*args: Any) -> Any:
            with self._lock:
                _standin_calls.append(name)
                self._read_world()
                return fn(*args)

        return exported

    def _system(self, symbol: str) -> int:
        """The code a library-wide call returns before doing its work."""
        if self._refcount == 0:
            return NVML_ERROR_UNINITIALIZED
        return _code(self._world.get("errors", {}).get(symbol, NVML_SUCCESS))

    def _device(self, symbol: str, handle: Any) -> tuple[int, dict[str, Any]]:
        """The device behind ``handle`` and the code a call on it returns before its work."""
        ret = self._system(symbol)
        if ret != NVML_SUCCESS:
            return ret, {}
        if not handle:
            return NVML_ERROR_INVALID_ARGUMENT, {}
        devices = self._world.get("devices", [])
        index = handle.contents.index
        if index >= len(devices):
            return NVML_ERROR_GPU_NOT_FOUND, {}
        device = devices[index]
        return _device_error(device, symbol), device

    def _processes(self, device: dict[str, Any]) -> list[dict[str, Any]]:
        listed = []
        double = device.get("cuda")
        procs = _cudadir.nvml_view(Path(double))[3] if double else device.get("processes", [])
        for proc in procs:
            if proc.get("live") and _proc_state(int(proc["pid"])) in (None, "Z", "X"):
                continue  # a real process that has exited leaves the driver's list
            listed.append(proc)
        return listed

    # -- library-wide

    def nvmlInitWithFlags(self, flags: int) -> int:
        del flags
        ret = _code(self._world.get("init", NVML_SUCCESS))
        if ret == NVML_SUCCESS:
            self._refcount += 1
        return ret

    def nvmlShutdown(self) -> int:
        ret = self._system("nvmlShutdown")
        if ret == NVML_SUCCESS:
            self._refcount -= 1
        return ret

    def nvmlErrorString(self, result: int) -> bytes:
        return _ERROR_STRINGS.get(result, "Unknown Error").encode()

    def nvmlSystemGetDriverVersion(self, version: Any, length: c_uint) -> int:
        ret = self._system("nvmlSystemGetDriverVersion")
        if ret == NVML_SUCCESS:
            text = str(self._world.get("driver_version", "580.159.04")).encode()
            if len(text) >= length.value:
                return NVML_ERROR_INSUFFICIENT_SIZE
            version.value = text
        return ret

    def nvmlDeviceGetCount_v2(self, count: c_uint) -> int:
        ret = self._system("nvmlDeviceGetCount_v2")
        if ret == NVML_SUCCESS:
            count.value = len(self._world.get("devices", []))
        return ret

    def nvmlDeviceGetHandleByIndex_v2(self, index: c_uint, device: Any) -> int:
        ret = self._system("nvmlDeviceGetHandleByIndex_v2")
        if ret != NVML_SUCCESS:
            return ret
        devices = self._world.get("devices", [])
        if index.value >= len(devices):
            return NVML_ERROR_INVALID_ARGUMENT
        ret = _device_error(devices[index.value], "nvmlDeviceGetHandleByIndex_v2")
        if ret == NVML_SUCCESS:
            device.contents = struct_c_nvmlDevice_t(index.value)
        return ret

    # -- per device

    def nvmlDeviceGetUUID(self, handle: Any, uuid: Any, length: c_uint) -> int:
        return self._text("nvmlDeviceGetUUID", handle, "uuid", uuid, length)

    def nvmlDeviceGetName(self, handle: Any, name: Any, length: c_uint) -> int:
        return self._text("nvmlDeviceGetName", handle, "name", name, length)

    def _text(self, symbol: str, handle: Any, key: str, out: Any, length: c_uint) -> int:
        ret, device = self._device(symbol, handle)
        if ret == NVML_SUCCESS:
            index = handle.contents.index
            uuid = f"GPU-00000000-0000-0000-0000-{index:012x}"
            text = str(device.get(key, uuid if key == "uuid" else "NVIDIA H200")).encode()
            if len(text) >= length.value:
                return NVML_ERROR_INSUFFICIENT_SIZE
            out.value = text
        return ret

    def nvmlDeviceGetMemoryInfo(self, handle: Any, memory: c_nvmlMemory_t) -> int:
        return self._memory("nvmlDeviceGetMemoryInfo", handle, memory)

    def nvmlDeviceGetMemoryInfo_v2(self, handle: Any, memory: c_nvmlMemory_v2_t) -> int:
        if memory.version != nvmlMemory_v2:
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        return self._memory("nvmlDeviceGetMemoryInfo_v2", handle, memory)

    def _memory(self, symbol: str, handle: Any, memory: Any) -> int:
        ret, device = self._device(symbol, handle)
        if ret == NVML_SUCCESS:
            info = device.get("memory", {})
            memory.total = int(info.get("total", 150754820096))
            memory.used = int(info.get("used", 0))
            if device.get("cuda"):
                _, memory.total, memory.used, _ = _cudadir.nvml_view(Path(device["cuda"]))
            memory.free = max(0, memory.total - memory.used)
        return ret

    def nvmlDeviceGetComputeRunningProcesses_v2(
        self, handle: Any, count: c_uint, infos: Any
    ) -> int:
        return self._running("nvmlDeviceGetComputeRunningProcesses_v2", handle, count, infos)

    def nvmlDeviceGetComputeRunningProcesses_v3(
        self, handle: Any, count: c_uint, infos: Any
    ) -> int:
        return self._running("nvmlDeviceGetComputeRunningProcesses_v3", handle, count, infos)

    def _running(self, symbol: str, handle: Any, count: c_uint, infos: Any) -> int:
        ret, device = self._device(symbol, handle)
        if ret != NVML_SUCCESS:
            return ret
        procs = self._processes(device)
        if not procs:  # "NVML_SUCCESS if none are running"
            count.value = 0
            return NVML_SUCCESS
        if infos is None or count.value < len(procs):
            count.value = len(procs)
            return NVML_ERROR_INSUFFICIENT_SIZE
        for slot, proc in zip(infos, procs, strict=False):
            slot.pid = int(proc["pid"])
            used = proc.get("usedGpuMemory")
            slot.usedGpuMemory = NVML_VALUE_NOT_AVAILABLE_ulonglong.value if used is None else used
            slot.gpuInstanceId = slot.computeInstanceId = NVML_VALUE_NOT_AVAILABLE_uint.value
        count.value = len(procs)
        return NVML_SUCCESS

    def nvmlDeviceGetProcessUtilization(
        self, handle: Any, utilization: Any, count: c_uint, last_seen: c_ulonglong
    ) -> int:
        ret, device = self._device("nvmlDeviceGetProcessUtilization", handle)
        if ret != NVML_SUCCESS:
            return ret
        latest: dict[int, dict[str, Any]] = {}  # one sample per process: its latest
        for sample in [*device.get("samples", []), *self._sample_live(handle, device)]:
            pid = int(sample["pid"])
            if pid not in latest or sample["timeStamp"] > latest[pid]["timeStamp"]:
                latest[pid] = sample
        samples = [s for s in latest.values() if int(s["timeStamp"]) > last_seen.value]
        if not samples:
            count.value = 0
            return _code(device.get("no_samples", "NOT_FOUND"))
        if utilization is None or count.value < len(samples):
            count.value = len(samples)
            return NVML_ERROR_INSUFFICIENT_SIZE
        for slot, sample in zip(utilization, samples, strict=False):
            slot.pid = int(sample["pid"])
            slot.timeStamp = int(sample["timeStamp"])
            for key in ("smUtil", "memUtil", "encUtil", "decUtil"):
                setattr(slot, key, int(sample.get(key, 0)))
        count.value = len(samples)
        return NVML_SUCCESS

    def _sample_live(self, handle: Any, device: dict[str, Any]) -> list[dict[str, int]]:
        """Sample the live processes that run now; return each one's latest sample."""
        now_us = int(time.time() * 1_000_000)
        latest = self._live_samples.setdefault(handle.contents.index, {})
        listed = {int(p["pid"]): p for p in self._processes(device) if p.get("live")}
        for pid in set(latest) - set(listed):
            del latest[pid]
        for pid, proc in listed.items():
            if _proc_state(pid) == _STATE_RUNNING and not proc.get("gated"):
                latest[pid] = {
                    "pid": pid,
                    "timeStamp": now_us,
                    "smUtil": int(proc.get("smUtil", 100)),
                    "memUtil": int(proc.get("memUtil", 0)),
                }
        return list(latest.values())


# ------------------------------------------------------------------ the binding

nvmlLib: _Library | None = None
libLoadLock = threading.Lock()
_nvmlLib_refcount = 0
_nvmlGetFunctionPointer_cache: dict[str, Callable[..., Any]] = {}
_standin_calls: list[str] = []
"""Test hook: the C symbols called, in order (pynvml has no such thing)."""


def _standin_reset() -> None:
    """Test hook: forget the loaded library, as in a fresh process (not in pynvml)."""
    global nvmlLib, _nvmlLib_refcount
    with libLoadLock:
        nvmlLib = None
        _nvmlLib_refcount = 0
        _nvmlGetFunctionPointer_cache.clear()
        _standin_calls.clear()


def _standin_refcount() -> int:
    """Test hook: how many ``nvmlInit`` calls no ``nvmlShutdown`` has matched yet."""
    return _nvmlLib_refcount


def _nvmlGetFunctionPointer(name: str) -> Callable[..., Any]:
    if name in _nvmlGetFunctionPointer_cache:
        return _nvmlGetFunctionPointer_cache[name]
    with libLoadLock:
        if nvmlLib is None:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        try:
            _nvmlGetFunctionPointer_cache[name] = nvmlLib.symbol(name)
        except AttributeError:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND) from None
        return _nvmlGetFunctionPointer_cache[name]


def _LoadNvmlLibrary() -> None:
    """Load the simulated library once; no machine file is no ``libnvidia-ml.so.1``."""
    global nvmlLib
    if nvmlLib is not None:
        return
    with libLoadLock:
        if nvmlLib is not None:
            return
        path = Path(os.environ.get(_STANDIN_ENVIRONMENT) or "/nonexistent/libnvidia-ml.so.1")
        if not path.is_file():
            _nvmlCheckReturn(NVML_ERROR_LIBRARY_NOT_FOUND)
        nvmlLib = _Library(path)


def convertStrBytes(func: Callable[..., Any]) -> Callable[..., Any]:
    """Pass ``str`` arguments as bytes, return ``bytes`` results as ``str``."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args = tuple(a.encode() if isinstance(a, str) else a for a in args)
        res = func(*args, **kwargs)
        return res.decode() if isinstance(res, bytes) else res

    return wrapper


def nvmlInitWithFlags(flags: int) -> None:
    global _nvmlLib_refcount
    _LoadNvmlLibrary()
    fn = _nvmlGetFunctionPointer("nvmlInitWithFlags")
    _nvmlCheckReturn(fn(flags))
    with libLoadLock:
        _nvmlLib_refcount += 1


def nvmlInit() -> None:
    nvmlInitWithFlags(0)


def nvmlShutdown() -> None:
    global _nvmlLib_refcount
    fn = _nvmlGetFunctionPointer("nvmlShutdown")
    _nvmlCheckReturn(fn())
    with libLoadLock:
        if _nvmlLib_refcount > 0:
            _nvmlLib_refcount -= 1


@convertStrBytes
def nvmlErrorString(result: int) -> bytes:
    fn = _nvmlGetFunctionPointer("nvmlErrorString")
    return bytes(fn(result))


@convertStrBytes
def nvmlSystemGetDriverVersion() -> bytes:
    c_version = create_string_buffer(NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE)
    fn = _nvmlGetFunctionPointer("nvmlSystemGetDriverVersion")
    _nvmlCheckReturn(fn(c_version, c_uint(NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE)))
    return c_version.value


def nvmlDeviceGetCount() -> int:
    c_count = c_uint()
    fn = _nvmlGetFunctionPointer("nvmlDeviceGetCount_v2")
    _nvmlCheckReturn(fn(c_count))
    return c_count.value


def nvmlDeviceGetHandleByIndex(index: int) -> Any:
    c_index = c_uint(index)
    device = c_nvmlDevice_t()
    fn = _nvmlGetFunctionPointer("nvmlDeviceGetHandleByIndex_v2")
    _nvmlCheckReturn(fn(c_index, device))
    return device


@convertStrBytes
def nvmlDeviceGetName(handle: Any) -> bytes:
    c_name = create_string_buffer(NVML_DEVICE_NAME_V2_BUFFER_SIZE)
    fn = _nvmlGetFunctionPointer("nvmlDeviceGetName")
    _nvmlCheckReturn(fn(handle, c_name, c_uint(NVML_DEVICE_NAME_V2_BUFFER_SIZE)))
    return c_name.value


@convertStrBytes
def nvmlDeviceGetUUID(handle: Any) -> bytes:
    c_uuid = create_string_buffer(NVML_DEVICE_UUID_V2_BUFFER_SIZE)
    fn = _nvmlGetFunctionPointer("nvmlDeviceGetUUID")
    _nvmlCheckReturn(fn(handle, c_uuid, c_uint(NVML_DEVICE_UUID_V2_BUFFER_SIZE)))
    return c_uuid.value


def nvmlDeviceGetMemoryInfo(handle: Any, version: int | None = None) -> Any:
    c_memory: c_nvmlMemory_t | c_nvmlMemory_v2_t
    if not version:
        c_memory = c_nvmlMemory_t()
        fn = _nvmlGetFunctionPointer("nvmlDeviceGetMemoryInfo")
    else:
        c_memory = c_nvmlMemory_v2_t()
        c_memory.version = version
        fn = _nvmlGetFunctionPointer("nvmlDeviceGetMemoryInfo_v2")
    _nvmlCheckReturn(fn(handle, c_memory))
    return c_memory


def _running_processes(symbol: str, handle: Any) -> list[nvmlFriendlyObject]:
    """pynvml's size query, then the real one; ``None`` for memory not available."""
    c_count = c_uint(0)
    fn = _nvmlGetFunctionPointer(symbol)
    ret = fn(handle, c_count, None)
    if ret == NVML_SUCCESS:  # no running processes
        return []
    if ret != NVML_ERROR_INSUFFICIENT_SIZE:
        raise NVMLError(ret)
    c_count.value = c_count.value * 2 + 5  # room for processes started meanwhile
    c_procs = (c_nvmlProcessInfo_t * c_count.value)()
    _nvmlCheckReturn(fn(handle, c_count, c_procs))
    procs = []
    for i in range(c_count.value):
        obj = nvmlStructToFriendlyObject(c_procs[i])
        if obj.usedGpuMemory == NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
            obj.usedGpuMemory = None  # pynvml's "special case for WDDM"
        procs.append(obj)
    return procs


def nvmlDeviceGetComputeRunningProcesses_v2(handle: Any) -> list[nvmlFriendlyObject]:
    return _running_processes("nvmlDeviceGetComputeRunningProcesses_v2", handle)


def nvmlDeviceGetComputeRunningProcesses_v3(handle: Any) -> list[nvmlFriendlyObject]:
    return _running_processes("nvmlDeviceGetComputeRunningProcesses_v3", handle)


def nvmlDeviceGetProcessUtilization(
    handle: Any, timeStamp: int
) -> list[c_nvmlProcessUtilizationSample_t]:
    c_count = c_uint(0)
    c_time_stamp = c_ulonglong(timeStamp)
    fn = _nvmlGetFunctionPointer("nvmlDeviceGetProcessUtilization")
    ret = fn(handle, None, c_count, c_time_stamp)
    if ret != NVML_ERROR_INSUFFICIENT_SIZE:
        # pynvml raises whatever the size query returned, NVML_SUCCESS included.
        raise NVMLError(ret)
    c_samples = (c_nvmlProcessUtilizationSample_t * c_count.value)()
    _nvmlCheckReturn(fn(handle, c_samples, c_count, c_time_stamp))
    return c_samples[0 : c_count.value]
