"""Fixtures for the deployment tests: a wheelhouse, a fleet of real systemd hosts, Ansible.

The hosts need root, systemd-nspawn and debootstrap (``scripts/test-hosts-deps``
installs them), and a machine that lets root create a network bridge (CAP_NET_ADMIN,
which a container may lack). Without them the tests are skipped on a developer's machine and
fail in CI (``CI`` set), so that a CI run cannot pass by skipping them.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import capabilities
from tests.deploy import hosts
from tests.deploy.playbook import Ansible, build_wheels, project_version, source_copy


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the deployment tests boot systemd-nspawn hosts and need root"
    missing = hosts.missing_tools()
    if missing:
        return f"missing {', '.join(missing)}: run scripts/test-hosts-deps (as root)"
    if not (Path(sys.executable).parent / "ansible-playbook").exists():
        return "ansible-playbook is not in the virtualenv: scripts/bootstrap --dev installs it"
    return capabilities.bridge_problem()


def require_hosts() -> None:
    """Skip (or, in CI, fail) when real systemd hosts cannot be booted here."""
    reason = _unavailable()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"deployment tests cannot run in CI: {reason}")
    pytest.skip(reason)


def _say(text: str) -> None:
    sys.stderr.write(f"\n[deploy] {text}\n")


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kiwi-gpu and all its dependencies as wheels, built on the controller."""
    require_hosts()
    base = tmp_path_factory.mktemp("wheels")
    started = time.monotonic()
    house = base / "wheelhouse"  # built from base / "src", which the upgrade test reuses
    src = source_copy(base / "src")
    build_wheels(src, house)
    _say(f"wheelhouse built in {time.monotonic() - started:.0f} s")
    assert list(house.glob(f"kiwi_gpu-{project_version(src)}-*.whl")), list(house.iterdir())
    return house


@pytest.fixture(scope="module")
def fleet() -> Iterator[hosts.Fleet]:
    """Two booted hosts: pure cgroup2, and hybrid where this machine has that layout."""
    require_hosts()
    started = time.monotonic()
    rootfs = hosts.ensure_rootfs(_say)
    layouts = ["unified", "hybrid" if hosts.hybrid_supported() else "unified"]
    booted = hosts.Fleet(rootfs, layouts)
    try:
        booted.start()
        _say(f"{len(booted.hosts)} hosts up in {time.monotonic() - started:.0f} s")
        yield booted
    finally:
        booted.close()


@pytest.fixture(scope="module")
def ansible(fleet: hosts.Fleet, wheelhouse: Path) -> Iterator[Ansible]:
    """ansible-playbook against the fleet; its SSH connections are closed afterwards."""
    runner = Ansible(fleet, wheelhouse)
    try:
        yield runner
    finally:
        runner.close()
