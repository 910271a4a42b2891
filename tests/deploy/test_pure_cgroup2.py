"""The tests that depend on the cgroup hierarchy, on a pure-cgroup2 Debian 12 host, from /root.

Boots one host with the unified hierarchy only (SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1,
as current distributions and Kiwi's GPU machines run), copies the checkout to
``/root/kiwi`` inside it (``/root`` is mode 0700 there, as on any Debian), installs
kiwi-gpu and the test tools into ``/root/kiwi/.venv`` from a wheelhouse built here
(the host has no network), and runs the tests of tests/adapters and tests/daemon
marked ``cgroups`` there, as a transient systemd service (like a CI job on a real
systemd machine). They must pass, the v1-freezer tests skipping with their reason.

Which tests, and why those: the ones that make real cgroups, freeze them or read
them, where a pure-cgroup2 host differs from this machine (tests/conftest.py marks
them ``cgroups``: the cgroup adapter's own tests, the daemon's tests with tenants
in real cgroups that a real kiwid freezes and thaws, its rotation, its isolation of
bare processes, the freezer fence, the sampled fault matrix on the sim). The rest
of the suite is the same on either layout: the scheduling core, configuration,
the control protocol, the CLI's output, the daemon's parts driven by scripted
gates, the docs. The ``serial`` tests are left out too: they measure time (shares
of the GPU, latencies), and this host shares the machine's CPUs with the other
tests of the parallel run; their cgroup operations are the ones the rotation tests
here run. Tests that need a C compiler (the driver double), runc or podman skip
in the host unless ``KIWI_IN_HOST_PACKAGES`` adds them.

``KIWI_IN_HOST_TESTS`` names other test paths to run instead (``tests`` for the
whole suite), ``KIWI_IN_HOST_MARKERS`` another ``-m`` expression (empty: every
test of those paths), ``KIWI_IN_HOST_DEV=1`` installs all of the dev extra's tools,
and ``KIWI_IN_HOST_PACKAGES`` Debian packages to add to the host (the whole suite
wants tmux, runc, podman, busybox-static, gcc, libc6-dev, procps and prometheus);
the host's root file system is then built and cached for that list.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from tests.deploy import hosts
from tests.deploy.conftest import _say, require_hosts
from tests.deploy.playbook import REPO, build_wheels, source_copy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TESTS = os.environ.get("KIWI_IN_HOST_TESTS", "tests/adapters tests/daemon").split()
MARKERS = os.environ.get("KIWI_IN_HOST_MARKERS", "cgroups and not serial")
EXTRA_PACKAGES = tuple(os.environ.get("KIWI_IN_HOST_PACKAGES", "").split())
# The test tools installed in the host: these four (pytest-xdist for its xdist_group
# marker, which --strict-markers wants known), or with KIWI_IN_HOST_DEV=1 all of
# kiwi-gpu's dev extra (what the whole suite uses), at the versions installed here.
DEV_EXTRA = [
    re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
    for requirement in metadata.requires("kiwi-gpu") or []
    if "extra ==" in requirement and "dev" in requirement
]
TEST_TOOLS = tuple(
    DEV_EXTRA
    if os.environ.get("KIWI_IN_HOST_DEV")
    else ("pytest", "pytest-timeout", "pytest-xdist", "hypothesis")
)
CHECKOUT = "/root/kiwi"
# pytest's last line: "63 passed, 12 skipped in 66.13s" (framed with = without -q).
SUMMARY = re.compile(r"^=* ?(?P<counts>\d+ (?:passed|failed)[^\n]*?) in [\d.]+s", re.MULTILINE)


def checkout_copy(dest: Path) -> Path:
    """The files of this checkout that git tracks or would track (no .venv, no caches)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source, target = REPO / name, dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():  # e.g. the role's units, links to systemd/
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
    return dest


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[hosts.Host]:
    """One booted pure-cgroup2 host with the checkout and a wheelhouse bound in."""
    require_hosts()
    base = tmp_path_factory.mktemp("in-host")
    house = base / "wheelhouse"
    build_wheels(source_copy(base / "src"), house)  # kiwi-gpu and what it needs to run
    pins = [f"{tool}=={metadata.version(tool)}" for tool in TEST_TOOLS]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(house), *pins],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    checkout = checkout_copy(base / "checkout")
    rootfs = hosts.ensure_rootfs(_say, extra=EXTRA_PACKAGES)
    fleet = hosts.Fleet(
        rootfs,
        ["unified"],
        binds=((checkout, "/mnt/kiwi-checkout"), (house, "/mnt/kiwi-wheelhouse")),
        # runc joins a session keyring for each container and attaches a BPF device
        # program to its cgroup: nspawn's default system call filter forbids both
        # (a machine of its own would not).
        nspawn_args=("--system-call-filter=@keyring bpf",),
    )
    try:
        fleet.start()
        yield fleet.hosts[0]
    finally:
        fleet.close()


def test_cgroup_and_daemon_tests_pass_on_a_pure_cgroup2_host_from_root(host: hosts.Host) -> None:
    assert host.sh("stat -c %a /root").strip() == "700"
    assert host.sh("stat -f -c %T /sys/fs/cgroup").strip() == "cgroup2fs"
    assert host.sh("test -e /sys/fs/cgroup/freezer && echo v1 || echo none").strip() == "none"
    host.sh(
        f"cp -a /mnt/kiwi-checkout {CHECKOUT} && python3 -m venv {CHECKOUT}/.venv && "
        f"{CHECKOUT}/.venv/bin/pip install -q --no-index --find-links /mnt/kiwi-wheelhouse "
        f"kiwi-gpu {' '.join(TEST_TOOLS)} && "
        # Installed offline from the wheelhouse: scripts/bootstrap (which the README
        # test runs) finds it done and asks no package index.
        f"touch {CHECKOUT}/.venv/.kiwi-installed '{CHECKOUT}/.venv/.kiwi-installed[dev]'",
        timeout=600,
    )
    # A transient service, as a CI job runs on a systemd machine; a clean
    # environment (no CI variable from this machine: tests that skip here for lack
    # of a tool are meant to skip).
    run = host.run(
        "systemd-run",
        "--wait",
        "--pipe",
        "--quiet",
        "--collect",
        f"--working-directory={CHECKOUT}",
        "/usr/bin/env",
        "-i",
        f"PATH={CHECKOUT}/.venv/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME=/root",
        "LANG=C.UTF-8",
        f"{CHECKOUT}/.venv/bin/python",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *(("-m", MARKERS) if MARKERS else ()),
        *TESTS,
        check=False,
        timeout=1500,
    )
    output = run.stdout + run.stderr
    summary = SUMMARY.search(output)
    what = " ".join(TESTS) + (f" -m '{MARKERS}'" if MARKERS else "")
    _say(f"inside the pure-cgroup2 host ({what}): {summary and summary['counts']}")
    assert run.returncode == 0, output[-60000:]
    assert summary is not None and "failed" not in summary["counts"], output[-5000:]
    if any("tests/adapters/test_cgroups.py".startswith(path.rstrip("/")) for path in TESTS):
        assert "needs a mounted cgroup v1 freezer hierarchy" in output, output[-5000:]
    # Nothing stranded: no test cgroup left behind, frozen or not.
    left = host.sh("ls -d /sys/fs/cgroup/kiwi-test-* 2>/dev/null; true").strip()
    assert left == "", left
