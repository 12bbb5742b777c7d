"""An S3 prefix: checkpoint steps (parallel multipart uploads, then a marker PUT with If-None-Match), and
compare-and-swap records (conditional PUTs: If-None-Match to create, If-Match on the ETag to swap)."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

from SneppX_ALG import _native, errors
from SneppX_ALG.storage import base, record


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
        step_prefix = self.key("step-")
        strip = len(self.key("")) + 1 if self.prefix else 0
        for obj in self._list(step_prefix):
            step_dir, _, leaf = obj["Key"][strip:].partition("/")
            step = base.parse_step_name(step_dir)
            if step is None:
                continue
            seen.add(step)
            if leaf == base.COMMITTED:
                committed.add(step)
        return seen, committed

    def committed_steps(self) -> list[int]:
        return sorted(self._steps()[1])

    def begin(self, step: int) -> base.PendingStep:
        local = tempfile.mkdtemp(prefix=f"{base.STAGE_PREFIX}{os.getpid()}-{step:09d}-", dir=self.staging_dir)
        return base.PendingStep(step=step, local_dir=local)

    def finalize(self, pending: base.PendingStep, manifest: bytes, signature: bytes | None = None) -> str:
        name = base.step_name(pending.step)
        marker = self.key(name, base.COMMITTED)
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
            self._put(self.key(name, base.MANIFEST), manifest)
            uploaded.append(self.key(name, base.MANIFEST))
            if signature is not None:  # before the marker: a committed signed step always has its signature
                self._put(self.key(name, base.SIGNATURE), signature)
                uploaded.append(self.key(name, base.SIGNATURE))
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
            base.remove_tree(pending.local_dir)
        return f"s3://{self.bucket}/{self.key(name)}"

    def abort(self, pending: base.PendingStep) -> None:
        base.remove_tree(pending.local_dir)

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
        name = base.step_name(step)
        if not self._exists(self.key(name, base.COMMITTED)):
            raise errors.CheckpointNotFoundError(f"no committed checkpoint for step {step} in {self.uri}",
                                                 path=self.uri)
        local = tempfile.mkdtemp(prefix=f"{base.STAGE_PREFIX}{os.getpid()}-fetch-", dir=self.staging_dir)
        try:
            present = {obj["Key"][len(self.key(name)) + 1:] for obj in self._list(self.key(name) + "/")}
            for leaf in (base.MANIFEST, base.SIGNATURE):
                if leaf in present:
                    self._download(self.key(name, leaf), os.path.join(local, leaf))
            for leaf in manifest_shards(os.path.join(local, base.MANIFEST)):
                if leaf in present:  # a missing shard is for validation to report
                    self._download(self.key(name, leaf), os.path.join(local, leaf))
            yield local
        finally:
            base.remove_tree(local)

    def _download(self, key: str, path: str) -> None:
        try:
            self.client.download_file(self.bucket, key, path)
        except (*_s3_errors(), OSError) as e:
            raise _s3_error(e, f"download of {key}", self.uri) from None

    def _delete_keys(self, keys: list[str]) -> None:
        """Deletes keys in batches. A key the server could not delete comes back in the Errors of a 200
        response, not as an exception: it fails the call (a step whose marker survived stays committed)."""
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start:start + 1000]]
            try:
                failed = self.client.delete_objects(Bucket=self.bucket,
                                                    Delete={"Objects": batch, "Quiet": True}).get("Errors")
            except _s3_errors() as e:
                raise _s3_error(e, "delete", self.uri) from None
            if failed:
                raise errors.StorageError(f"S3 delete failed for {self.uri}: " + ", ".join(
                    f"{f.get('Key')} ({f.get('Code')}: {f.get('Message')})" for f in failed), path=self.uri)

    def delete(self, step: int) -> None:
        name = base.step_name(step)
        self._delete_keys([self.key(name, base.COMMITTED)])  # invisible from here on
        self._delete_keys([obj["Key"] for obj in self._list(self.key(name) + "/")])

    def quarantine(self, step: int) -> str:
        """An invalid committed step: its marker is removed (its objects are cleaned up at the next start)."""
        self._delete_keys([self.key(base.step_name(step), base.COMMITTED)])
        return f"s3://{self.bucket}/{self.key(base.step_name(step))}"

    def incomplete_uploads(self) -> list[tuple[str, str]]:
        """(key, upload id) of every multipart upload of a step under this root that was never completed."""
        found = []
        try:
            paginator = self.client.get_paginator("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.key("step-")):  # not exp10/ for exp1
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
            keys = [obj["Key"] for obj in self._list(self.key(base.step_name(step)) + "/")]
            self._delete_keys(keys)
            removed += [f"s3://{self.bucket}/{k}" for k in keys]
        for entry in os.scandir(self.staging_dir):
            pid = entry.name[len(base.STAGE_PREFIX):].split("-", 1)[0]
            if entry.name.startswith(base.STAGE_PREFIX) and pid.isdigit() and not base.pid_alive(int(pid)):
                base.remove_tree(entry.path)
                removed.append(entry.path)
        return removed


class S3RecordStore:
    """Compare-and-swap records as objects under an S3 prefix.

    S3 decides every condition itself (strongly consistent since 2020, conditional writes since 2024): a
    create is PutObject with `If-None-Match: *`, a swap is PutObject with `If-Match: <ETag>`, and of
    concurrent conditional writes to one key the first to finish wins and the others get 412. The version
    of a record is its ETag (a digest of its bytes for a plain PUT). A 409 (`ConditionalRequestConflict`,
    two conditional writes in flight at once) is a conflict as well: read again.
    """

    def __init__(self, uri: str, *, client: Any = None):
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = parse_s3_uri(self.uri)
        self.client = client if client is not None else make_s3_client()

    def _key(self, key: str) -> str:
        record.check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def create(self, key: str, value: Mapping[str, Any]) -> record.Record:
        data = record.encode(key, value)
        try:
            response = self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data,
                                              ChecksumCRC32C=_crc32c_b64(data), IfNoneMatch="*")
        except _s3_errors() as e:
            if _error_code(e) in CONDITION_FAILED:
                raise errors.RecordExistsError(f"{key} exists", key=key) from None
            raise _record_error(e, "create", key) from None
        return record.Record(key, record.decode(key, data), str(response["ETag"]))

    def read(self, key: str) -> record.Record | None:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except _s3_errors() as e:
            if _error_code(e) in NOT_FOUND:
                return None
            raise _record_error(e, "read", key) from None
        body = response["Body"]
        try:
            if int(response.get("ContentLength") or 0) > record.MAX_RECORD_BYTES:
                raise errors.RecordCorruptError(f"{key} is {response['ContentLength']} bytes, over "
                                                f"{record.MAX_RECORD_BYTES}", key=key)
            data = body.read(record.MAX_RECORD_BYTES + 1)
        except _s3_errors() as e:
            raise _record_error(e, "read", key) from None
        finally:
            body.close()
        return record.Record(key, record.decode(key, data), str(response["ETag"]))

    def swap(self, key: str, value: Mapping[str, Any], version: str) -> record.Record:
        data = record.encode(key, value)
        if not isinstance(version, str) or not version:
            raise errors.RecordValueError(f"{version!r} is not a version of this store", key=key)
        try:
            response = self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data,
                                              ChecksumCRC32C=_crc32c_b64(data), IfMatch=version)
        except _s3_errors() as e:
            if _error_code(e) in CONDITION_FAILED + NOT_FOUND:
                raise errors.RecordConflictError(f"{key} is no longer at version {version}", key=key) from None
            raise _record_error(e, "swap", key) from None
        return record.Record(key, record.decode(key, data), str(response["ETag"]))

    def keys(self, prefix: str = "", *, limit: int | None = None) -> list[str]:
        record.check_prefix(prefix)
        record.check_limit(limit)
        strip = len(self.prefix) + 1 if self.prefix else 0
        found: list[str] = []
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._key(prefix[:-1]) + "/" if prefix
                                  else (self.prefix + "/" if self.prefix else "")}
        try:
            while True:
                if limit is not None:
                    kwargs["MaxKeys"] = min(1000, limit - len(found))
                page = self.client.list_objects_v2(**kwargs)
                for obj in page.get("Contents", []):
                    key = obj["Key"][strip:]
                    with contextlib.suppress(errors.RecordValueError):  # not a record's key: not ours
                        record.check_key(key)
                        found.append(key)
                if not page.get("IsTruncated") or (limit is not None and len(found) >= limit):
                    break
                kwargs["ContinuationToken"] = page["NextContinuationToken"]
        except _s3_errors() as e:
            raise _record_error(e, "list", prefix) from None
        return found[:limit] if limit is not None else found

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except _s3_errors() as e:
            if _error_code(e) not in NOT_FOUND:
                raise _record_error(e, "delete", key) from None


CONDITION_FAILED = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")
NOT_FOUND = ("404", "NoSuchKey", "NotFound")
TRANSIENT_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                             "RequestTimeTooSkewed", "ServiceUnavailable", "InternalError"})


def _record_error(e: Exception, what: str, key: str) -> errors.RecordStoreError:
    """A transient failure (no answer, 5xx, throttling) or another refusal of the store."""
    import botocore.exceptions

    status = int((getattr(e, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    transient = (isinstance(e, botocore.exceptions.ConnectionError | botocore.exceptions.HTTPClientError)
                 or status >= 500 or _error_code(e) in TRANSIENT_CODES)
    kind = errors.RecordUnavailableError if transient else errors.RecordStoreError
    return kind(f"S3 {what} of {key or '/'} failed: {e}", key=key)


def _s3_errors() -> tuple[type[Exception], ...]:
    """What boto3 raises (imported late: botocore costs ~0.1 s, and local roots never need it)."""
    import botocore.exceptions

    return (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)


def _error_code(e: Exception) -> str:
    response = getattr(e, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def manifest_shards(path: str) -> list[str]:
    """The plain shard names a fetched manifest lists ([] when it is missing or unreadable: validating the
    step then says what is wrong). Only these are fetched, so an odd key under a step prefix can't name a
    local path."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(base.MAX_MANIFEST_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return []
    shards = doc.get("shards") if isinstance(doc, dict) else None
    if not isinstance(shards, list):
        return []
    return [s for s in shards if isinstance(s, str) and base.is_plain_name(s) and s not in (base.MANIFEST, base.SIGNATURE,
                                                                                       base.COMMITTED)]
