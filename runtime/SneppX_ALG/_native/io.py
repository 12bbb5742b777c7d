"""Durable file I/O (io.c): the streaming writer, fsync and rename made durable, reads that land with their CRC32C,
and the fault hook the crash tests arm."""

from __future__ import annotations

import errno as _errno
import os
from typing import Any

from SneppX_ALG import errors
from SneppX_ALG._native._lib import as_buffer, ffi, lib, raise_for

_SITES = {"write": lib.SX_SITE_WRITE, "fsync": lib.SX_SITE_FSYNC, "rename": lib.SX_SITE_RENAME,
          "dirsync": lib.SX_SITE_DIRSYNC, "read": lib.SX_SITE_READ}


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


def fault_arm(sites: str, countdown: int, action: str = "kill", *, times: int = 1) -> None:
    """Arms the native fault hook (tests): the countdown-th I/O at `sites` kills or fails, and with
    `times` > 1 so do the matching I/Os after it, `times` in all (a fault that persists).
    Sites: write, fsync, rename, dirsync, read."""
    mask = 0
    for site in sites.split(","):
        mask |= _SITES[site.strip()]
    code = 0 if action == "kill" else getattr(_errno, action)
    lib.sx_fault_arm_times(mask, countdown, max(1, times), code)


def fault_sites_passed() -> int:
    return int(lib.sx_fault_sites_passed())


def _writable(buffer: Any) -> Any:
    """A cffi view of a writable contiguous buffer to read into (UnsupportedTensorError for anything else)."""
    try:
        return ffi.from_buffer("char[]", buffer, require_writable=True)
    except (TypeError, ValueError, BufferError) as e:
        raise errors.UnsupportedTensorError(f"{type(buffer).__name__} is not a writable contiguous buffer "
                                            f"({e})") from None


def read_at(fd: int, buffer: Any, offset: int, crc: int = 0, *, path: str | None = None) -> int:
    """Reads exactly len(buffer) bytes of fd at offset into a writable buffer; returns their CRC32C
    continued from `crc`. A failed read is StorageError with .errno (never a SIGBUS, as a memory map
    gives); a file that ends first is TruncatedCheckpointError."""
    if offset < 0:
        raise ValueError(f"offset must be >= 0, not {offset}")
    buf = _writable(buffer)
    out = ffi.new("uint32_t *", crc)
    raise_for(lib.sx_read_at(fd, buf, len(buf), offset, out), "read", path)
    return int(out[0])


def read_blocks_at(fd: int, buffer: Any, offset: int, block_bytes: int, *, path: str | None = None) -> list[int]:
    """As read_at, returning the CRC32C of each block_bytes block of what was read (the last may be shorter),
    each taken as the block landed."""
    if offset < 0 or block_bytes <= 0:
        raise ValueError(f"offset must be >= 0 and block_bytes > 0, not {offset} and {block_bytes}")
    buf = _writable(buffer)
    count = -(-len(buf) // block_bytes)
    crcs = ffi.new("uint32_t[]", max(1, count))
    raise_for(lib.sx_read_blocks_at(fd, buf, len(buf), offset, block_bytes, crcs), "read", path)
    return list(crcs)[:count]
