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
from SneppX_ALG.checkpoint import manifest as manifest_codec
from SneppX_ALG.checkpoint import reshard, validate
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
        self._uses: dict[int, list[int]] = {}  # a committed step's manifest never changes: read once

    # -- the timeline --

    def stored_fence(self) -> timeline.Fence | None:
        """The fence record at the root: a fence whose steps are not all moved aside yet."""
        raw = self.store.read_root_file(timeline.FENCE_RECORD)
        if raw is None:
            return None
        return timeline.decode_fence(raw, where=f"{self.store.uri}/{timeline.FENCE_RECORD}")

    def stored_rollback(self) -> timeline.Fence | None:
        """The rollback record at the root: a writer restored an older step and has not saved since (or died
        before it did). Retention keeps the restored step and what it references; nothing is hidden."""
        raw = self.store.read_root_file(timeline.ROLLBACK_RECORD)
        if raw is None:
            return None
        return timeline.decode_fence(raw, where=f"{self.store.uri}/{timeline.ROLLBACK_RECORD}")

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

    def start_timeline(self, restored: int, fence: timeline.Fence | None, *, verified: bool = True) -> None:
        """A restore loaded step `restored` (`verified`: all of it, so it is valid, and the newest valid step
        once the steps the fence abandons are gone; a resharded load reads only part of it). The fence is
        applied before the next commit; it replaces one a previous restore made and no commit applied (None: no
        step is newer, nothing to fence)."""
        with self._lock:
            self._pending = fence
            if verified:
                self._known_valid = restored

    def fence_applied(self, fence: timeline.Fence) -> None:
        with self._lock:
            if self._pending == fence:
                self._pending = None
            if self._known_valid in fence.abandoned:
                self._known_valid = None
            for step in fence.abandoned:
                self._uses.pop(step, None)

    # -- validity --

    @property
    def known_valid(self) -> int | None:
        """The newest step this process read whole and found valid (and has not seen deleted since)."""
        with self._lock:
            return self._known_valid

    def forget(self, steps: list[int]) -> None:
        """Steps deleted or moved aside (their numbers may be saved again)."""
        with self._lock:
            if self._known_valid in steps:
                self._known_valid = None
            for step in steps:
                self._uses.pop(step, None)

    def uses(self, step: int) -> list[int]:
        """The earlier steps a committed step references (its manifest's `uses`; [] for a full step, a step that
        is gone, or one whose manifest is invalid: it references nothing that works). CheckpointUnreadableError
        when its manifest can't be read now: retention then deletes nothing."""
        with self._lock:
            if step in self._uses:
                return self._uses[step]

        def attempt() -> bytes | None:
            with self.store.read_step(step) as reader:
                return reader.read_file(storage.MANIFEST)

        try:
            raw = self._retrying(step, attempt)
        except (errors.CheckpointNotFoundError, errors.CheckpointFormatError):  # gone, or no manifest file to read
            return []
        try:
            found = manifest_codec.uses(manifest_codec.decode_manifest(raw or b"", step=step, where=str(step)))
        except errors.ManifestError:
            found = []
        with self._lock:
            self._uses[step] = found
        return found

    def check(self, step: int) -> tuple[dict[str, Any] | None, list[str]]:
        """(manifest, problems) of a committed step, as validate.check_step says. CheckpointNotFoundError
        when it is gone; CheckpointUnreadableError when it can't be read after READ_ATTEMPTS tries."""
        manifest, problems, _ = self._read(step, keep=False)
        return manifest, problems

    def load(self, step: int) -> tuple[dict[str, Any] | None, list[str], list[np.ndarray] | None]:
        """check(), reading every tensor in the same pass (validate.load_step): what is returned is what
        was checked."""
        return self._read(step, keep=True)

    def load_needed(self, step: int, needs: list[reshard.Need], stats: reshard.ReadStats,
                    ) -> tuple[dict[str, Any] | None, list[str], list[np.ndarray] | None]:
        """(manifest, problems, arrays) of the boxes `needs` ask for, reading only them and checking every
        byte read (checkpoint/reshard.py); a step saved before manifest version 3 is read whole and cut.
        Errors as check()'s; ShardingMismatchError when a need does not fit the step."""
        def attempt() -> tuple[dict[str, Any] | None, list[str], list[np.ndarray] | None]:
            with self.store.read_step(step) as reader:
                return reshard.load(reader, step, needs, self.trusted_keys, stats, self.store.read_step)

        manifest, problems, arrays = self._retrying(step, attempt)
        if manifest is not None and manifest["version"] < 3 and not problems:
            manifest, problems, whole = self._read(step, keep=True)
            if manifest is not None and whole is not None:
                arrays = reshard.whole_tensors_to_needs(manifest, whole, needs)
                stats.data += sum(t["nbytes"] for t in manifest["tensors"])
                stats.needed += sum(a.nbytes for a in arrays)
        return manifest, problems, arrays

    def _read(self, step: int, *, keep: bool,
              ) -> tuple[dict[str, Any] | None, list[str], list[np.ndarray] | None]:
        def attempt() -> tuple[dict[str, Any] | None, list[str], list[np.ndarray] | None]:
            with self.store.open_step(step) as local:  # referenced blocks: ranged reads, once the manifest checks
                if keep:
                    return validate.load_step(local, step, self.trusted_keys, self.store.read_step)
                return (*validate.check_step(local, step, self.trusted_keys, self.store.read_step), None)

        manifest, problems, arrays = self._retrying(step, attempt)
        if not problems:
            with self._lock:
                if self._known_valid is None or step > self._known_valid:
                    self._known_valid = step
        return manifest, problems, arrays

    def _retrying(self, step: int, attempt: Any) -> Any:
        """attempt(), retried with backoff while the step can't be read (an I/O error, not a verdict)."""
        for tries in range(READ_ATTEMPTS):
            try:
                return attempt()
            except errors.CheckpointNotFoundError:
                raise
            except (errors.StorageError, OSError) as e:  # can't read now (S3 fetches fail as StorageError)
                if tries + 1 == READ_ATTEMPTS:
                    code = getattr(e, "errno", None)
                    raise errors.CheckpointUnreadableError(
                        f"step {step} can't be read after {READ_ATTEMPTS} tries; it was not skipped: {e}",
                        step=step, path=self.store.uri, errno=code) from e
                delay = READ_BACKOFF_S * 2 ** tries
                log.warning("step %d can't be read now (%s); trying again in %.1f s", step, e, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

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
