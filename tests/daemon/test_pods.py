"""PodNames on its own: which answers name which containers, and when it stops asking.

The kubelet is a plain function here (the gRPC side is in tests/adapters and
tests/daemon/test_pod_identity.py); the clock that dates registrations is a fake.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from collections.abc import Mapping

import pytest

from kiwid.adapters.podresources import ContainerRef, PodResourcesError
from kiwid.config.schema import KubernetesSettings
from kiwid.daemon.tenants.pods import GIVE_UP_S, PodNames
from kiwid.daemon.tenants.tracker import Identity, Registration, TenantTracker

SETTINGS = KubernetesSettings(pod_resources_socket="/run/fake-kubelet.sock")
OLD = ContainerRef("ml", "finished", "train")
NEW = ContainerRef("ml", "train-7f9", "train")


class Kubelet:
    """Answers List from a queue of answers; each call waits until the test lets it answer."""

    def __init__(self) -> None:
        self.answers: queue.Queue[Mapping[str, ContainerRef] | PodResourcesError] = queue.Queue()
        self.asked: queue.Queue[tuple[str, str]] = queue.Queue()

    def __call__(self, socket: str, resource: str) -> Mapping[str, ContainerRef]:
        self.asked.put((socket, resource))
        answer = self.answers.get(timeout=10)
        if isinstance(answer, PodResourcesError):
            raise answer
        return answer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tracker_with(*keys: str) -> TenantTracker:
    tracker = TenantTracker(lambda pid: None)
    for key in keys:
        identity = Identity(key=key, kind="cgroup", name=key)
        tracker.register(Registration(f"id-{key}", identity, frozenset({"0"}), frozenset()))
    return tracker


async def in_thread(q: queue.Queue[tuple[str, str]]) -> tuple[str, str]:
    return await asyncio.to_thread(q.get, timeout=10)


def test_an_answer_names_only_containers_registered_before_the_question() -> None:
    async def body() -> None:
        tracker, kubelet, clock = tracker_with("a", "b"), Kubelet(), Clock()
        pods = PodNames(tracker, lambda: SETTINGS, lister=kubelet, clock=clock)
        assert pods.want("a", ["GPU-x::0"])
        assert await in_thread(kubelet.asked) == (SETTINGS.pod_resources_socket, "kiwi.io/gpu")
        clock.now += 1
        pods.want("b", ["GPU-x::1"])  # while the kubelet is still answering
        # The answer predates b's allocation: its slot may still name a finished pod.
        kubelet.answers.put({"GPU-x::0": NEW, "GPU-x::1": OLD})
        await in_thread(kubelet.asked)
        assert tracker.registered["a"].identity.pod == "train-7f9"
        assert tracker.registered["b"].identity.pod is None
        kubelet.answers.put({"GPU-x::1": NEW})
        await settled(pods)
        ident = tracker.registered["b"].identity
        assert (ident.name, ident.pod, ident.namespace) == ("train", "train-7f9", "ml")
        assert ident.identity_source == "podresources"
        assert pods.questions == 2
        await pods.close()

    asyncio.run(body())


async def settled(pods: PodNames) -> None:
    """Wait for the lookup task: it ends when nobody is left to look for."""
    task = pods._task
    assert task is not None
    await asyncio.wait_for(task, 10)


def test_nothing_is_asked_without_device_ids_or_a_socket() -> None:
    async def body() -> None:
        kubelet = Kubelet()
        off = PodNames(
            tracker_with("a"), lambda: KubernetesSettings(pod_resources_socket=""), lister=kubelet
        )
        assert not off.want("a", ["GPU-x::0"])
        on = PodNames(tracker_with("a"), lambda: SETTINGS, lister=kubelet)
        assert not on.want("a", [])
        assert on.pending == off.pending == frozenset()
        await on.close()
        assert kubelet.asked.empty()

    asyncio.run(body())


def test_a_container_not_found_is_given_up_after_a_while(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        tracker, kubelet, clock = tracker_with("a", "b"), Kubelet(), Clock()
        pods = PodNames(tracker, lambda: SETTINGS, lister=kubelet, clock=clock)
        pods.want("a", ["GPU-x::0"])
        await in_thread(kubelet.asked)
        kubelet.answers.put(PodResourcesError("UNAVAILABLE", "kubelet restarting"))
        clock.now += GIVE_UP_S
        pods.want("b", ["GPU-x::1"])  # wakes it up at once
        await in_thread(kubelet.asked)
        kubelet.answers.put({"GPU-x::1": NEW})
        await settled(pods)
        assert tracker.registered["a"].identity.pod is None
        assert tracker.registered["b"].identity.pod == "train-7f9"
        await pods.close()

    with caplog.at_level(logging.INFO, logger="kiwid.pods"):
        asyncio.run(body())
    messages = [r.getMessage() for r in caplog.records]
    assert "No pod names from the kubelet for now: kubelet restarting" in messages
    assert "No pod holds devices GPU-x::0 of tenant a after 600 s; it keeps its name" in messages
    assert "The kubelet's PodResources API answers again" in messages


def test_closing_ends_a_lookup_in_progress() -> None:
    async def body() -> None:
        kubelet = Kubelet()
        pods = PodNames(tracker_with("a"), lambda: SETTINGS, lister=kubelet)
        pods.want("a", ["GPU-x::0"])
        await in_thread(kubelet.asked)
        closing = asyncio.ensure_future(pods.close())
        kubelet.answers.put({"GPU-x::0": NEW})
        await asyncio.wait_for(closing, 10)
        assert pods.pending == frozenset()

    asyncio.run(body())
