"""Reading and checking one SNPX checkpoint file: `read_layout` checks a file's header, table and signature block,
`CheckpointReader` maps the file and hands out zero-copy, read-only arrays, verifying each tensor's CRC32C on
first read (and, given trusted keys, the table's signature before parsing it and each tensor's digest), and
`check_tensor` / `check_tensors` check tensors' bytes without loading them (validate.py builds on them).

Why a module of its own: reading shares nothing with writing but the format (format.py); the checks of a
file's bytes belong with the reader that hands those bytes out.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import weakref
from collections.abc import Callable
from typing import Any, Self

import numpy as np

from SneppX_ALG import _fs, _native, errors
from SneppX_ALG.checkpoint import arrays, format, signing

# check_tensors hashes about this many bytes per native call: progress is reported between calls.
_CHECK_BATCH = 256 << 20


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a file's first and last blocks say: the header, the table and signature bytes, the table, and
    (when trusted keys were given) which of them signed it."""

    head: bytes  # the header block, bytes 0..DATA_OFFSET (or the whole file when it is shorter)
    header: format.Header
    table: bytes
    signature: bytes
    decoded: format.Table
    signer: bytes | None = None


def read_layout(fd: int, size: int, path: str, pread: Callable[[int, int, int], bytes] = os.pread, *,
                trusted_keys: Any = None) -> Layout:
    """Reads and checks the header block, the table and the signature block of an open file of `size`
    bytes (`pread(fd, n, offset)` reads them); the typed error of the first check that fails.

    The table's bytes are checked (length, CRC32C) before anything looks at them; with `trusted_keys`, the
    signature over those raw bytes is checked next, before they are parsed (a forged file costs one read of
    its table, never a parse), and after parsing every tensor must carry a digest."""
    head = pread(fd, min(size, format.DATA_OFFSET), 0)
    header = format.decode_header(head, actual_size=size, path=path)
    if head[format.HEADER_SIZE:].strip(b"\x00"):
        raise errors.NonZeroPaddingError("header padding (bytes 64..4095) is not zero", path=path)
    table = pread(fd, header.table_length, header.table_offset)  # two reads: no copy of a large table sliced
    signature = pread(fd, header.signature_length, header.table_offset + header.table_length)
    if len(signature) != header.signature_length:
        raise errors.TruncatedCheckpointError("signature block is truncated", path=path)
    if signature and _native.crc32c(signature) != header.signature_crc32c:
        raise errors.ChecksumMismatchError("signature block fails its CRC32C", path=path)
    format.check_table_bytes(table, header, path=path)
    signer = None
    if trusted_keys is not None:
        signer = signing.check_signature(signing.TABLE_DOMAIN, table, signature, trusted_keys, path=path)
    decoded = format.decode_table(table, header, path=path)
    if trusted_keys is not None:
        signing.check_digest_coverage(decoded.tensors, path=path)
    return Layout(head, header, table, signature, decoded, signer)


class CheckpointReader:
    """Reads an SNPX file: header and table checked at open, tensors mapped on demand.

    `read(name)` returns a read-only numpy array over the file's memory map (zero-copy) after checking the
    tensor's CRC32C (once per tensor per reader). Arrays stay valid after `close()`; copy them (`np.array`)
    to own writable memory. Reading after `close()` raises `CheckpointClosedError`. A reader that is dropped
    without `close()` closes its file when it is garbage-collected.

    With `trusted_keys`, the table's signature is checked over the raw table bytes before they are parsed (a
    forged file costs one read of its table, never a parse), every tensor must carry a digest, and `read`
    checks the tensor's digest as well as its CRC32C; `signer` is the id of the trusted key that signed.
    The file is mapped only when tensor data is first read.
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True, trusted_keys: Any = None):
        self.path = os.fspath(path)
        self.verify = verify
        self.signer: bytes | None = None
        self._fd, size = _fs.open_checked(self.path)
        # Closes the file when the reader is garbage-collected without close(); close() runs it early.
        self._close_fd = weakref.finalize(self, os.close, self._fd)
        self._map: mmap.mmap | None = None
        try:
            layout = read_layout(self._fd, size, self.path, trusted_keys=trusted_keys)
            self.header, self.table_bytes, self.signature_block = layout.header, layout.table, layout.signature
            self.table, self.signer = layout.decoded, layout.signer
        except BaseException:
            self.close()
            raise
        self._entries = {t.name: t for t in self.table.tensors}
        self._verified: set[str] = set()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fileno(self) -> int:
        """The descriptor the header and table were read from (to copy exactly the file that was checked)."""
        self._check_open()
        return self._fd

    def close(self) -> None:
        if self._fd < 0:
            return
        self._fd = -1
        self._close_fd()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # arrays handed out still use the mapping; it is unmapped when they are gone
            self._map = None

    def _check_open(self) -> None:
        if self._fd < 0:
            raise errors.CheckpointClosedError(f"{self.path}: this CheckpointReader is closed; arrays read "
                                               "before close() stay valid, new reads need a new reader")

    @property
    def _mmap(self) -> mmap.mmap:
        """The whole file, mapped read-only on first use."""
        self._check_open()
        if self._map is None:
            try:
                self._map = mmap.mmap(self._fd, self.header.file_size, prot=mmap.PROT_READ)
            except ValueError:  # Python checks the length against the file's size now
                raise errors.TruncatedCheckpointError(
                    f"file is shorter than its header's {self.header.file_size} bytes: it was truncated after it "
                    "was opened", path=self.path) from None
        return self._map

    @property
    def metadata(self) -> dict[str, str]:
        return self.table.metadata

    @property
    def config(self) -> Any:
        return self.table.config

    def names(self) -> list[str]:
        return [t.name for t in self.table.tensors]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, name: str) -> format.TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise errors.TensorNotFoundError(f"{self.path}: no tensor named {name!r}") from None

    def raw(self, name: str) -> memoryview:
        """The tensor's stored bytes, zero-copy, unverified."""
        entry = self.entry(name)
        return memoryview(self._mmap)[entry.offset:entry.offset + entry.length]

    def read(self, name: str, *, verify: bool | None = None, as_: Callable[[Any], Any] | None = None,
             out: Any = None) -> Any:
        """The tensor as a read-only numpy array over the mapping, CRC-verified unless verify=False (and
        digest-verified too when the reader was opened with trusted_keys).

        as_: a function that takes a DLPack tensor (`torch.from_dlpack`, `jax.dlpack.from_dlpack`,
            `np.asarray`, ...); it gets the tensor mapped copy-on-write (arrays.MappedTensor: writable, not
            copied, writes never reach the file) and read() returns what it returns.
        out: a writable tensor of the same shape and dtype (numpy, or anything with `__dlpack__` or the array
            interface on the CPU, e.g. a torch tensor) to copy the tensor into; read() returns `out`."""
        entry = self.entry(name)
        data = self.raw(name)
        if (self.verify if verify is None else verify) and name not in self._verified:
            problems = check_tensor(self, entry, digest=self.signer is not None)
            if problems:
                raise problems[0]
            self._verified.add(name)
        dtype = format.numpy_dtype(entry.dtype)
        if as_ is not None:
            if out is not None:
                raise ValueError("read() takes as_ or out, not both")
            return as_(arrays.MappedTensor(self.fileno(), entry.offset, dtype, entry.shape, entry.length))
        array = np.frombuffer(data, dtype=dtype, count=math.prod(entry.shape)).reshape(entry.shape)
        if out is not None:
            arrays.copy_into(out, array, what=f"{self.path}: tensor {name!r}")
            return out
        return array

    def padding_is_zero(self, entry: format.TensorEntry) -> bool:
        """True when the padding after the tensor (up to the next 4096 boundary) is all zero."""
        end = entry.offset + entry.length
        return not self._mmap[end:format.align_up(end)].strip(b"\x00")

    def read_all(self) -> dict[str, np.ndarray]:
        return {name: self.read(name) for name in self.names()}


def tensor_errors(entry: format.TensorEntry, crc: int, padding_is_zero: bool, digest_problem: str | None = None,
                  *, path: str | None = None) -> list[errors.CheckpointFormatError]:
    """What is wrong with one tensor, given what was computed over its bytes; [] when nothing.

    In the order a verifier reports them (docs/FORMAT.md, "Verifying", step 6): the CRC32C first, so an
    accident reads as one; then the padding; then the digest, whose mismatch with a matching CRC means the
    bytes were changed deliberately."""
    found: list[errors.CheckpointFormatError] = []
    if crc != entry.crc32c:
        found.append(errors.ChecksumMismatchError(
            f"tensor {entry.name!r} fails its CRC32C (stored {entry.crc32c:#010x}, computed {crc:#010x}): "
            "its bytes changed after they were written", path=path))
    if not padding_is_zero:
        found.append(errors.NonZeroPaddingError(f"padding after tensor {entry.name!r} is not zero", path=path))
    if digest_problem is not None:
        found.append(errors.DigestMismatchError(
            f"tensor {entry.name!r} {digest_problem}"
            + (" (its CRC32C matches: the bytes were changed deliberately)" if crc == entry.crc32c else ""),
            path=path))
    return found


def check_tensor(reader: CheckpointReader, entry: format.TensorEntry, *,
                 digest: bool = False) -> list[errors.CheckpointFormatError]:
    """Checks one tensor's bytes in the file: CRC32C, zero padding and, with `digest`, its digest from the
    table (hashed on signing's worker thread while this thread computes the CRC of the same bytes)."""
    data = reader.raw(entry.name)
    digest_check = signing.start_digest_check(data, entry.digest) if digest and entry.digest is not None else None
    crc = _native.crc32c_parallel(data)
    digest_problem = digest_check() if digest_check is not None else None
    return tensor_errors(entry, crc, reader.padding_is_zero(entry), digest_problem, path=reader.path)


def check_tensors(reader: CheckpointReader, progress: Callable[[int, int], None] | None = None,
                  ) -> list[errors.CheckpointFormatError]:
    """Checks every tensor's CRC32C and padding (not digests), in file order; what is wrong, [] when nothing.

    The tensors' bytes are hashed a batch at a time, each batch split evenly over every core whatever the
    tensors' sizes (a file of small tensors is checked as fast as one of large ones, and one native call per
    batch instead of one per tensor). `progress(done, total)` after each batch: bytes of the file checked."""
    found: list[errors.CheckpointFormatError] = []
    entries = reader.table.tensors
    start = 0
    while start < len(entries):
        end, size = start + 1, entries[start].length
        while end < len(entries) and size + entries[end].length <= _CHECK_BATCH:
            size += entries[end].length
            end += 1
        batch, start = entries[start:end], end
        crcs = _native.crc32c_ranges(reader._mmap, [(e.offset, e.length) for e in batch])
        for entry, crc in zip(batch, crcs, strict=True):
            found += tensor_errors(entry, crc, reader.padding_is_zero(entry), path=reader.path)
        if progress is not None:
            progress(batch[-1].offset + batch[-1].length, reader.header.table_offset)
    return found
