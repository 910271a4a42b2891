"""A container's cgroup: from its init process's ``/proc/PID/cgroup``, else its bundle's config."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiwid.linux.proc import parse_proc_cgroup


def _cgroups_from_proc(proc: Path, pid: int) -> tuple[str | None, str | None]:
    """(cgroup2 path, v1 freezer path) of a process; ``None`` for what is unknown."""
    try:
        text = (proc / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None, None
    paths = parse_proc_cgroup(text)
    v2, v1 = paths.v2, paths.v1_freezer
    # The root cgroup holds the whole machine: never a container's own.
    return (v2 if v2 not in (None, "/") else None), (v1 if v1 not in (None, "/") else None)


def _cgroup_from_config(config: Mapping[str, Any]) -> str | None:
    """The cgroup path that ``linux.cgroupsPath`` names, or ``None`` if it cannot tell."""
    linux = config.get("linux")
    raw = linux.get("cgroupsPath") if isinstance(linux, dict) else None
    if not isinstance(raw, str) or not raw:
        return None
    if raw.startswith("/"):
        return raw  # cgroupfs driver: the same path in every hierarchy
    parts = raw.split(":")
    if len(parts) == 3:  # systemd driver: "slice:prefix:name"
        return _systemd_path(*parts)
    return None  # relative: the runtime chose where, /proc would have told


def _systemd_path(slice_: str, prefix: str, name: str) -> str:
    """Expand systemd's ``slice:prefix:name`` the way runc's systemd driver does."""
    path = ""
    if slice_ and slice_ != "-.slice":
        stem = slice_.removesuffix(".slice")
        words = stem.split("-")
        path = "".join("/" + "-".join(words[: i + 1]) + ".slice" for i in range(len(words)))
    unit = name if name.endswith(".slice") else f"{prefix}-{name}.scope" if prefix else name
    return f"{path}/{unit}"
