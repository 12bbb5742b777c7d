"""The committed steps as a coordinator sees them: the current timeline only, each validated the one way,
and read errors retried, then raised, never taken for a bad step.

Why a module of its own: `latest()` and `restore()` (the caller's thread) and retention and fencing (the
writer thread) must agree on which steps exist and which are valid. Two answers are kept apart here:
"read and found bad" is a verdict (the step is skipped and reported), "can't read now" (EIO, EMFILE, ESTALE,
a failed download) is not: it is retried with bounded backoff, then raised as CheckpointUnreadableError, so a
flaky disk or NFS server never makes training silently roll back past a good step.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from SneppX_ALG import errors, storage
from SneppX_ALG.checkpoint import validate
from SneppX_ALG.coordinator import timeline

log = logging.getLogger(__name__)

# A step that can't be read is tried this many times, sleeping READ_BACKOFF_S, then twice that, ... between
# tries (0.1 + 0.2 + 0.4 + 0.8: about 1.5 s in all) before CheckpointUnreadableError.
READ_ATTEMPTS = 5
READ_BACKOFF_S = 0.1


class Steps:
    """The steps of one root: which are visible (on the current timeline), and which validate."""

    def __init__(self, store: storage.Storage, trusted_keys: dict[bytes, Any] | None):
        self.store = store
        self.trusted_keys = trusted_keys
        self._lock = threading.Lock()
        self._known_valid: int | None = None
        self._pending: timeline.Fence | None = None

    # -- the timeline --

    def stored_fence(self) -> timeline.Fence | None:
        """The fence record at the root: a fence whose steps are not all moved aside yet."""
        raw = self.store.read_record(timeline.FENCE_RECORD)
        if raw is None:
            return None
        return timeline.decode_fence(raw, where=f"{self.store.uri}/{timeline.FENCE_RECORD}")

    def visible(self, *, include_pending: bool = True) -> list[int]:
        """Committed steps, oldest first, less those a fence abandoned: a stored one, and (include_pending)
        the one this process's last restore made, which the next commit applies."""
        # Listed before the record is read: a writer fencing meanwhile has either written its record (read
        # below) or moved the steps already (then opening them fails, and readers skip what is gone).
        committed = self.store.committed_steps()
        fences = [self.stored_fence()] + ([self.pending_fence()] if include_pending else [])
        abandoned = {step for fence in fences if fence is not None for step in fence.abandoned}
        return [s for s in committed if s not in abandoned]

    def pending_fence(self) -> timeline.Fence | None:
        with self._lock:
            return self._pending

    def start_timeline(self, restored: int, fence: timeline.Fence | None) -> None:
        """A restore loaded step `restored` (so it is valid, and the newest valid step once the steps the
        fence abandons are gone). The fence is applied before the next commit; it replaces one a previous
        restore made and no commit applied (None: no step is newer, nothing to fence)."""
        with self._lock:
            self._pending = fence
            self._known_valid = restored

    def fence_applied(self, fence: timeline.Fence) -> None:
        with self._lock:
            if self._pending == fence:
                self._pending = None
            if self._known_valid in fence.abandoned:
                self._known_valid = None

    # -- validity --

    @property
    def known_valid(self) -> int | None:
        """The newest step this process read whole and found valid (and has not seen deleted since)."""
        with self._lock:
            return self._known_valid

    def forget(self, steps: list[int]) -> None:
        with self._lock:
            if self._known_valid in steps:
                self._known_valid = None

    def check(self, step: int) -> tuple[dict[str, Any] | None, list[str]]:
        """(manifest, problems) of a committed step, as validate.check_step says. CheckpointNotFoundError
        when it is gone; CheckpointUnreadableError when it can't be read after READ_ATTEMPTS tries."""
        manifest, problems, _ = self._read(step, keep=False)
        return manifest, problems

    def load(self, step: int) -> tuple[dict[str, Any] | None, list[str], list[np.ndarray] | None]:
        """check(), reading every tensor in the same pass (validate.load_step): what is returned is what
        was checked."""
        return self._read(step, keep=True)

    def _read(self, step: int, *, keep: bool,
              ) -> tuple[dict[str, Any] | None, list[str], list[np.ndarray] | None]:
        for attempt in range(READ_ATTEMPTS):
            try:
                with self.store.open_step(step) as local:
                    if keep:
                        manifest, problems, arrays = validate.load_step(local, step, self.trusted_keys)
                    else:
                        (manifest, problems), arrays = validate.check_step(local, step, self.trusted_keys), None
                break
            except errors.CheckpointNotFoundError:
                raise
            except (errors.StorageError, OSError) as e:  # can't read now (S3 fetches fail as StorageError)
                if attempt + 1 == READ_ATTEMPTS:
                    code = getattr(e, "errno", None)
                    raise errors.CheckpointUnreadableError(
                        f"step {step} can't be read after {READ_ATTEMPTS} tries; it was not skipped: {e}",
                        step=step, path=self.store.uri, errno=code) from e
                delay = READ_BACKOFF_S * 2 ** attempt
                log.warning("step %d can't be read now (%s); trying again in %.1f s", step, e, delay)
                time.sleep(delay)
        if not problems:
            with self._lock:
                if self._known_valid is None or step > self._known_valid:
                    self._known_valid = step
        return manifest, problems, arrays

    def newest_valid(self, candidates: list[int]) -> tuple[int | None, dict[int, list[str]]]:
        """The newest of `candidates` that validates (checked newest first, until one does), and the
        problems of those checked before it."""
        rejected: dict[int, list[str]] = {}
        for step in sorted(candidates, reverse=True):
            try:
                problems = self.check(step)[1]
            except errors.CheckpointNotFoundError:
                continue
            if not problems:
                return step, rejected
            rejected[step] = problems
        return None, rejected
