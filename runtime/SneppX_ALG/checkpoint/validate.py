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

import numpy as np

from SneppX_ALG import _fs, errors, storage
from SneppX_ALG.checkpoint import chunks, file, format, reshard, scan, signing, verify
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
    with reader:
        problems = [str(e) for e in file.check_tensors(reader, progress)]
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


def check_step(local: str, step: int, trusted_keys: dict[bytes, Any] | None = None,
               open_step: reshard.OpenStep | None = None) -> tuple[dict[str, Any] | None, list[str]]:
    """(manifest, problems) for a step directory: manifest (its checksum, and on S3 that the `COMMITTED`
    marker was written for these manifest bytes), every shard's bytes, and that the manifest's pieces are
    exactly the shard entries with the same CRCs. With trusted_keys, first the signature over the manifest
    bytes, then the size and digest of every file the manifest lists, and that every shard is among them.

    An incremental step's referenced blocks are read through `open_step` (a ranged reader of an earlier step:
    a storage's read_step), by default from the step directories beside `local`; only once the manifest is
    authenticated (with trusted_keys) and decoded, and its own shards checked, so a forged manifest costs no
    read of another step.

    Raises CheckpointUnreadableError when a file can't be read now (an I/O error other than a missing file):
    that says nothing about the step's bytes, so it is never reported as a problem."""
    manifest, problems, _ = _scan_step(local, step, trusted_keys, open_step, keep=False)
    return manifest, problems


def load_step(local: str, step: int, trusted_keys: dict[bytes, Any] | None = None,
              open_step: reshard.OpenStep | None = None,
              ) -> tuple[dict[str, Any] | None, list[str], list[np.ndarray] | None]:
    """check_step, reading every tensor into a new array as it is checked: (manifest, problems, arrays),
    one array per manifest tensor, in order (None when there are problems).

    The arrays hold exactly the bytes that were checked: each shard is read once, through one descriptor,
    straight into them, and each piece's CRC32C (and with trusted_keys each shard's BLAKE3) is computed on
    that memory. A shard renamed over or changed after the check can't be loaded (docs/FORMAT.md,
    "Verifying")."""
    return _scan_step(local, step, trusted_keys, open_step, keep=True)


def _scan_step(local: str, step: int, trusted_keys: dict[bytes, Any] | None, open_step: reshard.OpenStep | None,
               *, keep: bool) -> tuple[dict[str, Any] | None, list[str], list[np.ndarray] | None]:
    try:
        return _scan_step_files(local, step, trusted_keys, open_step or verify.sibling_steps(local), keep)
    except (OSError, errors.StorageError) as e:
        if isinstance(e, FileNotFoundError):  # a file went missing under us: a verdict, like any missing file
            return None, [f"{local}: {e}"], None
        if isinstance(e, errors.CheckpointUnreadableError):
            raise
        raise errors.CheckpointUnreadableError(f"{local}: can't read step {step} now: {e}", step=step,
                                               path=local, errno=e.errno) from e


def _scan_step_files(local: str, step: int, trusted_keys: dict[bytes, Any] | None, open_step: reshard.OpenStep,
                     keep: bool) -> tuple[dict[str, Any] | None, list[str], list[np.ndarray] | None]:
    path = os.path.join(local, storage.MANIFEST)
    try:
        raw = _fs.read_small(path, storage.MAX_MANIFEST_BYTES)
        signature = (_fs.read_small(os.path.join(local, storage.SIGNATURE), format.MAX_SIGNATURE_BYTES)
                     if trusted_keys is not None else None)
        marker = _fs.read_small(storage.fetched_marker_path(local), storage.MAX_MANIFEST_BYTES)  # S3 steps: the marker, next to them
    except errors.CheckpointFormatError as e:  # a FIFO, a link, a directory where a small file should be
        return None, [f"{type(e).__name__}: {e}"], None
    if raw is None:
        return None, [f"{path}: manifest.json is missing"], None
    if trusted_keys is not None:  # before parsing: a forged manifest costs nothing more than this
        try:
            signing.check_manifest_signature(raw, signature or b"", trusted_keys, path=local)
        except errors.SneppXError as e:
            return None, [f"{type(e).__name__}: {e}"], None
    problem = storage.marker_problem(marker, raw, step) if marker is not None else None
    if problem is not None:
        return None, [problem], None
    try:
        manifest = manifest_codec.decode_manifest(raw, step=step, where=path)
    except errors.ManifestError as e:
        return None, [str(e)], None
    listed: dict[str, dict[str, Any]] | None = None
    if trusted_keys is not None:
        try:  # the shards are hashed below, as they are read; anything else listed is checked here
            listed = verify.check_manifest_files(local, raw, skip=manifest["shards"])
        except errors.SneppXError as e:
            return None, [f"{type(e).__name__}: {e}"], None
        unsigned = [s for s in manifest["shards"] if s not in listed]
        if unsigned:
            why = (f"DigestMismatchError: {local}: shard(s) {', '.join(unsigned)} have no digest in the signed "
                   "manifest, so the signature does not cover them")
            return manifest, [why], None
    boxed = manifest["version"] >= 3
    block_bytes = manifest["block_bytes"] if boxed else None
    arrays, targets, scatters = _destinations(manifest) if keep else ([], {}, [])
    problems: list[str] = []
    entries: dict[tuple[int, str], format.TensorEntry] = {}
    blocks: dict[tuple[int, str], list[int]] = {}
    for index, shard in enumerate(manifest["shards"]):
        shard_path = os.path.join(local, shard)
        expected = listed[shard] if listed is not None else None
        try:
            if expected is not None:
                _check_size(local, shard, expected)
            into = (lambda entry, index=index: _target(targets, index, entry)) if keep else None
            found = scan.scan_shard(shard_path, into, digest=_digest_name(expected), block_bytes=block_bytes)
            if expected is not None and found.digest != expected["digest"]:
                raise errors.DigestMismatchError(
                    f"file {shard!r} does not match its {_digest_name(expected)} digest in the manifest",
                    path=local)
        except errors.SignatureError as e:  # what a signature vouches for does not hold: that, first and alone
            return manifest, [f"{type(e).__name__}: {e}"], None
        except (errors.CheckpointFormatError, errors.CheckpointNotFoundError) as e:
            problems.append(f"{type(e).__name__}: {e}" if expected is not None else str(e))
            continue
        problems += [str(p) for p in found.problems]
        for stored in found.table.tensors:
            entries[(index, stored.name)] = stored
        blocks.update({(index, name): crcs for name, crcs in found.blocks.items()})
    if problems:
        return manifest, problems, None
    for tensor in manifest["tensors"]:
        for piece in tensor["chunks" if boxed else "pieces"]:
            if manifest_codec.reference(piece) is not None:
                continue  # in an earlier step's file: read and checked below
            where = (piece["shard"], piece["entry"])
            entry = entries.get(where)
            if entry is None:
                problems.append(f"{'/'.join(tensor['path'])}: shard {piece['shard']} has no entry {piece['entry']!r}")
            elif not (manifest_codec.entry_matches(entry, piece, tensor) if boxed else (
                    entry.length == piece["nbytes"] and entry.crc32c == piece["crc32c"]
                    and entry.dtype == tensor["dtype"])):
                problems.append(f"{'/'.join(tensor['path'])}: entry {piece['entry']!r} does not match the manifest")
            elif boxed and blocks.get(where) != manifest_codec.block_crcs(piece):
                problems.append(f"{'/'.join(tensor['path'])}: the block checksums of entry {piece['entry']!r} don't "
                                "match its bytes")
    if problems:
        return manifest, problems, None
    if manifest_codec.uses(manifest):  # an incremental step: its chunks in earlier steps' files, beside it
        problems = reshard.read_references(open_step, manifest, arrays if keep else None,
                                           signed=trusted_keys is not None)
        if problems:
            return manifest, problems, None
    for views in targets.values():  # an entry that two pieces name (legal, unusual) was read into the first
        for view in views[1:]:
            view[:] = views[0]
    for array, box, view in scatters:  # chunks that are not one contiguous range of their tensor
        array[box.slices()] = np.frombuffer(view, array.dtype).reshape(box.shape)
    return manifest, [], arrays if keep else None


def _digest_name(expected: dict[str, Any] | None) -> str | None:
    return signing.parse_digest(expected["digest"])[0] if expected is not None else None


def _check_size(local: str, name: str, expected: dict[str, Any]) -> None:
    """A listed file's size against the manifest (the digest, computed as the file is read, decides)."""
    try:
        size = os.stat(os.path.join(local, name), follow_symlinks=False).st_size
    except FileNotFoundError:
        raise errors.TruncatedCheckpointError(f"file {name!r} listed in the manifest is missing",
                                              path=local) from None
    if size != expected["size"]:
        kind = errors.TruncatedCheckpointError if size < expected["size"] else errors.CorruptHeaderError
        raise kind(f"file {name!r} is {size} bytes, the manifest says {expected['size']}", path=local)


def _destinations(manifest: dict[str, Any]) -> tuple[list[np.ndarray], dict[tuple[int, str], list[memoryview]],
                                                   list[tuple[np.ndarray, chunks.Box, memoryview]]]:
    """A new array per manifest tensor; for each (shard, entry) the byte ranges of them it fills; and the chunks
    that are not one contiguous range of their tensor (read into a buffer of their own, placed afterwards)."""
    arrays: list[np.ndarray] = []
    targets: dict[tuple[int, str], list[memoryview]] = {}
    scatters: list[tuple[np.ndarray, chunks.Box, memoryview]] = []
    boxed = manifest["version"] >= 3
    for tensor in manifest["tensors"]:
        array = np.empty(tuple(tensor["shape"]), dtype=format.numpy_dtype(tensor["dtype"]))
        flat = array.reshape(-1).view(np.uint8)
        for piece in tensor["chunks" if boxed else "pieces"]:
            if manifest_codec.reference(piece) is not None:
                continue  # read straight into `array` by reshard.read_references
            if boxed:
                box = chunks.Box(tuple(piece["offset"]), tuple(piece["shape"]))
                if box.volume == 0:
                    view = memoryview(bytearray(0))
                elif chunks.is_contiguous(array.shape, box):
                    start = int(np.ravel_multi_index(box.offset, array.shape)) * array.itemsize if array.ndim else 0
                    view = flat[start:start + piece["nbytes"]].data
                else:
                    view = memoryview(bytearray(piece["nbytes"]))
                    scatters.append((array, box, view))
            else:
                view = flat[piece["start"]:piece["start"] + piece["nbytes"]].data
            targets.setdefault((piece["shard"], piece["entry"]), []).append(view)
        arrays.append(array)
    return arrays, targets, scatters


def _target(targets: dict[tuple[int, str], list[memoryview]], shard: int,
            entry: format.TensorEntry) -> memoryview | None:
    views = targets.get((shard, entry.name))
    return views[0] if views and len(views[0]) == entry.length else None


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
