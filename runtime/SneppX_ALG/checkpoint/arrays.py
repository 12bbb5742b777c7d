"""Tensors in and out of SneppX through the protocols array libraries share: DLPack and the array interface.

Why a module of its own: users hold torch, jax or cupy tensors, not numpy arrays, and copying a model's
weights to hand them over defeats zero-copy checkpoints. Both directions go through numpy (the reader and
writer work on numpy views), and this module covers the gaps between numpy and the frameworks:

* In (`as_array`): any object with `__dlpack__`, `__array_interface__` or the buffer protocol becomes a
  numpy view of the same memory. bfloat16, which numpy's DLPack importer refuses, is taken too: its capsule
  is relabelled 16-bit unsigned for numpy and viewed as `ml_dtypes.bfloat16` (the same bits).
* Out (`MappedTensor`): a tensor's pages in the file are mapped copy-on-write (`MAP_PRIVATE`), so the memory
  is writable, as frameworks require of a DLPack producer (jax and torch refuse numpy's read-only arrays),
  without a copy until someone writes, and a write never reaches the file or another read. bfloat16 leaves
  as a DLPack bfloat16 (the reverse relabelling).

Anything that can't be taken raises `UnsupportedTensorError` saying what to do instead.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import numpy as np

from SneppX_ALG import errors
from SneppX_ALG.checkpoint import format

# DLPack (dmlc/dlpack, include/dlpack/dlpack.h): device types and dtype codes used here.
_DL_CPU, _DL_CUDA_HOST = 1, 3
_DL_DEVICES = {2: "a CUDA GPU", 4: "an OpenCL device", 7: "a Vulkan device", 8: "a Metal (Apple GPU) device",
               10: "an ROCm GPU", 13: "a CUDA GPU (managed memory)", 14: "a oneAPI device"}
_DL_UINT, _DL_BFLOAT = 1, 4
_CAPSULE, _CAPSULE_VERSIONED = b"dltensor", b"dltensor_versioned"
# numpy reads DLPack 1.0 ("versioned") capsules from 2.1 on; before, only the legacy kind
_NUMPY_TAKES_VERSIONED = np.lib.NumpyVersion(np.__version__) >= "2.1.0"


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("dtype", _DLDataType), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.argtypes, _capsule_is_valid.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_int
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.argtypes, _capsule_pointer.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_void_p


def _dl_dtype(capsule: Any) -> _DLDataType:
    """The dtype field inside an unconsumed DLPack capsule (legacy or versioned), writable in place."""
    for name, struct in ((_CAPSULE_VERSIONED, _DLManagedTensorVersioned), (_CAPSULE, _DLManagedTensor)):
        if _capsule_is_valid(capsule, name):
            return struct.from_address(_capsule_pointer(capsule, name)).dl_tensor.dtype
    raise errors.UnsupportedTensorError("__dlpack__() did not return an unused DLPack capsule")


class _Capsule:
    """Hands numpy's from_dlpack a capsule already taken from the producer (so its dtype could be relabelled)."""

    def __init__(self, capsule: Any, device: tuple[int, int]):
        self._capsule, self._device = capsule, device

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


def _bfloat16() -> np.dtype:
    try:
        import ml_dtypes
    except ImportError:
        raise errors.UnsupportedTensorError("bfloat16 tensors need the ml_dtypes package: pip install "
                                            "ml_dtypes") from None
    return np.dtype(ml_dtypes.bfloat16)


def _from_dlpack(tensor: Any) -> np.ndarray:
    kind = type(tensor).__name__
    device = tuple(tensor.__dlpack_device__()) if hasattr(tensor, "__dlpack_device__") else (_DL_CPU, 0)
    if device[0] not in (_DL_CPU, _DL_CUDA_HOST):
        where = _DL_DEVICES.get(device[0], f"DLPack device type {device[0]}")
        raise errors.UnsupportedTensorError(
            f"this {kind} lives on {where}: a CheckpointWriter writes host memory. Copy it to the CPU first "
            "(torch: .cpu(), jax: jax.device_get, cupy: .get()), or save it with CheckpointCoordinator.save, "
            "which copies GPU tensors to its staging memory itself")
    try:
        capsule = None
        if _NUMPY_TAKES_VERSIONED:
            try:
                capsule = tensor.__dlpack__(max_version=(1, 0))
            except TypeError:  # a producer older than DLPack 1.0 takes no max_version
                pass
        if capsule is None:
            capsule = tensor.__dlpack__()
        dtype = _dl_dtype(capsule)
        bfloat16 = (dtype.code, dtype.bits, dtype.lanes) == (_DL_BFLOAT, 16, 1)
        if bfloat16:  # numpy has no bfloat16: the same bits as uint16, viewed as ml_dtypes' bfloat16 below
            dtype.code = _DL_UINT
        array = np.from_dlpack(_Capsule(capsule, (_DL_CPU, 0)))
    except (RuntimeError, TypeError, BufferError, ValueError) as e:
        raise errors.UnsupportedTensorError(
            f"numpy can't take this {kind} through DLPack ({e}). Make it a dense CPU tensor of a dtype SNPX "
            f"stores ({', '.join(format.DTYPES)}), e.g. .contiguous() or a cast, then write it") from None
    return array.view(_bfloat16()) if bfloat16 else array


def as_array(tensor: Any) -> np.ndarray:
    """A numpy view (no copy where the producer allows) of a numpy array, a DLPack tensor (torch, jax, cupy
    on the host...), an object with `__array_interface__`, or a buffer; UnsupportedTensorError otherwise."""
    if isinstance(tensor, np.ndarray):
        return tensor
    if isinstance(tensor, np.generic):
        return np.asarray(tensor)
    if hasattr(tensor, "__dlpack__"):
        return _from_dlpack(tensor)
    if hasattr(tensor, "__array_interface__"):
        return np.asarray(tensor)
    try:
        return np.asarray(memoryview(tensor))
    except (TypeError, ValueError, NotImplementedError) as e:
        raise errors.UnsupportedTensorError(
            f"{type(tensor).__name__} is not a tensor SneppX can read ({e}): pass a numpy array, an object with "
            "__dlpack__ (torch, jax, cupy...) or __array_interface__, or a buffer") from None


class MappedTensor:
    """One stored tensor, mapped copy-on-write: hand it to any framework without a copy.

    `__dlpack__` / `__dlpack_device__` (torch.from_dlpack, jax.dlpack.from_dlpack, np.from_dlpack...) and
    `__array__` (np.asarray) all share the mapping. The memory is writable; writes stay in this process's
    private copy of the touched pages and never reach the file, nor any other read of the tensor.
    """

    def __init__(self, fd: int, offset: int, dtype: np.dtype, shape: tuple[int, ...], length: int):
        self.dtype, self.shape = dtype, shape
        if length == 0:  # mmap refuses empty mappings; an empty tensor has no bytes to share
            self.array = np.zeros(shape, dtype=dtype)
            return
        start = offset - offset % mmap.ALLOCATIONGRANULARITY  # the format aligns to 4096; larger pages exist
        mapping = mmap.mmap(fd, offset - start + length, flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        self.array = np.frombuffer(mapping, dtype=dtype, count=length // dtype.itemsize,
                                   offset=offset - start).reshape(shape)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if dtype is not None and np.dtype(dtype) != self.array.dtype:
            return self.array.astype(dtype)
        return self.array.copy() if copy else self.array

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_DL_CPU, 0)

    def __dlpack__(self, **kwargs: Any) -> Any:
        if self.array.dtype.name != "bfloat16":
            return self.array.__dlpack__(**kwargs)
        capsule = self.array.view(np.uint16).__dlpack__(**kwargs)  # numpy exports the bits; relabel them
        dtype = _dl_dtype(capsule)
        dtype.code = _DL_BFLOAT
        return capsule


def copy_into(out: Any, array: np.ndarray, *, what: str) -> None:
    """Copies `array` into the existing tensor `out` (numpy, or a writable DLPack / array-interface tensor on
    the CPU: a torch tensor is filled in place); UnsupportedTensorError when it can't take it as it is."""
    target = as_array(out)
    if target.shape != array.shape or target.dtype != array.dtype:
        raise errors.UnsupportedTensorError(
            f"{what} is {array.dtype}{list(array.shape)}, out= is {target.dtype}{list(target.shape)}: pass a "
            "tensor of the same dtype and shape, or read without out=")
    if not target.flags.writeable:
        raise errors.UnsupportedTensorError(
            f"out= ({type(out).__name__}) is read-only (jax arrays always are): read with as_= instead, e.g. "
            "as_=jax.dlpack.from_dlpack, which hands the stored bytes over without a copy")
    np.copyto(target, array)
