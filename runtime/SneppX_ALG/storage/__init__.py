"""Where checkpoints live: a local directory (disk, PVC, NFS) or an S3 prefix, behind one small interface.

Why: the coordinator decides *what* and *when* to save; this module only knows how to make a step appear
atomically and how to list, fetch and delete steps. Like orbax's atomicity layer, a step is built under a
temporary name and finalized by one commit point; a step without its commit point does not exist for
readers, and `cleanup()` removes what a crash left behind.

Layout (both backends)::

    <root>/step-000001000/shard-00000.snpx   one SNPX file per shard
    <root>/step-000001000/manifest.json      global tensor index + training state (JSON, never pickle)
    <root>/step-000001000/manifest.sig       signed steps only: detached signature over manifest.json
    <root>/step-000001000/COMMITTED          S3 only: the commit marker, written last

Commit points:

* Local: shards, the manifest and its signature (if any) are written (each fsynced, renamed, directory
  fsynced) inside `<root>/.tmp-step-000001000-<owner>/`; every file is checked present with its size, then the
  directory is renamed to `step-000001000` and the root directory fsynced. The rename is the commit: a
  `step-*` directory is complete by construction, so no marker file is needed (one more fsync'd file would add
  nothing a rename doesn't already guarantee). If the fsync of the root fails after the rename, the save
  fails, and the step is renamed back to its temporary name (removed now, or by `cleanup()` at the next start)
  so it is never visible as committed: a failed fsync is not retried and trusted. Were even that rename back
  lost in a crash, what the next start finds is a directory whose every file was fsynced before the rename: it
  is validated like any step. Deletion first renames the step to `.deleting-...` (invisible at once), then
  removes it.
* S3: shards go up as parallel multipart uploads; `manifest.json` is created with `If-None-Match: *` (the
  first writer of a step owns it, so a late second writer can't replace a committed step's manifest), then
  `manifest.sig` (if any); every uploaded object is checked on the server (size and ETag), then `COMMITTED` is
  created with `If-None-Match: *`, so two writers can never both commit a step. The marker is a small record
  naming its writer and the manifest's size and CRC32C (docs/FORMAT.md, "S3 steps: the commit marker"):
  readers check the manifest against it, and a writer whose PUT got no clear answer (timeout, reset, 5xx, or a
  412 on the retry of its own applied PUT) reads the marker back to learn whether it committed. Deletion
  removes the marker first. Reading a step fetches only the files its manifest names (manifest, signature,
  shards), whatever else the prefix holds.

Several processes on one root (storage/lease.py): a writer claims each step it writes before writing any of it
(locally the temporary directory, named for its owner; on S3 a lease object per writer) and refreshes the
claim while the step is in flight, and `cleanup()` removes only leftovers no live claim covers: those of dead
processes on this machine at once, those of other machines after LEASE_EXPIRY_S (10 minutes) without a sign of
life. A commit checks that every part it wrote is still there first, so a writer whose claim expired under it
(stalled for ten minutes) fails instead of committing a step with parts missing. Readers never clean up
(`CheckpointCoordinator(read_only=True)`). Cleanup never touches set-aside steps or the files at the root (below).

Setting aside (a committed step moved out of the step namespace, kept for inspection until retention removes
it): local, one durable rename to `.<reason>-step-...`; S3, a server-side copy under that name, then the marker
deleted, then the step's other objects (its manifest.json too, so the number can be saved again). Small durable
files at the root (the coordinator's `FENCE` and `ROLLBACK`, docs/FORMAT.md "Coordinator roots: timelines and fencing"):
local, written through `_fs.write_durable`; S3, one PUT.

What is still assumed on S3: one writer per *step*. Two writers saving the same step upload its shards to the
same keys: at most one commits, and a step whose shards the other replaced fails validation (never loads mixed
bytes), but that step is then lost. (Locally each writer has its own directory and the rename decides.) Every
listing is confined to the root (`prefix + "/"`): `s3://bkt/jobs/a` never touches `jobs/ab/...`, and a bucket
root `s3://bkt` owns only the `step-*/`, `.lease-*`, set-aside (`.invalid-step-*/`, `.abandoned-step-*/`) and
`FENCE`/`ROLLBACK` keys at the top of the bucket, and the records under `rdzv/` (below); two jobs in one bucket need two
prefixes.

Beside the steps, the same root holds small compare-and-swap records (`SneppX_ALG.records`, opened with
`records.open_record_store`): the rendezvous of elastic jobs keeps its generations there under `rdzv/`, a name no
step listing, inventory or cleanup ever touches.
"""

from __future__ import annotations

from typing import Any

from SneppX_ALG._fs import local_root
from SneppX_ALG._s3 import make_s3_client, parse_s3_uri
from SneppX_ALG.storage.base import (
    Parts,
    PendingStep,
    StepReader,
    Storage,
    block_crcs,
    commit_record,
    marker_problem,
)
from SneppX_ALG.storage.layout import (
    COMMITTED,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    SIGNATURE,
    Entry,
    classify_entry,
    fetched_marker_path,
    is_plain_name,
    parse_set_aside_name,
    parse_step_name,
    set_aside_name,
    step_name,
)
from SneppX_ALG.storage.local import LocalStepReader, LocalStorage
from SneppX_ALG.storage.s3 import S3Storage

__all__ = [
    "COMMITTED",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "SIGNATURE",
    "Entry",
    "LocalStepReader",
    "LocalStorage",
    "Parts",
    "PendingStep",
    "S3Storage",
    "StepReader",
    "Storage",
    "block_crcs",
    "classify_entry",
    "commit_record",
    "fetched_marker_path",
    "is_plain_name",
    "make_s3_client",
    "marker_problem",
    "open_storage",
    "parse_s3_uri",
    "parse_set_aside_name",
    "parse_step_name",
    "set_aside_name",
    "step_name",
]


def open_storage(root: str, *, s3_client: Any = None, staging_dir: str | None = None,
                 upload_part_bytes: int = 16 << 20, upload_threads: int = 4) -> Storage:
    """A backend for `root`: `s3://bucket/prefix`, `file:///absolute/path` (what the operator hands its pods)
    or a local directory (created if missing)."""
    if root.startswith("s3://"):
        return S3Storage(root, client=s3_client, staging_dir=staging_dir, part_bytes=upload_part_bytes,
                         threads=upload_threads)
    return LocalStorage(local_root(root))
