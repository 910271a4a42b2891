"""Pod names from the kubelet's PodResources API, through a real kiwid and a fake kubelet.

The fake kubelet serves ``v1.PodResourcesLister`` over gRPC on a Unix socket; kiwid
asks it (``kubernetes.pod_resources_socket``) about containers registered with
device IDs but without names, as kiwi-hook registers them under containerd without
annotation passthrough or under a runtime that sets none.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.conftest import V2_ROOT, Kiwid, Tenant, config_text, status_json, wait_for
from tests.fake_podresources import FakePodResources, pod

GPU = "kiwi.io/gpu"
SLOT = "GPU-sim-000000000000::1"


@pytest.fixture
def kubelet(workdir: Path) -> Iterator[FakePodResources]:
    """A fake kubelet (not started: a test may want it down first)."""
    k = FakePodResources(workdir / "pod-resources.sock")
    k.pods = [pod("ml", "train-7f9", {"train": {GPU: [SLOT]}})]
    yield k
    k.stop()


@pytest.fixture
def kiwid(start_kiwid: Callable[..., Kiwid], workdir: Path, kubelet: FakePodResources) -> Kiwid:
    config = config_text(workdir, poll=0.05) + f'pod_resources_socket = "{kubelet.path}"\n'
    (workdir / "kiwi.toml").write_text(config)
    return start_kiwid()


def register(k: Kiwid, t: Tenant, cid: str, **names: Any) -> dict[str, Any]:
    args = {"id": cid, "cgroup_v2": "/" + str(t.v2.relative_to(V2_ROOT)), "pid": t.pid}
    return k.call("register", {**args, "gpus": ["0"], "hold": False, **names})


def listed(k: Kiwid, key: str) -> dict[str, Any]:
    tenants = status_json(k)["gpus"][0]["tenants"]
    return next(t for t in tenants if t["id"] == key)


def test_a_container_with_only_device_ids_gets_its_pod_from_the_kubelet(
    kiwid: Kiwid, kubelet: FakePodResources, tenants: Callable[..., Tenant]
) -> None:
    kubelet.start()
    c = tenants("c", busy=False)

    assert register(kiwid, c, "c1", device_ids=[SLOT]) == {"tenant": c.key, "held": False}

    assert kubelet.next_call() == "List"
    entry = wait_for(
        lambda: (e := listed(kiwid, c.key))["pod"] and e, 5, "the pod name in kiwictl status"
    )
    assert (entry["name"], entry["pod"], entry["namespace"]) == ("train", "train-7f9", "ml")
    assert entry["identity_source"] == "podresources"
    out = kiwid.ctl("status")
    assert f"{c.key} (train, pod ml/train-7f9): idle" in out.stdout
    kiwid.wait_log("Container c1 is train in pod ml/train-7f9 (kubelet PodResources)")


def test_annotations_win_over_the_kubelet(
    kiwid: Kiwid, kubelet: FakePodResources, tenants: Callable[..., Tenant]
) -> None:
    kubelet.pods.append(pod("web", "infer-1", {"server": {GPU: ["GPU-sim-000000000000::0"]}}))
    kubelet.start()
    named, bare = tenants("named", busy=False), tenants("bare", busy=False)
    names = {"name": "trainer", "pod": "from-annotations", "namespace": "ml"}

    register(kiwid, named, "c1", device_ids=[SLOT], **names)
    register(kiwid, bare, "c2", device_ids=["GPU-sim-000000000000::0"])

    # The kubelet is asked about the container without names, and only about it.
    assert kubelet.next_call() == "List"
    wait_for(lambda: listed(kiwid, bare.key)["pod"] == "infer-1", 5, "the bare one's pod")
    entry = listed(kiwid, named.key)
    assert (entry["name"], entry["pod"], entry["identity_source"]) == (
        "trainer",
        "from-annotations",
        "annotations",
    )
    assert kubelet.calls.empty()


def test_a_kubelet_that_is_down_or_slow_holds_up_nothing(
    kiwid: Kiwid, kubelet: FakePodResources, tenants: Callable[..., Tenant]
) -> None:
    c = tenants("c", busy=False)

    # No kubelet: the container is a tenant at once, without a pod.
    assert register(kiwid, c, "c1", device_ids=[SLOT])["tenant"] == c.key
    entry = listed(kiwid, c.key)
    assert (entry["state"], entry["pod"], entry["identity_source"]) == ("idle", None, None)
    kiwid.wait_log("No pod names from the kubelet for now")

    # A kubelet that takes its time: kiwid answers meanwhile.
    kubelet.hold = threading.Event()
    kubelet.start()
    assert kubelet.next_call() == "List"  # asked again by itself, and now waiting
    assert kiwid.call("ping")
    assert listed(kiwid, c.key)["pod"] is None

    kubelet.hold.set()
    wait_for(lambda: listed(kiwid, c.key)["pod"] == "train-7f9", 5, "the pod name")
    kiwid.wait_log("The kubelet's PodResources API answers again")


def test_an_unregistered_container_is_no_longer_looked_for(
    kiwid: Kiwid, kubelet: FakePodResources, tenants: Callable[..., Tenant]
) -> None:
    kubelet.pods = []  # the kubelet does not know the container (yet)
    kubelet.start()
    c = tenants("c", busy=False)
    register(kiwid, c, "c1", device_ids=[SLOT])
    assert kubelet.next_call() == "List"

    assert kiwid.call("unregister", {"id": "c1"}) == {"removed": True}
    kubelet.pods = [pod("ml", "train-7f9", {"train": {GPU: [SLOT]}})]
    # Registered again (a restart of the container): found under its new registration.
    register(kiwid, c, "c2", device_ids=[SLOT])
    wait_for(lambda: listed(kiwid, c.key)["pod"] == "train-7f9", 5, "the pod name")
    kiwid.wait_log("Container c2 is train in pod ml/train-7f9")
    assert "Container c1 is" not in kiwid.log_text()
