"""Reading a shard file the one way validation and restore share: through one descriptor, every byte read
once into where it goes, its CRC32C (and the whole file's digest) computed on the bytes as they land.

Why: checking a step's files and then opening them again to load them checks one set of bytes and loads
another (a file renamed over a shard, or changed in place, in between: a TOCTOU). Here what is loaded is
what was checked: a tensor's bytes are read into the array that restore hands back, and its CRC32C and the
file's BLAKE3 are computed on that memory. Validation alone reads the same way into a small scratch ring.

Reads go through the native reader (`_native.read_at`), not a memory map: a failing disk or NFS server is
then an I/O error (StorageError with .errno) the caller can retry or report, never a SIGBUS that kills the
process, and the fault hook's "read" site covers every byte (tests inject EIO with it).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from SneppX_ALG import _fs, _native, errors
from SneppX_ALG.checkpoint import file, format, signing

_SCRATCH = 8 << 20  # bytes per scratch buffer when a tensor is checked, not kept
_HASH_PIECE = 64 << 20  # a kept tensor is read and handed to the digest in pieces of this size


@dataclasses.dataclass
class ShardScan:
    """What one pass over a shard found."""

    table: format.Table
    size: int
    problems: list[errors.CheckpointFormatError]  # tensors whose CRC32C or padding is wrong, in file order
    digest: str | None  # "<alg>:<hex>" of the whole file, when asked for
    blocks: dict[str, list[int]]  # with block_bytes: each tensor's CRC32C per block, as its bytes were read


def scan_shard(path: str, into: Callable[[format.TensorEntry], memoryview | None] | None = None, *,
               digest: str | None = None, block_bytes: int | None = None) -> ShardScan:
    """Reads the shard at `path` once, in file order, checking every tensor's CRC32C and padding.

    `into(entry)`: a writable byte buffer of `entry.length` bytes that receives the tensor (kept), or None to
    only check it. `digest`: an algorithm name ("blake3") to hash the whole file with, as it is read.
    `block_bytes`: also take each tensor's CRC32C per block of that size (what a step manifest lists), from
    the same reads. Raises the typed error of a bad header or table, CheckpointNotFoundError for a missing file,
    CheckpointFormatError for a symbolic link or anything not a regular file (_fs.open_checked: a FIFO is
    refused, never waited on), and StorageError/OSError when the file can't be read (not a verdict on its
    bytes)."""
    fd, size = _fs.open_checked(path, follow_symlinks=False)  # never a FIFO waited on, never a link followed
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

        def pread(fd: int, n: int, offset: int) -> bytes:
            buffer = bytearray(n)
            _native.read_at(fd, buffer, offset, path=path)
            return bytes(buffer)

        layout = file.read_layout(fd, size, path, pread)
        hasher = signing.new_digest(digest, threads=signing.ALL_THREADS) if digest else None
        if hasher is not None:
            hasher.update(layout.head)
        scratch = _Scratch(hasher is not None)
        problems: list[errors.CheckpointFormatError] = []
        blocks: dict[str, list[int]] = {}
        for entry in layout.decoded.tensors:
            target = into(entry) if into is not None else None
            reader = _Reader(fd, path, hasher, block_bytes)
            if target is not None:
                for start in range(0, len(target), _HASH_PIECE):  # the digest hashes the kept memory itself
                    reader.read(target[start:start + _HASH_PIECE], entry.offset + start)
            else:
                for start in range(0, entry.length, _SCRATCH):
                    reader.read(scratch.take(min(_SCRATCH, entry.length - start)), entry.offset + start)
            crc = reader.finish()
            if block_bytes is not None:
                blocks[entry.name] = reader.blocks
            end = entry.offset + entry.length
            padding = pread(fd, format.align_up(end) - end, end) if format.align_up(end) > end else b""
            if hasher is not None and padding:
                hasher.update(padding)
            problems += file.tensor_errors(entry, crc, not padding.strip(b"\x00"), path=path)
        if hasher is not None:
            hasher.update(layout.table + layout.signature)
        value = f"{hasher.name}:{hasher.hexdigest()}" if hasher is not None else None
        return ShardScan(layout.decoded, size, problems, value, blocks)
    finally:
        os.close(fd)


class _Reader:
    """Reads one tensor's bytes in pieces through the native reader (CRC32C as they land), handing each piece
    to the file's digest, and with block_bytes keeping a CRC32C per block (a block may span pieces)."""

    def __init__(self, fd: int, path: str, hasher: Any, block_bytes: int | None):
        self.fd, self.path, self.hasher, self.block_bytes = fd, path, hasher, block_bytes
        self.blocks: list[int] = []
        self.crc = 0  # of everything read so far (without blocks), or of the current block
        self.done = 0  # bytes read
        self.whole = 0  # with blocks: the CRC32C of the blocks finished so far

    def read(self, view: memoryview, offset: int) -> None:
        position = 0
        while position < len(view):
            n = len(view) - position
            if self.block_bytes is not None:
                n = min(n, self.block_bytes - self.done % self.block_bytes)
            self.crc = _native.read_at(self.fd, view[position:position + n], offset + position, self.crc,
                                       path=self.path)
            position += n
            self.done += n
            if self.block_bytes is not None and self.done % self.block_bytes == 0:
                self._end_block(self.block_bytes)
        if self.hasher is not None:
            self.hasher.update(view)

    def _end_block(self, length: int) -> None:
        self.blocks.append(self.crc)
        self.whole = _native.crc32c_combine(self.whole, self.crc, length)
        self.crc = 0

    def finish(self) -> int:
        """The tensor's CRC32C."""
        if self.block_bytes is None:
            return self.crc
        if self.done % self.block_bytes:
            self._end_block(self.done % self.block_bytes)
        return self.whole


class _Scratch:
    """Reused buffers for bytes that are checked and dropped: one, or a ring of three when a digest runs
    (it may still be hashing the two pieces handed to it before; signing.StreamingDigest queues at most two)."""

    def __init__(self, hashing: bool):
        self._ring: list[bytearray] = []
        self._size = 3 if hashing else 1
        self._next = 0

    def take(self, n: int) -> memoryview:
        if len(self._ring) < self._size:
            self._ring.append(bytearray(_SCRATCH))
        buffer = self._ring[self._next % len(self._ring)]
        self._next += 1
        return memoryview(buffer)[:n]
