"""Carrying jobs out on threads, and telling the engine on the loop when each is done."""

from __future__ import annotations

import asyncio
import threading

from kiwid.core.events import Event
from kiwid.daemon.engine.engine import Engine, EngineFailed
from kiwid.daemon.engine.executor import Job


class ThreadRunner:
    """Carries each job out on a thread of its own and reports back on the loop.

    A thread per job: jobs are few (a hand-over makes a handful), and no job can
    then wait for a worker behind another job's 30-second swap. The threads are
    daemon threads: a stuck driver call cannot keep kiwid from exiting.
    """

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        """Report to ``engine`` on ``loop``."""
        self._engine = engine
        self._loop = loop

    def start(self, job: Job) -> None:
        """Run ``job`` on a new thread."""
        threading.Thread(
            target=self._run, args=(job,), name=f"kiwid-{job.kind.value}", daemon=True
        ).start()

    def _run(self, job: Job) -> None:
        events = self._engine.effects.carry_out(job)
        try:
            self._loop.call_soon_threadsafe(self._report, job, events)
        except RuntimeError:  # the loop is closed: kiwid is exiting
            return

    def _report(self, job: Job, events: list[Event]) -> None:
        """Hand the job's outcome to the engine (on the loop); a failure there stops kiwid."""
        try:
            self._engine.finished(job, events)
        except EngineFailed:
            return  # logged, and the daemon told, where it failed

    async def wait_idle(self) -> None:
        """Return once no job runs."""
        while self._engine.executor.running:
            done = asyncio.Event()
            self._engine.on_idle(done.set)
            if not self._engine.executor.running:
                break
            await done.wait()
