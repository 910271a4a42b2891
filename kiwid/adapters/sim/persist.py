"""The simulated GPU's persist file: its processes outlive a kiwid restart.

A real GPU keeps its processes (and a checkpointed process stays checkpointed)
when kiwid restarts; the sim keeps its attachments in ``<state_dir>/sim.json`` for
the same reason. Written atomically, mode 0600 (pids are nobody else's business);
read back entry by entry, keeping only processes that still run (a PID reused
since, told apart by its start time, is not re-attached).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kiwid.linux.files import read_regular, write_atomic
from kiwid.linux.proc import read_stat

__all__ = ["PersistFile"]

MAX_BYTES = 16 * 1024 * 1024

Entry = tuple[int, int, int, str, int, bool]
"""(pid, GPU index, memory bytes, activity, start ticks, swapped)."""


class PersistFile:
    """Where a :class:`~kiwid.adapters.sim.SimBackend` keeps its attachments."""

    def __init__(self, path: Path) -> None:
        """Use ``path`` (created at the first save)."""
        self.path = path

    def read(self) -> tuple[list[int], list[Entry]]:
        """The card sizes and the entries as saved; nothing if unreadable or malformed."""
        try:
            doc: Any = json.loads(read_regular(self.path, MAX_BYTES).decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            return [], []
        if isinstance(doc, list):  # a file of an older version: entries only
            doc = {"entries": doc}
        if not isinstance(doc, dict):
            return [], []
        sizes_raw = doc.get("memory_bytes")
        sizes = [n for n in sizes_raw if _is_int(n)] if isinstance(sizes_raw, list) else []
        entries: list[Entry] = []
        items = doc.get("entries")
        for item in items if isinstance(items, list) else []:
            entry = _entry(item)
            if entry is not None:
                entries.append(entry)
        return sizes, entries

    def live_entries(self) -> Iterator[tuple[int, int, int, str, bool]]:
        """(pid, index, memory, activity, swapped) of saved processes that still run."""
        for pid, index, memory, activity, start_ticks, swapped in self.read()[1]:
            stat = read_stat(pid)
            if stat is not None and not stat.zombie and stat.start_ticks == start_ticks:
                yield pid, index, memory, activity, swapped

    def save(self, sizes: Sequence[int], entries: Sequence[Entry]) -> bool:
        """Write the file atomically (0600); whether it was written."""
        doc = {"memory_bytes": list(sizes), "entries": [list(e) for e in entries]}
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps(doc).encode(), durable=False)
        except OSError:
            return False
        return True


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(item: object) -> Entry | None:
    """One saved attachment, or ``None`` if it is not of the saved shape."""
    if not isinstance(item, list) or len(item) not in (5, 6):
        return None
    pid, index, memory, activity, start_ticks, *rest = item
    swapped = bool(rest[0]) if rest else False
    if not all(_is_int(v) for v in (pid, index, memory, start_ticks)) or pid == 0:
        return None
    if not isinstance(activity, str):
        return None
    return pid, index, memory, activity, start_ticks, swapped
