"""Named tensors from any checkpoint a user points a tool at, through one small interface.

Why: `sneppx diff`, `sneppx convert` and `sneppx inspect` take an SNPX file, a coordinator step directory
(`<root>/step-000001000`: shards joined by their manifest), or a safetensors checkpoint (one file, or shards
with their `*.safetensors.index.json`). Each tool only needs "which tensors, what dtype and shape, and their
values", so `open_tensors` answers that for all of them, one tensor at a time (memory bounded by the largest
tensor, not the checkpoint). Every SNPX byte read is CRC-checked; safetensors files are read by the
`safetensors` package, never by a parser of our own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Self

import numpy as np

from SneppX_ALG import _fs, errors, storage
from SneppX_ALG.checkpoint import chunks, file, format
from SneppX_ALG.checkpoint import manifest as manifest_codec

INDEX_SUFFIX = ".safetensors.index.json"
_MAX_INDEX_BYTES = 64 << 20
# safetensors dtype codes (the header's names) -> SNPX's; the rest (float8, float4, ...) SNPX can't store
SAFETENSORS_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
                      "F16": "float16", "BF16": "bfloat16", "U32": "uint32", "I32": "int32", "F32": "float32",
                      "U64": "uint64", "I64": "int64", "F64": "float64", "C64": "complex64"}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What a checkpoint says about one tensor, before any of its bytes are read. `dtype` is SNPX's name, or
    the foreign one (e.g. safetensors' "F8_E4M3") for a dtype SNPX can't store."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None


class TensorSet:
    """The tensors of one checkpoint: `info` (name -> TensorInfo, in stored order), `read(name)`, `metadata`
    and `config`; `kind` is "snpx", "step" or "safetensors". Use as a context manager."""

    kind = ""

    def __init__(self, path: str):
        self.path = path
        self.info: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        self.config: Any = None

    def read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.info.values())

    def close(self) -> None:
        """Releases files; arrays already read stay valid."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _info_of(self, name: str) -> TensorInfo:
        try:
            return self.info[name]
        except KeyError:
            raise errors.TensorNotFoundError(f"{self.path}: no tensor named {name!r}") from None


def open_tensors(path: str | os.PathLike[str]) -> TensorSet:
    """The tensors at `path`: an SNPX file, a step directory, a safetensors file, a `*.safetensors.index.json`,
    or a directory holding one index (or one .safetensors file). Typed errors name what `path` is instead."""
    path = os.fspath(path)
    if os.path.isdir(path):
        step = storage.parse_step_name(os.path.basename(os.path.normpath(path)))
        if step is not None:
            return StepTensors(path, step)
        found = sorted(n for n in os.listdir(path) if n.endswith(INDEX_SUFFIX))
        found = found or sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if len(found) != 1:
            raise errors.CheckpointFormatError(
                "is a directory, but neither a step directory (step-NNNNNNNNN) nor one holding a single "
                f"*{INDEX_SUFFIX} or *.safetensors file (found {len(found)})", path=path)
        return SafetensorsTensors(os.path.join(path, found[0]))
    if path.endswith(INDEX_SUFFIX):
        return SafetensorsTensors(path)
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        head = b""  # CheckpointReader says what is wrong with it
    if not head.startswith(format.MAGIC) and format.sniff_foreign(head) == "safetensors":
        return SafetensorsTensors(path)
    return SnpxTensors(path)


class SnpxTensors(TensorSet):
    kind = "snpx"

    def __init__(self, path: str):
        super().__init__(path)
        self.reader = file.CheckpointReader(path)
        self.metadata, self.config = dict(self.reader.metadata), self.reader.config
        self.info = {t.name: TensorInfo(t.dtype, t.shape, t.length, t.global_shape, t.global_offset)
                     for t in self.reader.table.tensors}

    def read(self, name: str) -> np.ndarray:
        self._info_of(name)
        return np.asarray(self.reader.read(name))

    def close(self) -> None:
        self.reader.close()


class StepTensors(TensorSet):
    """A coordinator step directory: each tensor joined from its pieces (version 3: chunks, boxes of the tensor
    that any rank saved) in the shards, as the manifest says.
    The manifest and its checksum are checked at open, and that every piece is an entry of its shard with the
    manifest's size, CRC32C and dtype; each piece's bytes are CRC-checked as they are read."""

    kind = "step"

    def __init__(self, path: str, step: int):
        super().__init__(path)
        self.step = step
        where = os.path.join(path, storage.MANIFEST)
        raw = _fs.read_small(where, storage.MAX_MANIFEST_BYTES)
        if raw is None:
            raise errors.ManifestError("manifest.json is missing: not a committed step", path=path)
        self.manifest = manifest_codec.decode_manifest(raw, step=step, where=where)
        self.readers: list[file.CheckpointReader] = []
        self._referenced: dict[tuple[int, str], file.CheckpointReader] = {}  # earlier steps' files (incremental)
        try:
            for shard in self.manifest["shards"]:
                self.readers.append(file.CheckpointReader(os.path.join(path, shard)))
            root = os.path.dirname(os.path.normpath(path))
            for ref in sorted(manifest_codec.references(self.manifest["tensors"])):
                self._referenced[ref] = file.CheckpointReader(os.path.join(root, storage.step_name(ref[0]), ref[1]))
            self._tensors = {"/".join(t["path"]): t for t in self.manifest["tensors"]}
            for name, tensor in self._tensors.items():
                for piece in manifest_codec.parts_of(tensor):
                    reader = self._reader(piece)
                    entry = reader.entry(piece["entry"]) if piece["entry"] in reader else None
                    if entry is None or not (manifest_codec.entry_matches(entry, piece, tensor) if "offset" in piece
                                             else (entry.length, entry.crc32c, entry.dtype) == (
                                                 piece["nbytes"], piece["crc32c"], tensor["dtype"])):
                        raise errors.ManifestError(f"tensor {name}: piece {piece['entry']!r} is not in shard "
                                                   f"{piece['shard']} as the manifest says", path=path)
                self.info[name] = TensorInfo(tensor["dtype"], tuple(tensor["shape"]), tensor["nbytes"])
        except BaseException:
            self.close()
            raise

    def _reader(self, piece: dict[str, Any]) -> file.CheckpointReader:
        """The file that holds a piece: its shard, or the earlier step's file an incremental step references."""
        ref = manifest_codec.reference(piece)
        return self.readers[piece["shard"]] if ref is None else self._referenced[ref]

    @property
    def training_state(self) -> Any:
        return self.manifest.get("training_state")

    @property
    def values(self) -> dict[str, Any]:
        """The plain (non-array) values saved with the state, by path."""
        return {"/".join(v["path"]): v["value"] for v in self.manifest["values"]}

    def read(self, name: str) -> np.ndarray:
        info = self._info_of(name)
        pieces = manifest_codec.parts_of(self._tensors[name])
        dtype = format.numpy_dtype(info.dtype)
        if len(pieces) == 1:  # the whole tensor is one entry: a view of the shard's mapping
            return np.asarray(self._reader(pieces[0]).read(pieces[0]["entry"])).reshape(info.shape)
        array = np.empty(info.shape, dtype=dtype)
        flat = array.reshape(-1).view(np.uint8)
        for piece in pieces:
            data = np.asarray(self._reader(piece).read(piece["entry"]))
            if "offset" in piece:  # version 3: a box of the tensor, saved by any rank
                box = chunks.Box(tuple(piece["offset"]), tuple(piece["shape"]))
                array[box.slices()] = data.reshape(box.shape)
            else:
                flat[piece["start"]:piece["start"] + piece["nbytes"]] = data.reshape(-1).view(np.uint8)
        return array

    def close(self) -> None:
        for reader in [*self.readers, *self._referenced.values()]:
            reader.close()


class SafetensorsTensors(TensorSet):
    """A safetensors file, or shards listed by an index (`{"metadata": ..., "weight_map": {tensor: file}}`),
    read with the `safetensors` package. `index` holds the index (None for a single file) and
    `shard_metadata` each file's own metadata; `metadata` is the first file's."""

    kind = "safetensors"

    def __init__(self, path: str):
        super().__init__(path)
        import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 with numpy: safetensors' reader needs them)
        import safetensors

        self._error = safetensors.SafetensorError
        self.index: dict[str, Any] | None = None
        self.weight_map: dict[str, str] = {}
        self.shard_metadata: dict[str, dict[str, str]] = {}
        self._files: dict[str, Any] = {}
        try:
            if path.endswith(INDEX_SUFFIX):
                self.index = _read_index(path)
                self.weight_map = self.index["weight_map"]
                shards = list(dict.fromkeys(self.weight_map.values()))
            else:
                shards = [os.path.basename(path)]
            directory = os.path.dirname(path)
            for shard in shards:
                handle = self._open(os.path.join(directory, shard))
                self._files[shard] = handle
                self.shard_metadata[shard] = dict(handle.metadata() or {})
                for name in handle.offset_keys():
                    if self.index is not None and self.weight_map.get(name) != shard:
                        raise errors.ForeignCheckpointError(
                            f"shard {shard} holds tensor {name!r}, which the index places in "
                            f"{self.weight_map.get(name)!r}", path=path)
                    self.weight_map[name] = shard
                    view = handle.get_slice(name)
                    dtype, shape = view.get_dtype(), tuple(int(d) for d in view.get_shape())
                    itemsize = format.DTYPES.get(SAFETENSORS_DTYPES.get(dtype, ""), 0)
                    self.info[name] = TensorInfo(SAFETENSORS_DTYPES.get(dtype, dtype), shape,
                                                 itemsize * math.prod(shape) if itemsize else -1)
            missing = [n for n in self.weight_map if n not in self.info]
            if missing:
                raise errors.ForeignCheckpointError(
                    f"the index lists {len(missing)} tensor(s) no shard holds, e.g. {missing[0]!r}", path=path)
            self.metadata = self.shard_metadata[shards[0]] if shards else {}
        except BaseException:
            self.close()
            raise

    def _open(self, path: str) -> Any:
        import safetensors

        if not os.path.isfile(path):
            raise errors.CheckpointNotFoundError(f"safetensors file {path} is missing", path=path)
        try:
            return safetensors.safe_open(path, framework="numpy").__enter__()
        except (self._error, OSError, ValueError) as e:
            raise errors.ForeignCheckpointError(f"not a readable safetensors file: {e}", path=path) from None

    def read(self, name: str) -> np.ndarray:
        self._info_of(name)
        try:
            return np.asarray(self._files[self.weight_map[name]].get_tensor(name))
        except (self._error, TypeError, ValueError, KeyError) as e:
            raise errors.UnsupportedTensorError(f"{self.path}: can't read tensor {name!r} as a numpy array "
                                                f"({e})") from None

    def close(self) -> None:
        for handle in self._files.values():
            handle.__exit__(None, None, None)
        self._files.clear()


def _read_index(path: str) -> dict[str, Any]:
    """A sharded safetensors index, checked: a weight_map of tensor -> plain file name next to the index."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_INDEX_BYTES + 1)
    except FileNotFoundError:
        raise errors.CheckpointNotFoundError(f"no safetensors index at {path}", path=path) from None
    if len(raw) > _MAX_INDEX_BYTES:
        raise errors.ForeignCheckpointError(f"index is larger than {_MAX_INDEX_BYTES} bytes", path=path)
    try:
        index = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise errors.ForeignCheckpointError(f"index is not JSON: {e}", path=path) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and storage.is_plain_name(v) for k, v in weight_map.items()):
        raise errors.ForeignCheckpointError("index has no weight_map of tensor names to file names in its "
                                            "directory", path=path)
    if not isinstance(index.get("metadata", {}), dict):
        raise errors.ForeignCheckpointError("index 'metadata' is not an object", path=path)
    return index

