"""PID -> tenant: pure parsing tables, then real processes in real cgroups."""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest

from kiwid.adapters.procs import (
    AccessDenied,
    ContainerIdentity,
    ProcCgroups,
    ProcessGone,
    ProcsError,
    alive,
    cpu_seconds,
    identify,
    parse_proc_cgroup,
    read_proc_cgroup,
    tenant_of,
    tenants_of,
)
from tests.adapters.conftest import BUSY, Sandbox, wait_until

ID = "3f1c9d0e5b7a4c2e8f6d1b3a5c7e9f0a2b4d6f8e0c1a3b5d7f9e1c3a5b7d9f0e"
ID12 = ID[:12]
POD = "8c0e6f2a-1b3d-4e5f-a7b9-c1d3e5f7a9b1"
POD_ = POD.replace("-", "_")


def v1(path: str, freezer: str | None = None, systemd: str | None = None) -> str:
    """A cgroup v1 /proc/PID/cgroup (as on CentOS 7 / Debian 10 with docker)."""
    return "\n".join(
        [
            f"12:freezer:{freezer or path}",
            f"11:cpu,cpuacct:{path}",
            f"10:memory:{path}",
            f"9:devices:{path}",
            f"8:pids:{path}",
            f"1:name=systemd:{systemd or path}",
        ]
    )


def hybrid(v2: str, path: str) -> str:
    """A hybrid layout: v1 controllers plus the systemd-managed cgroup2 line."""
    return v1(path) + f"\n0::{v2}\n"


def v2(path: str) -> str:
    return f"0::{path}\n"


K8S_SD = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_}.slice"
K8S_FS = f"/kubepods/burstable/pod{POD}"
USER = "/user.slice/user-1000.slice"

# (case, /proc/PID/cgroup text, kind, container_id, pod_uid, name, dedicated)
CASES = [
    ("docker v1 cgroupfs", v1(f"/docker/{ID}"), "docker", ID, None, ID12, True),
    ("docker v2 systemd", v2(f"/system.slice/docker-{ID}.scope"), "docker", ID, None, ID12, True),
    ("docker v2 cgroupfs", v2(f"/docker/{ID}"), "docker", ID, None, ID12, True),
    (
        "docker hybrid systemd",
        hybrid(f"/system.slice/docker-{ID}.scope", f"/system.slice/docker-{ID}.scope"),
        "docker",
        ID,
        None,
        ID12,
        True,
    ),
    ("docker hybrid v1 only", hybrid("/", f"/docker/{ID}"), "docker", ID, None, ID12, True),
    ("containerd k8s v1 cgroupfs", v1(f"{K8S_FS}/{ID}"), "containerd", ID, POD, ID12, True),
    ("containerd k8s v2 cgroupfs", v2(f"{K8S_FS}/{ID}"), "containerd", ID, POD, ID12, True),
    (
        "containerd k8s guaranteed",
        v2(f"/kubepods/pod{POD}/{ID}"),
        "containerd",
        ID,
        POD,
        ID12,
        True,
    ),
    (
        "containerd k8s v2 systemd",
        v2(f"{K8S_SD}/cri-containerd-{ID}.scope"),
        "containerd",
        ID,
        POD,
        ID12,
        True,
    ),
    (
        "containerd k8s hybrid systemd",
        hybrid(f"{K8S_SD}/cri-containerd-{ID}.scope", f"{K8S_SD}/cri-containerd-{ID}.scope"),
        "containerd",
        ID,
        POD,
        ID12,
        True,
    ),
    (
        "docker under k8s systemd",
        v1(f"{K8S_SD}/docker-{ID}.scope"),
        "docker",
        ID,
        POD,
        ID12,
        True,
    ),
    ("cri-o v2 systemd", v2(f"{K8S_SD}/crio-{ID}.scope"), "cri-o", ID, POD, ID12, True),
    ("cri-o v1 cgroupfs", v1(f"{K8S_FS}/crio-{ID}"), "cri-o", ID, POD, ID12, True),
    (
        "cri-o conmon is a plain scope",
        v2(f"{K8S_SD}/crio-conmon-{ID}.scope"),
        "systemd",
        None,
        None,
        f"crio-conmon-{ID}.scope",
        True,
    ),
    (
        "podman v2 systemd",
        v2(f"/machine.slice/libpod-{ID}.scope/container"),
        "podman",
        ID,
        None,
        ID12,
        True,
    ),
    (
        "podman user session",
        v2(f"{USER}/user@1000.service/user.slice/libpod-{ID}.scope"),
        "podman",
        ID,
        None,
        ID12,
        True,
    ),
    ("podman cgroupfs", hybrid(f"/libpod_parent/libpod-{ID}", "/"), "podman", ID, None, ID12, True),
    (
        "podman conmon is not the container",
        v2(f"/machine.slice/libpod-conmon-{ID}.scope"),
        "systemd",
        None,
        None,
        f"libpod-conmon-{ID}.scope",
        True,
    ),
    (
        "systemd service v2",
        v2("/system.slice/jupyter.service"),
        "systemd",
        None,
        None,
        "jupyter.service",
        True,
    ),
    (
        "systemd-run scope hybrid",
        hybrid("/system.slice/run-r1a2b3.scope", "/"),
        "systemd",
        None,
        None,
        "run-r1a2b3.scope",
        True,
    ),
    (
        "user manager app",
        v2(f"{USER}/user@1000.service/app.slice/train.service"),
        "systemd",
        None,
        None,
        "user@1000.service/train.service",
        True,
    ),
    (
        "login session",
        v2(f"{USER}/session-3.scope"),
        "systemd",
        None,
        None,
        "session-3.scope",
        False,
    ),
    (
        "user manager itself",
        v2(f"{USER}/user@1000.service"),
        "systemd",
        None,
        None,
        "user@1000.service",
        False,
    ),
    ("init scope", v2("/init.scope"), "systemd", None, None, "init.scope", False),
    ("generic v2 cgroup", v2("/kiwi-test/x"), "cgroup", None, None, "/kiwi-test/x", True),
    ("generic v1 cgroup", v1("/batch/job7"), "cgroup", None, None, "/batch/job7", True),
    ("root v2", v2("/"), "process", None, None, "/", False),
    ("root v1", v1("/"), "process", None, None, "/", False),
    (
        "v1 systemd unit is not freezable on v1",
        v1("/", systemd="/system.slice/jupyter.service"),
        "process",
        None,
        None,
        "/",
        False,
    ),
    (
        "only memory elsewhere (this CI sandbox)",
        "4:memory:/process_api/40e54726774b57d9\n6:freezer:/\n0::/\n",
        "process",
        None,
        None,
        "/",
        False,
    ),
]


@pytest.mark.parametrize(
    ("text", "kind", "container_id", "pod_uid", "name", "dedicated"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_identify(
    text: str, kind: str, container_id: str | None, pod_uid: str | None, name: str, dedicated: bool
) -> None:
    who = identify(parse_proc_cgroup(text))
    assert (who.kind, who.container_id, who.pod_uid, who.name, who.dedicated) == (
        kind,
        container_id,
        pod_uid,
        name,
        dedicated,
    )


def test_parse_proc_cgroup_keeps_every_line() -> None:
    text = hybrid(f"/system.slice/docker-{ID}.scope", f"/docker/{ID}") + "bad line\n"
    parsed = parse_proc_cgroup(text)
    assert parsed.v2 == f"/system.slice/docker-{ID}.scope"
    assert parsed.v1_freezer == f"/docker/{ID}"
    assert parsed.v1["cpu"] == parsed.v1["cpuacct"] == parsed.v1["name=systemd"] == f"/docker/{ID}"
    assert parse_proc_cgroup("") == ProcCgroups(v2=None, v1_freezer=None, v1={})
    assert parse_proc_cgroup(v2("/a")).v1_freezer is None


def test_identify_names_the_cgroup_it_used() -> None:
    who = identify(parse_proc_cgroup(hybrid("/", f"/docker/{ID}")))
    assert who == ContainerIdentity("docker", ID, None, ID12, f"/docker/{ID}", True)


def test_a_bare_process_is_its_own_tenant(sandbox: Sandbox) -> None:
    child = sandbox.spawn()
    tenant = tenant_of(child.pid)
    assert tenant is not None
    if tenant.cgroup_v2 != "/":
        pytest.skip("this test runs where the test process is not in the root cgroup")
    assert (tenant.key, tenant.kind, tenant.dedicated) == (f"pid:{child.pid}", "process", False)
    assert tenant.pids == frozenset({child.pid})


@pytest.mark.parametrize(
    ("cgroup", "key", "kind"),
    [
        (f"docker-{ID}.scope", f"docker:{ID12}", "docker"),
        (f"libpod-{ID}.scope", f"podman:{ID12}", "podman"),
        ("notebook.service", "systemd:notebook.service", "systemd"),
        ("session-9.scope", "pid:{pid}", "process"),
    ],
)
def test_a_process_in_a_container_cgroup(
    sandbox: Sandbox, cgroup: str, key: str, kind: str
) -> None:
    ref = sandbox.cgroup(cgroup)
    first, second = sandbox.spawn(), sandbox.spawn()
    for child in (first, second):
        sandbox.move(child.pid, ref)

    tenant = tenant_of(first.pid)

    assert tenant is not None
    assert (tenant.key, tenant.kind) == (key.format(pid=first.pid), kind)
    assert tenant.cgroup_v2 == ref.v2
    # /proc/PID/cgroup names every hierarchy the kernel has, mounted here or not (a
    # pure-cgroup2 container on a hybrid machine still sees a v1 freezer line).
    if sandbox.layout.v1_freezer_root is not None:
        assert tenant.cgroup_v1_freezer == ref.v1_freezer
    grouped = tenants_of([first.pid, second.pid, 2**22 + 7])
    if tenant.dedicated:
        assert grouped == {key: replace(tenant, pids=frozenset({first.pid, second.pid}))}
    else:
        assert set(grouped) == {f"pid:{first.pid}", f"pid:{second.pid}"}


def test_a_process_in_kiwids_own_cgroup_is_bare(sandbox: Sandbox) -> None:
    ref = sandbox.cgroup("kiwid.service")
    child = sandbox.spawn()
    sandbox.move(child.pid, ref)

    tenant = tenant_of(child.pid, own_cgroup=ref.v2)

    assert tenant is not None
    assert (tenant.key, tenant.kind, tenant.dedicated) == (f"pid:{child.pid}", "process", False)
    other = tenant_of(child.pid, own_cgroup="/")  # the root is never someone's container
    assert other is not None
    assert other.key == "systemd:kiwid.service"


def test_a_vanished_process_is_none_not_an_exception(sandbox: Sandbox) -> None:
    child = sandbox.spawn(["true"])
    child.wait(timeout=5)
    assert tenant_of(child.pid) is None
    assert cpu_seconds(child.pid) is None
    assert not alive(child.pid)
    with pytest.raises(ProcessGone):
        read_proc_cgroup(child.pid)
    assert issubclass(ProcessGone, ProcsError)
    assert issubclass(AccessDenied, ProcsError)


def test_alive_is_false_for_a_zombie(sandbox: Sandbox) -> None:
    child = sandbox.spawn()
    assert alive(child.pid)
    os.kill(child.pid, signal.SIGKILL)
    stat = Path(f"/proc/{child.pid}/stat")
    wait_until(lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", what="a zombie")

    assert not alive(child.pid)
    cpu_seconds(child.pid)  # a zombie's CPU time or None, never a psutil exception
    child.wait(timeout=5)


def test_cpu_seconds_grows_for_a_busy_process(sandbox: Sandbox) -> None:
    child = sandbox.spawn(BUSY)
    first = cpu_seconds(child.pid)
    assert first is not None

    wait_until(lambda: (cpu_seconds(child.pid) or 0) > first + 0.05, what="CPU time to grow")
