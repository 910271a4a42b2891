"""A copy of the kiwid package that every user can read.

Tests that run Python as another uid (``nobody``) import kiwid from here, not
from the checkout: a checkout may sit where other users cannot read it (a clone
under ``/root``, mode 0700). The copy is made once per test session, in a fresh
directory under /tmp, and removed when the session ends.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@functools.cache
def kiwid_copy() -> Path:
    """The directory that holds a world-readable ``kiwid`` package (put it on sys.path)."""
    top = Path(tempfile.mkdtemp(prefix="kiwi-readable-", dir="/tmp"))
    atexit.register(shutil.rmtree, top, True)
    shutil.copytree(REPO / "kiwid", top / "kiwid", ignore=shutil.ignore_patterns("__pycache__"))
    top.chmod(0o755)
    for root, dirs, files in os.walk(top / "kiwid"):
        for name in dirs:
            Path(root, name).chmod(0o755)
        for name in files:
            Path(root, name).chmod(0o644)
    (top / "kiwid").chmod(0o755)
    return top


def _requirements(dist: str, seen: set[str]) -> None:
    """``dist`` and, recursively, what it requires (extras and markers aside)."""
    key = re.sub(r"[-_.]+", "-", dist).lower()
    if key in seen:
        return
    seen.add(key)
    for requirement in metadata.requires(dist) or []:
        if ";" in requirement:  # an extra's or a platform's: not what kiwid needs to run
            continue
        name = re.match(r"[A-Za-z0-9_.-]+", requirement)
        if name is not None:
            with contextlib.suppress(metadata.PackageNotFoundError):
                _requirements(name.group(0), seen)


@functools.cache
def runtime_copy() -> Path:
    """A world-readable directory with kiwid and the packages it needs to run.

    For running kiwid or kiwictl as another uid with the system's python3 (the
    virtualenv's interpreter may sit under /root, which that uid cannot reach):
    put the directory on ``sys.path`` (or ``PYTHONPATH``). Compiled modules work
    with any interpreter of the same minor version.
    """
    top = Path(tempfile.mkdtemp(prefix="kiwi-runtime-", dir="/tmp"))
    atexit.register(shutil.rmtree, top, True)
    dists: set[str] = set()
    _requirements("kiwi-gpu", dists)
    dists.discard("kiwi-gpu")  # installed editable: copied from the checkout instead
    for dist in sorted(dists):
        found = metadata.distribution(dist)
        for file in found.files or []:
            source = Path(str(found.locate_file(file)))
            if ".." in file.parts or not source.is_file():
                continue
            target = top / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
    shutil.copytree(REPO / "kiwid", top / "kiwid", ignore=shutil.ignore_patterns("__pycache__"))
    for root, dirs, files in os.walk(top):
        for name in dirs:
            Path(root, name).chmod(0o755)
        for name in files:
            Path(root, name).chmod(0o644)
    top.chmod(0o755)
    return top
