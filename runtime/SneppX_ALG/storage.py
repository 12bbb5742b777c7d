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
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import json
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from SneppX_ALG import _native, errors

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
COMMITTED = "COMMITTED"
MAX_MANIFEST_BYTES = 256 << 20  # the coordinator's limit too: a larger manifest is refused when read
_STEP_RE = re.compile(r"^step-(\d{9,})$")
_TMP_PREFIX = ".tmp-step-"
_DELETING_PREFIX = ".deleting-step-"
_STAGE_PREFIX = "sneppx-stage-"


def step_name(step: int) -> str:
    """`step-000001000`: zero-padded so names sort like numbers up to a billion steps."""
    if step < 0:
        raise ValueError(f"step must be >= 0, not {step}")
    return f"step-{step:09d}"


def parse_step_name(name: str) -> int | None:
    match = _STEP_RE.match(name)
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


def open_storage(root: str, *, s3_client: Any = None, staging_dir: str | None = None,
                 upload_part_bytes: int = 16 << 20, upload_threads: int = 4) -> Storage:
    """A backend for `root`: `s3://bucket/prefix`, `file:///absolute/path` (what the operator hands its pods)
    or a local directory (created if missing)."""
    if root.startswith("s3://"):
        return S3Storage(root, client=s3_client, staging_dir=staging_dir, part_bytes=upload_part_bytes,
                         threads=upload_threads)
    if root.startswith("file://"):
        root = root[len("file://"):]
        if not root.startswith("/"):
            raise ValueError(f"unsupported checkpoint root file://{root}: a file:// URI needs an absolute path, "
                             "file:///path (no host)")
    elif "://" in root:
        raise ValueError(f"unsupported checkpoint root {root!r}: use a local path or s3://bucket/prefix")
    return LocalStorage(root)


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


def manifest_shards(path: str) -> list[str]:
    """The plain shard names a fetched manifest lists ([] when it is missing or unreadable: validating the
    step then says what is wrong). Only these are fetched, so an odd key under a step prefix can't name a
    local path."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(MAX_MANIFEST_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return []
    shards = doc.get("shards") if isinstance(doc, dict) else None
    if not isinstance(shards, list):
        return []
    return [s for s in shards if isinstance(s, str) and is_plain_name(s) and s not in (MANIFEST, SIGNATURE,
                                                                                       COMMITTED)]


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- local filesystem ----------------------------------------------------------------------------------


class LocalStorage:
    """Steps as directories under a local root (a disk, a PVC, an NFS mount)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.uri = self.root
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise errors.StorageError(f"can't create checkpoint root {self.root}: {e.strerror}", path=self.root,
                                      errno=e.errno) from None

    def step_path(self, step: int) -> str:
        return os.path.join(self.root, step_name(step))

    def committed_steps(self) -> list[int]:
        steps = []
        for entry in os.scandir(self.root):
            step = parse_step_name(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):
                steps.append(step)
        return sorted(steps)

    def begin(self, step: int) -> PendingStep:
        tmp = os.path.join(self.root, f"{_TMP_PREFIX}{step:09d}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(tmp)
        except OSError as e:
            raise _os_error(e, tmp) from None
        return PendingStep(step=step, local_dir=tmp)

    def finalize(self, pending: PendingStep, manifest: bytes, signature: bytes | None = None) -> str:
        final = self.step_path(pending.step)
        write_durable(os.path.join(pending.local_dir, MANIFEST), manifest)
        if signature is not None:  # before the commit point: a committed signed step always has its signature
            write_durable(os.path.join(pending.local_dir, SIGNATURE), signature)
        if os.path.lexists(final):
            raise errors.CheckpointExistsError(f"{final} is already committed; a step is never overwritten",
                                               path=final)
        try:
            _native.rename_durable(pending.local_dir, final)  # the commit point
        except BaseException:
            if not os.path.lexists(pending.local_dir) and os.path.lexists(final):
                self._uncommit(final, pending.local_dir)
            raise
        return final

    def _uncommit(self, final: str, tmp: str) -> None:
        """The rename happened but its fsync failed: the step must not stay visible as committed. Renamed
        back to its temporary name (abort() or the next cleanup() removes it), else removed (best effort)."""
        try:
            os.rename(final, tmp)
        except OSError:
            _remove_tree(final)
            return
        with contextlib.suppress(OSError):
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def abort(self, pending: PendingStep) -> None:
        _remove_tree(pending.local_dir)

    @contextlib.contextmanager
    def open_step(self, step: int) -> Iterator[str]:
        path = self.step_path(step)
        if not os.path.isdir(path):
            raise errors.CheckpointNotFoundError(f"no committed checkpoint for step {step} in {self.root}",
                                                 path=path)
        yield path

    def delete(self, step: int) -> None:
        path = self.step_path(step)
        doomed = os.path.join(self.root, f"{_DELETING_PREFIX}{step:09d}-{secrets.token_hex(4)}")
        _native.rename_durable(path, doomed)  # invisible from here on, even if the removal is cut short
        _remove_tree(doomed)

    def quarantine(self, step: int) -> str:
        """Moves a committed but invalid step out of the way (kept for inspection as `.invalid-...`)."""
        path = self.step_path(step)
        aside = os.path.join(self.root, f".invalid-{step_name(step)}-{secrets.token_hex(4)}")
        _native.rename_durable(path, aside)
        return aside

    def cleanup(self) -> list[str]:
        removed = []
        for entry in os.scandir(self.root):
            if entry.name.startswith((_TMP_PREFIX, _DELETING_PREFIX)):
                _remove_tree(entry.path)
                removed.append(entry.path)
        return removed


def _os_error(e: OSError, path: str) -> errors.StorageError:
    import errno as errno_module

    if e.errno in (errno_module.ENOSPC, errno_module.EDQUOT):
        return errors.DiskFullError(f"{path}: {e.strerror}", path=path, errno=e.errno)
    return errors.StorageError(f"{path}: {e.strerror}", path=path, errno=e.errno)


# ---- S3 ------------------------------------------------------------------------------------------------


def make_s3_client(*, endpoint_url: str | None = None, region: str | None = None, max_connections: int = 16,
                   connect_timeout: float = 10, read_timeout: float = 60, max_attempts: int = 3) -> Any:
    """A boto3 S3 client; endpoint, credentials and region come from the usual AWS environment variables
    unless given. A custom endpoint (moto, MinIO, Ceph) gets path-style addressing."""
    import boto3
    from botocore.config import Config

    endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config = Config(
        s3={"addressing_style": "path"} if endpoint_url else {},
        retries={"max_attempts": max_attempts, "mode": "standard"},
        max_pool_connections=max_connections, connect_timeout=connect_timeout, read_timeout=read_timeout)
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint_url, region_name=region or os.environ.get("AWS_DEFAULT_REGION")
        or os.environ.get("AWS_REGION") or "us-east-1", config=config)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/a/b` -> ("bucket", "a/b") with no trailing slash."""
    rest = uri[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{uri!r} has no bucket: use s3://bucket/prefix")
    return bucket, prefix.strip("/")


def _s3_error(e: Exception, what: str, uri: str) -> errors.StorageError:
    return errors.StorageError(f"S3 {what} failed for {uri}: {e}", path=uri)


def _crc32c_b64(data: Any) -> str:
    return base64.b64encode(_native.crc32c(data).to_bytes(4, "big")).decode()


class S3Storage:
    """Steps as prefixes in a bucket; shards are written to a local staging directory, then uploaded.

    Why stage to a local file: an SNPX header records sizes known only at the end, and S3 objects are
    immutable, so the file is finished (and its CRCs known) before upload; parts then go up in parallel
    straight from the page cache, each with its CRC32C for the server to check.
    """

    def __init__(self, uri: str, *, client: Any = None, staging_dir: str | None = None, part_bytes: int = 16 << 20,
                 threads: int = 4):
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = parse_s3_uri(self.uri)
        self.client = client if client is not None else make_s3_client(max_connections=max(16, 2 * threads))
        self.staging_dir = staging_dir or os.path.join(tempfile.gettempdir(), "sneppx-staging")
        self.part_bytes = max(5 << 20, part_bytes)  # S3's minimum part size (except the last)
        self.threads = max(1, threads)
        os.makedirs(self.staging_dir, exist_ok=True)

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _list(self, prefix: str) -> Iterator[dict[str, Any]]:
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                yield from page.get("Contents", [])
        except _s3_errors() as e:
            raise _s3_error(e, "list", self.uri) from None

    def _steps(self) -> tuple[set[int], set[int]]:
        """(all steps with any object, steps with a commit marker)."""
        seen, committed = set(), set()
        base = self.key("step-")
        strip = len(self.key("")) + 1 if self.prefix else 0
        for obj in self._list(base):
            step_dir, _, leaf = obj["Key"][strip:].partition("/")
            step = parse_step_name(step_dir)
            if step is None:
                continue
            seen.add(step)
            if leaf == COMMITTED:
                committed.add(step)
        return seen, committed

    def committed_steps(self) -> list[int]:
        return sorted(self._steps()[1])

    def begin(self, step: int) -> PendingStep:
        local = tempfile.mkdtemp(prefix=f"{_STAGE_PREFIX}{os.getpid()}-{step:09d}-", dir=self.staging_dir)
        return PendingStep(step=step, local_dir=local)

    def finalize(self, pending: PendingStep, manifest: bytes, signature: bytes | None = None) -> str:
        name = step_name(pending.step)
        marker = self.key(name, COMMITTED)
        uploaded: list[str] = []
        try:
            if self._exists(marker):
                raise errors.CheckpointExistsError(f"s3://{self.bucket}/{marker} exists; a step is never "
                                                   "overwritten", path=self.uri)
            for filename in sorted(os.listdir(pending.local_dir)):
                if filename.endswith(".tmp") or filename.startswith("."):
                    continue
                key = self.key(name, filename)
                self.upload_file(os.path.join(pending.local_dir, filename), key)
                uploaded.append(key)
            self._put(self.key(name, MANIFEST), manifest)
            uploaded.append(self.key(name, MANIFEST))
            if signature is not None:  # before the marker: a committed signed step always has its signature
                self._put(self.key(name, SIGNATURE), signature)
                uploaded.append(self.key(name, SIGNATURE))
            try:
                self._put(marker, manifest, if_none_match=True)  # the commit point
            except errors.CheckpointExistsError:
                uploaded.clear()  # lost the race: those keys may hold the winner's objects now; keep them
                raise
        except BaseException:
            with contextlib.suppress(errors.StorageError):  # best effort: cleanup() gets the rest
                self._delete_keys(uploaded)
            raise
        finally:
            _remove_tree(pending.local_dir)
        return f"s3://{self.bucket}/{self.key(name)}"

    def abort(self, pending: PendingStep) -> None:
        _remove_tree(pending.local_dir)

    def _exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
            return True
        except _s3_errors() as e:
            if _error_code(e) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise _s3_error(e, "head", self.uri) from None

    def _put(self, key: str, body: bytes, *, if_none_match: bool = False) -> None:
        extra = {"IfNoneMatch": "*"} if if_none_match else {}
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=body, ChecksumCRC32C=_crc32c_b64(body),
                                   **extra)
        except _s3_errors() as e:
            if if_none_match and _error_code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise errors.CheckpointExistsError(f"s3://{self.bucket}/{key} was committed by another writer",
                                                   path=self.uri) from None
            raise _s3_error(e, f"put {key}", self.uri) from None

    def upload_file(self, path: str, key: str) -> None:
        """Uploads one local file: a single PUT when small, else parallel multipart with per-part CRC32C.
        A failed multipart upload is aborted before the error propagates."""
        size = os.path.getsize(path)
        if size <= self.part_bytes:
            with open(path, "rb") as f:
                self._put(key, f.read())
            return
        try:
            upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=key,
                                                            ChecksumAlgorithm="CRC32C")["UploadId"]
        except _s3_errors() as e:
            raise _s3_error(e, f"start upload of {key}", self.uri) from None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

        def upload_part(number: int) -> dict[str, Any]:
            offset = (number - 1) * self.part_bytes
            body = os.pread(fd, min(self.part_bytes, size - offset), offset)
            checksum = _crc32c_b64(body)
            response = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                               PartNumber=number, Body=body, ChecksumAlgorithm="CRC32C",
                                               ChecksumCRC32C=checksum)
            return {"PartNumber": number, "ETag": response["ETag"], "ChecksumCRC32C": checksum}

        count = (size + self.part_bytes - 1) // self.part_bytes
        try:
            with concurrent.futures.ThreadPoolExecutor(max_workers=min(self.threads, count)) as pool:
                parts = list(pool.map(upload_part, range(1, count + 1)))
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                  MultipartUpload={"Parts": parts})
        except BaseException as e:  # abort on anything, then re-raise
            with contextlib.suppress(*_s3_errors()):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            if isinstance(e, Exception) and not isinstance(e, errors.SneppXError):
                raise _s3_error(e, f"upload of {key}", self.uri) from None
            raise
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def open_step(self, step: int) -> Iterator[str]:
        """Downloads a committed step into a temporary local directory for reading and validation."""
        name = step_name(step)
        if not self._exists(self.key(name, COMMITTED)):
            raise errors.CheckpointNotFoundError(f"no committed checkpoint for step {step} in {self.uri}",
                                                 path=self.uri)
        local = tempfile.mkdtemp(prefix=f"{_STAGE_PREFIX}{os.getpid()}-fetch-", dir=self.staging_dir)
        try:
            present = {obj["Key"][len(self.key(name)) + 1:] for obj in self._list(self.key(name) + "/")}
            for leaf in (MANIFEST, SIGNATURE):
                if leaf in present:
                    self._download(self.key(name, leaf), os.path.join(local, leaf))
            for leaf in manifest_shards(os.path.join(local, MANIFEST)):
                if leaf in present:  # a missing shard is for validation to report
                    self._download(self.key(name, leaf), os.path.join(local, leaf))
            yield local
        finally:
            _remove_tree(local)

    def _download(self, key: str, path: str) -> None:
        try:
            self.client.download_file(self.bucket, key, path)
        except (*_s3_errors(), OSError) as e:
            raise _s3_error(e, f"download of {key}", self.uri) from None

    def _delete_keys(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start:start + 1000]]
            try:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            except _s3_errors() as e:
                raise _s3_error(e, "delete", self.uri) from None

    def delete(self, step: int) -> None:
        name = step_name(step)
        self._delete_keys([self.key(name, COMMITTED)])  # invisible from here on
        self._delete_keys([obj["Key"] for obj in self._list(self.key(name) + "/")])

    def quarantine(self, step: int) -> str:
        """An invalid committed step: its marker is removed (its objects are cleaned up at the next start)."""
        self._delete_keys([self.key(step_name(step), COMMITTED)])
        return f"s3://{self.bucket}/{self.key(step_name(step))}"

    def incomplete_uploads(self) -> list[tuple[str, str]]:
        """(key, upload id) of every multipart upload under the prefix that was never completed."""
        found = []
        try:
            paginator = self.client.get_paginator("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.key("")):
                found += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]
        except _s3_errors() as e:
            raise _s3_error(e, "list uploads", self.uri) from None
        return found

    def cleanup(self) -> list[str]:
        removed = []
        for key, upload_id in self.incomplete_uploads():
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except _s3_errors() as e:
                if _error_code(e) == "NoSuchUpload":
                    continue  # aborted or completed since it was listed (e.g. by the writer it belonged to)
                raise _s3_error(e, f"abort upload of {key}", self.uri) from None
            removed.append(f"upload {upload_id} of s3://{self.bucket}/{key}")
        seen, committed = self._steps()
        for step in sorted(seen - committed):
            keys = [obj["Key"] for obj in self._list(self.key(step_name(step)) + "/")]
            self._delete_keys(keys)
            removed += [f"s3://{self.bucket}/{k}" for k in keys]
        for entry in os.scandir(self.staging_dir):
            pid = entry.name[len(_STAGE_PREFIX):].split("-", 1)[0]
            if entry.name.startswith(_STAGE_PREFIX) and pid.isdigit() and not _pid_alive(int(pid)):
                _remove_tree(entry.path)
                removed.append(entry.path)
        return removed


def _s3_errors() -> tuple[type[Exception], ...]:
    """What boto3 raises (imported late: botocore costs ~0.1 s, and local roots never need it)."""
    import botocore.exceptions

    return (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)


def _error_code(e: Exception) -> str:
    response = getattr(e, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))
