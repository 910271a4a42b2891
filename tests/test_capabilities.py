"""The capability probes of tests/capabilities.py, run in children that lack each one.

A child loses CAP_NET_ADMIN (or CAP_SYS_ADMIN) through ``setpriv``, which drops it
from the bounding and inheritable sets before it runs the probe; it loses
``keyctl`` through a seccomp filter that answers EPERM, as a container runtime's
default profile does. Then the tests that need the capability skip and say why,
rather than erroring deep inside (``ip link add``, ``runc run``).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import pytest

from tests import capabilities
from tests.deploy.conftest import _unavailable
from tests.readable import REPO

# Runs argv[2:] under a seccomp filter that fails keyctl (system call argv[1]) with
# EPERM and allows everything else: a BPF program of four instructions.
WITHOUT_KEYCTL = """\
import ctypes, errno, os, struct, sys
number = int(sys.argv[1])
program = [
    (0x20, 0, 0, 0),  # load the system call's number
    (0x15, 0, 1, number),  # keyctl? on to the next, else skip it
    (0x06, 0, 0, 0x00050000 | errno.EPERM),  # SECCOMP_RET_ERRNO
    (0x06, 0, 0, 0x7FFF0000),  # SECCOMP_RET_ALLOW
]
code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in program))

class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

libc = ctypes.CDLL(None, use_errno=True)
prog = Program(len(program), ctypes.cast(code, ctypes.c_void_p))
# PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP with SECCOMP_MODE_FILTER
if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(prog), 0, 0):
    raise OSError(ctypes.get_errno(), "cannot install the seccomp filter")
os.execv(sys.argv[2], sys.argv[2:])
"""
PYTEST = ("-q", "-rs", "-p", "no:cacheprovider")


def _without(capability: str) -> list[str]:
    if os.geteuid() != 0:
        pytest.skip("dropping a capability shows something only where root has it")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is missing (apt-get install -y util-linux)")
    return [setpriv, "--bounding-set", f"-{capability}", "--inh-caps", f"-{capability}"]


def _without_keyctl() -> list[str]:
    number = capabilities.SYS_KEYCTL.get(platform.machine())
    if number is None:
        pytest.skip(f"no keyctl system call number known for {platform.machine()}")
    return [sys.executable, "-c", WITHOUT_KEYCTL, str(number), sys.executable]


def _run(prefix: list[str], *argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CI", None)  # in CI the deployment tests fail instead, with the same sentence
    command = [*prefix, *argv]
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=REPO, env=env, timeout=120, check=False
    )
    return done.stdout + done.stderr


def test_the_bridge_probe_names_a_missing_cap_net_admin() -> None:
    out = _run(_without("net_admin"), sys.executable, "-m", "tests.capabilities", "bridge")
    assert "CAP_NET_ADMIN" in out and "bridge" in out, out


def test_the_bridge_probe_reports_a_bridge_it_could_not_create() -> None:
    # With CAP_NET_ADMIN but not CAP_SYS_ADMIN, no network namespace of its own.
    out = _run(_without("sys_admin"), sys.executable, "-m", "tests.capabilities", "bridge")
    assert "does not let the tests create a network bridge" in out, out
    assert "Operation not permitted" in out, out


def test_the_keyring_probe_names_a_forbidden_keyctl() -> None:
    out = _run(_without_keyctl(), "-m", "tests.capabilities", "keyring")
    assert "runc cannot start a container here" in out and "EPERM" in out, out


def test_the_probes_pass_where_the_machine_has_the_capabilities() -> None:
    if os.geteuid() != 0 or not capabilities.has_capability(capabilities.CAP_NET_ADMIN):
        pytest.skip("this machine itself lacks what the bridge probe looks for")
    assert capabilities.bridge_problem() is None
    assert capabilities.keyring_problem() is None


def test_the_deployment_tests_skip_without_cap_net_admin() -> None:
    if _unavailable() is not None:
        pytest.skip(f"the deployment tests cannot run here anyway: {_unavailable()}")
    test = "tests/deploy/test_rollout.py::test_first_run_changes_things_and_the_second_nothing"
    out = _run(_without("net_admin"), sys.executable, "-m", "pytest", *PYTEST, test)
    assert "1 skipped" in out and "CAP_NET_ADMIN" in out, out


def test_the_runc_tests_skip_where_keyctl_is_forbidden() -> None:
    if os.geteuid() != 0 or shutil.which("runc") is None:
        pytest.skip("the runc tests cannot run here for another reason")
    test = (
        "tests/daemon/test_containers_e2e.py::"
        "test_a_runc_container_is_a_tenant_from_create_runtime_to_poststop"
    )
    out = _run(_without_keyctl(), "-m", "pytest", *PYTEST, test)
    assert "1 skipped" in out and "keyring" in out, out
