"""Kiwi's CDI spec: its content, the atomic writer, and reading other vendors' specs."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from kiwid.adapters import cdi
from kiwid.adapters.gpu import DeviceInfo

GPUS = [
    DeviceInfo(1, "GPU-bbbbbbbb-0000-0000-0000-000000000001", "NVIDIA H200", 2**30),
    DeviceInfo(0, "GPU-aaaaaaaa-0000-0000-0000-000000000000", "NVIDIA H200", 2**30),
]
HOOK = "/opt/kiwi/bin/kiwi-hook"
SOCK = "/run/kiwi/kiwid.sock"


def test_spec_names_each_gpu_by_index_and_uuid_in_a_version_podman_43_reads() -> None:
    spec = cdi.build_spec(GPUS, HOOK, nvidia_cdi=True, kiwi_socket=SOCK)

    assert spec["cdiVersion"] == "0.5.0"
    assert spec["kind"] == "kiwi.io/gpu"
    names = [d["name"] for d in spec["devices"]]
    assert names == ["0", GPUS[1].uuid, "1", GPUS[0].uuid]
    by_name = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    assert by_name["0"] == by_name[GPUS[1].uuid] == {"env": [f"KIWI_GPU_0={GPUS[1].uuid}"]}
    assert by_name["1"]["env"] == [f"KIWI_GPU_1={GPUS[0].uuid}"]
    json.dumps(spec)  # JSON-ready


def test_spec_hooks_run_kiwi_hook_at_create_runtime_and_poststop_within_the_oci_timeout() -> None:
    spec = cdi.build_spec(GPUS, HOOK, nvidia_cdi=True, kiwi_socket=SOCK, hook_timeout_s=3)

    create, poststop = spec["containerEdits"]["hooks"]
    assert create == {
        "hookName": "createRuntime",
        "path": HOOK,
        "args": ["kiwi-hook", "--socket", SOCK, "--timeout", "3", "--admission", "hold", "create"],
        "timeout": 8,
    }
    assert poststop == {
        "hookName": "poststop",
        "path": HOOK,
        "args": ["kiwi-hook", "--socket", SOCK, "--timeout", "3", "poststop"],
        "timeout": 8,
    }
    # kiwi-hook's own limit always ends it before the runtime would kill it (and
    # fail the container).
    assert create["timeout"] > 3
    none = cdi.build_spec(GPUS, HOOK, nvidia_cdi=True, kiwi_socket=SOCK, admission="none")
    assert "none" in none["containerEdits"]["hooks"][0]["args"]


def test_device_nodes_only_where_nvidias_spec_is_not_used() -> None:
    nodes = cdi.DeviceNodes(
        per_gpu={0: ("/dev/nvidia0",), 1: ("/dev/nvidia1",)},
        shared=("/dev/nvidiactl", "/dev/nvidia-uvm"),
    )

    own = cdi.build_spec(GPUS, HOOK, nvidia_cdi=False, kiwi_socket=SOCK, device_nodes=nodes)
    by_name = {d["name"]: d["containerEdits"] for d in own["devices"]}
    assert by_name["0"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
    assert by_name[GPUS[0].uuid]["deviceNodes"] == [{"path": "/dev/nvidia1"}]
    assert own["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidiactl"},
        {"path": "/dev/nvidia-uvm"},
    ]

    beside_nvidia = cdi.build_spec(
        GPUS, HOOK, nvidia_cdi=True, kiwi_socket=SOCK, device_nodes=nodes
    )
    assert "deviceNodes" not in json.dumps(beside_nvidia)
    simulated = cdi.build_spec(GPUS, HOOK, nvidia_cdi=False, kiwi_socket=SOCK)
    assert "deviceNodes" not in json.dumps(simulated)


@pytest.mark.parametrize(
    ("hook", "admission", "uuid", "message"),
    [
        ("kiwi-hook", "hold", "GPU-1", "absolute"),
        (HOOK, "later", "GPU-1", "admission"),
        (HOOK, "hold", "GPU 1/x", "CDI name"),
    ],
)
def test_build_spec_refuses_what_an_engine_would_refuse(
    hook: str, admission: str, uuid: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        cdi.build_spec([DeviceInfo(0, uuid, "x", 1)], hook, False, SOCK, admission=admission)


def test_find_device_nodes_lists_only_existing_character_devices(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    os.mknod(tmp_path / "nvidia0", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(tmp_path / "nvidiactl", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    (tmp_path / "nvidia1").write_text("not a device")

    nodes = cdi.find_device_nodes([0, 1], dev_root=tmp_path)

    assert nodes.per_gpu == {0: (str(tmp_path / "nvidia0"),), 1: ()}
    assert nodes.shared == (str(tmp_path / "nvidiactl"),)


def test_write_spec_creates_the_directory_and_a_readable_file(tmp_path: Path) -> None:
    spec = cdi.build_spec(GPUS, HOOK, True, SOCK)
    folder = tmp_path / "run" / "cdi"

    assert cdi.write_spec(spec, folder) is True

    target = folder / "kiwi.io-gpu.json"
    assert json.loads(target.read_text()) == spec
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sorted(p.name for p in folder.iterdir()) == ["kiwi.io-gpu.json"]


def test_write_spec_leaves_an_unchanged_file_alone_and_replaces_a_changed_one(
    tmp_path: Path,
) -> None:
    spec = cdi.build_spec(GPUS, HOOK, True, SOCK)
    cdi.write_spec(spec, tmp_path, "kiwi.json")
    before = (tmp_path / "kiwi.json").stat()

    assert cdi.write_spec(spec, tmp_path, "kiwi.json") is False
    assert (tmp_path / "kiwi.json").stat().st_ino == before.st_ino

    changed = cdi.build_spec(GPUS[:1], HOOK, True, SOCK)
    assert cdi.write_spec(changed, tmp_path, "kiwi.json") is True
    assert json.loads((tmp_path / "kiwi.json").read_text()) == changed
    # Replaced by a rename, not rewritten in place: a reader never sees half a spec.
    assert (tmp_path / "kiwi.json").stat().st_ino != before.st_ino
    assert [p.name for p in tmp_path.iterdir()] == ["kiwi.json"]


def test_a_failed_write_keeps_the_old_spec_and_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = cdi.build_spec(GPUS, HOOK, True, SOCK)
    cdi.write_spec(old, tmp_path)

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="No space"):
        cdi.write_spec(cdi.build_spec(GPUS[:1], HOOK, True, SOCK), tmp_path)

    assert json.loads((tmp_path / "kiwi.io-gpu.json").read_text()) == old
    assert [p.name for p in tmp_path.iterdir()] == ["kiwi.io-gpu.json"]


@pytest.mark.parametrize("name", ["../kiwi.json", "kiwi.yaml", "sub/kiwi.json"])
def test_write_spec_takes_only_plain_json_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="plain"):
        cdi.write_spec({}, tmp_path, name)


def test_remove_spec(tmp_path: Path) -> None:
    cdi.write_spec(cdi.build_spec(GPUS, HOOK, True, SOCK), tmp_path)

    assert cdi.remove_spec(tmp_path) is True
    assert cdi.remove_spec(tmp_path) is False
    assert list(tmp_path.iterdir()) == []


NVIDIA_YAML = """\
---
cdiVersion: 0.5.0
containerEdits:
  deviceNodes:
  - path: /dev/nvidiactl
  hooks:
  - args:
    - nvidia-cdi-hook
    - update-ldcache
    hookName: createContainer
    path: /usr/bin/nvidia-cdi-hook
devices:
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
  name: "0"
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
  name: GPU-aaaaaaaa-0000-0000-0000-000000000000
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
  name: all
kind: nvidia.com/gpu
"""


def test_find_devices_reads_json_and_nvidia_ctk_yaml_specs(tmp_path: Path) -> None:
    etc, run = tmp_path / "etc", tmp_path / "run"
    etc.mkdir()
    (etc / "nvidia.yaml").write_text(NVIDIA_YAML)
    cdi.write_spec(cdi.build_spec(GPUS, HOOK, True, SOCK), run)
    (run / "broken.json").write_text("{")
    (run / "other.json").write_text(
        json.dumps({"kind": "vendor.com/x", "devices": [{"name": "q"}]})
    )
    (run / ".kiwi.io-gpu.json.tmp").write_text(json.dumps({"kind": "kiwi.io/gpu"}))
    dirs = [etc, run, tmp_path / "missing"]

    assert cdi.find_devices("nvidia.com/gpu", dirs) == {
        "0",
        "GPU-aaaaaaaa-0000-0000-0000-000000000000",
        "all",
    }
    assert cdi.find_devices("kiwi.io/gpu", dirs) == {"0", "1", GPUS[0].uuid, GPUS[1].uuid}
    assert cdi.find_devices("vendor.com/x", dirs) == {"q"}
    assert cdi.find_devices("amd.com/gpu", dirs) == frozenset()
