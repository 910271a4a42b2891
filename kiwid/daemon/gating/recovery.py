"""Letting go of recorded tenants: one path for start-up, shutdown and ``kiwid recover``.

For each record of the state file: if its memory is in host RAM and a process of
it still lives, bring the memory back (when the card has room); then ungate it;
then forget the record. Tenants whose memory is on the card go first, so that the
swapped ones find room. A tenant that cannot be let go stays recorded (and gated),
and the caller says so. The state file is written once at the end, whatever the
number of records, so recovering thousands costs thousands of ungates, not
thousands of fsyncs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kiwid.adapters import procs
from kiwid.adapters.cgroups import CgroupLayout
from kiwid.adapters.cudalock import CudaLock, CudaLockError
from kiwid.daemon.gating.cudagate import CudaLockGate
from kiwid.daemon.gating.gates import FreezeGate, GateError, Guard, TenantGate, always
from kiwid.daemon.gating.record import GatedRecord
from kiwid.daemon.gating.state import StateFile
from kiwid.daemon.gating.swap import SwapError, Swapper, restore_record

log = logging.getLogger("kiwid.recovery")

RETRY_PAUSE_S = 0.5
"""Between a release's attempts: a checkpoint or restore in flight (a call that
returned late, a kiwid killed during one) ends in the driver meanwhile."""


@dataclass(frozen=True)
class Undo:
    """How this process undoes a record: its gate's ungate, its swapper's restore."""

    ungate: Callable[[GatedRecord], None]
    """Raises :class:`~kiwid.daemon.gating.gates.GateError` if it cannot."""
    restore: Callable[[GatedRecord], None]
    """Raises :class:`~kiwid.daemon.gating.swap.SwapError` if it cannot."""


def undo_with(
    state_dir: Path,
    gate: TenantGate | None = None,
    swapper: Swapper | None = None,
    guard: Guard = always,
) -> Callable[[GatedRecord], Undo]:
    """How to undo each record: with the live gate and swapper where they made it.

    A record made another way (a previous kiwid with another gate) is undone the
    way it names, as ``kiwid recover`` does without a daemon. ``guard``: a live
    kiwid's (its state file's), so that what a job read is undone only while it is
    still the record (:meth:`~kiwid.daemon.gating.gates.TenantGate.ungate`).
    """

    def offline_restore(record: GatedRecord) -> None:
        restore_record(record, state_dir)

    def undo(record: GatedRecord) -> Undo:
        ungate: Callable[[GatedRecord], None] = ungate_record
        if gate is not None and gate.method == record.method:
            ungate = functools.partial(gate.ungate, guard=guard)
        restore = offline_restore
        made_here = swapper is not None and swapper.method == record.swap_method
        locked_here = swapper is not None and swapper.method == "checkpoint"
        if swapper is not None and (made_here or (locked_here and record.method == "cuda-lock")):
            restore = swapper.swap_in
        return Undo(ungate, restore)

    return undo


def alive(record: GatedRecord) -> bool:
    """Whether a process of the recorded tenant still runs (the same process)."""
    return any(procs.alive(pid, start) for pid, start in record.pid_starts().items())


def release(
    record: GatedRecord,
    undo: Undo,
    note: str = "",
    again: str = "kiwid recover",
) -> str | None:
    """Restore (if alive), ungate and unfence one tenant; why not, if it could not.

    The driver's word decides, not only the record: a tenant locked by the CUDA
    gate has every checkpointed process restored before it is unlocked, also
    when the record says nothing of host RAM (a kiwid killed during a
    checkpoint), and a checkpoint that ended meanwhile is restored in turn.
    ``note`` ends the log line (e.g. who left it gated); ``again`` is the command
    that tries once more, named in the advice when memory stays in host RAM.
    """
    if record.swapped and not alive(record):
        log.info("Dropped %s: its processes are gone (and its host memory)", record.tenant)
        return None
    for attempt in range(3):
        try:
            undo.restore(record)
        except SwapError as err:
            nbytes = sum((record.swapped or {}).values())
            return (
                f"its memory ({nbytes} bytes by the record) stays in host RAM and it stays "
                f"gated ({err}). Free GPU memory (stop another job) and run `{again}` "
                f"again, or end the tenant (pids {' '.join(map(str, record.pids))})"
            )
        try:
            undo.ungate(record)
        except GateError as err:
            if attempt < 2:  # a move in flight may have ended meanwhile: once more
                time.sleep(RETRY_PAUSE_S)
                continue
            return str(err)
        break
    if record.swapped:
        log.info("Restored %s's memory from host RAM", record.tenant)
    log.info("Ungated %s%s", record.tenant, note)
    return None


def release_all(
    state: StateFile,
    records: Iterable[GatedRecord],
    undo: Callable[[GatedRecord], Undo],
    note: str = "",
) -> dict[str, str]:
    """Let go of ``records`` (resident ones first); return those kept, with why.

    The released are dropped from ``state`` with one write; ``note`` ends each
    "Ungated" line.
    """
    kept: dict[str, str] = {}
    released: list[str] = []
    for record in sorted(records, key=lambda r: (bool(r.swapped), r.tenant)):
        why = release(record, undo(record), note)
        if why is None:
            released.append(record.tenant)
        else:
            kept[record.tenant] = why
            kind = "Kept swapped" if record.swapped else "Kept gated"
            log.error("%s: %s: %s", kind, record.tenant, why)
    state.drop_many(released)
    return kept


def report_skipped(state: StateFile) -> None:
    """Log each record of the last load that was not of the documented shape."""
    for tenant, why in sorted(state.skipped.items()):
        log.error(
            "Skipped record %r of %s: %s; nothing was done for it (thaw it by hand if it is "
            "a frozen cgroup: echo 0 > /sys/fs/cgroup/<path>/cgroup.freeze)",
            tenant,
            state.path,
            why,
        )


def ungate_record(record: GatedRecord, layout: CgroupLayout | None = None) -> None:
    """Undo ``record`` without a running daemon (``kiwid recover``, start-up).

    Raises:
        GateError: the tenant could not be ungated.
    """
    if record.method == "freeze":
        FreezeGate(layout or CgroupLayout.detect()).ungate(record)
    elif record.method == "cuda-lock":
        try:
            lock = CudaLock()
        except CudaLockError as err:
            raise GateError(f"{record.tenant}: the CUDA lock is unavailable here: {err}") from err
        fence = FreezeGate(layout or CgroupLayout.detect()) if record.fenced else None
        CudaLockGate(lock, fence=fence).ungate(record)
    elif record.method != "none":
        raise GateError(f"{record.tenant}: unknown gate method {record.method!r}")
