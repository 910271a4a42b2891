"""What a machine lets the tests do, probed once: network bridges and session keyrings.

A container may lack what some tests need though every program is installed:
CAP_NET_ADMIN, without which the deployment tests cannot create the bridge their
hosts boot on, or the ``keyctl`` system call (a seccomp filter), without which
runc cannot start a container ("unable to join session keyring"). Each probe
answers ``None`` where the capability is there, else one sentence naming what is
missing, which the tests skip with (tests/deploy fail with it in CI, as for any
other reason they cannot run there).

``python -m tests.capabilities bridge|keyring`` prints a probe's answer (``ok``
or the sentence): tests/test_capabilities.py runs it so, in a child without the
capability, to show that the probe sees what is missing.
"""

from __future__ import annotations

import errno
import functools
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

CAP_NET_ADMIN = 12  # linux/capability.h
KEYCTL_JOIN_SESSION_KEYRING = 1  # linux/keyctl.h
# keyctl's system call number where Python has no name for it (asm/unistd*.h).
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 271, "s390x": 280}
# In a child: what runc does first in a new container, join a new session keyring
# (an anonymous one here); print the errno, 0 for success.
_JOIN_KEYRING = (
    "import ctypes, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    "done = libc.syscall(ctypes.c_long(int(sys.argv[1])), ctypes.c_long(int(sys.argv[2])),\n"
    "                    ctypes.c_void_p(None))\n"
    "print(0 if done >= 0 else ctypes.get_errno())\n"
)


def has_capability(number: int, status: Path = Path("/proc/self/status")) -> bool:
    """Whether this process has capability ``number`` in its effective set."""
    for line in status.read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> number & 1)
    return False


@functools.cache
def bridge_problem() -> str | None:
    """Why the deployment tests cannot create their hosts' bridge here, or None.

    Tries in a new network namespace of its own, which vanishes with the probe:
    nothing on this machine's network changes.
    """
    if not has_capability(CAP_NET_ADMIN):
        return (
            "this machine does not give the tests CAP_NET_ADMIN (a container started "
            "without it?), which creating the network bridge the test hosts boot on needs"
        )
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if unshare is None or ip is None:
        return None  # a missing program is named by whoever needs it
    script = f"{ip} link add kiwi-probe0 type bridge && {ip} link del kiwi-probe0"
    done = subprocess.run(
        [unshare, "--net", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode == 0:
        return None
    said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
    return (
        "this machine does not let the tests create a network bridge, which the test "
        f"hosts boot on (`ip link add ... type bridge` in a new network namespace: {said})"
    )


@functools.cache
def keyring_problem() -> str | None:
    """Why runc cannot start a container here, at joining a session keyring; or None.

    runc joins a new session keyring in every container it starts and fails
    ("unable to join session keyring") unless that works or the kernel has no
    keyrings at all (ENOSYS).
    """
    number = SYS_KEYCTL.get(platform.machine())
    if number is None:
        return None  # no number to probe with: runc will say it itself
    done = subprocess.run(
        [sys.executable, "-c", _JOIN_KEYRING, str(number), str(KEYCTL_JOIN_SESSION_KEYRING)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    error = int(done.stdout)
    if error in (0, errno.ENOSYS):
        return None
    return (
        "runc cannot start a container here: joining a session keyring (the keyctl "
        f"system call) fails with {errno.errorcode.get(error, error)} ({os.strerror(error)}), "
        "as where a container's seccomp filter forbids keyctl"
    )


if __name__ == "__main__":
    probes = {"bridge": bridge_problem, "keyring": keyring_problem}
    if len(sys.argv) != 2 or sys.argv[1] not in probes:
        sys.exit(f"usage: python -m tests.capabilities {'|'.join(probes)}")
    print(probes[sys.argv[1]]() or "ok")
