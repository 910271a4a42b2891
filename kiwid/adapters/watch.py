"""Config-file watching: the only module that imports ``watchdog``.

:class:`ConfigWatcher` watches the config file's *parent directory*, so that
every way of saving is seen: writing in place, writing a temporary file and
renaming it over the config (Ansible's ``template``, most editors), renaming
the original away and writing a new file (vim), or deleting and recreating.
Bursts of events pass through the pure :class:`Debouncer` and become one
``on_change()`` call on a background thread.

Events that cannot change the content (the file being opened, or closed
after reading, e.g. by kiwid's own reload) are ignored, or a reload would
trigger itself.

A clean stop logs nothing at ERROR: watchdog's own false alarm at stop time is
filtered out (see :class:`_QuietStop`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from watchdog.events import (
    EVENT_TYPE_ATTRIB,
    EVENT_TYPE_CLOSED,
    EVENT_TYPE_CREATED,
    EVENT_TYPE_DELETED,
    EVENT_TYPE_MODIFIED,
    EVENT_TYPE_MOVED,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

__all__ = ["ConfigWatcher", "Debouncer", "WatchError"]

log = logging.getLogger(__name__)

# What watchdog's inotify emitter logs, at ERROR, when it loses a race with its own
# stop (see _QuietStop); its logger is named after its module.
_INOTIFY_LOGGER = "watchdog.observers.inotify"
_STOP_RACE_MESSAGE = "InotifyEmitter.queue_events() called when the thread is inactive"

_CONTENT_EVENTS = frozenset(
    {
        EVENT_TYPE_ATTRIB,  # `touch` to force a reload
        EVENT_TYPE_CLOSED,  # closed after writing
        EVENT_TYPE_CREATED,
        EVENT_TYPE_DELETED,
        EVENT_TYPE_MODIFIED,
        EVENT_TYPE_MOVED,
    }
)


class WatchError(Exception):
    """The config file's directory cannot be watched (missing, or inotify failed)."""


class Debouncer:
    """Collapses a burst of events into one, once the burst has been quiet a while.

    Pure: the caller passes the time in (monotonic seconds).

    Args:
        quiet_s: How long no event may arrive before the burst counts as over, in seconds.

    Raises:
        ValueError: ``quiet_s`` is negative.
    """

    def __init__(self, quiet_s: float = 0.2) -> None:
        if quiet_s < 0:
            raise ValueError(f"quiet_s must be >= 0, got {quiet_s}")
        self._quiet_s = quiet_s
        self._deadline: float | None = None

    def feed(self, now: float) -> None:
        """Record an event at ``now``; this restarts the quiet period.

        Args:
            now: Monotonic time of the event, in seconds.
        """
        self._deadline = now + self._quiet_s

    def due(self, now: float) -> bool:
        """Return True once per burst, when its quiet period has passed at ``now``.

        A True answer consumes the burst: the next call returns False until
        :meth:`feed` starts a new one.

        Args:
            now: Monotonic time, in seconds.

        Returns:
            Whether the burst is over and should be acted on now.
        """
        if self._deadline is None or now < self._deadline:
            return False
        self._deadline = None
        return True

    def deadline(self) -> float | None:
        """Return when the pending burst becomes due, or ``None`` when none is pending."""
        return self._deadline


class _Handler(FileSystemEventHandler):
    """Forwards watchdog events about one file to a callback."""

    def __init__(self, path: str, on_event: Callable[[], None]) -> None:
        self._path = path
        self._on_event = on_event

    def on_any_event(self, event: FileSystemEvent) -> None:
        """Call back when ``event`` may have changed the watched file's content."""
        if event.is_directory or event.event_type not in _CONTENT_EVENTS:
            return
        if self._path in (os.fsdecode(event.src_path), os.fsdecode(event.dest_path)):
            self._on_event()


class _QuietStop(logging.Filter):
    """Drops watchdog's stop-race message, from the given emitter threads only.

    watchdog 7.1 stops an emitter in ``BaseThread.stop()``: it sets the stop flag,
    then drops the emitter's inotify watch group without the lock its read loop
    takes. An emitter thread that passed its loop's ``should_keep_running()`` check
    just before (an event had just arrived: kiwid's own log file, a neighbour in
    /etc) then finds no watch group and logs this message at ERROR, though nothing
    is wrong and the thread ends as it should. Every public way to stop an emitter
    (``Observer.stop()``, ``unschedule()``, ``unschedule_all()``) goes through that
    ``stop()``, so no order of calls avoids it; the only other cure would be a
    subclass of ``InotifyEmitter`` rewriting its read loop over private attributes.
    So this filter sits on watchdog's inotify logger for the length of one
    :meth:`ConfigWatcher.stop`, and drops exactly that message, from exactly the
    emitter threads being stopped: the same message at any other time, or from any
    other thread, still reaches the log.
    """

    def __init__(self, threads: set[int]) -> None:
        super().__init__()
        self._threads = threads

    def filter(self, record: logging.LogRecord) -> bool:
        """Return False for the stop-race message from a stopping emitter thread."""
        return not (record.thread in self._threads and record.msg == _STOP_RACE_MESSAGE)


class ConfigWatcher:
    """Calls ``on_change()`` after the config file changed and then stayed quiet.

    ``on_change`` runs on the watcher's own thread; an asyncio daemon should hand
    it to its loop with ``loop.call_soon_threadsafe``. An exception it raises is
    logged and the watcher goes on. A symlinked config file is not followed.

    Args:
        path: The config file; it need not exist, its parent directory must.
        on_change: Called with no arguments once per burst of changes.
        debounce_s: Quiet period that ends a burst, in seconds.

    Raises:
        ValueError: ``debounce_s`` is negative.
    """

    def __init__(
        self,
        path: Path,
        on_change: Callable[[], None],
        debounce_s: float = 0.2,
    ) -> None:
        self._path = Path(os.path.abspath(path))  # noqa: PTH100 - resolve() would follow links
        self._on_change = on_change
        self._debouncer = Debouncer(debounce_s)
        self._wakeup = threading.Condition()
        self._stopping = False
        self._observer: BaseObserver | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start watching.

        Raises:
            WatchError: The parent directory does not exist or cannot be watched.
            RuntimeError: The watcher was already started.
        """
        if self._thread is not None:
            raise RuntimeError("ConfigWatcher already started")
        observer = Observer()
        observer.schedule(_Handler(str(self._path), self._feed), str(self._path.parent))
        try:
            observer.start()
        except OSError as err:
            raise WatchError(f"cannot watch {self._path.parent}: {err}") from err
        self._observer = observer
        self._thread = threading.Thread(target=self._run, name="kiwid-config-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop watching; a pending burst is dropped. Safe to call more than once.

        Args:
            timeout_s: How long to wait for each background thread to end, in seconds.
        """
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify_all()
        if self._observer is not None:
            threads = {e.ident for e in self._observer.emitters if e.ident is not None}
            quiet = _QuietStop(threads)
            inotify_log = logging.getLogger(_INOTIFY_LOGGER)
            inotify_log.addFilter(quiet)
            try:
                # Observer.stop() stops and joins its emitters before it returns:
                # after it, none of them logs again.
                self._observer.stop()
                self._observer.join(timeout_s)
            finally:
                inotify_log.removeFilter(quiet)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _feed(self) -> None:
        """Record an event (watchdog's thread) and wake the debounce thread."""
        with self._wakeup:
            self._debouncer.feed(time.monotonic())
            self._wakeup.notify_all()

    def _run(self) -> None:
        """Wait for bursts to end and call ``on_change`` once per burst."""
        while True:
            with self._wakeup:
                while not self._stopping and not self._debouncer.due(time.monotonic()):
                    deadline = self._debouncer.deadline()
                    self._wakeup.wait(None if deadline is None else deadline - time.monotonic())
                if self._stopping:
                    return
            try:
                self._on_change()
            except Exception:
                log.exception("config change callback failed")
