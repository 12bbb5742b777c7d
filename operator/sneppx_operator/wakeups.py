"""Wake a job's reconcile loop when something it depends on changes.

Why: each job is reconciled by one loop (a kopf daemon in handlers.py), so its passes never overlap and never
count a restart twice. Watch events for the job, its pods, their nodes and its rendezvous object arrive in
other handlers; they `poke` the job, and its loop wakes at once instead of at the next resync.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

Key = tuple[str, str]  # (namespace, job name)


class Wakeups:
    """One event per job; a poke before the loop waits is not lost (the event stays set)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[Key, threading.Event] = {}

    def _event(self, key: Key) -> threading.Event:
        with self._lock:
            return self._events.setdefault(key, threading.Event())

    def poke(self, key: Key) -> None:
        self._event(key).set()

    def wait(self, key: Key, timeout: float, stopped: Callable[[], bool], slice_s: float = 0.5) -> bool:
        """Wait up to `timeout` seconds for a poke; True if poked. Checks `stopped` every `slice_s` seconds
        (kopf's stop flag has no hook to set our event)."""
        event = self._event(key)
        remaining = max(0.0, timeout)
        while not stopped():
            if event.wait(min(slice_s, remaining)):
                event.clear()
                return True
            remaining -= slice_s
            if remaining <= 0:
                return False
        return False

    def forget(self, key: Key) -> None:
        with self._lock:
            self._events.pop(key, None)
