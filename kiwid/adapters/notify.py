"""systemd service notifications: the only module that imports ``sdnotify``.

Every method is a no-op when ``NOTIFY_SOCKET`` is unset (kiwid not started by
systemd with ``Type=notify``). Sending is best effort, like ``sd_notify(3)``:
a failure is logged at WARNING and never raised, since systemd notices a
missing ``READY=1`` or ``WATCHDOG=1`` on its own.

``sdnotify`` already maps an abstract socket address (``@name``) to the
Linux abstract namespace. It encodes text as Latin-1, though, while systemd
expects UTF-8: messages are passed through :func:`_latin1_carrier` so that the
bytes on the wire are UTF-8.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import sdnotify

__all__ = ["Notifier"]

log = logging.getLogger(__name__)


class Notifier:
    """Sends ``sd_notify`` messages to the service manager.

    ``NOTIFY_SOCKET`` is read when the first message is sent; the connection is
    kept and retried on the next message after a failure. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._notifier: sdnotify.SystemdNotifier | None = None

    @property
    def enabled(self) -> bool:
        """Whether a service manager listens (``NOTIFY_SOCKET`` is set)."""
        return bool(os.environ.get("NOTIFY_SOCKET"))

    def ready(self, status: str | None = None) -> None:
        """Report that start-up or a reload finished (``READY=1``, optional ``STATUS=``).

        Args:
            status: Optional one-line status text sent in the same datagram.
        """
        self._send("READY=1" if status is None else f"READY=1\nSTATUS={_one_line(status)}")

    def reloading(self) -> None:
        """Report that a reload started.

        Sends one datagram ``RELOADING=1`` plus ``MONOTONIC_USEC=`` (``CLOCK_MONOTONIC``
        in microseconds), as ``Type=notify-reload`` requires; send :meth:`ready` when
        the reload is done.
        """
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self._send(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def stopping(self) -> None:
        """Report that shutdown started (``STOPPING=1``)."""
        self._send("STOPPING=1")

    def status(self, text: str) -> None:
        """Set the free-form status line ``systemctl status`` shows (``STATUS=``).

        Args:
            text: Status text; line breaks become spaces so it cannot inject fields.
        """
        self._send(f"STATUS={_one_line(text)}")

    def watchdog(self) -> None:
        """Pet the service watchdog (``WATCHDOG=1``)."""
        self._send("WATCHDOG=1")

    def watchdog_interval_s(self) -> float | None:
        """Return how often to call :meth:`watchdog`, in seconds.

        Returns:
            Half of ``WATCHDOG_USEC`` when it is set to a positive integer and
            ``WATCHDOG_PID`` is unset or names this process; ``None`` otherwise.
        """
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec.isdigit() or int(usec) == 0:
            return None
        if pid is not None and pid != str(os.getpid()):
            return None
        return int(usec) / 2 / 1_000_000

    def close(self) -> None:
        """Close the notification socket; a later message reconnects."""
        with self._lock:
            if self._notifier is not None and self._notifier.socket is not None:
                self._notifier.socket.close()
            self._notifier = None

    def _send(self, message: str) -> None:
        """Send one datagram, connecting first if needed; log failures."""
        if not self.enabled:
            return
        with self._lock:
            try:
                if self._notifier is None:
                    # debug=True: let sdnotify raise instead of swallowing errors.
                    self._notifier = sdnotify.SystemdNotifier(debug=True)
                self._notifier.notify(_latin1_carrier(message))
            except OSError as err:
                log.warning("sd_notify %r failed: %s", message.split("\n", 1)[0], err)
                if self._notifier is not None and self._notifier.socket is not None:
                    self._notifier.socket.close()
                self._notifier = None


def _one_line(text: str) -> str:
    """Replace line breaks so ``text`` stays one notification field."""
    return " ".join(text.splitlines())


def _latin1_carrier(message: str) -> str:
    """Return a string whose Latin-1 encoding is ``message``'s UTF-8 encoding."""
    return message.encode("utf-8").decode("latin-1")
