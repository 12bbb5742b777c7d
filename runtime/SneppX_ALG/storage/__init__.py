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
  fsynced) inside `<root>/.tmp-step-000001000-<pid>-<hex>/`, which is then renamed to `step-000001000` and
  the root directory fsynced. The rename is the commit: a `step-*` directory is complete by construction,
  so no marker file is needed (one more fsync'd file would add nothing a rename doesn't already guarantee).
  If the fsync of the root fails after the rename, the save fails, and the step is renamed back to its
  temporary name (removed now, or by `cleanup()` at the next start) so it is never visible as committed:
  a failed fsync is not retried and trusted. Were even that rename back lost in a crash, what the next
  start finds is a directory whose every file was fsynced before the rename: it is validated like any step.
  Deletion first renames the step to `.deleting-...` (invisible at once), then removes it.
* S3: shards go up as parallel multipart uploads, the manifest and its signature (if any) as one PUT each,
  then `COMMITTED` is PUT with `If-None-Match: *`, so two writers can never both commit a step. Deletion
  removes the marker first. Failed uploads are aborted; `cleanup()` aborts every incomplete multipart upload
  under the prefix and deletes objects of steps that have no marker. Reading a step fetches only the files its
  manifest names (manifest, signature, shards), whatever else the prefix holds.

One writer per root is assumed (rank 0 in a multi-rank job): `cleanup()` removes every leftover, and on S3
the shards and manifest of a step are plain PUTs under fixed keys, so two writers saving the same step at
once overwrite each other's objects (only the marker is conditional: one of them commits). A step mixed
that way fails validation, never loads wrong bytes. What a writer that loses the marker race does *not* do
is delete anything: the keys it wrote may now hold the winner's objects, so it can't prove they are its own
(`cleanup()` at the next start removes what an uncommitted step left).

Beside the steps, the same root holds small compare-and-swap records (`storage.record`, opened with
`open_record_store`): the rendezvous of elastic jobs keeps its generations there under `rdzv/`, a name no
step listing or cleanup ever touches.
"""

from __future__ import annotations

from typing import Any

from SneppX_ALG.storage.base import (
    COMMITTED,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    SIGNATURE,
    PendingStep,
    Storage,
    is_plain_name,
    parse_step_name,
    step_name,
    unlink_quietly,
    write_durable,
)
from SneppX_ALG.storage.local import LocalRecordStore, LocalStorage
from SneppX_ALG.storage.record import Record, RecordStore
from SneppX_ALG.storage.s3 import S3RecordStore, S3Storage, make_s3_client, parse_s3_uri

__all__ = [
    "COMMITTED", "MANIFEST", "MAX_MANIFEST_BYTES", "SIGNATURE", "LocalRecordStore", "LocalStorage", "PendingStep",
    "Record", "RecordStore", "S3RecordStore", "S3Storage", "Storage", "is_plain_name", "make_s3_client",
    "open_record_store", "open_storage", "parse_s3_uri", "parse_step_name", "step_name", "unlink_quietly",
    "write_durable",
]


def open_storage(root: str, *, s3_client: Any = None, staging_dir: str | None = None,
                 upload_part_bytes: int = 16 << 20, upload_threads: int = 4) -> Storage:
    """A backend for `root`: `s3://bucket/prefix`, `file:///absolute/path` (what the operator hands its pods)
    or a local directory (created if missing)."""
    if root.startswith("s3://"):
        return S3Storage(root, client=s3_client, staging_dir=staging_dir, part_bytes=upload_part_bytes,
                         threads=upload_threads)
    return LocalStorage(_local_path(root))


def open_record_store(root: str, *, s3_client: Any = None) -> RecordStore:
    """The compare-and-swap records under the same roots `open_storage` takes (`s3://bucket/prefix`,
    `file:///absolute/path`, a local directory)."""
    if root.startswith("s3://"):
        return S3RecordStore(root, client=s3_client)
    return LocalRecordStore(_local_path(root))


def _local_path(root: str) -> str:
    if root.startswith("file://"):
        root = root[len("file://"):]
        if not root.startswith("/"):
            raise ValueError(f"unsupported checkpoint root file://{root}: a file:// URI needs an absolute path, "
                             "file:///path (no host)")
    elif "://" in root:
        raise ValueError(f"unsupported checkpoint root {root!r}: use a local path or s3://bucket/prefix")
    return root
