"""Verifying signed checkpoints against trusted keys, and signing existing ones.

Why apart from signing.py: signing.py (with keys.py and digests.py) is the pure cryptography (keys, digests,
signature blocks, what is signed); this module applies it to files on disk through the reader and writer, in
the order of docs/FORMAT.md "Verifying": the signature before any data, then every byte against its digest.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ed25519

from SneppX_ALG import _fs, errors, storage
from SneppX_ALG.checkpoint import file, format, reshard, signing
from SneppX_ALG.checkpoint import manifest as manifest_codec


@dataclass(frozen=True)
class Verified:
    """What a successful verification proved."""

    path: str
    key_id: bytes
    metadata: dict[str, str]
    config: Any


def check_checkpoint(path: str | os.PathLike[str], trusted_keys: Any, *,
                     progress: Callable[[int, int], None] | None = None) -> Verified:
    """Verifies a checkpoint file or signed directory; raises the typed error of the first failed check.

    File: header, table and signature CRCs, then the signature over the raw table bytes (before the table is
    parsed or any data is read, so a forged file costs one read of its table), then the table's layout and
    digest coverage (all in CheckpointReader), then every tensor's CRC32C, padding and digest
    (file.check_tensor). `progress(done, total)` is called as a file's bytes are checked.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return check_manifest(path, trusted_keys)
    keys = signing.trusted_key_set(trusted_keys)
    with file.CheckpointReader(path, verify=False, trusted_keys=keys) as reader:
        assert reader.signer is not None
        for entry in reader.table.tensors:
            problems = file.check_tensor(reader, entry, digest=True)
            if problems:
                raise problems[0]
            if progress is not None:
                progress(entry.offset + entry.length, reader.header.table_offset)
        return Verified(path, reader.signer, dict(reader.metadata), reader.config)


def verify_checkpoint(path: str | os.PathLike[str], trusted_keys: Any, *,
                      progress: Callable[[int, int], None] | None = None) -> tuple[bool, list[str]]:
    """(True, []) when a trusted key signed the checkpoint and every byte matches; else (False, [why]).

    Never raises for a bad or missing file; each message starts with the name of the failed check.
    """
    try:
        check_checkpoint(path, trusted_keys, progress=progress)
    except errors.SneppXError as e:
        return False, [f"{type(e).__name__}: {e}"]
    except OSError as e:
        return False, [f"StorageError: {os.fspath(path)}: can't read: {e.strerror or e}"]
    return True, []


def sign_checkpoint(path: str | os.PathLike[str], private_key: ed25519.Ed25519PrivateKey) -> bytes:
    """Signs an existing checkpoint file (or a checkpoint directory's manifest); returns the key id.

    The file is checked (CRC32C of every tensor and padding) and rewritten next to itself with a digest per
    tensor, the new table and a signature block, then renamed over the original after fsync: a crash leaves
    the old file or the signed one. The data section is copied byte for byte; an existing signature is
    replaced. A digest already in the table must match the data, or signing is refused.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return sign_manifest(path, private_key)
    if not isinstance(private_key, ed25519.Ed25519PrivateKey):
        raise errors.KeyFormatError(f"signing needs an Ed25519 private key, got {type(private_key).__name__}")
    with file.CheckpointReader(path, verify=False) as reader:
        writer = file.CheckpointWriter(path, reader.metadata, reader.config, signing_key=private_key)
        try:
            for entry in reader.table.tensors:
                alg = signing.parse_digest(entry.digest)[0] if entry.digest is not None else signing.DIGEST_ALGORITHM
                # one pass: the copy computes the CRC32C and (on the worker) the digest of the same bytes
                copied = writer._append_stored(entry, reader.raw(entry.name), digest_algorithm=alg)
                digest_problem = (None if entry.digest is None or entry.digest == copied.digest
                                  else "does not match the digest already in its table")
                problems = file.tensor_errors(entry, copied.crc32c, reader.padding_is_zero(entry),
                                                    digest_problem, path=path)
                if problems:
                    raise type(problems[0])(f"{problems[0].reason}; refusing to sign", path=path)
        except BaseException:
            writer.abort()
            raise
    writer.commit()  # table with the digests, signature block, header; fsync, rename over `path`
    return signing.key_id(private_key)


def _read_bounded(path: str, limit: int) -> bytes | None:
    data = _fs.read_small(path, limit)
    if data is not None and len(data) > limit:
        raise errors.LimitExceededError(f"{os.path.basename(path)} is larger than {limit} bytes", path=path)
    return data


def sign_manifest(directory: str | os.PathLike[str], private_key: ed25519.Ed25519PrivateKey) -> bytes:
    """Writes `manifest.sig` next to the directory's manifest.json (tmp, fsync, rename); returns the key id.

    Every listed file is checked against its size and digest first: a signature vouches for the bytes.
    """
    directory = os.fspath(directory)
    manifest_path = os.path.join(directory, storage.MANIFEST)
    manifest = _read_bounded(manifest_path, storage.MAX_MANIFEST_BYTES)
    if manifest is None:
        raise errors.CheckpointNotFoundError(f"{manifest_path} not found: nothing to sign",
                                             path=manifest_path)
    _check_manifest_files(directory, signing.manifest_files(manifest, manifest_path))
    _fs.write_durable(os.path.join(directory, storage.SIGNATURE), signing.manifest_signature(manifest, private_key))
    return signing.key_id(private_key)


def _check_manifest_files(directory: str, files: dict[str, dict[str, Any]]) -> None:
    root = os.path.realpath(directory)
    for name, info in files.items():
        target = os.path.realpath(os.path.join(root, name))
        if os.path.commonpath([root, target]) != root:
            raise errors.CorruptTableError(f"manifest entry {name!r} resolves outside the checkpoint",
                                           path=directory)
        try:
            size = os.stat(target).st_size
        except FileNotFoundError:
            raise errors.TruncatedCheckpointError(f"file {name!r} listed in the manifest is missing",
                                                  path=directory) from None
        if size != info["size"]:
            kind = errors.TruncatedCheckpointError if size < info["size"] else errors.CorruptHeaderError
            raise kind(f"file {name!r} is {size} bytes, the manifest says {info['size']}", path=directory)
        alg, _ = signing.parse_digest(info["digest"])
        if signing.file_digest(target, alg) != info["digest"]:
            raise errors.DigestMismatchError(f"file {name!r} does not match its {alg} digest in the manifest",
                                             path=directory)


def check_manifest_files(directory: str | os.PathLike[str], manifest_bytes: bytes, *,
                         skip: Collection[str] = ()) -> dict[str, dict[str, Any]]:
    """Every file these manifest bytes list, checked in `directory` against its size and digest; returns the
    "files" object. For callers that already hold (and checked the signature of) the manifest bytes, so the
    bytes they go on to use are the bytes that were verified. `skip`: files the caller checks itself (a
    step's shards, which validate.check_step hashes as it reads them)."""
    directory = os.fspath(directory)
    files = signing.manifest_files(manifest_bytes, directory)
    _check_manifest_files(directory, {name: info for name, info in files.items() if name not in skip})
    return files


def check_manifest(directory: str | os.PathLike[str], trusted_keys: Any) -> Verified:
    """Verifies a signed checkpoint directory: manifest.sig over manifest.json, then each listed file."""
    directory = os.fspath(directory)
    manifest_path = os.path.join(directory, storage.MANIFEST)
    manifest = _read_bounded(manifest_path, storage.MAX_MANIFEST_BYTES)
    if manifest is None:
        raise errors.CheckpointNotFoundError(f"{manifest_path} not found", path=directory)
    signature = _read_bounded(os.path.join(directory, storage.SIGNATURE), format.MAX_SIGNATURE_BYTES)
    signer = signing.check_manifest_signature(manifest, signature or b"", trusted_keys, path=directory)
    files = signing.manifest_files(manifest, directory)
    _check_manifest_files(directory, files)
    _check_references(directory, manifest)
    doc = json.loads(manifest)
    metadata = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    return Verified(directory, signer, {str(k): str(v) for k, v in metadata.items()}, doc.get("config"))


def _check_references(directory: str, manifest_bytes: bytes) -> None:
    """The blocks an incremental step (a step directory with a version 4 manifest) reads from earlier steps'
    files beside it, each against its BLAKE3 in the signed manifest: the step's bytes are those too."""
    step = storage.parse_step_name(os.path.basename(os.path.normpath(directory)))
    if step is None:
        return
    manifest = manifest_codec.decode_manifest(manifest_bytes, step=step, where=directory)
    if not manifest_codec.uses(manifest):
        return
    problems = reshard.read_references(sibling_steps(directory), manifest, None, signed=True)
    if problems:
        raise errors.DigestMismatchError(f"{problems[0]} (a referenced block is part of this step)", path=directory)


def sibling_steps(local: str) -> reshard.OpenStep:
    """Opens the earlier steps an incremental step references: the step directories next to it (a local root;
    an S3 step is fetched with the files it references, laid out the same way)."""
    root = os.path.dirname(os.path.normpath(local))

    @contextlib.contextmanager
    def open_step(step: int) -> Iterator[storage.StepReader]:
        path = os.path.join(root, storage.step_name(step))
        if not os.path.isdir(path):
            raise errors.CheckpointNotFoundError(f"step {step} is gone", path=path)
        reader = storage.LocalStepReader(path)
        try:
            yield reader
        finally:
            reader.close()

    return open_step
