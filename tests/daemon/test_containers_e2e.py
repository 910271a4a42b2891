"""Real containers with kiwi-hook: runc with OCI hooks, podman with Kiwi's CDI spec.

Needs root and Debian's ``runc``, ``busybox-static`` and ``podman`` (scripts/bootstrap
--dev installs them), and a ``keyctl`` system call that no seccomp filter forbids
(runc joins a session keyring in every container); each test says what it misses
and skips without it. The
containers run a busybox rootfs, no image and no registry. Every container, cgroup,
CDI spec file and socket a test makes is removed afterwards, whatever happened. CDI
specs go only into the test's own directories (podman sees them through a private
mount namespace): a spec left in /var/run/cdi would change every later podman run
on the machine, and one the machine holds must not change the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kiwid.adapters import cdi
from kiwid.adapters.gpu import DeviceInfo
from tests import capabilities
from tests.daemon.conftest import (
    V1_FREEZER,
    V2_ROOT,
    Kiwid,
    Tenant,
    config_text,
    status_json,
    wait_for,
)
from tests.fake_podresources import FakePodResources, pod

pytestmark = pytest.mark.slow

GPU0 = DeviceInfo(0, "GPU-sim-000000000000", "Kiwi simulated GPU", 80 * 2**30)
APPLETS = ("sh", "sleep", "cat", "env", "true")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PODMAN_LIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]


def need(binary: str, package: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} is not installed (apt-get install -y {package})")
    return path


@pytest.fixture
def root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("real containers need root")


@pytest.fixture
def runc(root_only: None) -> str:
    """runc, where it can start a container (it joins a session keyring in each)."""
    path = need("runc", "runc")
    problem = capabilities.keyring_problem()
    if problem is not None:
        pytest.skip(problem)
    return path


@pytest.fixture
def rootfs(workdir: Path, root_only: None) -> Path:
    """A busybox root filesystem: /bin/busybox and its applets."""
    busybox = need("busybox", "busybox-static")
    root = workdir / "rootfs"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(busybox, root / "bin" / "busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    for name in ("proc", "sys", "dev", "tmp"):
        (root / name).mkdir()
    return root


@pytest.fixture
def hook_path(workdir: Path) -> str:
    """kiwi-hook as installed (console script), else a wrapper running this checkout's."""
    installed = Path(sys.executable).with_name("kiwi-hook")
    if installed.is_file() and os.access(installed, os.X_OK):
        return str(installed)
    wrapper = workdir / "kiwi-hook"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m kiwid.hook.main "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.fixture
def kiwid(start_kiwid: Callable[..., Kiwid], workdir: Path) -> Kiwid:
    """A kiwid on one simulated GPU whose own CDI spec (if it writes one) stays private."""
    config = config_text(workdir, poll=0.05)
    (workdir / "kiwi.toml").write_text(config)
    return start_kiwid()


@pytest.fixture
def test_cgroup() -> Iterator[str]:
    """A parent cgroup name for the test's containers; removed in every hierarchy after."""
    name = f"kiwi-e2e-{uuid.uuid4().hex[:8]}"
    yield name
    _remove_cgroup_everywhere(name)


def _remove_cgroup_everywhere(relative: str) -> None:
    for hierarchy in [V2_ROOT, *sorted(p for p in CGROUP_ROOT.iterdir() if p.is_dir())]:
        top = hierarchy / relative
        if not top.is_dir():
            continue
        for directory in sorted(top.glob("**/"), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                directory.rmdir()


def tenant(k: Kiwid, key: str) -> dict[str, Any] | None:
    return next((t for t in k.call("tenants")["tenants"] if t["id"] == key), None)


def named(k: Kiwid, name: str) -> dict[str, Any] | None:
    return next((t for t in k.call("tenants")["tenants"] if t["name"] == name), None)


def cgroup2_of(pid: int) -> str:
    text = Path(f"/proc/{pid}/cgroup").read_text()
    return next(line[3:] for line in text.splitlines() if line.startswith("0::"))


def make_bundle(
    runc: str,
    workdir: Path,
    rootfs: Path,
    hook_path: str,
    k: Kiwid,
    cgroup: str,
    annotations: dict[str, str] | None = None,
    env: list[str] | None = None,
) -> Path:
    """An OCI bundle (``runc spec``, edited) whose hooks run kiwi-hook against ``k``."""
    bundle = workdir / "bundle"
    bundle.mkdir()
    subprocess.run([runc, "spec"], cwd=bundle, check=True, timeout=30)
    config = json.loads((bundle / "config.json").read_text())
    config["root"] = {"path": str(rootfs), "readonly": False}
    config["process"]["terminal"] = False
    config["process"]["args"] = ["sleep", "300"]
    config["process"]["env"].append(f"KIWI_GPU_0={GPU0.uuid}")  # as Kiwi's CDI device sets
    config["process"]["env"] += env or []
    config["linux"]["cgroupsPath"] = cgroup
    config["annotations"] = annotations or {}
    sock = str(k.socket)
    config["hooks"] = {
        "createRuntime": [
            {"path": hook_path, "args": cdi.hook_args(sock, "create"), "timeout": 10}
        ],
        "poststop": [{"path": hook_path, "args": cdi.hook_args(sock, "poststop"), "timeout": 10}],
    }
    (bundle / "config.json").write_text(json.dumps(config))
    return bundle


def runc_run_detached(
    runc_cmd: list[str], bundle: Path, cid: str, log: Path
) -> subprocess.Popen[bytes]:
    """``runc run -d``; its output goes to a file, not a pipe (the container keeps its stdio)."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [*runc_cmd, "run", "-d", "--bundle", str(bundle), cid],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def runc_pid(runc_cmd: list[str], cid: str) -> int:
    state = subprocess.run([*runc_cmd, "state", cid], capture_output=True, check=True, timeout=30)
    return int(json.loads(state.stdout)["pid"])


def test_a_runc_container_is_a_tenant_from_create_runtime_to_poststop(
    runc: str, kiwid: Kiwid, workdir: Path, rootfs: Path, hook_path: str, test_cgroup: str
) -> None:
    annotations = {
        "io.kubernetes.cri.container-name": "trainer",
        "io.kubernetes.cri.sandbox-name": "train-7f9",
        "io.kubernetes.cri.sandbox-namespace": "ml",
    }
    bundle = make_bundle(
        runc, workdir, rootfs, hook_path, kiwid, f"/{test_cgroup}/trainer", annotations
    )
    runc_cmd = [runc, "--root", str(workdir / "runc-state")]
    cid = f"{test_cgroup}-trainer"
    key = f"cgroup:/{test_cgroup}/trainer"
    try:
        log = workdir / "runc.log"
        assert runc_run_detached(runc_cmd, bundle, cid, log).wait(60) == 0, log.read_text()
        assert cgroup2_of(runc_pid(runc_cmd, cid)) == f"/{test_cgroup}/trainer"

        entry = wait_for(lambda: tenant(kiwid, key), 10, "kiwid to list the runc container")
        assert (entry["name"], entry["pod"], entry["namespace"]) == ("trainer", "train-7f9", "ml")
        assert entry["gpus"] == ["0"]

        subprocess.run([*runc_cmd, "delete", "--force", cid], check=True, timeout=60)
        wait_for(lambda: tenant(kiwid, key) is None, 10, "kiwid to forget it at poststop")
    finally:
        subprocess.run(
            [*runc_cmd, "delete", "--force", cid], capture_output=True, timeout=60, check=False
        )


def test_a_runc_container_without_names_gets_them_from_the_kubelet_by_its_device_ids(
    runc: str,
    start_kiwid: Callable[..., Kiwid],
    workdir: Path,
    rootfs: Path,
    hook_path: str,
    test_cgroup: str,
) -> None:
    slot = f"{GPU0.uuid}::2"
    kubelet = FakePodResources(workdir / "pod-resources.sock")
    kubelet.pods = [pod("ml", "train-7f9", {"train": {"kiwi.io/gpu": [slot]}})]
    kubelet.start()
    config = config_text(workdir, poll=0.05) + f'pod_resources_socket = "{kubelet.path}"\n'
    (workdir / "kiwi.toml").write_text(config)
    k = start_kiwid()
    # As containerd runs it: the device plugin's variable, no name annotations.
    bundle = make_bundle(
        runc, workdir, rootfs, hook_path, k, f"/{test_cgroup}/c", env=[f"KIWI_DEVICE_IDS={slot}"]
    )
    runc_cmd = [runc, "--root", str(workdir / "runc-state")]
    cid = f"{test_cgroup}-c"
    try:
        log = workdir / "runc.log"
        assert runc_run_detached(runc_cmd, bundle, cid, log).wait(60) == 0, log.read_text()

        assert kubelet.next_call() == "List"
        key = f"cgroup:/{test_cgroup}/c"
        entry = wait_for(
            lambda: (t := tenant(k, key)) and t["pod"] and t, 10, "the container's pod name"
        )
        assert (entry["name"], entry["pod"], entry["namespace"]) == ("train", "train-7f9", "ml")
        assert entry["identity_source"] == "podresources"
    finally:
        subprocess.run(
            [*runc_cmd, "delete", "--force", cid], capture_output=True, timeout=60, check=False
        )
        kubelet.stop()


def _with_own_cdi_dirs(spec_dir: Path, empty: Path) -> list[str]:
    """A command prefix: run in a private mount namespace whose CDI directories are ours.

    podman 4.3 reads CDI specs only from /etc/cdi and /var/run/cdi and has no option
    for another directory. In a mount namespace of its own, the test's ``spec_dir``
    is bound over /var/run/cdi and an empty directory over /etc/cdi (where it
    exists): podman then sees exactly the test's spec, never one the machine holds,
    and the machine's directories never see the test's.
    """
    script = (
        'mount --bind "$1" /var/run/cdi && '
        '{ [ ! -d /etc/cdi ] || mount --bind "$2" /etc/cdi; } && shift 2 && exec "$@"'
    )
    unshare = need("unshare", "util-linux")
    namespace = [unshare, "--mount", "--propagation", "private"]
    return [*namespace, "sh", "-c", script, "sh", str(spec_dir), str(empty)]


def test_podman_applies_kiwis_cdi_spec_and_kiwid_sees_the_container_by_name(
    runc: str, kiwid: Kiwid, workdir: Path, rootfs: Path, hook_path: str
) -> None:
    podman = need("podman", "podman")
    if not V1_FREEZER.exists() and "pids" not in (V2_ROOT / "cgroup.controllers").read_text():
        # podman sets a pids limit: on pure cgroup2 it needs that controller, which a
        # container on a machine whose controllers are bound to v1 does not get.
        pytest.skip("podman needs the cgroup2 pids controller, which this host lacks")
    tag = uuid.uuid4().hex[:8]
    name = f"kiwi-e2e-{tag}"
    spec_dir, empty = workdir / "cdi-specs", workdir / "cdi-empty"
    spec_name = f"kiwi.io-gpu-e2e-{tag}.json"
    spec = cdi.build_spec([GPU0], hook_path, nvidia_cdi=False, kiwi_socket=str(kiwid.socket))
    podman_cmd = [
        podman,
        *("--root", str(workdir / "podman-root"), "--runroot", str(workdir / "podman-run")),
        *("--tmpdir", str(workdir / "podman-tmp"), "--runtime", runc),
    ]
    had_libpod_parent = (V2_ROOT / "libpod_parent").exists()
    # The mount point for the test's own spec directory (podman's default; a
    # directory this test makes is removed again below).
    made_run_cdi = not Path(cdi.DEFAULT_DIR).exists()
    Path(cdi.DEFAULT_DIR).mkdir(parents=True, exist_ok=True)
    empty.mkdir()
    try:
        try:
            cdi.write_spec(spec, str(spec_dir), spec_name)
            run = subprocess.run(
                [
                    *_with_own_cdi_dirs(spec_dir, empty),
                    *(*podman_cmd, "run", "-d", "--network=none", *PODMAN_LIMITS, "--name", name),
                    *("--device", f"{cdi.KIND}=0", "--rootfs", str(rootfs), "/bin/sleep", "300"),
                ],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
        finally:
            cdi.remove_spec(str(spec_dir), spec_name)  # CDI is resolved at create only
        assert run.returncode == 0, run.stderr
        cid = run.stdout.strip()
        pid = int(
            subprocess.run(
                [*podman_cmd, "inspect", "-f", "{{.State.Pid}}", name],
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            ).stdout
        )
        # The spec took effect: the device's environment is the container's.
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"KIWI_GPU_0={GPU0.uuid}".encode() in environ
        assert cgroup2_of(pid).endswith(cid)  # libpod_parent/libpod-<id>

        entry = wait_for(lambda: named(kiwid, name), 10, "kiwid to list the podman container")
        assert cid[:12] in entry["id"]
        assert entry["gpus"] == ["0"]
        assert pid in entry["pids"]

        subprocess.run([*podman_cmd, "rm", "-f", "-t", "0", name], check=True, timeout=120)
        wait_for(lambda: named(kiwid, name) is None, 10, "kiwid to forget it at poststop")
    finally:
        subprocess.run(
            [*podman_cmd, "rm", "-f", "-t", "0", name],
            capture_output=True,
            timeout=120,
            check=False,
        )
        if not had_libpod_parent:
            _remove_cgroup_everywhere("libpod_parent")
        if made_run_cdi:
            with contextlib.suppress(OSError):
                Path(cdi.DEFAULT_DIR).rmdir()
    assert not (Path(cdi.DEFAULT_DIR) / spec_name).exists()  # never there: it was ours
    assert not (spec_dir / spec_name).exists()


def frozen(cgroup: str) -> bool:
    events = V2_ROOT / cgroup.lstrip("/") / "cgroup.events"
    freezer = V1_FREEZER / cgroup.lstrip("/") / "freezer.state"
    v2 = events.exists() and "frozen 1" in events.read_text()
    return v2 or (freezer.exists() and freezer.read_text().strip() == "FROZEN")


def test_hold_a_newcomer_on_a_busy_gpu_starts_frozen_without_blocking_the_runtime(
    runc: str,
    kiwid: Kiwid,
    workdir: Path,
    rootfs: Path,
    hook_path: str,
    test_cgroup: str,
    tenants: Callable[..., Tenant],
) -> None:
    busy = tenants("busy")
    kiwid.attach(busy.pid)
    wait_for(lambda: kiwid.tenant_states().get(busy.key) == "holder", 5, "busy to hold the GPU")
    cgroup = f"/{test_cgroup}/newcomer"
    bundle = make_bundle(runc, workdir, rootfs, hook_path, kiwid, cgroup)
    runc_cmd = [runc, "--root", str(workdir / "runc-state")]
    cid = f"{test_cgroup}-newcomer"
    key = f"cgroup:{cgroup}"
    log = workdir / "runc.log"
    try:
        run = runc_run_detached(runc_cmd, bundle, cid, log)
        try:
            rc = run.wait(10)
        except subprocess.TimeoutExpired:
            busy.proc.kill()  # the newcomer's turn comes, and runc can go on
            run.wait(60)
            msg = "`runc run` hung while the held container waited for its turn:\n"
            pytest.fail(msg + kiwid.log_text())
        assert rc == 0, log.read_text()
        # Queued once its program has replaced runc's init (kiwid watches for the
        # exec), which may come a moment after `runc run -d` returned.
        wait_for(lambda: kiwid.tenant_states().get(key) == "waiting", 5, "the newcomer queued")
        wait_for(lambda: frozen(cgroup), 5, "the newcomer to be frozen")

        busy.proc.kill()  # the holder goes: the newcomer's turn
        wait_for(lambda: kiwid.tenant_states().get(key) == "holder", 10, "the newcomer's turn")
        wait_for(lambda: not frozen(cgroup), 5, "the newcomer to be thawed")
    finally:
        subprocess.run(
            [*runc_cmd, "delete", "--force", cid], capture_output=True, timeout=60, check=False
        )


POLICY_RULES = """
[[tenants]]
match = { name = "trainer-*" }
weight = 1
priority = 1
max_weight = 3
max_priority = 5
"""


def test_a_pods_weight_and_priority_annotations_are_capped_by_its_rule(
    runc: str,
    start_kiwid: Callable[..., Kiwid],
    workdir: Path,
    rootfs: Path,
    hook_path: str,
    test_cgroup: str,
) -> None:
    (workdir / "kiwi.toml").write_text(config_text(workdir, poll=0.05) + POLICY_RULES)
    k = start_kiwid()
    runc_cmd = [runc, "--root", str(workdir / "runc-state")]
    asked = {
        # More than the rule allows on both counts, and within it on both.
        "greedy": {"kiwi.io/weight": "8", "kiwi.io/priority": "50"},
        "modest": {"kiwi.io/weight": "0.5", "kiwi.io/priority": "3"},
        # kiwi-hook leaves out what does not parse (with a warning): the rule's weight.
        "sloppy": {"kiwi.io/weight": "lots", "kiwi.io/priority": "2"},
    }
    cids = [f"{test_cgroup}-{name}" for name in asked]
    try:
        for name, annotations in asked.items():
            (workdir / name).mkdir()
            bundle = make_bundle(
                runc,
                workdir / name,
                rootfs,
                hook_path,
                k,
                f"/{test_cgroup}/{name}",
                {"kiwi.io/name": f"trainer-{name}", **annotations},
            )
            log = workdir / f"runc-{name}.log"
            run = runc_run_detached(runc_cmd, bundle, f"{test_cgroup}-{name}", log)
            assert run.wait(60) == 0, log.read_text()

        greedy = wait_for(lambda: named(k, "trainer-greedy"), 10, "the greedy container")
        modest = wait_for(lambda: named(k, "trainer-modest"), 10, "the modest container")
        sloppy = wait_for(lambda: named(k, "trainer-sloppy"), 10, "the sloppy container")

        assert greedy["policy"]["weight"] == 3  # asked 8, max_weight 3
        assert greedy["policy"]["priority"] == 5  # asked 50, max_priority 5
        assert sorted(greedy["policy"]["capped"]) == ["priority", "weight"]
        assert modest["policy"]["weight"] == 0.5
        assert modest["policy"]["priority"] == 3
        assert modest["policy"]["capped"] == []
        for entry in (greedy, modest):
            assert entry["policy"]["sources"]["weight"] == "annotation"
        assert (sloppy["policy"]["weight"], sloppy["policy"]["priority"]) == (1, 2)
        assert sloppy["policy"]["sources"]["weight"] == "rule 0"
        for entry in (greedy, modest, sloppy):
            assert entry["policy"]["rule"] == 0
            assert entry["policy"]["sources"]["priority"] == "annotation"
            assert entry["policy"]["runtime"] is False
        # What `kiwictl status --json` shows an operator, per GPU.
        (gpu,) = status_json(k)["gpus"]
        shown = {t["name"]: t["policy"] for t in gpu["tenants"]}
        assert (shown["trainer-greedy"]["weight"], shown["trainer-greedy"]["priority"]) == (3, 5)
        assert sorted(shown["trainer-greedy"]["capped"]) == ["priority", "weight"]
        assert shown["trainer-modest"]["capped"] == []
    finally:
        for cid in cids:
            subprocess.run(
                [*runc_cmd, "delete", "--force", cid], capture_output=True, timeout=60, check=False
            )
