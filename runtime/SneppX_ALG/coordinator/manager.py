"""CheckpointCoordinator: periodic, asynchronous, crash-consistent checkpoints with retention.

Why it exists: a training loop wants `coord.save(model, step)` to cost about one memory copy, never a disk or
network write, and it wants whatever it finds after a crash to be a whole checkpoint. So a save is split:

1. **Snapshot** (snapshot.py, on the caller's thread; `save()` returns after it): the state is copied into staging
   buffers by the native copy engine (plain threads on the CPU; pinned memory, its own CUDA stream and one
   event per piece for GPU tensors), and the CRC32C of every piece is taken as it lands.
2. **Persist** (engine.py, one background thread): each staging buffer is streamed into an SNPX shard file, the CRC
   the writer computes is checked against the snapshot's (staging memory can't silently change bytes),
   the buffer goes back to the pool, and at the end the step is committed through `storage` (local rename
   or S3 marker with If-None-Match) and retention runs.

Staging memory is bounded (`staging_bytes`) and multi-buffered: when the state is larger than the staging
area, `save()` fills the free buffers while the writer drains full ones, and returns once the last piece is
copied. A tensor larger than one buffer is split into row blocks (or flat ranges), which the manifest joins
again. CPU snapshots copy rather than fork (copy-on-write); docs/BENCHMARKS.md has the measurement.

Errors from the background are kept and raised by the next `save()`, `wait()` or `close()`.

Call order (one process, or one coordinator per rank without a group: each saves its own root):

    coord = CheckpointCoordinator(checkpoint_root="/ckpts", save_every_n_steps=1000, max_to_keep=5)
    info = coord.restore(model)            # None on a fresh start; else .step and .training_state
    for step in ...:
        if coord.should_save(step):
            coord.save(model, step=step, training_state={"data_position": pos})
    coord.close()                          # or use `with CheckpointCoordinator(...) as coord:`

A group of ranks saving one sharded checkpoint (docs/FORMAT.md, "Sharded steps"): every rank makes a
coordinator on the same root with `group=` (a ProcessGroup, or anything with coordinator.Group's shape) and
calls the same methods in the same order; `Shard(array, global_shape, global_offset)` marks its piece of a
tensor, a plain array is replicated (every rank holds it; one rank writes it):

    ckpt_group = ProcessGroup(store, rank, world, generation, key=key)   # used by the coordinator only
    coord = CheckpointCoordinator("/ckpts", save_every_n_steps=100, group=ckpt_group)
    info = coord.restore(trainer)          # ALL ranks; any world size saved it; trainer.sharded_state_dict()
    ...                                    #   names what this rank needs, load_sharded_state_dict() takes it
    if coord.should_save(step):            # ALL ranks, same step
        coord.save(trainer, step=step)     # each rank snapshots its part and returns; the ranks' writers
                                           #   meet in the background, rank 0 commits once all are durable
    coord.close()                          # ALL ranks: waits; a failure on any rank is raised on every rank

Rank 0 alone cleans up at start, commits, fences and applies retention; latest(), validate() and
committed_steps() are local (no collectives) and may be called by any rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any, Self

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ed25519

from SneppX_ALG import _native, errors, storage
from SneppX_ALG.checkpoint import manifest as manifest_codec
from SneppX_ALG.checkpoint import reshard, signing
from SneppX_ALG.coordinator import (
    engine,
    increments,
    plan,
    retention,
    snapshot,
    state,
    steps,
    timeline,
    upkeep,
)
from SneppX_ALG.coordinator import group as group_lib
from SneppX_ALG.coordinator import job as job_lib

log = logging.getLogger(__name__)


# ---- the public API -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint that validated: its step, where it is, and the training state saved with it."""

    step: int
    location: str
    training_state: Any
    manifest: dict[str, Any]
    read: reshard.ReadStats | None = None  # what a resharded restore read (None: the step was read whole)


@dataclasses.dataclass(frozen=True)
class SkippedCheckpoint:
    """A committed step that failed validation, and why (reported by latest() and restore())."""

    step: int
    problems: tuple[str, ...]


class CheckpointCoordinator:
    """Saves checkpoints every N steps in the background and finds the newest valid one after a crash.

    checkpoint_root: a local directory (disk, PVC, NFS) or `s3://bucket/prefix` (boto3; endpoint and
        credentials from the AWS environment variables, or pass `s3_client`).
    save_every_n_steps: what should_save() answers (None: never).
    max_to_keep: newest committed steps to keep (None: all); keep_every_n_steps: also keep multiples of it.
    async_save: False makes save() return only once the step is committed.
    staging_bytes: host memory for the snapshot (default 1 GiB). States up to this size make save() cost one
        copy; larger states stream through it, so save() returns when the rest is written.
    device: "auto" (pinned staging and GPU copies when a CUDA device is usable), "cpu", or a CUDA device index.
    cleanup_on_start: remove what crashed saves left (temp directories, incomplete S3 uploads, objects of steps
        without a marker) whose writer is provably gone: safe with other coordinators saving to the same root
        (storage/lease.py). Default: on, except with read_only; in a group, rank 0 alone cleans up.
    read_only: a reader (an evaluator, a tool): never cleans up and never saves (save() raises
        ReadOnlyCoordinatorError); latest(), restore() and validate() work as usual.
    signing_key: an Ed25519 private key (or an unencrypted PEM path): every step is signed, a detached `manifest.sig`
        over manifest.json (which lists each shard's size and BLAKE3 digest) written before the commit point.
        Without it, steps are saved without shard digests (they cost a read-back of every shard) and can't be
        signed later.
    trusted_keys: public keys (objects, PEM paths or bytes; see signing.trusted_key_set): latest(), restore()
        and validate() then also require a signature by one of them and every shard to match its digest, and
        treat a step that fails like any invalid step (skipped, reported in `skipped`, rolled back past).
        None (the default): signatures are not checked.
    group: the ranks that save and restore this root together (coordinator.Group: a collectives.ProcessGroup
        fits): each rank writes its own shard file, rank 0 commits once every rank's file is durable, and a
        restore loads, at any world size, only what each rank's Shards and arrays ask for. With
        async_save, the writer thread runs the group's collectives while training goes on, so pass a group
        that nothing else uses (a second ProcessGroup of the generation, as torch DCP's async_save wants a
        group of its own); its timeout bounds how long ranks wait for the slowest rank's write. None: this
        process alone (world size 1).
    checksum_block_bytes: the size of the blocks each chunk's CRC32C is taken per (a power of two, 4 KiB to
        64 MiB), so a resharded load reads whole blocks only where it needs part of a chunk. Smaller blocks
        read less beyond what is needed and make a larger manifest (8 hex digits per block, 72 when signed).
        None (the default): 256 KiB, and for a state over 128 GiB the power of two that cuts it into at most 2^17
        blocks (incremental pieces are then one block each), so its manifest stays far below what readers accept
        (docs/FORMAT.md, "How large a state fits").
    commit_fence: called by the committing rank right before each step's commit point; whatever it raises
        fails the step instead (the ElasticTrainer's workers pass the rendezvous fence, `elastic.rendezvous.fence.check`,
        so a membership generation that is over commits nothing).
    incremental: "auto" (the default), True or False. On, a save writes only the pieces (1 MiB boxes of each
        array) whose bytes changed since this coordinator's previous save, and references the rest in the step
        that holds them (compared by CRC32C and BLAKE3 per checksum block; docs/FORMAT.md, "Incremental
        steps"). "auto" stops comparing for the rest of a chain once a save finds less than 1/8 of its bytes
        unchanged. Retention keeps every step a kept step references. The first save after a restore continues
        the restored step's chain (it may reference what that step holds or references), unless the step was
        saved at another world size or without block digests: then it is full.
    full_every: every full_every-th save of a chain is full (default 10, at most 1001), so a damaged step can spoil
        at most the full_every - 1 saves after it. The save after a CommittedStepInvalidError (the read-back found
        a referenced block changed) or a ReferencedStepGoneError is full too, as is one whose chain a gc deleted.
    """

    def __init__(self, checkpoint_root: str | os.PathLike[str], save_every_n_steps: int | None = None,
                 max_to_keep: int | None = 5, async_save: bool = True, *, keep_every_n_steps: int | None = None,
                 staging_bytes: int = plan.DEFAULT_STAGING_BYTES, device: str | int = "auto", copy_threads: int = 0,
                 s3_client: Any = None, staging_dir: str | None = None, cleanup_on_start: bool | None = None,
                 signing_key: Any = None, trusted_keys: Any = None, read_only: bool = False,
                 group: group_lib.Group | None = None,
                 checksum_block_bytes: int | None = None,
                 commit_fence: Callable[[], None] | None = None, incremental: bool | str = increments.AUTO,
                 full_every: int = 10):
        if incremental not in (True, False, increments.AUTO):
            raise ValueError(f"incremental must be True, False or 'auto', not {incremental!r}")
        if (not isinstance(full_every, int) or isinstance(full_every, bool)
                or not 1 <= full_every <= manifest_codec.MAX_USES + 1):
            raise ValueError(f"full_every must be an int from 1 to {manifest_codec.MAX_USES + 1} (a manifest "
                             f"references at most {manifest_codec.MAX_USES} earlier steps), not {full_every!r}")
        for name, value in (("save_every_n_steps", save_every_n_steps), ("max_to_keep", max_to_keep),
                            ("keep_every_n_steps", keep_every_n_steps)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative int or None, not {value!r}")
        if read_only and cleanup_on_start:
            raise ValueError("a read_only coordinator never cleans up: drop cleanup_on_start")
        if staging_bytes < 2 * 4096:
            raise ValueError(f"staging_bytes must be at least 8 KiB, not {staging_bytes}")
        block = checksum_block_bytes
        if block is not None and not (isinstance(block, int) and manifest_codec.MIN_BLOCK_BYTES <= block
                                      <= manifest_codec.MAX_BLOCK_BYTES and block & (block - 1) == 0):
            raise ValueError(f"checksum_block_bytes must be a power of two from {manifest_codec.MIN_BLOCK_BYTES} to "
                             f"{manifest_codec.MAX_BLOCK_BYTES}, not {block}")
        if group is not None and not isinstance(group, group_lib.Group):
            raise TypeError(f"group must have rank, world_size, generation, allgather and broadcast (a "
                            f"ProcessGroup), not a {type(group).__name__}")
        self.group: group_lib.Group = group if group is not None else group_lib.SOLO
        self.checkpoint_root = os.fspath(checkpoint_root)
        self.save_every_n_steps = save_every_n_steps
        self.max_to_keep = max_to_keep
        self.keep_every_n_steps = keep_every_n_steps
        self.async_save = async_save
        self.staging_bytes = staging_bytes
        self.read_only = read_only
        self.skipped: list[SkippedCheckpoint] = []
        self.last_saved_step: int | None = None
        self._signing_key = _private_key(signing_key)
        self._trusted_keys = None if trusted_keys is None else signing.trusted_key_set(trusted_keys)
        if self._trusted_keys is not None and not self._trusted_keys:
            raise errors.KeyFormatError("trusted_keys is empty: no step could ever verify (pass None to not "
                                        "check signatures)")
        if (self._signing_key is not None and self._trusted_keys is not None
                and signing.key_id(self._signing_key) not in self._trusted_keys):
            raise errors.SigningKeyNotTrustedError(
                f"signing_key (key id {signing.key_id_hex(self._signing_key)}) is not among trusted_keys: every "
                "step this coordinator saved would fail its own validation, and retention would have no valid "
                "step to keep. Add its public key to trusted_keys (after a key rotation, keep the old one too).")
        self._storage = storage.open_storage(self.checkpoint_root, s3_client=s3_client, staging_dir=staging_dir)
        if (cleanup_on_start if cleanup_on_start is not None else not read_only) and self.group.rank == 0:
            for leftover in self._storage.cleanup():
                log.info("removed leftover of an interrupted save: %s", leftover)
        self._copier = self._make_copier(device, copy_threads)
        self._lock = threading.Lock()
        self._closed = False
        self._steps = steps.Steps(self._storage, self._trusted_keys)
        self._engine = engine.Engine(self._steps, max_to_keep, keep_every_n_steps, self._signing_key, self.group,
                                     checksum_block_bytes, commit_fence, incremental, full_every)
        self._finalizer = weakref.finalize(self, self._engine.shutdown)

    @staticmethod
    def _make_copier(device: str | int, threads: int) -> _native.Copier:
        if device == "cpu":
            return _native.Copier(-1, threads=threads)
        if device == "auto":
            return _native.Copier(0, threads=threads) if _native.cuda_available() else _native.Copier(-1,
                                                                                                     threads=threads)
        if isinstance(device, int) and device >= 0:
            return _native.Copier(device, threads=threads)  # AcceleratorUnavailableError without one
        raise ValueError(f"device must be 'auto', 'cpu' or a CUDA device index, not {device!r}")

    @property
    def uses_gpu(self) -> bool:
        return self._copier.device >= 0

    @property
    def storage(self) -> storage.Storage:
        return self._storage

    @property
    def saving(self) -> bool:
        """True while an earlier save is still being written or committed in the background. Its error, if it
        fails, is raised by the next save(), wait() or close()."""
        return not self._engine.idle

    @property
    def staging_allocated_bytes(self) -> int:
        """Host memory held for staging right now (bounded by staging_bytes)."""
        return self._engine.staging_allocated_bytes

    # -- context manager --

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is already on its way: finish what can be finished, don't mask it
            self.close()
        except errors.SneppXError as background:
            log.error("checkpoint error while closing after %s: %s", exc_type.__name__, background)

    # -- the calls --

    def should_save(self, step: int) -> bool:
        """True when `step` is a multiple of save_every_n_steps that was not saved already."""
        return retention.is_save_step(step, self.save_every_n_steps, self.last_saved_step)

    def save(self, obj: Any, step: int, *, training_state: Any = None) -> None:
        """Snapshots `obj` (a model with state_dict(), an object with sharded_state_dict(), or a dict of arrays,
        Shards and JSON values) as checkpoint `step` and returns; the write, commit and retention go on in the
        background (with async_save=False, save() waits).

        training_state: JSON-safe data resumed with the weights (data position, RNG state, ...); in a group,
        rank 0's is saved, as are rank 0's plain values. In a group every rank calls save() with the same step;
        a failure on any rank fails the step on every rank (raised by the next call, ShardedCheckpointError
        naming the ranks that failed, or the rank's own error where it happened)."""
        with self._lock:
            self._check_open()
            if self.read_only:
                raise errors.ReadOnlyCoordinatorError(f"this coordinator reads {self.checkpoint_root} only "
                                                      "(read_only=True): it can't save")
            self._raise_background_error()
            if not isinstance(step, (int, np.integer)) or step < 0:
                raise ValueError(f"step must be a non-negative int, not {step!r}")
            if self._trusted_keys is not None and self._signing_key is None:
                raise errors.SigningKeyNotTrustedError(
                    "this coordinator checks signatures (trusted_keys) but has no signing_key: a step it saved "
                    "would be unsigned and fail its own validation; pass signing_key to save")
            step = int(step)
            worker = self._engine
            if not worker.claim_step(step):
                raise errors.CheckpointExistsError(f"step {step} was already saved by this coordinator",
                                                   path=self.checkpoint_root)
            # From here on this rank takes part in the step's protocol whatever happens (coordinator/engine.py):
            # what fails below is reported to the group by the writer, at the step's end.
            job = job_lib.Job(step, training_state=training_state)
            if not self.async_save:  # save() waits for the commit anyway: the writer starts with the snapshot
                job.may_write.set()
            worker.begin(job)
            try:
                snapshot.stage(job, obj, worker, self._copier, self.group, self.staging_bytes)
            except BaseException as e:
                job.error, job.failed, job.raised = e, True, True
                job.may_write.set()
                worker.end(job)  # reports this rank's failure to the group
                worker.release_steps([step])
                raise
            job.may_write.set()
            worker.end(job)
            self.last_saved_step = step
        if not self.async_save:
            self.wait()

    def wait(self) -> None:
        """Blocks until every save so far is committed (or failed); raises a background error."""
        self._engine.wait()
        self._raise_background_error()

    def close(self) -> None:
        """Waits for pending saves, stops the writer and frees staging memory; raises a background error."""
        # Under the lock: a save() running on another thread finishes submitting first (the writer never
        # takes this lock, so waiting for it here can't deadlock), and none starts on a stopped writer.
        with self._lock:
            if self._closed:
                return
            try:
                self._engine.wait()
            finally:
                self._closed = True
                self._finalizer()
                self._engine.free_staging()
                if not self.read_only and self.group.rank == 0 and self._steps.pending_fence() is not None:
                    try:  # never saved after its restore: nothing was rolled back
                        _record_rollback(self._storage, None)
                    except (errors.SneppXError, OSError) as e:  # a stale record only keeps a chain longer
                        log.warning("the rollback record at %s stays: %s", self.checkpoint_root, e)
        self._raise_background_error()

    def _check_open(self) -> None:
        if self._closed:
            raise errors.CoordinatorClosedError("this CheckpointCoordinator is closed")

    def _raise_background_error(self) -> None:
        error = self._engine.take_error()
        if error is not None:
            raise error

    # -- finding and loading --

    def committed_steps(self) -> list[int]:
        """Every step with a commit point on the current timeline, oldest first (not validated): steps a
        restore to an older step abandoned are not listed (docs/FORMAT.md, "Timelines and fencing")."""
        return self._steps.visible()

    def validate(self, step: int) -> list[str]:
        """Problems with committed step `step` ([] when it is whole and every byte checks).
        CheckpointUnreadableError when it can't be read (an I/O error, retried first)."""
        return self.checked(step)[1]

    def checked(self, step: int) -> tuple[dict[str, Any] | None, list[str]]:
        """`validate`, with the manifest of a step that validates (what generation saved it, for one)."""
        return self._steps.check(step)

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint on the current timeline that validates, or None. Committed steps
        that fail validation are skipped, logged, and listed in `self.skipped`; a step that can't be read
        (an I/O error, not bad bytes) is retried, then raised as CheckpointUnreadableError, never skipped."""
        for step in reversed(self._steps.visible()):
            try:
                manifest, problems = self._steps.check(step)
            except errors.CheckpointNotFoundError:
                continue  # deleted by retention between listing and opening
            if not problems:
                assert manifest is not None
                return self._info(step, manifest)
            self._report(step, problems)
        return None

    def restore(self, obj: Any, step: int | None = None) -> CheckpointInfo | None:
        """Loads checkpoint `step` (default: the newest valid one) into `obj`. Returns its info, or None when
        there is no checkpoint at all.

        `obj`: a model (load_state_dict()) or a dict, updated in place with everything the step holds; or, for
        a resharded load, an object with sharded_state_dict()/load_sharded_state_dict() or a dict holding
        Shards: then only what its Shards and arrays name is read (each Shard gets its box of the saved
        tensor, each array the whole tensor), at whatever world size saved the step, and `info.read` says
        how many bytes that took.

        Every byte loaded is the byte validated: each shard is read once (or, resharded, each block read is
        checked) into the arrays handed to `obj`. Restoring a step older than others on the timeline starts a
        new timeline: before this coordinator's next save commits, the newer steps are fenced off and moved
        aside, so neither latest() nor a restart returns them again (docs/FORMAT.md, "Timelines and fencing").
        Until that save the rollback is pending: latest() elsewhere still sees the newer steps, and a close()
        without a save leaves them as they were. Meanwhile the root's `ROLLBACK` record (written by this restore,
        removed by the next commit or close) keeps retention, `sneppx gc` included, off the restored step's chain.
        A read_only coordinator never saves, so its restore is a look at a step, not a rollback: it fences
        nothing, writes nothing, and its latest() still sees the newer steps.

        In a group, every rank calls restore() and all load the same step: rank 0's list of steps is tried
        newest first, and a step that fails on any rank is skipped on all (reported in `skipped`); an error
        that is not a verdict on the step (unreadable, a target that doesn't fit) is raised on every rank."""
        self._engine.wait()  # the fence a restore makes is over this coordinator's own saves too
        targets = state.restore_targets(obj)
        # An explicit step may be one that an earlier restore here abandoned, as long as no save fenced it. The
        # fence is made over every step of the stored timeline: a restore() after restore(step=S) keeps what the
        # first abandoned abandoned (and found invalid), or the steps newer than S would come back.
        pending = self._steps.pending_fence()
        seen = group_lib.broadcast_json(self.group, {
            "steps": self._steps.visible(include_pending=False),
            "abandoned": list(pending.abandoned) if pending is not None else [],
            "invalid": list(pending.invalid) if pending is not None else []})
        everything: list[int] = seen["steps"]
        current = everything if step is not None else [s for s in everything if s not in set(seen["abandoned"])]
        if step is not None and step not in current:
            raise errors.CheckpointNotFoundError(f"no committed checkpoint for step {step} on the current "
                                                 f"timeline of {self.checkpoint_root}", path=self.checkpoint_root)
        candidates = [step] if step is not None else list(reversed(current))
        invalid: set[int] = set(seen["invalid"])
        for candidate in candidates:
            verdict, loaded, error = self._try_load(candidate, targets)
            verdicts = group_lib.allgather_json(self.group, verdict)
            failed = {r: v["error"] for r, v in enumerate(verdicts) if v["state"] == "error"}
            if failed:
                if error is not None:
                    raise error
                raise errors.ShardedCheckpointError(
                    f"step {candidate} could not be restored: " + "; ".join(f"rank {r}: {w}" for r, w in
                                                                            failed.items()), failures=failed)
            if any(v["state"] == "gone" for v in verdicts):  # deleted by retention since it was listed
                if step is not None:
                    raise errors.CheckpointNotFoundError(f"step {step} is gone from {self.checkpoint_root}",
                                                         path=self.checkpoint_root)
                continue
            problems = [p if self.group.world_size == 1 else f"rank {r}: {p}"
                        for r, v in enumerate(verdicts) for p in v.get("problems", [])]
            if problems:
                self._report(candidate, problems)
                if step is not None:
                    raise errors.ManifestError(f"step {step} is not valid: {'; '.join(problems[:3])}",
                                               path=self.checkpoint_root)
                invalid.add(candidate)
                continue
            assert loaded is not None
            manifest, arrays, read = loaded
            if targets is not None:
                state.apply_restored(targets, arrays, manifest)
            else:
                _load_whole(obj, manifest, arrays)
            if self.read_only:
                return self._info(candidate, manifest, read)
            fence = timeline.fence_after(candidate, everything, invalid)
            self._steps.start_timeline(candidate, fence, verified=targets is None)
            if self.group.rank == 0:
                _record_rollback(self._storage, fence)
            self._engine.continue_chain(manifest)
            if fence is not None:
                self._engine.release_steps(fence.abandoned)  # their numbers may be saved again on the new timeline
                log.info("restored step %d: steps %s are abandoned and set aside before the next save commits",
                         candidate, list(fence.abandoned))
            return self._info(candidate, manifest, read)
        return None

    def _try_load(self, step: int, targets: state.Targets | None,
                  ) -> tuple[dict[str, Any], tuple[dict[str, Any], list[np.ndarray], reshard.ReadStats | None] | None,
                             Exception | None]:
        """(verdict for the group, what was loaded, this rank's error) of loading `step` here."""
        read = reshard.ReadStats() if targets is not None else None
        try:
            if targets is None:
                manifest, problems, arrays = self._steps.load(step)
            else:
                assert read is not None
                manifest, problems, arrays = self._steps.load_needed(step, targets.needs, read)
        except errors.CheckpointNotFoundError:
            return {"state": "gone"}, None, None
        except Exception as e:  # noqa: BLE001 - the group decides together; raised below on this rank
            return {"state": "error", "error": f"{type(e).__name__}: {e}"}, None, e
        if problems:
            return {"state": "invalid", "problems": problems[:5]}, None, None
        assert manifest is not None and arrays is not None
        return {"state": "ok"}, (manifest, arrays, read), None

    def retention_plan(self, max_to_keep: int, keep_every_n_steps: int | None = None) -> retention.Plan:
        """What retention would delete now with these settings, as if the newest committed step had just
        been saved (`sneppx gc`): the rule the writer applies after each save (never the newest step that
        validates). Reads steps only as that rule does; changes nothing."""
        return upkeep.plan_retention(self._steps, None, max_to_keep, keep_every_n_steps)

    def apply_retention(self, plan: retention.Plan) -> None:
        """Deletes what `plan` (from retention_plan) names, after this coordinator's own saves finish."""
        with self._lock:
            self._check_open()
            if self.read_only:
                raise errors.ReadOnlyCoordinatorError(f"this coordinator reads {self.checkpoint_root} only "
                                                      "(read_only=True): it can't delete")
            self._engine.wait()
            upkeep.apply_retention(self._steps, plan)

    def _info(self, step: int, manifest: dict[str, Any], read: reshard.ReadStats | None = None) -> CheckpointInfo:
        location = (f"{self._storage.uri}/{storage.step_name(step)}")
        return CheckpointInfo(step, location, manifest.get("training_state"), manifest, read)

    def _report(self, step: int, problems: list[str]) -> None:
        self.skipped.append(SkippedCheckpoint(step, tuple(problems)))
        log.warning("skipping checkpoint step %d: %s", step, "; ".join(problems[:5]))


def _record_rollback(store: storage.Storage, fence: timeline.Fence | None) -> None:
    """The root's rollback record made to say what a writer's restore left pending (None: nothing), so that
    retention beside it (`sneppx gc`) keeps the restored step's chain (coordinator/timeline.py). Not written
    durably, retention could delete the chain the next save continues: a failure is raised."""
    if fence is None:
        if store.read_root_file(timeline.ROLLBACK_RECORD) is not None:  # a restore of the newest step: most often none
            store.remove_root_file(timeline.ROLLBACK_RECORD)
    else:
        store.write_root_file(timeline.ROLLBACK_RECORD, timeline.encode_fence(fence))


def _load_whole(obj: Any, manifest: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """Hands a step read whole to `obj`: load_state_dict() with the saved tree, or a dict updated in place."""
    state.load_whole(obj, manifest["kind"], state.tree_of(manifest, arrays))


def _private_key(key: Any) -> Any:
    """The signing key as an Ed25519 private key (an unencrypted PEM path is loaded once, here)."""
    if key is None or isinstance(key, ed25519.Ed25519PrivateKey):
        return key
    if isinstance(key, (str, os.PathLike)):
        return signing.load_private_key(key)
    raise errors.KeyFormatError(f"signing_key must be an Ed25519 private key or a PEM path, not a "
                                f"{type(key).__name__}")
