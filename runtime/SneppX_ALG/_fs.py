"""Durable local file operations every layer above shares: small files written whole and fsynced, checkpoint files
opened only when they are regular files, leftovers removed quietly.

Why one module: a checkpoint's safety rests on these few calls (a write is renamed into place only after its
data and then its directory are on disk; a reader never waits on a FIFO or follows a link out of a step), so they
are written once, over the native writer (`_native.NativeFile`, whose fault hook the kill tests use).
"""

from __future__ import annotations

import contextlib
import errno as errno_module
import os
import secrets
import shutil
import stat

from SneppX_ALG import _native, errors


def write_durable(path: str, data: bytes) -> None:
    """Writes a small file through the native writer (fault hook, fdatasync) under a temp name, then
    renames it into place with a directory fsync."""
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    native_file = _native.NativeFile(tmp, direct=False)
    try:
        native_file.append(data)
    except BaseException:
        native_file.abort()
        raise
    try:
        native_file.finish()
        _native.rename_durable(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise


def open_checked(path: str, *, follow_symlinks: bool = True) -> tuple[int, int]:
    """Opens a checkpoint file for reading: (descriptor, size). Typed errors for missing paths, directories
    and anything else that is not a regular file (and, with follow_symlinks=False, a symbolic link: a
    step's shards are files its writer made). Opened non-blocking, so a FIFO (or device) is refused instead of
    waiting forever for a writer; other OSErrors (EIO, EMFILE, ...) propagate: they are not a verdict."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise errors.CheckpointNotFoundError(f"no checkpoint at {path}: file not found", path=path) from None
    except IsADirectoryError:
        raise errors.CheckpointFormatError("is a directory, not a checkpoint file", path=path) from None
    except PermissionError as e:
        raise errors.StorageError(f"can't read {path}: {e.strerror}", path=path, errno=e.errno) from None
    except OSError as e:
        if e.errno == errno_module.ELOOP and not follow_symlinks:
            raise errors.CheckpointFormatError("is a symbolic link, not a checkpoint file",
                                               path=path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _FILE_KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise errors.CheckpointFormatError(f"is {kind}, not a checkpoint file", path=path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_small(path: str, limit: int) -> bytes | None:
    """A step's or a root's small file (a manifest, a signature, a marker, a record): at most limit + 1 bytes (so
    its reader can refuse a larger one), or None when there is none. Opened as open_checked opens a shard, without
    following a symbolic link: a FIFO named manifest.json is a CheckpointFormatError, never an open that waits
    for a writer forever, and a link never reads a file outside the step."""
    try:
        fd, _ = open_checked(path, follow_symlinks=False)
    except (errors.CheckpointNotFoundError, NotADirectoryError):
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(limit + 1)


_FILE_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket",
               stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def unlink_quietly(path: str) -> None:
    """Removes a file that may already be gone (a temporary file after a failed or killed write)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def remove_tree(path: str) -> None:
    """Removes a directory and what it holds, whatever is already gone (a leftover, a step being deleted)."""
    shutil.rmtree(path, ignore_errors=True)


def local_root(root: str) -> str:
    """The directory a local root names: a path, or a `file:///absolute/path` URI (what the operator hands its pods)."""
    if root.startswith("file://"):
        root = root[len("file://"):]
        if not root.startswith("/"):
            raise ValueError(f"unsupported checkpoint root file://{root}: a file:// URI needs an absolute path, "
                             "file:///path (no host)")
    elif "://" in root:
        raise ValueError(f"unsupported checkpoint root {root!r}: use a local path or s3://bucket/prefix")
    return root
