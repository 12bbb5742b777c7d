"""Steps as prefixes in an S3 bucket: parallel multipart uploads, then a marker PUT with If-None-Match."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import datetime
import email.utils
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from SneppX_ALG import _native, errors
from SneppX_ALG.storage import base, lease

LEASE_FORMAT = "sneppx.lease"


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

    Every key this object lists, writes or deletes is under `prefix + "/"` (`key()` builds them all), and
    within it only `step-NNNNNNNNN/...`, `.lease-*`, set-aside steps (`.invalid-step-*/...`,
    `.abandoned-step-*/...`) and the coordinator's records (`FENCE`): a root `s3://bkt/jobs/a` never touches
    `jobs/ab/...`, and a bucket root (`s3://bkt`) owns just those keys at the top of the bucket, nothing else.
    """

    def __init__(self, uri: str, *, client: Any = None, staging_dir: str | None = None,
                 part_bytes: int = 16 << 20, threads: int = 4, lease_expiry_s: float = lease.LEASE_EXPIRY_S):
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = parse_s3_uri(self.uri)
        self.client = client if client is not None else make_s3_client(max_connections=max(16, 2 * threads))
        self.staging_dir = staging_dir or os.path.join(tempfile.gettempdir(), "sneppx-staging")
        self.part_bytes = max(5 << 20, part_bytes)  # S3's minimum part size (except the last)
        self.threads = max(1, threads)
        os.makedirs(self.staging_dir, exist_ok=True)
        self.lease = lease.WriterLease(publish=self._publish_lease, refresh=self._publish_lease,
                                       withdraw=self._withdraw_lease, expiry_s=lease_expiry_s)

    def key(self, *parts: str) -> str:
        """`<prefix>/<parts joined by "/">` (no prefix: the parts alone)."""
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _step_of(self, key: str) -> int | None:
        """The step a key of this root belongs to (`<prefix>/step-NNNNNNNNN/...`), else None."""
        root = self.key("")
        if root and not key.startswith(root + "/"):
            return None
        step_dir, slash, _ = key[len(root) + 1 if root else 0:].partition("/")
        return base.parse_step_name(step_dir) if slash else None

    def _list_pages(self, prefix: str) -> Iterator[dict[str, Any]]:
        try:
            paginator = self.client.get_paginator("list_objects_v2")
            yield from paginator.paginate(Bucket=self.bucket, Prefix=prefix)
        except _s3_errors() as e:
            raise _s3_error(e, "list", self.uri) from None

    def _list(self, prefix: str) -> Iterator[dict[str, Any]]:
        for page in self._list_pages(prefix):
            yield from page.get("Contents", [])

    def _steps(self) -> tuple[set[int], set[int]]:
        """(all steps with any object, steps with a commit marker)."""
        seen, committed = set(), set()
        for obj in self._list(self.key("step-")):
            step = self._step_of(obj["Key"])
            if step is None:
                continue
            seen.add(step)
            if obj["Key"] == self.key(base.step_name(step), base.COMMITTED):
                committed.add(step)
        return seen, committed

    def committed_steps(self) -> list[int]:
        return sorted(self._steps()[1])

    # -- the writer's lease (storage/lease.py) --

    def _lease_key(self, writer: str) -> str:
        return self.key(lease.LEASE_PREFIX + writer)

    def _publish_lease(self) -> None:
        owner = self.lease.owner()
        record = {"format": LEASE_FORMAT, "writer": owner.writer, "host": owner.host, "pid": owner.pid,
                  "pid_start": owner.pid_start, "steps": sorted(self.lease.steps),
                  "expiry_s": self.lease.expiry_s}
        self._put(self._lease_key(owner.writer), json.dumps(record, sort_keys=True).encode())

    def _withdraw_lease(self) -> None:
        self._delete_keys([self._lease_key(self.lease.writer)])

    def _leases(self) -> list[tuple[str, lease.Claim | None, float]]:
        """(key, claim or None if unreadable, age by the server's clock) of every lease under the root."""
        found = []
        for page in self._list_pages(self.key(lease.LEASE_PREFIX)):
            date = page.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
            now = email.utils.parsedate_to_datetime(date) if date else datetime.datetime.now(datetime.UTC)
            for obj in page.get("Contents", []):
                got = self._get(obj["Key"])
                claim = _parse_lease(got[0]) if got is not None else None
                found.append((obj["Key"], claim, max(0.0, (now - obj["LastModified"]).total_seconds())))
        return found

    # -- writing a step --

    def begin(self, step: int) -> base.PendingStep:
        self.lease.hold(step)  # before anything of the step is uploaded
        try:
            local = tempfile.mkdtemp(prefix=f"{base.STAGE_PREFIX}{os.getpid()}-{step:09d}-",
                                     dir=self.staging_dir)
        except BaseException:
            self.lease.release(step)
            raise
        return base.PendingStep(step=step, local_dir=local)

    def finalize(self, pending: base.PendingStep, manifest: bytes, signature: bytes | None = None) -> str:
        """Uploads the shards the manifest names, creates manifest.json (If-None-Match: the first writer of a
        step owns it), puts manifest.sig, checks that every object is on the server as uploaded (size and
        ETag), then creates `COMMITTED` (If-None-Match): the commit point.

        On failure, what this writer uploaded is deleted unless another writer may own those keys now (it
        created the manifest or the marker first, or changed an object since), or unless the commit's outcome
        is unknown (CommitUnknownError): then the next cleanup removes them if no marker appears."""
        name = base.step_name(pending.step)
        marker = self.key(name, base.COMMITTED)
        uploaded: dict[str, tuple[int, str]] = {}  # key -> (size, ETag) as the server acknowledged it
        try:
            if self._exists(marker):
                raise errors.CheckpointExistsError(f"s3://{self.bucket}/{marker} exists; a step is never "
                                                   "overwritten", path=self.uri)
            for shard in base.manifest_shards(manifest):
                path = os.path.join(pending.local_dir, shard)
                if not os.path.isfile(path):
                    raise errors.StorageError(f"{path}, named by the manifest, was not written", path=path)
                key = self.key(name, shard)
                uploaded[key] = (os.path.getsize(path), self.upload_file(path, key))
            key = self.key(name, base.MANIFEST)
            etag = self._create(key, manifest)
            if etag is None:
                uploaded.clear()  # another writer's step: the shard keys may hold its objects now; keep them
                raise errors.CheckpointExistsError(
                    f"s3://{self.bucket}/{key} is another writer's (committed, being committed, or left by "
                    "an interrupted save that cleanup will remove)", path=self.uri)
            uploaded[key] = (len(manifest), etag)
            if signature is not None:  # before the marker: a committed signed step always has its signature
                key = self.key(name, base.SIGNATURE)
                uploaded[key] = (len(signature), self._put(key, signature))
            self._check_parts(name, uploaded)
            if self._create(marker, base.commit_record(pending.step, self.lease.writer, manifest)) is None:
                uploaded.clear()
                raise errors.CheckpointExistsError(
                    f"s3://{self.bucket}/{marker} was committed by another writer", path=self.uri)
        except errors.CommitUnknownError:
            raise  # the marker may be there: the parts stay
        except BaseException:
            with contextlib.suppress(errors.StorageError):  # best effort: cleanup() gets the rest
                self._delete_keys(list(uploaded))
            raise
        finally:
            base.remove_tree(pending.local_dir)
            self.lease.release(pending.step)
        return f"s3://{self.bucket}/{self.key(name)}"

    def _check_parts(self, name: str, uploaded: dict[str, tuple[int, str]]) -> None:
        """Every object this writer uploaded for the step is on the server with the size and ETag it was given
        (none removed by a cleanup that judged this writer gone, none replaced by another writer)."""
        present = {obj["Key"]: (obj["Size"], obj["ETag"].strip('"'))
                   for obj in self._list(self.key(name) + "/")}
        for key, (size, etag) in uploaded.items():
            if key not in present:
                raise errors.StorageError(f"s3://{self.bucket}/{key} is gone before the commit (removed by a "
                                          "cleanup that judged this writer gone?)", path=self.uri)
            if present[key] != (size, etag.strip('"')):
                uploaded.clear()  # someone else's object now: delete nothing
                raise errors.StorageError(f"s3://{self.bucket}/{key} was replaced before the commit (another "
                                          "writer of the same step?)", path=self.uri)

    def _create(self, key: str, body: bytes) -> str | None:
        """PUTs `body` at `key` only if no object is there (If-None-Match: *). Returns the ETag when the
        object there is ours, None when it is someone else's.

        An answer that doesn't say (a timeout or reset after the request went out, a 5xx, or a 412 that may
        be the retry of our own applied PUT) is settled by reading the key back: our bytes -> ours; other
        bytes -> someone else's; nothing there -> the PUT did not happen (its error is raised). If that read
        fails too: CommitUnknownError."""
        try:
            return self._put(key, body, if_none_match=True)
        except errors.CheckpointExistsError:
            failure: errors.StorageError | None = None
        except errors.StorageError as e:
            failure = e
        try:
            current = self._get(key)
        except errors.StorageError as e:
            why = failure or "412 Precondition Failed"
            raise errors.CommitUnknownError(f"s3://{self.bucket}/{key}: the PUT's outcome is unknown ({why}) "
                                            f"and reading it back failed ({e})", path=self.uri) from None
        if current is None:
            if failure is not None:
                raise failure
            return None  # there a moment ago (412), gone now: not ours
        return current[1] if current[0] == body else None

    def abort(self, pending: base.PendingStep) -> None:
        base.remove_tree(pending.local_dir)
        self.lease.release(pending.step)

    def _exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
            return True
        except _s3_errors() as e:
            if _error_code(e) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise _s3_error(e, "head", self.uri) from None

    def _get(self, key: str, *, limit: int | None = None) -> tuple[bytes, str] | None:
        """(body, ETag) of a small object (its first `limit` bytes), or None if there is none."""
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=key)
            return response["Body"].read(limit), response["ETag"]
        except _s3_errors() as e:
            if _error_code(e) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise _s3_error(e, f"get {key}", self.uri) from None

    def _put(self, key: str, body: bytes, *, if_none_match: bool = False) -> str:
        """PUTs one object; returns its ETag."""
        extra = {"IfNoneMatch": "*"} if if_none_match else {}
        try:
            response = self.client.put_object(Bucket=self.bucket, Key=key, Body=body,
                                              ChecksumCRC32C=_crc32c_b64(body), **extra)
        except _s3_errors() as e:
            conflict = _error_code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict")
            if if_none_match and conflict:
                raise errors.CheckpointExistsError(f"s3://{self.bucket}/{key} was written by another writer",
                                                   path=self.uri) from None
            raise _s3_error(e, f"put {key}", self.uri) from None
        return str(response["ETag"])

    def upload_file(self, path: str, key: str) -> str:
        """Uploads one local file: a single PUT when small, else parallel multipart with per-part CRC32C.
        A failed multipart upload is aborted before the error propagates. Returns the object's ETag."""
        size = os.path.getsize(path)
        if size <= self.part_bytes:
            with open(path, "rb") as f:
                return self._put(key, f.read())
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
            response = self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                             MultipartUpload={"Parts": parts})
            return str(response["ETag"])
        except BaseException as e:  # abort on anything, then re-raise
            with contextlib.suppress(*_s3_errors()):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            if isinstance(e, Exception) and not isinstance(e, errors.SneppXError):
                raise _s3_error(e, f"upload of {key}", self.uri) from None
            raise
        finally:
            os.close(fd)

    # -- reading and deleting --

    @contextlib.contextmanager
    def open_step(self, step: int) -> Iterator[str]:
        """Downloads a committed step (manifest, signature and the shards the manifest names) into a temporary
        local directory named like the step, for reading and validation; its marker goes next to it
        (base.fetched_marker_path), where validation checks it against the manifest."""
        name = base.step_name(step)
        marker = self._get(self.key(name, base.COMMITTED))
        if marker is None:
            raise errors.CheckpointNotFoundError(f"no committed checkpoint for step {step} in {self.uri}",
                                                 path=self.uri)
        fetched = tempfile.mkdtemp(prefix=f"{base.STAGE_PREFIX}{os.getpid()}-fetch-", dir=self.staging_dir)
        local = os.path.join(fetched, name)
        try:
            os.mkdir(local)
            with open(base.fetched_marker_path(local), "wb") as f:
                f.write(marker[0])
            present = {obj["Key"][len(self.key(name)) + 1:] for obj in self._list(self.key(name) + "/")}
            for leaf in (base.MANIFEST, base.SIGNATURE):
                if leaf in present:
                    self._download(self.key(name, leaf), os.path.join(local, leaf))
            manifest = b""
            with contextlib.suppress(FileNotFoundError), open(os.path.join(local, base.MANIFEST), "rb") as f:
                manifest = f.read(base.MAX_MANIFEST_BYTES + 1)
            for leaf in base.manifest_shards(manifest):
                if leaf in present:  # a missing shard is for validation to report
                    self._download(self.key(name, leaf), os.path.join(local, leaf))
            yield local
        finally:
            base.remove_tree(fetched)

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

    # -- setting steps aside, and records at the root (coordinator/timeline.py) --

    def set_aside(self, step: int, reason: str) -> str:
        """Moves a committed step out of the step namespace: its objects are copied (server-side) under
        `.<reason>-step-...`, then its marker is deleted (invisible as a step from then on), then the rest,
        manifest.json included, so the step's number can be saved again (its manifest is created with
        If-None-Match). S3 has no rename; a crash part-way leaves the step committed (and a partial copy that
        retention bounds like any set-aside step), or objects of an uncommitted step that cleanup removes."""
        name, aside = base.step_name(step), base.set_aside_name(step, reason)
        keys = [obj["Key"] for obj in self._list(self.key(name) + "/")]
        marker = self.key(name, base.COMMITTED)
        if marker not in keys:
            raise errors.CheckpointNotFoundError(f"no committed checkpoint for step {step} in {self.uri}",
                                                 path=self.uri)
        for key in keys:
            target = self.key(aside, key[len(self.key(name)) + 1:])
            try:
                self.client.copy({"Bucket": self.bucket, "Key": key}, self.bucket, target)
            except _s3_errors() as e:
                raise _s3_error(e, f"copy of {key}", self.uri) from None
        self._delete_keys([marker])
        self._delete_keys([k for k in keys if k != marker])
        return f"s3://{self.bucket}/{self.key(aside)}"

    def set_aside_steps(self) -> list[tuple[int, str]]:
        """(step, name) of every set-aside step of this root (listed by their own prefixes only), including a
        copy a killed process left as incomplete multipart uploads (large objects are copied in parts): so
        retention bounds those too, and cleanup, which can't tell them from a live copy, never has to."""
        found = set()
        root = self.key("")
        for reason in base.SET_ASIDE_REASONS:
            prefix = self.key(f".{reason}-step-")
            keys = [obj["Key"] for obj in self._list(prefix)] + [key for key, _ in self._uploads(prefix)]
            for key in keys:
                name = key[len(root) + 1 if root else 0:].partition("/")[0]
                step = base.parse_set_aside_name(name)
                if step is not None:
                    found.add((step, name))
        return sorted(found)

    def remove_set_aside(self, name: str) -> None:
        """Removes a set-aside step: its incomplete uploads (a copy cut short), then its objects."""
        if base.parse_set_aside_name(name) is None:
            raise ValueError(f"{name!r} is not a set-aside step")
        prefix = self.key(name) + "/"
        for key, upload_id in self._uploads(prefix):
            self._abort_upload(key, upload_id)
        self._delete_keys([obj["Key"] for obj in self._list(prefix)])

    def read_record(self, name: str) -> bytes | None:
        got = self._get(self.key(name), limit=base.MAX_MANIFEST_BYTES + 1)
        return None if got is None else got[0]

    def write_record(self, name: str, data: bytes) -> None:
        self._put(self.key(name), data)

    def remove_record(self, name: str) -> None:
        self._delete_keys([self.key(name)])

    def _uploads(self, prefix: str) -> list[tuple[str, str]]:
        """(key, upload id) of every multipart upload under `prefix` that was never completed."""
        found = []
        try:
            paginator = self.client.get_paginator("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                found += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]
        except _s3_errors() as e:
            raise _s3_error(e, "list uploads", self.uri) from None
        return found

    def _abort_upload(self, key: str, upload_id: str) -> bool:
        """Aborts an upload; False when it is gone already (aborted or completed since it was listed)."""
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except _s3_errors() as e:
            if _error_code(e) == "NoSuchUpload":
                return False
            raise _s3_error(e, f"abort upload of {key}", self.uri) from None
        return True

    def incomplete_uploads(self) -> list[tuple[str, str]]:
        """(key, upload id) of every multipart upload of this root's steps that was never completed."""
        return [(key, upload_id) for key, upload_id in self._uploads(self.key("step-"))
                if self._step_of(key) is not None]

    def cleanup(self) -> list[str]:
        """Removes what crashed or failed saves left, where no live writer claims the step (storage/lease.py):
        incomplete multipart uploads, objects of steps without a marker, abandoned leases, and staging
        directories of dead processes on this machine.

        Uploads and steps are listed before the leases are read: a writer publishes its claim before it
        uploads anything of a step and withdraws it only after the step's marker is written or its uploads
        ended, so whatever was listed either is claimed in what is read next or has a marker by now (looked
        up again just before a step's objects are deleted)."""
        uploads = self.incomplete_uploads()
        seen, committed = self._steps()
        leases = self._leases()
        claimed: set[int] = set()
        for _, claim, age in leases:
            if claim is not None:
                claimed |= claim.standing(age)
        removed = []
        for key, upload_id in uploads:
            if self._step_of(key) in claimed:
                continue
            if not self._abort_upload(key, upload_id):
                continue  # aborted or completed since it was listed (e.g. by the writer it belonged to)
            removed.append(f"upload {upload_id} of s3://{self.bucket}/{key}")
        for step in sorted(seen - committed - claimed):
            if self._exists(self.key(base.step_name(step), base.COMMITTED)):
                continue  # committed since it was listed
            keys = [obj["Key"] for obj in self._list(self.key(base.step_name(step)) + "/")]
            self._delete_keys(keys)
            removed += [f"s3://{self.bucket}/{k}" for k in keys]
        for key, claim, age in leases:
            if claim is None or claim.is_abandoned(age):
                self._delete_keys([key])
                removed.append(f"s3://{self.bucket}/{key}")
        for entry in os.scandir(self.staging_dir):
            pid = entry.name[len(base.STAGE_PREFIX):].split("-", 1)[0]
            if entry.name.startswith(base.STAGE_PREFIX) and pid.isdigit() and not base.pid_alive(int(pid)):
                base.remove_tree(entry.path)
                removed.append(entry.path)
        return removed

    # -- what `sneppx ls` shows --

    def inventory(self) -> list[base.Entry]:
        """Every step-like prefix under the root (storage.Entry), from one listing: a step is committed when
        its marker is there. Its files' sizes; nothing is read."""
        root = self.key("")
        strip = len(root) + 1 if root else 0
        files: dict[str, dict[str, int]] = {}
        for obj in self._list(root + "/" if root else ""):
            name, slash, leaf = obj["Key"][strip:].partition("/")
            if slash and leaf and base.classify_entry(name) is not None:
                files.setdefault(name, {})[leaf] = int(obj["Size"])
        found = []
        for name, held in files.items():
            step, state = base.classify_entry(name)  # type: ignore[misc]
            if state == "committed" and base.COMMITTED not in held:
                state = "uncommitted"
            found.append(base.Entry(name, step, state, held))
        return found

    def read_entry_file(self, name: str, leaf: str) -> bytes | None:
        """A small object (manifest, signature, marker) of an inventory entry, or None when it has none."""
        if base.classify_entry(name) is None or not base.is_plain_name(leaf):
            raise ValueError(f"{name}/{leaf} is not a file of a step")
        found = self._get(self.key(name, leaf))
        return None if found is None else found[0]


def _parse_lease(raw: bytes) -> lease.Claim | None:
    """The claim a lease object records, or None when it is not one (it then claims nothing)."""
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not (isinstance(record, dict) and record.get("format") == LEASE_FORMAT
            and isinstance(record.get("writer"), str) and isinstance(record.get("host"), str)
            and isinstance(record.get("pid"), int) and isinstance(record.get("pid_start"), (int, type(None)))
            and isinstance(record.get("steps"), list) and all(isinstance(s, int) for s in record["steps"])
            and isinstance(record.get("expiry_s"), (int, float))):
        return None
    owner = lease.Owner(record["writer"], record["host"], record["pid"], record["pid_start"])
    return lease.Claim(owner, frozenset(record["steps"]), float(record["expiry_s"]))


def _s3_errors() -> tuple[type[Exception], ...]:
    """What boto3 raises (imported late: botocore costs ~0.1 s, and local roots never need it)."""
    import botocore.exceptions

    return (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)


def _error_code(e: Exception) -> str:
    response = getattr(e, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))
