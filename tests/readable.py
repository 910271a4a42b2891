"""A copy of the kiwid package that every user can read.

Tests that run Python as another uid (``nobody``) import kiwid from here, not
from the checkout: a checkout may sit where other users cannot read it (a clone
under ``/root``, mode 0700). The copy is made once per test session, in a fresh
directory under /tmp, and removed when the session ends.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
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
