"""What both storage backends share: the atomicity interface (Storage, PendingStep, StepReader), what a manifest
names, and the S3 commit marker. Step and file names are layout.py's.

The commit-point story for each backend is in `SneppX_ALG.storage` (the package docstring).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Protocol

from SneppX_ALG import _native
from SneppX_ALG.storage import layout


@dataclass
class PendingStep:
    """A step being written: this rank's shard files go into `local_dir`, or stream to the store through the
    sinks it handed out (`streamed`, by shard name: S3 uploads them as they are written); nothing is visible
    until finalize().

    `token` names the step in flight for the other ranks of a group (locally, the temporary directory they all
    write into; on S3 nothing: each rank stages its own files); `uploaded` holds what this rank put on the
    server, {key: (size, ETag)}, so a failed step can take it back."""

    step: int
    local_dir: str
    token: str = ""
    owner: bool = True  # False for a rank that joined rank 0's step: locally, the directory is not its to remove
    uploaded: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    streamed: dict[str, Any] = dataclasses.field(default_factory=dict)


# What one rank wrote of a step, as finalize() checks it: {file name: (size, ETag or "" locally)}.
Parts = dict[str, tuple[int, str]]


class StepReader(Protocol):
    """Ranged reads of one committed step's files (a resharded load reads only what it needs).

    `read_file(name)`: a small file whole (the manifest, its signature), None when there is none.
    `size(name)`: a file's size (CheckpointNotFoundError when missing). `read_blocks(name, buffer, offset,
    block_bytes)`: fills `buffer` with the file's bytes at `offset` and returns the CRC32C of each block_bytes
    block of it (the last may be short), computed on the bytes in `buffer`. `marker`: the step's commit record
    (S3), None locally. `bytes_read`: bytes read by read_blocks so far (what a test counts)."""

    location: str
    marker: bytes | None
    bytes_read: int

    def read_file(self, name: str) -> bytes | None: ...

    def size(self, name: str) -> int: ...

    def read_blocks(self, name: str, buffer: memoryview, offset: int, block_bytes: int) -> list[int]: ...


class Storage(Protocol):
    """The atomicity interface both backends implement.

    One writer (or rank 0 of a group) calls begin(), each other rank of a group join() with its token; every
    rank writes its files into its PendingStep's local_dir, then upload() (S3: puts them on the server), and
    rank 0 alone finalize() (the commit point) with every rank's Parts, or abort(); the other ranks then
    leave() (their part stays: it is the step's, or cleanup's), or abort() when rank 0 says nothing committed."""

    uri: str

    def committed_steps(self) -> list[int]: ...

    def begin(self, step: int) -> PendingStep: ...

    def join(self, step: int, token: str) -> PendingStep: ...

    def shard_sink(self, pending: PendingStep, name: str) -> Any:
        """A checkpoint.file.Sink that streams shard `name` straight to the store, or None: write the file into
        `pending.local_dir` (upload() puts it up)."""
        ...

    def upload(self, pending: PendingStep, names: list[str]) -> Parts: ...

    def finalize(self, pending: PendingStep, manifest: bytes, signature: bytes | None, parts: Parts) -> str: ...

    def abort(self, pending: PendingStep) -> None: ...

    def leave(self, pending: PendingStep) -> None: ...

    def open_step(self, step: int) -> contextlib.AbstractContextManager[str]: ...

    def read_step(self, step: int) -> contextlib.AbstractContextManager[StepReader]: ...

    def delete(self, step: int) -> None: ...

    def cleanup(self) -> list[str]: ...

    # Moving committed steps out of the step namespace, and small files at the root (timelines).

    def set_aside(self, step: int, reason: str) -> str: ...

    def set_aside_steps(self) -> list[tuple[int, str]]: ...

    def remove_set_aside(self, name: str) -> None: ...

    # A small file at the root, written whole and durably (last writer wins): the coordinator's FENCE. Not a
    # compare-and-swap record (SneppX_ALG.records): a fence is decided by the restore that writes it and only
    # read by the others, so it needs no condition, and it stays where every tool that opens a root sees it.
    def read_root_file(self, name: str) -> bytes | None: ...

    def write_root_file(self, name: str, data: bytes) -> None: ...

    def remove_root_file(self, name: str) -> None: ...

    # What a tool shows of a root (sneppx ls): step-like entries and their small files, nothing else read.

    def inventory(self) -> list[layout.Entry]: ...

    def read_entry_file(self, name: str, leaf: str) -> bytes | None: ...


def block_crcs(buffer: memoryview, block_bytes: int) -> list[int]:
    """The CRC32C of each block_bytes block of `buffer` (the last may be short)."""
    return [_native.crc32c(buffer[i:i + block_bytes]) for i in range(0, len(buffer), block_bytes)]


def manifest_shards(manifest: bytes) -> list[str]:
    """The plain shard names a manifest lists ([] when it is unreadable: validating the step then says what
    is wrong). Only these are uploaded, checked at a commit and fetched, so an odd key under a step prefix
    can't name a local path."""
    try:
        doc = json.loads(manifest[:layout.MAX_MANIFEST_BYTES + 1])
    except (ValueError, UnicodeDecodeError, RecursionError):
        return []
    shards = doc.get("shards") if isinstance(doc, dict) else None
    if not isinstance(shards, list):
        return []
    reserved = (layout.MANIFEST, layout.SIGNATURE, layout.COMMITTED)
    return [s for s in shards if isinstance(s, str) and layout.is_plain_name(s) and s not in reserved]


def commit_record(step: int, writer: str, manifest: bytes) -> bytes:
    """The body of an S3 step's `layout.COMMITTED` marker: which writer committed which manifest.json (its size and
    CRC32C), so that a reader can check the manifest is the one committed and a writer can recognise its own
    marker when the answer to its PUT was lost (docs/FORMAT.md, "S3 steps: the commit marker")."""
    return json.dumps({"format": layout.COMMIT_FORMAT, "step": step, "writer": writer,
                       "manifest": _manifest_id(manifest)}, sort_keys=True, separators=(",", ":")).encode()


def marker_problem(marker: bytes, manifest: bytes, step: int) -> str | None:
    """Why a `layout.COMMITTED` marker does not vouch for these manifest bytes, or None when it does. A marker
    written before commit records existed is a copy of the manifest itself, and must equal it."""
    if marker == manifest:
        return None
    try:
        record = json.loads(marker)
    except (ValueError, UnicodeDecodeError, RecursionError):
        record = None
    if not isinstance(record, dict) or record.get("format") != layout.COMMIT_FORMAT:
        return f"{layout.COMMITTED} of step {step} is not a commit record"
    if record.get("step") != step:
        return f"{layout.COMMITTED} of step {step} says step {record.get('step')!r}"
    if record.get("manifest") != _manifest_id(manifest):
        return (f"{layout.COMMITTED} of step {step} was written for another {layout.MANIFEST} "
                f"({record.get('manifest')!r}, "
                f"this one {_manifest_id(manifest)}): the manifest was replaced after the commit")
    return None


def _manifest_id(manifest: bytes) -> dict[str, object]:
    return {"size": len(manifest), "crc32c": f"{_native.crc32c(manifest):08x}"}
