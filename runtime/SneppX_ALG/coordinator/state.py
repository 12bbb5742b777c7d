"""The user's state as SneppX sees it: flattened into tensors and plain values on save, rebuilt on restore.

Why: `save()` takes a model with `state_dict()`, an object with `sharded_state_dict()`, or a (nested) dict of
numpy, DLPack or CUDA arrays and `Shard`s; the rest of the coordinator works on a flat list of (path, array,
placement) and (path, JSON value). This module is the only one that knows about the shapes a user's state can
take.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

import numpy as np

from SneppX_ALG import errors
from SneppX_ALG.checkpoint import arrays, chunks, format, reshard
from SneppX_ALG.coordinator import plan


@dataclasses.dataclass(frozen=True)
class Shard:
    """This rank's block of a larger, global tensor, in a state given to `save()` or `restore()`.

    `data` holds `global[o0:o0 + data.shape[0], o1:o1 + data.shape[1], ...]` of a tensor of `global_shape`, where
    (o0, o1, ...) is `global_offset`. On save, `data` is anything an array leaf may be (numpy, DLPack, CUDA);
    the ranks' shards of one tensor must cover it exactly once. On restore, `data` is a writable C-contiguous
    numpy array that receives that block of the saved tensor, whatever world size saved it. An array in a
    state that is not a Shard is replicated: every rank holds it whole (it is written by one rank)."""

    data: Any
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]

    def __post_init__(self) -> None:
        shape, offset = tuple(self.global_shape), tuple(self.global_offset)
        if not all(isinstance(v, (int, np.integer)) and v >= 0 for v in (*shape, *offset)):
            raise ValueError(f"Shard: global_shape {shape} and global_offset {offset} must be ints >= 0")
        object.__setattr__(self, "global_shape", tuple(int(v) for v in shape))
        object.__setattr__(self, "global_offset", tuple(int(v) for v in offset))

    def box(self, local_shape: tuple[int, ...]) -> chunks.Box:
        """The box of the global tensor this shard is, given its data's shape (UnsupportedTensorError when it
        does not fit)."""
        if not (len(local_shape) == len(self.global_shape) == len(self.global_offset)
                and format.shard_fits(local_shape, self.global_shape, self.global_offset)):
            raise errors.UnsupportedTensorError(
                f"a Shard of shape {list(local_shape)} at {list(self.global_offset)} does not fit in a tensor of "
                f"shape {list(self.global_shape)}")
        return chunks.Box(self.global_offset, local_shape)


@dataclasses.dataclass
class DeviceArray:
    """A CUDA array seen through __cuda_array_interface__ (torch, cupy): pointer, dtype, shape, device, and
    the producer's stream the copy must be ordered after (None: the interface asks for no ordering).

    `keepalive` holds the object that exposed the interface and the tree it came from (a state_dict()
    result may be its only owner): the pointer is only valid while they live, so they live as long as
    this does, which is until the snapshot's copy has landed (save() holds its leaves until it returns,
    and the copy engine returns only when every byte is in staging)."""

    pointer: int
    dtype: np.dtype
    shape: tuple[int, ...]
    device: int
    stream: int | None = None
    keepalive: tuple[Any, ...] = ()


def producer_stream(cai: Mapping[str, Any]) -> int | None:
    """The stream a consumer must order after, from __cuda_array_interface__ (version 3's "stream": absent
    or None for none, 1 the legacy default stream, 2 the per-thread default stream, else a cudaStream_t;
    0 is disallowed by the spec as ambiguous)."""
    stream = cai.get("stream")
    if stream is None:
        return None
    if isinstance(stream, bool) or not isinstance(stream, int) or stream < 0:
        raise errors.UnsupportedTensorError(f"__cuda_array_interface__ stream {stream!r} is not a stream handle")
    if stream == 0:
        raise errors.UnsupportedTensorError("__cuda_array_interface__ stream 0 is ambiguous (legacy or "
                                            "per-thread default stream) and disallowed by the interface")
    return stream


def is_c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether byte strides describe a C-contiguous layout (computed, never allocated: the tensor may be
    as large as a GPU's memory). A dimension of size 1 may have any stride, and an empty tensor is any
    layout, as in numpy's and torch's own contiguity flags."""
    if len(strides) != len(shape):
        return False
    if 0 in shape:
        return True
    expected = itemsize
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def leaf_of(value: Any) -> np.ndarray | DeviceArray | None:
    """The array behind a state value, or None when it is a plain JSON value."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, np.generic):
        return np.asarray(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    cai = getattr(value, "__cuda_array_interface__", None)
    if cai is not None:
        strides = cai.get("strides")
        dtype = np.dtype(cai["typestr"])
        shape = tuple(int(d) for d in cai["shape"])
        if strides is not None and not is_c_contiguous(shape, tuple(strides), dtype.itemsize):
            raise errors.UnsupportedTensorError("a non-contiguous CUDA tensor can't be snapshot; call "
                                                ".contiguous() first")
        device = getattr(value, "device", None)
        index = getattr(device, "index", None)
        if index is None:
            index = getattr(device, "id", 0)
        return DeviceArray(int(cai["data"][0]), dtype, shape, int(index or 0), producer_stream(cai), (value,))
    return arrays.as_array(value)


Leaf = tuple[tuple[str, ...], np.ndarray | DeviceArray, Shard | None]


def state_tree(obj: Any) -> tuple[str, Mapping[str, Any]]:
    """(kind, tree) of what save() was given: an object with sharded_state_dict() (a trainer whose state is
    sharded over ranks), one with state_dict() (a model), or a (nested) mapping."""
    if hasattr(obj, "sharded_state_dict") and callable(obj.sharded_state_dict):
        return "sharded", obj.sharded_state_dict()
    if hasattr(obj, "state_dict") and callable(obj.state_dict):
        return "state_dict", obj.state_dict()
    if isinstance(obj, Mapping):
        return "mapping", obj
    raise errors.UnsupportedTensorError(f"can't checkpoint a {type(obj).__name__}: pass an object with "
                                        "state_dict()/load_state_dict() or a dict of arrays")


def flatten_state(obj: Any) -> tuple[str, list[Leaf], list[tuple[tuple[str, ...], Any]]]:
    """(kind, tensors as (path, array, Shard or None), plain values) of what save() was given."""
    kind, tree = state_tree(obj)
    tensors: list[Leaf] = []
    values: list[tuple[tuple[str, ...], Any]] = []

    def walk(node: Mapping[Any, Any], prefix: tuple[str, ...]) -> None:
        for key, value in node.items():
            if not isinstance(key, str) or not key:
                raise errors.UnsupportedTensorError(f"state key {key!r} at {'/'.join(prefix) or 'top'} must be a "
                                                    "non-empty string")
            path = (*prefix, key)
            if isinstance(value, Mapping):
                walk(value, path)
                continue
            shard = value if isinstance(value, Shard) else None
            leaf = leaf_of(shard.data if shard is not None else value)
            if leaf is None:
                if shard is not None:
                    raise errors.UnsupportedTensorError(f"the Shard at {'/'.join(path)} holds no array")
                values.append((path, value))
            else:
                if isinstance(leaf, DeviceArray):  # the pointer is valid only while its owners live
                    leaf.keepalive = (value, tree)
                if shard is not None:
                    shard.box(tuple(int(d) for d in leaf.shape))  # fits, or a typed error now
                tensors.append((path, leaf, shard))

    walk(tree, ())
    return kind, tensors, values


def check_json_safe(value: Any, what: str) -> None:
    try:
        format.check_config(value)
    except errors.SneppXError as e:
        raise errors.UnsupportedTensorError(f"{what} must be JSON-safe (it goes into manifest.json): "
                                            f"{e}") from None


def tensor_spec(path: tuple[str, ...], leaf: np.ndarray | DeviceArray, shard: Shard | None) -> plan.TensorSpec:
    dtype = leaf.dtype
    return plan.TensorSpec(path, format.dtype_name(dtype), tuple(int(d) for d in leaf.shape), dtype.itemsize,
                           shard.global_shape if shard is not None else None,
                           shard.global_offset if shard is not None else None)


def check_entry_names(pieces: Iterable[plan.Piece]) -> None:
    """Every shard entry name passes the format's own rule (format.check_name: no NUL, valid Unicode, length),
    so a state key the writer would refuse fails the save() that passed it, not the background write (whose
    error would then fail the next save())."""
    for piece in pieces:
        try:
            format.check_name(piece.entry)
        except errors.CorruptTableError as e:
            raise errors.UnsupportedTensorError(f"can't save this state: {e.reason}") from None


def set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def load_into_mapping(target: MutableMapping[str, Any], loaded: Mapping[str, Any]) -> None:
    """Writes arrays into the existing ones where dtype and shape match, numpy arrays or host tensors of
    another framework seen through DLPack or the array interface (references stay valid); anything else
    is replaced by the loaded value."""
    for key, value in loaded.items():
        current = target.get(key)
        if isinstance(value, dict) and isinstance(current, MutableMapping):
            load_into_mapping(current, value)
        elif isinstance(value, np.ndarray) and (existing := _host_view(current)) is not None \
                and existing.flags.writeable and existing.shape == value.shape and existing.dtype == value.dtype:
            np.copyto(existing, value)
        else:
            target[key] = value


def _host_view(value: Any) -> np.ndarray | None:
    """A numpy view of a host tensor the state held (to load into it), or None."""
    if value is None or isinstance(value, (bool, int, float, str, Mapping)):
        return None
    try:
        return arrays.as_array(value)
    except errors.UnsupportedTensorError:
        return None


def tree_of(manifest: dict[str, Any], arrays: list[np.ndarray]) -> dict[str, Any]:
    """The saved tree: the manifest's tensors (as validate.load_step read them: owned, writable arrays, one
    per manifest tensor) and plain values at their paths."""
    tree: dict[str, Any] = {}
    for tensor, array in zip(manifest["tensors"], arrays, strict=True):
        set_path(tree, tensor["path"], array)
    for value in manifest["values"]:
        set_path(tree, value["path"], value["value"])
    return tree


def load_whole(obj: Any, kind: str, tree: dict[str, Any]) -> None:
    """Hands a whole saved tree to `obj`: load_state_dict() when it was saved from one (`kind`), else a dict
    updated in place, else load_state_dict() anyway."""
    if kind == "state_dict" and hasattr(obj, "load_state_dict"):
        obj.load_state_dict(tree)
    elif isinstance(obj, MutableMapping):
        load_into_mapping(obj, tree)
    elif hasattr(obj, "load_state_dict"):
        obj.load_state_dict(tree)
    else:
        raise errors.UnsupportedTensorError(f"can't restore into a {type(obj).__name__}")


# ---- restoring into a sharded state: what each rank asks for, and where it goes ------------------------------


@dataclasses.dataclass
class Targets:
    """What a resharded restore fills: for each tensor of `tree` the Need handed to the loader and where the
    result goes (a Shard's data, or the plain array to overwrite), the paths of plain values, and the call
    that hands the filled tree back to its owner (load_sharded_state_dict), if any."""

    tree: Mapping[str, Any]
    needs: list[reshard.Need]
    destinations: list[Shard | np.ndarray]
    values: list[tuple[str, ...]]
    finish: Callable[[Any], Any] | None


def restore_targets(obj: Any) -> Targets | None:
    """The targets of a resharded restore, or None for a whole one: an object with sharded_state_dict() (and
    load_sharded_state_dict()), or a mapping that holds at least one Shard. Targets must be writable numpy
    arrays: each Shard receives its box of the saved tensor, each plain array the whole tensor (same shape)."""
    if hasattr(obj, "sharded_state_dict") and callable(obj.sharded_state_dict):
        tree, finish = obj.sharded_state_dict(), getattr(obj, "load_sharded_state_dict", None)
    elif isinstance(obj, Mapping) and _holds_shard(obj):
        tree, finish = obj, None
    else:
        return None
    targets = Targets(tree, [], [], [], finish)

    def walk(node: Mapping[str, Any], prefix: tuple[str, ...]) -> None:
        for key, value in node.items():
            path = (*prefix, str(key))
            if isinstance(value, Mapping):
                walk(value, path)
                continue
            shard = value if isinstance(value, Shard) else None
            array = shard.data if shard is not None else value
            if leaf_of(array) is None and shard is None:
                targets.values.append(path)
                continue
            if not (isinstance(array, np.ndarray) and array.flags.writeable):
                raise errors.UnsupportedTensorError(f"restore target {'/'.join(path)} must be a writable numpy "
                                                    f"array, not a {type(array).__name__}")
            dtype = format.dtype_name(array.dtype)
            if shard is not None:
                box = shard.box(tuple(array.shape))
                targets.needs.append(reshard.Need(path, box, dtype))
                targets.destinations.append(shard)
            else:
                targets.needs.append(reshard.Need(path, None, dtype, tuple(array.shape)))
                targets.destinations.append(array)

    walk(tree, ())
    return targets


def _holds_shard(node: Mapping[str, Any]) -> bool:
    return any(isinstance(v, Shard) or (isinstance(v, Mapping) and _holds_shard(v)) for v in node.values())


def apply_restored(targets: Targets, arrays: list[np.ndarray], manifest: dict[str, Any]) -> None:
    """Copies what was loaded into the targets' arrays, the saved plain values into the tree, and hands the tree
    to its owner."""
    saved = {tuple(v["path"]): v["value"] for v in manifest["values"]}
    missing = [p for p in targets.values if p not in saved]
    if missing:
        raise errors.ShardingMismatchError(f"step {manifest['step']} has no value {'/'.join(missing[0])}")
    for destination, array in zip(targets.destinations, arrays, strict=True):
        np.copyto(destination.data if isinstance(destination, Shard) else destination, array, casting="no")
    for path in targets.values:
        set_path(targets.tree, list(path), saved[path])  # type: ignore[arg-type]
    if targets.finish is not None:
        targets.finish(targets.tree)
