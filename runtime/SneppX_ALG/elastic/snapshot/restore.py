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


def apply(obj: Any, parts: list[Snapshot]) -> None:
    """Copies what `parts` (one per old rank; the first whole, with the replicated arrays and plain values, the
    others their unique parts) hold into `obj`, each target getting its box of each tensor: the resharding."""
    pieces: dict[tuple[str, ...], list[tuple[dict[str, Any], np.ndarray]]] = {}
    for part in parts:
        for t in part.meta["tensors"]:
            data = part.payload[t["at"]:t["at"] + t["nbytes"]].view(format.numpy_dtype(t["dtype"]))
            pieces.setdefault(tuple(t["path"]), []).append((t, data.reshape(t["local"])))
    values = {tuple(v["path"]): v["value"] for v in parts[0].meta["values"]}
    targets = state_lib.restore_targets(obj)
    if targets is None:
        _apply_whole(obj, parts[0].meta["kind"], pieces, values)
        return
    for need, destination in zip(targets.needs, targets.destinations, strict=True):
        out = destination.data if isinstance(destination, state_lib.Shard) else destination
        want = need.box if need.box is not None else chunks.Box.whole(tuple(out.shape))
        filled = 0
        for t, data in pieces.get(need.path, []):
            if need.dtype is not None and need.dtype != t["dtype"]:
                raise errors.ShardingMismatchError(f"{'/'.join(need.path)} was snapshot as {t['dtype']}, the "
                                                   f"target is {need.dtype}")
            have = chunks.Box(tuple(t["offset"] or [0] * len(t["shape"])), tuple(t["local"]))
            common = chunks.intersect(have, want)
            if common is not None:
                out[common.slices(want.offset)] = data[common.slices(have.offset)]
                filled += common.volume
        if filled != want.volume:
            raise errors.ShardingMismatchError(f"{'/'.join(need.path)}: the snapshot covers {filled} of the "
                                               f"{want.volume} elements the target needs")
    missing = [p for p in targets.values if p not in values]
    if missing:
        raise errors.ShardingMismatchError(f"the snapshot has no value {'/'.join(missing[0])}")
    for path in targets.values:
        state_lib.set_path(targets.tree, list(path), values[path])  # type: ignore[arg-type]
    if targets.finish is not None:
        targets.finish(targets.tree)


def _apply_whole(obj: Any, kind: str, pieces: Mapping[tuple[str, ...], list[tuple[dict[str, Any], np.ndarray]]],
                 values: Mapping[tuple[str, ...], Any]) -> None:
    """A target with no Shards: every tensor whole, assembled from its boxes (as coordinator's whole restore)."""
    tree: dict[str, Any] = {}
    for path, boxes in pieces.items():
        first = boxes[0][0]
        whole = np.empty(first["shape"], format.numpy_dtype(first["dtype"]))
        for t, data in boxes:
            have = chunks.Box(tuple(t["offset"] or [0] * len(t["shape"])), tuple(t["local"]))
            whole[have.slices()] = data
        state_lib.set_path(tree, list(path), whole)
    for path, value in values.items():
        state_lib.set_path(tree, list(path), value)
    state_lib.load_whole(obj, kind, tree)
