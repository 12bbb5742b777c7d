"""The CUDA runtime, loaded by dlopen when present (copy.c): devices, memory, streams."""

from __future__ import annotations

import os

from SneppX_ALG import errors
from SneppX_ALG._native._lib import ffi, lib, raise_for
from SneppX_ALG.contract.env import ENV_CUDART

CUDART_SONAME = "libcudart.so.12"


_CUDART_IN_WHEEL = os.path.join("nvidia", "cuda_runtime", "lib", CUDART_SONAME)


def wheel_library_candidates(in_wheel: str, soname: str, override: str, sys_path: list[str],
                             env: dict[str, str]) -> list[str]:
    """Where to look for an NVIDIA library, in order: $override alone if set, else `in_wheel` (e.g.
    nvidia/nccl/lib/libnccl.so.2) under any sys.path entry (`nvidia` is a namespace package), then the soname."""
    if env.get(override):
        return [env[override]]
    found = [os.path.join(entry or ".", in_wheel) for entry in sys_path]
    return [path for path in found if os.path.isfile(path)] + [soname]


def cudart_candidates(sys_path: list[str], env: dict[str, str]) -> list[str]:
    """Where to look for libcudart: $SNEPPX_CUDART, the nvidia-cuda-runtime-cu12 wheel, the soname."""
    return wheel_library_candidates(_CUDART_IN_WHEEL, CUDART_SONAME, ENV_CUDART, sys_path, env)


def raise_cuda(code: int, what: str) -> None:
    if code == lib.SX_OK:
        return
    cuda_err = int(lib.sx_cuda_last_error())
    text = ffi.string(lib.sx_cuda_error_string(cuda_err)).decode(errors="replace") if cuda_err else ""
    if code == lib.SX_ENOLIB:
        raise errors.AcceleratorUnavailableError(f"{what}: the CUDA runtime library ({CUDART_SONAME}) can't be "
                                                 "loaded; install nvidia-cuda-runtime-cu12 or set SNEPPX_CUDART")
    if code == lib.SX_ENODEV:
        raise errors.AcceleratorUnavailableError(f"{what}: no CUDA device (CUDA error {cuda_err}: {text})")
    if code == lib.SX_ECUDA:
        raise errors.CudaError(f"{what}: CUDA error {cuda_err}: {text}", cuda_error=cuda_err)
    raise_for(code, what)


def cuda_load() -> str:
    """Loads libcudart (first candidate that loads) and returns the file it came from."""
    import sys

    for candidate in cudart_candidates(sys.path, dict(os.environ)):
        if lib.sx_cuda_load(os.fsencode(candidate)) == lib.SX_OK:
            return str(ffi.string(lib.sx_cuda_library()).decode())
    raise_cuda(lib.SX_ENOLIB, "load CUDA runtime")
    return ""  # unreachable: raise_cuda raised


def cuda_device_count() -> int:
    """Number of CUDA devices; AcceleratorUnavailableError when the runtime or a device is missing."""
    cuda_load()
    count = ffi.new("int *")
    raise_cuda(lib.sx_cuda_device_count(count), "cudaGetDeviceCount")
    return int(count[0])


def cuda_available() -> bool:
    """True when a CUDA device can be used; never raises."""
    try:
        return cuda_device_count() > 0
    except errors.AcceleratorUnavailableError:
        return False


def cuda_malloc(device: int, nbytes: int) -> int:
    """Device memory (tests, benchmarks); returns the pointer as an int."""
    out = ffi.new("void **")
    raise_cuda(lib.sx_cuda_malloc(device, nbytes, out), "cudaMalloc")
    return int(ffi.cast("uintptr_t", out[0]))


def cuda_free(device: int, pointer: int) -> None:
    raise_cuda(lib.sx_cuda_free(device, ffi.cast("void *", pointer)), "cudaFree")


def cuda_memcpy(device: int, dst: int, src: int, nbytes: int, kind: int) -> None:
    """Synchronous cudaMemcpy between int pointers (tests, benchmarks)."""
    raise_cuda(lib.sx_cuda_memcpy(device, ffi.cast("void *", dst), ffi.cast("void *", src), nbytes, kind),
                "cudaMemcpy")


def cuda_stream_create(device: int) -> int:
    """A new non-blocking CUDA stream (tests, benchmarks); returns its handle."""
    out = ffi.new("uintptr_t *")
    raise_cuda(lib.sx_cuda_stream_create(device, out), "cudaStreamCreate")
    return int(out[0])


def cuda_stream_destroy(device: int, stream: int) -> None:
    raise_cuda(lib.sx_cuda_stream_destroy(device, stream), "cudaStreamDestroy")


def cuda_memset_async(device: int, pointer: int, value: int, nbytes: int, stream: int) -> None:
    """cudaMemsetAsync on a stream (tests, benchmarks): work a copy can be ordered after."""
    raise_cuda(lib.sx_cuda_memset_async(device, ffi.cast("void *", pointer), value, nbytes, stream),
                "cudaMemsetAsync")
