"""A pod's GPU memory declaration through real runc and kiwi-hook.

runc runs kiwi-hook at createRuntime against a real kiwid on one simulated 80 GiB
GPU (1 GiB reserve). A declaration it can hold makes the container a tenant with that
declaration; one no GPU can hold, or one that is no size, fails the container's
start (the hook exits 1): the container never runs, gated or not. Needs what
tests/daemon/test_containers_e2e.py needs (root, runc, busybox-static, keyctl) and
skips without it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.daemon.conftest import Kiwid, wait_for
from tests.daemon.test_containers_e2e import (  # noqa: F401 - fixtures, asked for by name
    hook_path,
    kiwid,
    make_bundle,
    root_only,
    rootfs,
    runc,
    runc_run_detached,
    tenant,
    test_cgroup,
)

pytestmark = pytest.mark.slow
GiB = 2**30


@dataclass
class Rig:
    """runc with kiwi-hook in its bundles, and the kiwid the hook registers with."""

    runc: str
    kiwid: Kiwid
    workdir: Path
    rootfs: Path
    hook: str
    cgroup: str

    @property
    def cmd(self) -> list[str]:
        return [self.runc, "--root", str(self.workdir / "runc-state")]

    @property
    def cid(self) -> str:
        return f"{self.cgroup}-trainer"

    def start(self, memory: str) -> tuple[int, str]:
        """``runc run -d`` a container declaring ``memory``: its status and runc's output."""
        annotations = {"io.kubernetes.cri.container-name": "trainer", "kiwi.io/gpu-memory": memory}
        cgroup = f"/{self.cgroup}/trainer"
        bundle = make_bundle(
            self.runc, self.workdir, self.rootfs, self.hook, self.kiwid, cgroup, annotations
        )
        log = self.workdir / "runc.log"
        return runc_run_detached(self.cmd, bundle, self.cid, log).wait(60), log.read_text()


@pytest.fixture
def rig(request: pytest.FixtureRequest, workdir: Path) -> Iterator[Rig]:
    """The fixtures of tests/daemon/test_containers_e2e.py (asked for by name, so that
    they are not parameters named like the imports), and no container left behind."""
    runc_path, k, root, hook, cgroup = (
        request.getfixturevalue(name)
        for name in ("runc", "kiwid", "rootfs", "hook_path", "test_cgroup")
    )
    made = Rig(runc_path, k, workdir, root, hook, cgroup)
    yield made
    subprocess.run([*made.cmd, "delete", "--force", made.cid], capture_output=True, timeout=60)


@pytest.mark.parametrize(
    ("memory", "words"),
    [
        (
            "200Gi",
            "container trainer (CID) declares 200 GiB of GPU memory per GPU (its pod's "
            "annotation kiwi.io/gpu-memory), more than GPU 0 can ever give it: its 80 GiB "
            "less memory.reserve_mib (1 GiB) leave 79 GiB (kiwid refused it)",
        ),
        ("40GB", "container CID: annotation kiwi.io/gpu-memory='40GB' must be a GPU memory size"),
    ],
)
def test_a_declaration_no_gpu_can_hold_fails_the_container_start(
    rig: Rig, memory: str, words: str
) -> None:
    status, output = rig.start(memory)
    assert status != 0, output
    assert f"kiwi-hook: error: {words.replace('CID', rig.cid)}" in output, output
    assert "the container does not start" in output
    listed = subprocess.run([*rig.cmd, "list", "-q"], capture_output=True, text=True, timeout=30)
    assert rig.cid not in listed.stdout.split()  # never created, so it never ran
    assert rig.kiwid.tenant_states() == {}


def test_a_declaration_that_fits_makes_a_tenant_that_says_so(rig: Rig) -> None:
    status, output = rig.start("40Gi")
    assert status == 0, output
    key = f"cgroup:/{rig.cgroup}/trainer"
    entry = wait_for(lambda: tenant(rig.kiwid, key), 10, "kiwid to list the runc container")
    assert (entry["declared_bytes"], entry["declared_source"]) == (40 * GiB, "annotation")
