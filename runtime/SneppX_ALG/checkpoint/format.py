"""The SNPX on-disk format: encode and decode of the header and table, and the hard limits.

Pure: no I/O. The reader and writer (reader.py, writer.py), the validator (validate.py) and the storage layer build on these
functions, so the rules of docs/FORMAT.md live in exactly one place. Every decoder bounds every length
before it trusts it and raises a `CheckpointFormatError` subclass that names what is wrong.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from SneppX_ALG import _native, errors, untrusted

MAGIC = b"\x89SNPX\r\n\x1a"
VERSION_MAJOR = 1
VERSION_MINOR = 0
HEADER_SIZE = 64
ALIGN = 4096
DATA_OFFSET = 4096

MAX_TABLE_BYTES = 64 << 20
MAX_SIGNATURE_BYTES = 64 << 10
MAX_TENSORS = 1 << 20
MAX_RANK = 32
MAX_NAME_BYTES = 1024
MAX_METADATA_ENTRIES = 65536
MAX_METADATA_KEY_BYTES = 1024
MAX_METADATA_VALUE_BYTES = 1 << 20
MAX_DIM = 1 << 62
MAX_LENGTH = 1 << 62
MAX_JSON_DEPTH = 64
TABLE_DEPTH = MAX_JSON_DEPTH + 1  # the table object, then a config nested MAX_JSON_DEPTH deep

# dtype name -> item size in bytes (little-endian, C order)
DTYPES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1,
    "uint16": 2, "int16": 2, "float16": 2, "bfloat16": 2,
    "uint32": 4, "int32": 4, "float32": 4,
    "uint64": 8, "int64": 8, "float64": 8, "complex64": 8,
    "complex128": 16,
}

_HEADER = struct.Struct("<8sHHIQQQIIQII")
assert _HEADER.size == HEADER_SIZE

_TABLE_KEYS = {"tensors", "metadata", "config"}
_ENTRY_REQUIRED = {"name", "dtype", "shape", "offset", "length", "crc32c"}
_ENTRY_OPTIONAL = {"global_shape", "global_offset", "digest"}


def align_up(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


@dataclass(frozen=True)
class Header:
    file_size: int
    table_offset: int
    table_length: int
    table_crc32c: int
    signature_length: int = 0
    signature_crc32c: int = 0
    data_offset: int = DATA_OFFSET
    version_major: int = VERSION_MAJOR
    version_minor: int = VERSION_MINOR
    flags: int = 0


@dataclass(frozen=True, slots=True)  # no __dict__: a table may hold a million of them
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    crc32c: int
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None
    digest: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape),
            "offset": self.offset, "length": self.length, "crc32c": self.crc32c,
        }
        if self.global_shape is not None:
            out["global_shape"] = list(self.global_shape)
            out["global_offset"] = list(self.global_offset or ())
        if self.digest is not None:
            out["digest"] = self.digest
        return out


@dataclass(frozen=True)
class Table:
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str] = field(default_factory=dict)
    config: Any = None


# --- header -------------------------------------------------------------------


def encode_header(h: Header) -> bytes:
    body = _HEADER.pack(MAGIC, h.version_major, h.version_minor, h.flags, h.file_size, h.table_offset,
                        h.table_length, h.table_crc32c, h.signature_length, h.data_offset,
                        h.signature_crc32c, 0)
    return body[:60] + struct.pack("<I", _native.crc32c(body[:60]))


def sniff_foreign(prefix: bytes) -> str | None:
    """Names a well-known foreign format from the first bytes, or None."""
    if len(prefix) >= 2 and prefix[0] == 0x80 and 2 <= prefix[1] <= 5:
        return "pickle"
    if prefix.startswith(b"PK\x03\x04"):
        return "zip"  # torch.save files are zip archives holding a pickle
    if prefix.startswith(b"\x93NUMPY"):
        return "npy"
    if len(prefix) >= 9 and prefix[8:9] == b"{":
        return "safetensors"
    return None


def decode_header(raw: bytes, *, actual_size: int | None = None, path: str | None = None) -> Header:
    """Checks and decodes the 64-byte header. `actual_size` is the file's size when known."""
    if len(raw) < HEADER_SIZE:
        if MAGIC.startswith(raw[: len(MAGIC)]) and raw:
            raise errors.TruncatedCheckpointError(
                f"file is {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header", path=path)
        if not raw:
            raise errors.TruncatedCheckpointError("file is empty (0 bytes)", path=path)
    if raw[: len(MAGIC)] != MAGIC:
        foreign = sniff_foreign(raw)
        if foreign in ("pickle", "zip"):
            raise errors.UnsafeFormatError(
                f"this is a {'Python pickle' if foreign == 'pickle' else 'zip archive (torch.save: a pickle inside)'}"
                ", not an SNPX checkpoint; SneppX never loads pickles because loading one can run arbitrary code. "
                "Re-save the weights with CheckpointWriter or Transformer.save_checkpoint.", path=path)
        hint = f" (it looks like a {foreign} file)" if foreign else ""
        raise errors.BadMagicError(f"not an SNPX checkpoint: bad magic bytes {raw[:8]!r}{hint}", path=path)
    if len(raw) < HEADER_SIZE:
        raise errors.TruncatedCheckpointError(
            f"file is {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header", path=path)
    (_, major, minor, flags, file_size, table_offset, table_length, table_crc, sig_length, data_offset,
     sig_crc, header_crc) = _HEADER.unpack(raw[:HEADER_SIZE])
    crc_ok = _native.crc32c(raw[:60]) == header_crc
    if major != VERSION_MAJOR:
        why = "" if crc_ok else " (the header also fails its CRC: it may be corrupt)"
        raise errors.UnsupportedVersionError(
            f"format version {major}.{minor} is not supported by this reader (major version {VERSION_MAJOR}); "
            f"upgrade SneppX{why}", path=path)
    if not crc_ok:
        raise errors.CorruptHeaderError(
            f"header CRC32C mismatch (stored {header_crc:#010x}, computed {_native.crc32c(raw[:60]):#010x})",
            path=path)
    if flags != 0:
        raise errors.UnsupportedVersionError(f"unknown header flags {flags:#x}; upgrade SneppX", path=path)
    if data_offset != DATA_OFFSET:
        raise errors.CorruptHeaderError(f"data_offset is {data_offset}, must be {DATA_OFFSET}", path=path)
    if not 2 <= table_length <= MAX_TABLE_BYTES:
        raise errors.LimitExceededError(
            f"table_length {table_length} outside 2..{MAX_TABLE_BYTES} bytes", path=path)
    if sig_length > MAX_SIGNATURE_BYTES:
        raise errors.LimitExceededError(
            f"signature_length {sig_length} exceeds {MAX_SIGNATURE_BYTES} bytes", path=path)
    if sig_length == 0 and sig_crc != 0:
        raise errors.CorruptHeaderError("signature_crc32c is set but there is no signature block", path=path)
    if table_offset < DATA_OFFSET or table_offset % ALIGN:
        raise errors.LayoutError(
            f"table_offset {table_offset} must be a multiple of {ALIGN} and >= {DATA_OFFSET}", path=path)
    if table_offset + table_length + sig_length != file_size:
        raise errors.CorruptHeaderError(
            f"file_size {file_size} != table_offset {table_offset} + table_length {table_length} "
            f"+ signature_length {sig_length}", path=path)
    if actual_size is not None:
        if actual_size < file_size:
            raise errors.TruncatedCheckpointError(
                f"file is {actual_size} bytes but its header says {file_size}: truncated "
                f"({file_size - actual_size} bytes missing)", path=path)
        if actual_size > file_size:
            raise errors.CorruptHeaderError(
                f"{actual_size - file_size} trailing bytes after the end of the checkpoint "
                f"(header says {file_size} bytes)", path=path)
    return Header(file_size=file_size, table_offset=table_offset, table_length=table_length,
                  table_crc32c=table_crc, signature_length=sig_length, signature_crc32c=sig_crc,
                  data_offset=data_offset, version_major=major, version_minor=minor, flags=flags)


# --- table --------------------------------------------------------------------


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Exact byte size; raises LimitExceededError past MAX_LENGTH (Python ints never overflow)."""
    n = DTYPES[dtype] * math.prod(shape)
    if n > MAX_LENGTH:
        raise errors.LimitExceededError(f"{dtype}{list(shape)} is {n} bytes, more than {MAX_LENGTH}")
    return n


def check_metadata(metadata: Any, *, path: str | None = None) -> dict[str, str]:
    if not isinstance(metadata, dict):
        raise errors.CorruptTableError("metadata must be a mapping of string to string", path=path)
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise errors.LimitExceededError(f"{len(metadata)} metadata entries, limit {MAX_METADATA_ENTRIES}", path=path)
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise errors.CorruptTableError(f"metadata entry {k!r}: keys and values must be strings", path=path)
        try:
            key_bytes, value_bytes = len(k.encode("utf-8")), len(v.encode("utf-8"))
        except UnicodeEncodeError:
            raise errors.CorruptTableError(
                f"metadata entry {k!r} is not valid Unicode: it holds a lone surrogate, which UTF-8 can't store",
                path=path) from None
        if key_bytes > MAX_METADATA_KEY_BYTES:
            raise errors.LimitExceededError(f"metadata key {k[:40]!r}... longer than {MAX_METADATA_KEY_BYTES} bytes",
                                            path=path)
        if value_bytes > MAX_METADATA_VALUE_BYTES:
            raise errors.LimitExceededError(f"metadata value of {k!r} longer than {MAX_METADATA_VALUE_BYTES} bytes",
                                            path=path)
    return dict(metadata)


def _has_lone_surrogate(value: Any) -> bool:
    """True when a string anywhere in a JSON value (dict keys too) can't be encoded as UTF-8: it holds a lone
    UTF-16 surrogate, which Python strings and JSON escapes ("\\ud800") allow but the table's UTF-8 does not.
    Iterative, like _depth."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _depth(value: Any, limit: int) -> int:
    """Nesting depth, stopping early past `limit` (iterative: hostile input can't blow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def check_config(config: Any) -> None:
    """Writer side: `config` must survive a JSON round trip unchanged (no tuples, NaN, numpy scalars...)."""
    try:
        text = json.dumps(config, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise errors.UnsupportedTensorError(f"config is not JSON-safe: {e}") from None
    if json.loads(text) != config:
        raise errors.UnsupportedTensorError(
            "config is not JSON-safe: it changes in a JSON round trip (tuples, non-string keys, subclasses?)")
    if _has_lone_surrogate(config):
        raise errors.UnsupportedTensorError(
            "config is not JSON-safe: a string in it is not valid Unicode (a lone surrogate, which UTF-8 can't store)")
    if _depth(config, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise errors.LimitExceededError(f"config nests deeper than {MAX_JSON_DEPTH}")


def shard_fits(shape: tuple[int, ...], global_shape: tuple[int, ...], global_offset: tuple[int, ...]) -> bool:
    """True when a shard of `shape` placed at `global_offset` lies inside `global_shape` (same rank)."""
    return len(global_shape) == len(global_offset) == len(shape) and all(
        0 <= o and o + s <= g for o, s, g in zip(global_offset, shape, global_shape))


def check_name(name: Any, *, path: str | None = None) -> str:
    if not isinstance(name, str) or not name:
        raise errors.CorruptTableError(f"tensor name must be a non-empty string, got {name!r}", path=path)
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise errors.CorruptTableError(f"tensor name {name!r} is not valid Unicode", path=path) from None
    if size > MAX_NAME_BYTES:
        raise errors.LimitExceededError(f"tensor name {name[:40]!r}... is longer than {MAX_NAME_BYTES} bytes", path=path)
    if "\x00" in name:
        raise errors.CorruptTableError(f"tensor name {name!r} contains NUL", path=path)
    return name


def encode_table(table: Table) -> bytes:
    doc = {"tensors": [t.to_json() for t in table.tensors], "metadata": table.metadata, "config": table.config}
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    if len(raw) > MAX_TABLE_BYTES:
        raise errors.LimitExceededError(f"table is {len(raw)} bytes, limit {MAX_TABLE_BYTES}")
    untrusted.check_json_cost(raw, what="table", max_depth=TABLE_DEPTH)  # what a reader refuses, refused here
    return raw


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {dup!r}")
    return out


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def _int_list(value: Any, what: str, path: str | None) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise errors.CorruptTableError(f"{what} must be a list of integers", path=path)
    if len(value) > MAX_RANK:
        raise errors.LimitExceededError(f"{what} has rank {len(value)}, limit {MAX_RANK}", path=path)
    for d in value:
        if type(d) is not int or not 0 <= d <= MAX_DIM:
            raise errors.CorruptTableError(f"{what} holds {d!r}, not an integer in 0..2^62", path=path)
    return tuple(value)


def _decode_entry(raw: Any, index: int, path: str | None) -> TensorEntry:
    if not isinstance(raw, dict):
        raise errors.CorruptTableError(f"tensor #{index} is not an object", path=path)
    keys = set(raw)
    if not _ENTRY_REQUIRED <= keys or keys - _ENTRY_REQUIRED - _ENTRY_OPTIONAL:
        missing, extra = _ENTRY_REQUIRED - keys, keys - _ENTRY_REQUIRED - _ENTRY_OPTIONAL
        raise errors.CorruptTableError(
            f"tensor #{index}: missing keys {sorted(missing)} / unknown keys {sorted(extra)}", path=path)
    name = check_name(raw["name"], path=path)
    dtype = raw["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise errors.CorruptTableError(f"tensor {name!r}: unknown dtype {dtype!r}", path=path)
    shape = _int_list(raw["shape"], f"tensor {name!r} shape", path)
    for key in ("offset", "length", "crc32c"):
        if type(raw[key]) is not int or raw[key] < 0:
            raise errors.CorruptTableError(f"tensor {name!r}: {key} must be a non-negative integer", path=path)
    if raw["crc32c"] > 0xFFFFFFFF:
        raise errors.CorruptTableError(f"tensor {name!r}: crc32c {raw['crc32c']} is not 32-bit", path=path)
    try:
        expected = tensor_nbytes(dtype, shape)
    except errors.LimitExceededError as e:
        raise errors.LimitExceededError(f"tensor {name!r}: {e}", path=path) from None
    if raw["length"] != expected:
        raise errors.CorruptTableError(
            f"tensor {name!r}: length {raw['length']} != {dtype}{list(shape)} = {expected} bytes", path=path)
    global_shape = global_offset = None
    if "global_shape" in raw or "global_offset" in raw:
        if "global_shape" not in raw or "global_offset" not in raw:
            raise errors.CorruptTableError(f"tensor {name!r}: global_shape and global_offset come together", path=path)
        global_shape = _int_list(raw["global_shape"], f"tensor {name!r} global_shape", path)
        global_offset = _int_list(raw["global_offset"], f"tensor {name!r} global_offset", path)
        if not shard_fits(shape, global_shape, global_offset):
            raise errors.CorruptTableError(
                f"tensor {name!r}: shard {list(shape)} at {list(global_offset)} does not fit in {list(global_shape)}",
                path=path)
    digest = raw.get("digest")
    if digest is not None and (not isinstance(digest, str) or ":" not in digest or len(digest) > 256):
        raise errors.CorruptTableError(f"tensor {name!r}: digest must be '<alg>:<hex>'", path=path)
    return TensorEntry(name, dtype, shape, raw["offset"], raw["length"], raw["crc32c"], global_shape,
                       global_offset, digest)


def check_table_bytes(raw: bytes, header: Header, *, path: str | None = None) -> None:
    """The table bytes are all there and match their CRC32C: checked before anything else looks at them (a
    verifier checks the signature over these raw bytes next, and parses them only after that)."""
    if len(raw) != header.table_length:
        raise errors.TruncatedCheckpointError(
            f"table is {len(raw)} bytes, header says {header.table_length}", path=path)
    crc = _native.crc32c(raw)
    if crc != header.table_crc32c:
        raise errors.CorruptTableError(
            f"table CRC32C mismatch (stored {header.table_crc32c:#010x}, computed {crc:#010x})", path=path)


# A lone surrogate can reach a parsed string only through a JSON escape (the bytes themselves are strict UTF-8),
# so the walk that looks for one runs only when the table holds such an escape.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def decode_table(raw: bytes, header: Header, *, path: str | None = None) -> Table:
    """Checks the table bytes (check_table_bytes), parses them strictly, and checks the canonical layout
    against the header."""
    check_table_bytes(raw, header, path=path)
    untrusted.check_json_cost(raw, what="table", max_depth=TABLE_DEPTH, path=path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise errors.CorruptTableError(f"table is not valid UTF-8 ({e.reason} at byte {e.start})", path=path) from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant,
                         parse_float=untrusted.finite_float)
    except RecursionError:
        raise errors.LimitExceededError("table JSON nests too deeply", path=path) from None
    except ValueError as e:
        raise errors.CorruptTableError(f"table is not valid JSON: {e}", path=path) from None
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(doc):
        raise errors.CorruptTableError("table holds a string that is not valid Unicode (an escaped lone "
                                       "surrogate such as \\ud800, which UTF-8 can't store)", path=path)
    if not isinstance(doc, dict) or set(doc) != _TABLE_KEYS:
        found = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise errors.CorruptTableError(f"table must be an object with keys {sorted(_TABLE_KEYS)}, got {found}",
                                       path=path)
    tensors_raw = doc["tensors"]
    if not isinstance(tensors_raw, list):
        raise errors.CorruptTableError("table 'tensors' must be a list", path=path)
    if len(tensors_raw) > MAX_TENSORS:
        raise errors.LimitExceededError(f"{len(tensors_raw)} tensors, limit {MAX_TENSORS}", path=path)
    metadata = check_metadata(doc["metadata"], path=path)
    if _depth(doc["config"], MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise errors.LimitExceededError(f"config nests deeper than {MAX_JSON_DEPTH}", path=path)
    tensors = tuple(_decode_entry(t, i, path) for i, t in enumerate(tensors_raw))
    check_layout(tensors, header, path=path)
    return Table(tensors=tensors, metadata=metadata, config=doc["config"])


def check_layout(tensors: tuple[TensorEntry, ...], header: Header, *, path: str | None = None) -> None:
    """Offsets must be exactly the canonical ones: no holes, overlaps, or data past the table."""
    seen: set[str] = set()
    expected = header.data_offset
    for t in tensors:
        if t.name in seen:
            raise errors.CorruptTableError(f"duplicate tensor name {t.name!r}", path=path)
        seen.add(t.name)
        if t.offset != expected:
            kind = "overlaps the previous tensor" if t.offset < expected else "leaves a hole"
            raise errors.LayoutError(
                f"tensor {t.name!r} starts at {t.offset}, expected {expected}: it {kind}", path=path)
        end = t.offset + t.length
        if end > header.table_offset:
            raise errors.LayoutError(
                f"tensor {t.name!r} ends at {end}, past the data section (table at {header.table_offset})", path=path)
        expected = align_up(end)
    if expected != header.table_offset:
        raise errors.LayoutError(
            f"table_offset is {header.table_offset}, expected {expected} after the last tensor", path=path)


# --- dtypes -------------------------------------------------------------------


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype that reads a stored dtype (bfloat16 as raw uint16 unless ml_dtypes is installed)."""
    if name == "bfloat16":
        try:
            import ml_dtypes  # optional

            return np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            return np.dtype("<u2")
    return np.dtype(name).newbyteorder("<") if np.dtype(name).itemsize > 1 else np.dtype(name)


def dtype_name(dtype: np.dtype) -> str:
    """The stored name of a numpy dtype; UnsupportedTensorError for anything else."""
    name = dtype.name
    if name in DTYPES and name != "bfloat16" and dtype.kind in "biufc":
        return name
    if name == "bfloat16":
        return name
    if dtype.fields:
        raise errors.UnsupportedTensorError(f"a structured (record) dtype {dtype} can't be stored: write each "
                                            "field as a tensor of its own")
    raise errors.UnsupportedTensorError(f"dtype {dtype} can't be stored (SNPX stores {', '.join(DTYPES)}): cast "
                                        "the tensor to one of them first (float8 to bfloat16, for example)")
