"""CheckpointCoordinator: periodic, asynchronous, crash-consistent checkpoints with retention.

Why it exists: a training loop wants `coord.save(model, step)` to cost about one memory copy, never a disk or
network write, and it wants whatever it finds after a crash to be a whole checkpoint. So a save is split:

1. **Snapshot** (on the caller's thread, `save()` returns after it): the state is copied into staging
   buffers by the native copy engine (plain threads on the CPU; pinned memory, its own CUDA stream and one
   event per piece for GPU tensors), and the CRC32C of every piece is taken as it lands.
2. **Persist** (one background thread): each staging buffer is streamed into an SNPX shard file, the CRC
   the writer computes is checked against the snapshot's (staging memory can't silently change bytes),
   the buffer goes back to the pool, and at the end the step is committed through `storage` (local rename
   or S3 marker with If-None-Match) and retention runs.

Staging memory is bounded (`staging_bytes`) and multi-buffered: when the state is larger than the staging
area, `save()` fills the free buffers while the writer drains full ones, and returns once the last piece is
copied. A tensor larger than one buffer is split into row blocks (or flat ranges), which the manifest joins
again. CPU snapshots copy rather than fork (copy-on-write); docs/BENCHMARKS.md has the measurement.

Errors from the background are kept and raised by the next `save()`, `wait()` or `close()`.

Call order (one coordinator per process; in a multi-rank job, the rank that owns the root):

    coord = CheckpointCoordinator(checkpoint_root="/ckpts", save_every_n_steps=1000, max_to_keep=5)
    info = coord.restore(model)            # None on a fresh start; else .step and .training_state
    for step in ...:
        if coord.should_save(step):
            coord.save(model, step=step, training_state={"data_position": pos})
    coord.close()                          # or use `with CheckpointCoordinator(...) as coord:`
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import queue
import threading
import types
import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any, Self

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ed25519

from SneppX_ALG import _native, checkpoint, errors, format, signing, storage

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 1 << 30
MIN_BUFFER_BYTES = 1 << 20
MAX_BUFFER_BYTES = 64 << 20
SHARD_FILE = "shard-{:05d}.snpx"
MANIFEST_FORMAT = "sneppx.manifest"
MANIFEST_VERSION = 1
_PIECE_ALIGN = 64


# ---- pure: what a state is made of ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of the state: where it sits in the tree, and its dtype and shape."""

    path: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    itemsize: int

    @property
    def name(self) -> str:
        return "/".join(self.path)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize


@dataclasses.dataclass(frozen=True)
class Piece:
    """A contiguous byte range of one tensor, staged at `offset` in buffer `buffer`, stored as `entry`."""

    tensor: int
    entry: str
    start: int
    nbytes: int
    shape: tuple[int, ...]
    global_offset: tuple[int, ...] | None
    buffer: int
    offset: int


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def choose_buffer_bytes(state_bytes: int, staging_bytes: int) -> int:
    """Staging buffer size: about a quarter of the state (so copy and write overlap even when it all fits),
    between 1 and 64 MiB, and at most half the staging area (at least two buffers: double buffering)."""
    want = _align(max(1, state_bytes // 4), 4096)
    size = min(max(want, MIN_BUFFER_BYTES), MAX_BUFFER_BYTES, max(4096, staging_bytes // 2))
    return _align(size, 4096)


def split_tensor(spec: TensorSpec, max_bytes: int,
                 first_bytes: int | None = None) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...] | None]]:
    """(start byte, nbytes, stored shape, global offset) of each piece of a tensor: the first piece at most
    first_bytes (to fill what is left of a buffer; skipped when not even one unit fits), the others at most
    max_bytes. Pieces are blocks of rows (dimension 0) when a row fits in max_bytes, else flat ranges."""
    total = spec.nbytes
    first = max_bytes if first_bytes is None else min(first_bytes, max_bytes)
    if total <= first:
        return [(0, total, spec.shape, None)]
    shape = spec.shape
    by_rows = len(shape) >= 1 and shape[0] > 1 and total // shape[0] <= max_bytes
    unit = total // shape[0] if by_rows else spec.itemsize
    out: list[tuple[int, int, tuple[int, ...], tuple[int, ...] | None]] = []
    start, budget = 0, first
    while start < total:
        n = min(budget // unit * unit, total - start)
        if n > 0:
            if by_rows:
                out.append((start, n, (n // unit, *shape[1:]), (start // unit,) + (0,) * (len(shape) - 1)))
            else:
                out.append((start, n, (n // unit,), None))
            start += n
        budget = max_bytes
    return out


def plan_pieces(specs: list[TensorSpec], buffer_bytes: int) -> list[list[Piece]]:
    """Packs every tensor's pieces into buffers of buffer_bytes, in order; returns the pieces per buffer.

    Entry names in the shard: the tensor's path joined with "/" when it is one piece, else `name@<i>`;
    a name already taken gets "~" appended until it is unique (the manifest maps entries back to paths)."""
    used: set[str] = set()
    own_name: dict[int, str] = {}
    for index, spec in enumerate(specs):  # whole tensors keep their own names first
        if spec.nbytes <= buffer_bytes and spec.name not in used:
            used.add(spec.name)
            own_name[index] = spec.name

    def unique(name: str) -> str:
        while name in used:
            name += "~"
        used.add(name)
        return name

    buffers: list[list[Piece]] = [[]]
    fill = 0
    for index, spec in enumerate(specs):
        # A tensor that fits in a buffer moves whole to the next one when it doesn't fit here; a larger one
        # starts by filling this buffer, so buffers are full and the staging area holds as much as it can.
        room = buffer_bytes - _align(fill, _PIECE_ALIGN)
        parts = split_tensor(spec, buffer_bytes, room if spec.nbytes > buffer_bytes else None)
        for i, (start, nbytes, shape, global_offset) in enumerate(parts):
            if index in own_name:
                entry = own_name[index]
            else:
                entry = unique(f"{spec.name}@{i}" if len(parts) > 1 else spec.name)
            offset = _align(fill, _PIECE_ALIGN)
            if offset + nbytes > buffer_bytes and buffers[-1]:
                buffers.append([])
                offset = 0
            buffers[-1].append(Piece(index, entry, start, nbytes, shape, global_offset, len(buffers) - 1, offset))
            fill = offset + nbytes
    return [b for b in buffers if b]


def is_save_step(step: int, every: int | None, last_saved: int | None) -> bool:
    """True on multiples of `every` that were not saved already (every=None or 0: never)."""
    return bool(every) and step % every == 0 and step != last_saved  # type: ignore[operator]


def steps_to_delete(committed: list[int], *, new_step: int, max_to_keep: int | None,
                    keep_every_n_steps: int | None = None, protected: frozenset[int] = frozenset()) -> list[int]:
    """Retention, decided after `new_step` was committed: keeps the newest max_to_keep steps, every step
    divisible by keep_every_n_steps, new_step itself and `protected` (e.g. the last step known valid).
    Only steps older than new_step are ever deleted, so the newest good copy survives until a newer one
    is committed. max_to_keep None or 0 keeps everything."""
    if not max_to_keep or max_to_keep < 0:
        return []
    ordered = sorted(set(committed) | {new_step})
    keep = set(ordered[-max_to_keep:]) | {new_step} | set(protected)
    if keep_every_n_steps:
        keep |= {s for s in ordered if s % keep_every_n_steps == 0}
    return [s for s in ordered if s not in keep and s < new_step]


# ---- pure: the manifest -----------------------------------------------------------------------------------


def build_manifest(step: int, specs: list[TensorSpec], pieces: list[Piece], crcs: dict[str, int],
                   values: list[tuple[tuple[str, ...], Any]], kind: str, training_state: Any,
                   shards: list[str], files: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The step's manifest. `files`: {shard name: {"size", "digest"}}, what a signature over the manifest
    vouches for (docs/FORMAT.md, "Multi-file checkpoints")."""
    tensors = []
    for index, spec in enumerate(specs):
        own = [p for p in pieces if p.tensor == index]
        tensors.append({
            "path": list(spec.path), "dtype": spec.dtype, "shape": list(spec.shape), "nbytes": spec.nbytes,
            "pieces": [{"shard": 0, "entry": p.entry, "start": p.start, "nbytes": p.nbytes,
                        "crc32c": crcs[p.entry]} for p in own]})
    return {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "step": step,
        "created": datetime.datetime.now(datetime.UTC).isoformat(),
        "world_size": 1, "kind": kind, "shards": shards, "tensors": tensors,
        "values": [{"path": list(path), "value": value} for path, value in values],
        "training_state": training_state,
        **({"files": files} if files is not None else {}),
    }


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True, allow_nan=False, separators=(",", ":")).encode()


def decode_manifest(raw: bytes, *, step: int, where: str) -> dict[str, Any]:
    """Parses and checks a manifest; ManifestError with what is wrong."""
    def bad(why: str) -> errors.ManifestError:
        return errors.ManifestError(why, path=where)

    if len(raw) > storage.MAX_MANIFEST_BYTES:
        raise bad(f"manifest is {len(raw)} bytes, more than {storage.MAX_MANIFEST_BYTES}")
    try:
        m = json.loads(raw, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"manifest is not JSON: {e}") from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
        raise bad("not a SneppX manifest")
    if m.get("version") != MANIFEST_VERSION:
        raise bad(f"manifest version {m.get('version')!r} is not supported (this reader: {MANIFEST_VERSION})")
    if m.get("step") != step:
        raise bad(f"manifest says step {m.get('step')!r}, the directory says {step}")
    shards = m.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, str) and s == os.path.basename(s) and s
                                               and not s.startswith(".") for s in shards):
        raise bad("manifest 'shards' must be a list of plain file names")
    if not isinstance(m.get("tensors"), list) or not isinstance(m.get("values"), list):
        raise bad("manifest 'tensors' and 'values' must be lists")
    for t in m["tensors"]:
        try:
            path, dtype, shape, nbytes, pieces = t["path"], t["dtype"], t["shape"], t["nbytes"], t["pieces"]
            ok = (isinstance(path, list) and path and all(isinstance(p, str) for p in path)
                  and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                  and isinstance(pieces, list) and format.tensor_nbytes(dtype, tuple(shape)) == nbytes)
        except (KeyError, TypeError, errors.SneppXError, ValueError):
            ok = False
        if not ok:
            raise bad(f"manifest tensor entry {str(t)[:200]} is malformed")
        covered = 0
        for p in pieces:
            if not (isinstance(p, dict) and p.get("start") == covered and isinstance(p.get("nbytes"), int)
                    and p["nbytes"] >= 0 and isinstance(p.get("entry"), str) and isinstance(p.get("crc32c"), int)
                    and isinstance(p.get("shard"), int) and 0 <= p["shard"] < len(shards)):
                raise bad(f"tensor {'/'.join(path)}: pieces are malformed or not contiguous")
            covered += p["nbytes"]
        if covered != nbytes:
            raise bad(f"tensor {'/'.join(path)}: pieces cover {covered} of {nbytes} bytes")
    return m


# ---- the state: flatten on save, rebuild on restore ---------------------------------------------------------


@dataclasses.dataclass
class _DeviceArray:
    """A CUDA array seen through __cuda_array_interface__ (torch, cupy): pointer, dtype, shape, device."""

    pointer: int
    dtype: np.dtype
    shape: tuple[int, ...]
    device: int


def is_c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether byte strides describe a C-contiguous layout (computed, never allocated: the tensor may be
    as large as a GPU's memory). A dimension of size 1 may have any stride, and an empty tensor is any
    layout, as in numpy's and torch's own contiguity flags."""
    if len(strides) != len(shape):
        return False
    if 0 in shape:
        return True
    expected = itemsize
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _leaf(value: Any) -> np.ndarray | _DeviceArray | None:
    """The array behind a state value, or None when it is a plain JSON value."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, np.generic):
        return np.asarray(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    cai = getattr(value, "__cuda_array_interface__", None)
    if cai is not None:
        strides = cai.get("strides")
        dtype = np.dtype(cai["typestr"])
        shape = tuple(int(d) for d in cai["shape"])
        if strides is not None and not is_c_contiguous(shape, tuple(strides), dtype.itemsize):
            raise errors.UnsupportedTensorError("a non-contiguous CUDA tensor can't be snapshot; call "
                                                ".contiguous() first")
        device = getattr(value, "device", None)
        index = getattr(device, "index", None)
        if index is None:
            index = getattr(device, "id", 0)
        return _DeviceArray(int(cai["data"][0]), dtype, shape, int(index or 0))
    return checkpoint.as_array(value)


def flatten_state(obj: Any) -> tuple[str, list[tuple[tuple[str, ...], np.ndarray | _DeviceArray]],
                                     list[tuple[tuple[str, ...], Any]]]:
    """(kind, tensors, plain values) of a model (state_dict()), or a (nested) mapping of arrays."""
    if hasattr(obj, "state_dict") and callable(obj.state_dict):
        kind, tree = "state_dict", obj.state_dict()
    elif isinstance(obj, Mapping):
        kind, tree = "mapping", obj
    else:
        raise errors.UnsupportedTensorError(f"can't checkpoint a {type(obj).__name__}: pass an object with "
                                            "state_dict()/load_state_dict() or a dict of arrays")
    tensors: list[tuple[tuple[str, ...], Any]] = []
    values: list[tuple[tuple[str, ...], Any]] = []

    def walk(node: Mapping[Any, Any], prefix: tuple[str, ...]) -> None:
        for key, value in node.items():
            if not isinstance(key, str) or not key:
                raise errors.UnsupportedTensorError(f"state key {key!r} at {'/'.join(prefix) or 'top'} must be a "
                                                    "non-empty string")
            path = (*prefix, key)
            if isinstance(value, Mapping):
                walk(value, path)
                continue
            leaf = _leaf(value)
            if leaf is None:
                values.append((path, value))
            else:
                tensors.append((path, leaf))

    walk(tree, ())
    return kind, tensors, values


def _check_json_safe(value: Any, what: str) -> None:
    try:
        format.check_config(value)
    except errors.SneppXError as e:
        raise errors.UnsupportedTensorError(f"{what} must be JSON-safe (it goes into manifest.json): "
                                            f"{e}") from None


def _spec(path: tuple[str, ...], leaf: np.ndarray | _DeviceArray) -> TensorSpec:
    dtype = leaf.dtype
    return TensorSpec(path, format.dtype_name(dtype), tuple(int(d) for d in leaf.shape), dtype.itemsize)


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _load_into_mapping(target: MutableMapping[str, Any], loaded: Mapping[str, Any]) -> None:
    """Writes arrays into the existing ones where dtype and shape match (references stay valid)."""
    for key, value in loaded.items():
        current = target.get(key)
        if isinstance(value, dict) and isinstance(current, MutableMapping):
            _load_into_mapping(current, value)
        elif (isinstance(value, np.ndarray) and isinstance(current, np.ndarray) and current.flags.writeable
              and current.shape == value.shape and current.dtype == value.dtype):
            np.copyto(current, value)
        else:
            target[key] = value


def _host_piece(job: _Job, leaf: np.ndarray, piece: Piece) -> np.ndarray:
    """The bytes of one piece of a host tensor, little-endian and in C order, as uint8.

    A tensor that is already both is only viewed. Otherwise a row block is converted on its own (a copy the
    size of the piece), and any other piece comes from one converted copy of the whole tensor, made for its
    first piece and dropped after its last: never one full copy per piece."""
    little = leaf.dtype.newbyteorder("<") if leaf.dtype.byteorder == ">" else leaf.dtype
    if leaf.flags.c_contiguous and little == leaf.dtype:
        return leaf.reshape(-1).view(np.uint8)[piece.start:piece.start + piece.nbytes]
    if piece.global_offset is not None:  # rows [r0, r0 + rows) of dimension 0
        first_row = piece.global_offset[0]
        block = np.ascontiguousarray(leaf[first_row:first_row + piece.shape[0]], dtype=little)
        return block.reshape(-1).view(np.uint8)
    whole = job.host_copies.get(piece.tensor)
    if whole is None:
        whole = np.ascontiguousarray(leaf, dtype=little).reshape(-1).view(np.uint8)
        job.host_copies[piece.tensor] = whole
    if piece.start + piece.nbytes >= whole.size:  # the tensor's last piece: the copy is not needed again
        del job.host_copies[piece.tensor]
    return whole[piece.start:piece.start + piece.nbytes]


# ---- the staging pool -----------------------------------------------------------------------------------


class _StagingPool:
    """At most `limit` buffers of `size` bytes, allocated on first use and reused (pinned on a GPU copier)."""

    def __init__(self, copier: _native.Copier, size: int, limit: int):
        self.copier, self.size, self.limit = copier, size, max(2, limit)
        self._free: list[Any] = []
        self._count = 0
        self._cond = threading.Condition()

    def acquire(self, on_wait: Any = None) -> Any:
        """A free buffer; blocks while all `limit` are in use (calling on_wait() first)."""
        with self._cond:
            if not self._free and self._count >= self.limit and on_wait is not None:
                on_wait()
            while not self._free and self._count >= self.limit:
                self._cond.wait()
            if self._free:
                return self._free.pop()
            self._count += 1
        try:
            return self.copier.alloc(self.size)
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def release(self, buffer: Any) -> None:
        with self._cond:
            self._free.append(buffer)
            self._cond.notify()

    @property
    def allocated_bytes(self) -> int:
        return self._count * self.size

    def clear(self) -> None:
        with self._cond:
            self._count -= len(self._free)
            self._free.clear()


# ---- the background writer ---------------------------------------------------------------------------------


@dataclasses.dataclass
class _Job:
    step: int
    specs: list[TensorSpec]
    pieces: list[Piece]
    values: list[tuple[tuple[str, ...], Any]]
    kind: str
    training_state: Any
    failed: bool = False
    # Set when the snapshot is done, or when it waits for a buffer: until then the writer stays idle, so on
    # a small machine it doesn't compete with the copy that save() is blocked on.
    may_write: threading.Event = dataclasses.field(default_factory=threading.Event)
    pending: storage.PendingStep | None = None
    writer: checkpoint.CheckpointWriter | None = None
    # CRC32C of every piece as it was staged; the writer checks its own against it, so on success these
    # are also the CRCs in the shard, and the manifest lists them.
    snapshot_crcs: dict[str, int] = dataclasses.field(default_factory=dict)
    # Little-endian C-contiguous copies of host tensors that are neither, made once per tensor for pieces that
    # are not row blocks, and dropped after the tensor's last piece.
    host_copies: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)


class _Engine:
    """The worker thread and its queue; kept apart from the coordinator so that an atexit finalizer can
    finish pending saves without holding the coordinator alive."""

    def __init__(self, coordinator: CheckpointCoordinator):
        self.store = coordinator._storage
        self.retention = (coordinator.max_to_keep, coordinator.keep_every_n_steps)
        self.signing_key = coordinator._signing_key
        self.trusted_keys = coordinator._trusted_keys
        self.queue: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.error: BaseException | None = None
        self.steps: set[int] = set()  # submitted or committed here (failed saves are taken out again)
        self._outstanding = 0
        self._idle = threading.Condition()
        self.pool: _StagingPool | None = None
        self.thread = threading.Thread(target=self._run, name="sneppx-checkpoint-writer", daemon=True)
        self.thread.start()

    def submit(self, *item: Any) -> None:
        with self._idle:
            self._outstanding += 1
        self.queue.put(item)

    def wait(self) -> None:
        with self._idle:
            while self._outstanding:
                self._idle.wait()

    def shutdown(self) -> None:
        if self.thread.is_alive():
            self.queue.put(("stop",))
            self.thread.join()

    def take_error(self) -> BaseException | None:
        with self._idle:
            error, self.error = self.error, None
        return error

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item[0] == "stop":
                return
            try:
                self._handle(item)
            except BaseException as e:  # noqa: BLE001 - kept and raised by the next call; the thread goes on
                job = item[1]
                job.failed = True
                self._abort(job)
                with self._idle:
                    if self.error is None:
                        self.error = e
                    self.steps.discard(job.step)
                log.warning("checkpoint of step %d failed: %s", job.step, e)
            finally:
                if item[0] == "data":
                    assert self.pool is not None
                    self.pool.release(item[2])
                with self._idle:
                    self._outstanding -= 1
                    self._idle.notify_all()

    def _handle(self, item: tuple[Any, ...]) -> None:
        kind, job = item[0], item[1]
        if job.failed and kind != "abort":
            return
        if kind == "begin":
            job.pending = self.store.begin(job.step)
            job.writer = checkpoint.CheckpointWriter(
                os.path.join(job.pending.local_dir, SHARD_FILE.format(0)),
                metadata={"sneppx.step": str(job.step), "sneppx.shard": "0"})
            job.writer.open()
        elif kind == "data":
            job.may_write.wait()
            if not job.failed:
                self._write_buffer(job, item[2], item[3])
        elif kind == "end":
            self._commit(job)
        elif kind == "abort":
            self._abort(job)

    def _write_buffer(self, job: _Job, buffer: Any, pieces: list[Piece]) -> None:
        assert job.writer is not None and self.pool is not None
        view = self.pool.copier.view(buffer, self.pool.size)
        for piece in pieces:
            spec = job.specs[piece.tensor]
            dtype = format.numpy_dtype(spec.dtype)
            count = piece.nbytes // spec.itemsize
            array = np.frombuffer(view, dtype=dtype, count=count, offset=piece.offset).reshape(piece.shape)
            extra = {}
            if piece.global_offset is not None:
                extra = {"global_shape": spec.shape, "global_offset": piece.global_offset}
            entry = job.writer.write(piece.entry, array, **extra)
            expected = job.snapshot_crcs[piece.entry]
            if entry.crc32c != expected:
                raise errors.ChecksumMismatchError(
                    f"step {job.step}: tensor piece {piece.entry!r} changed in staging memory between snapshot "
                    f"and write (snapshot {expected:#010x}, written {entry.crc32c:#010x})")
        del view

    def _commit(self, job: _Job) -> None:
        assert job.writer is not None and job.pending is not None
        job.writer.commit()
        job.writer = None
        shard = SHARD_FILE.format(0)
        # Shard digests cost a read-back of every shard; only a signature needs them (it vouches for the
        # shards through them), so unsigned steps are saved without (and without a "files" object).
        files = None
        if self.signing_key is not None:
            files = {shard: self._file_record(job, shard)}
        if job.step in self.store.committed_steps():
            self._set_aside_if_invalid(job.step)
        manifest = encode_manifest(build_manifest(job.step, job.specs, job.pieces, job.snapshot_crcs, job.values,
                                                  job.kind, job.training_state, [shard], files))
        signature = None
        if self.signing_key is not None:  # written before the commit point, by finalize()
            signature = signing.manifest_signature(manifest, self.signing_key)
        self.store.finalize(job.pending, manifest, signature)
        job.pending = None
        max_to_keep, keep_every = self.retention
        for step in steps_to_delete(self.store.committed_steps(), new_step=job.step, max_to_keep=max_to_keep,
                                    keep_every_n_steps=keep_every):
            self.store.delete(step)
            log.info("retention: deleted checkpoint step %d", step)

    @staticmethod
    def _file_record(job: _Job, name: str) -> dict[str, Any]:
        """Size and digest of a finished shard, for a signed manifest.

        Why a read-back rather than hashing during the write: the digest is BLAKE3 of the whole file, and the
        header at its start is written last, while the `blake3` package can only hash from the start. The
        cost is one read of the shard (from the disk: the writer bypasses the page cache) and the hash, on
        this background thread with the writer's hashing threads (signing.write_threads()), never in save()."""
        assert job.pending is not None
        path = os.path.join(job.pending.local_dir, name)
        return {"size": os.path.getsize(path),
                "digest": signing.readback_digest(path, threads=signing.write_threads())}

    def _set_aside_if_invalid(self, step: int) -> None:
        """A committed step being saved again (after a rollback past it): an invalid copy is moved aside so
        the new one can commit; a valid one stays and finalize() refuses to overwrite it."""
        try:
            with self.store.open_step(step) as local:
                problems = check_step(local, step, self.trusted_keys)[1]
        except errors.CheckpointNotFoundError:
            return
        if problems:
            aside = self.store.quarantine(step)
            log.warning("step %d was committed but invalid (%s); moved to %s", step, problems[0], aside)

    def _abort(self, job: _Job) -> None:
        if job.writer is not None:
            writer, job.writer = job.writer, None
            writer.abort()
        if job.pending is not None:
            pending, job.pending = job.pending, None
            self.store.abort(pending)


# ---- the public API -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint that validated: its step, where it is, and the training state saved with it."""

    step: int
    location: str
    training_state: Any
    manifest: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class SkippedCheckpoint:
    """A committed step that failed validation, and why (reported by latest() and restore())."""

    step: int
    problems: tuple[str, ...]


class CheckpointCoordinator:
    """Saves checkpoints every N steps in the background and finds the newest valid one after a crash.

    checkpoint_root: a local directory (disk, PVC, NFS) or `s3://bucket/prefix` (boto3; endpoint and
        credentials from the AWS environment variables, or pass `s3_client`).
    save_every_n_steps: what should_save() answers (None: never).
    max_to_keep: newest committed steps to keep (None: all); keep_every_n_steps: also keep multiples of it.
    async_save: False makes save() return only once the step is committed.
    staging_bytes: host memory for the snapshot (default 1 GiB). States up to this size make save() cost one
        copy; larger states stream through it, so save() returns when the rest is written.
    device: "auto" (pinned staging and GPU copies when a CUDA device is usable), "cpu", or a CUDA device index.
    cleanup_on_start: remove what a crash left (temp directories, incomplete S3 uploads); leave it on in one
        process per root only.
    signing_key: an Ed25519 private key (or an unencrypted PEM path): every step is signed, a detached `manifest.sig`
        over manifest.json (which lists each shard's size and BLAKE3 digest) written before the commit point.
        Without it, steps are saved without shard digests (they cost a read-back of every shard) and can't be
        signed later.
    trusted_keys: public keys (objects, PEM paths or bytes; see signing.trusted_key_set): latest(), restore()
        and validate() then also require a signature by one of them and every shard to match its digest, and
        treat a step that fails like any invalid step (skipped, reported in `skipped`, rolled back past).
        None (the default): signatures are not checked.
    """

    def __init__(self, checkpoint_root: str | os.PathLike[str], save_every_n_steps: int | None = None,
                 max_to_keep: int | None = 5, async_save: bool = True, *, keep_every_n_steps: int | None = None,
                 staging_bytes: int = DEFAULT_STAGING_BYTES, device: str | int = "auto", copy_threads: int = 0,
                 s3_client: Any = None, staging_dir: str | None = None, cleanup_on_start: bool = True,
                 signing_key: Any = None, trusted_keys: Any = None):
        for name, value in (("save_every_n_steps", save_every_n_steps), ("max_to_keep", max_to_keep),
                            ("keep_every_n_steps", keep_every_n_steps)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative int or None, not {value!r}")
        if staging_bytes < 2 * 4096:
            raise ValueError(f"staging_bytes must be at least 8 KiB, not {staging_bytes}")
        self.checkpoint_root = os.fspath(checkpoint_root)
        self.save_every_n_steps = save_every_n_steps
        self.max_to_keep = max_to_keep
        self.keep_every_n_steps = keep_every_n_steps
        self.async_save = async_save
        self.staging_bytes = staging_bytes
        self.skipped: list[SkippedCheckpoint] = []
        self.last_saved_step: int | None = None
        self._signing_key = _private_key(signing_key)
        self._trusted_keys = None if trusted_keys is None else signing.trusted_key_set(trusted_keys)
        if self._trusted_keys is not None and not self._trusted_keys:
            raise errors.KeyFormatError("trusted_keys is empty: no step could ever verify (pass None to not "
                                        "check signatures)")
        self._storage = storage.open_storage(self.checkpoint_root, s3_client=s3_client, staging_dir=staging_dir)
        if cleanup_on_start:
            for leftover in self._storage.cleanup():
                log.info("removed leftover of an interrupted save: %s", leftover)
        self._copier = self._make_copier(device, copy_threads)
        self._lock = threading.Lock()
        self._closed = False
        self._engine = _Engine(self)
        self._finalizer = weakref.finalize(self, self._engine.shutdown)

    @staticmethod
    def _make_copier(device: str | int, threads: int) -> _native.Copier:
        if device == "cpu":
            return _native.Copier(-1, threads=threads)
        if device == "auto":
            return _native.Copier(0, threads=threads) if _native.cuda_available() else _native.Copier(-1,
                                                                                                     threads=threads)
        if isinstance(device, int) and device >= 0:
            return _native.Copier(device, threads=threads)  # AcceleratorUnavailableError without one
        raise ValueError(f"device must be 'auto', 'cpu' or a CUDA device index, not {device!r}")

    @property
    def uses_gpu(self) -> bool:
        return self._copier.device >= 0

    @property
    def storage(self) -> storage.Storage:
        return self._storage

    @property
    def staging_allocated_bytes(self) -> int:
        """Host memory held for staging right now (bounded by staging_bytes)."""
        pool = self._engine.pool
        return pool.allocated_bytes if pool else 0

    # -- context manager --

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is already on its way: finish what can be finished, don't mask it
            self.close()
        except errors.SneppXError as background:
            log.error("checkpoint error while closing after %s: %s", exc_type.__name__, background)

    # -- the calls --

    def should_save(self, step: int) -> bool:
        """True when `step` is a multiple of save_every_n_steps that was not saved already."""
        return is_save_step(step, self.save_every_n_steps, self.last_saved_step)

    def save(self, obj: Any, step: int, *, training_state: Any = None) -> None:
        """Snapshots `obj` (a model with state_dict(), or a dict of arrays) as checkpoint `step` and returns;
        the write, commit and retention go on in the background (with async_save=False, save() waits).

        training_state: JSON-safe data resumed with the weights (data position, RNG state, ...)."""
        with self._lock:
            self._check_open()
            self._raise_background_error()
            if not isinstance(step, (int, np.integer)) or step < 0:
                raise ValueError(f"step must be a non-negative int, not {step!r}")
            step = int(step)
            with self._engine._idle:
                if step in self._engine.steps:
                    raise errors.CheckpointExistsError(f"step {step} was already saved by this coordinator",
                                                       path=self.checkpoint_root)
            _check_json_safe(training_state, "training_state")
            kind, leaves, values = flatten_state(obj)
            _check_json_safe([v for _, v in values], "the state's plain (non-array) values")
            specs = [_spec(path, leaf) for path, leaf in leaves]
            state_bytes = sum(s.nbytes for s in specs)
            engine = self._engine
            if engine.pool is None:
                size = choose_buffer_bytes(state_bytes, self.staging_bytes)
                engine.pool = _StagingPool(self._copier, size, self.staging_bytes // size)
            plan = plan_pieces(specs, engine.pool.size)
            job = _Job(step, specs, [p for b in plan for p in b], values, kind, training_state)
            with engine._idle:
                engine.steps.add(step)
            engine.submit("begin", job)
            try:
                for pieces in plan:
                    buffer = engine.pool.acquire(on_wait=job.may_write.set)
                    try:
                        self._snapshot(job, leaves, buffer, pieces)
                    except BaseException:
                        engine.pool.release(buffer)
                        raise
                    engine.submit("data", job, buffer, pieces)
            except BaseException:
                job.failed = True
                job.host_copies.clear()
                job.may_write.set()
                engine.submit("abort", job)
                with engine._idle:
                    engine.steps.discard(step)
                raise
            job.may_write.set()
            engine.submit("end", job)
            self.last_saved_step = step
        if not self.async_save:
            self.wait()

    def _snapshot(self, job: _Job, leaves: list[tuple[tuple[str, ...], Any]], buffer: Any,
                  pieces: list[Piece]) -> None:
        pool = self._engine.pool
        assert pool is not None
        view = self._copier.view(buffer, pool.size)
        for piece in pieces:
            leaf = leaves[piece.tensor][1]
            dst = view[piece.offset:piece.offset + piece.nbytes]
            if isinstance(leaf, _DeviceArray):
                if not self.uses_gpu:
                    raise errors.AcceleratorUnavailableError(
                        "the state holds CUDA tensors but this coordinator has no CUDA device (device='cpu' "
                        "or none found)")
                crc = self._copier.copy(dst, leaf.pointer + piece.start, piece.nbytes, kind=_native.COPY_D2H)
            else:
                crc = self._copier.copy(dst, _host_piece(job, leaf, piece))
            job.snapshot_crcs[piece.entry] = int(crc or 0)
        del view

    def wait(self) -> None:
        """Blocks until every save so far is committed (or failed); raises a background error."""
        self._engine.wait()
        self._raise_background_error()

    def close(self) -> None:
        """Waits for pending saves, stops the writer and frees staging memory; raises a background error."""
        # Under the lock: a save() running on another thread finishes submitting first (the writer never
        # takes this lock, so waiting for it here can't deadlock), and none starts on a stopped writer.
        with self._lock:
            if self._closed:
                return
            try:
                self._engine.wait()
            finally:
                self._closed = True
                self._finalizer()
                if self._engine.pool is not None:
                    self._engine.pool.clear()
        self._raise_background_error()

    def _check_open(self) -> None:
        if self._closed:
            raise errors.CoordinatorClosedError("this CheckpointCoordinator is closed")

    def _raise_background_error(self) -> None:
        error = self._engine.take_error()
        if error is not None:
            raise error

    # -- finding and loading --

    def committed_steps(self) -> list[int]:
        """Every step with a commit point, oldest first (not validated)."""
        return self._storage.committed_steps()

    def validate(self, step: int) -> list[str]:
        """Problems with committed step `step` ([] when it is whole and every byte checks)."""
        with self._storage.open_step(step) as local:
            return check_step(local, step, self._trusted_keys)[1]

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint that validates, or None. Committed steps that fail validation
        are skipped, logged, and listed in `self.skipped`."""
        for step in reversed(self._storage.committed_steps()):
            try:
                with self._storage.open_step(step) as local:
                    manifest, problems = check_step(local, step, self._trusted_keys)
            except errors.CheckpointNotFoundError:
                continue  # deleted by retention between listing and opening
            if not problems:
                assert manifest is not None
                return self._info(step, manifest)
            self._report(step, problems)
        return None

    def restore(self, obj: Any, step: int | None = None) -> CheckpointInfo | None:
        """Loads checkpoint `step` (default: the newest valid one) into `obj` (load_state_dict() or a dict,
        updated in place). Returns its info, or None when there is no checkpoint at all."""
        steps = [step] if step is not None else list(reversed(self._storage.committed_steps()))
        for candidate in steps:
            try:
                with self._storage.open_step(candidate) as local:
                    manifest, problems = check_step(local, candidate, self._trusted_keys)
                    if problems:
                        self._report(candidate, problems)
                        if step is not None:
                            raise errors.ManifestError(f"step {step} is not valid: {'; '.join(problems[:3])}",
                                                       path=self.checkpoint_root)
                        continue
                    assert manifest is not None
                    state = _read_state(local, manifest)
            except errors.CheckpointNotFoundError:
                if step is not None:
                    raise
                continue
            if manifest["kind"] == "state_dict" and hasattr(obj, "load_state_dict"):
                obj.load_state_dict(state)
            elif isinstance(obj, MutableMapping):
                _load_into_mapping(obj, state)
            elif hasattr(obj, "load_state_dict"):
                obj.load_state_dict(state)
            else:
                raise errors.UnsupportedTensorError(f"can't restore into a {type(obj).__name__}")
            return self._info(candidate, manifest)
        return None

    def _info(self, step: int, manifest: dict[str, Any]) -> CheckpointInfo:
        location = (f"{self._storage.uri}/{storage.step_name(step)}")
        return CheckpointInfo(step, location, manifest.get("training_state"), manifest)

    def _report(self, step: int, problems: list[str]) -> None:
        self.skipped.append(SkippedCheckpoint(step, tuple(problems)))
        log.warning("skipping checkpoint step %d: %s", step, "; ".join(problems[:5]))


def _private_key(key: Any) -> Any:
    """The signing key as an Ed25519 private key (an unencrypted PEM path is loaded once, here)."""
    if key is None or isinstance(key, ed25519.Ed25519PrivateKey):
        return key
    if isinstance(key, (str, os.PathLike)):
        return signing.load_private_key(key)
    raise errors.KeyFormatError(f"signing_key must be an Ed25519 private key or a PEM path, not a "
                                f"{type(key).__name__}")


def _signature_problem(local: str, raw: bytes, trusted_keys: dict[bytes, Any]) -> str | None:
    """Why a step's signature or digests don't verify (named by the failed check's error class), or None.

    Checks the exact manifest bytes the caller goes on to use: manifest.sig over them, then each listed
    file's size and BLAKE3 digest."""
    try:
        with open(os.path.join(local, storage.SIGNATURE), "rb") as f:
            signature = f.read(format.MAX_SIGNATURE_BYTES + 1)
    except FileNotFoundError:
        signature = b""
    try:
        signing.check_manifest_signature(raw, signature, trusted_keys, path=local)
        signing.check_manifest_files(local, raw)
    except errors.SneppXError as e:
        return f"{type(e).__name__}: {e}"
    except OSError as e:
        return f"StorageError: {local}: can't read: {e.strerror or e}"
    return None


def check_step(local: str, step: int, trusted_keys: dict[bytes, Any] | None = None,
                ) -> tuple[dict[str, Any] | None, list[str]]:
    """(manifest, problems) for a step directory: manifest, every shard's bytes, and that the manifest's
    pieces are exactly the shard entries with the same CRCs. With trusted_keys, first the signature and
    the digest of every file the manifest lists, and that every shard is among them."""
    path = os.path.join(local, storage.MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read(storage.MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        return None, [f"{path}: manifest.json is missing"]
    if trusted_keys is not None:  # before parsing: a forged manifest costs nothing more than this
        problem = _signature_problem(local, raw, trusted_keys)
        if problem is not None:
            return None, [problem]
    try:
        manifest = decode_manifest(raw, step=step, where=path)
    except errors.ManifestError as e:
        return None, [str(e)]
    if trusted_keys is not None:
        unsigned = [s for s in manifest["shards"] if s not in manifest.get("files", {})]
        if unsigned:
            why = (f"DigestMismatchError: {local}: shard(s) {', '.join(unsigned)} have no digest in the signed "
                   "manifest, so the signature does not cover them")
            return manifest, [why]
    problems: list[str] = []
    entries: dict[tuple[int, str], format.TensorEntry] = {}
    for index, shard in enumerate(manifest["shards"]):
        shard_path = os.path.join(local, shard)
        ok, errs = checkpoint.validate_checkpoint(shard_path)
        if not ok:
            problems += errs
            continue
        with checkpoint.CheckpointReader(shard_path, verify=False) as reader:
            for name in reader.names():
                entries[(index, name)] = reader.entry(name)
    if problems:
        return manifest, problems
    for tensor in manifest["tensors"]:
        for piece in tensor["pieces"]:
            entry = entries.get((piece["shard"], piece["entry"]))
            if entry is None:
                problems.append(f"{'/'.join(tensor['path'])}: shard {piece['shard']} has no entry {piece['entry']!r}")
            elif entry.length != piece["nbytes"] or entry.crc32c != piece["crc32c"] or entry.dtype != tensor["dtype"]:
                problems.append(f"{'/'.join(tensor['path'])}: entry {piece['entry']!r} does not match the manifest")
    return manifest, problems


def _read_state(local: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """The saved tree, with arrays assembled from their pieces (owned, writable copies)."""
    with contextlib.ExitStack() as stack:  # a reader that fails to open closes those opened before it
        readers = [stack.enter_context(checkpoint.CheckpointReader(os.path.join(local, shard)))
                   for shard in manifest["shards"]]
        tree: dict[str, Any] = {}
        for tensor in manifest["tensors"]:
            dtype = format.numpy_dtype(tensor["dtype"])
            shape = tuple(tensor["shape"])
            pieces = tensor["pieces"]
            if len(pieces) == 1:
                array = np.array(readers[pieces[0]["shard"]].read(pieces[0]["entry"]), copy=True).reshape(shape)
            else:
                array = np.empty(shape, dtype=dtype)
                flat = array.reshape(-1).view(np.uint8)
                for piece in pieces:
                    data = readers[piece["shard"]].read(piece["entry"])
                    flat[piece["start"]:piece["start"] + piece["nbytes"]] = data.reshape(-1).view(np.uint8)
            _set_path(tree, tensor["path"], array)
        for value in manifest["values"]:
            _set_path(tree, value["path"], value["value"])
        return tree
