"""Whether the driver can checkpoint a tenant: what kiwid can tell from the host.

The driver's checkpoint does not support memory shared between processes: CUDA
IPC, and NCCL's transports between the processes of one job (a multi-process
NCCL job fails to restore). A tenant whose processes map NCCL's shared-memory
segments (``/dev/shm/nccl-*``), or several of whose processes load NCCL, is
kept on the card instead: it is gated, never swapped, and the rotation goes on
around it. CUDA IPC and managed (UVM) memory leave no trace kiwid can read
here; a checkpoint that fails because of them is remembered of the workload
(:mod:`kiwid.daemon.tenants.workloads`), so its next runs stay on the card too.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import PurePosixPath

from kiwid.linux import proc

NCCL_SHM_PREFIX = "/dev/shm/nccl-"


def why_not(pids: Iterable[int]) -> str | None:
    """Why the processes ``pids`` of one tenant cannot be checkpointed (``None``: no sign)."""
    loading: list[int] = []
    for pid in sorted(pids):
        files = proc.mapped_files(pid)
        if not files:
            continue
        shared = sorted(f for f in files if f.startswith(NCCL_SHM_PREFIX))
        if shared:
            return (
                f"it uses NCCL between processes (pid {pid} maps {shared[0]}); the driver "
                "cannot checkpoint a multi-process NCCL job"
            )
        if any(PurePosixPath(f).name.startswith("libnccl") for f in files):
            loading.append(pid)
    if len(loading) > 1:
        return (
            f"it runs NCCL in {len(loading)} processes (pids "
            f"{', '.join(map(str, loading[:4]))}); the driver cannot checkpoint a "
            "multi-process NCCL job"
        )
    return None
