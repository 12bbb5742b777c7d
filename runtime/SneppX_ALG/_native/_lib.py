"""The binding itself: the cffi-built library (`ffi`, `lib`), the only import of it, and the two conventions every
wrapper follows: a status code becomes a typed exception at once (raise_for), a buffer is passed without a copy
(as_buffer)."""

from __future__ import annotations

import errno as _errno
import os
from typing import Any

from SneppX_ALG import errors
from SneppX_ALG._sneppx_native import ffi, lib

__all__ = ["as_buffer", "ffi", "lib", "raise_for"]


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
    if code == lib.SX_EFSYNC:
        raise errors.DurabilityError(message, path=path, errno=err)
    if code == lib.SX_EEOF:
        raise errors.TruncatedCheckpointError(f"{what}: {detail}: the file is shorter than its header says",
                                              path=path)
    if code == lib.SX_EINVAL:
        raise ValueError(message)
    if code == lib.SX_ENOMEM:
        raise MemoryError(message)
    raise errors.StorageError(message, path=path, errno=err)


def as_buffer(data: Any) -> Any:
    """A zero-copy cffi view of bytes, bytearray, memoryview or a C-contiguous numpy array."""
    try:
        return ffi.from_buffer("char[]", data, require_writable=False)
    except (TypeError, ValueError, BufferError) as e:
        raise errors.UnsupportedTensorError(
            f"{type(data).__name__} is not a contiguous buffer ({e}); pass bytes or a C-contiguous array") from None
