"""bench/gpu/swap.py's surroundings: kiwid's config, the machine, NVML's view of GPU 0."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from enforcement import SOCK, STATE

HERE = Path(__file__).resolve().parent
GIB = 2**30

# --------------------------------------------------------------------- kiwid config


def config_text(
    tq: float,
    *,
    backend: str,
    gate: str | None,
    swap: str = "checkpoint",
    host_floor_mib: int = 4096,
    sim_gib: float = 140.0,
    sim_gbps: tuple[float, float] = (25.0, 50.0),
    state_dir: Path = STATE,
    checkpoint_lanes: int | None = None,
    newcomer: str | None = None,
    declared: Mapping[str, int] | None = None,
) -> str:
    """kiwid's config; ``checkpoint_lanes`` and ``newcomer`` are written only when given.

    (``memory.checkpoint_lanes``, ``memory.newcomer``: issue 13's keys; a kiwid without
    them rejects the config at ``check-config``.) ``declared``: bytes per tenant cgroup
    (``/kiwigpu-bench-0``...), each a ``[[tenants]]`` rule's ``memory`` (issue 18's).
    """
    gate_line = f'gate = "{gate}"\n' if gate else ""
    sim = (
        f"[gpu.sim]\ndevices = 1\nmemory_gib = {sim_gib:g}\n"
        f"swap_out_gbps = {sim_gbps[0]:g}\nswap_in_gbps = {sim_gbps[1]:g}\n"
        if backend == "sim"
        else ""
    )
    return (
        f"[scheduler]\ntq = {tq:g}\nidle_release = 5\n"
        f'[gpu]\nbackend = "{backend}"\npoll_interval = 0.5\n{gate_line}{sim}'
        f'[memory]\nswap = "{swap}"\nreserve_mib = 1024\nhost_floor_mib = {host_floor_mib}\n'
        + (f"checkpoint_lanes = {checkpoint_lanes}\n" if checkpoint_lanes is not None else "")
        + (f'newcomer = "{newcomer}"\n' if newcomer is not None else "")
        + f'[control]\nsocket = "{SOCK}"\n'
        f'[daemon]\nstate_dir = "{state_dir}"\n'
        '[kubernetes]\ncdi_dir = ""\n'
        + "".join(
            f'[[tenants]]\nmatch = {{ cgroup = "{cgroup}" }}\nmemory = {nbytes}\n'
            for cgroup, nbytes in sorted((declared or {}).items())
        )
    )


# --------------------------------------------------------------------- the machine


def host_available() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def host_total() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def machine_line() -> str:
    sys.path.insert(0, str(HERE.parent))
    try:
        from _kiwid import machine  # noqa: PLC0415 - bench/_kiwid.py, the benchmarks' line

        return str(machine())
    except Exception as exc:
        return f"machine: {os.uname().nodename} ({exc})"


class GpuMemory:
    """NVML's view of GPU 0 (or, in a rehearsal, one kept from kiwid's swap lines)."""

    def __init__(self, nvml: Any = None, handle: Any = None, total: int = 0) -> None:
        self.nvml, self.handle = nvml, handle
        self.total = total
        self.resident: dict[str, int] = {}  # rehearsal: tenant -> bytes on the card
        self.errors: list[str] = []

    def used_free(self) -> tuple[int, int]:
        """(used, free) bytes; a failed NVML query counts as a full card."""
        if self.nvml is not None:
            try:
                info = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
            except Exception as exc:
                self.errors.append(str(exc))
                return self.total, 0
            return int(info.used), int(info.free)
        used = sum(self.resident.values())
        return used, max(0, self.total - used)

    def processes(self) -> int:
        if self.nvml is None:
            return len(self.resident)
        return len(self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle))


# --------------------------------------------------------------------- kiwid's status


def gpu0(status: Mapping[str, Any]) -> Mapping[str, Any]:
    gpus = status.get("gpus") if isinstance(status, Mapping) else None
    return gpus[0] if gpus else {}


def holder_of(status: Mapping[str, Any]) -> str | None:
    holder = gpu0(status).get("holder") or {}
    return holder.get("tenant")


def swap_of(status: Mapping[str, Any]) -> str | None:
    swap = gpu0(status).get("swap")
    if not swap:
        return None
    if isinstance(swap, Mapping):
        done, total = swap.get("done_bytes") or 0, swap.get("bytes") or 0
        return (
            f"{swap.get('direction')} {swap.get('tenant')} {done / GIB:.1f}/{total / GIB:.1f} GiB"
        )
    return str(swap)


def calm(status: Mapping[str, Any], lead_s: float) -> bool:
    """No swap-in in flight, no hand-over due within lead_s (no status: don't block on it).

    A swap-in takes GPU memory that NVML may not show yet; a swap-out only frees it.
    """
    gpu = gpu0(status)
    if not gpu:
        return True
    swap = gpu.get("swap")
    if swap and (not isinstance(swap, Mapping) or swap.get("direction") != "out"):
        return False
    remaining = (gpu.get("holder") or {}).get("remaining_s")
    return remaining is None or remaining >= lead_s
