"""Pod names from the kubelet's PodResources API, for containers kiwi-hook registered.

kiwi-hook passes a container's pod, namespace and name when the runtime's
annotations carry them (containerd and CRI-O do), and on Kubernetes the device IDs
that Kiwi's device plugin gave it. When the names are missing, `PodNames` asks the
kubelet's PodResources API (``kubernetes.pod_resources_socket``) which pod and
container hold those device IDs, and gives the tenant those names; annotations,
when present, always win.

The kubelet is asked off the loop (a thread, bounded by the adapter's timeout), at
most once per `MIN_GAP_S`: one answer serves every container registered before it
was asked. An answer is not reused for containers registered later, because a slot
that a finished pod freed may already be another pod's. A container the kubelet
does not (yet) list, or a kubelet that is down or lacks the API, is asked about
again with a backoff up to `RETRY_MAX_S`, until it is found, unregistered, or
`GIVE_UP_S` old. Nothing waits for the kubelet: the container is scheduled all
along, only its names come later.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from kiwid.adapters.podresources import ContainerRef, PodResourcesError, list_owners
from kiwid.config.schema import KubernetesSettings
from kiwid.daemon.tenants.tracker import TenantTracker

__all__ = ["GIVE_UP_S", "MIN_GAP_S", "RETRY_MAX_S", "Lister", "PodNames"]

log = logging.getLogger("kiwid.pods")

MIN_GAP_S = 0.5
"""Seconds between two questions to the kubelet, however many containers arrive."""
RETRY_MAX_S = 30.0
"""The longest wait, seconds, before asking again about containers not yet found."""
GIVE_UP_S = 600.0
"""Seconds after its registration when a container not found is no longer asked about."""

Lister = Callable[[str, str], Mapping[str, ContainerRef]]
"""(socket, resource) -> device ID -> container; raises `PodResourcesError`."""


@dataclass(frozen=True)
class _Wanted:
    device_ids: tuple[str, ...]
    since: float  # monotonic seconds: when it registered


class PodNames:
    """Fills in the pod names of registered containers from their device IDs.

    Args:
        tracker: The tenant table whose registered containers get the names.
        settings: Returns the ``[kubernetes]`` settings in force (socket, resource).
        lister: Asks the kubelet (`kiwid.adapters.podresources.list_owners`).
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        tracker: TenantTracker,
        settings: Callable[[], KubernetesSettings],
        *,
        lister: Lister = list_owners,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tracker = tracker
        self._settings = settings
        self._lister = lister
        self._clock = clock
        self._wanted: dict[str, _Wanted] = {}
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._asked_at = -MIN_GAP_S
        self._last_error: str | None = None
        self.questions = 0
        """How many times the kubelet was asked (for tests and logs)."""

    @property
    def pending(self) -> frozenset[str]:
        """The tenants whose pod is still being looked for."""
        return frozenset(self._wanted)

    def want(self, key: str, device_ids: Collection[str]) -> bool:
        """Look for a registered container's pod by its device IDs, soon and off the loop.

        Args:
            key: The container's tenant key.
            device_ids: The device plugin's slots it was given.

        Returns:
            Whether it will be looked for (not without device IDs or a socket).
        """
        if not device_ids or not self._settings().pod_resources_socket:
            return False
        self._wanted[key] = _Wanted(tuple(device_ids), self._clock())
        self._kick.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._work())
        return True

    def forget(self, key: str) -> None:
        """Stop looking for an unregistered container's pod."""
        self._wanted.pop(key, None)

    async def close(self) -> None:
        """Stop looking (a question in flight ends within the adapter's timeout)."""
        self._wanted.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _work(self) -> None:
        delay = MIN_GAP_S
        while self._wanted:
            gap = self._asked_at + MIN_GAP_S - self._clock()
            if gap > 0:
                await asyncio.sleep(gap)
            self._kick.clear()
            asked_at = self._asked_at = self._clock()
            owners = await self._ask()
            if owners is not None:
                self._match(owners, asked_at)
            self._give_up(self._clock())
            if not self._wanted:
                return
            if not self._kick.is_set():  # nobody new: back off until someone is
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._kick.wait(), delay)
                delay = min(delay * 2, RETRY_MAX_S)

    async def _ask(self) -> Mapping[str, ContainerRef] | None:
        settings = self._settings()
        if not settings.pod_resources_socket:  # turned off by a reload
            self._wanted.clear()
            return None
        self.questions += 1
        try:
            owners = await asyncio.to_thread(
                self._lister, settings.pod_resources_socket, settings.resource
            )
        except PodResourcesError as err:
            if err.status != self._last_error:
                log.warning("No pod names from the kubelet for now: %s", err)
                self._last_error = err.status
            return None
        if self._last_error is not None:
            log.info("The kubelet's PodResources API answers again")
            self._last_error = None
        return owners

    def _match(self, owners: Mapping[str, ContainerRef], asked_at: float) -> None:
        for key, wanted in list(self._wanted.items()):
            if wanted.since > asked_at:
                continue  # registered after the question: the answer may predate it
            ref = next((owners[d] for d in wanted.device_ids if d in owners), None)
            if ref is None:
                continue
            del self._wanted[key]
            self._name(key, ref)

    def _name(self, key: str, ref: ContainerRef) -> None:
        reg = self._tracker.registered.get(key)
        if reg is None or reg.identity.pod:
            return
        identity = dataclasses.replace(
            reg.identity,
            name=ref.container,
            pod=ref.pod,
            namespace=ref.namespace,
            identity_source="podresources",
        )
        if self._tracker.update_identity(key, identity):
            log.info(
                "Container %s is %s in pod %s/%s (kubelet PodResources)",
                reg.container_id,
                ref.container,
                ref.namespace,
                ref.pod,
            )

    def _give_up(self, now: float) -> None:
        for key, wanted in list(self._wanted.items()):
            if now - wanted.since >= GIVE_UP_S:
                del self._wanted[key]
                log.info(
                    "No pod holds devices %s of tenant %s after %.0f s; it keeps its name",
                    ",".join(wanted.device_ids),
                    key,
                    GIVE_UP_S,
                )
