"""What carrying out a job needs: the gate, the swapper, the state file, the guards.

Shared by the job modules (:mod:`.gate_jobs`, :mod:`.swap_jobs`, :mod:`.mend_jobs`);
:class:`~kiwid.daemon.engine.effects.Effects` owns one and dispatches to them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kiwid.core.events import TenantFaulted
from kiwid.core.residency import Residency
from kiwid.daemon.engine.executor import Job
from kiwid.daemon.gating.cudagate import CudaLockGate
from kiwid.daemon.gating.gates import GateError, TenantGate
from kiwid.daemon.gating.record import GatedRecord, RecordedFault
from kiwid.daemon.gating.state import StateFile
from kiwid.daemon.gating.swap import Placement, Swapper
from kiwid.daemon.tenants.tracker import TenantInfo

log = logging.getLogger("kiwid.engine")


def _unknown(_: str) -> int | None:
    return None


def _no_reason(_: Sequence[int]) -> str | None:
    return None


def _nobody(tenant: str, reason: str, permanent: bool) -> None:
    return None


@dataclass(frozen=True)
class SwapGuards:
    """What a swap asks of the world around it (the daemon wires them to the GPU)."""

    free_bytes: Callable[[str], int | None] = _unknown
    """A GPU's free memory now, by the driver (``None``: it cannot be read)."""
    reserve_bytes: Callable[[], int] = int
    """``memory.reserve_mib`` in force, in bytes."""
    unswappable: Callable[[Sequence[int]], str | None] = _no_reason
    """Why a tenant's processes cannot be checkpointed (``None``: no sign of it)."""
    checkpoint_failed: Callable[[str, str, bool], None] = _nobody
    """Told of every tenant the driver could not (or must not) checkpoint, why, and
    whether that is the workload's nature (``permanent``) or only now."""


@dataclass
class Tools:
    """The things every job works with."""

    gate: TenantGate
    state: StateFile
    swapper: Swapper | None = None
    guards: SwapGuards = field(default_factory=SwapGuards)
    clock: Callable[[], float] = time.monotonic
    retry_for_s: Callable[[], float] = lambda: 0.0
    """How long a gate or ungate that fails is tried again (``gpu.driver_timeout``)."""
    sleep: Callable[[float], None] = time.sleep

    def placement(self, record: GatedRecord) -> Placement:
        """Where a recorded tenant's memory is now (all on the card without a swapper)."""
        if self.swapper is None:
            return Placement(Residency.RESIDENT)
        return self.swapper.placement(record)

    def retrying(
        self, attempt: Callable[[], None], what: str, given_up: threading.Event | None = None
    ) -> None:
        """Call ``attempt`` until it works or ``retry_for_s`` has passed, backing off.

        ``given_up``: the job's; once set (it ran past its deadline), a failed
        attempt is not tried again: kiwid deals with the tenant since, and a late
        attempt would write over what it did.

        Raises:
            GateError: the last attempt's failure (an ``OSError`` becomes one).
        """
        deadline = self.clock() + self.retry_for_s()
        delay = 0.1
        while True:
            try:
                attempt()
            except (GateError, OSError) as err:
                failure = err if isinstance(err, GateError) else _os_failure(err, what)
                late = given_up is not None and given_up.is_set()
                if late or self.clock() + delay > deadline:
                    raise failure from err
                log.warning("%s failed (%s); trying again in %.1f s", what, err, delay)
                self.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            return

    def record_fault(self, fault: TenantFaulted) -> None:
        """Keep why a tenant is stuck in its record: a restarted kiwid keeps it stuck."""
        kept = RecordedFault(fault.operation, fault.reason, time.time(), fault.pid, fault.answer)

        def with_fault(record: GatedRecord | None) -> GatedRecord | None:
            return None if record is None else replace(record, fault=kept)

        try:
            self.state.update(fault.tenant, with_fault)
        except OSError as err:
            log.warning("Cannot record why %s is stuck: %s", fault.tenant, err)

    def fence(
        self, info: TenantInfo | None, fault: TenantFaulted, given_up: threading.Event | None = None
    ) -> TenantFaulted:
        """Freeze a tenant whose lock cannot be trusted; the fault, told as it now stands.

        The fence is recorded ahead of the freeze (so recovery thaws it). Without a
        fence (the freezer gate, no record, no cgroup) the fault says it may run.
        ``given_up``: the job's, set once it ran past its deadline. A call that
        returns that late finds the tenant dealt with since (fenced by kiwid,
        released or retried by an operator): it fences nothing, or it would freeze
        a tenant that an operator let run.
        """
        if given_up is not None and given_up.is_set():
            log.warning("%s: not fenced, its call returned late: %s", fault.tenant, fault.reason)
            return fault
        gate = self.gate
        if not isinstance(gate, CudaLockGate) or info is None:
            return _as(fault, contained=False, why="no fence")
        try:
            record = self.state.records.get(fault.tenant) or gate.prepare(info)
            fenced = gate.fence(info, record)
            self.state.put(fenced)  # write-ahead: every way out thaws it
            try:
                gate.freeze_fence(fenced)
            except GateError:
                self.state.put(record, only=fenced)  # unless another wrote since
                raise
        except (GateError, OSError) as err:
            log.error("Cannot fence %s with the freezer: %s; it may run", fault.tenant, err)
            return _as(fault, contained=False, why=f"the fence failed too: {err}")
        log.warning("Fenced %s with the cgroup freezer: %s", fault.tenant, fault.reason)
        return _as(fault, contained=True, why="fenced with the cgroup freezer")


def _as(fault: TenantFaulted, *, contained: bool, why: str) -> TenantFaulted:
    return TenantFaulted(
        fault.tenant,
        fault.operation,
        f"{fault.reason}; {why}",
        fault.memory,
        contained,
        fault.pid,
        fault.answer,
        fault.answers,
    )


def _os_failure(err: OSError, what: str) -> GateError:
    answer = f"errno {err.errno}" if err.errno else None
    return GateError(f"{what}: cannot write the state file: {err.strerror or err}", None, answer)


def not_given_up(job: Job, what: str) -> None:
    """Go on only if kiwid has not given up on ``job``: a late job changes nothing more.

    Raises:
        GateError: it ran past its deadline; kiwid deals with its tenant since.
    """
    if job.given_up.is_set():
        raise GateError(f"{job.tenant}: not {what}: kiwid gave up on its {job.kind.value}")


def who(info: TenantInfo | None, tenant: str) -> str:
    """A tenant as log lines name it: ``name (key)``, or the key alone."""
    name = info.identity.name if info else tenant
    return f"{name} ({tenant})" if name != tenant else tenant
