"""Pure planning of a save: which tensors this rank writes, cut into which pieces, packed into which staging
buffers, and the manifest that joins the pieces of every rank again.

Why pure: the layout of a step (piece boundaries, entry names, buffer packing, which rank writes a replicated
tensor) decides what can be restored, so it is tested on its own, without threads, memory, disks or peers.

Every piece is a box of its global tensor (checkpoint/chunks.py) and becomes one chunk in the manifest, with
its CRC32C and one CRC32C per BLOCK_BYTES block, so a load at any world size reads only the blocks it needs and
checks every byte it reads (docs/FORMAT.md, "Sharded steps").
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from typing import Any

import numpy as np

from SneppX_ALG import errors
from SneppX_ALG.checkpoint import chunks
from SneppX_ALG.checkpoint import manifest as manifest_codec

DEFAULT_STAGING_BYTES = 1 << 30
MIN_BUFFER_BYTES = 1 << 20
MAX_BUFFER_BYTES = 64 << 20
SHARD_FILE = "shard-{:05d}.snpx"
_PIECE_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of this rank's state: where it sits in the tree, its dtype, the shape of the array this rank
    holds, and where that array lies in the global tensor (`placement`: None when it is the whole tensor, a
    replicated array; a box of the global tensor for a coordinator.Shard)."""

    path: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None

    @property
    def name(self) -> str:
        return "/".join(self.path)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize

    @property
    def sharded(self) -> bool:
        return self.global_shape is not None

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The global tensor's shape."""
        return self.global_shape if self.global_shape is not None else self.shape

    @property
    def origin(self) -> tuple[int, ...]:
        """Where this rank's array starts in the global tensor."""
        return self.global_offset if self.global_offset is not None else (0,) * len(self.shape)


@dataclasses.dataclass(frozen=True)
class Piece:
    """A box of one of this rank's arrays (`box`, relative to that array; contiguous in its C-order bytes, which
    are [start, start + nbytes)), staged at `offset` in buffer `buffer`, stored as `entry`."""

    tensor: int
    entry: str
    start: int
    nbytes: int
    box: chunks.Box
    buffer: int
    offset: int

    def global_box(self, spec: TensorSpec) -> chunks.Box:
        return chunks.Box(tuple(o + b for o, b in zip(spec.origin, self.box.offset, strict=True)), self.box.shape)


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def choose_buffer_bytes(state_bytes: int, staging_bytes: int) -> int:
    """Staging buffer size: about a quarter of the state (so copy and write overlap even when it all fits),
    between 1 and 64 MiB, and at most half the staging area (at least two buffers: double buffering)."""
    want = _align(max(1, state_bytes // 4), 4096)
    size = min(max(want, MIN_BUFFER_BYTES), MAX_BUFFER_BYTES, max(4096, staging_bytes // 2))
    return _align(size, 4096)


def replicated_owners(specs: list[TensorSpec], world_size: int) -> dict[tuple[str, ...], int]:
    """Which rank writes each replicated tensor (every rank holds it whole): the largest first, each to the rank
    that has the fewest replicated bytes so far (the lowest such rank on a tie), as DCP's save planner
    deduplicates. A pure function of the replicated tensors' paths and sizes, so every rank that declares the
    same ones computes the same owners without asking the others (the commit checks they did declare the
    same). Shards are not counted: each rank writes its own, and they are balanced by construction."""
    load = [0] * world_size
    owners: dict[tuple[str, ...], int] = {}
    for spec in sorted((s for s in specs if not s.sharded), key=lambda s: (-s.nbytes, s.path)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[spec.path] = rank
        load[rank] += spec.nbytes
    return owners


def replicated_declaration(specs: list[TensorSpec]) -> str:
    """A digest of the replicated tensors a rank declares (paths, dtypes, shapes): equal on every rank, or the
    ranks would compute different owners and some tensor would be written by none."""
    listed = sorted([list(s.path), s.dtype, list(s.shape)] for s in specs if not s.sharded)
    return hashlib.sha256(json.dumps(listed).encode()).hexdigest()


def plan_pieces(specs: list[TensorSpec], buffer_bytes: int, unit_bytes: int | None = None) -> list[list[Piece]]:
    """Packs every tensor's pieces into buffers of buffer_bytes, in order; returns the pieces per buffer.
    `unit_bytes` (incremental saves): no piece is larger, so a save can reference each piece that did not change
    on its own; the boundaries depend only on the specs, so the same state is cut the same way every save.

    Entry names in the shard: the tensor's path joined with "/" when it is one piece, else `name@<i>`;
    a name already taken gets "~" appended until it is unique (the manifest maps entries back to paths)."""
    largest = min(buffer_bytes, unit_bytes) if unit_bytes else buffer_bytes
    used: set[str] = set()
    own_name: dict[int, str] = {}
    for index, spec in enumerate(specs):  # whole tensors keep their own names first
        if spec.nbytes <= largest and spec.name not in used:
            used.add(spec.name)
            own_name[index] = spec.name

    def unique(name: str) -> str:
        while name in used:
            name += "~"
        used.add(name)
        return name

    buffers: list[list[Piece]] = [[]]
    fill = 0
    for index, spec in enumerate(specs):
        # A tensor that fits in a buffer moves whole to the next one when it doesn't fit here; a larger one
        # starts by filling this buffer, so buffers are full and the staging area holds as much as it can.
        room = buffer_bytes - _align(fill, _PIECE_ALIGN)
        parts = chunks.split_box(spec.shape, spec.itemsize, largest,
                                 room if spec.nbytes > largest and room < largest else None)
        for i, (start, nbytes, box) in enumerate(parts):
            if index in own_name:
                entry = own_name[index]
            else:
                entry = unique(f"{spec.name}@{i}" if len(parts) > 1 else spec.name)
            offset = _align(fill, _PIECE_ALIGN)
            if offset + nbytes > buffer_bytes and buffers[-1]:
                buffers.append([])
                offset = 0
            buffers[-1].append(Piece(index, entry, start, nbytes, box, len(buffers) - 1, offset))
            fill = offset + nbytes
    return [b for b in buffers if b]


def chunk_record(spec: TensorSpec, piece: Piece, shard: int, crc: int, blocks: str,
                 digests: str | None, reference: tuple[int, str] | None = None) -> dict[str, Any]:
    """A piece as a chunk of the manifest: the box of the global tensor it holds, where it is stored, its
    CRC32C, and its block checksums (hex: 8 digits per block CRC32C, 64 per block BLAKE3 in signed steps)."""
    box = piece.global_box(spec)
    record = {"shard": shard, "entry": piece.entry, "offset": list(box.offset), "shape": list(box.shape),
              "nbytes": piece.nbytes, "crc32c": crc, "blocks": blocks}
    if digests is not None:
        record["digests"] = digests
    if reference is not None:
        record["from"] = list(reference)
    return record


def rank_part(specs: list[TensorSpec], pieces: list[Piece], records: dict[str, dict[str, Any]],
              ) -> list[dict[str, Any]]:
    """What this rank wrote, per tensor (path, dtype, global shape, its chunks), for the manifest that rank 0
    builds from every rank's part. Tensors this rank declared but does not write are not listed."""
    out = []
    for index, spec in enumerate(specs):
        own = [records[p.entry] for p in pieces if p.tensor == index]
        if own:
            out.append({"path": list(spec.path), "dtype": spec.dtype, "shape": list(spec.full_shape),
                        "chunks": own})
    return out


def merge_parts(parts: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The manifest's tensors from every rank's part (rank order): each tensor's chunks from all ranks, which
    must agree on its dtype and global shape and cover it exactly once (ShardingMismatchError otherwise)."""
    tensors: dict[tuple[str, ...], dict[str, Any]] = {}
    for rank, part in enumerate(parts):
        for tensor in part:
            path = tuple(tensor["path"])
            merged = tensors.setdefault(path, {**tensor, "chunks": []})
            if (merged["dtype"], merged["shape"]) != (tensor["dtype"], tensor["shape"]):
                raise errors.ShardingMismatchError(
                    f"tensor {'/'.join(path)}: rank {rank} saved it as {tensor['dtype']}{tensor['shape']}, an "
                    f"earlier rank as {merged['dtype']}{merged['shape']}")
            merged["chunks"] += tensor["chunks"]
    out = []
    for path, tensor in tensors.items():
        shape = tuple(tensor["shape"])
        problem = chunks.tiling_problem(shape, [chunks.Box(tuple(c["offset"]), tuple(c["shape"]))
                                                for c in tensor["chunks"]])
        if problem is not None:
            raise errors.ShardingMismatchError(f"tensor {'/'.join(path)}: the ranks' shards don't cover it "
                                               f"exactly once: {problem}")
        nbytes = sum(c["nbytes"] for c in tensor["chunks"])
        out.append({**tensor, "nbytes": nbytes})
    return out


def build_manifest(step: int, tensors: list[dict[str, Any]], values: list[tuple[tuple[str, ...], Any]], kind: str,
                   training_state: Any, shards: list[str], *, world_size: int = 1, generation: int = 0,
                   block_bytes: int = manifest_codec.BLOCK_BYTES,
                   files: dict[str, dict[str, Any]] | None = None, chain: int = 0) -> dict[str, Any]:
    """The step's manifest (version 3; version 4 with `uses` when a chunk references an earlier step's file).
    `shards[r]` is rank r's file; `files`: {shard name: {"size", "digest"}}, what a signature over the manifest
    vouches for (docs/FORMAT.md, "Multi-file checkpoints"); `chain`: saves since the last full one (the most of
    any rank), written with the references."""
    uses = sorted({step for step, _ in manifest_codec.references(tensors)})
    version = manifest_codec.INCREMENTAL_VERSION if uses else manifest_codec.MANIFEST_VERSION
    return {
        "format": manifest_codec.MANIFEST_FORMAT, "version": version, "step": step,
        **({"uses": uses, "chain": max(chain, 1)} if uses else {}),
        "created": datetime.datetime.now(datetime.UTC).isoformat(),
        "world_size": world_size, "generation": generation, "block_bytes": block_bytes,
        "kind": kind, "shards": shards, "tensors": tensors,
        "values": [{"path": list(path), "value": value} for path, value in values],
        "training_state": training_state,
        **({"files": files} if files is not None else {}),
    }
