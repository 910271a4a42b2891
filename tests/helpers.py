"""What many tests share: waiting for real state, and stepping a fake clock.

* :func:`wait_for` polls a predicate over real things (a cgroup, a process, a log)
  with a short backoff until it holds, and fails the test at the deadline with
  what it waited for. It is for state that has no event to await.
* :func:`steps` drives a scheduler on a fake clock the way the daemon's loop
  does: it stops at every deadline the scheduler names on the way, so a test
  never jumps over a preemption.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 5.0,
    what: str = "condition",
    *,
    max_delay: float = 0.05,
) -> T:
    """Poll ``predicate`` until it returns something truthy (and return that).

    Fails the test after ``timeout`` seconds, naming ``what``. The first polls
    come quickly (5 ms), then back off up to ``max_delay`` seconds.
    """
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, max_delay)


def steps(
    now: Callable[[], float],
    next_deadline: Callable[[], float | None],
    seconds: float,
    max_step: float = math.inf,
) -> Iterator[float]:
    """How far to advance a fake clock each time until ``seconds`` have passed.

    Each step ends at the scheduler's next deadline if one comes first (read
    afresh before every step, after the caller fed its events), or after
    ``max_step`` seconds (for callers that feed activity every second).
    """
    end = now() + seconds
    while now() < end:
        step = min(max_step, end - now())
        deadline = next_deadline()
        if deadline is not None and deadline > now():
            step = min(step, deadline - now())
        yield step
