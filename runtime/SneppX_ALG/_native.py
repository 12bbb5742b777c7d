"""The only importer of the cffi-built native core (`_sneppx_native`).

Everything else in SneppX calls the functions here, which check arguments
before C sees them and turn every SX_E* status into a typed exception at once.
cffi releases the GIL around each C call, so CRC and file I/O run while other
Python threads keep going.
"""

from __future__ import annotations

import errno as _errno
import os
from typing import Any

from SneppX_ALG import errors
from SneppX_ALG._sneppx_native import ffi, lib

KERNELS = {
    "portable": lib.SX_CRC_PORTABLE,
    "sse42": lib.SX_CRC_SSE42,
    "vpclmul256": lib.SX_CRC_VPCLMUL256,
    "vpclmul512": lib.SX_CRC_VPCLMUL512,
}

_SITES = {"write": lib.SX_SITE_WRITE, "fsync": lib.SX_SITE_FSYNC, "rename": lib.SX_SITE_RENAME,
          "dirsync": lib.SX_SITE_DIRSYNC}


def raise_for(code: int, what: str, path: str | None = None) -> None:
    """Raises the typed exception for a native status code (no-op for SX_OK)."""
    if code == lib.SX_OK:
        return
    err = lib.sx_last_errno() or None
    detail = ffi.string(lib.sx_strerror(code)).decode()
    if err:
        detail = f"{detail} ({os.strerror(err)})"
    message = f"{what}: {detail}" + (f" [{path}]" if path else "")
    if code == lib.SX_ENOSPC:
        raise errors.DiskFullError(message, path=path, errno=_errno.ENOSPC)
    if code == lib.SX_ENOENT:
        raise errors.CheckpointNotFoundError(message, path=path, errno=_errno.ENOENT)
    if code == lib.SX_EFAULT_INJECTED:
        raise errors.InjectedFault(message, path=path, errno=err)
    if code == lib.SX_EIO and "fsync" in what:
        raise errors.DurabilityError(message, path=path, errno=err)
    if code == lib.SX_EINVAL:
        raise ValueError(message)
    if code == lib.SX_ENOMEM:
        raise MemoryError(message)
    raise errors.StorageError(message, path=path, errno=err)


def as_buffer(data: Any) -> Any:
    """A zero-copy cffi view of bytes, bytearray, memoryview or a C-contiguous numpy array."""
    return ffi.from_buffer("char[]", data, require_writable=False)


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC32C of a buffer, continuing from `crc`, with the best kernel for this CPU."""
    buf = as_buffer(data)
    return int(lib.sx_crc32c(crc, buf, len(buf)))


def crc32c_parallel(data: Any, crc: int = 0, threads: int = 0) -> int:
    """CRC32C split over threads (0 = all CPUs); the same value as crc32c()."""
    buf = as_buffer(data)
    return int(lib.sx_crc32c_parallel(crc, buf, len(buf), threads))


def crc32c_with(kernel: str, data: Any, crc: int = 0) -> int:
    """CRC32C with one named kernel (tests and benchmarks); ValueError if the CPU lacks it."""
    buf = as_buffer(data)
    out = ffi.new("uint32_t *")
    raise_for(lib.sx_crc32c_with(KERNELS[kernel], crc, buf, len(buf), out), f"crc32c kernel {kernel}")
    return int(out[0])


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc(A + B) from crc(A), crc(B) and len(B)."""
    return int(lib.sx_crc32c_combine(crc_a, crc_b, len_b))


def crc32c_kernels() -> list[str]:
    """The kernels this CPU can run, best last."""
    mask = lib.sx_crc32c_kernels()
    return [name for name, k in KERNELS.items() if mask & (1 << k)]


class NativeFile:
    """A file written in one streaming pass by the native writer; see sx_file_* in sneppx.h.

    Use as: append()/pad() ..., pwrite() of a header, then finish() (durable) or abort() (unlinked).
    """

    def __init__(self, path: str, *, direct: bool = True, buffer_bytes: int = 0):
        self.path = path
        out = ffi.new("sx_file **")
        raise_for(lib.sx_file_create(os.fsencode(path), buffer_bytes, int(direct), out), "create", path)
        self._f = out[0]

    @property
    def size(self) -> int:
        return int(lib.sx_file_size(self._f))

    @property
    def is_direct(self) -> bool:
        return bool(lib.sx_file_is_direct(self._f))

    def append(self, data: Any) -> int:
        """Appends bytes; returns their CRC32C (computed while they are copied in)."""
        buf = as_buffer(data)
        crc = ffi.new("uint32_t *", 0)
        raise_for(lib.sx_file_append(self._f, buf, len(buf), crc), "write", self.path)
        return int(crc[0])

    def pad(self, alignment: int) -> None:
        raise_for(lib.sx_file_pad(self._f, alignment), "write", self.path)

    def pwrite(self, data: Any, offset: int) -> None:
        buf = as_buffer(data)
        raise_for(lib.sx_file_pwrite(self._f, buf, len(buf), offset), "write", self.path)

    def finish(self) -> None:
        f, self._f = self._f, ffi.NULL
        raise_for(lib.sx_file_finish(f), "write+fsync", self.path)

    def abort(self) -> None:
        if self._f != ffi.NULL:
            f, self._f = self._f, ffi.NULL
            lib.sx_file_abort(f)


def fsync_path(path: str) -> None:
    raise_for(lib.sx_fsync_path(os.fsencode(path)), "fsync", path)


def rename_durable(src: str, dst: str) -> None:
    """rename(src, dst) then fsync of the directories, so the rename survives a crash."""
    raise_for(lib.sx_rename_durable(os.fsencode(src), os.fsencode(dst)), "rename", dst)


def fault_arm(sites: str, countdown: int, action: str = "kill") -> None:
    """Arms the native fault hook (tests): the countdown-th I/O at `sites` kills or fails."""
    mask = 0
    for site in sites.split(","):
        mask |= _SITES[site.strip()]
    code = 0 if action == "kill" else getattr(_errno, action)
    lib.sx_fault_arm(mask, countdown, code)


def fault_sites_passed() -> int:
    return int(lib.sx_fault_sites_passed())
