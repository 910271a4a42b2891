"""Workloads remembered across runs: their peak footprints and failed checkpoints.

A tenant lives as long as its processes; the job it runs often comes back (a
pod's next replica, a unit restarted, the same script run again). kiwid keeps,
per workload, the most GPU memory its last run used and whether the driver failed
to checkpoint it, in ``<state_dir>/workloads.json`` (0600, written atomically:
at most every ``SAVE_EVERY_S`` when something changed, at once after a failed
checkpoint or a ``forget``, and when kiwid stops). A recurring job is then
sized from its last run instead of taking the whole card as a newcomer, and a job
the driver could not checkpoint is kept on the card from its first turn, until
``memory.checkpoint_retry_after`` has passed since the failure (drivers and
applications change). ``kiwictl workloads`` lists what is remembered and
``kiwictl forget`` clears one workload.

A workload is named, most stable first, by:

* its pod's owner and its container: the pod name less the suffixes its
  controller generates (``trainer-7d4b9c6f5-x2x7q`` is ``trainer``);
* else its systemd unit;
* else its container's name (as the runtime's hook announced it);
* else the executable and the arguments of its first process.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shlex
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from kiwid.config.schema import MemorySettings
from kiwid.core.events import Event, FootprintRemembered, TenantUnswappable
from kiwid.daemon.tenants.tracker import Identity, TenantInfo
from kiwid.linux import proc
from kiwid.linux.files import read_regular, write_atomic

log = logging.getLogger("kiwid.workloads")

FILE_NAME = "workloads.json"
VERSION = 1
MAX_WORKLOADS = 4096
"""The least recently seen are forgotten beyond this many."""
MAX_BYTES = 8 * 1024 * 1024
SAVE_EVERY_S = 30.0
_DEFAULT_RETRY_AFTER_S = MemorySettings().checkpoint_retry_after
# Suffixes Kubernetes controllers add to pod names: a ReplicaSet's pod-template
# hash and a pod's random tail (both in the alphabet of rand.SafeEncodeString),
# a CronJob's scheduled time in minutes.
_SAFE = "bcdfghjklmnpqrstvwxz2456789"
_POD_TAIL = re.compile(rf"-[{_SAFE}]{{5}}$")
_CONTROLLER_TAIL = re.compile(rf"-(?:[{_SAFE}]{{6,10}}|[0-9]{{8,}})$")


def pod_owner(pod: str) -> str:
    """A pod's name less what its controller generated (a StatefulSet's ordinal stays)."""
    owner = _POD_TAIL.sub("", pod)
    return _CONTROLLER_TAIL.sub("", owner) if owner != pod else owner


def workload_of(identity: Identity, pids: Iterable[int]) -> str | None:
    """The name of the workload a tenant runs (``None``: nothing stable to name it by)."""
    named_container = identity.container_id is not None and not identity.container_id.startswith(
        identity.name
    )
    if identity.pod and identity.identity_source in ("annotations", "podresources"):
        container = identity.name if named_container else "?"
        return f"pod {identity.namespace or 'default'}/{pod_owner(identity.pod)}/{container}"
    if identity.kind == "systemd":
        return f"unit {identity.name}"
    if named_container:
        return f"container {identity.name}"
    first = min(pids, default=None)
    if first is None:
        return None
    return program_name(proc.command_line(first), proc.executable(first))


def program_name(args: tuple[str, ...] | None, exe: str | None) -> str | None:
    """A bare process's workload: its program and arguments (``None``: not knowable now).

    No arguments means the process is in the middle of an ``execve`` (the kernel
    installs the new program before its arguments) or has wiped them: naming it by
    the program alone would put every ``python3 …`` job under one name and size
    each from another's run, so it stays unnamed until its arguments can be read.
    """
    if args is None:
        return None
    return "exe " + shlex.join([exe or args[0], *args[1:]])


@dataclass
class Remembered:
    """What one workload's runs left behind."""

    peak_bytes: int = 0
    """The most GPU memory one of its tenants used on one GPU, in its last run."""
    seen_unix: float = 0.0
    checkpoint_failed: str | None = None
    """Why the driver failed to checkpoint it: its runs stay on the card until the
    mark expires (``memory.checkpoint_retry_after`` after ``checkpoint_failed_unix``)."""
    checkpoint_failed_unix: float | None = None
    """When that mark was set (a file without it: when the file was read)."""


class WorkloadBook:
    """The remembered workloads, and which tenant runs which."""

    def __init__(
        self,
        state_dir: Path | str,
        clock: Callable[[], float] = time.time,
        retry_after_s: Callable[[], float] = lambda: _DEFAULT_RETRY_AFTER_S,
    ) -> None:
        """Read ``<state_dir>/workloads.json`` (nothing if absent or unusable).

        ``clock`` is the wall clock (unix seconds: the file outlives boots);
        ``retry_after_s`` says ``memory.checkpoint_retry_after`` as it is now (a
        reload changes it).
        """
        self.path = Path(state_dir) / FILE_NAME
        self._clock = clock
        self.retry_after_s = retry_after_s
        self._known: dict[str, Remembered] = self._read()
        self._of: dict[str, str | None] = {}  # tenant -> its workload (None: unnamed)
        self._identity: dict[str, Identity] = {}  # tenant -> the identity it was named by
        self._peak: dict[str, int] = {}  # tenant -> its peak in this run
        self._dirty = False
        self._saved_at = clock()
        # The loop's thread reads and notes; a swap's worker thread reports a failed
        # checkpoint. One lock keeps the entries and the file whole.
        self._lock = threading.RLock()

    def __len__(self) -> int:
        """How many workloads are remembered."""
        return len(self._known)

    def now(self) -> float:
        """The book's clock now (unix seconds): what ``listing``'s times compare with."""
        return self._clock()

    def get(self, workload: str) -> Remembered | None:
        """What is remembered of ``workload``."""
        return self._known.get(workload)

    def workload(self, tenant: str) -> str | None:
        """The workload a tenant seen here runs (``None``: unnamed or unknown)."""
        return self._of.get(tenant)

    def events(self, tenants: dict[str, TenantInfo]) -> list[Event]:
        """Name new tenants' workloads, end the runs of those gone; what the scheduler learns.

        A tenant is named again when its identity changes (kiwi-hook's registration
        may name the pod after its processes were seen), and told what its
        workload's earlier runs left: its peak footprint, a failed checkpoint.
        """
        with self._lock:
            for tenant in [t for t in self._of if t not in tenants]:
                self.departed(tenant)
            events: list[Event] = []
            for tenant, info in tenants.items():
                if self._identity.get(tenant) == info.identity:
                    continue
                workload = workload_of(info.identity, info.pids)
                if workload is not None:
                    self._identity[tenant] = info.identity  # else: try again next time
                if tenant in self._of and workload in (None, self._of[tenant]):
                    continue  # named already, and nothing better now
                self._of[tenant] = workload
                known = self._known.get(workload) if workload else None
                if known is None:
                    continue
                if known.peak_bytes > 0:
                    events.append(FootprintRemembered(tenant, known.peak_bytes))
                    log.info("%s runs %s again: sized from its last run", tenant, workload)
                if known.checkpoint_failed and self._expired(known):
                    log.info(
                        "%s runs %s, whose checkpoint failed %s s ago (%s): it may be "
                        "swapped again (memory.checkpoint_retry_after)",
                        tenant,
                        workload,
                        f"{self._clock() - (known.checkpoint_failed_unix or 0):.0f}",
                        known.checkpoint_failed,
                    )
                    known.checkpoint_failed = known.checkpoint_failed_unix = None
                    self._dirty = True
                if known.checkpoint_failed:
                    why = f"a checkpoint of its workload failed before: {known.checkpoint_failed}"
                    events.append(TenantUnswappable(tenant, why))
            return events

    def _expired(self, entry: Remembered) -> bool:
        """Whether ``entry``'s failed-checkpoint mark is older than the retry delay."""
        marked = entry.checkpoint_failed_unix
        return marked is not None and self._clock() >= marked + self.retry_after_s()

    def listing(self) -> list[dict[str, Any]]:
        """Every remembered workload, by name, for ``kiwictl workloads``.

        A mark that has expired is shown as none (it is cleared when the workload
        runs again); ``until_unix`` is when a mark expires.
        """
        with self._lock:
            running: dict[str, list[str]] = {}
            for tenant, workload in self._of.items():
                if workload is not None:
                    running.setdefault(workload, []).append(tenant)
            out: list[dict[str, Any]] = []
            for workload, entry in sorted(self._known.items()):
                marked = bool(entry.checkpoint_failed) and not self._expired(entry)
                at = entry.checkpoint_failed_unix if marked else None
                out.append(
                    {
                        "workload": workload,
                        "peak_bytes": entry.peak_bytes,
                        "seen_unix": round(entry.seen_unix, 3),
                        "unswappable": marked,
                        "why": entry.checkpoint_failed if marked else None,
                        "marked_unix": None if at is None else round(at, 3),
                        "until_unix": None if at is None else round(at + self.retry_after_s(), 3),
                        "tenants": sorted(running.get(workload, ())),
                    }
                )
            return out

    def forget(self, workload: str) -> bool:
        """Forget one workload now (the file is saved at once); whether it was saved.

        Tenants running it keep what they were told; their runs, when they end,
        are remembered anew.

        Raises:
            KeyError: ``workload`` is not remembered.
        """
        with self._lock:
            del self._known[workload]
            self._dirty = True
            return self.save()

    def observe(self, tenants: dict[str, TenantInfo]) -> None:
        """Note each tenant's footprint: its run's peak, and its workload's if higher."""
        with self._lock:
            for tenant, info in tenants.items():
                workload = self._of.get(tenant)
                if workload is None:
                    continue
                peak = max((b for b in info.footprint.values() if b), default=0)
                if peak <= self._peak.get(tenant, 0):
                    continue
                self._peak[tenant] = peak
                entry = self._entry(workload)
                if peak > entry.peak_bytes:
                    entry.peak_bytes = peak
                    self._dirty = True

    def checkpoint_failed(self, tenant: str, reason: str, permanent: bool = True) -> None:
        """The driver could not checkpoint ``tenant``: remember it of its workload.

        Only a ``permanent`` failure says something of the workload (what the
        driver cannot checkpoint); a passing one (out of host memory, say) is
        not remembered.
        """
        if not permanent:
            log.debug("Not remembering %s's failed checkpoint (%s): it may pass", tenant, reason)
            return
        with self._lock:
            workload = self._of.get(tenant)
            if workload is not None:
                entry = self._entry(workload)
                entry.checkpoint_failed = reason
                entry.checkpoint_failed_unix = self._clock()
                self._dirty = True
                self.save()

    def departed(self, tenant: str) -> None:
        """A tenant left: its run's peak is what its workload will need next time."""
        with self._lock:
            workload = self._of.pop(tenant, None)
            self._identity.pop(tenant, None)
            peak = self._peak.pop(tenant, None)
            if workload is not None and peak is not None:
                self._entry(workload).peak_bytes = peak
                self._dirty = True

    def save_if_due(self) -> None:
        """Save what changed, at most every ``SAVE_EVERY_S``."""
        with self._lock:
            if self._dirty and self._clock() - self._saved_at >= SAVE_EVERY_S:
                self.save()

    def save(self) -> bool:
        """Write the file now (0600, atomically); whether it was written."""
        with self._lock:
            self._saved_at = self._clock()
            if len(self._known) > MAX_WORKLOADS:
                oldest = sorted(self._known, key=lambda w: self._known[w].seen_unix)
                for workload in oldest[: len(self._known) - MAX_WORKLOADS]:
                    del self._known[workload]
            doc = {
                "version": VERSION,
                "workloads": {
                    w: {
                        "peak_bytes": r.peak_bytes,
                        "seen_unix": round(r.seen_unix, 3),
                        "checkpoint_failed": r.checkpoint_failed,
                        "checkpoint_failed_unix": r.checkpoint_failed_unix,
                    }
                    for w, r in sorted(self._known.items())
                },
            }
            try:
                self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                write_atomic(self.path, json.dumps(doc, indent=1).encode(), durable=False)
            except OSError as err:
                log.warning("Cannot save remembered workloads to %s: %s", self.path, err)
                return False
            self._dirty = False
            return True

    def _entry(self, workload: str) -> Remembered:
        entry = self._known.get(workload)
        if entry is None:
            entry = self._known[workload] = Remembered()
        entry.seen_unix = self._clock()
        return entry

    def _read(self) -> dict[str, Remembered]:
        try:
            doc: Any = json.loads(read_regular(self.path, MAX_BYTES).decode("utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
            log.warning("Ignoring %s (%s): workloads are learnt again", self.path, err)
            return {}
        items = doc.get("workloads") if isinstance(doc, dict) else None
        if not isinstance(items, dict):
            log.warning("Ignoring %s: not a workloads file", self.path)
            return {}
        known: dict[str, Remembered] = {}
        for workload, item in items.items():
            entry = _remembered(item, self._clock())
            if entry is None:
                log.warning(
                    "Ignoring the entry %r of %s: not of the saved shape", workload, self.path
                )
                continue
            known[workload] = entry
        return known


def _remembered(item: object, now: float) -> Remembered | None:
    """One saved entry, or ``None`` if not of the saved shape.

    A failed-checkpoint mark saved without its time (by a kiwid before
    ``memory.checkpoint_retry_after``) counts from ``now``, when it is read.
    """
    if not isinstance(item, dict):
        return None
    peak, seen, failed, failed_at = (
        item.get("peak_bytes"),
        item.get("seen_unix"),
        item.get("checkpoint_failed"),
        item.get("checkpoint_failed_unix"),
    )
    if not isinstance(peak, int) or isinstance(peak, bool) or peak < 0:
        return None
    if not _is_number(seen):
        return None
    if failed is not None and not isinstance(failed, str):
        return None
    if failed_at is not None and not _is_number(failed_at):
        return None
    if not failed:
        return Remembered(peak, float(seen))
    return Remembered(peak, float(seen), failed, now if failed_at is None else float(failed_at))


def _is_number(value: object) -> TypeGuard[float]:
    """A finite JSON number (a boolean is none)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
