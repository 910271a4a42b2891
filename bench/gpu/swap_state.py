"""kiwid's state_dir across runs of bench/gpu/swap.py, and which workloads it has seen.

kiwid remembers each workload's peak footprint in its ``state_dir``, keyed, for a
bare process or a plain cgroup, by its executable and arguments (``/proc/PID/exe``
and ``/proc/PID/cmdline``). A run that shares an earlier run's ``state_dir``
(``--state-dir DIR --keep-state``) therefore starts with *known* tenants: their
first turn is sized from the earlier run instead of taking the whole card.

The bench keeps its own list of the identities it ran with a state_dir in
``kiwi-bench-workloads.json`` there (kiwid ignores files it does not own; the run
checks that kiwid and ``kiwid recover`` left it in place), and labels each tenant
known or newcomer from it. Without ``--keep-state`` the directory is emptied at the
start (after ``kiwid recover`` let go of anything an interrupted run left gated), so
that every tenant is a newcomer; only a directory that is the bench's own is emptied.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

LEDGER = "kiwi-bench-workloads.json"


class StateDirError(Exception):
    """The state directory cannot be used as asked."""


def identity(pid: int) -> str | None:
    """The executable and arguments of ``pid``, as kiwid keys a bare process's footprint."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return None
    return " ".join([exe, *(a.decode(errors="replace") for a in argv[1:])])


def listing(state_dir: Path) -> list[str]:
    """The names in ``state_dir`` (empty if there is none)."""
    try:
        return sorted(p.name for p in state_dir.iterdir())
    except OSError:
        return []


def read_ledger(state_dir: Path) -> dict[str, dict[str, object]]:
    """identity -> what the bench noted about it (runs, last bytes)."""
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads((state_dir / LEDGER).read_text())
        if isinstance(doc, dict) and isinstance(doc.get("workloads"), dict):
            return doc["workloads"]
    return {}


def prepare(state_dir: Path, *, keep: bool, bench_root: Path) -> list[str]:
    """Empty ``state_dir`` for a run of newcomers, or keep it; say what happened.

    Raises:
        StateDirError: it should be emptied but is not the bench's own (outside
            ``bench_root`` and without the bench's list), e.g. a real kiwid's.
    """
    names = listing(state_dir)
    if keep:
        known = read_ledger(state_dir)
        return [
            f"state dir {state_dir} kept ({', '.join(names) or 'empty'}); the bench has seen "
            f"{len(known)} workload(s) with it"
        ]
    if not names:
        return [f"state dir {state_dir}: new (every tenant a newcomer)"]
    own = state_dir.resolve().is_relative_to(bench_root.resolve()) or LEDGER in names
    if not own:
        raise StateDirError(
            f"{state_dir} is not the bench's (outside {bench_root}, no {LEDGER}); it is not "
            "emptied. Pass --keep-state to use it as it is, or choose another --state-dir"
        )
    for name in names:
        path = state_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return [f"state dir {state_dir}: emptied ({', '.join(names)}): every tenant a newcomer"]


def record(state_dir: Path, seen: Iterable[tuple[str, int | None]]) -> None:
    """Add the identities that ran (allocated) in this run to the bench's list."""
    workloads = read_ledger(state_dir)
    for ident, nbytes in seen:
        entry = workloads.setdefault(ident, {"runs": 0})
        entry["runs"] = int(str(entry.get("runs", 0))) + 1
        if nbytes is not None:
            entry["bytes"] = nbytes
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = state_dir / f".{LEDGER}.tmp"
    tmp.write_text(json.dumps({"workloads": workloads}, indent=1) + "\n")
    tmp.replace(state_dir / LEDGER)
