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


def test_with_dev_it_asks_for_git_where_it_is_missing(checkout: Path) -> None:
    # The suite calls git (the pure-cgroup2 host copies the checkout with
    # `git ls-files`; the fault matrix's sample reads the commits on HEAD), so a
    # clean machine gets it from bootstrap --dev like every other test tool. A PATH
    # with every tool bootstrap looks for but git makes a machine without it.
    tools = checkout / "tools"
    tools.mkdir()
    for name in (
        "python3",
        "dirname",
        "id",
        "tmux",
        "runc",
        "podman",
        "busybox",
        "cc",
        "promtool",
        "prometheus",
    ):
        found = shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")
        if found is None:
            pytest.skip(f"{name} is missing here: bootstrap --dev installs it first")
        (tools / name).symlink_to(found)
    tools.chmod(0o755)
    as_user = (
        []
        if os.geteuid()
        else [
            shutil.which("setpriv") or "/usr/bin/setpriv",
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
        ]
    )

    done = subprocess.run(
        [*as_user, "/bin/bash", str(checkout / "scripts" / "bootstrap"), "--dev"],
        env={"PATH": str(tools)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )

    assert done.returncode == 1, done.stderr
    assert done.stderr == "bootstrap: please install as root: apt-get install git\n"
