"""Ed25519 signatures over checkpoints: who made a checkpoint, and that no byte changed since.

CRC32C catches accidents, not attackers: anyone can recompute a CRC after editing a file. A checkpoint
that travels between clusters, buckets and teams is signed instead. What is signed is the exact table
bytes of the file (docs/FORMAT.md, "Signatures"): the table already names every tensor, its dtype, shape,
offset, the metadata, the config and a cryptographic digest of every tensor's bytes, so one Ed25519
signature over it binds all of them, and a signature moved to another checkpoint fails because that
checkpoint's table differs. Multi-file checkpoints sign their manifest.json (which lists each file's
digest) with a detached `manifest.sig` in the same block format.

Digests are BLAKE3 (measured in bench/signing.py and docs/FORMAT.md: the only candidate faster than the
disk on this class of machine) and are computed on a background thread while the writer streams the same
bytes to disk, so signing costs little more than the hash work that the second core absorbs.

The pure parts (block encode/decode, what is signed, the decision whether a signature is acceptable) are
separate from the file-level entry points (`sign_checkpoint`, `verify_checkpoint`, `sign_manifest`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import os
import re
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import blake3
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from SneppX_ALG import _native, errors, storage

# --- digests -------------------------------------------------------------------------------------------

DIGEST_ALGORITHM = "blake3"
# Verification also accepts SHA-256 so that digests made by other tools (sha256sum, S3 checksums) verify.
_HASHERS: dict[str, Any] = {
    "blake3": blake3.blake3,
    "sha256": hashlib.sha256,
}
_DIGEST_HEX_LENGTH = {"blake3": 64, "sha256": 64}
_DIGEST_RE = re.compile(r"^([a-z0-9]+):([0-9a-f]+)$")

ALL_THREADS = blake3.blake3.AUTO
# Buffers below this are hashed inline: handing them to the worker costs more than hashing them.
_INLINE_BYTES = 1 << 20
# Large buffers are fed to the hasher in pieces of this size, so hashing starts before the copy ends.
_PIECE = 64 << 20
# At most this many buffers per digest wait for the worker, so a caller feeding fresh buffers faster
# than they can be hashed keeps bounded memory.
_MAX_QUEUED = 2

_worker_lock = threading.Lock()
_worker: concurrent.futures.ThreadPoolExecutor | None = None


def _forget_worker_after_fork() -> None:
    # A forked child has no worker thread (only the forking thread survives) and maybe a held lock.
    global _worker, _worker_lock
    _worker, _worker_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_worker_after_fork)


def _hash_worker() -> concurrent.futures.ThreadPoolExecutor:
    """One hashing thread per process: being one, it keeps each digest's updates in order."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sneppx-digest")
        return _worker


class StreamingDigest:
    """A hash whose large updates run on a background thread, overlapping the caller's own work.

    `update(buffer)` returns at once for large buffers: the buffer must stay unchanged until
    `hexdigest()` returns (the writer passes views of the tensor being written, which it holds until then).
    Hashing releases the GIL, so a write and its digest really run on two cores.
    """

    def __init__(self, name: str = DIGEST_ALGORITHM, *, threads: int = 1):
        if name not in _HASHERS:
            raise ValueError(f"unsupported digest algorithm {name!r}; supported: {', '.join(_HASHERS)}")
        self.name = name
        self._hasher = blake3.blake3(max_threads=threads) if name == "blake3" else _HASHERS[name]()
        self._queued: collections.deque[concurrent.futures.Future[Any]] = collections.deque()

    def update(self, data: Any) -> None:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        while self._queued and self._queued[0].done():
            self._queued.popleft().result()
        if not self._queued and len(view) < _INLINE_BYTES:
            self._hasher.update(view)
            return
        if len(self._queued) >= _MAX_QUEUED:
            self._queued.popleft().result()
        self._queued.append(_hash_worker().submit(self._hasher.update, view))

    def hexdigest(self) -> str:
        while self._queued:
            self._queued.popleft().result()
        return str(self._hasher.hexdigest())


def write_threads() -> int:
    """Hashing threads for a save: every core. A tensor's digest is awaited before the writer moves on (the
    caller may change the tensor once write() returns), so the hash of each tensor is on the save's critical
    path: split over all cores it ends sooner, and where the writer's own threads are busy it only shares
    them. Measured on tmpfs with two vCPUs: signed saves 1.10-1.18x an unsigned one with two BLAKE3 threads,
    1.08-1.27x with one (docs/BENCHMARKS.md, "Signing")."""
    return os.cpu_count() or 1


def block_digest(data: Any) -> str:
    """The BLAKE3 of one checksum block of a chunk, as 64 lowercase hex digits (a signed step lists one per
    block, so a load that reads part of a chunk still checks every byte it reads against the signature)."""
    return blake3.blake3(data).hexdigest()


def new_digest(name: str = DIGEST_ALGORITHM, *, threads: int | None = None) -> StreamingDigest:
    """The digest the writer feeds every tensor's bytes to; store as f"{d.name}:{d.hexdigest()}".

    `threads` defaults to write_threads(); checks that only read pass `threads=ALL_THREADS` (BLAKE3 then
    splits each large piece across every core).
    """
    return StreamingDigest(name, threads=write_threads() if threads is None else threads)


def parse_digest(value: str) -> tuple[str, str]:
    """'<alg>:<hex>' -> (alg, hex); DigestMismatchError for an unknown algorithm or a malformed value."""
    match = _DIGEST_RE.match(value) if isinstance(value, str) else None
    if match is None:
        raise errors.DigestMismatchError(f"digest {value!r} is not '<algorithm>:<lowercase hex>'")
    alg, hexdigest = match.groups()
    if alg not in _HASHERS:
        raise errors.DigestMismatchError(
            f"digest algorithm {alg!r} is not supported (supported: {', '.join(_HASHERS)})")
    if len(hexdigest) != _DIGEST_HEX_LENGTH[alg]:
        raise errors.DigestMismatchError(f"{alg} digest has {len(hexdigest)} hex digits, expected "
                                         f"{_DIGEST_HEX_LENGTH[alg]}")
    return alg, hexdigest


def digest_of(data: Any, name: str = DIGEST_ALGORITHM, *, threads: int | None = None) -> str:
    """'<alg>:<hex>' of a buffer (large buffers are hashed in pieces on the worker thread)."""
    digest = new_digest(name, threads=threads)
    view = memoryview(data).cast("B") if memoryview(data).format != "B" else memoryview(data)
    for start in range(0, len(view), _PIECE):
        digest.update(view[start:start + _PIECE])
    return f"{digest.name}:{digest.hexdigest()}"


def start_digest_check(data: Any, expected: str) -> Callable[[], str | None]:
    """Starts hashing `data` on the worker; the returned function waits and says what is wrong, or None.

    Lets a caller compute the CRC32C of the same bytes while the digest runs (validate, verify).
    """
    try:
        alg, _ = parse_digest(expected)
    except errors.DigestMismatchError as e:
        reason = e.reason
        return lambda: reason
    digest = new_digest(alg, threads=ALL_THREADS)
    view = memoryview(data)
    for start in range(0, len(view), _PIECE):
        digest.update(view[start:start + _PIECE])

    def finish() -> str | None:
        if f"{alg}:{digest.hexdigest()}" != expected:
            return f"does not match its signed {alg} digest"
        return None

    return finish


# A file is read in pieces of this size into a ring of three reused buffers: memory stays bounded (a memory
# map would count every page of the file in the process's RSS) and the next piece is read while the hashing
# thread hashes the previous one.
_READBACK_PIECE = 8 << 20


def file_digest(path: str | os.PathLike[str], name: str = DIGEST_ALGORITHM, *, threads: int = ALL_THREADS,
                drop_cache: bool = False) -> str:
    """'<alg>:<hex>' of a whole file (for manifests of multi-file checkpoints), read with bounded memory.

    `threads`: every core by default (a verify has nothing else to do); a background writer passes fewer so
    that the training loop keeps its cores. `drop_cache`: drop the file from the page cache afterwards, for
    a writer that hashes what it just wrote without growing its footprint (a verify keeps it cached for
    the load that follows).
    """
    digest = new_digest(name, threads=threads)
    ring = [bytearray(_READBACK_PIECE) for _ in range(3)]  # update() keeps at most 2 pieces queued
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        offset = pieces = 0
        while True:
            buffer = ring[pieces % 3]
            count = os.preadv(fd, [buffer], offset)
            if count == 0:
                break
            digest.update(memoryview(buffer)[:count])
            offset, pieces = offset + count, pieces + 1
        value = f"{digest.name}:{digest.hexdigest()}"
        if drop_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return value
    finally:
        os.close(fd)


def readback_digest(path: str | os.PathLike[str], name: str = DIGEST_ALGORITHM, *, threads: int = 1) -> str:
    """file_digest of a file just written, dropped from the page cache afterwards (the coordinator's
    background writer hashes each shard it wrote this way)."""
    return file_digest(path, name, threads=threads, drop_cache=True)


# --- keys ----------------------------------------------------------------------------------------------

KEY_ID_BYTES = 32


def generate_keypair() -> tuple[ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey]:
    """A new Ed25519 key pair (private, public)."""
    private = ed25519.Ed25519PrivateKey.generate()
    return private, private.public_key()


def key_id(key: ed25519.Ed25519PublicKey | ed25519.Ed25519PrivateKey) -> bytes:
    """SHA-256 of the raw 32-byte public key: names the key in a signature block without revealing more."""
    public = key.public_key() if isinstance(key, ed25519.Ed25519PrivateKey) else key
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).digest()


def key_id_hex(key: ed25519.Ed25519PublicKey | ed25519.Ed25519PrivateKey) -> str:
    return key_id(key).hex()


def _write_new_file(path: str, data: bytes, mode: int) -> None:
    """Creates `path` (never overwrites: losing a private key is not recoverable) and fsyncs it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except FileExistsError:
        raise errors.StorageError(f"{path} already exists; refusing to overwrite a key", path=path) from None
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    _native.fsync_path(os.path.dirname(os.path.abspath(path)))


def save_private_key(path: str | os.PathLike[str], key: ed25519.Ed25519PrivateKey,
                     password: bytes | None = None) -> None:
    """PKCS#8 PEM, mode 0600, encrypted when a password is given. Refuses to overwrite an existing file."""
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    _write_new_file(os.fspath(path), pem, 0o600)


def save_public_key(path: str | os.PathLike[str], key: ed25519.Ed25519PublicKey) -> None:
    """SubjectPublicKeyInfo PEM (what `openssl pkey -pubout` writes)."""
    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    _write_new_file(os.fspath(path), pem, 0o644)


def _read_key_file(path: str | os.PathLike[str]) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 16)
    except FileNotFoundError:
        raise errors.KeyFormatError(f"key file {os.fspath(path)} not found") from None
    except IsADirectoryError:
        raise errors.KeyFormatError(f"key file {os.fspath(path)} is a directory") from None
    return data


def load_private_key(path: str | os.PathLike[str],
                     password: bytes | None = None) -> ed25519.Ed25519PrivateKey:
    """An Ed25519 private key from a PEM file; KeyFormatError for anything else."""
    try:
        key = serialization.load_pem_private_key(_read_key_file(path), password=password)
    except (ValueError, TypeError) as e:
        raise errors.KeyFormatError(f"{os.fspath(path)}: not a readable PEM private key ({e})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise errors.KeyFormatError(f"{os.fspath(path)}: a {type(key).__name__}, not an Ed25519 key")
    return key


def public_key_from_bytes(data: bytes, *, source: str = "key") -> ed25519.Ed25519PublicKey:
    """An Ed25519 public key from PEM (public or private) or the raw 32 bytes."""
    if len(data) == 32 and not data.startswith(b"-----"):
        return ed25519.Ed25519PublicKey.from_public_bytes(data)
    try:
        key: Any = serialization.load_pem_public_key(data)
    except ValueError:
        try:
            key = serialization.load_pem_private_key(data, password=None).public_key()
        except (ValueError, TypeError) as e:
            raise errors.KeyFormatError(f"{source}: not a PEM Ed25519 public key ({e})") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise errors.KeyFormatError(f"{source}: a {type(key).__name__}, not an Ed25519 key")
    return key


def load_public_key(path: str | os.PathLike[str]) -> ed25519.Ed25519PublicKey:
    """An Ed25519 public key from a PEM file (a private key file gives its public half)."""
    return public_key_from_bytes(_read_key_file(path), source=os.fspath(path))


def trusted_key_set(trusted_keys: Any) -> dict[bytes, ed25519.Ed25519PublicKey]:
    """key id -> public key: from keys, PEM paths, PEM or raw bytes (one or an iterable)."""
    if trusted_keys is None:
        return {}
    items: Iterable[Any]
    single = (ed25519.Ed25519PublicKey, ed25519.Ed25519PrivateKey, str, bytes, os.PathLike)
    if isinstance(trusted_keys, single):
        items = [trusted_keys]
    elif isinstance(trusted_keys, dict):
        items = trusted_keys.values()
    else:
        items = trusted_keys
    keys: dict[bytes, ed25519.Ed25519PublicKey] = {}
    for item in items:
        if isinstance(item, ed25519.Ed25519PrivateKey):
            public = item.public_key()
        elif isinstance(item, ed25519.Ed25519PublicKey):
            public = item
        elif isinstance(item, bytes):
            public = public_key_from_bytes(item)
        elif isinstance(item, (str, os.PathLike)):
            public = load_public_key(item)
        else:
            raise errors.KeyFormatError(f"can't use a {type(item).__name__} as a trusted key")
        keys[key_id(public)] = public
    return keys


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
