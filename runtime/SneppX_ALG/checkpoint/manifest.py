"""The step manifest (`manifest.json`): encode, decode and check it. Pure: no I/O.

Why here and not in the coordinator: a step directory is a multi-file checkpoint (docs/FORMAT.md,
"Multi-file checkpoints"), and validating one needs the manifest's rules; the coordinator only builds
the manifest's contents.

Integrity: a manifest carries `"checksum": "crc32c:<8 hex>"`, the CRC32C of its canonical encoding without
that key, and its bytes must be that canonical encoding, so every byte of it is covered whether the step is
signed or not (docs/FORMAT.md, "Step manifests: the checksum"). Version 1 manifests, written before the
checksum existed, are still read, with no checksum to check.
"""

from __future__ import annotations

import json
import os
from typing import Any

from SneppX_ALG import _native, errors, storage
from SneppX_ALG.checkpoint import format

MANIFEST_FORMAT = "sneppx.manifest"
MANIFEST_VERSION = 2
CHECKSUM = "checksum"


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, allow_nan=False, separators=(",", ":")).encode()


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """`crc32c:<8 hex>` of the canonical encoding of `manifest` without its checksum."""
    content = {k: v for k, v in manifest.items() if k != CHECKSUM}
    return f"crc32c:{_native.crc32c(_canonical(content)):08x}"


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    """The manifest's bytes: canonical JSON (sorted keys, no spaces, ASCII) with its checksum added."""
    content = {k: v for k, v in manifest.items() if k != CHECKSUM}
    return _canonical({**content, CHECKSUM: manifest_checksum(content)})


def decode_manifest(raw: bytes, *, step: int, where: str) -> dict[str, Any]:
    """Parses and checks a manifest (its schema, then its checksum); returns its content, without the
    checksum. ManifestError with what is wrong."""
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
    if m.get("version") not in (1, MANIFEST_VERSION):
        raise bad(f"manifest version {m.get('version')!r} is not supported (this reader: 1 to "
                  f"{MANIFEST_VERSION})")
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
    if m["version"] >= 2:
        stored = m.pop(CHECKSUM, None)
        if stored is None:
            raise bad("manifest has no checksum")
        if stored != manifest_checksum(m):
            raise bad(f"manifest checksum mismatch: it says {str(stored)[:40]!r}, its content gives "
                      f"{manifest_checksum(m)!r} (the manifest was changed after it was written)")
        if _canonical({**m, CHECKSUM: stored}) != raw:
            raise bad("manifest bytes are not in canonical form (changed after they were written?)")
    return m
