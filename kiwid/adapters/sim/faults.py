"""Faults injected into the simulated GPU's swaps (``sim-fault``), stdlib only.

On a real GPU the driver's checkpoint API fails in ways kiwid must survive: a
checkpoint or restore that fails, one that hangs, a process left in host RAM
for good after a failed restore (NVIDIA cuda-checkpoint issue 44). The
simulated GPU's swapper asks this table before each swap, so that tests reach
the same paths without a GPU. One fault per process and operation
(``checkpoint``: a swap-out, ``restore``: a swap-in):

* ``fail``: the next ``times`` swaps of the process fail;
* ``hang``: the next ``times`` swaps block (their worker thread waits) until
  the fault is cleared, then do their work;
* ``stuck``: the next ``times`` swaps fail and leave the process's memory off
  the card, and every later restore of it fails, until cleared;
* ``none``: clears the process's fault of that operation, ends the swaps it
  holds hanging, and un-sticks the process.

Thread-safe: the control socket's thread injects, the swap workers take.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FAULTS", "OPS", "SimFault", "SimFaults"]

OPS = ("checkpoint", "restore")
"""The operations a fault may be injected into: the swap-out and the swap-in."""
FAULTS = ("fail", "hang", "stuck", "none")
"""The faults :meth:`SimFaults.inject` accepts (``none`` clears)."""


@dataclass(frozen=True)
class SimFault:
    """The fault one swap met.

    Attributes:
        pid: The process it was injected for.
        op: ``checkpoint`` or ``restore``.
        kind: ``fail``, ``hang`` or ``stuck``.
        clears: For a hang: how many times ``none`` had cleared this fault before it
            was taken; the hang ends at the next.
    """

    pid: int
    op: str
    kind: str
    clears: int = 0


class SimFaults:
    """The injected faults, by process and operation; empty: every swap works."""

    def __init__(self, poll_s: float = 0.1) -> None:
        """Make an empty table; a hang looks again every ``poll_s`` seconds at the latest."""
        self._changed = threading.Condition()
        self._poll_s = poll_s
        self._faults: dict[tuple[int, str], tuple[str, int]] = {}  # -> (kind, times left)
        self._clears: dict[tuple[int, str], int] = {}
        self._stuck: set[int] = set()

    def inject(self, pid: int, op: str, fault: str, times: int = 1) -> None:
        """Make the next ``times`` swaps ``op`` of ``pid`` meet ``fault`` (``none``: clear).

        Raises:
            ValueError: unknown ``op`` or ``fault``, or ``times`` not an integer >= 1.
        """
        if op not in OPS:
            raise ValueError(f"op must be one of {', '.join(OPS)}, not {op!r}")
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {', '.join(FAULTS)}, not {fault!r}")
        if type(times) is not int or times < 1:
            raise ValueError(f"times must be an integer >= 1, not {times!r}")
        with self._changed:
            key = (pid, op)
            if fault == "none":
                self._faults.pop(key, None)
                self._stuck.discard(pid)
                self._clears[key] = self._clears.get(key, 0) + 1
                self._changed.notify_all()
            else:
                self._faults[key] = (fault, times)

    def knows(self, pid: int) -> bool:
        """Whether ``pid`` has a fault, is stuck, or had one cleared (``none`` may name it)."""
        with self._changed:
            return pid in self._stuck or any(p == pid for p, _ in [*self._faults, *self._clears])

    def active(self) -> dict[str, str]:
        """The faults waiting for a swap, and the stuck processes, in words (for tests)."""
        with self._changed:
            shown = {f"{pid} {op}": f"{kind} x{n}" for (pid, op), (kind, n) in self._faults.items()}
            shown.update({f"{pid} restore": "stuck" for pid in self._stuck})
            return shown

    def take(self, pids: Sequence[int], op: str) -> SimFault | None:
        """The fault that a swap ``op`` of ``pids`` meets now, counted down; ``None``: none."""
        with self._changed:
            for pid in pids:
                if op == "restore" and pid in self._stuck:
                    return SimFault(pid, op, "stuck")
                key = (pid, op)
                fault = self._faults.get(key)
                if fault is None:
                    continue
                kind, times = fault
                if times > 1:
                    self._faults[key] = (kind, times - 1)
                else:
                    del self._faults[key]
                if kind == "stuck":
                    self._stuck.add(pid)
                return SimFault(pid, op, kind, self._clears.get(key, 0))
        return None

    def wait_cleared(self, fault: SimFault) -> None:
        """Block until ``none`` clears the fault that ``fault`` (a hang) was taken from."""
        key = (fault.pid, fault.op)
        with self._changed:
            while self._clears.get(key, 0) == fault.clears:
                self._changed.wait(self._poll_s)
