"""Ed25519 signatures over checkpoints: who made a checkpoint, and that no byte changed since.

CRC32C catches accidents, not attackers: anyone can recompute a CRC after editing a file. A checkpoint
that travels between clusters, buckets and teams is signed instead. What is signed is the exact table
bytes of the file (docs/FORMAT.md, "Signatures"): the table already names every tensor, its dtype, shape,
offset, the metadata, the config and a cryptographic digest of every tensor's bytes, so one Ed25519
signature over it binds all of them, and a signature moved to another checkpoint fails because that
checkpoint's table differs. Multi-file checkpoints sign their manifest.json (which lists each file's
digest) with a detached `manifest.sig` in the same block format.

Keys (keys.py) and digests (digests.py), which a signature binds, are modules of their own; every name they
define is still importable from here.

The pure parts (block encode/decode, what is signed, the decision whether a signature is acceptable) are
separate from the file-level entry points (`sign_checkpoint`, `verify_checkpoint`, `sign_manifest`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519

from SneppX_ALG import errors, storage
from SneppX_ALG.checkpoint.digests import (  # noqa: F401 - re-exported: digests.py's names as they were here
    ALL_THREADS,
    DIGEST_ALGORITHM,
    StreamingDigest,
    block_digest,
    digest_of,
    file_digest,
    new_digest,
    parse_digest,
    readback_digest,
    start_digest_check,
    write_threads,
)
from SneppX_ALG.checkpoint.keys import (  # noqa: F401 - re-exported: keys.py's names as they were here
    KEY_ID_BYTES,
    generate_keypair,
    key_id,
    key_id_hex,
    load_private_key,
    load_public_key,
    public_key_from_bytes,
    save_private_key,
    save_public_key,
    trusted_key_set,
)

# --- the signature block (docs/FORMAT.md, "Signatures") ------------------------------------------------

BLOCK_MAGIC = b"SNPX-SIG"
BLOCK_VERSION = 1
ALG_ED25519 = 1
MAX_SIGNATURES = 16
_BLOCK_HEAD = struct.Struct("<8sHHI")       # magic, block version, count, reserved
_BLOCK_ENTRY = struct.Struct("<HHI32s64s")  # algorithm, reserved, reserved, key id, signature
assert _BLOCK_HEAD.size == 16 and _BLOCK_ENTRY.size == 104

# Domain separation: a signature over a table can't be passed off as one over a manifest, or the reverse.
TABLE_DOMAIN = b"SNPX table signature v1\x00"
MANIFEST_DOMAIN = b"SNPX manifest signature v1\x00"


@dataclass(frozen=True)
class SignatureEntry:
    algorithm: int
    key_id: bytes
    signature: bytes


def encode_block(entries: list[SignatureEntry]) -> bytes:
    if not 1 <= len(entries) <= MAX_SIGNATURES:
        raise ValueError(f"a signature block holds 1..{MAX_SIGNATURES} signatures, not {len(entries)}")
    out = [_BLOCK_HEAD.pack(BLOCK_MAGIC, BLOCK_VERSION, len(entries), 0)]
    out += [_BLOCK_ENTRY.pack(e.algorithm, 0, 0, e.key_id, e.signature) for e in entries]
    return b"".join(out)


def decode_block(raw: bytes, *, path: str | None = None) -> list[SignatureEntry]:
    """Strict decode: exact length, known version and algorithm, zero reserved fields, distinct key ids."""
    if len(raw) < _BLOCK_HEAD.size:
        raise errors.BadSignatureError(f"signature block is {len(raw)} bytes, shorter than its 16-byte head",
                                       path=path)
    magic, version, count, reserved = _BLOCK_HEAD.unpack_from(raw)
    if magic != BLOCK_MAGIC:
        raise errors.BadSignatureError(f"signature block has bad magic {magic!r}", path=path)
    if version != BLOCK_VERSION:
        raise errors.BadSignatureError(f"signature block version {version} is not supported (expected "
                                       f"{BLOCK_VERSION}); upgrade SneppX", path=path)
    if not 1 <= count <= MAX_SIGNATURES or reserved:
        raise errors.BadSignatureError(
            f"signature block head is malformed (count {count}, reserved {reserved})", path=path)
    if len(raw) != _BLOCK_HEAD.size + count * _BLOCK_ENTRY.size:
        raise errors.BadSignatureError(
            f"signature block is {len(raw)} bytes, expected {_BLOCK_HEAD.size + count * _BLOCK_ENTRY.size} "
            f"for {count} signature(s)", path=path)
    entries = []
    for i in range(count):
        alg, r1, r2, kid, sig = _BLOCK_ENTRY.unpack_from(raw, _BLOCK_HEAD.size + i * _BLOCK_ENTRY.size)
        if alg != ALG_ED25519 or r1 or r2:
            raise errors.BadSignatureError(
                f"signature #{i}: unknown algorithm {alg} or non-zero reserved field", path=path)
        entries.append(SignatureEntry(alg, kid, sig))
    if len({e.key_id for e in entries}) != len(entries):
        raise errors.BadSignatureError("signature block names the same key twice", path=path)
    return entries


def signed_message(domain: bytes, body: bytes, entry_key_id: bytes, algorithm: int = ALG_ED25519) -> bytes:
    """What each signature covers: domain, algorithm, key id, then the length-prefixed body."""
    return domain + struct.pack("<H", algorithm) + entry_key_id + struct.pack("<Q", len(body)) + body


def _sign(domain: bytes, body: bytes, private_key: ed25519.Ed25519PrivateKey) -> bytes:
    if not isinstance(private_key, ed25519.Ed25519PrivateKey):
        raise errors.KeyFormatError(f"signing needs an Ed25519 private key, got {type(private_key).__name__}")
    kid = key_id(private_key)
    signature = private_key.sign(signed_message(domain, body, kid))
    return encode_block([SignatureEntry(ALG_ED25519, kid, signature)])


def check_signature(domain: bytes, body: bytes, block: bytes, trusted_keys: Any, *, what: str = "table",
                    path: str | None = None) -> bytes:
    """Raises the typed error for the first failed check; returns the id of the trusted key that signed.

    Checks, in order: there is a block; it decodes; at least one signature is by a trusted key; every
    signature by a trusted key verifies over (domain, key id, body). Signatures by other keys are ignored.
    """
    keys = trusted_keys if isinstance(trusted_keys, dict) else trusted_key_set(trusted_keys)
    if not block:
        raise errors.MissingSignatureError(f"the {what} is not signed, and a signature is required",
                                           path=path)
    entries = decode_block(block, path=path)
    if not keys:
        raise errors.UntrustedKeyError("no trusted keys were given, so no signature can be accepted",
                                       path=path)
    trusted = [e for e in entries if e.key_id in keys]
    if not trusted:
        ids = ", ".join(e.key_id.hex()[:16] for e in entries)
        raise errors.UntrustedKeyError(
            f"the {what} is signed by key {ids}, which is not among the {len(keys)} trusted key(s)",
            path=path)
    for e in trusted:
        try:
            keys[e.key_id].verify(e.signature, signed_message(domain, body, e.key_id))
        except InvalidSignature:
            raise errors.BadSignatureError(
                f"the Ed25519 signature by key {e.key_id.hex()[:16]} does not verify: the {what} changed "
                "after it was signed, or the signature belongs to another checkpoint", path=path) from None
    return trusted[0].key_id


def signature_block(table_bytes: bytes, private_key: ed25519.Ed25519PrivateKey) -> bytes:
    """The block the writer puts after the table. Refuses a table with a tensor that has no digest."""
    check_digest_coverage(_tensor_entries(table_bytes))
    return _sign(TABLE_DOMAIN, table_bytes, private_key)


def _tensor_entries(table_bytes: bytes) -> list[dict[str, Any]]:
    try:
        doc = json.loads(table_bytes)
        tensors = doc["tensors"]
        if not isinstance(tensors, list) or not all(isinstance(t, dict) for t in tensors):
            raise TypeError("tensors is not a list of objects")
    except (ValueError, TypeError, KeyError) as e:
        raise errors.CorruptTableError(f"table can't be parsed for signing: {e}") from None
    return tensors


def check_digest_coverage(tensors: Iterable[Any], path: str | None = None) -> None:
    """Every tensor must carry a well-formed digest, or the signature would not cover its bytes."""
    for t in tensors:
        digest = t.get("digest") if isinstance(t, dict) else t.digest
        name = t.get("name") if isinstance(t, dict) else t.name
        if digest is None:
            raise errors.DigestMismatchError(
                f"tensor {name!r} carries no digest, so a signature would not cover its bytes", path=path)
        try:
            parse_digest(digest)
        except errors.DigestMismatchError as e:
            raise errors.DigestMismatchError(f"tensor {name!r}: {e.reason}", path=path) from None


# --- multi-file checkpoints: a signed manifest ---------------------------------------------------------

def manifest_signature(manifest_bytes: bytes, private_key: ed25519.Ed25519PrivateKey) -> bytes:
    """The detached `manifest.sig` for these exact manifest bytes (also for an S3 prefix: store it beside)."""
    manifest_files(manifest_bytes)
    return _sign(MANIFEST_DOMAIN, manifest_bytes, private_key)


def manifest_files(manifest_bytes: bytes, path: str | None = None) -> dict[str, dict[str, Any]]:
    """The manifest's "files" object, each entry checked: a safe relative path, a size and a digest."""
    try:
        doc = json.loads(manifest_bytes)
    except (ValueError, RecursionError) as e:
        raise errors.CorruptTableError(f"manifest is not valid JSON: {e}", path=path) from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict):
        raise errors.CorruptTableError('manifest has no "files" digests: the step was saved without them; '
                                       'save it with CheckpointCoordinator(..., signing_key=...) to sign it',
                                       path=path)
    for name, info in files.items():
        parts = name.split("/")
        if not name or name.startswith("/") or "\\" in name or "\x00" in name or any(
                p in ("", ".", "..") for p in parts) or name in (storage.MANIFEST, storage.SIGNATURE):
            raise errors.CorruptTableError(f"manifest lists an unsafe or reserved path {name!r}", path=path)
        if not isinstance(info, dict) or type(info.get("size")) is not int or info["size"] < 0:
            raise errors.CorruptTableError(f"manifest entry {name!r} needs an integer size", path=path)
        try:
            parse_digest(info.get("digest"))  # type: ignore[arg-type]
        except errors.DigestMismatchError as e:
            raise errors.DigestMismatchError(f"manifest entry {name!r}: {e.reason}", path=path) from None
    return files


def check_manifest_signature(manifest_bytes: bytes, signature: bytes, trusted_keys: Any, *,
                             path: str | None = None) -> bytes:
    """Checks a detached manifest signature; returns the signer's key id (typed error otherwise)."""
    return check_signature(MANIFEST_DOMAIN, manifest_bytes, signature, trusted_keys, what="manifest",
                           path=path)
