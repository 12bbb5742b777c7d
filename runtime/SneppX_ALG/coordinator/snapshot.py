"""The caller's half of a save: the state flattened, this rank's part planned into pieces, and each piece copied
into a staging buffer (its CRC32C taken as it lands), every full buffer handed to the writer thread.

Why a module of its own: this is what `save()` costs the training loop, one memory copy, and the only part of a
save on the caller's thread; the public API around it (coordinator/manager.py) and the writer that drains the
buffers (coordinator/engine.py) are each a concept of their own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from SneppX_ALG import _native, errors
from SneppX_ALG.coordinator import engine, plan, staging, state
from SneppX_ALG.coordinator import group as group_lib
from SneppX_ALG.coordinator import job as job_lib


def stage(job: job_lib.Job, obj: Any, worker: engine.Engine, copier: _native.Copier, group: group_lib.Group,
          staging_bytes: int) -> None:
    """Plans this rank's part of the step and copies it into staging buffers, handing each to the writer."""
    state.check_json_safe(job.training_state, "training_state")
    kind, leaves, values = state.flatten_state(obj)
    state.check_json_safe([v for _, v in values], "the state's plain (non-array) values")
    specs = [state.tensor_spec(path, leaf, shard) for path, leaf, shard in leaves]
    owners = plan.replicated_owners(specs, group.world_size)
    mine = [i for i, spec in enumerate(specs) if spec.sharded or owners[spec.path] == group.rank]
    job.kind, job.values, job.declared = kind, values, plan.replicated_declaration(specs)
    job.specs = [specs[i] for i in mine]
    job.block_bytes = worker.block_bytes_for(specs)
    leaves = [leaves[i] for i in mine]
    pool = worker.staging_pool(copier, sum(s.nbytes for s in job.specs), staging_bytes)
    unit_bytes = worker.unit_bytes(job.block_bytes)
    buffers = plan.plan_pieces(job.specs, pool.size, unit_bytes)
    state.check_entry_names(p for b in buffers for p in b)
    job.pieces = [p for b in buffers for p in b]
    # An incremental save whose state fits the staging area puts its i-th buffer in slot i every time, so the
    # slot still holds what the last save staged there: a host piece equal to that is not copied (staging.Held).
    slotted = unit_bytes is not None and len(buffers) <= pool.limit
    for index, pieces in enumerate(buffers):
        slot, held = pool.acquire(job.token, on_wait=job.may_write.set, slot=index if slotted else None)
        try:
            _snapshot(job, leaves, copier, pool, slot, pieces, held)
        except BaseException:
            pool.release(slot)
            raise
        if slotted:
            job.slots.append((slot, pieces))
        worker.write(job, slot, pieces)


def _snapshot(job: job_lib.Job, leaves: list[state.Leaf], copier: _native.Copier, pool: staging.StagingPool,
              slot: int, pieces: list[plan.Piece], held: staging.Held | None) -> None:
    view = copier.view(pool.buffer(slot), pool.size)
    staged = _unchanged(view, leaves, pieces, held) if held is not None else {}
    for piece in pieces:
        leaf = leaves[piece.tensor][1]
        dst = view[piece.offset:piece.offset + piece.nbytes]
        if piece.entry in staged:  # unchanged since step held.step: staged already
            assert held is not None
            job.same[piece.entry] = held.step
            crc: int | None = staged[piece.entry]
        elif isinstance(leaf, state.DeviceArray):
            if copier.device < 0:
                raise errors.AcceleratorUnavailableError(
                    "the state holds CUDA tensors but this coordinator has no CUDA device (device='cpu' "
                    "or none found)")
            if leaf.stream is not None and leaf.stream not in job.ordered_streams:
                # the producer may still be writing the tensor on its stream: the copy waits for that
                copier.wait_stream(leaf.stream)
                job.ordered_streams.add(leaf.stream)
            crc = copier.copy(dst, leaf.pointer + piece.start, piece.nbytes, kind=_native.COPY_D2H)
        else:
            assert isinstance(leaf, np.ndarray)  # state.Leaf: a host array when not a DeviceArray
            crc = copier.copy(dst, staging.host_piece(leaf, piece))
        job.snapshot_crcs[piece.entry] = int(crc or 0)
    del view


def _unchanged(view: memoryview, leaves: list[state.Leaf], pieces: list[plan.Piece], held: staging.Held,
               ) -> dict[str, int]:
    """The host pieces whose bytes equal what the staging buffer (`view`) holds of them (`held`), with the CRC32C
    recorded for those bytes: compared in one call over every core."""
    known: list[tuple[plan.Piece, np.ndarray, int]] = []  # host pieces staged at the same place last time
    for p in pieces:
        leaf, recorded = leaves[p.tensor][1], held.pieces.get(p.entry)
        if recorded is not None and recorded[:2] == (p.offset, p.nbytes) and isinstance(leaf, np.ndarray):
            known.append((p, leaf, recorded[2]))
    same = _native.equal_pairs([(view[p.offset:p.offset + p.nbytes], staging.host_piece(leaf, p))
                                for p, leaf, _ in known])
    return {p.entry: crc for (p, _, crc), equal in zip(known, same, strict=True) if equal}
