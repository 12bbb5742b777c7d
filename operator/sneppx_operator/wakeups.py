"""Wake a job's reconcile loop when something it depends on changes.

Why: each job is reconciled by one loop (a kopf daemon in handlers.py), so its passes never overlap and never
count a restart twice. Watch events for the job, its pods, their nodes and its rendezvous object arrive in
other handlers; they `poke` the job, and its loop wakes at once instead of at the next resync. Everything here
runs on kopf's event loop (asyncio): a waiting job holds no thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

Key = tuple[str, str]  # (namespace, job name)


class Wakeups:
    """One event per job; a poke before the loop waits is not lost (the event stays set)."""

    def __init__(self) -> None:
        self._events: dict[Key, asyncio.Event] = {}

    def _event(self, key: Key) -> asyncio.Event:
        return self._events.setdefault(key, asyncio.Event())

    def poke(self, key: Key) -> None:
        self._event(key).set()

    async def wait(self, key: Key, timeout: float, stopped: Callable[[], bool], slice_s: float = 0.5) -> bool:
        """Wait up to `timeout` seconds for a poke; True if poked. Looks at `stopped` every `slice_s` seconds
        (kopf's stop flag has no hook to set our event)."""
        event = self._event(key)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        while not stopped():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(event.wait(), min(slice_s, remaining))
            except TimeoutError:
                continue
            event.clear()
            return True
        return False

    def forget(self, key: Key) -> None:
        self._events.pop(key, None)
