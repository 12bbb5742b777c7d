"""The user's state as SneppX sees it: flattened into tensors and plain values on save, rebuilt on restore.

Why: `save()` takes a model with `state_dict()` or a (nested) dict of numpy, DLPack or CUDA arrays; the
rest of the coordinator works on a flat list of (path, array) and (path, JSON value). This module is the
only one that knows about the shapes a user's state can take.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import numpy as np

from SneppX_ALG import errors
from SneppX_ALG.checkpoint import arrays, format
from SneppX_ALG.coordinator import plan


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


def flatten_state(obj: Any) -> tuple[str, list[tuple[tuple[str, ...], np.ndarray | DeviceArray]],
                                     list[tuple[tuple[str, ...], Any]]]:
    """(kind, tensors, plain values) of a model (state_dict()), or a (nested) mapping of arrays."""
    if hasattr(obj, "state_dict") and callable(obj.state_dict):
        kind, tree = "state_dict", obj.state_dict()
    elif isinstance(obj, Mapping):
        kind, tree = "mapping", obj
    else:
        raise errors.UnsupportedTensorError(f"can't checkpoint a {type(obj).__name__}: pass an object with "
                                            "state_dict()/load_state_dict() or a dict of arrays")
    tensors: list[tuple[tuple[str, ...], Any]] = []
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
            leaf = leaf_of(value)
            if leaf is None:
                values.append((path, value))
            else:
                if isinstance(leaf, DeviceArray):  # the pointer is valid only while its owners live
                    leaf.keepalive = (value, tree)
                tensors.append((path, leaf))

    walk(tree, ())
    return kind, tensors, values


def check_json_safe(value: Any, what: str) -> None:
    try:
        format.check_config(value)
    except errors.SneppXError as e:
        raise errors.UnsupportedTensorError(f"{what} must be JSON-safe (it goes into manifest.json): "
                                            f"{e}") from None


def tensor_spec(path: tuple[str, ...], leaf: np.ndarray | DeviceArray) -> plan.TensorSpec:
    dtype = leaf.dtype
    return plan.TensorSpec(path, format.dtype_name(dtype), tuple(int(d) for d in leaf.shape), dtype.itemsize)


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
