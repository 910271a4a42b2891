"""scripts/bootstrap, the README's first step: which Debian packages it asks for."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.readable import REPO

SCRIPT = REPO / "scripts" / "bootstrap"


@pytest.fixture
def checkout() -> Iterator[Path]:
    """A world-readable directory holding scripts/bootstrap alone, for ``nobody`` to run.

    pytest's own temporary directories are private to their user.
    """
    top = Path(tempfile.mkdtemp(prefix="kiwi-bootstrap-", dir="/tmp"))
    try:
        (top / "scripts").mkdir()
        shutil.copy2(SCRIPT, top / "scripts" / "bootstrap")
        for folder in (top, top / "scripts"):
            folder.chmod(0o755)
        yield top
    finally:
        shutil.rmtree(top)


def test_without_ensurepip_it_asks_for_python3_venv_alone_without_recommends(
    checkout: Path,
) -> None:
    # Debian's python3 without python3-venv has no ensurepip module: a package of
    # that name that fails to import, first on the path, makes the same python3.
    missing = checkout / "no-ensurepip" / "ensurepip"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text("raise ImportError('python3-venv is not installed')\n")
    for folder in (missing.parent, missing):
        folder.chmod(0o755)
    (missing / "__init__.py").chmod(0o644)
    # As root it would install them: it only names them to another user.
    as_user = (
        [] if os.geteuid() else ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    )
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": str(missing.parent)}

    done = subprocess.run(
        [*as_user, str(checkout / "scripts" / "bootstrap")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )

    assert done.returncode == 1, done.stderr
    # A venv brings its own pip through ensurepip: Debian's python3-pip, whose
    # recommends are a compiler and python3-dev, is not needed.
    assert done.stderr == (
        "bootstrap: please install as root: apt-get install --no-install-recommends python3-venv\n"
    )
    assert not (checkout / ".venv").exists()
