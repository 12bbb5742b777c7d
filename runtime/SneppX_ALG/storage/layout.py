"""What a step is on disk, in both backends: the names of steps and of their files, the names a step takes while it
is written, deleted or set aside, and what a listing of a root makes of them. Names only: nothing here reads
or writes (storage/base.py holds the backends' interface, and the package docstring the commit points).

    <root>/step-000001000/                 a committed step (local: a directory; S3: a prefix with COMMITTED)
    <root>/step-000001000/manifest.json    MANIFEST
    <root>/step-000001000/manifest.sig     SIGNATURE (signed steps)
    <root>/step-000001000/COMMITTED        the S3 commit marker
    <root>/.tmp-step-000001000-<owner>/    a local step being written
    <root>/.deleting-step-000001000-<hex>/ a local step being deleted
    <root>/.invalid-step-000001000-<hex>/  set aside (also .abandoned-step-...)

Shard files are any plain names a manifest lists (the coordinator writes `shard-NNNNN.snpx`): readers take them
from the manifest, never from a pattern.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass

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
# What a local write of a root file (the coordinator's FENCE) is named until its rename (_fs.write_durable): one a
# kill left behind is removed by the next start's cleanup.
ROOT_FILE_TMP_RE = re.compile(r"^[A-Z]+\.[0-9a-f]{8}\.tmp$")


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


def is_plain_name(name: str) -> bool:
    """A file name that can only mean a file directly in a step directory (no separator, no dot file)."""
    return bool(name) and "/" not in name and "\\" not in name and "\x00" not in name and not name.startswith(".")


def fetched_marker_path(step_dir: str) -> str:
    """Where `open_step()` of a backend with commit markers (S3) puts the step's marker: next to the step's
    local directory, not in it (the directory holds exactly the files the manifest names)."""
    return os.path.normpath(step_dir) + "." + COMMITTED


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
