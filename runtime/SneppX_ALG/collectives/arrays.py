"""Which arrays collectives take, and how: C-contiguous writable numpy arrays in place, device arrays (CuPy,
PyTorch, Numba) by their __cuda_array_interface__, dtypes the native ops support.

Separate because the checks are the same for every collective and backend, and have nothing to do with how a
group connects.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from SneppX_ALG import _native, errors


def dtype_name(array: Any, allowed: Mapping[str, int] | tuple[str, ...]) -> str:
    name = np.dtype(array_dtype(array)).name
    if name not in allowed:
        raise errors.UnsupportedTensorError(f"collectives take {', '.join(allowed)} arrays, not {name}")
    return name


def reduce_dtype(array: Any, op: str) -> str:
    if op not in _native.REDUCE_OPS:
        raise ValueError(f"op must be one of {sorted(_native.REDUCE_OPS)}, got {op!r}")
    return dtype_name(array, _native.REDUCE_DTYPES)


def array_dtype(array: Any) -> Any:
    interface = getattr(array, "__cuda_array_interface__", None)
    return np.dtype(interface["typestr"]) if interface is not None else array.dtype


def element_count(array: Any) -> int:
    """Elements of a numpy array or a device array (whose `size` may be a method, as torch's is)."""
    interface = getattr(array, "__cuda_array_interface__", None)
    return math.prod(interface["shape"]) if interface is not None else int(array.size)


def host_array(array: Any) -> np.ndarray:
    """The array itself if collectives can write into it in place; UnsupportedTensorError otherwise."""
    if not isinstance(array, np.ndarray):
        raise errors.UnsupportedTensorError(f"collectives take numpy arrays, not {type(array).__name__}")
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise errors.UnsupportedTensorError("collectives work in place: pass a C-contiguous, writable array")
    return array


def device_pointer(array: Any) -> int | None:
    """The device address of an object with __cuda_array_interface__ (CuPy, PyTorch, Numba), else None."""
    interface = getattr(array, "__cuda_array_interface__", None)
    if interface is None:
        return None
    if interface.get("strides") is not None:
        raise errors.UnsupportedTensorError("collectives work in place: pass a C-contiguous device array")
    return int(interface["data"][0])
