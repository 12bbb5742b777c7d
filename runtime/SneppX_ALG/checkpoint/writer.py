"""Writing one SNPX checkpoint file: `CheckpointWriter` streams tensors through the native writer (O_DIRECT or
buffered write-behind, whichever measured faster on the filesystem: checkpoint/write_mode.py; CRC32C computed as
the bytes are copied) into a temporary name and commits with fsync, rename and a directory fsync, so a reader
sees either the whole file or none; or into a `Sink` (an S3 object uploaded in parts as it is written).

Why a module of its own: writing shares nothing with reading but the format (format.py); readers, validators and
tools never need the writer's streaming, signing and commit.
"""

from __future__ import annotations

import os
import secrets
import types
from collections.abc import Iterator
from typing import Any, Protocol, Self

import numpy as np

from SneppX_ALG import _fs, _native, errors
from SneppX_ALG.checkpoint import arrays, format, signing, write_mode

# Writes go to the native writer in pieces of this size so signing digests can stream alongside.
_PIECE = 64 << 20


class Sink(Protocol):
    """Where a CheckpointWriter streams its bytes instead of a file of its own (e.g. an S3 object uploaded in
    parts as it is written: storage/s3.py). The same calls as `_native.NativeFile`; `finish()` makes the bytes
    durable where they go (or, failing, takes back what was sent), `abort()` takes back what was sent."""

    @property
    def size(self) -> int: ...

    def append(self, data: Any) -> int: ...

    def pad(self, alignment: int) -> None: ...

    def pwrite(self, data: Any, offset: int) -> None: ...

    def finish(self) -> None: ...

    def abort(self) -> None: ...


def _little_endian_pieces(array: np.ndarray, piece: int) -> Iterator[memoryview]:
    """The array's bytes in C order and little-endian, in pieces; copies only what isn't already so."""
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if array.flags.c_contiguous:
        flat = array.reshape(-1).view(np.uint8).data if array.size else memoryview(b"")
        for start in range(0, len(flat), piece):
            yield flat[start:start + piece]
        return
    # Non-contiguous: copy a bounded block of rows at a time, never the whole tensor.
    rows_per_piece = max(1, piece // max(1, array[0].nbytes)) if array.ndim and len(array) else 1
    for start in range(0, len(array), rows_per_piece):
        block = np.ascontiguousarray(array[start:start + rows_per_piece])
        yield block.reshape(-1).view(np.uint8).data


class CheckpointWriter:
    """Writes one SNPX file in a single streaming pass and commits it atomically.

    >>> with CheckpointWriter(path, metadata={"run": "a"}) as w:
    ...     w.write("layer0.w", array)

    A clean exit from the `with` block commits (temp name, fsync, rename, directory fsync); an exception
    leaves no file at `path` (and the previous file there, if any, untouched). A failed fsync fails the write.
    With `signing_key` (an Ed25519 private key), a digest of every tensor is computed in the same pass and the
    table is signed (see checkpoint/signing.py). `direct`: True for O_DIRECT, False for buffered writes with
    write-behind, None (default) for what SNEPPX_WRITE_MODE says or else what measured faster on the
    directory's filesystem (checkpoint/write_mode.py). `sink`: stream the file there instead (a `Sink`: no temp
    file, no rename; `commit()` ends with `sink.finish()`, a failure with `sink.abort()`; `path` names it).

    A writer is single-use: after `commit()` or `abort()` (explicit, or a failed commit), `write` and `commit`
    raise `CheckpointClosedError` and never touch `path` again, and leaving the `with` block does nothing.
    """

    def __init__(self, path: str | os.PathLike[str], metadata: dict[str, str] | None = None, config: Any = None,
                 *, signing_key: Any = None, direct: bool | None = None, buffer_bytes: int = 0,
                 sink: Sink | None = None):
        self.path = os.fspath(path)
        try:
            self.metadata = format.check_metadata(metadata or {})
        except errors.CorruptTableError as e:
            raise errors.UnsupportedTensorError(e.reason) from None
        format.check_config(config)
        self.config = config
        self.signing_key = signing_key
        self._direct = direct
        self._buffer_bytes = buffer_bytes
        self._entries: list[format.TensorEntry] = []
        self._names: set[str] = set()
        self._sink = sink
        self._file: Sink | None = None
        self._broken: BaseException | None = None
        self._tmp = ""
        self.committed = False
        self._finished = ""  # why the writer is done ("committed", "aborted", ...): it never writes again

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        if self._finished:
            return  # an explicit commit() or abort() inside the block already decided
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def _check_not_finished(self) -> None:
        if self._finished:
            raise errors.CheckpointClosedError(
                f"this CheckpointWriter for {self.path} is done ({self._finished}); a writer is single-use, so "
                "nothing more is written: make a new CheckpointWriter")

    def open(self) -> None:
        """Creates the temporary file next to `path` (done by `with`)."""
        self._check_not_finished()
        if self._file is not None:
            return
        if self._sink is not None:
            self._file = self._sink
            self._file.append(bytes(format.DATA_OFFSET))  # the header block, filled in at commit
            return
        directory, base = os.path.split(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise errors.CheckpointNotFoundError(f"directory {directory} does not exist", path=self.path)
        self._tmp = os.path.join(directory, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        direct = write_mode.use_direct(directory, self._direct)
        self._file = _native.NativeFile(self._tmp, direct=direct, buffer_bytes=self._buffer_bytes)
        self._file.append(bytes(format.DATA_OFFSET))  # the header block, filled in at commit

    def write(self, name: str, tensor: Any, *, global_shape: tuple[int, ...] | None = None,
              global_offset: tuple[int, ...] | None = None) -> format.TensorEntry:
        """Streams one tensor into the file. Returns its table entry (offset, length, CRC32C)."""
        self.open()
        assert self._file is not None
        format.check_name(name)
        if name in self._names:
            raise errors.UnsupportedTensorError(f"tensor {name!r} was already written to this checkpoint")
        array = arrays.as_array(tensor)
        dtype = format.dtype_name(array.dtype)
        shape = tuple(int(d) for d in array.shape)
        if (global_shape is None) != (global_offset is None):
            raise ValueError("global_shape and global_offset come together")
        if global_shape is not None:
            global_shape, global_offset = tuple(global_shape), tuple(global_offset or ())
            if not format.shard_fits(shape, global_shape, global_offset):
                raise ValueError(f"shard {list(shape)} at {list(global_offset)} does not fit in {list(global_shape)}")
        return self._append(name, dtype, shape, global_shape, global_offset, _little_endian_pieces(array, _PIECE),
                            digest_algorithm=None)

    def _append_stored(self, entry: format.TensorEntry, data: memoryview, *,
                       digest_algorithm: str | None) -> format.TensorEntry:
        """Appends a tensor's stored bytes exactly as they are, under `entry`'s name, dtype name, shape and
        global placement (for signing an existing file: a bfloat16 stays bfloat16, no numpy round trip).

        Returns the new entry with this file's offset and the CRC32C (and, when signing, the digest with
        `digest_algorithm`, default BLAKE3) computed while the bytes were copied; the caller compares them
        with the stored ones before committing."""
        self.open()
        if entry.name in self._names:
            raise errors.UnsupportedTensorError(f"tensor {entry.name!r} was already written to this checkpoint")
        pieces = (data[start:start + _PIECE] for start in range(0, len(data), _PIECE))
        return self._append(entry.name, entry.dtype, entry.shape, entry.global_shape, entry.global_offset, pieces,
                            digest_algorithm=digest_algorithm)

    def _append(self, name: str, dtype: str, shape: tuple[int, ...], global_shape: tuple[int, ...] | None,
                global_offset: tuple[int, ...] | None, pieces: Iterator[memoryview], *,
                digest_algorithm: str | None) -> format.TensorEntry:
        """Streams checked pieces into the file (aligned), CRC32C and digest in the same pass; records the entry."""
        assert self._file is not None
        if self._broken is not None:
            raise errors.StorageError(f"an earlier write to {self.path} failed ({self._broken}); this checkpoint "
                                      "can't be committed", path=self.path)
        try:
            self._file.pad(format.ALIGN)
            offset = self._file.size
            digest = _new_digest(digest_algorithm) if self.signing_key is not None else None
            crc = 0
            for piece in pieces:
                if digest is not None:
                    digest.update(piece)  # hashed on signing's worker thread while append copies the same bytes
                crc = _native.crc32c_combine(crc, self._file.append(piece), len(piece))
        except BaseException as e:
            # part of the tensor may be in the file already: the layout is no longer canonical
            self._broken = e
            raise
        entry = format.TensorEntry(
            name=name, dtype=dtype, shape=shape, offset=offset, length=self._file.size - offset, crc32c=crc,
            global_shape=global_shape, global_offset=global_offset,
            digest=f"{digest.name}:{digest.hexdigest()}" if digest is not None else None)
        self._entries.append(entry)
        self._names.add(name)
        return entry

    def commit(self) -> None:
        """Writes table and header, makes the file durable and renames it to `path`."""
        self.open()
        assert self._file is not None
        try:
            if self._broken is not None:
                raise errors.StorageError(f"an earlier write to {self.path} failed ({self._broken}); nothing was "
                                          "committed", path=self.path)
            self._file.pad(format.ALIGN)
            table_offset = self._file.size
            table = format.encode_table(format.Table(tuple(self._entries), self.metadata, self.config))
            self._file.append(table)
            signature = b""
            if self.signing_key is not None:
                signature = signing.signature_block(table, self.signing_key)
                self._file.append(signature)
            header = format.Header(
                file_size=self._file.size, table_offset=table_offset, table_length=len(table),
                table_crc32c=_native.crc32c(table), signature_length=len(signature),
                signature_crc32c=_native.crc32c(signature) if signature else 0)
            self._file.pwrite(format.encode_header(header), 0)
            file, self._file = self._file, None
            file.finish()  # a sink that fails to finish takes back what it sent itself, as a file is removed
        except BaseException:
            self._finished = "its commit failed"
            self._drop()
            raise
        if self._sink is not None:
            self._finished = "committed"
            self.committed = True
            return
        try:
            _native.rename_durable(self._tmp, self.path)
        except BaseException:
            self._finished = "its commit failed"
            _fs.unlink_quietly(self._tmp)
            raise
        self._finished = "committed"
        self.committed = True

    def abort(self) -> None:
        """Drops everything written; nothing appears at `path`. Does nothing after a commit."""
        if self._finished:
            return
        self._finished = "aborted"
        self._drop()

    def _drop(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.abort()
        elif self._tmp:
            _fs.unlink_quietly(self._tmp)

    def __del__(self) -> None:
        if getattr(self, "_file", None) is not None:
            self.abort()


def _new_digest(algorithm: str | None) -> Any:
    return signing.new_digest(algorithm or signing.DIGEST_ALGORITHM)
