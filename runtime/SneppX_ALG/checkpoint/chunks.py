"""Boxes of a tensor: where a saved chunk or a needed block lies in the global tensor, which bytes of a saved
chunk a load must read, and which checksum blocks those bytes fall in. Pure (numpy only, no I/O).

Why: a sharded checkpoint stores every tensor as chunks, each a box (offset and shape per dimension) of the
global tensor, written by whichever rank held it. Loading at another world size, each rank names the boxes
it needs; the loader intersects them with the saved chunks dimension by dimension (as PyTorch DCP's planner
does) and reads only the bytes of each intersection. A chunk is stored in C order, so the intersection is a
set of contiguous byte runs in it; every chunk carries a CRC32C per `block_bytes` block, so a load reads the
blocks its runs touch and checks each one: what it reads beyond the runs is alignment to those blocks
(docs/FORMAT.md, "Sharded steps").
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Box:
    """[offset, offset + shape) in every dimension of a tensor (a 0-d tensor is the box () of one element)."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape, strict=True))

    @property
    def volume(self) -> int:
        return math.prod(self.shape)

    def slices(self, origin: tuple[int, ...] | None = None) -> tuple[slice, ...]:
        """This box as slices of an array whose element [0, ...] is at `origin` (default: the global origin)."""
        origin = origin or (0,) * len(self.offset)
        return tuple(slice(o - base, o - base + s) for o, s, base in zip(self.offset, self.shape, origin,
                                                                          strict=True))

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> Box:
        return cls((0,) * len(shape), tuple(shape))


def intersect(a: Box, b: Box) -> Box | None:
    """The box both cover, or None when they share no element."""
    lo = tuple(max(x, y) for x, y in zip(a.offset, b.offset, strict=True))
    hi = tuple(min(x, y) for x, y in zip(a.stop, b.stop, strict=True))
    if any(h <= low for low, h in zip(lo, hi)) or a.volume == 0 or b.volume == 0:
        return None
    return Box(lo, tuple(h - low for low, h in zip(lo, hi)))


def inside(shape: tuple[int, ...], box: Box) -> bool:
    """Whether `box` lies within a tensor of `shape` (same rank, every index in range)."""
    return (len(box.offset) == len(box.shape) == len(shape)
            and all(o >= 0 and s >= 0 and o + s <= n for o, s, n in zip(box.offset, box.shape, shape)))


def is_contiguous(outer: tuple[int, ...], box: Box) -> bool:
    """Whether `box`, inside a C-order array of shape `outer` (box offsets relative to it), is one contiguous byte
    range: size 1 in every dimension before some k, and the full extent in every dimension after it."""
    ndim = len(outer)
    k = max((i for i in range(ndim) if box.shape[i] != outer[i]), default=-1)
    return all(box.shape[i] == 1 for i in range(k))


def byte_runs(chunk: Box, part: Box, itemsize: int) -> np.ndarray:
    """The contiguous byte runs `part` (inside `chunk`, both global) occupies in the chunk's C-order bytes:
    an (n, 2) int64 array of [start, stop), ascending and disjoint, each as long as it can be."""
    if part.volume == 0:
        return np.zeros((0, 2), np.int64)
    ndim = len(chunk.shape)
    if ndim == 0:
        return np.array([[0, itemsize]], np.int64)
    strides = [itemsize * math.prod(chunk.shape[i + 1:]) for i in range(ndim)]
    rel = [p - c for p, c in zip(part.offset, chunk.offset, strict=True)]
    # The last dimension where part is narrower than chunk: each run spans it and everything after it.
    k = max((i for i in range(ndim) if part.shape[i] != chunk.shape[i]), default=0)
    length = part.shape[k] * strides[k]
    starts = np.array([rel[k] * strides[k]], np.int64)
    for i in range(k - 1, -1, -1):  # one run per index of the dimensions before k
        rows = (rel[i] + np.arange(part.shape[i], dtype=np.int64)) * strides[i]
        starts = (rows[:, None] + starts[None, :]).reshape(-1)
    return np.stack([starts, starts + length], axis=1)


def touched_blocks(runs: np.ndarray, block_bytes: int) -> np.ndarray:
    """The checksum blocks that byte runs touch, as an (m, 2) int64 array of [first block, stop block),
    ascending and coalesced (a range of adjacent blocks is one read)."""
    if len(runs) == 0:
        return np.zeros((0, 2), np.int64)
    first = runs[:, 0] // block_bytes
    stop = (runs[:, 1] - 1) // block_bytes + 1
    # Runs are ascending: a new range starts where a run's first block is past every block before it.
    reach = np.maximum.accumulate(stop)
    new = np.ones(len(first), bool)
    new[1:] = first[1:] > reach[:-1]
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(first)) - 1
    return np.stack([first[starts], reach[ends]], axis=1)


def tiling_problem(shape: tuple[int, ...], boxes: list[Box]) -> str | None:
    """Why `boxes` do not cover a tensor of `shape` exactly once (a hole, an overlap, a box outside it), or
    None when they do."""
    ndim = len(shape)
    for box in boxes:
        if len(box.offset) != ndim or len(box.shape) != ndim:
            return f"a chunk of rank {len(box.shape)} in a tensor of rank {ndim}"
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(box.offset, box.shape, shape)):
            return f"chunk at {list(box.offset)} of shape {list(box.shape)} lies outside {list(shape)}"
    total = sum(box.volume for box in boxes)
    if total != math.prod(shape):
        return f"chunks hold {total} elements of {math.prod(shape)}"
    full = [b for b in boxes if b.volume]
    if len(full) < 2:  # (a 0-d tensor: the count above allows exactly one chunk)
        return None
    lo = np.array([b.offset for b in full], np.int64)
    hi = np.array([b.stop for b in full], np.int64)
    for start in range(0, len(full), 1024):  # pairwise, in slices: O(n^2) comparisons, bounded memory
        a_lo, a_hi = lo[start:start + 1024, None, :], hi[start:start + 1024, None, :]
        overlap = np.asarray(((a_lo < hi[None]) & (lo[None] < a_hi)).all(axis=2))
        overlap[np.arange(overlap.shape[0]), start + np.arange(overlap.shape[0])] = False
        if overlap.any():
            i, j = np.argwhere(overlap)[0]
            return (f"chunks at {list(full[start + i].offset)} and {list(full[j].offset)} overlap "
                    f"(shapes {list(full[start + i].shape)}, {list(full[j].shape)})")
    return None


def split_box(shape: tuple[int, ...], itemsize: int, max_bytes: int, first_bytes: int | None = None,
              ) -> list[tuple[int, int, Box]]:
    """(start byte, nbytes, box) of each piece an array of `shape` is cut into so that every piece holds at
    most max_bytes (the first at most first_bytes, to fill what is left of a staging buffer; skipped when not
    even one unit fits). Every piece is a box that is contiguous in the array's C-order bytes: blocks of
    index ranges along the first dimension k whose slices (everything after k) fit, one index at a time in
    the dimensions before k."""
    total = math.prod(shape) * itemsize
    first = max_bytes if first_bytes is None else min(first_bytes, max_bytes)
    if total <= first or not shape:  # (a 0-d tensor is one element: it can't be cut)
        return [(0, total, Box.whole(shape))]
    ndim = len(shape)
    k = next(i for i in range(ndim) if math.prod(shape[i + 1:]) * itemsize <= max_bytes)
    unit = math.prod(shape[k + 1:]) * itemsize
    out: list[tuple[int, int, Box]] = []
    budget = first
    for outer in np.ndindex(*shape[:k]) if k else [()]:
        index = 0
        while index < shape[k]:
            count = min(budget // unit, shape[k] - index)
            if count > 0:
                offset = (*outer, index) + (0,) * (ndim - k - 1)
                box = Box(tuple(int(o) for o in offset), (1,) * k + (count,) + tuple(shape[k + 1:]))
                start = int(np.ravel_multi_index(box.offset, shape)) * itemsize if ndim else 0
                out.append((start, count * unit, box))
                index += count
            budget = max_bytes
    return out
