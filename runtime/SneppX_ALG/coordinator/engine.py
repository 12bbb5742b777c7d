"""The background half of a save: staging buffers and the one writer thread that streams them to storage.

Why a thread of its own: `save()` returns after the snapshot; writing, committing and retention run
here, one step after another in submission order, and their errors are kept for the next call.

In a group of ranks (coordinator/group.py) every rank's writer runs the same protocol per step, in the same
order, over the group's collectives (so the group must be one nothing else uses while a save is in flight):

1. begin: rank 0 claims the step (storage.begin) and broadcasts its token; the others join it.
2. data: each rank writes its own shard file, `shard-<rank>.snpx`: its shards, and the replicated tensors
   plan.replicated_owners gives it.
3. end: each rank makes its file durable (S3: uploads it), then all ranks allgather a report (what each wrote,
   or why it failed): the barrier. Rank 0 alone, and only when every report is whole, builds the manifest from
   them and commits (storage.finalize checks every rank's file first); it broadcasts the outcome, and every
   rank raises the same failure. A rank that dies before the barrier makes the allgather fail everywhere, so
   nothing commits; what the ranks wrote is removed, or left for the lease rules (storage/lease.py).
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - registers its exit hook before ours (see _drain_at_exit)
import dataclasses
import logging
import os
import queue
import threading
import traceback
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from SneppX_ALG import _native, errors, storage
from SneppX_ALG.checkpoint import file, format, signing
from SneppX_ALG.checkpoint import manifest as manifest_codec
from SneppX_ALG.coordinator import group as group_lib
from SneppX_ALG.coordinator import plan, retention, steps, timeline

log = logging.getLogger(__name__)


def host_piece(leaf: np.ndarray, piece: plan.Piece) -> np.ndarray:
    """The bytes of one piece of a host tensor, little-endian and in C order, as uint8: a view when the tensor
    is already both, else a copy of the piece's box alone (never of the whole tensor)."""
    little = leaf.dtype.newbyteorder("<") if leaf.dtype.byteorder == ">" else leaf.dtype
    if leaf.flags.c_contiguous and little == leaf.dtype:
        return leaf.reshape(-1).view(np.uint8)[piece.start:piece.start + piece.nbytes]
    block = np.ascontiguousarray(leaf[piece.box.slices()], dtype=little)
    return block.reshape(-1).view(np.uint8)


# ---- the staging pool -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Held:
    """What a staging buffer still holds after the save that filled it committed: step `step`'s bytes of these
    pieces, by entry name: (offset in the buffer, length, CRC32C). An incremental save compares a host piece
    with them byte for byte, instead of hashing it, to learn that it did not change."""

    step: int
    pieces: dict[str, tuple[int, int, int]]


class StagingPool:
    """At most `limit` buffers of `size` bytes, allocated on first use and reused (pinned on a GPU copier).

    Each buffer has a slot number. An incremental save whose state fits the pool takes slot i for its i-th
    buffer every time, so each buffer still holds, at the next save, what the last one staged there: `held`,
    recorded once that save committed, and only while no later save has taken the slot since."""

    def __init__(self, copier: _native.Copier, size: int, limit: int):
        self.copier, self.size, self.limit = copier, size, max(2, limit)
        self._buffers: list[Any] = [None] * self.limit  # by slot; None until first used
        self._free = set(range(self.limit))
        self._owner: dict[int, object] = {}  # the save that last took each slot
        self._held: dict[int, Held] = {}
        self._cond = threading.Condition()

    def acquire(self, owner: object, on_wait: Any = None, slot: int | None = None) -> tuple[int, Held | None]:
        """A free slot (`slot`: that one; None: any, an allocated one first) for `owner`, and what its buffer held
        (None: nothing known), which the owner now overwrites; blocks while it is taken (calling on_wait() first)."""
        with self._cond:
            def ready() -> bool:
                return slot in self._free if slot is not None else bool(self._free)

            if not ready() and on_wait is not None:
                on_wait()
            while not ready():
                self._cond.wait()
            if slot is None:
                allocated = [s for s in self._free if self._buffers[s] is not None]
                slot = max(allocated) if allocated else min(self._free)
            self._free.remove(slot)
            self._owner[slot] = owner
            held = self._held.pop(slot, None)
            if self._buffers[slot] is not None:
                return slot, held
        try:
            buffer = self.copier.alloc(self.size)
        except BaseException:
            self.release(slot)
            raise
        self._buffers[slot] = buffer  # only the slot's holder touches its entry
        return slot, None

    def buffer(self, slot: int) -> Any:
        return self._buffers[slot]

    def release(self, slot: int) -> None:
        with self._cond:
            self._free.add(slot)
            self._cond.notify_all()

    def settle(self, slot: int, owner: object, held: Held) -> None:
        """`owner`'s save committed: its slot holds `held`, unless a later save has taken the slot since."""
        with self._cond:
            if self._owner.get(slot) is owner:
                self._held[slot] = held

    def forget(self) -> None:
        """Nothing held is to be compared with any more (a restore starts another chain)."""
        with self._cond:
            self._held.clear()

    @property
    def allocated_bytes(self) -> int:
        return sum(b is not None for b in self._buffers) * self.size

    def clear(self) -> None:
        """Frees the buffers not in use."""
        with self._cond:
            for slot in self._free:
                self._buffers[slot] = None
                self._held.pop(slot, None)


# ---- incremental saves ---------------------------------------------------------------------------------------

# An incremental save cuts every array into pieces of at most this many bytes (four checksum blocks at the default
# block size), each written or referenced whole: smaller finds more unchanged bytes in sparse updates, and costs a
# table entry and a manifest chunk (~300 bytes) per piece. docs/BENCHMARKS.md, "Incremental checkpoints".
REUSE_BYTES = 1 << 20
AUTO = "auto"
# "auto" stops comparing for the rest of a chain after a save that found less than this share of its bytes
# unchanged (hashing then costs more than it saves); the chain's next full save compares again.
AUTO_MIN_REUSE = 0.125


@dataclasses.dataclass(frozen=True)
class Chain:
    """What this rank's next save may reference: the newest step it committed (`step`, in which this rank's file
    was `shard`), how many incremental saves since the last full one (`length`: 0 after a full one), and each
    piece it recorded there by entry name: (dtype, global shape, its manifest chunk, with BLAKE3 per block)."""

    step: int
    shard: str
    length: int
    records: dict[str, tuple[str, tuple[int, ...], dict[str, Any]]]
    comparing: bool = True


def reusable(base: Chain, entry: str, dtype: str, global_shape: tuple[int, ...], record: dict[str, Any],
             keys: tuple[str, ...] = ("crc32c", "blocks", "digests")) -> dict[str, Any] | None:
    """The base's chunk that holds the bytes of a piece (`record`: its box, length and checksums), as this save's
    chunk referencing it, or None: the base has the same entry with the same dtype, global shape, box and length,
    and the same `keys` (a piece just hashed: its block CRC32Cs and BLAKE3s; a piece found equal byte for byte
    to what the base saved: its CRC32C)."""
    known = base.records.get(entry)
    if known is None or known[0] != dtype or known[1] != global_shape or known[2].get("digests") is None:
        return None
    old = known[2]
    if any(old.get(k) != record.get(k) for k in ("offset", "shape", "nbytes", *keys)):
        return None
    return {**old, "shard": record["shard"], "from": list(manifest_codec.reference(old) or (base.step, base.shard))}


# ---- the background writer ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    step: int
    kind: str = "mapping"
    specs: list[plan.TensorSpec] = dataclasses.field(default_factory=list)  # the tensors this rank writes
    declared: str = ""  # plan.replicated_declaration of this rank's state
    pieces: list[plan.Piece] = dataclasses.field(default_factory=list)
    values: list[tuple[tuple[str, ...], Any]] = dataclasses.field(default_factory=list)
    training_state: Any = None
    # This rank can't contribute the step (its own error, raised once the group has the step's outcome).
    failed: bool = False
    error: BaseException | None = None
    raised: bool = False  # save() raised `error` itself: the writer reports it to the group, never raises it again
    # The group agreed that the step began (rank 0 claimed it): every rank then takes part in its end.
    began: bool = False
    committed: bool = False
    # Set when the snapshot is done, or when it waits for a buffer: until then the writer stays idle, so on
    # a small machine it doesn't compete with the copy that save() is blocked on.
    may_write: threading.Event = dataclasses.field(default_factory=threading.Event)
    pending: storage.PendingStep | None = None
    writer: file.CheckpointWriter | None = None
    # CRC32C of every piece as it was staged; the writer checks its own against it, so on success these
    # are also the CRCs in the shard, and the manifest lists them.
    snapshot_crcs: dict[str, int] = dataclasses.field(default_factory=dict)
    # Each written piece as a manifest chunk (plan.chunk_record), by entry name.
    records: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # Producer streams (of CUDA tensors) the copier's stream was already ordered after during this snapshot.
    ordered_streams: set[int] = dataclasses.field(default_factory=set)
    # Incremental saves: the chain this save may reference (None: a full save), whether it hashes every block
    # with BLAKE3 (to be compared now, or next time), and the bytes it referenced instead of writing.
    base: Chain | None = None
    hashing: bool = False
    reused_bytes: int = 0
    state_bytes: int = 0
    # The staging slots this save filled, with their pieces (what they hold once it commits), and the pieces the
    # snapshot found equal, byte for byte, to what a slot held since committed step S (entry -> S): not copied.
    slots: list[tuple[int, list[plan.Piece]]] = dataclasses.field(default_factory=list)
    same: dict[str, int] = dataclasses.field(default_factory=dict)
    token: object = dataclasses.field(default_factory=object)  # this save, as the owner of staging slots

    def fail(self, error: BaseException) -> None:
        """This rank's part of the step failed: kept, the writer dropped; the step's end still runs."""
        # The error outlives the call that raised it: its frames must not keep staging views and the arrays over
        # them (a memoryview with an array exporting from it, freed by the cycle collector, crashed CPython 3.11
        # in _memory_release: seen when a write failed inside _write_buffer).
        traceback.clear_frames(error.__traceback__)
        if self.error is None:
            self.error = error
        self.failed = True
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.abort()


@dataclasses.dataclass(frozen=True)
class _Task:
    """One thing the writer does for a save: `run(job)`, then give staging slot `slot` back (when it wrote one)."""

    job: Job
    run: Callable[[Job], None]
    slot: int | None = None


class Engine:
    """The worker thread and its queue; kept apart from the coordinator so that a finalizer can finish
    pending saves without holding the coordinator alive (and _drain_at_exit can finish them at exit)."""

    def __init__(self, known: steps.Steps, max_to_keep: int | None, keep_every_n_steps: int | None,
                 signing_key: Any, group: group_lib.Group = group_lib.SOLO,
                 block_bytes: int = manifest_codec.BLOCK_BYTES, commit_fence: Callable[[], None] | None = None,
                 incremental: bool | str = False, full_every: int = 10):
        self.known = known
        self.store = known.store
        self.retention = (max_to_keep, keep_every_n_steps)
        self.signing_key = signing_key
        self.group = group
        self.block_bytes = block_bytes
        self.commit_fence = commit_fence
        self.incremental = incremental
        self.full_every = full_every
        self.chain: Chain | None = None  # set by each committed save of this rank, and by a restore
        self._stored_fence_checked = False  # a fence record left by an interrupted process is finished once
        # Tasks of saves, in submission order; None stops the thread, an Event is set once what came before is done.
        self.queue: queue.Queue[_Task | threading.Event | None] = queue.Queue()
        self.error: BaseException | None = None
        self._steps: set[int] = set()  # submitted or committed here (failed saves are taken out again)
        self._outstanding = 0
        self._idle = threading.Condition()
        self.pool: StagingPool | None = None
        self.thread = threading.Thread(target=self._run, name="sneppx-checkpoint-writer", daemon=True)
        self.thread.start()
        _running.add(self)

    @property
    def shard_name(self) -> str:
        return plan.SHARD_FILE.format(self.group.rank)

    @property
    def unit_bytes(self) -> int | None:
        """The largest piece a save writes or references whole (None: as large as a staging buffer)."""
        return max(REUSE_BYTES, self.block_bytes) if self.incremental else None

    def continue_chain(self, manifest: dict[str, Any]) -> None:
        """After a restore of `manifest`'s step: the next save may reference the chunks this rank's file holds or
        references there (those with block digests). A restore of an older step sets aside only newer steps, so
        nothing this chain points at is fenced away. Another world size, or a step without digests: a full save."""
        self.chain = None
        if self.pool is not None:
            self.pool.forget()
        if (not self.incremental or manifest.get("version", 0) < manifest_codec.MANIFEST_VERSION
                or manifest.get("world_size") != self.group.world_size):
            return
        rank = self.group.rank
        records = {c["entry"]: (t["dtype"], tuple(t["shape"]), c) for t in manifest["tensors"] for c in t["chunks"]
                   if c["shard"] == rank and c.get("digests") is not None}
        if records:
            self.chain = Chain(manifest["step"], manifest["shards"][rank], int(manifest.get("chain", 0)), records)

    def _plan_increment(self, job: Job) -> None:
        """Whether this save references the chain (at most full_every - 1 saves after a full one) and whether it
        hashes its blocks (to compare now, or to be compared by the next save)."""
        chain = self.chain
        if not self.incremental:
            return
        if chain is not None and chain.length + 1 < self.full_every:
            job.base = chain if chain.comparing else None
            job.hashing = chain.comparing
        else:  # a full save: the start of the next chain, hashed so the saves after it can compare
            job.hashing = True

    def claim_step(self, step: int) -> bool:
        """Takes `step` for a save; False when this coordinator saved it (or is saving it) already."""
        with self._idle:
            if step in self._steps:
                return False
            self._steps.add(step)
            return True

    def release_steps(self, steps: Iterable[int]) -> None:
        """`steps` may be saved again: their save failed in save(), or a restore abandoned them."""
        with self._idle:
            self._steps.difference_update(steps)

    def begin(self, job: Job) -> None:
        """Queues the start of a save: its step claimed (rank 0) or joined, its shard file opened."""
        self._submit(_Task(job, self._begin))

    def write(self, job: Job, slot: int, pieces: list[plan.Piece]) -> None:
        """Queues the write of one staged buffer; its slot goes back to the pool once written (or skipped)."""
        self._submit(_Task(job, lambda job: self._write(job, slot, pieces), slot))

    def end(self, job: Job) -> None:
        """Queues the end of a save: the commit, or, after a save() that raised, the report of its failure to the
        group (every rank takes part in every step it began)."""
        self._submit(_Task(job, self._end))

    def _submit(self, task: _Task) -> None:
        with self._idle:
            self._outstanding += 1
        self.queue.put(task)

    def wait(self) -> None:
        with self._idle:
            while self._outstanding:
                self._idle.wait()

    def shutdown(self) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()

    def drain(self) -> None:
        """At exit: waits for the work submitted so far (not for what other threads submit meanwhile), then
        logs the error the writer kept, if any, since nothing will raise it now."""
        if not self.thread.is_alive():
            return
        done = threading.Event()
        self.queue.put(done)
        while not done.wait(1.0) and self.thread.is_alive():  # stopped meanwhile (a finalizer): done too
            pass
        with self._idle:
            error = self.error
        if error is not None:
            log.error("checkpoint save failed, and the program ended without close() or wait() to raise it: "
                      "%s: %s", type(error).__name__, error)

    def take_error(self) -> BaseException | None:
        with self._idle:
            error, self.error = self.error, None
        return error

    def _run(self) -> None:
        while True:
            task = self.queue.get()
            if task is None:
                return
            if isinstance(task, threading.Event):
                task.set()
                continue
            job = task.job
            try:
                task.run(job)
            except BaseException as e:  # noqa: BLE001 - kept and raised by the next call; the thread goes on
                job.fail(e)
                self._drop(job)
                with self._idle:
                    if self.error is None:
                        self.error = e
                    if not job.committed:
                        self._steps.discard(job.step)
                log.warning("checkpoint of step %d failed: %s", job.step, e)
            finally:
                if task.slot is not None:
                    assert self.pool is not None
                    self.pool.release(task.slot)
                with self._idle:
                    self._outstanding -= 1
                    self._idle.notify_all()

    def _write(self, job: Job, slot: int, pieces: list[plan.Piece]) -> None:
        job.may_write.wait()
        if not job.failed:
            try:
                self._write_buffer(job, slot, pieces)
            except Exception as e:  # noqa: BLE001 - this rank's failure; the step's end reports it
                job.fail(e)

    def _begin(self, job: Job) -> None:
        """Rank 0 claims the step and tells the others where to write; this rank opens its shard file."""
        group = self.group
        error: BaseException | None = None
        self._plan_increment(job)
        if group.rank == 0:
            try:
                # Before any rank writes: steps a restore abandoned are moved aside (the fence), and so is an
                # invalid committed step of this number, so that nothing of theirs is overwritten or lost.
                self._apply_fences()
                if job.step in self.store.committed_steps():
                    self._set_aside_if_invalid(job.step)
                job.pending = self.store.begin(job.step)
            except Exception as e:
                if group.world_size == 1:
                    raise
                error = e
            answer = group_lib.broadcast_json(group, {
                "token": job.pending.token if job.pending is not None else None, "error": _describe(error)})
        else:
            answer = group_lib.broadcast_json(group, None)
            if answer["token"] is None:
                error = errors.ShardedCheckpointError(f"step {job.step}: rank 0 could not begin it: "
                                                      f"{answer['error']}", failures={0: answer["error"]})
            else:
                try:
                    job.pending = self.store.join(job.step, answer["token"])
                except Exception as e:  # noqa: BLE001 - reported at the step's end
                    error = e
        job.began = answer["token"] is not None
        if error is not None:
            job.fail(error)
            return
        assert job.pending is not None
        try:
            job.writer = self._shard_writer(job.pending, self.shard_name,
                                            {"sneppx.step": str(job.step), "sneppx.shard": str(group.rank)})
            job.writer.open()
        except Exception as e:
            if group.world_size == 1:
                raise
            job.fail(e)

    def _shard_writer(self, pending: storage.PendingStep, shard: str,
                      metadata: dict[str, str]) -> file.CheckpointWriter:
        """The writer of one shard: streamed to the store where it takes streams (S3: uploaded in parts as it is
        written), else a file in the step's local directory. A signed step's shards are files: the shard's
        digest in the manifest is a read-back of the finished file (_file_record: its header, at the start,
        is written last, and BLAKE3 hashes from the start)."""
        sink = self.store.shard_sink(pending, shard) if self.signing_key is None else None
        return file.CheckpointWriter(os.path.join(pending.local_dir, shard), metadata=metadata, sink=sink)

    def _write_buffer(self, job: Job, slot: int, pieces: list[plan.Piece]) -> None:
        assert job.writer is not None and self.pool is not None
        view = self.pool.copier.view(self.pool.buffer(slot), self.pool.size)
        data = None
        for piece in pieces:
            spec = job.specs[piece.tensor]
            same = job.same.get(piece.entry)
            if same is not None and job.base is not None and same == job.base.step:
                # the snapshot found it equal to the base's bytes: referenced with the base's checksums, unhashed
                placed = plan.chunk_record(spec, piece, self.group.rank, job.snapshot_crcs[piece.entry], "", None)
                record = reusable(job.base, piece.entry, spec.dtype, spec.full_shape, placed, ("crc32c",))
                if record is not None:
                    job.records[piece.entry] = record
                    job.state_bytes += piece.nbytes
                    job.reused_bytes += piece.nbytes
                    continue
            dtype = format.numpy_dtype(spec.dtype)
            count = piece.nbytes // spec.itemsize
            data = view[piece.offset:piece.offset + piece.nbytes]
            array = np.frombuffer(data, dtype=dtype, count=count).reshape(piece.box.shape)
            box = piece.global_box(spec)
            extra = {}
            if box.shape != spec.full_shape:
                extra = {"global_shape": spec.full_shape, "global_offset": box.offset}
            expected = job.snapshot_crcs[piece.entry]
            blocks = storage.block_crcs(data, self.block_bytes)
            combined = 0
            for index, crc in enumerate(blocks):
                combined = _native.crc32c_combine(combined, crc,
                                                  min(self.block_bytes, piece.nbytes - index * self.block_bytes))
            digests = None
            if self.signing_key is not None or job.hashing:
                digests = "".join(signing.block_digest(data[i:i + self.block_bytes])
                                  for i in range(0, piece.nbytes, self.block_bytes))
            record = plan.chunk_record(spec, piece, self.group.rank, expected, "".join(f"{c:08x}" for c in blocks),
                                       digests)
            job.state_bytes += piece.nbytes
            reference = reusable(job.base, piece.entry, spec.dtype, spec.full_shape, record) if job.base else None
            if reference is not None:  # unchanged since the chain's step: referenced, not written
                written = expected
                record = reference
                job.reused_bytes += piece.nbytes
            else:
                written = job.writer.write(piece.entry, array, **extra).crc32c
            if written != expected or combined != expected:
                raise errors.ChecksumMismatchError(
                    f"step {job.step}: tensor piece {piece.entry!r} changed in staging memory between snapshot "
                    f"and write (snapshot {expected:#010x}, written {written:#010x}, blocks {combined:#010x})")
            job.records[piece.entry] = record
        del view, data

    def _end(self, job: Job) -> None:
        """This rank's file made durable (and uploaded), every rank's report gathered (the barrier), rank 0's
        commit decided and broadcast; every rank raises the step's failure, if any."""
        group = self.group
        if not job.began:  # the group never started the step (rank 0 could not claim it): nothing to end
            self._drop(job)
            if job.raised:  # save() failed too, and raised its own error already
                return
            raise job.error or errors.ShardedCheckpointError(f"step {job.step} did not begin")
        report: dict[str, Any] = {"ok": False, "error": _describe(job.error)}
        if not job.failed:
            try:
                report = self._finish_part(job)
            except Exception as e:
                if group.world_size == 1:
                    raise
                job.fail(e)
                report = {"ok": False, "error": _describe(e)}
        try:
            reports = group_lib.allgather_json(group, report)
        except BaseException:
            # Rank 0 commits only with every report, so it knows nothing committed; another rank can't know that
            # (rank 0 may have had all reports): its part stays, for rank 0's step or for cleanup.
            self._drop(job, remove=group.rank == 0)
            raise
        outcome, commit_error = None, None
        if group.rank == 0:
            try:
                outcome = self._commit(job, reports)
            except errors.CommitUnknownError as e:
                commit_error, outcome = e, {"state": "unknown", "error": _describe(e)}
            except Exception as e:
                if group.world_size == 1:
                    raise
                commit_error, outcome = e, {"state": "failed", "failures": {"0": _describe(e)}}
        try:
            outcome = group_lib.broadcast_json(group, outcome)
        except BaseException:
            self._drop(job, remove=False)  # rank 0 may have committed: nothing is taken back here
            raise
        assert outcome is not None
        if outcome["state"] == "committed":
            job.committed = True
            self._extend_chain(job)
            self._drop(job, remove=False)
            if group.rank == 0:
                self._retain(job.step)
            return
        self._drop(job, remove=outcome["state"] == "failed")
        if outcome["state"] == "unknown":
            raise commit_error or errors.CommitUnknownError(
                f"step {job.step}: rank 0 could not learn whether it committed: {outcome['error']}")
        failures = {int(rank): why for rank, why in outcome["failures"].items()}
        if job.error is not None:
            if job.raised:
                return
            raise job.error
        if commit_error is not None:
            raise commit_error
        raise errors.ShardedCheckpointError(
            f"step {job.step} was not committed: " + "; ".join(f"rank {r}: {w}" for r, w in sorted(failures.items())),
            failures=failures)

    @staticmethod
    def _chain_length(job: Job) -> int:
        """Saves since this rank's last full one, this one included (0: it referenced nothing)."""
        return job.base.length + 1 if job.base is not None and job.reused_bytes else 0

    def _extend_chain(self, job: Job) -> None:
        """A committed save becomes what the next one may reference (when it hashed its blocks)."""
        if not job.hashing:
            self.chain = None if self.chain is None else dataclasses.replace(self.chain, length=self.chain.length + 1)
            return
        length = self._chain_length(job)
        comparing = (self.incremental != AUTO or job.base is None
                     or job.reused_bytes >= AUTO_MIN_REUSE * job.state_bytes)
        specs = {p.entry: job.specs[p.tensor] for p in job.pieces}
        self.chain = Chain(job.step, self.shard_name, length,
                           {name: (specs[name].dtype, specs[name].full_shape, record)
                            for name, record in job.records.items()}, comparing)
        if self.pool is not None:
            for slot, pieces in job.slots:
                self.pool.settle(slot, job.token, Held(job.step, {
                    p.entry: (p.offset, p.nbytes, job.records[p.entry]["crc32c"]) for p in pieces}))

    def _finish_part(self, job: Job) -> dict[str, Any]:
        """This rank's file durable and on the server; its report for rank 0."""
        assert job.writer is not None and job.pending is not None
        job.writer.commit()
        job.writer = None
        shard = self.shard_name
        # Shard digests cost a read-back of every shard; only a signature needs them (it vouches for the
        # shards through them), so unsigned steps are saved without (and without a "files" object).
        record = self._file_record(job, shard) if self.signing_key is not None else None
        parts = self.store.upload(job.pending, [shard])
        return {"ok": True, "shard": shard, "parts": {k: list(v) for k, v in parts.items()}, "file": record,
                "chain": self._chain_length(job),
                "declared": job.declared, "tensors": plan.rank_part(job.specs, job.pieces, job.records)}

    def _commit(self, job: Job, reports: list[dict[str, Any]]) -> dict[str, Any]:
        """Rank 0, with every rank's report: the manifest, fences, then the commit point."""
        assert job.pending is not None
        failures = {str(rank): r["error"] for rank, r in enumerate(reports) if not r["ok"]}
        if failures:
            return {"state": "failed", "failures": failures}
        if len({r["declared"] for r in reports}) != 1:
            raise errors.ShardingMismatchError(
                f"step {job.step}: the ranks hold different replicated tensors (an array that is not a Shard must "
                "be in every rank's state, with the same dtype and shape)")
        tensors = plan.merge_parts([r["tensors"] for r in reports])
        shards = [r["shard"] for r in reports]
        parts = {name: (size, etag) for r in reports for name, (size, etag) in r["parts"].items()}
        files = {r["shard"]: r["file"] for r in reports} if self.signing_key is not None else None
        manifest = manifest_codec.encode_manifest(plan.build_manifest(
            job.step, tensors, job.values, job.kind, job.training_state, shards,
            world_size=self.group.world_size, generation=self.group.generation, block_bytes=self.block_bytes,
            files=files, chain=max(r["chain"] for r in reports)))
        signature = None
        if self.signing_key is not None:  # written before the commit point, by finalize()
            signature = signing.manifest_signature(manifest, self.signing_key)
        if self.commit_fence is not None:
            self.commit_fence()  # e.g. StaleGenerationError: a generation that is over commits nothing
        pending, job.pending = job.pending, None  # finalize() ends it, whatever happens
        try:
            self.store.finalize(pending, manifest, signature, parts)  # the commit point
        except errors.CommitUnknownError:
            raise  # the marker may be there: nothing is taken back
        except BaseException:
            job.pending = pending  # taken back by _drop
            raise
        return {"state": "committed"}

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
        pinned: set[int] = set()
        if doomed:  # never a step that a kept one references (incremental steps): it would break that step
            pinned = retention.referenced([s for s in committed if s not in doomed], self.known.uses) & set(doomed)
            doomed = [s for s in doomed if s not in pinned]
        return retention.Plan(keep=[s for s in committed if s not in doomed], delete=doomed,
                              remove_set_aside=retention.set_aside_to_delete(self.store.set_aside_steps(),
                                                                             max_to_keep=max_to_keep),
                              protected=protected, invalid=rejected, pinned=sorted(pinned))

    def apply_retention(self, plan: retention.Plan) -> None:
        """Deletes the steps and set-aside steps `plan` names (one already gone is passed over), newest first: a
        step is referenced only by newer ones, so a deletion cut short never leaves a step whose references are
        gone (the kill harness found the oldest-first order doing that)."""
        for step in sorted(plan.delete, reverse=True):
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
            self.known.forget([step])
            log.warning("step %d was committed but invalid (%s); moved to %s", step, problems[0], aside)

    def _drop(self, job: Job, *, remove: bool = True) -> None:
        """Ends this rank's part of a step that is over: the writer aborted, and the step in flight either taken
        back (`remove`: storage.abort) or left as it is (storage.leave: committed, or not this rank's call)."""
        if job.writer is not None:
            writer, job.writer = job.writer, None
            writer.abort()
        if job.pending is not None:
            pending, job.pending = job.pending, None
            (self.store.abort if remove else self.store.leave)(pending)


# Saves still pending when the program ends are finished before the interpreter stops the thread pools they
# need (an S3 multipart upload sends its parts from one): concurrent.futures stops every pool in a threading
# exit hook, which runs before atexit callbacks (and so before the coordinator's weakref.finalize), and those
# hooks run last registered first, so ours (registered after concurrent.futures.thread's, imported above) runs
# before it. Bounded like close(): each step's requests and collectives have their own timeouts (the S3
# client's, the group's). A save that fails here is logged; the exit status stays the program's.
_running: weakref.WeakSet[Engine] = weakref.WeakSet()


def _drain_at_exit() -> None:
    try:
        for worker in list(_running):
            worker.drain()
    except BaseException as e:  # noqa: BLE001 - a hook that raises skips the hooks after it (the pools' own)
        log.error("pending checkpoint saves were not finished at exit: %s: %s", type(e).__name__, e)


threading._register_atexit(_drain_at_exit)


def _describe(error: BaseException | None) -> str | None:
    """An error as the other ranks read it in a report."""
    return None if error is None else f"{type(error).__name__}: {error}"
