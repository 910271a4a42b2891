"""What carrying out a job needs: the gate, the swapper, the state file, the guards.

Shared by the job modules (:mod:`.gate_jobs`, :mod:`.swap_jobs`, :mod:`.mend_jobs`,
:mod:`.converge_jobs`); :class:`~kiwid.daemon.engine.effects.Effects` owns one and
dispatches to them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kiwid.core.residency import Residency
from kiwid.daemon.gating.gates import GateError, TenantGate
from kiwid.daemon.gating.record import GatedRecord
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


def _unmeasured(_: int) -> dict[str, int] | None:
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
    pid_bytes: Callable[[int], dict[str, int] | None] = _unmeasured
    """A process's memory per GPU by the last poll (``None``: not listed, or the
    driver does not say how much)."""


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

    def retrying(self, attempt: Callable[[], None], what: str) -> None:
        """Call ``attempt`` until it works or ``retry_for_s`` has passed, backing off.

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
                if self.clock() + delay > deadline:
                    raise failure from err
                log.warning("%s failed (%s); trying again in %.1f s", what, err, delay)
                self.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            return


def _os_failure(err: OSError, what: str) -> GateError:
    answer = f"errno {err.errno}" if err.errno else None
    return GateError(f"{what}: cannot write the state file: {err.strerror or err}", None, answer)


def who(info: TenantInfo | None, tenant: str) -> str:
    """A tenant as log lines name it: ``name (key)``, or the key alone."""
    name = info.identity.name if info else tenant
    return f"{name} ({tenant})" if name != tenant else tenant
