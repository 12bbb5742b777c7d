"""The background half of a save: the one writer thread that streams the staged buffers to storage and commits.

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

What the thread uses but does not own lives beside it: the staging buffers (staging.py), the rule for
referencing an earlier step (increments.py), the job save() and the thread share (job.py), and the root's
fences and retention (upkeep.py). Their public names are still importable from here. What remains is one
concept, the writer thread and the step protocol above, which is why it stays whole at some 530 lines.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - registers its exit hook before ours (see _drain_at_exit)
import dataclasses
import logging
import math
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from SneppX_ALG import _native, errors, storage
from SneppX_ALG.checkpoint import file, format, signing
from SneppX_ALG.checkpoint import manifest as manifest_codec
from SneppX_ALG.coordinator import group as group_lib
from SneppX_ALG.coordinator import increments, plan, steps, upkeep
from SneppX_ALG.coordinator.increments import AUTO, AUTO_MIN_REUSE, Chain, reusable
from SneppX_ALG.coordinator.job import Job
from SneppX_ALG.coordinator.staging import Held, StagingPool, host_piece  # noqa: F401 - host_piece: re-exported

log = logging.getLogger(__name__)


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
                 block_bytes: int | None = manifest_codec.BLOCK_BYTES, commit_fence: Callable[[], None] | None = None,
                 incremental: bool | str = False, full_every: int = 10):
        self.known = known
        self.store = known.store
        self.retention = (max_to_keep, keep_every_n_steps)
        self.signing_key = signing_key
        self.group = group
        self.block_bytes = block_bytes  # None: by the size of each save's state (increments.block_bytes_for)
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

    def block_bytes_for(self, specs: list[plan.TensorSpec]) -> int:
        """The checksum block size of a save of these tensors (every tensor of the state, this rank's or not: the
        global size is the same on every rank, so the ranks agree without a word)."""
        if self.block_bytes is not None:
            return self.block_bytes
        sizes = {spec.path: math.prod(spec.full_shape) * spec.itemsize for spec in specs}
        return increments.block_bytes_for(sum(sizes.values()))

    def unit_bytes(self, block_bytes: int) -> int | None:
        """The largest piece a save writes or references whole (None: as large as a staging buffer)."""
        return increments.piece_bytes_for(block_bytes) if self.incremental else None

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
            self.chain = Chain(manifest["step"], manifest["shards"][rank], int(manifest.get("chain", 0)), records,
                               block_bytes=manifest["block_bytes"])

    def _plan_increment(self, job: Job) -> None:
        """Whether this save references the chain (at most full_every - 1 saves after a full one) and whether it
        hashes its blocks (to compare now, or to be compared by the next save)."""
        if not self.incremental:
            return
        chain = self.chain
        if chain is not None and not set(chain.steps()) <= set(self.known.visible()):
            # deleted since (a gc beside a trainer that rolled back and has not saved yet): start a new chain
            log.warning("step %d: the steps this save would reference are gone; it is saved whole", job.step)
            chain = self.chain = None
        if chain is not None and chain.length + 1 < self.full_every:
            job.base = chain if chain.comparing else None
            job.hashing = chain.comparing
        else:  # a full save: the start of the next chain, hashed so the saves after it can compare
            job.hashing = True

    def staging_pool(self, copier: _native.Copier, state_bytes: int, staging_bytes: int) -> StagingPool:
        """The staging pool, made by the first save: buffers sized for that save's state
        (plan.choose_buffer_bytes), as many as `staging_bytes` holds; every later save gets the same pool."""
        if self.pool is None:
            size = plan.choose_buffer_bytes(state_bytes, staging_bytes)
            self.pool = StagingPool(copier, size, staging_bytes // size)
        return self.pool

    @property
    def staging_allocated_bytes(self) -> int:
        """Host memory the staging pool holds now (0 before the first save)."""
        return self.pool.allocated_bytes if self.pool is not None else 0

    def free_staging(self) -> None:
        """Frees the staging buffers not in use (close())."""
        if self.pool is not None:
            self.pool.clear()

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

    @property
    def idle(self) -> bool:
        """Every task submitted so far is done (what wait() waits for), asked without waiting."""
        with self._idle:
            return not self._outstanding

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
                if isinstance(e, _CHAIN_BROKEN):  # evidence that the chain no longer holds: the next save is full
                    self.chain = None
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
                upkeep.apply_fences(self.known, stored=not self._stored_fence_checked)
                self._stored_fence_checked = True
                if job.step in self.store.committed_steps():
                    upkeep.set_aside_if_invalid(self.known, job.step)
                job.pending = self.store.begin(job.step)
            except Exception as e:
                if group.world_size == 1:
                    raise
                error = e
            # "full": rank 0 has no chain to reference (a read-back found it broken, say, which only rank 0 sees):
            # no rank references one, so no step mixes a new chain with a broken one.
            answer = group_lib.broadcast_json(group, {
                "token": job.pending.token if job.pending is not None else None, "error": _describe(error),
                "full": self.chain is None})
        else:
            answer = group_lib.broadcast_json(group, None)
            if answer.get("full") and self.chain is not None:
                self.chain = job.base = None
                job.hashing = True  # the start of the next chain, as _plan_increment makes a full save
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
                record = reusable(job.base, piece.entry, spec.dtype, spec.full_shape, placed, ("crc32c",),
                                  block_bytes=job.block_bytes)
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
            block = job.block_bytes
            blocks = storage.block_crcs(data, block)
            combined = 0
            for index, crc in enumerate(blocks):
                combined = _native.crc32c_combine(combined, crc, min(block, piece.nbytes - index * block))
            digests = None
            if self.signing_key is not None or job.hashing:
                digests = "".join(signing.block_digest(data[i:i + block]) for i in range(0, piece.nbytes, block))
            record = plan.chunk_record(spec, piece, self.group.rank, expected, "".join(f"{c:08x}" for c in blocks),
                                       digests)
            job.state_bytes += piece.nbytes
            reference = (reusable(job.base, piece.entry, spec.dtype, spec.full_shape, record, block_bytes=block)
                         if job.base else None)
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
        outcome: dict[str, Any] | None = None
        commit_error: Exception | None = None
        if group.rank == 0:
            try:
                outcome = self._commit(job, reports)
            except errors.CommitUnknownError as e:
                commit_error, outcome = e, {"state": "unknown", "error": _describe(e)}
            except Exception as e:
                if group.world_size == 1:
                    raise
                commit_error, outcome = e, {"state": "failed", "failures": {"0": _describe(e)},
                                            "chain_broken": isinstance(e, _CHAIN_BROKEN)}
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
                upkeep.retain(self.known, job.step, *self.retention)
            return
        self._drop(job, remove=outcome["state"] == "failed")
        if outcome.get("chain_broken"):  # every rank's next save is full
            self.chain = None
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
                            for name, record in job.records.items()}, comparing, job.block_bytes)
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
                "chain": self._chain_length(job), "block_bytes": job.block_bytes,
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
        if len({r["block_bytes"] for r in reports}) != 1:
            raise errors.ShardingMismatchError(
                f"step {job.step}: the ranks cut their blocks differently ({[r['block_bytes'] for r in reports]} "
                "bytes): their states differ in size (each rank's whole state must name every tensor alike)")
        tensors = plan.merge_parts([r["tensors"] for r in reports])
        shards = [r["shard"] for r in reports]
        parts = {name: (size, etag) for r in reports for name, (size, etag) in r["parts"].items()}
        files = {r["shard"]: r["file"] for r in reports} if self.signing_key is not None else None
        manifest = manifest_codec.encode_manifest(plan.build_manifest(
            job.step, tensors, job.values, job.kind, job.training_state, shards,
            world_size=self.group.world_size, generation=self.group.generation, block_bytes=job.block_bytes,
            files=files, chain=max(r["chain"] for r in reports)))
        if len(manifest) > storage.MAX_MANIFEST_BYTES:  # readers refuse it: it would commit unreadable
            raise errors.ManifestTooLargeError(
                f"step {job.step}: the manifest would be {len(manifest)} bytes, more than readers accept "
                f"({storage.MAX_MANIFEST_BYTES}); nothing was committed (docs/FORMAT.md, \"Incremental steps\", "
                "says how large a state fits)", path=self.store.uri)
        self._check_references(job.step, tensors)
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

    def _check_references(self, step: int, tensors: list[dict[str, Any]]) -> None:
        """Every file this step references is still in a step on the timeline (a gc beside a trainer that rolled
        back may have deleted its chain): else ReferencedStepGoneError, before the commit point."""
        by_step: dict[int, set[str]] = {}
        for origin, name in manifest_codec.references(tensors):
            by_step.setdefault(origin, set()).add(name)
        if not by_step:
            return
        visible = set(self.known.visible())
        for origin, names in sorted(by_step.items()):
            try:
                if origin not in visible:
                    raise errors.CheckpointNotFoundError(f"step {origin} is not on the timeline")
                with self.store.read_step(origin) as reader:
                    for name in sorted(names):
                        reader.size(name)
            except errors.CheckpointNotFoundError as e:
                raise errors.ReferencedStepGoneError(
                    f"step {step} references files of step {origin}, which are gone ({e}); nothing was committed, "
                    "and the next save is full", path=self.store.uri) from None

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


# threading's own exit hooks run before the interpreter joins non-daemon threads (atexit runs after: too late for
# the writer pools); a private CPython function, so typeshed does not declare it.
threading._register_atexit(_drain_at_exit)  # type: ignore[attr-defined]


# Errors that show a chain can't be referenced any more (a referenced block rotted, found by the read-back; a
# referenced step gone): the next save is full. Any other failure leaves the chain as it was.
_CHAIN_BROKEN = (errors.CommittedStepInvalidError, errors.ReferencedStepGoneError)


def _describe(error: BaseException | None) -> str | None:
    """An error as the other ranks read it in a report."""
    return None if error is None else f"{type(error).__name__}: {error}"
