"""The state file: which tenants kiwid has gated, so nothing is ever stranded.

Written atomically (temporary file, fsync, rename) BEFORE a tenant is gated and
after it is ungated, so that after any crash ``kiwid recover`` (systemd's
``ExecStopPost=``) or the next start finds every tenant that may be frozen.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("kiwid.state")

STATE_VERSION = 1


@dataclass(frozen=True)
class GatedRecord:
    """How to ungate one tenant, whatever happened to kiwid."""

    tenant: str
    method: str
    """``freeze`` or ``cuda-lock``."""
    cgroup_v2: str | None
    cgroup_v1_freezer: str | None
    pids: tuple[int, ...]
    swapped: dict[str, int] | None = None
    """Its GPU memory is (being) swapped to host RAM: bytes per GPU. Recovery
    brings it back (when it fits) before letting the tenant go."""
    swap_method: str | None = None
    """How it was swapped: ``checkpoint`` (the driver) or ``sim``."""


def _swapped(raw: Any) -> dict[str, int] | None:
    if raw is None:
        return None
    return {str(gpu): int(n) for gpu, n in dict(raw).items()}


class StateError(Exception):
    """The state file exists but cannot be read or understood."""


class StateFile:
    """``<state_dir>/state.json``: the gated tenants, keyed by tenant."""

    def __init__(self, state_dir: str | Path) -> None:
        """Keep the state in ``state_dir`` (created on first write, mode 0755)."""
        self.path = Path(state_dir) / "state.json"
        self._records: dict[str, GatedRecord] = {}
        self._write_lock = threading.Lock()  # two worker threads record gates

    @property
    def records(self) -> dict[str, GatedRecord]:
        """The gated tenants as last written (a copy)."""
        with self._write_lock:
            return dict(self._records)

    def load(self) -> dict[str, GatedRecord]:
        """Read the file (a missing file is an empty state).

        Raises:
            StateError: the file is unreadable or not a Kiwi state file.
        """
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            self._records = {}
            return {}
        except OSError as err:
            raise StateError(f"{self.path}: cannot read: {err.strerror}") from err
        try:
            doc: Any = json.loads(raw)
            if doc.get("version") != STATE_VERSION:
                raise StateError(f"{self.path}: unknown state version {doc.get('version')!r}")
            records = {
                key: GatedRecord(
                    tenant=key,
                    method=str(rec["method"]),
                    cgroup_v2=rec.get("cgroup_v2"),
                    cgroup_v1_freezer=rec.get("cgroup_v1_freezer"),
                    pids=tuple(int(p) for p in rec.get("pids", ())),
                    swapped=_swapped(rec.get("swapped")),
                    swap_method=rec.get("swap_method"),
                )
                for key, rec in doc["gated"].items()
            }
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise StateError(f"{self.path}: not a Kiwi state file: {err}") from err
        self._records = records
        return dict(records)

    def put(self, record: GatedRecord) -> None:
        """Record a tenant as (about to be) gated; durable on return."""
        with self._write_lock:
            self._records[record.tenant] = record
            self._write()

    def drop(self, tenant: str) -> None:
        """Forget a tenant after it was ungated; durable on return."""
        with self._write_lock:
            if self._records.pop(tenant, None) is not None:
                self._write()

    def clear(self) -> None:
        """Forget everything and remove the file."""
        self._records = {}
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _write(self) -> None:
        self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        doc = {
            "version": STATE_VERSION,
            "gated": {
                key: {k: v for k, v in asdict(rec).items() if k != "tenant"}
                for key, rec in sorted(self._records.items())
            },
        }
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path)
