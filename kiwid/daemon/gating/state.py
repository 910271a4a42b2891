"""The state file: which tenants kiwid has gated, so nothing is ever stranded.

Written atomically (temporary file, fsync, rename) BEFORE a tenant is gated and
after it is ungated, so that after any crash ``kiwid recover`` (systemd's
``ExecStopPost=``) or the next start finds every tenant that may be frozen.

Each record names what kiwid gated and how to tell it is still the same thing:
the cgroup directories' inode numbers (a cgroup removed and made again under the
same path is another cgroup) and each process's start time (a PID reused since is
another process). Recovery acts only on what matches. A record of the wrong shape
is skipped and named, the others are kept: one bad line strands nobody else.

Reading never waits for a write: the records are an immutable snapshot that a
writer replaces once its write (and fsync) is done, so the event loop's poll never
waits behind a worker thread's fsync, and a reader sees what the file holds.

The directory is 0700 and the file 0600 (pids and cgroups are nobody else's
business). A lock file in it is held by the live kiwid: a second kiwid or
``kiwid recover`` refuses to act while it is held.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kiwid.daemon.gating.record import BadRecord, GatedRecord, parse_record, record_json
from kiwid.linux.files import read_regular, write_atomic

log = logging.getLogger("kiwid.state")

STATE_VERSION = 3
READS = (2, 3)
"""Versions this kiwid reads: 3 added ``fenced``, ``fault`` and the ``unusable`` table."""
MAX_STATE_BYTES = 64 * 1024 * 1024
"""A state file larger than this is not read (a runaway or a wrong file)."""


class StateError(Exception):
    """The state file exists but cannot be read, or is not a Kiwi state file."""


class StateLocked(StateError):
    """Another live kiwid holds the state directory."""


class StateFile:
    """``<state_dir>/state.json``: the gated tenants, keyed by tenant."""

    def __init__(self, state_dir: str | Path) -> None:
        """Keep the state in ``state_dir`` (created on first write, mode 0700)."""
        self.dir = Path(state_dir)
        self.path = self.dir / "state.json"
        self._records: Mapping[str, GatedRecord] = MappingProxyType({})
        """What the file holds: never changed in place, replaced after each write."""
        self._write_lock = threading.Lock()  # worker threads record gates; writers only
        self._lock_fd: int | None = None
        self.skipped: dict[str, str] = {}
        """Records of the last :meth:`load` that were not usable, and why."""
        self._unusable: dict[str, tuple[Any, str]] = {}
        """Records no kiwid can act on (the raw entry, and why), kept in the file."""
        self.writes = 0
        """How many times the file was written (each write is an fsync)."""

    @property
    def records(self) -> Mapping[str, GatedRecord]:
        """The gated tenants as last written (read-only; never waits for a write)."""
        return self._records

    # ------------------------------------------------------------ the lock

    def ensure_dir(self) -> None:
        """Create the directory (0700), or tighten its mode if it is laxer.

        Raises:
            StateError: it exists and is not a directory, or cannot be made.
        """
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = self.dir.lstat()
        except OSError as err:
            raise StateError(f"state directory {self.dir}: {err.strerror or err}") from err
        if not stat.S_ISDIR(info.st_mode):
            raise StateError(f"state directory {self.dir} exists and is not a directory")
        if stat.S_IMODE(info.st_mode) & 0o077:
            self.dir.chmod(0o700)

    def lock(self) -> None:
        """Take the directory's lock for this process's lifetime.

        Raises:
            StateLocked: another process (a live kiwid) holds it.
            StateError: the directory or lock file cannot be used.
        """
        self.ensure_dir()
        lock_path = self.dir / "kiwid.lock"
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as err:
            raise StateError(f"cannot open {lock_path}: {err.strerror or err}") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read_pid(fd)
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                who = f"kiwid (pid {holder})" if holder else "another kiwid"
                raise StateLocked(
                    f"{who} is running and manages the tenants recorded in {self.dir}; "
                    "stop it first (systemctl stop kiwid)"
                ) from None
            raise StateError(f"cannot lock {lock_path}: {err.strerror or err}") from err
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    @property
    def locked(self) -> bool:
        """Whether this process holds the directory's lock."""
        return self._lock_fd is not None

    def unlock(self) -> None:
        """Release the lock (at exit; the kernel releases it if we die)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------ reading

    def load(self) -> dict[str, GatedRecord]:
        """Read the file, record by record (a missing file is an empty state).

        A record of the wrong shape is skipped and named in :attr:`skipped`; the
        others are returned. Reading is O(n).

        Raises:
            StateError: the file cannot be read, is not a regular file, or is not a
                Kiwi state file of this version at all.
        """
        self.skipped = {}
        try:
            raw = read_regular(self.path, MAX_STATE_BYTES)
        except FileNotFoundError:
            self._records = MappingProxyType({})
            return {}
        except OSError as err:
            raise StateError(f"{self.path}: {err.strerror or err}") from err
        try:
            doc: Any = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise StateError(f"{self.path}: not a Kiwi state file (not JSON: {err})") from err
        if not isinstance(doc, dict) or not isinstance(doc.get("gated"), dict):
            raise StateError(f"{self.path}: not a Kiwi state file (no 'gated' table)")
        if doc.get("version") not in READS:
            raise StateError(
                f"{self.path}: state version {doc.get('version')!r}, this kiwid reads "
                f"versions {' and '.join(map(str, READS))}; nothing was touched. Thaw what it "
                "lists by hand (echo 0 > /sys/fs/cgroup/<path>/cgroup.freeze) and remove the file"
            )
        records: dict[str, GatedRecord] = {}
        unusable: dict[str, tuple[Any, str]] = {}
        kept = doc.get("unusable")
        for key, item in (kept if isinstance(kept, dict) else {}).items():
            if isinstance(item, dict) and isinstance(item.get("why"), str):
                unusable[str(key)] = (item.get("record"), item["why"])
        for key, rec in doc["gated"].items():
            try:
                records[key] = parse_record(key, rec)
            except BadRecord as err:
                self.skipped[str(key)] = str(err)
                unusable[str(key)] = (rec, str(err))
        self._unusable = unusable
        self._records = MappingProxyType(dict(records))
        return records

    @property
    def unusable(self) -> dict[str, str]:
        """Records kept in the file that no kiwid can act on, and why (the operator's)."""
        return {key: why for key, (_, why) in self._unusable.items()}

    # ------------------------------------------------------------ writing

    def version(self, tenant: str) -> int:
        """The version of ``tenant``'s record now (0: there is none)."""
        record = self._records.get(tenant)
        return 0 if record is None else record.version

    @contextlib.contextmanager
    def unchanged(self, record: GatedRecord) -> Iterator[bool]:
        """Whether ``record`` is still the tenant's (its version), held while the caller acts.

        No write comes in between: a job that thaws what its record says (a fence)
        does so only if nobody wrote since (a fence frozen beside its hung call).
        """
        with self._write_lock:
            yield self.version(record.tenant) == record.version

    def put(self, record: GatedRecord, *, expect: int | None = None) -> GatedRecord | None:
        """Record a tenant as (about to be) gated; durable on return.

        ``expect``: write only if the tenant's record is still at that version (what
        the writer read; 0: none). Returns the record written (its version the next
        one), or ``None`` if another wrote since.
        """
        with self._write_lock:
            current = self.version(record.tenant)
            if expect is not None and current != expect:
                return None
            written = replace(record, version=current + 1)
            self._write({**self._records, record.tenant: written})
            return written

    def update(
        self,
        tenant: str,
        change: Callable[[GatedRecord | None], GatedRecord | None],
        *,
        bump: bool = False,
    ) -> GatedRecord | None:
        """Write what ``change`` makes of ``tenant``'s record (``None``: leave it as it is).

        ``change`` sees the record as it stands, with no other write in between
        (a swap recording where the memory went is never written over by a follow
        adding a process). Durable on return; returns the record written, or
        ``None`` if nothing was. ``bump``: written even if unchanged, so that its
        version says it was written again (a fence frozen again is news to a job
        that read the record before).
        """
        with self._write_lock:
            current = self._records.get(tenant)
            record = change(current)
            if record is None or (record == current and not bump):
                return None
            written = replace(record, version=self.version(tenant) + 1)
            self._write({**self._records, tenant: written})
            return written

    def drop(self, tenant: str, *, expect: int | None = None) -> bool:
        """Forget a tenant after it was ungated; durable on return.

        ``expect``: drop it only if its record is still at that version. A job that
        let go of what it read must not drop what another wrote since (a fence that
        froze the tenant while the job's call hung). Returns whether the record was
        dropped (or there was none).
        """
        with self._write_lock:
            current = self._records.get(tenant)
            if current is None:
                return True
            if expect is not None and current.version != expect:
                return False
            records = dict(self._records)
            del records[tenant]
            self._write(records)
            return True

    def drop_many(self, tenants: Iterable[str]) -> None:
        """Forget several tenants with one write (recovery of thousands stays O(n))."""
        with self._write_lock:
            records = dict(self._records)
            dropped = [t for t in tenants if records.pop(t, None) is not None]
            if dropped:
                self._write(records)

    def replace_all(self, records: Mapping[str, GatedRecord]) -> None:
        """Write exactly ``records`` (e.g. the loaded ones without the skipped)."""
        with self._write_lock:
            self._write(dict(records))

    def set_aside(self) -> Path | None:
        """Move an unusable state file out of the way (kept for the operator)."""
        aside = self.path.with_name(f"{self.path.name}.unusable-{int(time.time())}")
        try:
            self.path.rename(aside)
        except OSError:
            return None
        return aside

    def remove_if_empty(self) -> bool:
        """Remove the file if it records nobody (and keeps no unusable records).

        Decided under the write lock: a caller that saw no records may be racing a
        gate job that records its tenant this very moment (at start-up, the first
        poll's gates run while re-adoption tidies up), and that record must stay.
        Returns whether nobody was recorded.
        """
        with self._write_lock:
            if self._records:
                return False
            if not self._unusable:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            return True

    def _write(self, records: dict[str, GatedRecord]) -> None:
        """Write ``records``, durably; then (only then) readers see them.

        Raises:
            OSError: the file cannot be written; the records stay as the file has them.
        """
        self.ensure_dir()
        doc = {
            "version": STATE_VERSION,
            "gated": {key: record_json(rec) for key, rec in sorted(records.items())},
            # Kept, never acted on, until the operator removes them: only they can tell
            # what such a record meant (recover names each one).
            "unusable": {
                key: {"record": raw, "why": why}
                for key, (raw, why) in sorted(self._unusable.items())
            },
        }
        write_atomic(self.path, json.dumps(doc, indent=1).encode())
        self._records = MappingProxyType(records)  # one reference swap: atomic
        self.writes += 1


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip() or "0") or None
    return None
