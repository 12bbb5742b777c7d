"""The snapshot copy engine (copy.c): copies into staging memory with the CRC32C of what landed, and the exact
compare an incremental save makes instead of a copy."""

from __future__ import annotations

from typing import Any

from SneppX_ALG._native._lib import as_buffer, ffi, lib, raise_for
from SneppX_ALG._native.cuda import cuda_load, raise_cuda


def equal_pairs(pairs: list[tuple[Any, Any]], threads: int = 0) -> list[bool]:
    """For each pair of buffers, whether they hold the same bytes (memcmp, the pairs spread over `threads`
    threads, 0: every core, without the GIL)."""
    views = [(as_buffer(a), as_buffer(b)) for a, b in pairs]
    n = len(views)
    lens = ffi.new("uint64_t[]", [min(len(x), len(y)) for x, y in views] or [0])
    firsts = ffi.new("void *[]", [ffi.cast("void *", x) for x, _ in views] or [ffi.NULL])
    seconds = ffi.new("void *[]", [ffi.cast("void *", y) for _, y in views] or [ffi.NULL])
    equal = ffi.new("uint8_t[]", max(1, n))
    raise_for(lib.sx_equal_ranges(n, firsts, seconds, lens, equal, threads), "compare")
    return [len(x) == len(y) and bool(equal[i]) for i, (x, y) in enumerate(views)]


COPY_H2H = lib.SX_COPY_H2H


COPY_D2H = lib.SX_COPY_D2H


COPY_H2D = lib.SX_COPY_H2D


COPY_D2D = lib.SX_COPY_D2D


def address_of(data: Any) -> int:
    """The address of a buffer's first byte (bytes, bytearray, numpy array...)."""
    return int(ffi.cast("uintptr_t", as_buffer(data)))


class Copier:
    """The snapshot copy engine: copies into staging memory and returns the CRC32C of what landed.

    device=-1 copies host memory with plain threads; device>=0 also copies from CUDA device memory
    through pinned staging on its own stream (AcceleratorUnavailableError without a device).
    Staging buffers come from alloc() (pinned on a device copier) and go back with free().
    """

    def __init__(self, device: int = -1, *, piece_bytes: int = 0, threads: int = 0):
        if device >= 0:
            cuda_load()
        out = ffi.new("sx_copier **")
        raise_cuda(lib.sx_copier_create(device, piece_bytes, threads, out), "create copier")
        self._c = ffi.gc(out[0], lib.sx_copier_destroy)
        self.device = device

    def alloc(self, nbytes: int) -> Any:
        """A writable buffer (cffi) of nbytes; pinned on a device copier. Keep it alive while in use."""
        out = ffi.new("void **")
        raise_cuda(lib.sx_copier_alloc(self._c, nbytes, out), "allocate staging memory")
        # A cycle collection (as at interpreter exit) may destroy the copier before this buffer: the C copier
        # stays allocated until its last buffer is freed (copy.c). The finalizer holds the C function itself,
        # not the module global `lib`, which interpreter shutdown may have cleared by the time it runs.
        copier, free = self._c, lib.sx_copier_free
        return ffi.gc(ffi.cast("char *", out[0]), lambda p: free(copier, p), nbytes)

    def view(self, buffer: Any, nbytes: int) -> memoryview:
        """A memoryview over the first nbytes of a buffer from alloc()."""
        return memoryview(ffi.buffer(buffer, nbytes))

    def wait_stream(self, stream: int) -> None:
        """Orders this copier's next copies after the work queued so far on a producer's CUDA stream
        (the __cuda_array_interface__ "stream" value: 1 legacy default, 2 per-thread default, or a
        handle); returns without waiting for that work."""
        if self.device < 0:
            raise ValueError("a host copier has no stream to order")
        if not isinstance(stream, int) or stream <= 0:
            raise ValueError(f"stream must be a positive int (0 is ambiguous), not {stream!r}")
        raise_cuda(lib.sx_copier_wait_stream(self._c, stream), "order the copy after the producer's stream")

    def copy(self, dst: Any, src: Any, nbytes: int | None = None, *, crc: int | None = 0,
             kind: int = COPY_H2H) -> int | None:
        """Copies into dst (writable buffer or int address) from src (buffer, or int device address for
        COPY_D2H). Returns the CRC32C of the bytes continued from `crc`, or None with crc=None."""
        dst_p, dst_len = _pointer(dst, writable=True)
        src_p, src_len = _pointer(src, writable=False)
        if nbytes is None:
            nbytes = src_len if src_len is not None else dst_len
        if nbytes is None:
            raise ValueError("nbytes is needed when both ends are raw pointers")
        for end, length in (("into", dst_len), ("from", src_len)):
            if length is not None and nbytes > length:
                raise ValueError(f"copy of {nbytes} bytes {end} a buffer of {length}")
        out = ffi.new("uint32_t *", crc or 0) if crc is not None else ffi.NULL
        raise_cuda(lib.sx_copier_copy(self._c, dst_p, src_p, nbytes, kind, out), "copy")
        return int(out[0]) if crc is not None else None


def _pointer(data: Any, *, writable: bool) -> tuple[Any, int | None]:
    """A void* for an int address, a cffi pointer (length unknown) or a buffer (with its length)."""
    if isinstance(data, int):
        return ffi.cast("void *", data), None
    if isinstance(data, ffi.CData):
        return ffi.cast("void *", data), None
    buf = ffi.from_buffer("char[]", data, require_writable=writable)
    return buf, len(buf)
