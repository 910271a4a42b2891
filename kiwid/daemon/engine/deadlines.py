"""How long each job may run before its tenant is stuck (``gpu.driver_timeout``).

A gate or an ungate is tried again for ``driver_timeout`` (a freeze that did not
take, a lock the driver refused), so its deadline is that window plus one more
attempt (a follow that moves its new processes' memory, their checkpoint on top).
A checkpoint or a restore gets ``driver_timeout`` plus twice its size at
the slowest rate the swapper expects: a 47 GiB checkpoint takes half a minute on
an H200, and is no fault. A retry or a release may restore the whole tenant.
"""

from __future__ import annotations

from collections.abc import Callable

from kiwid.core.events import Event, TenantFaulted
from kiwid.core.residency import Residency
from kiwid.daemon.engine.executor import OPERATIONS, Job, Kind
from kiwid.daemon.gating.swap import Swapper

_RESTORING = (Kind.SWAP_IN, Kind.RETRY, Kind.RELEASE)


def deadlines(
    driver_s: Callable[[], float],
    gate_s: Callable[[], float],
    swapper: Swapper | None,
) -> Callable[[Job, int], float]:
    """A job's deadline in seconds, given the bytes it moves, by the settings in force."""

    def deadline_s(job: Job, nbytes: int) -> float:
        driver = driver_s()
        if job.kind is Kind.SWAP_OUT and swapper is not None:
            return driver + 2 * swapper.expected_s(nbytes, "out")
        if job.kind is Kind.FOLLOW and job.sizes and swapper is not None:  # lock, then move
            return 2 * driver + gate_s() + 2 * swapper.expected_s(nbytes, "out")
        if job.kind in _RESTORING and swapper is not None:
            return 2 * driver + 2 * swapper.expected_s(nbytes, "in")
        return 2 * driver + gate_s()

    return deadline_s


LOCKING = (Kind.GATE, Kind.FOLLOW, Kind.RETRY)
"""Jobs that lock: one whose call returns after kiwid gave up on it is settled
(its late lock recorded or undone, as kiwid holds the tenant now)."""
MAY_RUN = (Kind.GATE, Kind.FOLLOW, Kind.UNGATE, Kind.RELEASE, Kind.SETTLE)
"""Jobs whose call, hanging, may leave the tenant running (or let it run when it
returns): it counts as running, and is fenced with the freezer where it can be."""


def late(job: Job, seconds: float) -> list[Event]:
    """What the scheduler hears of a job that ran past its deadline."""
    operation = OPERATIONS.get(job.kind)
    if operation is None:  # a forget: its tenant is gone
        return []
    reason = (
        f"its {job.kind.value} ran past its deadline ({seconds:.0f} s, gpu.driver_timeout): "
        "the driver call has not returned"
    )
    if job.kind in (*MAY_RUN, Kind.FENCE):  # it may run (the call may yet return)
        answers = job.kind not in (Kind.FOLLOW, Kind.FENCE)  # (these answer no Gate asked)
        return [TenantFaulted(job.tenant, operation, reason, contained=False, answers=answers)]
    moving = job.kind in (Kind.SWAP_OUT, Kind.SWAP_IN, Kind.RETRY, Kind.RELEASE)
    return [TenantFaulted(job.tenant, operation, reason, Residency.UNKNOWN if moving else None)]
