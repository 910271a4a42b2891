"""The simulated GPUs' host links: how long concurrent swaps take.

PCIe is full duplex: a checkpoint (device to host) and a restore (host to device)
each run at their own direction's rate at the same time, while transfers in one
direction share that direction's rate equally (processor sharing). The model is
pure bookkeeping over times given to it (:meth:`Link.start`, :meth:`Link.advance`,
:meth:`Link.finish_at`), so tests drive it on any clock; :meth:`Link.transfer`
blocks a worker thread for as long as the model says.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["Link"]

DIRECTIONS = ("out", "in")


@dataclass
class _Transfer:
    gpu: int
    direction: str
    remaining: float
    """Bytes left to move."""


class Link:
    """Every simulated GPU's link to host RAM, at ``rates`` bytes/s per direction."""

    def __init__(
        self,
        rates: Mapping[str, float],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Model links whose directions (``"out"``, ``"in"``) move ``rates`` bytes/s.

        Raises:
            ValueError: a direction is missing or its rate is not > 0.
        """
        for direction in DIRECTIONS:
            if not rates.get(direction, 0) > 0:
                raise ValueError(f"the {direction!r} rate must be > 0")
        self._rates = dict(rates)
        self._clock = clock
        self._ids = itertools.count()
        self._active: dict[int, _Transfer] = {}
        self._at = -float("inf")
        self._changed = threading.Condition()

    # ------------------------------------------------------------ the model

    def start(self, gpu: int, direction: str, nbytes: int, now: float) -> int:
        """A transfer of ``nbytes`` begins on ``gpu``'s link at ``now``; return its id."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")
        self.advance(now)
        tid = next(self._ids)
        self._active[tid] = _Transfer(gpu, direction, float(max(0, nbytes)))
        return tid

    def advance(self, now: float) -> None:
        """Move every transfer on by what its share of its direction carried until ``now``."""
        if now <= self._at:
            return
        elapsed = now - self._at if self._at > -float("inf") else 0.0
        self._at = now
        sharing = self._sharing()
        for t in self._active.values():
            t.remaining = max(0.0, t.remaining - elapsed * self._rate_of(t, sharing))

    def finish_at(self, tid: int) -> float:
        """When transfer ``tid`` ends if nothing starts or ends before (``now`` if done)."""
        t = self._active[tid]
        return self._at + t.remaining / self._rate_of(t, self._sharing())

    def done(self, tid: int) -> bool:
        """Whether transfer ``tid`` has moved all its bytes (by the last :meth:`advance`)."""
        return self._active[tid].remaining <= 0

    def end(self, tid: int, now: float) -> None:
        """Transfer ``tid`` is over (done, or abandoned): the others share without it."""
        self.advance(now)
        self._active.pop(tid, None)

    def _sharing(self) -> dict[tuple[int, str], int]:
        count: dict[tuple[int, str], int] = {}
        for t in self._active.values():
            key = (t.gpu, t.direction)
            count[key] = count.get(key, 0) + 1
        return count

    def _rate_of(self, t: _Transfer, sharing: dict[tuple[int, str], int]) -> float:
        return self._rates[t.direction] / sharing[(t.gpu, t.direction)]

    # ------------------------------------------------------------ blocking

    def transfer(self, parts: Mapping[int, int], direction: str) -> None:
        """Block until ``parts`` (bytes per GPU index) have crossed in ``direction``."""
        with self._changed:
            ids = [self.start(gpu, direction, n, self._clock()) for gpu, n in parts.items() if n]
            self._changed.notify_all()  # the others' shares just shrank
            try:
                while ids:
                    self.advance(self._clock())
                    for tid in [i for i in ids if self.done(i)]:
                        ids.remove(tid)
                        self.end(tid, self._clock())
                        self._changed.notify_all()  # the others' shares grew
                    if ids:
                        wait = min(self.finish_at(i) for i in ids) - self._clock()
                        self._changed.wait(timeout=max(0.001, min(wait, 1.0)))
            finally:
                for tid in ids:  # interrupted: free the link for the others
                    self.end(tid, self._clock())
                self._changed.notify_all()
