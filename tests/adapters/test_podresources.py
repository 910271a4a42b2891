"""The PodResources client against a fake kubelet: real gRPC over a Unix socket."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiwid.adapters.podresources import ContainerRef, PodResourcesError, list_owners
from kiwid.adapters.podresources._generated import api_pb2 as pb
from kiwid.adapters.podresources.client import LIST_METHOD, METHODS, SERVICE
from tests.fake_podresources import FakePodResources, pod

REPO = Path(__file__).resolve().parents[2]
GPU = "kiwi.io/gpu"


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    # Unix socket paths are short (108 bytes): not pytest's long tmp_path.
    d = Path(tempfile.mkdtemp(prefix="kiwi-pr-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kubelet(kubelet_dir: Path) -> Iterator[FakePodResources]:
    k = FakePodResources(kubelet_dir / "kubelet.sock")
    k.start()
    yield k
    k.stop()


def test_list_owners_maps_the_devices_of_our_resource_to_their_containers(
    kubelet: FakePodResources,
) -> None:
    kubelet.pods = [
        pod("ml", "train-7f9", {"train": {GPU: ["GPU-a::0", "GPU-b::1"], "cpu.x/y": ["7"]}}),
        pod("web", "infer-1", {"server": {GPU: ["GPU-a::1"]}, "sidecar": {}}),
        pod("other", "exclusive", {"main": {"nvidia.com/gpu": ["GPU-c"]}}),
    ]

    owners = list_owners(kubelet.path, GPU, timeout_s=5)

    assert owners == {
        "GPU-a::0": ContainerRef("ml", "train-7f9", "train"),
        "GPU-b::1": ContainerRef("ml", "train-7f9", "train"),
        "GPU-a::1": ContainerRef("web", "infer-1", "server"),
    }
    assert kubelet.next_call() == "List"


def test_a_resource_nobody_holds_gives_no_owners(kubelet: FakePodResources) -> None:
    kubelet.pods = [pod("other", "exclusive", {"main": {"nvidia.com/gpu": ["GPU-c"]}})]
    assert list_owners(kubelet.path, "example.com/none", timeout_s=5) == {}
    kubelet.pods = []
    assert list_owners(kubelet.path, GPU, timeout_s=5) == {}


def test_no_kubelet_socket_is_an_error_at_once(kubelet_dir: Path) -> None:
    with pytest.raises(PodResourcesError, match="does not exist") as info:
        list_owners(kubelet_dir / "kubelet.sock", GPU, timeout_s=5)
    assert info.value.status == "NO_SOCKET"


@pytest.mark.serial
def test_a_kubelet_that_is_down_is_an_error_well_before_the_timeout(kubelet_dir: Path) -> None:
    stale = socket.socket(socket.AF_UNIX)  # the socket file of a kubelet that died
    stale.bind(str(kubelet_dir / "kubelet.sock"))
    stale.close()
    start = time.monotonic()
    with pytest.raises(PodResourcesError, match="UNAVAILABLE") as info:
        list_owners(kubelet_dir / "kubelet.sock", GPU, timeout_s=5)
    assert info.value.status == "UNAVAILABLE"
    assert time.monotonic() - start < 2.5


def test_a_kubelet_without_the_api_answers_unimplemented(kubelet_dir: Path) -> None:
    kubelet = FakePodResources(kubelet_dir / "kubelet.sock", with_api=False)
    kubelet.start()
    try:
        with pytest.raises(PodResourcesError, match="UNIMPLEMENTED") as info:
            list_owners(kubelet.path, GPU, timeout_s=5)
    finally:
        kubelet.stop()
    assert info.value.status == "UNIMPLEMENTED"


@pytest.mark.serial
def test_a_kubelet_too_slow_to_answer_costs_the_timeout_only(kubelet_dir: Path) -> None:
    kubelet = FakePodResources(kubelet_dir / "kubelet.sock", hold=threading.Event())
    kubelet.start()
    try:
        start = time.monotonic()
        with pytest.raises(PodResourcesError) as info:
            list_owners(kubelet.path, GPU, timeout_s=0.2)
        elapsed = time.monotonic() - start
    finally:
        kubelet.stop()  # releases the held call
    assert info.value.status == "DEADLINE_EXCEEDED"
    assert elapsed < 2.0


def test_each_call_finds_a_restarted_kubelet(kubelet: FakePodResources) -> None:
    kubelet.pods = [pod("ml", "a", {"c": {GPU: ["GPU-a::0"]}})]
    assert list_owners(kubelet.path, GPU, timeout_s=5) == {"GPU-a::0": ContainerRef("ml", "a", "c")}

    kubelet.stop()  # a kubelet restart: its socket goes, a new one comes
    kubelet.pods = [pod("ml", "b", {"c": {GPU: ["GPU-a::0"]}})]
    kubelet.start()

    assert list_owners(kubelet.path, GPU, timeout_s=5) == {"GPU-a::0": ContainerRef("ml", "b", "c")}


def test_the_client_binds_the_proto_s_list_method() -> None:
    desc = pb.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert pb.DESCRIPTOR.package == "v1"
    assert desc.full_name == SERVICE == "v1.PodResourcesLister"
    assert set(METHODS) == set(desc.methods_by_name)
    assert f"/{desc.full_name}/{desc.methods_by_name['List'].name}" == LIST_METHOD


def test_kiwid_loads_grpc_only_when_it_asks_the_kubelet() -> None:
    code = (
        "import sys, kiwid.daemon.server, kiwid.adapters.podresources\nprint('grpc' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    )
    assert out.stdout.strip() == "False"


def test_the_generator_notices_stale_podresources_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location(
        "kiwi_proto_generate", REPO / "proto" / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    source = "podresources/v1/api.proto"
    copy = tmp_path / "_generated"
    shutil.copytree(generate.TARGETS[source], copy)
    generate.TARGETS = {source: copy}
    assert generate.main(["--check"]) == 0

    (copy / "api_pb2.pyi").write_text("# edited by hand\n")

    assert generate.main(["--check"]) == 1
    assert f"{copy / 'api_pb2.pyi'} is not current" in capsys.readouterr().err
