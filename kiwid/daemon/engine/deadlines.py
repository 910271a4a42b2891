"""How long each job may run before its tenant is stuck (``gpu.driver_timeout``).

A gate or an ungate is tried again for ``driver_timeout`` (a freeze that did not
take, a lock the driver refused), so its deadline is that window plus one more
attempt. A checkpoint gets ``driver_timeout`` plus twice its size at the slowest
rate the swapper expects: a 47 GiB checkpoint takes half a minute on an H200, and
is no fault. A job that may restore (a swap-in, a retry, a release, a converge)
gets twice ``driver_timeout`` plus twice its size at the slowest restore rate.

A job past its deadline is not given up on: its call goes on, and keeps its
tenant's lane until it returns. What the scheduler hears is :func:`overdue`.
"""

from __future__ import annotations

from collections.abc import Callable

from kiwid.core.events import JobOverdue
from kiwid.daemon.engine.executor import OPERATIONS, Job, Kind
from kiwid.daemon.gating.swap import Swapper

_RESTORING = (Kind.SWAP_IN, Kind.RETRY, Kind.RELEASE, Kind.CONVERGE)
MAY_RUN = frozenset(
    {Kind.GATE, Kind.UNGATE, Kind.RELEASE, Kind.RETRY, Kind.FOLLOW, Kind.CONVERGE, Kind.FENCE}
)
"""Jobs whose call, hanging, may leave the tenant running (a lock that did not take,
an unlock half-way): it counts as running, and is fenced with the freezer."""
MOVING = frozenset({Kind.SWAP_OUT, Kind.SWAP_IN, Kind.RETRY, Kind.RELEASE, Kind.CONVERGE})
"""Jobs whose call, hanging, leaves the tenant's memory nowhere known."""


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
        if job.kind in _RESTORING and swapper is not None:
            return 2 * driver + 2 * swapper.expected_s(nbytes, "in")
        return 2 * driver + gate_s()

    return deadline_s


def overdue(job: Job, seconds: float) -> list[JobOverdue]:
    """What the scheduler hears of a job that ran past its deadline (a forget: nothing)."""
    operation = OPERATIONS.get(job.kind)
    if operation is None:  # a forget: its tenant is gone
        return []
    reason = (
        f"its {job.kind.value} ran past its deadline ({seconds:.0f} s, gpu.driver_timeout): "
        "the driver call has not returned; its next jobs wait for it"
    )
    may_run = job.kind in MAY_RUN
    return [
        JobOverdue(
            job.tenant, operation, reason, may_run, moving=job.kind in MOVING, epoch=job.epoch
        )
    ]
