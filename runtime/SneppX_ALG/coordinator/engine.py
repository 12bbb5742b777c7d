"""The background half of a save: staging buffers and the one writer thread that streams them to storage.

Why a thread of its own: `save()` returns after the snapshot; writing, committing and retention run
here, one step after another in submission order, and their errors are kept for the next call.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
from typing import Any

import numpy as np

from SneppX_ALG import _native, errors, storage
from SneppX_ALG.checkpoint import file, format, signing
from SneppX_ALG.checkpoint import manifest as manifest_codec
from SneppX_ALG.coordinator import plan, retention, steps, timeline

log = logging.getLogger(__name__)


def host_piece(job: Job, leaf: np.ndarray, piece: plan.Piece) -> np.ndarray:
    """The bytes of one piece of a host tensor, little-endian and in C order, as uint8.

    A tensor that is already both is only viewed. Otherwise a row block is converted on its own (a copy the
    size of the piece), and any other piece comes from one converted copy of the whole tensor, made for its
    first piece and dropped after its last: never one full copy per piece."""
    little = leaf.dtype.newbyteorder("<") if leaf.dtype.byteorder == ">" else leaf.dtype
    if leaf.flags.c_contiguous and little == leaf.dtype:
        return leaf.reshape(-1).view(np.uint8)[piece.start:piece.start + piece.nbytes]
    if piece.global_offset is not None:  # rows [r0, r0 + rows) of dimension 0
        first_row = piece.global_offset[0]
        block = np.ascontiguousarray(leaf[first_row:first_row + piece.shape[0]], dtype=little)
        return block.reshape(-1).view(np.uint8)
    whole = job.host_copies.get(piece.tensor)
    if whole is None:
        whole = np.ascontiguousarray(leaf, dtype=little).reshape(-1).view(np.uint8)
        job.host_copies[piece.tensor] = whole
    if piece.start + piece.nbytes >= whole.size:  # the tensor's last piece: the copy is not needed again
        del job.host_copies[piece.tensor]
    return whole[piece.start:piece.start + piece.nbytes]


# ---- the staging pool -----------------------------------------------------------------------------------


class StagingPool:
    """At most `limit` buffers of `size` bytes, allocated on first use and reused (pinned on a GPU copier)."""

    def __init__(self, copier: _native.Copier, size: int, limit: int):
        self.copier, self.size, self.limit = copier, size, max(2, limit)
        self._free: list[Any] = []
        self._count = 0
        self._cond = threading.Condition()

    def acquire(self, on_wait: Any = None) -> Any:
        """A free buffer; blocks while all `limit` are in use (calling on_wait() first)."""
        with self._cond:
            if not self._free and self._count >= self.limit and on_wait is not None:
                on_wait()
            while not self._free and self._count >= self.limit:
                self._cond.wait()
            if self._free:
                return self._free.pop()
            self._count += 1
        try:
            return self.copier.alloc(self.size)
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def release(self, buffer: Any) -> None:
        with self._cond:
            self._free.append(buffer)
            self._cond.notify()

    @property
    def allocated_bytes(self) -> int:
        return self._count * self.size

    def clear(self) -> None:
        with self._cond:
            self._count -= len(self._free)
            self._free.clear()


# ---- the background writer ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    step: int
    specs: list[plan.TensorSpec]
    pieces: list[plan.Piece]
    values: list[tuple[tuple[str, ...], Any]]
    kind: str
    training_state: Any
    failed: bool = False
    # Set when the snapshot is done, or when it waits for a buffer: until then the writer stays idle, so on
    # a small machine it doesn't compete with the copy that save() is blocked on.
    may_write: threading.Event = dataclasses.field(default_factory=threading.Event)
    pending: storage.PendingStep | None = None
    writer: file.CheckpointWriter | None = None
    # CRC32C of every piece as it was staged; the writer checks its own against it, so on success these
    # are also the CRCs in the shard, and the manifest lists them.
    snapshot_crcs: dict[str, int] = dataclasses.field(default_factory=dict)
    # Little-endian C-contiguous copies of host tensors that are neither, made once per tensor for pieces that
    # are not row blocks, and dropped after the tensor's last piece.
    host_copies: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    # Producer streams (of CUDA tensors) the copier's stream was already ordered after during this snapshot.
    ordered_streams: set[int] = dataclasses.field(default_factory=set)


class Engine:
    """The worker thread and its queue; kept apart from the coordinator so that an atexit finalizer can
    finish pending saves without holding the coordinator alive."""

    def __init__(self, known: steps.Steps, max_to_keep: int | None, keep_every_n_steps: int | None,
                 signing_key: Any):
        self.known = known
        self.store = known.store
        self.retention = (max_to_keep, keep_every_n_steps)
        self.signing_key = signing_key
        self._stored_fence_checked = False  # a fence record left by an interrupted process is finished once
        self.queue: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.error: BaseException | None = None
        self.steps: set[int] = set()  # submitted or committed here (failed saves are taken out again)
        self._outstanding = 0
        self._idle = threading.Condition()
        self.pool: StagingPool | None = None
        self.thread = threading.Thread(target=self._run, name="sneppx-checkpoint-writer", daemon=True)
        self.thread.start()

    def submit(self, *item: Any) -> None:
        with self._idle:
            self._outstanding += 1
        self.queue.put(item)

    def wait(self) -> None:
        with self._idle:
            while self._outstanding:
                self._idle.wait()

    def shutdown(self) -> None:
        if self.thread.is_alive():
            self.queue.put(("stop",))
            self.thread.join()

    def take_error(self) -> BaseException | None:
        with self._idle:
            error, self.error = self.error, None
        return error

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item[0] == "stop":
                return
            try:
                self._handle(item)
            except BaseException as e:  # noqa: BLE001 - kept and raised by the next call; the thread goes on
                job = item[1]
                job.failed = True
                self._abort(job)
                with self._idle:
                    if self.error is None:
                        self.error = e
                    self.steps.discard(job.step)
                log.warning("checkpoint of step %d failed: %s", job.step, e)
            finally:
                if item[0] == "data":
                    assert self.pool is not None
                    self.pool.release(item[2])
                with self._idle:
                    self._outstanding -= 1
                    self._idle.notify_all()

    def _handle(self, item: tuple[Any, ...]) -> None:
        kind, job = item[0], item[1]
        if job.failed and kind != "abort":
            return
        if kind == "begin":
            job.pending = self.store.begin(job.step)
            job.writer = file.CheckpointWriter(
                os.path.join(job.pending.local_dir, plan.SHARD_FILE.format(0)),
                metadata={"sneppx.step": str(job.step), "sneppx.shard": "0"})
            job.writer.open()
        elif kind == "data":
            job.may_write.wait()
            if not job.failed:
                self._write_buffer(job, item[2], item[3])
        elif kind == "end":
            self._commit(job)
        elif kind == "abort":
            self._abort(job)

    def _write_buffer(self, job: Job, buffer: Any, pieces: list[plan.Piece]) -> None:
        assert job.writer is not None and self.pool is not None
        view = self.pool.copier.view(buffer, self.pool.size)
        for piece in pieces:
            spec = job.specs[piece.tensor]
            dtype = format.numpy_dtype(spec.dtype)
            count = piece.nbytes // spec.itemsize
            array = np.frombuffer(view, dtype=dtype, count=count, offset=piece.offset).reshape(piece.shape)
            extra = {}
            if piece.global_offset is not None:
                extra = {"global_shape": spec.shape, "global_offset": piece.global_offset}
            entry = job.writer.write(piece.entry, array, **extra)
            expected = job.snapshot_crcs[piece.entry]
            if entry.crc32c != expected:
                raise errors.ChecksumMismatchError(
                    f"step {job.step}: tensor piece {piece.entry!r} changed in staging memory between snapshot "
                    f"and write (snapshot {expected:#010x}, written {entry.crc32c:#010x})")
        del view

    def _commit(self, job: Job) -> None:
        assert job.writer is not None and job.pending is not None
        job.writer.commit()
        job.writer = None
        shard = plan.SHARD_FILE.format(0)
        # Shard digests cost a read-back of every shard; only a signature needs them (it vouches for the
        # shards through them), so unsigned steps are saved without (and without a "files" object).
        files = None
        if self.signing_key is not None:
            files = {shard: self._file_record(job, shard)}
        self._apply_fences()
        if job.step in self.store.committed_steps():
            self._set_aside_if_invalid(job.step)
        manifest = manifest_codec.encode_manifest(plan.build_manifest(
            job.step, job.specs, job.pieces, job.snapshot_crcs, job.values, job.kind, job.training_state, [shard],
            files))
        signature = None
        if self.signing_key is not None:  # written before the commit point, by finalize()
            signature = signing.manifest_signature(manifest, self.signing_key)
        self.store.finalize(job.pending, manifest, signature)  # the commit point
        job.pending = None
        self._retain(job.step)

    def _apply_fences(self) -> None:
        """Before a commit: the steps a restore abandoned (and those of a fence record an interrupted
        process left) are moved aside, listed first in the durable fence record (docs/FORMAT.md,
        "Timelines and fencing"), so they are never visible again, even if this is cut short."""
        fences = []
        if not self._stored_fence_checked:
            stored = self.known.stored_fence()
            fences += [stored] if stored is not None else []
        pending = self.known.pending_fence()
        fences += [pending] if pending is not None else []
        for fence in fences:
            self.store.write_record(timeline.FENCE_RECORD, timeline.encode_fence(fence))
            for step in reversed(fence.abandoned):
                reason = "invalid" if step in fence.invalid else "abandoned"
                try:
                    aside = self.store.set_aside(step, reason)
                except errors.CheckpointNotFoundError:
                    continue  # moved already (a fence record finished by a later process), or deleted
                log.info("new timeline from step %d: step %d set aside as %s", fence.restored, step, aside)
            self.store.remove_record(timeline.FENCE_RECORD)
            self.known.fence_applied(fence)
        self._stored_fence_checked = True

    def _retain(self, new_step: int) -> None:
        """Retention after `new_step` committed (plan_retention, then apply_retention). A step that can't be
        read now stops retention for this save: nothing is deleted on a guess."""
        max_to_keep, keep_every = self.retention
        try:
            plan = self.plan_retention(new_step, max_to_keep, keep_every)
        except errors.CheckpointUnreadableError as e:
            log.warning("retention skipped after step %d: %s", new_step, e)
            return
        self.apply_retention(plan)
        invalid = plan.invalid.get(new_step, [])
        if invalid:
            raise errors.CommittedStepInvalidError(
                f"step {new_step} was committed but does not validate when read back: {'; '.join(invalid[:3])}. "
                "Retention kept the newest step that does.", path=self.store.uri)

    def plan_retention(self, new_step: int | None, max_to_keep: int | None,
                       keep_every_n_steps: int | None) -> retention.Plan:
        """What retention deletes after `new_step` committed (None: the newest visible step): what
        retention.steps_to_delete says, never the newest step that validates, and set-aside steps beyond
        max_to_keep. The one rule for the writer after each save and for `sneppx gc`.

        Which step is the newest valid one is learned by reading it, and only when a deletion could touch
        it: when this process knows (from a read) of a valid step newer than every step to delete, nothing
        is read. Otherwise the steps are validated newest first (the new step first: usually it is valid)
        until one validates. In the steady state that is one read-back every max_to_keep saves (a step
        validated stays known valid until it is the oldest kept); with max_to_keep=1 it is every save:
        keeping a single copy means proving the new one good before the old one goes. Raises
        CheckpointUnreadableError when a step can't be read now."""
        committed = self.known.visible()
        if new_step is None:
            new_step = committed[-1] if committed else None
        doomed: list[int] = []
        protected, rejected = None, {}
        if new_step is not None:
            doomed = retention.steps_to_delete(committed, new_step=new_step, max_to_keep=max_to_keep,
                                               keep_every_n_steps=keep_every_n_steps)
            known = self.known.known_valid
            if doomed and (known is None or known not in committed or known <= max(doomed)):
                protected, rejected = self.known.newest_valid(committed)
                doomed = retention.steps_to_delete(
                    committed, new_step=new_step, max_to_keep=max_to_keep, keep_every_n_steps=keep_every_n_steps,
                    protected=frozenset() if protected is None else frozenset({protected}))
        return retention.Plan(keep=[s for s in committed if s not in doomed], delete=doomed,
                              remove_set_aside=retention.set_aside_to_delete(self.store.set_aside_steps(),
                                                                             max_to_keep=max_to_keep),
                              protected=protected, invalid=rejected)

    def apply_retention(self, plan: retention.Plan) -> None:
        """Deletes the steps and set-aside steps `plan` names (one already gone is passed over)."""
        for step in plan.delete:
            try:
                self.store.delete(step)
            except errors.CheckpointNotFoundError:
                continue
            log.info("retention: deleted checkpoint step %d", step)
        self.known.forget(plan.delete)
        for name in plan.remove_set_aside:
            self.store.remove_set_aside(name)
            log.info("retention: removed set-aside step %s", name)

    @staticmethod
    def _file_record(job: Job, name: str) -> dict[str, Any]:
        """Size and digest of a finished shard, for a signed manifest.

        Why a read-back rather than hashing during the write: the digest is BLAKE3 of the whole file, and the
        header at its start is written last, while the `blake3` package can only hash from the start. The
        cost is one read of the shard (from the disk: the writer bypasses the page cache) and the hash, on
        this background thread with the writer's hashing threads (signing.write_threads()), never in save()."""
        assert job.pending is not None
        path = os.path.join(job.pending.local_dir, name)
        return {"size": os.path.getsize(path),
                "digest": signing.readback_digest(path, threads=signing.write_threads())}

    def _set_aside_if_invalid(self, step: int) -> None:
        """A committed step being saved again (after a rollback past it): an invalid copy is moved aside so
        the new one can commit; a valid one stays and finalize() refuses to overwrite it."""
        try:
            problems = self.known.check(step)[1]
        except errors.CheckpointNotFoundError:
            return
        if problems:
            aside = self.store.set_aside(step, "invalid")
            log.warning("step %d was committed but invalid (%s); moved to %s", step, problems[0], aside)

    def _abort(self, job: Job) -> None:
        if job.writer is not None:
            writer, job.writer = job.writer, None
            writer.abort()
        if job.pending is not None:
            pending, job.pending = job.pending, None
            self.store.abort(pending)
