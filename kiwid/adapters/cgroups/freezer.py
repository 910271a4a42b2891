"""Freezing and thawing a tenant's cgroups (cgroup2 ``cgroup.freeze``, v1 ``freezer``).

:class:`Freezer` prefers cgroup2 (``cgroup.freeze`` = 1, then ``frozen 1`` in
``cgroup.events``) and falls back to v1 (``freezer.state`` = ``FROZEN``) when the
tenant has no usable v2 cgroup. A freeze that the kernel does not confirm before
the deadline is undone, so a tenant is never left half-frozen. kiwid refuses to
freeze the root cgroup or any cgroup that contains kiwid itself.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from kiwid.adapters.cgroups.layout import (
    CgroupGone,
    CgroupLayout,
    CgroupRef,
    FreezeError,
    FreezeTimeout,
    _control,
    _is_root,
    cgroup_of,
)

_FIRST_POLL_S = 0.0002  # first wait between two reads of the freezer state
_MAX_POLL_S = 0.01  # the backoff doubles up to this


def _v2_frozen(directory: Path) -> bool:
    return "frozen 1" in _control(directory / "cgroup.events").splitlines()


def _v1_state(directory: Path) -> str:
    return _control(directory / "freezer.state").strip()


class Freezer:
    """Freezes and thaws tenants' cgroups, v2 first, v1 as the fallback."""

    def __init__(
        self, layout: CgroupLayout, timeout_s: float = 2.0, *, own: CgroupRef | None = None
    ) -> None:
        """Create a freezer.

        Args:
            layout: Where the hierarchies are mounted.
            timeout_s: How long a freeze may take before it is undone, in seconds.
                The state is polled only before the deadline, so 0 never confirms.
            own: kiwid's own cgroups, which it refuses to freeze; read from
                ``/proc/self/cgroup`` at every freeze when ``None``.
        """
        self.layout = layout
        self.timeout_s = timeout_s
        self._own = own

    def freeze(self, ref: CgroupRef) -> None:
        """Freeze a tenant and wait until the kernel confirms it.

        Args:
            ref: The tenant's cgroups.

        Raises:
            FreezeError: No usable freezer (e.g. the tenant is in the root cgroup), or
                the cgroup contains kiwid itself, or a control file cannot be written.
            CgroupGone: The cgroup no longer exists.
            FreezeTimeout: Not frozen within ``timeout_s``; the cgroup was thawed again.
        """
        v2, v1 = self.layout.dirs(ref)
        own_v2, own_v1 = self.layout.dirs(self._own or cgroup_of("self"))
        if v2 is not None and not v2.is_dir():
            raise CgroupGone(f"{v2} no longer exists")
        if v2 is not None and (v2 / "cgroup.freeze").exists():
            _refuse_own(v2, own_v2)
            self._freeze_v2(v2)
        elif v1 is not None:
            _refuse_own(v1, own_v1)
            self._freeze_v1(v1)
        elif _is_root(ref.v2) or _is_root(ref.v1_freezer):
            raise FreezeError(
                f"refusing to freeze the root cgroup of {ref}: that would freeze "
                "every process on the host, kiwid included"
            )
        else:
            raise FreezeError(f"no usable freezer for {ref} on {self.layout}")

    def _freeze_v2(self, directory: Path) -> None:
        self._freeze(directory / "cgroup.freeze", "1", "0", lambda: _v2_frozen(directory))

    def _freeze_v1(self, directory: Path) -> None:
        if not directory.is_dir():
            raise CgroupGone(f"{directory} no longer exists")

        def frozen() -> bool:
            state = _v1_state(directory)
            if state == "FREEZING":  # re-kick tasks that slipped through (forks, wakeups)
                _control(directory / "freezer.state", "FROZEN")
            return state == "FROZEN"

        self._freeze(directory / "freezer.state", "FROZEN", "THAWED", frozen)

    def _freeze(self, file: Path, on: str, off: str, done: Callable[[], bool]) -> None:
        """Write ``on``, wait for ``done``; on timeout or any error write ``off`` again."""
        _control(file, on)
        frozen = False
        try:
            frozen = self._wait(done)
        finally:
            if not frozen:  # never leave a half-frozen tenant behind
                with contextlib.suppress(CgroupGone):
                    _control(file, off)
        if not frozen:
            raise FreezeTimeout(file.parent, self.timeout_s)

    def thaw(self, ref: CgroupRef) -> None:
        """Thaw a tenant in every hierarchy where it has a cgroup.

        Both v2 and v1 are thawed, since something else may have frozen either. A
        cgroup that no longer exists is fine: the tenant exited.

        Args:
            ref: The tenant's cgroups.

        Raises:
            FreezeError: A control file exists but cannot be written (after trying
                every hierarchy).
        """
        first_error: FreezeError | None = None
        v2, v1 = self.layout.dirs(ref)
        targets = [(v2, "cgroup.freeze", "0"), (v1, "freezer.state", "THAWED")]
        for directory, name, value in targets:
            if directory is None:
                continue
            file = directory / name
            if not file.exists():
                continue  # tenant gone, or a kernel without this freezer
            try:
                _control(file, value)
            except CgroupGone:
                continue
            except FreezeError as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def is_frozen(self, ref: CgroupRef) -> bool:
        """Whether the tenant is frozen in any hierarchy.

        Args:
            ref: The tenant's cgroups.

        Returns:
            ``True`` if v2 reports ``frozen 1`` or v1 reports ``FROZEN``; a missing
            cgroup is not frozen.

        Raises:
            FreezeError: A control file exists but cannot be read.
        """
        v2, v1 = self.layout.dirs(ref)
        try:
            if v2 is not None and v2.is_dir() and _v2_frozen(v2):
                return True
            return v1 is not None and v1.is_dir() and _v1_state(v1) == "FROZEN"
        except CgroupGone:
            return False

    def _wait(self, done: Callable[[], bool]) -> bool:
        """Poll ``done`` with a doubling backoff until it holds or the deadline passes."""
        deadline = time.monotonic() + self.timeout_s
        delay = _FIRST_POLL_S
        while (remaining := deadline - time.monotonic()) > 0:
            if done():
                return True
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _MAX_POLL_S)
        return False


def _refuse_own(target: Path, own_dir: Path | None) -> None:
    """Refuse ``target`` if kiwid's own cgroup ``own_dir`` is it or lies below it."""
    if own_dir is not None and (own_dir == target or target in own_dir.parents):
        raise FreezeError(
            f"refusing to freeze {target}: kiwid itself runs in {own_dir}, "
            "so kiwid would freeze itself"
        )
