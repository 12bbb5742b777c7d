"""Load-time resharding: read from a step only the bytes this rank needs, and check every byte it reads.

Why: a step saved by N ranks is loaded by M (any M, larger or smaller); each rank needs some boxes of some
tensors (its shards of the optimizer state, the whole replicated parameters). Reading every shard file whole
and cutting afterwards would cost each rank the whole checkpoint. Here, per needed box and per saved chunk
of its tensor, the intersection is computed dimension by dimension (checkpoint/chunks.py, as PyTorch DCP's
planner does), turned into the byte runs it occupies in the chunk, and only the checksum blocks those runs
touch are read (pread locally, a ranged GET on S3: storage.StepReader). Every block read is checked against
its CRC32C in the manifest (and, with trusted keys, its BLAKE3 in the signed manifest) before a byte of it is
copied out, so what is loaded is exactly what was verified. Beyond the bytes needed, a load reads: the
manifest (and its signature), the header block (4 KiB) and table of each shard file it touches, and up to
two partial blocks per byte run (docs/FORMAT.md, "Sharded steps: loading at another world size").

Steps saved before manifest version 3 have no block checksums; `load` leaves them to a whole read
(coordinator/steps.py reads them the old way and cuts the boxes out).

A chunk of an incremental step (manifest version 4) may live in an earlier step's file (`from`): it is read from
there through `open_step`, and checked like any chunk of the step (each block's CRC32C; with trusted keys its
BLAKE3 in the signed manifest), so a reference to bytes that are gone or were changed makes this step invalid,
never wrong.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from SneppX_ALG import errors, storage
from SneppX_ALG.checkpoint import chunks, file, format, signing
from SneppX_ALG.checkpoint import manifest as manifest_codec


@dataclasses.dataclass(frozen=True)
class Need:
    """A block of one saved tensor a rank wants: `box` of the global tensor (None: all of it, which must then
    have `shape` when that is given), as `dtype` (None: whatever was saved; else it must be the saved dtype)."""

    path: tuple[str, ...]
    box: chunks.Box | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    def resolve(self, shape: tuple[int, ...], dtype: str, step: int) -> chunks.Box:
        """The box wanted of a saved tensor of `shape` and `dtype`; ShardingMismatchError when it doesn't fit."""
        where = "/".join(self.path)
        if self.dtype is not None and self.dtype != dtype:
            raise errors.ShardingMismatchError(f"{where} was saved as {dtype}, the target is {self.dtype}")
        if self.box is None and self.shape is not None and tuple(self.shape) != shape:
            raise errors.ShardingMismatchError(f"{where} was saved with shape {list(shape)} in step {step}, the "
                                               f"target has {list(self.shape)}")
        box = self.box if self.box is not None else chunks.Box.whole(shape)
        if not chunks.inside(shape, box):
            raise errors.ShardingMismatchError(f"{where}: the target box at {list(box.offset)} of shape "
                                               f"{list(box.shape)} is not inside the saved {list(shape)}")
        return box


@dataclasses.dataclass
class ReadStats:
    """What a load read: `needed` bytes of tensors asked for; `data` bytes of chunk data read (whole checksum
    blocks); `metadata` bytes of manifest, signature and the shard files' header blocks and tables; `reads`
    requests made (pread calls locally, ranged GETs on S3) for data and metadata; `cut` the saved chunks read
    only in part (the only reads that go beyond what is needed: by at most two partial blocks each, when the
    part is one byte run, as every part of a 1-D or row-split tensor is)."""

    needed: int = 0
    data: int = 0
    metadata: int = 0
    reads: int = 0
    cut: int = 0


@dataclasses.dataclass(frozen=True)
class _Work:
    """One saved chunk's part of one need: read blocks [first, stop) of the chunk, copy `part` out."""

    need: int
    chunk: dict[str, Any]
    part: chunks.Box
    blocks: np.ndarray  # (m, 2) coalesced block ranges


OpenStep = Callable[[int], contextlib.AbstractContextManager[storage.StepReader]]


def load(reader: storage.StepReader, step: int, needs: list[Need], trusted_keys: dict[bytes, Any] | None = None,
         stats: ReadStats | None = None, open_step: OpenStep | None = None,
         ) -> tuple[dict[str, Any] | None, list[str], list[np.ndarray] | None]:
    """(manifest, problems, arrays): one new array per need, holding the box it asked for, read and checked
    as the module docstring says; arrays is None when there are problems (the step is invalid: a verdict), and
    also for a step older than manifest version 3 (manifest["version"] says so: read it whole instead).

    `open_step(s)` opens an earlier step of the same root, for the chunks an incremental step references there.

    Raises ShardingMismatchError when a need does not fit the step (a tensor it lacks, another dtype, a box
    outside the tensor): that is not the step's fault. I/O errors propagate (StorageError, OSError): they are
    not a verdict either, and the caller retries."""
    stats = stats if stats is not None else ReadStats()
    try:
        raw = reader.read_file(storage.MANIFEST)
        signature = (reader.read_file(storage.SIGNATURE) or b"") if trusted_keys is not None else b""
    except errors.CheckpointFormatError as e:  # a FIFO, a link, a directory where a small file should be
        return None, [f"{type(e).__name__}: {e}"], None
    if raw is None:
        return None, [f"{reader.location}: manifest.json is missing"], None
    stats.metadata += len(raw) + len(signature)
    if trusted_keys is not None:  # before parsing: a forged manifest costs nothing more than this
        try:
            signing.check_manifest_signature(raw, signature, trusted_keys, path=reader.location)
        except errors.SneppXError as e:
            return None, [f"{type(e).__name__}: {e}"], None
    if reader.marker is not None:
        problem = storage.marker_problem(reader.marker, raw, step)
        if problem is not None:
            return None, [problem], None
    try:
        manifest = manifest_codec.decode_manifest(raw, step=step, where=f"{reader.location}/{storage.MANIFEST}")
    except errors.ManifestError as e:
        return None, [str(e)], None
    if manifest["version"] < 3:
        return manifest, [], None
    tensors = {tuple(t["path"]): t for t in manifest["tensors"]}
    outs, work = _plan(manifest, tensors, needs, stats)
    if trusted_keys is not None:
        problem = _unsigned(manifest, work)
        if problem is not None:
            return manifest, [problem], None
    problems = _read_work(reader, manifest, work, needs, outs, trusted_keys is not None, stats, open_step)
    if problems:
        return manifest, problems, None
    return manifest, [], outs


def read_references(open_step: OpenStep, manifest: dict[str, Any], outs: list[np.ndarray] | None,
                    signed: bool = False, stats: ReadStats | None = None) -> list[str]:
    """Reads every chunk a version 4 manifest references in earlier steps, whole, checking each block's CRC32C
    (and, `signed`: the manifest's signature was checked, its BLAKE3), into `outs` (one array per manifest tensor,
    in order; None: check only). Returns the problems."""
    needs = [Need(tuple(t["path"])) for t in manifest["tensors"]]
    work = []
    for index, tensor in enumerate(manifest["tensors"]):
        for chunk in tensor["chunks"]:
            if manifest_codec.reference(chunk) is not None:
                box = chunks.Box(tuple(chunk["offset"]), tuple(chunk["shape"]))
                count = manifest_codec.block_count(chunk["nbytes"], manifest["block_bytes"])
                work.append(_Work(index, chunk, box, np.array([[0, count]] if count else [], np.int64).reshape(-1, 2)))
    return _read_work(None, manifest, work, needs, outs, signed, stats or ReadStats(), open_step)


def _read_work(reader: storage.StepReader | None, manifest: dict[str, Any], work: list[_Work], needs: list[Need],
               outs: list[np.ndarray] | None, signed: bool, stats: ReadStats, open_step: OpenStep | None,
               ) -> list[str]:
    """Reads `work`, file by file: this step's shards through `reader`, referenced files of earlier steps through
    `open_step`. Returns the problems (a verdict on the step)."""
    problems: list[str] = []
    by_file: dict[tuple[int, str], list[_Work]] = {}
    for item in work:
        ref = manifest_codec.reference(item.chunk)
        key = ref if ref is not None else (-1, manifest["shards"][item.chunk["shard"]])
        by_file.setdefault(key, []).append(item)
    def read(origin: int, name: str, items: list[_Work]) -> tuple[ReadStats, str | None]:
        counted = ReadStats()
        try:
            if origin < 0:
                assert reader is not None
                _read_file(reader, manifest, name, items, needs, outs, signed, counted, own=True)
            elif open_step is None:
                return counted, f"step {manifest['step']} references step {origin}, which this reader can't open"
            else:
                with open_step(origin) as other:
                    _read_file(other, manifest, name, items, needs, outs, signed, counted, own=False)
        except (errors.CheckpointFormatError, errors.CheckpointNotFoundError) as e:
            where = "" if origin < 0 else f"step {manifest['step']} references {name} of step {origin}: "
            return counted, f"{where}{type(e).__name__}: {e}"
        return counted, None

    # This step's own files through its one reader, in turn; earlier steps' files at once, each through a reader of
    # its own on a thread of its own (the native reads and the GETs release the GIL, and each file fills disjoint
    # bytes of the targets): a chain step's bytes lie in several files, and read one after the other a cold
    # restore waited for each disk read in turn (docs/BENCHMARKS.md, "Incremental checkpoints").
    files = sorted(by_file.items())
    results = [read(origin, name, items) for (origin, name), items in files if origin < 0]
    referenced = [(origin, name, items) for (origin, name), items in files if origin >= 0]
    if len(referenced) > 1:
        with concurrent.futures.ThreadPoolExecutor(min(_FILE_THREADS, len(referenced))) as pool:
            results += list(pool.map(lambda f: read(*f), referenced))
    else:
        results += [read(*f) for f in referenced]
    for counted, problem in results:
        for field in dataclasses.fields(ReadStats):
            setattr(stats, field.name, getattr(stats, field.name) + getattr(counted, field.name))
        if problem is not None:
            problems.append(problem)
    return problems


_FILE_THREADS = 4  # earlier steps' files one load reads at once


def _plan(manifest: dict[str, Any], tensors: dict[tuple[str, ...], dict[str, Any]], needs: list[Need],
          stats: ReadStats) -> tuple[list[np.ndarray], list[_Work]]:
    """An empty array per need, and what to read for it: per saved chunk that intersects it, the blocks."""
    outs: list[np.ndarray] = []
    work: list[_Work] = []
    block_bytes = manifest["block_bytes"]
    for index, need in enumerate(needs):
        tensor = tensors.get(need.path)
        if tensor is None:
            raise errors.ShardingMismatchError(f"step {manifest['step']} has no tensor {'/'.join(need.path)}")
        box = need.resolve(tuple(tensor["shape"]), tensor["dtype"], manifest["step"])
        dtype = format.numpy_dtype(tensor["dtype"])
        outs.append(np.empty(box.shape, dtype))
        stats.needed += box.volume * dtype.itemsize
        for chunk in tensor["chunks"]:
            saved = chunks.Box(tuple(chunk["offset"]), tuple(chunk["shape"]))
            part = chunks.intersect(saved, box)
            if part is None:
                continue
            runs = chunks.byte_runs(saved, part, dtype.itemsize)
            work.append(_Work(index, chunk, part, chunks.touched_blocks(runs, block_bytes)))
            stats.cut += part != saved
    return outs, work


def _unsigned(manifest: dict[str, Any], work: list[_Work]) -> str | None:
    """Why a signature can't vouch for what this load reads (a shard not listed, a chunk without block
    digests), or None."""
    listed = manifest.get("files") or {}
    for item in work:
        if manifest_codec.reference(item.chunk) is not None:
            continue  # its block digests, in the signed manifest, vouch for it (the codec requires them)
        shard = manifest["shards"][item.chunk["shard"]]
        if shard not in listed:
            return (f"DigestMismatchError: shard {shard} has no digest in the signed manifest, so the signature "
                    "does not cover it")
        if item.chunk.get("digests") is None:
            return (f"DigestMismatchError: chunk {item.chunk['entry']!r} of {shard} has no block digests in the "
                    "signed manifest, so a partial read of it can't be checked against the signature")
    return None


def _read_file(reader: storage.StepReader, manifest: dict[str, Any], name: str, items: list[_Work],
               needs: list[Need], outs: list[np.ndarray] | None, signed: bool, stats: ReadStats, *, own: bool) -> None:
    """Reads what `items` need of one shard file (this step's, `own`, or an earlier step's that this step
    references): its header and table, then the blocks, each checked."""
    path = f"{reader.location}/{name}"
    size = reader.size(name)
    listed = (manifest.get("files") or {}).get(name) if own else None
    if signed and listed is not None and listed.get("size") != size:
        raise errors.TruncatedCheckpointError(f"file {name!r} is {size} bytes, the manifest says {listed.get('size')}",
                                              path=reader.location)

    def pread(_fd: int, n: int, offset: int) -> bytes:
        buffer = bytearray(n)
        reader.read_blocks(name, memoryview(buffer), offset, max(1, n))
        stats.metadata += n
        stats.reads += 1 if n else 0
        return bytes(buffer)

    layout = file.read_layout(-1, size, path, pread)
    entries = {entry.name: entry for entry in layout.decoded.tensors}
    block_bytes = manifest["block_bytes"]
    tensors = {tuple(t["path"]): t for t in manifest["tensors"]}
    flats: dict[int, np.ndarray] = {}  # each target's bytes, viewed once per file, not once per chunk
    reads: list[_Read] = []
    for item in items:
        chunk = item.chunk
        tensor = tensors[needs[item.need].path]
        entry = entries.get(chunk["entry"])
        if entry is None:
            raise errors.CorruptTableError(f"has no entry {chunk['entry']!r}, which the manifest names", path=path)
        if not manifest_codec.entry_matches(entry, chunk, tensor):
            raise errors.CorruptTableError(f"entry {chunk['entry']!r} does not match the manifest", path=path)
        place = _direct_place(item, needs[item.need], outs[item.need], flats) if outs is not None else None
        reads.append(_Read(item, entry.offset, *(place or (None, 0))))
    reads.sort(key=lambda r: r.offset)
    digests_too = signed
    index = 0
    while index < len(reads):  # chunks read whole, adjacent in the file and in their target: one read
        run, size = [reads[index]], reads[index].item.chunk["nbytes"]
        while (index + len(run) < len(reads) and run[-1].joins(reads[index + len(run)], block_bytes)
               and size < _RUN_BYTES):
            run.append(reads[index + len(run)])
            size += run[-1].item.chunk["nbytes"]
        if len(run) > 1:
            _read_run(reader, name, path, run, block_bytes, digests_too, stats)
        else:
            _read_one(reader, name, path, run[0], needs, outs, block_bytes, digests_too, stats)
        index += len(run)


_RUN_BYTES = 64 << 20  # the most one coalesced read takes


@dataclasses.dataclass(frozen=True)
class _Read:
    """One chunk's part to read: where its entry starts in the file, and, when it lands whole in one byte range of
    its target, that target's bytes (`flat`) and where in them (`start`)."""

    item: _Work
    offset: int
    flat: np.ndarray | None
    start: int

    @property
    def direct(self) -> np.ndarray | None:
        return None if self.flat is None else self.flat[self.start:self.start + self.item.chunk["nbytes"]]

    def joins(self, after: _Read, block_bytes: int) -> bool:
        """Whether `after` continues this read in the file and in the same target (this one a whole number of
        blocks, so the blocks of the joined read are each chunk's own)."""
        nbytes = self.item.chunk["nbytes"]
        return (self.flat is not None and after.flat is not None and after.item.need == self.item.need
                and after.start == self.start + nbytes and after.offset == self.offset + nbytes
                and nbytes % block_bytes == 0)


def _check_blocks(view: memoryview, got: list[int], chunk: dict[str, Any], first: int, block_bytes: int,
                  digests: list[bytes] | None, path: str) -> None:
    """The CRC32C (and BLAKE3) of blocks first, first + 1, ... of a chunk, read into `view`, against the manifest."""
    crcs = manifest_codec.block_crcs(chunk)
    if digests is None and got == crcs[first:first + len(got)]:
        return  # the usual case, in one comparison; a mismatch is found and named below
    for block, crc in enumerate(got, start=first):
        if crc != crcs[block]:
            raise errors.ChecksumMismatchError(
                f"block {block} of {chunk['entry']!r} fails its CRC32C (stored {crcs[block]:#010x}, read "
                f"{crc:#010x})", path=path)
        if digests is not None:
            piece = view[(block - first) * block_bytes:(block - first + 1) * block_bytes]
            if bytes.fromhex(signing.block_digest(piece)) != digests[block]:
                raise errors.DigestMismatchError(
                    f"block {block} of {chunk['entry']!r} does not match its BLAKE3 in the signed manifest",
                    path=path)


def _read_run(reader: storage.StepReader, name: str, path: str, run: list[_Read], block_bytes: int,
              digests_too: bool, stats: ReadStats) -> None:
    """Whole chunks that lie one after the other in the file and in their target: one read, then each checked."""
    assert run[0].flat is not None
    total = sum(r.item.chunk["nbytes"] for r in run)
    target = run[0].flat[run[0].start:run[0].start + total]
    got = reader.read_blocks(name, target.data, run[0].offset, block_bytes)
    stats.data += total
    stats.reads += 1
    position, block = 0, 0
    for r in run:
        chunk = r.item.chunk
        count = manifest_codec.block_count(chunk["nbytes"], block_bytes)
        if digests_too or got[block:block + count] != manifest_codec.block_crcs(chunk):  # else: all match
            _check_blocks(target[position:position + chunk["nbytes"]].data, got[block:block + count], chunk, 0,
                          block_bytes, manifest_codec.block_digests(chunk) if digests_too else None, path)
        position += chunk["nbytes"]
        block += count


def _read_one(reader: storage.StepReader, name: str, path: str, read: _Read, needs: list[Need],
              outs: list[np.ndarray] | None, block_bytes: int, digests_too: bool, stats: ReadStats) -> None:
    """One chunk's blocks (what the need takes of it), each checked, into its target or a scratch buffer."""
    item = read.item
    chunk = item.chunk
    digests = manifest_codec.block_digests(chunk) if digests_too else None
    base = int(item.blocks[0, 0]) * block_bytes if len(item.blocks) else 0
    end = min(int(item.blocks[-1, 1]) * block_bytes, chunk["nbytes"]) if len(item.blocks) else 0
    scratch = read.direct if read.direct is not None else np.empty(end - base, np.uint8)
    for first, stop in item.blocks.tolist():
        lo, hi = first * block_bytes, min(stop * block_bytes, chunk["nbytes"])
        view = scratch[lo - base:hi - base].data
        got = reader.read_blocks(name, view, read.offset + lo, block_bytes)
        stats.data += hi - lo
        stats.reads += 1
        _check_blocks(view, got, chunk, first, block_bytes, digests, path)
    if read.direct is None and outs is not None:
        _copy_out(scratch, base, chunk, item.part, needs[item.need], outs[item.need])


def _direct_place(item: _Work, need: Need, out: np.ndarray, flats: dict[int, np.ndarray],
                  ) -> tuple[np.ndarray, int] | None:
    """Where a chunk needed whole lands in `out` when that is one byte range of it (the common case: a whole
    tensor, a row block, a range of a 1-D tensor): (out's bytes, the range's start); its blocks are read and checked
    right there, no copy. `flats`: out's bytes by need, made once."""
    offset, shape = item.chunk["offset"], item.chunk["shape"]
    if item.part.offset != tuple(offset) or item.part.shape != tuple(shape) or 0 in shape:
        return None
    origin = need.box.offset if need.box is not None else (0,) * out.ndim
    local = chunks.Box(tuple(o - b for o, b in zip(offset, origin, strict=True)), tuple(shape))
    if not chunks.is_contiguous(out.shape, local):
        return None
    start = 0
    for index, extent in zip(local.offset, out.shape, strict=True):  # np.ravel_multi_index, without its cost
        start = start * extent + index
    flat = flats.get(item.need)
    if flat is None:
        flat = flats[item.need] = out.reshape(-1).view(np.uint8)
    return flat, int(start) * out.itemsize


def _copy_out(scratch: np.ndarray, base: int, chunk: dict[str, Any], part: chunks.Box, need: Need,
              out: np.ndarray) -> None:
    """Copies `part` from the chunk's checked bytes (scratch holds the chunk's bytes from `base` on) into `out`."""
    if part.volume == 0:
        return
    itemsize = out.dtype.itemsize
    shape = tuple(chunk["shape"])
    strides = tuple(itemsize * math.prod(shape[i + 1:]) for i in range(len(shape)))
    first = sum((p - c) * st for p, c, st in zip(part.offset, chunk["offset"], strides, strict=True))
    source = np.ndarray(part.shape, out.dtype, buffer=scratch, offset=first - base, strides=strides)
    origin = need.box.offset if need.box is not None else (0,) * out.ndim
    out[part.slices(origin)] = source


def whole_tensors_to_needs(manifest: dict[str, Any], arrays: list[np.ndarray],
                           needs: list[Need]) -> list[np.ndarray]:
    """The boxes `needs` ask for, cut from whole tensors (a step read whole: versions before 3)."""
    by_path = {tuple(t["path"]): (t, a) for t, a in zip(manifest["tensors"], arrays, strict=True)}
    out = []
    for need in needs:
        if need.path not in by_path:
            raise errors.ShardingMismatchError(f"step {manifest['step']} has no tensor {'/'.join(need.path)}")
        tensor, array = by_path[need.path]
        box = need.resolve(array.shape, tensor["dtype"], manifest["step"])
        out.append(np.array(array[box.slices()], copy=True))
    return out

