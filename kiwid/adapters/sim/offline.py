"""The simulated GPU without a daemon: ``kiwid recover`` restores swapped tenants."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kiwid.adapters.sim.backend import SimBackend
from kiwid.adapters.sim.persist import PersistFile

__all__ = ["swap_in_persisted"]


def swap_in_persisted(path: Path, pids: Sequence[int]) -> bool:
    """Bring ``pids`` back in a persist file, without a running daemon (recover).

    All or nothing, and only if they fit beside the live resident processes: the
    file is loaded into a :class:`SimBackend` (which drops exited processes), the
    swap-in done there, and the result saved back.

    Returns:
        Whether the file listed any of them as swapped out.

    Raises:
        SimOutOfMemory: they do not fit.
    """
    sizes, _ = PersistFile(path).read()
    if not sizes:
        return False  # no file, or one from before swapping: nothing in it is swapped
    backend = SimBackend(len(sizes), max(sizes), persist=path)
    try:
        return bool(backend.swap_in(pids))
    finally:
        backend.close()
