"""One loop per job, woken when something it depends on changes.

Why: each job is reconciled by one loop (an asyncio task), so its passes never overlap and never decide a
restart twice. Watch events for the job, its pods, their nodes and its rendezvous object arrive in kopf's event
handlers (handlers.py); they `poke` the job, and its loop wakes at once instead of at the next resync. The
loops are our own tasks rather than kopf daemons because a kopf daemon puts a finalizer on its object, and a
finalizer makes deleting a job hang whenever no operator serves its namespace. Everything here runs on kopf's
event loop: a waiting job holds no thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

Key = tuple[str, str]  # (namespace, job name)
log = logging.getLogger(__name__)


class JobLoops:
    """A task and a wake-up event per job; a poke before the loop waits is not lost (the event stays set)."""

    def __init__(self) -> None:
        self._events: dict[Key, asyncio.Event] = {}
        self._tasks: dict[Key, asyncio.Task[None]] = {}

    def _event(self, key: Key) -> asyncio.Event:
        return self._events.setdefault(key, asyncio.Event())

    def ensure(self, key: Key, run: Callable[[Key], Coroutine[Any, Any, None]]) -> None:
        """Start the job's loop unless it runs."""
        task = self._tasks.get(key)
        if task is None or task.done():
            self._tasks[key] = asyncio.get_running_loop().create_task(run(key), name=f"job {key[0]}/{key[1]}")

    def poke(self, key: Key) -> None:
        self._event(key).set()

    def poke_all(self) -> None:
        for key in list(self._tasks):
            self.poke(key)

    async def wait(self, key: Key, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a poke; True if poked."""
        event = self._event(key)
        try:
            await asyncio.wait_for(event.wait(), max(0.0, timeout))
        except TimeoutError:
            return False
        event.clear()
        return True

    def forget(self, key: Key) -> None:
        """The job is gone: its loop ends (called by the loop itself, or on a DELETED event)."""
        task = self._tasks.pop(key, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        self._events.pop(key, None)

    async def stop_all(self) -> None:
        """Ends every job's loop. Loops of another event loop (an operator of this process that stopped without
        its cleanup: kopf's test runner starts one per test module) are dropped: they can't be awaited here, and
        their loop runs no more."""
        current = asyncio.get_running_loop()
        tasks = [t for t in self._tasks.values() if t.get_loop() is current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._events.clear()
