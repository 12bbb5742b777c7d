"""`apply`: the parts a recovery chose (one per old rank) copied into the target, each target tensor getting its
box of every snapshot tensor: the resharding from the old world size to the new one.

Separate because it is the one part that knows the target's shape (the coordinator's restore targets, the whole
state when there are no Shards), and nothing of how the parts travelled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from SneppX_ALG import errors
from SneppX_ALG.checkpoint import chunks, format
from SneppX_ALG.coordinator import state as state_lib
from SneppX_ALG.elastic.snapshot.image import Snapshot

Piece = tuple[dict[str, Any], np.ndarray]  # a snapshot tensor's description, and its data in its local shape


def apply(obj: Any, parts: list[Snapshot]) -> None:
    """Copies what `parts` (one per old rank; the first whole, with the replicated arrays and plain values, the
    others their unique parts) hold into `obj`, each target getting its box of each tensor: the resharding.

    All or nothing: every target's dtype, global shape, box and coverage (and every plain value) is checked
    before the first byte is written; ShardingMismatchError says what does not fit, and `obj` is untouched."""
    pieces: dict[tuple[str, ...], list[Piece]] = {}
    for part in parts:
        for t in part.meta["tensors"]:
            data = part.payload[t["at"]:t["at"] + t["nbytes"]].view(format.numpy_dtype(t["dtype"]))
            pieces.setdefault(tuple(t["path"]), []).append((t, data.reshape(t["local"])))
    values = {tuple(v["path"]): v["value"] for v in parts[0].meta["values"]}
    step = int(parts[0].meta["step"])
    targets = state_lib.restore_targets(obj)
    if targets is None:
        _apply_whole(obj, parts[0].meta["kind"], pieces, values, step)
        return
    writes = []
    for need, destination in zip(targets.needs, targets.destinations, strict=True):  # check everything first
        out = destination.data if isinstance(destination, state_lib.Shard) else destination
        found = pieces.get(need.path, [])
        shape, dtype = _saved(need.path, found)
        want = need.resolve(shape, dtype, step)
        overlaps = []
        for t, data in found:
            common = chunks.intersect(_box(t), want)
            if common is not None:
                overlaps.append((t, data, common))
        _disjoint(need.path, [common for _, _, common in overlaps])  # else a sum of volumes hides a hole
        filled = sum(common.volume for _, _, common in overlaps)
        if filled != want.volume:
            raise errors.ShardingMismatchError(f"{'/'.join(need.path)}: the snapshot covers {filled} of the "
                                               f"{want.volume} elements the target needs")
        writes.append((out, want, overlaps))
    missing = [p for p in targets.values if p not in values]
    if missing:
        raise errors.ShardingMismatchError(f"the snapshot has no value {'/'.join(missing[0])}")
    for out, want, overlaps in writes:
        for t, data, common in overlaps:
            out[common.slices(want.offset)] = data[common.slices(_box(t).offset)]
    for path in targets.values:
        state_lib.set_path(targets.tree, list(path), values[path])  # type: ignore[arg-type]
    if targets.finish is not None:
        targets.finish(targets.tree)


def _box(t: dict[str, Any]) -> chunks.Box:
    """Where a snapshot tensor lies in its global tensor."""
    return chunks.Box(tuple(t["offset"] or [0] * len(t["shape"])), tuple(t["local"]))


def _disjoint(path: tuple[str, ...], boxes: list[chunks.Box]) -> None:
    """ShardingMismatchError when two parts' boxes of one tensor overlap (descriptions that do not belong
    together): coverage is counted as a sum of volumes, which one overlap and one hole of its size would pass."""
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if chunks.intersect(a, b) is not None:
                raise errors.ShardingMismatchError(
                    f"{'/'.join(path)}: the snapshot's parts overlap at {list(a.offset)} and {list(b.offset)}")


def _saved(path: tuple[str, ...], found: list[Piece]) -> tuple[tuple[int, ...], str]:
    """(global shape, dtype) every piece of a tensor agrees on; ShardingMismatchError when there is none, or
    pieces disagree (parts of steps that do not belong together)."""
    if not found:
        raise errors.ShardingMismatchError(f"the snapshot has no tensor {'/'.join(path)}")
    described = {(tuple(t["shape"]), t["dtype"]) for t, _ in found}
    if len(described) != 1:
        raise errors.ShardingMismatchError(f"{'/'.join(path)}: the snapshot's parts disagree on its global shape "
                                           f"and dtype: {sorted(described)}")
    return described.pop()


def _apply_whole(obj: Any, kind: str, pieces: Mapping[tuple[str, ...], list[Piece]],
                 values: Mapping[tuple[str, ...], Any], step: int) -> None:
    """A target with no Shards: every tensor whole, assembled from its boxes (as coordinator's whole restore),
    each checked to be covered exactly before the target is given any of it."""
    tree: dict[str, Any] = {}
    for path, boxes in pieces.items():
        shape, dtype = _saved(path, boxes)
        _disjoint(path, [_box(t) for t, _ in boxes])  # else a sum of volumes hides a hole
        whole = np.empty(shape, format.numpy_dtype(dtype))
        covered = 0
        for t, data in boxes:
            have = _box(t)
            if not chunks.inside(shape, have):
                raise errors.ShardingMismatchError(f"{'/'.join(path)}: a part at {list(have.offset)} of shape "
                                                   f"{list(have.shape)} is not inside {list(shape)} (step {step})")
            whole[have.slices()] = data
            covered += have.volume
        if covered != int(np.prod(shape, dtype=np.int64)):
            raise errors.ShardingMismatchError(f"{'/'.join(path)}: the snapshot covers {covered} of its "
                                               f"{int(np.prod(shape, dtype=np.int64))} elements")
        state_lib.set_path(tree, list(path), whole)
    for path, value in values.items():
        state_lib.set_path(tree, list(path), value)
    state_lib.load_whole(obj, kind, tree)
