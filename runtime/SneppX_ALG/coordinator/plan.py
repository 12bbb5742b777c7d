"""Pure planning of a save: which tensors, cut into which pieces, packed into which staging buffers, and
the manifest that joins the pieces again.

Why pure: the layout of a step (piece boundaries, entry names, buffer packing) decides what can be
restored, so it is tested on its own, without threads, memory or disks.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import numpy as np

from SneppX_ALG.checkpoint import manifest as manifest_codec

DEFAULT_STAGING_BYTES = 1 << 30
MIN_BUFFER_BYTES = 1 << 20
MAX_BUFFER_BYTES = 64 << 20
SHARD_FILE = "shard-{:05d}.snpx"
_PIECE_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of the state: where it sits in the tree, and its dtype and shape."""

    path: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    itemsize: int

    @property
    def name(self) -> str:
        return "/".join(self.path)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize


@dataclasses.dataclass(frozen=True)
class Piece:
    """A contiguous byte range of one tensor, staged at `offset` in buffer `buffer`, stored as `entry`."""

    tensor: int
    entry: str
    start: int
    nbytes: int
    shape: tuple[int, ...]
    global_offset: tuple[int, ...] | None
    buffer: int
    offset: int


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def choose_buffer_bytes(state_bytes: int, staging_bytes: int) -> int:
    """Staging buffer size: about a quarter of the state (so copy and write overlap even when it all fits),
    between 1 and 64 MiB, and at most half the staging area (at least two buffers: double buffering)."""
    want = _align(max(1, state_bytes // 4), 4096)
    size = min(max(want, MIN_BUFFER_BYTES), MAX_BUFFER_BYTES, max(4096, staging_bytes // 2))
    return _align(size, 4096)


def split_tensor(spec: TensorSpec, max_bytes: int,
                 first_bytes: int | None = None) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...] | None]]:
    """(start byte, nbytes, stored shape, global offset) of each piece of a tensor: the first piece at most
    first_bytes (to fill what is left of a buffer; skipped when not even one unit fits), the others at most
    max_bytes. Pieces are blocks of rows (dimension 0) when a row fits in max_bytes, else flat ranges."""
    total = spec.nbytes
    first = max_bytes if first_bytes is None else min(first_bytes, max_bytes)
    if total <= first:
        return [(0, total, spec.shape, None)]
    shape = spec.shape
    by_rows = len(shape) >= 1 and shape[0] > 1 and total // shape[0] <= max_bytes
    unit = total // shape[0] if by_rows else spec.itemsize
    out: list[tuple[int, int, tuple[int, ...], tuple[int, ...] | None]] = []
    start, budget = 0, first
    while start < total:
        n = min(budget // unit * unit, total - start)
        if n > 0:
            if by_rows:
                out.append((start, n, (n // unit, *shape[1:]), (start // unit,) + (0,) * (len(shape) - 1)))
            else:
                out.append((start, n, (n // unit,), None))
            start += n
        budget = max_bytes
    return out


def plan_pieces(specs: list[TensorSpec], buffer_bytes: int) -> list[list[Piece]]:
    """Packs every tensor's pieces into buffers of buffer_bytes, in order; returns the pieces per buffer.

    Entry names in the shard: the tensor's path joined with "/" when it is one piece, else `name@<i>`;
    a name already taken gets "~" appended until it is unique (the manifest maps entries back to paths)."""
    used: set[str] = set()
    own_name: dict[int, str] = {}
    for index, spec in enumerate(specs):  # whole tensors keep their own names first
        if spec.nbytes <= buffer_bytes and spec.name not in used:
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
        parts = split_tensor(spec, buffer_bytes, room if spec.nbytes > buffer_bytes else None)
        for i, (start, nbytes, shape, global_offset) in enumerate(parts):
            if index in own_name:
                entry = own_name[index]
            else:
                entry = unique(f"{spec.name}@{i}" if len(parts) > 1 else spec.name)
            offset = _align(fill, _PIECE_ALIGN)
            if offset + nbytes > buffer_bytes and buffers[-1]:
                buffers.append([])
                offset = 0
            buffers[-1].append(Piece(index, entry, start, nbytes, shape, global_offset, len(buffers) - 1, offset))
            fill = offset + nbytes
    return [b for b in buffers if b]


def build_manifest(step: int, specs: list[TensorSpec], pieces: list[Piece], crcs: dict[str, int],
                   values: list[tuple[tuple[str, ...], Any]], kind: str, training_state: Any,
                   shards: list[str], files: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The step's manifest. `files`: {shard name: {"size", "digest"}}, what a signature over the manifest
    vouches for (docs/FORMAT.md, "Multi-file checkpoints")."""
    tensors = []
    for index, spec in enumerate(specs):
        own = [p for p in pieces if p.tensor == index]
        tensors.append({
            "path": list(spec.path), "dtype": spec.dtype, "shape": list(spec.shape), "nbytes": spec.nbytes,
            "pieces": [{"shard": 0, "entry": p.entry, "start": p.start, "nbytes": p.nbytes,
                        "crc32c": crcs[p.entry]} for p in own]})
    return {
        "format": manifest_codec.MANIFEST_FORMAT, "version": manifest_codec.MANIFEST_VERSION, "step": step,
        "created": datetime.datetime.now(datetime.UTC).isoformat(),
        "world_size": 1, "kind": kind, "shards": shards, "tensors": tensors,
        "values": [{"path": list(path), "value": value} for path, value in values],
        "training_state": training_state,
        **({"files": files} if files is not None else {}),
    }
