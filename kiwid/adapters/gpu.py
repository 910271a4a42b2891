"""The GPU backend interface that every GPU adapter implements (stdlib only).

Kiwi learns about GPUs and GPU demand through a :class:`GpuBackend`: the NVML
adapter (:mod:`kiwid.adapters.nvml`) on real hardware, the simulated backend
(:mod:`kiwid.adapters.sim`) on machines without a GPU. Both raise only the
errors defined here, so the daemon never sees a foreign exception type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "DeviceInfo",
    "DriverUnavailable",
    "GpuBackend",
    "GpuBackendError",
    "GpuLost",
    "GpuProcess",
]


@dataclass(frozen=True)
class DeviceInfo:
    """A GPU as the backend sees it.

    Attributes:
        index: The backend's device index (NVML index; stable while the driver is loaded).
        uuid: The GPU's UUID, e.g. ``GPU-5f0c...``; stable across reboots.
        name: The product name, e.g. ``NVIDIA H200``.
        memory_total_bytes: Total device memory in bytes.
    """

    index: int
    uuid: str
    name: str
    memory_total_bytes: int


@dataclass(frozen=True)
class GpuProcess:
    """A compute process that holds a context on a GPU.

    Attributes:
        pid: Host PID of the process.
        used_memory_bytes: Device memory the process uses in bytes, or ``None`` when
            the driver did not say (e.g. NVML reported ``NVML_VALUE_NOT_AVAILABLE``).
    """

    pid: int
    used_memory_bytes: int | None


class GpuBackendError(Exception):
    """Base class of every error a GPU backend raises."""


class DriverUnavailable(GpuBackendError):
    """The GPU driver or its management library cannot be used at all.

    Fatal at startup. ``str()`` of the error ends with ``HINT: ...`` telling the
    operator what to do.

    Attributes:
        reason: What went wrong, without the hint.
        hint: What the operator should do about it.
    """

    def __init__(self, reason: str, hint: str) -> None:
        super().__init__(f"{reason}. HINT: {hint}")
        self.reason = reason
        self.hint = hint


class GpuLost(GpuBackendError):
    """One GPU fell off the bus or is otherwise unusable.

    The daemon marks that GPU unhealthy and carries on with the others.

    Attributes:
        index: The index of the lost GPU.
    """

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"GPU {index} is lost: {reason}")
        self.index = index


class GpuBackend(Protocol):
    """What the daemon needs from a GPU backend.

    Attributes:
        name: Short backend name for logs and status, e.g. ``"nvml"`` or ``"sim"``.
    """

    name: str

    def devices(self) -> Sequence[DeviceInfo]:
        """List the usable GPUs.

        Returns:
            The GPUs, ordered by index.

        Raises:
            DriverUnavailable: The driver or its library cannot be used.
            GpuBackendError: Any other backend failure.
        """
        ...

    def processes(self, index: int) -> Sequence[GpuProcess]:
        """List the compute processes (host PIDs) that hold a context on a GPU.

        Args:
            index: The GPU index.

        Returns:
            One entry per process.

        Raises:
            GpuLost: The GPU is unusable.
            DriverUnavailable: The driver or its library cannot be used.
            GpuBackendError: Any other failure, including an unknown index.
        """
        ...

    def active_pids(self, index: int, window_s: float) -> frozenset[int]:
        """Return the PIDs that did GPU work recently.

        Args:
            index: The GPU index.
            window_s: Look-back window in seconds.

        Returns:
            The PIDs with SM utilisation above zero in the last ``window_s`` seconds.
            A frozen or idle process is not in the set.

        Raises:
            GpuLost: The GPU is unusable.
            DriverUnavailable: The driver or its library cannot be used.
            GpuBackendError: Any other failure, including an unknown index.
        """
        ...

    def free_memory(self, index: int) -> int:
        """Return the GPU's free memory in bytes, as the driver counts it.

        Args:
            index: The GPU index.

        Raises:
            GpuLost: The GPU is unusable.
            DriverUnavailable: The driver or its library cannot be used.
            GpuBackendError: Any other failure, including an unknown index.
        """
        ...

    def close(self) -> None:
        """Release the backend's resources; safe to call more than once."""
        ...
