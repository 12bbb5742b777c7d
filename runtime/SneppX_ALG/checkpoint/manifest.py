"""The step manifest (`manifest.json`): encode, decode and check it. Pure: no I/O.

Why here and not in the coordinator: a step directory is a multi-file checkpoint (docs/FORMAT.md,
"Multi-file checkpoints"), and validating one needs the manifest's rules; the coordinator only builds
the manifest's contents.

Versions: 1 and 2 list each tensor's `pieces` (flat byte ranges, written by one process); version 3 (since
sharded steps) lists its `chunks`, boxes of the global tensor written by any rank, each with block checksums
(docs/FORMAT.md, "Sharded steps"); version 4 is version 3 with references: a chunk whose bytes did not change
since an earlier step names the file of that step which holds them (`from`), and `uses` lists those steps
(docs/FORMAT.md, "Incremental steps"). All four are read; a step with no reference is written as version 3.

Integrity: a manifest carries `"checksum": "crc32c:<8 hex>"`, the CRC32C of its canonical encoding without
that key, and its bytes must be that canonical encoding, so every byte of it is covered whether the step is
signed or not (docs/FORMAT.md, "Step manifests: the checksum"). Version 1 manifests, written before the
checksum existed, are still read, with no checksum to check.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import Any

from SneppX_ALG import _native, errors, storage, untrusted
from SneppX_ALG.checkpoint import chunks, format

MANIFEST_FORMAT = "sneppx.manifest"
MANIFEST_VERSION = 3
INCREMENTAL_VERSION = 4  # a version 3 manifest with references to earlier steps' files
CHECKSUM = "checksum"
# Bytes per block checksum of a chunk (version 3): a load reads whole blocks, so this bounds what it reads
# beyond what it needs (two partial blocks per run at most, one on average) against the manifest's size (8 hex
# digits per block, 64 more per block in a signed step). docs/BENCHMARKS.md, "Sharded checkpoints".
BLOCK_BYTES = 256 << 10
MIN_BLOCK_BYTES = 4096
MAX_BLOCK_BYTES = 64 << 20
# The most earlier steps a version 4 manifest may reference (a chain references at most full_every - 1 of them):
# bounds what checking a forged manifest can make a reader open (each referenced file costs a few requests on S3).
MAX_USES = 1000
MAX_DEPTH = format.MAX_JSON_DEPTH + 8  # the manifest's own structure, then a training state nested up to 64 deep
_HEX = re.compile(r"^[0-9a-f]*$")


def _canonical(doc: dict[str, Any]) -> bytes:
    return _canonical_text(doc).encode()


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """`crc32c:<8 hex>` of the canonical encoding of `manifest` without its checksum."""
    content = {k: v for k, v in manifest.items() if k != CHECKSUM}
    return f"crc32c:{_native.crc32c(_canonical(content)):08x}"


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    """The manifest's bytes: canonical JSON (sorted keys, no spaces, ASCII) with its checksum added. A manifest
    that decode_manifest would refuse for its nesting (a training state nested too deep) is refused here."""
    content = {k: v for k, v in manifest.items() if k != CHECKSUM}
    raw = _canonical({**content, CHECKSUM: manifest_checksum(content)})
    untrusted.check_json_cost(raw, what="manifest", max_depth=MAX_DEPTH, limit=errors.ManifestError,
                              malformed=errors.ManifestError, dense_ok=True)
    return raw


def decode_manifest(raw: bytes, *, step: int, where: str) -> dict[str, Any]:
    """Parses and checks a manifest (its schema, then its checksum); returns its content, without the
    checksum. ManifestError with what is wrong."""
    def bad(why: str) -> errors.ManifestError:
        return errors.ManifestError(why, path=where)

    if len(raw) > storage.MAX_MANIFEST_BYTES:
        raise bad(f"manifest is {len(raw)} bytes, more than {storage.MAX_MANIFEST_BYTES}")
    untrusted.check_json_cost(raw, what="manifest", max_depth=MAX_DEPTH, limit=errors.ManifestError,
                              malformed=errors.ManifestError, dense_ok=True, path=where)
    try:
        m = json.loads(raw, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)),
                       parse_float=untrusted.finite_float)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"manifest is not JSON: {e}") from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
        raise bad("not a SneppX manifest")
    if m.get("version") not in (1, 2, MANIFEST_VERSION, INCREMENTAL_VERSION):
        raise bad(f"manifest version {m.get('version')!r} is not supported (this reader: 1 to "
                  f"{INCREMENTAL_VERSION})")
    if m.get("step") != step:
        raise bad(f"manifest says step {m.get('step')!r}, the directory says {step}")
    shards = m.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, str) and s == os.path.basename(s) and s
                                               and not s.startswith(".") for s in shards):
        raise bad("manifest 'shards' must be a list of plain file names")
    if not isinstance(m.get("tensors"), list) or not isinstance(m.get("values"), list):
        raise bad("manifest 'tensors' and 'values' must be lists")
    if m["version"] >= 3:
        _check_sharding(m, bad)
    if m["version"] >= INCREMENTAL_VERSION:
        uses = m.get("uses")
        if not (isinstance(uses, list) and uses and all(type(u) is int and 0 <= u < step for u in uses)
                and uses == sorted(set(uses))):
            raise bad("manifest 'uses' must list the earlier steps it references, ascending, at least one")
        if len(uses) > MAX_USES:
            raise bad(f"manifest 'uses' lists {len(uses)} steps, more than {MAX_USES}")
        if not (type(m.get("chain")) is int and m["chain"] >= 1):
            raise bad("manifest 'chain' (saves since the last full one) must be an int >= 1")
    for t in m["tensors"]:
        key = "chunks" if m["version"] >= 3 else "pieces"
        try:
            path, dtype, shape, nbytes, pieces = t["path"], t["dtype"], t["shape"], t["nbytes"], t[key]
            ok = (isinstance(path, list) and path and all(isinstance(p, str) for p in path)
                  and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                  and isinstance(pieces, list) and format.tensor_nbytes(dtype, tuple(shape)) == nbytes)
        except (KeyError, TypeError, errors.SneppXError, ValueError):
            ok = False
        if not ok:
            raise bad(f"manifest tensor entry {str(t)[:200]} is malformed")
        if m["version"] >= 3:
            _check_chunks(t, len(shards), m["block_bytes"], m["version"], step, bad)
            continue
        covered = 0
        for p in pieces:
            if not (isinstance(p, dict) and p.get("start") == covered and isinstance(p.get("nbytes"), int)
                    and p["nbytes"] >= 0 and isinstance(p.get("entry"), str) and isinstance(p.get("crc32c"), int)
                    and isinstance(p.get("shard"), int) and 0 <= p["shard"] < len(shards)):
                raise bad(f"tensor {'/'.join(path)}: pieces are malformed or not contiguous")
            covered += p["nbytes"]
        if covered != nbytes:
            raise bad(f"tensor {'/'.join(path)}: pieces cover {covered} of {nbytes} bytes")
    if m["version"] >= INCREMENTAL_VERSION:
        files = references(m["tensors"])
        referenced = sorted({step for step, _ in files})
        if referenced != m["uses"]:
            raise bad(f"manifest 'uses' says {m['uses'][:20]}, its chunks reference {referenced[:20]}")
        if len(files) > len(shards) * len(referenced):  # each rank references its own file of each step
            raise bad(f"manifest references {len(files)} files of {len(referenced)} steps: at most one per shard "
                      "of each")
    elif m["version"] <= MANIFEST_VERSION and ("uses" in m or "chain" in m):
        raise bad(f"manifest version {m['version']} has 'uses' or 'chain': references need version 4")
    if m["version"] >= 2:
        stored = m.pop(CHECKSUM, None)
        if stored is None:
            raise bad("manifest has no checksum")
        content, whole = _canonical_with(m, stored)  # one encoding for both checks: a chain's manifest is large
        computed = f"crc32c:{_native.crc32c(content):08x}"
        if stored != computed:
            raise bad(f"manifest checksum mismatch: it says {str(stored)[:40]!r}, its content gives "
                      f"{computed!r} (the manifest was changed after it was written)")
        if whole != raw:
            raise bad("manifest bytes are not in canonical form (changed after they were written?)")
    return m


def _canonical_with(content: dict[str, Any], checksum: Any) -> tuple[bytes, bytes]:
    """(_canonical(content), _canonical(content with `checksum` added)), each top-level value encoded once:
    a canonical encoding is its members in key order, so the two differ by the checksum's member alone."""
    members = {key: f"{json.dumps(key)}:{_canonical_text(value)}" for key, value in content.items()}
    without = sorted(members)
    with_checksum = sorted({*members, CHECKSUM})
    members[CHECKSUM] = f"{json.dumps(CHECKSUM)}:{_canonical_text(checksum)}"
    return (("{" + ",".join(members[k] for k in without) + "}").encode(),
            ("{" + ",".join(members[k] for k in with_checksum) + "}").encode())


def _canonical_text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=False, separators=(",", ":"))


def _check_sharding(m: dict[str, Any], bad: Any) -> None:
    """Version 3's step-wide keys: who saved it (world size, generation) and the block size."""
    world, generation, block = m.get("world_size"), m.get("generation"), m.get("block_bytes")
    if not (type(world) is int and world == len(m["shards"]) >= 1 and type(generation) is int and generation >= 0):
        raise bad("manifest 'world_size' must equal the number of shards, and 'generation' be an int >= 0")
    if not (type(block) is int and MIN_BLOCK_BYTES <= block <= MAX_BLOCK_BYTES and block & (block - 1) == 0):
        raise bad(f"manifest 'block_bytes' must be a power of two in {MIN_BLOCK_BYTES}..{MAX_BLOCK_BYTES}")


def _check_chunks(tensor: dict[str, Any], shard_count: int, block_bytes: int, version: int, step: int,
                  bad: Any) -> None:
    """A version 3 or 4 tensor's chunks: well-formed, each with block checksums that combine to its CRC32C, and
    together covering the tensor exactly once; a reference (`from`, version 4) names an earlier step and a plain
    file name, and carries a BLAKE3 per block, so what it points at is checked as strongly as a signature would."""
    name = "/".join(tensor["path"])
    itemsize = format.tensor_nbytes(tensor["dtype"], ())
    keys = {"shard", "entry", "offset", "shape", "nbytes", "crc32c", "blocks", "digests"}
    if version >= INCREMENTAL_VERSION:
        keys.add("from")
    boxes = []
    combine = _native.crc32c_combine
    for c in tensor["chunks"]:
        if not (isinstance(c, dict) and type(c.get("shard")) is int and 0 <= c["shard"] < shard_count
                and isinstance(c.get("entry"), str) and _int_list(c.get("offset")) and _int_list(c.get("shape"))
                and len(c["offset"]) == len(c["shape"]) == len(tensor["shape"])
                and c.get("nbytes") == math.prod(c["shape"]) * itemsize and type(c.get("crc32c")) is int
                and isinstance(c.get("blocks"), str) and _HEX.match(c["blocks"])
                and (c.get("digests") is None or (isinstance(c["digests"], str) and _HEX.match(c["digests"])))
                and set(c) <= keys):
            raise bad(f"tensor {name}: chunk {str(c)[:200]} is malformed")
        if "from" in c and not _reference_ok(c, step):
            raise bad(f"tensor {name}: chunk {c['entry']!r} references {str(c['from'])[:80]}: a reference is "
                      "[an earlier step, a plain file name] and needs block digests")
        count = block_count(c["nbytes"], block_bytes)
        if len(c["blocks"]) != 8 * count or (c.get("digests") is not None and len(c["digests"]) != 64 * count):
            raise bad(f"tensor {name}: chunk {c['entry']!r} needs {count} block checksums")
        crcs = block_crcs(c)
        crc = 0
        for value in crcs[:-1]:
            crc = combine(crc, value, block_bytes)
        if crcs:
            crc = combine(crc, crcs[-1], c["nbytes"] - (len(crcs) - 1) * block_bytes)
        if crc != c["crc32c"]:
            raise bad(f"tensor {name}: the block checksums of chunk {c['entry']!r} don't make up its CRC32C")
        boxes.append(chunks.Box(tuple(c["offset"]), tuple(c["shape"])))
    problem = chunks.tiling_problem(tuple(tensor["shape"]), boxes)
    if problem is not None:
        raise bad(f"tensor {name}: chunks don't cover it exactly once: {problem}")


def _reference_ok(chunk: dict[str, Any], step: int) -> bool:
    ref = chunk["from"]
    return (isinstance(ref, list) and len(ref) == 2 and type(ref[0]) is int and 0 <= ref[0] < step
            and isinstance(ref[1], str) and storage.is_plain_name(ref[1]) and not ref[1].startswith(".")
            and ref[1] not in (storage.MANIFEST, storage.SIGNATURE, storage.COMMITTED)
            and isinstance(chunk.get("digests"), str))


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def reference(chunk: dict[str, Any]) -> tuple[int, str] | None:
    """(step, file) of an earlier step's file that holds a chunk's bytes (a version 4 reference), or None when
    the chunk is in its own step's shard."""
    ref = chunk.get("from")
    return None if ref is None else (ref[0], ref[1])


def references(tensors: list[dict[str, Any]]) -> set[tuple[int, str]]:
    """(step, file) of every earlier step's file the chunks of decoded (or about to be written) tensors reference."""
    return {(c["from"][0], c["from"][1]) for t in tensors for c in t.get("chunks", ()) if "from" in c}


def uses(manifest: dict[str, Any]) -> list[int]:
    """The earlier steps a decoded manifest references (what must be kept while it is)."""
    return list(manifest.get("uses") or [])


def parts_of(tensor: dict[str, Any]) -> list[dict[str, Any]]:
    """A decoded tensor's stored parts: its chunks (version 3) or its pieces (versions 1 and 2)."""
    return tensor["chunks"] if "chunks" in tensor else tensor["pieces"]


def block_count(nbytes: int, block_bytes: int) -> int:
    """How many checksum blocks a chunk of nbytes has (the last may be short; none when it is empty)."""
    return -(-nbytes // block_bytes)


def block_crcs(chunk: dict[str, Any]) -> list[int]:
    """A version 3 chunk's CRC32C per block."""
    raw = bytes.fromhex(chunk["blocks"])  # (decode_manifest checked it is 8 hex digits per block)
    return list(struct.unpack(f">{len(raw) // 4}I", raw))


def block_digests(chunk: dict[str, Any]) -> list[bytes] | None:
    """A version 3 chunk's BLAKE3 per block (signed steps), or None when it has none."""
    hexes = chunk.get("digests")
    return None if hexes is None else [bytes.fromhex(hexes[i:i + 64]) for i in range(0, len(hexes), 64)]


def entry_matches(entry: format.TensorEntry, chunk: dict[str, Any], tensor: dict[str, Any]) -> bool:
    """Whether a shard's table entry is the version 3 chunk the manifest says: its length, CRC32C, dtype and
    shape, and where it lies in the tensor (an entry without a placement is the whole tensor)."""
    shape = tuple(tensor["shape"])
    offset = entry.global_offset if entry.global_shape is not None else (0,) * len(shape)
    global_shape = entry.global_shape if entry.global_shape is not None else entry.shape
    return (entry.length == chunk["nbytes"] and entry.crc32c == chunk["crc32c"] and entry.dtype == tensor["dtype"]
            and list(entry.shape) == chunk["shape"] and list(offset or ()) == chunk["offset"]
            and tuple(global_shape) == shape)
