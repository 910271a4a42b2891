"""Programs from Debian packages that some tests need.

Without the program a test skips on a developer's machine, naming the package
and the script that installs it, and fails in CI (``CI`` set): there every
install step is in scripts/bootstrap, and a run must not pass by skipping.
"""

from __future__ import annotations

import os
import shutil

import pytest


def need(program: str, how: str) -> str:
    """The path of ``program``; skips (in CI: fails) with ``how`` to install it."""
    path = shutil.which(program)
    if path is not None:
        return path
    message = f"{program} is missing: {how}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)
