"""Wake a parked tenant when a request waits on one of its sockets.

A parked tenant is idle with its memory in host RAM, gated and out of the queue
(kiwid.core.parking). Each poll reads the sockets of every parked tenant through
the kernel's socket diagnostics (kiwid.adapters.sockets) and asks the core to wake
those a client waits on: a connection in the accept queue of a socket it listens
on, unread bytes on a connection to it, or, when its processes run (the CUDA lock
gates the GPU side only, the CPU side answers), a request read and not answered for
longer than :data:`UNANSWERED_AFTER_S`. A connection the tenant opened itself (a
database's reply) wakes nobody: its own client is not waiting on it.

Which sockets each parked tenant listens on is kept here for status
(``wakes_on``); the core owns whether a tenant is parked and why it woke.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Set
from dataclasses import dataclass, field

from kiwid.adapters import sockets
from kiwid.core.events import WakeAsked
from kiwid.core.parking import REQUEST

log = logging.getLogger("kiwid")

UNANSWERED_AFTER_S = 0.05
"""How long a request a running (lock-gated) tenant read may go unanswered before it
counts as waiting: longer than a health check's answer takes, far shorter than a poll."""


@dataclass
class Waker:
    """What the last reads of the parked tenants' sockets found."""

    wakes_on: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per parked tenant, where it accepts connections (``"tcp 0.0.0.0:8000"``)."""
    trouble: dict[str, str] = field(default_factory=dict)
    """Per parked tenant, why its sockets could not be read (logged once)."""

    def events(self, parked: Mapping[str, Set[int]], frozen: Set[str]) -> list[WakeAsked]:
        """Read the parked tenants' sockets; wake those a client waits on.

        ``parked`` maps each parked tenant to its processes; ``frozen`` names those
        whose processes the freezer holds (their requests wait in the queues).
        """
        for key in [k for k in self.wakes_on if k not in parked]:
            del self.wakes_on[key]
        for key in [k for k in self.trouble if k not in parked]:
            del self.trouble[key]
        if not parked:
            return []
        found = sockets.probe_many(
            parked,
            frozen={key: key in frozen for key in parked},
            unanswered_after_s=UNANSWERED_AFTER_S,
        )
        wakes: list[WakeAsked] = []
        for key, answer in found.items():
            if isinstance(answer, sockets.SocketDiagError):
                if self.trouble.get(key) != str(answer):
                    log.warning(
                        "Cannot read the sockets of parked %s (%s): only `kiwictl wake` "
                        "wakes it until they can be read",
                        key,
                        answer,
                    )
                self.trouble[key] = str(answer)
                continue
            if self.trouble.pop(key, None) is not None:
                log.info("The sockets of parked %s can be read again", key)
            self.wakes_on[key] = tuple(str(where) for where in answer.listening)
            waiting = [w for w in answer.waiting if w.inbound]
            if waiting:
                first = waiting[0]
                wakes.append(WakeAsked(key, REQUEST, f"{first.socket}: {first.detail}"))
        return wakes
