"""What both storage backends share: step names, the atomicity interface, durable small writes.

The commit-point story for each backend is in `SneppX_ALG.storage` (the package docstring).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from typing import Protocol

from SneppX_ALG import _native

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
COMMITTED = "COMMITTED"
COMMIT_FORMAT = "sneppx.commit"
MAX_MANIFEST_BYTES = 256 << 20  # the coordinator's limit too: a larger manifest is refused when read
STEP_RE = re.compile(r"^step-(\d{9,})$")
TMP_PREFIX = ".tmp-step-"
DELETING_PREFIX = ".deleting-step-"
STAGE_PREFIX = "sneppx-stage-"
# A committed step moved out of the step namespace (docs/FORMAT.md, "Timelines and fencing"): kept for
# inspection as `.<reason>-step-NNNNNNNNN-<hex>`, never read as a step, removed by retention.
SET_ASIDE_REASONS = ("invalid", "abandoned")
SET_ASIDE_RE = re.compile(r"^\.(?:invalid|abandoned)-step-(\d{9,})-[0-9a-f]+$")


def step_name(step: int) -> str:
    """`step-000001000`: zero-padded so names sort like numbers up to a billion steps."""
    if step < 0:
        raise ValueError(f"step must be >= 0, not {step}")
    return f"step-{step:09d}"


def parse_step_name(name: str) -> int | None:
    match = STEP_RE.match(name)
    return int(match.group(1)) if match else None


def set_aside_name(step: int, reason: str) -> str:
    """`.invalid-step-000001000-<hex>` or `.abandoned-...`: a new, unique name for a step set aside."""
    if reason not in SET_ASIDE_REASONS:
        raise ValueError(f"reason must be one of {SET_ASIDE_REASONS}, not {reason!r}")
    return f".{reason}-{step_name(step)}-{secrets.token_hex(4)}"


def parse_set_aside_name(name: str) -> int | None:
    """The step a set-aside name holds, or None when the name is not one."""
    match = SET_ASIDE_RE.match(name)
    return int(match.group(1)) if match else None


@dataclass
class PendingStep:
    """A step being written: shard files go into `local_dir`; nothing is visible until finalize()."""

    step: int
    local_dir: str


class Storage(Protocol):
    """The atomicity interface both backends implement."""

    uri: str

    def committed_steps(self) -> list[int]: ...

    def begin(self, step: int) -> PendingStep: ...

    def finalize(self, pending: PendingStep, manifest: bytes, signature: bytes | None = None) -> str: ...

    def abort(self, pending: PendingStep) -> None: ...

    def open_step(self, step: int) -> contextlib.AbstractContextManager[str]: ...

    def delete(self, step: int) -> None: ...

    def cleanup(self) -> list[str]: ...

    # Moving committed steps out of the step namespace, and small records at the root (timelines).

    def set_aside(self, step: int, reason: str) -> str: ...

    def set_aside_steps(self) -> list[tuple[int, str]]: ...

    def remove_set_aside(self, name: str) -> None: ...

    def read_record(self, name: str) -> bytes | None: ...

    def write_record(self, name: str, data: bytes) -> None: ...

    def remove_record(self, name: str) -> None: ...

    # What a tool shows of a root (sneppx ls): step-like entries and their small files, nothing else read.

    def inventory(self) -> list[Entry]: ...

    def read_entry_file(self, name: str, leaf: str) -> bytes | None: ...


def write_durable(path: str, data: bytes) -> None:
    """Writes a small file through the native writer (fault hook, fdatasync) under a temp name, then
    renames it into place with a directory fsync."""
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    native_file = _native.NativeFile(tmp, direct=False)
    try:
        native_file.append(data)
    except BaseException:
        native_file.abort()
        raise
    try:
        native_file.finish()
        _native.rename_durable(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise


def unlink_quietly(path: str) -> None:
    """Removes a file that may already be gone (a temporary file after a failed or killed write)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def is_plain_name(name: str) -> bool:
    """A file name that can only mean a file directly in a step directory (no separator, no dot file)."""
    return bool(name) and "/" not in name and "\\" not in name and "\x00" not in name and not name.startswith(".")


def manifest_shards(manifest: bytes) -> list[str]:
    """The plain shard names a manifest lists ([] when it is unreadable: validating the step then says what
    is wrong). Only these are uploaded, checked at a commit and fetched, so an odd key under a step prefix
    can't name a local path."""
    try:
        doc = json.loads(manifest[:MAX_MANIFEST_BYTES + 1])
    except (ValueError, UnicodeDecodeError, RecursionError):
        return []
    shards = doc.get("shards") if isinstance(doc, dict) else None
    if not isinstance(shards, list):
        return []
    return [s for s in shards if isinstance(s, str) and is_plain_name(s) and s not in (MANIFEST, SIGNATURE,
                                                                                       COMMITTED)]


def fetched_marker_path(step_dir: str) -> str:
    """Where `open_step()` of a backend with commit markers (S3) puts the step's marker: next to the step's
    local directory, not in it (the directory holds exactly the files the manifest names)."""
    return os.path.normpath(step_dir) + "." + COMMITTED


def commit_record(step: int, writer: str, manifest: bytes) -> bytes:
    """The body of an S3 step's `COMMITTED` marker: which writer committed which manifest.json (its size and
    CRC32C), so that a reader can check the manifest is the one committed and a writer can recognise its own
    marker when the answer to its PUT was lost (docs/FORMAT.md, "S3 steps: the commit marker")."""
    return json.dumps({"format": COMMIT_FORMAT, "step": step, "writer": writer,
                       "manifest": _manifest_id(manifest)}, sort_keys=True, separators=(",", ":")).encode()


def marker_problem(marker: bytes, manifest: bytes, step: int) -> str | None:
    """Why a `COMMITTED` marker does not vouch for these manifest bytes, or None when it does. A marker
    written before commit records existed is a copy of the manifest itself, and must equal it."""
    if marker == manifest:
        return None
    try:
        record = json.loads(marker)
    except (ValueError, UnicodeDecodeError, RecursionError):
        record = None
    if not isinstance(record, dict) or record.get("format") != COMMIT_FORMAT:
        return f"{COMMITTED} of step {step} is not a commit record"
    if record.get("step") != step:
        return f"{COMMITTED} of step {step} says step {record.get('step')!r}"
    if record.get("manifest") != _manifest_id(manifest):
        return (f"{COMMITTED} of step {step} was written for another {MANIFEST} ({record.get('manifest')!r}, "
                f"this one {_manifest_id(manifest)}): the manifest was replaced after the commit")
    return None


def _manifest_id(manifest: bytes) -> dict[str, object]:
    return {"size": len(manifest), "crc32c": f"{_native.crc32c(manifest):08x}"}


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- what a listing of a root shows (sneppx ls): steps and step-like leftovers, nothing read ------------------

_ENTRY_RE = re.compile(r"^(?:(step)|\.tmp-step|\.deleting-step|\.(?:invalid|abandoned)-step)-(\d{9,})(?:-.+)?$")
ENTRY_STATES = {"step": "committed", ".tmp-step": "uncommitted", ".deleting-step": "deleting"}


@dataclass(frozen=True)
class Entry:
    """One step-like directory or prefix of a root: `state` is "committed" (a step with its commit point),
    "uncommitted" (a save in flight or left by a crash), "set-aside" (moved out of the steps) or "deleting";
    `files` maps its files' names to their sizes."""

    name: str
    step: int
    state: str
    files: dict[str, int]


def classify_entry(name: str) -> tuple[int, str] | None:
    """(step, state) of a top-level name of a root, or None when it is not step-like (leases, records)."""
    match = _ENTRY_RE.match(name)
    if match is None:
        return None
    if match.group(1):
        return (int(match.group(2)), "committed") if STEP_RE.match(name) else None
    prefix = name[: name.index("-step") + len("-step")]
    return int(match.group(2)), ENTRY_STATES.get(prefix, "set-aside")
