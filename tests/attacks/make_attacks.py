"""Regenerates the hostile checkpoint files in this folder (run: python tests/attacks/make_attacks.py).

Each file breaks exactly one rule of docs/FORMAT.md while keeping every check it does not target
valid (correct CRCs, canonical layout), so the reader has to catch the rule itself. `expected.json`
maps each file to the error class and a phrase of the message a user sees. The files are committed
as artifacts: a regression in the generator can't quietly weaken the tests.
"""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import struct
import zipfile

from SneppX_ALG import _native
from SneppX_ALG.checkpoint import format

HERE = pathlib.Path(__file__).resolve().parent
HDR = struct.Struct("<8sHHIQQQIIQII")


def header(*, file_size, table_offset, table_length, table_crc, sig_length=0, sig_crc=0, major=1, minor=0, flags=0,
           data_offset=4096, magic=format.MAGIC) -> bytes:
    body = HDR.pack(magic, major, minor, flags, file_size, table_offset, table_length, table_crc, sig_length,
                    data_offset, sig_crc, 0)[:60]
    return body + struct.pack("<I", _native.crc32c(body))


def entry(name, dtype="float32", shape=(4,), offset=4096, length=None, data=None, **extra):
    length = format.DTYPES.get(dtype, 4) * _prod(shape) if length is None else length
    crc = _native.crc32c(data if data is not None else bytes(length))
    return {"name": name, "dtype": dtype, "shape": list(shape), "offset": offset, "length": length, "crc32c": crc,
            **extra}


def _prod(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def build(tensors, *, metadata=None, config=None, table_raw=None, data_end=None, data=b"", tweak=None,
          trailing=b"", **header_overrides) -> bytes:
    """A file with the given table; data is zeros unless given; header CRCs are correct unless overridden."""
    table = table_raw if table_raw is not None else json.dumps(
        {"tensors": tensors, "metadata": metadata or {}, "config": config}, separators=(",", ":")).encode()
    if data_end is None:
        data_end = max([t["offset"] + t["length"] for t in tensors if isinstance(t.get("length"), int)
                        and isinstance(t.get("offset"), int) and t["length"] < 1 << 20] + [4096])
    table_offset = format.align_up(data_end)
    body = bytearray(table_offset)
    body[4096:4096 + len(data)] = data
    fields = {"file_size": table_offset + len(table), "table_offset": table_offset, "table_length": len(table),
              "table_crc": _native.crc32c(table)}
    fields.update(header_overrides)
    body[:64] = header(**fields)
    out = bytes(body) + table + trailing
    return tweak(out) if tweak else out


class Evil:
    def __reduce__(self):
        return (print, ("pickle code ran",))


def attacks() -> dict[str, tuple[bytes, str, str]]:
    """name -> (file bytes, expected error class, message phrase)."""
    ok = [entry("w")]
    a: dict[str, tuple[bytes, str, str]] = {}
    a["bad_magic"] = (b"NOTSNPX!" + bytes(8000), "BadMagicError", "bad magic")
    a["empty"] = (b"", "TruncatedCheckpointError", "empty")
    a["short_header"] = (format.MAGIC + b"\x01\x00", "TruncatedCheckpointError", "shorter than")
    a["pickle"] = (pickle.dumps({"w": [1.0, 2.0], "evil": Evil()}), "UnsafeFormatError", "pickle")
    zbuf = io.BytesIO()
    with zipfile.ZipFile(zbuf, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": 1}))
    a["torch_zip"] = (zbuf.getvalue(), "UnsafeFormatError", "zip")
    a["future_version"] = (build(ok, major=2), "UnsupportedVersionError", "version 2.0")
    a["unknown_flags"] = (build(ok, flags=1), "UnsupportedVersionError", "flags")
    a["header_crc"] = (build(ok, tweak=lambda b: b[:60] + bytes([b[60] ^ 1]) + b[61:]), "CorruptHeaderError",
                       "header CRC32C")
    a["table_length_past_file"] = (build(ok, table_length=1 << 20, file_size=8192 + (1 << 20)),
                                   "TruncatedCheckpointError", "truncated")
    a["table_length_overflow"] = (build(ok, table_length=(1 << 64) - 1), "LimitExceededError", "table_length")
    a["file_size_lies_short"] = (build(ok, file_size=4096), "CorruptHeaderError", "file_size")
    a["trailing_bytes"] = (build(ok, trailing=b"\x00" * 10), "CorruptHeaderError", "trailing bytes")
    a["table_offset_unaligned"] = (build(ok, tweak=None, table_offset=8100, file_size=8100 + 200),
                                   "LayoutError", "multiple of 4096")
    a["table_crc"] = (build(ok, table_crc=0x12345678), "CorruptTableError", "table CRC32C")
    a["header_padding"] = (build(ok, tweak=lambda b: b[:100] + b"\x01" + b[101:]), "NonZeroPaddingError",
                           "header padding")
    a["not_json"] = (build([], table_raw=b"{not json"), "CorruptTableError", "not valid JSON")
    a["not_utf8_table"] = (build([], table_raw=b'{"tensors":[],"metadata":{"\xff":"x"},"config":null}'),
                           "CorruptTableError", "UTF-8")
    a["name_not_utf8"] = (build([], table_raw=b'{"tensors":[{"name":"\xc3\x28","dtype":"float32","shape":[0],'
                                           b'"offset":4096,"length":0,"crc32c":0}],"metadata":{},"config":null}'),
                          "CorruptTableError", "UTF-8")
    a["name_lone_surrogate"] = (build([entry("\ud800")]), "CorruptTableError", "not valid Unicode")
    a["nested_json"] = (build([], table_raw=b'{"tensors":[],"metadata":{},"config":' + b"[" * 5000 + b"]" * 5000
                              + b"}"), "LimitExceededError", "nests")
    # 100,000 empty objects: 300 KB that json would build into ~7 MB of dicts (a 64 MiB table: ~1.6 GB)
    a["dense_containers"] = (build([], table_raw=b'{"tensors":[' + b",".join([b"{}"] * 100_000)
                                   + b'],"metadata":{},"config":null}'), "LimitExceededError", "objects and arrays")
    a["duplicate_json_key"] = (build([], table_raw=b'{"tensors":[],"tensors":[],"metadata":{},"config":null}'),
                               "CorruptTableError", "duplicate key")
    a["nan_in_table"] = (build([], table_raw=b'{"tensors":[],"metadata":{},"config":NaN}'), "CorruptTableError",
                         "NaN")
    a["extra_table_key"] = (build([], table_raw=b'{"tensors":[],"metadata":{},"config":null,"exec":"rm"}'),
                            "CorruptTableError", "keys")
    a["duplicate_names"] = (build([entry("w"), entry("w", offset=8192)]), "CorruptTableError",
                            "duplicate tensor name")
    a["unknown_dtype"] = (build([entry("w", dtype="object", length=16)]), "CorruptTableError", "unknown dtype")
    a["huge_rank"] = (build([entry("w", shape=[1] * 1000, length=4)]), "LimitExceededError", "rank")
    a["shape_dtype_overflow"] = (build([entry("w", dtype="float64", shape=[1 << 62, 1 << 62], length=8)]),
                                 "LimitExceededError", "bytes, more than")
    a["length_mismatch"] = (build([entry("w", length=20)]), "CorruptTableError", "length 20")
    a["negative_dim"] = (build([entry("w", shape=[-4], length=4)]), "CorruptTableError", "not an integer")
    a["offset_past_end"] = (build([entry("w", offset=1 << 40)], data_end=4112), "LayoutError", "starts at")
    a["gap"] = (build([entry("w", offset=8192)], data_end=8208), "LayoutError", "leaves a hole")
    a["overlap"] = (build([entry("a", shape=(2048,)), entry("b", offset=8000)], data_end=12288),
                    "LayoutError", "overlaps")
    a["tensor_past_table"] = (build([entry("w", shape=(2048,))], data_end=4096), "LayoutError", "past the data")
    a["unaligned_offset"] = (build([entry("w", offset=4097)], data_end=4113), "LayoutError", "expected 4096")
    a["too_many_tensors"] = (build([], table_raw=b'{"tensors":[' + b",".join([b"0"] * (format.MAX_TENSORS + 1))
                                   + b'],"metadata":{},"config":null}'), "LimitExceededError", "tensors, limit")
    a["metadata_not_strings"] = (build(ok, metadata={"n": 1}), "CorruptTableError", "strings")
    # "\ud800" escapes: valid JSON, but no UTF-8 text; a reader that kept them could never write them again
    a["metadata_lone_surrogate"] = (build(ok, metadata={"note": "\ud800"}), "CorruptTableError", "not valid Unicode")
    a["config_lone_surrogate"] = (build(ok, config={"vocab": {"\udc80": 3}}), "CorruptTableError",
                                  "not valid Unicode")
    a["shard_out_of_bounds"] = (build([entry("w", global_shape=[3], global_offset=[2])]), "CorruptTableError",
                                "does not fit")
    a["data_corrupt"] = (build([entry("w", data=b"\x00" * 16)], data=b"\x01" + b"\x00" * 15),
                         "ChecksumMismatchError", "CRC32C")
    a["tensor_padding"] = (build([entry("w")], data=b"\x00" * 16 + b"\x07"), "NonZeroPaddingError", "padding")
    a["signature_crc"] = (build(ok, sig_length=0, sig_crc=5), "CorruptHeaderError", "signature")
    return a


def main() -> None:
    expected = {}
    for name, (blob, error, phrase) in sorted(attacks().items()):
        (HERE / f"{name}.snpx").write_bytes(blob)
        expected[name] = {"error": error, "message": phrase}
    (HERE / "expected.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(expected)} hostile files to {HERE}")


if __name__ == "__main__":
    main()
