"""Is this checkpoint whole and authentic? One entry point for files and step directories.

Why a module of its own: validation sits on top of everything else in the checkpoint layer (the file
reader, signatures, digests, the step manifest), and both `validate_checkpoint` (a user pointing at a file
or a step directory) and the coordinator (deciding which step is `latest()`) must apply exactly the same
checks in the same order. Nothing here raises for a bad checkpoint; it reports what is wrong.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from SneppX_ALG import errors, storage
from SneppX_ALG.checkpoint import file, format, signing, verify
from SneppX_ALG.checkpoint import manifest as manifest_codec


def validate_checkpoint(path: str | os.PathLike[str], trusted_keys: Any = None, *,
                        progress: Callable[[int, int], None] | None = None) -> tuple[bool, list[str]]:
    """Checks every byte of a checkpoint without loading it: (True, []) or (False, [what is wrong, ...]).

    Never raises for a bad file (missing, empty, garbage, truncated, corrupt). With `trusted_keys`, the
    checks are signing.verify_checkpoint's, in the order of docs/FORMAT.md "Verifying": the signature before
    any tensor data is read, then every tensor's CRC32C, padding and digest; it stops at the first failure.
    `path` may also be a CheckpointCoordinator step directory (`<root>/step-000001000`), checked as the
    coordinator checks it (manifest, every shard, and with `trusted_keys` manifest.sig and each digest).
    `progress(done, total)` is called as bytes of a file are checked.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        step = storage.parse_step_name(os.path.basename(os.path.normpath(path)))
        if step is not None:
            return _validate_step(path, step, trusted_keys)
    if trusted_keys is not None:
        return verify.verify_checkpoint(path, trusted_keys, progress=progress)
    try:
        reader = file.CheckpointReader(path, verify=False)
    except errors.SneppXError as e:
        return False, [str(e)]
    except OSError as e:
        return False, [f"{path}: can't read: {e.strerror or e}"]
    problems: list[str] = []
    with reader:
        for entry in reader.table.tensors:
            problems += [str(e) for e in file.check_tensor(reader, entry)]
            if progress is not None:
                progress(entry.offset + entry.length, reader.header.table_offset)
    return not problems, problems


def _validate_step(path: str, step: int, trusted_keys: Any) -> tuple[bool, list[str]]:
    """A coordinator step directory, checked as the coordinator checks it (check_step)."""
    try:
        keys = signing.trusted_key_set(trusted_keys) if trusted_keys is not None else None
        _, problems = check_step(path, step, keys)
    except errors.SneppXError as e:
        return False, [f"{type(e).__name__}: {e}"]
    except OSError as e:
        return False, [f"{path}: can't read: {e.strerror or e}"]
    return not problems, problems


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
        verify.check_manifest_files(local, raw)
    except errors.SneppXError as e:
        return f"{type(e).__name__}: {e}"
    except OSError as e:
        return f"StorageError: {local}: can't read: {e.strerror or e}"
    return None


def check_step(local: str, step: int, trusted_keys: dict[bytes, Any] | None = None,
                ) -> tuple[dict[str, Any] | None, list[str]]:
    """(manifest, problems) for a step directory: manifest (its checksum, and on S3 that the `COMMITTED`
    marker was written for these manifest bytes), every shard's bytes, and that the manifest's pieces are
    exactly the shard entries with the same CRCs. With trusted_keys, first the signature and the digest of
    every file the manifest lists, and that every shard is among them."""
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
        with open(storage.fetched_marker_path(local), "rb") as f:  # S3 steps: the marker, next to them
            problem = storage.marker_problem(f.read(storage.MAX_MANIFEST_BYTES + 1), raw, step)
    except FileNotFoundError:
        problem = None
    if problem is not None:
        return None, [problem]
    try:
        manifest = manifest_codec.decode_manifest(raw, step=step, where=path)
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
        ok, errs = validate_checkpoint(shard_path)
        if not ok:
            problems += errs
            continue
        with file.CheckpointReader(shard_path, verify=False) as reader:
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


def quick_check_step(step: int, manifest: bytes | None, files: dict[str, int], marker: bytes | None = None,
                     ) -> tuple[dict[str, Any] | None, list[str]]:
    """(manifest, problems) of a committed step judged from its listing alone, no shard byte read (what
    `sneppx ls` says without --full): the manifest's schema and checksum, that an S3 step's `COMMITTED`
    marker was written for it, and that every shard it names is there (with the size a signed manifest
    lists). A step that passes can still fail check_step, which reads every byte."""
    if manifest is None:
        return None, [f"step {step}: manifest.json is missing"]
    if marker is not None:
        problem = storage.marker_problem(marker, manifest, step)
        if problem is not None:
            return None, [problem]
    try:
        decoded = manifest_codec.decode_manifest(manifest, step=step, where=f"step {step}: {storage.MANIFEST}")
    except errors.ManifestError as e:
        return None, [str(e)]
    problems = []
    listed = decoded.get("files", {})
    for shard in decoded["shards"]:
        if shard not in files:
            problems.append(f"step {step}: shard {shard} is missing")
        elif shard in listed and isinstance(listed[shard], dict) and listed[shard].get("size") != files[shard]:
            problems.append(f"step {step}: shard {shard} is {files[shard]} bytes, the manifest says "
                            f"{listed[shard].get('size')}")
    return decoded, problems
