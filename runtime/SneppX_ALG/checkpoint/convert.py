"""SNPX <-> safetensors, both ways, with the `safetensors` package doing the safetensors side.

Why: people arrive with safetensors files (often sharded, with a `*.safetensors.index.json`) and leave with
them for serving. A conversion keeps every tensor's bytes as they are (bfloat16 included, through
`ml_dtypes`), and what only one format can say travels in the other's metadata under reserved keys:

    safetensors -> SNPX   the file's `__metadata__` becomes the SNPX metadata; a sharded checkpoint's index
                          (its metadata and weight_map, and any shard whose own metadata differs) is kept in
                          `safetensors.index`, so converting back writes the same shards and index
    SNPX -> safetensors   the SNPX metadata becomes `__metadata__`; the JSON config goes into `sneppx.config`
                          and shard placements (global shape and offset) into `sneppx.placement`, which the
                          way back turns into config and placements again

So SNPX -> safetensors -> SNPX and safetensors -> SNPX -> safetensors give the same tensors, bit for bit, and
the same metadata. (The safetensors package orders `__metadata__` keys as it likes, so two files it wrote with
the same content may still differ in header bytes.) A tensor SNPX can't hold (float8, float4) or safetensors
can't (complex128) is an `UnsupportedTensorError` naming it and what to do.

Memory: to SNPX, one tensor at a time. To safetensors, the package writes a file from memory pointers: SNPX
tensors are handed over as views of the file's mapping (no copy); tensors a step stores in several pieces
are joined in memory first, one output shard at a time.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from typing import Any

import numpy as np

from SneppX_ALG import _fs, _native, errors, storage
from SneppX_ALG.checkpoint import file, format, tensors

INDEX_KEY = "safetensors.index"
CONFIG_KEY = "sneppx.config"
PLACEMENT_KEY = "sneppx.placement"
DEFAULT_SHARD_BYTES = 5 * 10**9  # what transformers' save_pretrained splits at by default
SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
INDEX_NAME = "model" + tensors.INDEX_SUFFIX

Progress = Callable[[int, int], None]


def to_snpx(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, progress: Progress | None = None,
            signing_key: Any = None) -> str:
    """Writes the checkpoint at `src` (safetensors file, index or directory; or anything tensors.open_tensors
    reads) as one SNPX file at `dst`, committed atomically. Returns `dst`."""
    dst = os.fspath(dst)
    with tensors.open_tensors(src) as source:
        metadata, config, placement = _snpx_metadata(source)
        total, done = source.total_bytes(), 0
        with file.CheckpointWriter(dst, metadata=metadata, config=config, signing_key=signing_key) as writer:
            for name, info in source.info.items():
                if info.dtype not in format.DTYPES:
                    raise errors.UnsupportedTensorError(
                        f"tensor {name!r} is {info.dtype}, which SNPX does not store "
                        f"({', '.join(format.DTYPES)}): cast it (e.g. to bfloat16) before converting")
                writer.write(name, source.read(name), **placement.get(name, {}))
                done += info.nbytes
                if progress is not None:
                    progress(done, total)
    return dst


def _snpx_metadata(source: tensors.TensorSet) -> tuple[dict[str, str], Any, dict[str, dict[str, Any]]]:
    """(metadata, config, placements) for the SNPX file made from `source`."""
    metadata = dict(source.metadata)
    config = source.config
    placement = {name: {"global_shape": t.global_shape, "global_offset": t.global_offset}
                 for name, t in source.info.items() if t.global_shape is not None}
    if isinstance(source, tensors.StepTensors):  # what a step saved besides its tensors
        config = {"step": source.step, "training_state": source.training_state, "values": source.values}
    if isinstance(source, tensors.SafetensorsTensors):
        config = _json_value(metadata.pop(CONFIG_KEY, "null"), CONFIG_KEY, source.path)
        stored = _json_value(metadata.pop(PLACEMENT_KEY, "{}"), PLACEMENT_KEY, source.path)
        placement = {name: {"global_shape": tuple(where[0]), "global_offset": tuple(where[1])}
                     for name, where in stored.items()}
        if source.index is not None:
            differing = {shard: meta for shard, meta in source.shard_metadata.items() if meta != source.metadata}
            metadata[INDEX_KEY] = json.dumps({
                "metadata": source.index.get("metadata", {}), "weight_map": source.index["weight_map"],
                **({"shard_metadata": differing} if differing else {})}, sort_keys=True, separators=(",", ":"))
    return metadata, config, placement


def _json_value(raw: str, key: str, where: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise errors.ForeignCheckpointError(f"metadata {key!r} is not JSON: {e}", path=where) from None


def to_safetensors(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
                   max_shard_bytes: int | None = None, progress: Progress | None = None) -> list[str]:
    """Writes the checkpoint at `src` (an SNPX file or a step directory; anything tensors.open_tensors reads)
    as safetensors. `dst` ending in `.safetensors`: one file. Otherwise `dst` is a directory that gets
    shards and `model.safetensors.index.json`: the shards recorded when the SNPX file came from a sharded
    checkpoint, or new ones of at most `max_shard_bytes` (default 5 GB; a larger tensor gets a shard of its
    own). Every file is written under a temporary name, fsynced and renamed. Returns the paths written."""
    dst = os.fspath(dst)
    with tensors.open_tensors(src) as source:
        metadata, recorded = _safetensors_metadata(source)
        for name, info in source.info.items():
            if info.dtype not in tensors.SAFETENSORS_DTYPES.values():
                raise errors.UnsupportedTensorError(
                    f"tensor {name!r} is {info.dtype}, which safetensors does not store: convert it to a "
                    f"supported dtype ({', '.join(tensors.SAFETENSORS_DTYPES.values())}) first")
        total, done = source.total_bytes(), 0
        if dst.endswith(".safetensors"):
            plan = {os.path.basename(dst): list(source.info)}
            directory, index = os.path.dirname(os.path.abspath(dst)), None
        else:
            directory = dst
            os.makedirs(directory, exist_ok=True)
            if recorded is not None and max_shard_bytes is None:
                plan = {}
                for name, shard in recorded["weight_map"].items():
                    plan.setdefault(shard, []).append(name)
                index_metadata = recorded.get("metadata", {})
            else:
                plan = _split(source, max_shard_bytes or DEFAULT_SHARD_BYTES)
                index_metadata = {"total_size": total}
            index = {"metadata": index_metadata,
                     "weight_map": {name: shard for shard, names in plan.items() for name in names}}
            if set(index["weight_map"]) != set(source.info):
                raise errors.ForeignCheckpointError(f"the recorded {INDEX_KEY} does not list exactly this "
                                                    "file's tensors", path=source.path)
        shard_metadata = recorded.get("shard_metadata", {}) if recorded is not None else {}
        written = []
        for shard, names in plan.items():
            arrays = {name: _c_order(source.read(name)) for name in names}
            path = os.path.join(directory, shard)
            _write_safetensors(path, arrays, shard_metadata.get(shard, metadata))
            written.append(path)
            done += sum(a.nbytes for a in arrays.values())
            if progress is not None:
                progress(done, total)
        if index is not None:
            path = os.path.join(directory, INDEX_NAME)
            _fs.write_durable(path, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
            written.append(path)
    return written


def _safetensors_metadata(source: tensors.TensorSet) -> tuple[dict[str, str], dict[str, Any] | None]:
    """(the files' `__metadata__`, the shard layout recorded by an earlier conversion or None)."""
    metadata = dict(source.metadata)
    recorded = None
    if INDEX_KEY in metadata:
        recorded = _json_value(metadata.pop(INDEX_KEY), INDEX_KEY, source.path)
        if not isinstance(recorded, dict) or not isinstance(recorded.get("weight_map"), dict) or not all(
                storage.is_plain_name(v) for v in recorded["weight_map"].values() if isinstance(v, str)):
            raise errors.ForeignCheckpointError(f"metadata {INDEX_KEY!r} is not a shard layout", path=source.path)
    if source.config is not None:
        metadata[CONFIG_KEY] = json.dumps(source.config, sort_keys=True, separators=(",", ":"))
    placement = {name: [list(t.global_shape), list(t.global_offset or ())]
                 for name, t in source.info.items() if t.global_shape is not None}
    if placement:
        metadata[PLACEMENT_KEY] = json.dumps(placement, sort_keys=True, separators=(",", ":"))
    return metadata, recorded


def _split(source: tensors.TensorSet, max_bytes: int) -> dict[str, list[str]]:
    """Tensors in stored order, cut into shards of at most max_bytes (transformers' rule and file names)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, info in source.info.items():
        if groups[-1] and size + info.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += info.nbytes
    return {SHARD_NAME.format(i + 1, len(groups)): names for i, names in enumerate(groups)}


def _c_order(array: np.ndarray) -> np.ndarray:
    """The array itself when C-contiguous (reads of SNPX are), else a C-ordered copy; 0-d stays 0-d
    (np.ascontiguousarray would make it 1-d)."""
    return array if array.flags.c_contiguous else array.copy(order="C")


def _write_safetensors(path: str, arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """One safetensors file by the safetensors package, from the arrays' memory; durable and atomic."""
    import safetensors

    specs = {name: safetensors.TensorSpec(dtype=array.dtype.name, shape=array.shape,
                                          data_ptr=array.ctypes.data, data_len=array.nbytes)
             for name, array in arrays.items()}
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    try:
        safetensors.serialize_file(specs, tmp, metadata=metadata or None)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        _native.rename_durable(tmp, path)
    except BaseException:
        _fs.unlink_quietly(tmp)
        raise
