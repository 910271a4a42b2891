"""Injected time: the core never reads a clock, the shell passes ``now`` in.

``MonotonicClock`` is what the daemon uses; ``FakeClock`` is what the tests use,
so that a 30-second quantum takes no time to test.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Something that tells monotonic time in seconds."""

    def now(self) -> float:
        """Return the current monotonic time in seconds."""
        ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` (never jumps with NTP or DST)."""

    def now(self) -> float:
        """Return ``time.monotonic()``."""
        return time.monotonic()


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        """Start at ``start`` seconds."""
        self._now = start

    def now(self) -> float:
        """Return the fake time."""
        return self._now

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds`` (>= 0) and return the new time.

        Raises:
            ValueError: ``seconds`` is negative (monotonic time never goes back).
        """
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back ({seconds} s)")
        self._now += seconds
        return self._now
