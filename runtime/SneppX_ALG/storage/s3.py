"""An S3 prefix's checkpoint steps: parallel multipart uploads, then a marker PUT with If-None-Match (the commit
story is the package docstring's). Its records are records/s3.py's.

One concept, the `Storage` Protocol over S3 (writing, reading, setting aside, cleaning up and listing steps),
so it stays one module past 500 lines; how one object goes up in parts is storage/s3_upload.py's, the lease
object's codec is lease.py's and the client is _s3.py's."""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import os
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from SneppX_ALG import _fs, _s3, errors
from SneppX_ALG.storage import base, layout, lease, s3_upload


class S3Storage:
    """Steps as prefixes in a bucket; a shard streams up in parts as it is written (s3_upload.StreamingUpload, via
    shard_sink), or, where it can't (a signed step, a key already taken), is written to a local staging
    directory, then uploaded: parts go up in parallel straight from the page cache, each with its CRC32C for
    the server to check.

    Every key this object lists, writes or deletes is under `prefix + "/"` (`key()` builds them all), and
    within it only `step-NNNNNNNNN/...`, `.lease-*`, set-aside steps (`.invalid-step-*/...`,
    `.abandoned-step-*/...`) and the coordinator's records (`FENCE`, `ROLLBACK`): a root `s3://bkt/jobs/a` never
    touches `jobs/ab/...`, and a bucket root (`s3://bkt`) owns just those keys at the top of the bucket, nothing else.
    """

    def __init__(self, uri: str, *, client: Any = None, staging_dir: str | None = None,
                 part_bytes: int = 16 << 20, threads: int = 4, lease_expiry_s: float = lease.LEASE_EXPIRY_S):
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = _s3.parse_s3_uri(self.uri)
        self.client = client if client is not None else _s3.make_s3_client(max_connections=max(16, 2 * threads))
        self.staging_dir = staging_dir or os.path.join(tempfile.gettempdir(), "sneppx-staging")
        self.part_bytes = max(5 << 20, part_bytes)  # S3's minimum part size (except the last)
        self.threads = max(1, threads)
        os.makedirs(self.staging_dir, exist_ok=True)
        self.lease = lease.WriterLease(publish=self._publish_lease, refresh=self._publish_lease,
                                       withdraw=self._withdraw_lease, expiry_s=lease_expiry_s)
        # Part buffers of streamed uploads, kept from one save to the next (fresh memory costs a page fault
        # per 4 KiB the first time it is written).
        self._buffers: list[bytearray] = []
        self._buffers_lock = threading.Lock()

    def key(self, *parts: str) -> str:
        """`<prefix>/<parts joined by "/">` (no prefix: the parts alone)."""
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _step_of(self, key: str) -> int | None:
        """The step a key of this root belongs to (`<prefix>/step-NNNNNNNNN/...`), else None."""
        root = self.key("")
        if root and not key.startswith(root + "/"):
            return None
        step_dir, slash, _ = key[len(root) + 1 if root else 0:].partition("/")
        return layout.parse_step_name(step_dir) if slash else None

    def _list_pages(self, prefix: str) -> Iterator[dict[str, Any]]:
        try:
            paginator = self.client.get_paginator("list_objects_v2")
            yield from paginator.paginate(Bucket=self.bucket, Prefix=prefix)
        except _s3.client_errors() as e:
            raise _s3.storage_error(e, "list", self.uri) from None

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
            if obj["Key"] == self.key(layout.step_name(step), layout.COMMITTED):
                committed.add(step)
        return seen, committed

    def committed_steps(self) -> list[int]:
        return sorted(self._steps()[1])

    # -- the writer's lease (storage/lease.py) --

    def _lease_key(self, writer: str) -> str:
        return self.key(lease.LEASE_PREFIX + writer)

    def _publish_lease(self) -> None:
        owner = self.lease.owner()
        self.put(self._lease_key(owner.writer), lease.encode_claim(owner, self.lease.steps, self.lease.expiry_s))

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
                claim = lease.parse_claim(got[0]) if got is not None else None
                found.append((obj["Key"], claim, max(0.0, (now - obj["LastModified"]).total_seconds())))
        return found

    # -- writing a step --

    def begin(self, step: int) -> base.PendingStep:
        """Claims `step` and makes a staging directory for its files. CheckpointExistsError when it is committed
        already: its objects are never overwritten (the keys of a new save would be the same)."""
        marker = self.key(layout.step_name(step), layout.COMMITTED)
        if self._exists(marker):
            raise errors.CheckpointExistsError(f"s3://{self.bucket}/{marker} exists; a step is never overwritten",
                                               path=self.uri)
        self.lease.hold(step)  # before anything of the step is uploaded
        try:
            local = tempfile.mkdtemp(prefix=f"{layout.STAGE_PREFIX}{os.getpid()}-{step:09d}-",
                                     dir=self.staging_dir)
        except BaseException:
            self.lease.release(step)
            raise
        return base.PendingStep(step=step, local_dir=local)

    def join(self, step: int, token: str) -> base.PendingStep:
        """Another rank's part of a step in flight: on S3 every rank stages and uploads its own files under its
        own claim (its lease names the step), so joining is beginning."""
        return self.begin(step)

    def upload(self, pending: base.PendingStep, names: list[str]) -> base.Parts:
        """Puts this rank's files under the step's prefix: {name: (size, ETag)}. A file shard_sink streamed is
        there already (its finished upload is taken as it is); any other is uploaded from its local_dir. They
        are recorded in pending.uploaded, so abort() takes them back."""
        name = layout.step_name(pending.step)
        parts: base.Parts = {}
        for leaf in names:
            key = self.key(name, leaf)
            sink = pending.streamed.get(leaf)
            if sink is not None:
                if sink.result is None:
                    raise errors.StorageError(f"s3://{self.bucket}/{key} was not finished", path=self.uri)
                pending.uploaded[key] = parts[leaf] = sink.result
                continue
            path = os.path.join(pending.local_dir, leaf)
            if not os.path.isfile(path):
                raise errors.StorageError(f"{path} was not written", path=path)
            size = os.path.getsize(path)
            etag = self.upload_file(path, key)
            pending.uploaded[key] = parts[leaf] = (size, etag)
        return parts

    def finalize(self, pending: base.PendingStep, manifest: bytes, signature: bytes | None,
                 parts: base.Parts) -> str:
        """Creates manifest.json (If-None-Match: the first writer of a step owns it), puts manifest.sig, checks
        that every rank's uploaded file is on the server as it was uploaded (size and ETag, from `parts`), then
        creates `COMMITTED` (If-None-Match): the commit point.

        On failure, what the step's ranks uploaded is deleted unless another writer may own those keys now (it
        created the manifest or the marker first, or changed an object since), or unless the commit's outcome
        is unknown (CommitUnknownError): then the next cleanup removes them if no marker appears."""
        name = layout.step_name(pending.step)
        marker = self.key(name, layout.COMMITTED)
        uploaded = {self.key(name, leaf): part for leaf, part in parts.items()}  # key -> (size, ETag)
        try:
            if self._exists(marker):
                raise errors.CheckpointExistsError(f"s3://{self.bucket}/{marker} exists; a step is never "
                                                   "overwritten", path=self.uri)
            missing = sorted(set(base.manifest_shards(manifest)) - set(parts))
            if missing:
                raise errors.StorageError(f"no rank reported uploading {', '.join(missing)}", path=self.uri)
            key = self.key(name, layout.MANIFEST)
            etag = self._create(key, manifest)
            if etag is None:
                uploaded.clear()  # another writer's step: the shard keys may hold its objects now; keep them
                raise errors.CheckpointExistsError(
                    f"s3://{self.bucket}/{key} is another writer's (committed, being committed, or left by "
                    "an interrupted save that cleanup will remove)", path=self.uri)
            uploaded[key] = (len(manifest), etag)
            if signature is not None:  # before the marker: a committed signed step always has its signature
                key = self.key(name, layout.SIGNATURE)
                uploaded[key] = (len(signature), self.put(key, signature))
            self._check_parts(name, uploaded)
            if self._create(marker, base.commit_record(pending.step, self.lease.writer, manifest)) is None:
                uploaded.clear()
                raise errors.CheckpointExistsError(
                    f"s3://{self.bucket}/{marker} was committed by another writer", path=self.uri)
        except errors.CommitUnknownError:
            raise  # the marker may be there: the parts stay
        except BaseException:
            pending.uploaded.clear()  # taken back here (or, if another writer owns the keys, not at all)
            with contextlib.suppress(errors.StorageError):  # best effort: cleanup() gets the rest
                self._delete_keys(list(uploaded))
            raise
        finally:
            self.leave(pending)
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
            return self.put(key, body, if_none_match=True)
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
        """Drops this rank's part of a step that will not commit: its open streams stopped (uploads aborted),
        what it put on the server deleted (best effort: cleanup gets the rest once no claim stands), its staging
        directory, its claim."""
        try:
            self._stop_streams(pending)
            name = layout.step_name(pending.step)
            uploaded = set(pending.uploaded) | {self.key(name, shard) for shard, sink in pending.streamed.items()
                                                if sink.result is not None}
            pending.uploaded = {}
            with contextlib.suppress(errors.StorageError):
                self._delete_keys(sorted(uploaded))
        finally:
            self.leave(pending)

    def leave(self, pending: base.PendingStep) -> None:
        """This rank is done with the step: its staging directory goes, its claim ends; its uploads stay. A
        stream still open is stopped: it can no longer be part of a commit."""
        try:
            self._stop_streams(pending)
        finally:
            pending.streamed.clear()
            _fs.remove_tree(pending.local_dir)
            self.lease.release(pending.step)

    @staticmethod
    def _stop_streams(pending: base.PendingStep) -> None:
        for sink in pending.streamed.values():
            sink.abort()  # nothing for a finished one

    def _exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
            return True
        except _s3.client_errors() as e:
            if _s3.error_code(e) in _s3.NOT_FOUND:
                return False
            raise _s3.storage_error(e, "head", self.uri) from None

    def _get(self, key: str, *, limit: int | None = None) -> tuple[bytes, str] | None:
        """(body, ETag) of a small object (its first `limit` bytes), or None if there is none."""
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=key)
            return response["Body"].read(limit), response["ETag"]
        except _s3.client_errors() as e:
            if _s3.error_code(e) in _s3.NOT_FOUND:
                return None
            raise _s3.storage_error(e, f"get {key}", self.uri) from None

    def put(self, key: str, body: bytes, *, if_none_match: bool = False) -> str:
        """PUTs one object; returns its ETag."""
        extra = {"IfNoneMatch": "*"} if if_none_match else {}
        try:
            response = self.client.put_object(Bucket=self.bucket, Key=key, Body=body,
                                              ChecksumCRC32C=_s3.crc32c_b64(body), **extra)
        except _s3.client_errors() as e:
            conflict = _s3.error_code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict")
            if if_none_match and conflict:
                raise errors.CheckpointExistsError(f"s3://{self.bucket}/{key} was written by another writer",
                                                   path=self.uri) from None
            raise _s3.storage_error(e, f"put {key}", self.uri) from None
        return str(response["ETag"])

    def upload_file(self, path: str, key: str) -> str:
        """Uploads one finished local file (s3_upload.upload_file); returns the object's ETag."""
        return s3_upload.upload_file(self, path, key)

    def shard_sink(self, pending: base.PendingStep, name: str) -> s3_upload.StreamingUpload | None:
        """A sink (checkpoint.file.Sink) that uploads shard `name` of a pending step in parts as a writer
        streams it: no local staging file. upload() reports the finished upload as the shard's.

        None (write a local file, put up by upload() when this rank's part is done) when the step has a marker or a
        manifest (committed, or being committed: finalize refuses it, and the coordinator may first set a
        committed step aside, copying its objects) or an object at this shard's key (another writer's, or
        left by a crash): a shard streamed there would replace it before those checks."""
        step = layout.step_name(pending.step)
        if any(self._exists(self.key(step, leaf)) for leaf in (layout.COMMITTED, layout.MANIFEST, name)):
            return None
        sink = s3_upload.StreamingUpload(self, self.key(step, name))
        pending.streamed[name] = sink
        return sink

    def take_buffer(self) -> bytearray:
        with self._buffers_lock:
            if self._buffers:
                return self._buffers.pop()
        return bytearray(self.part_bytes)

    def give_buffer(self, buffer: bytearray) -> None:
        """Keeps a part buffer for the next upload (at most threads + 2: what one upload holds at once)."""
        with self._buffers_lock:
            if len(self._buffers) < self.threads + 2 and len(buffer) == self.part_bytes:
                self._buffers.append(buffer)

    # -- reading and deleting --

    @contextlib.contextmanager
    def open_step(self, step: int) -> Iterator[str]:
        """Downloads a committed step (manifest, signature and the shards the manifest names) into a temporary
        local directory named like the step, for reading and validation; its marker goes next to it
        (layout.fetched_marker_path), where validation checks it against the manifest. Nothing of another step
        is fetched: an incremental step's referenced blocks are read through read_step, once its manifest has
        been authenticated and checked (a forged manifest costs no request for other steps' objects)."""
        name = layout.step_name(step)
        marker = self._get(self.key(name, layout.COMMITTED))
        if marker is None:
            raise errors.CheckpointNotFoundError(f"no committed checkpoint for step {step} in {self.uri}",
                                                 path=self.uri)
        fetched = tempfile.mkdtemp(prefix=f"{layout.STAGE_PREFIX}{os.getpid()}-fetch-", dir=self.staging_dir)
        local = os.path.join(fetched, name)
        try:
            os.mkdir(local)
            with open(layout.fetched_marker_path(local), "wb") as f:
                f.write(marker[0])
            present = {obj["Key"][len(self.key(name)) + 1:] for obj in self._list(self.key(name) + "/")}
            for leaf in (layout.MANIFEST, layout.SIGNATURE):
                if leaf in present:
                    self._download(self.key(name, leaf), os.path.join(local, leaf))
            manifest = b""
            with contextlib.suppress(FileNotFoundError), open(os.path.join(local, layout.MANIFEST), "rb") as f:
                manifest = f.read(layout.MAX_MANIFEST_BYTES + 1)
            for leaf in base.manifest_shards(manifest):
                if leaf in present:  # a missing shard is for validation to report
                    self._download(self.key(name, leaf), os.path.join(local, leaf))
            yield local
        finally:
            _fs.remove_tree(fetched)

    @contextlib.contextmanager
    def read_step(self, step: int) -> Iterator[base.StepReader]:
        """Ranged reads of a committed step's objects (GET with a Range header; nothing is downloaded whole
        but the manifest and its signature). The marker is read first: no marker, no step."""
        name = layout.step_name(step)
        marker = self._get(self.key(name, layout.COMMITTED))
        if marker is None:
            raise errors.CheckpointNotFoundError(f"no committed checkpoint for step {step} in {self.uri}",
                                                 path=self.uri)
        sizes = {obj["Key"][len(self.key(name)) + 1:]: int(obj["Size"]) for obj in self._list(self.key(name) + "/")}
        yield S3StepReader(self, name, marker[0], sizes)

    def _download(self, key: str, path: str) -> None:
        try:
            self.client.download_file(self.bucket, key, path)
        except _s3.client_errors() + (OSError,) as e:
            raise _s3.storage_error(e, f"download of {key}", self.uri) from None

    def _delete_keys(self, keys: list[str]) -> None:
        """Deletes keys in batches. A key the server could not delete comes back in the Errors of a 200
        response, not as an exception: it fails the call (a step whose marker survived stays committed)."""
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start:start + 1000]]
            try:
                failed = self.client.delete_objects(Bucket=self.bucket,
                                                    Delete={"Objects": batch, "Quiet": True}).get("Errors")
            except _s3.client_errors() as e:
                raise _s3.storage_error(e, "delete", self.uri) from None
            if failed:
                raise errors.StorageError(f"S3 delete failed for {self.uri}: " + ", ".join(
                    f"{f.get('Key')} ({f.get('Code')}: {f.get('Message')})" for f in failed), path=self.uri)

    def delete(self, step: int) -> None:
        name = layout.step_name(step)
        self._delete_keys([self.key(name, layout.COMMITTED)])  # invisible from here on
        self._delete_keys([obj["Key"] for obj in self._list(self.key(name) + "/")])

    # -- setting steps aside, and small files at the root (coordinator/timeline.py) --

    def set_aside(self, step: int, reason: str) -> str:
        """Moves a committed step out of the step namespace: its objects are copied (server-side) under
        `.<reason>-step-...`, then its marker is deleted (invisible as a step from then on), then the rest,
        manifest.json included, so the step's number can be saved again (its manifest is created with
        If-None-Match). S3 has no rename; a crash part-way leaves the step committed (and a partial copy that
        retention bounds like any set-aside step), or objects of an uncommitted step that cleanup removes."""
        name, aside = layout.step_name(step), layout.set_aside_name(step, reason)
        keys = [obj["Key"] for obj in self._list(self.key(name) + "/")]
        marker = self.key(name, layout.COMMITTED)
        if marker not in keys:
            raise errors.CheckpointNotFoundError(f"no committed checkpoint for step {step} in {self.uri}",
                                                 path=self.uri)
        for key in keys:
            target = self.key(aside, key[len(self.key(name)) + 1:])
            try:
                self.client.copy({"Bucket": self.bucket, "Key": key}, self.bucket, target)
            except _s3.client_errors() as e:
                raise _s3.storage_error(e, f"copy of {key}", self.uri) from None
        self._delete_keys([marker])
        self._delete_keys([k for k in keys if k != marker])
        return f"s3://{self.bucket}/{self.key(aside)}"

    def set_aside_steps(self) -> list[tuple[int, str]]:
        """(step, name) of every set-aside step of this root (listed by their own prefixes only), including a
        copy a killed process left as incomplete multipart uploads (large objects are copied in parts): so
        retention bounds those too, and cleanup, which can't tell them from a live copy, never has to."""
        found = set()
        root = self.key("")
        for reason in layout.SET_ASIDE_REASONS:
            prefix = self.key(f".{reason}-step-")
            keys = [obj["Key"] for obj in self._list(prefix)] + [key for key, _ in self._uploads(prefix)]
            for key in keys:
                name = key[len(root) + 1 if root else 0:].partition("/")[0]
                step = layout.parse_set_aside_name(name)
                if step is not None:
                    found.add((step, name))
        return sorted(found)

    def remove_set_aside(self, name: str) -> None:
        """Removes a set-aside step: its incomplete uploads (a copy cut short), then its objects."""
        if layout.parse_set_aside_name(name) is None:
            raise ValueError(f"{name!r} is not a set-aside step")
        prefix = self.key(name) + "/"
        for key, upload_id in self._uploads(prefix):
            self.abort_upload(key, upload_id)
        self._delete_keys([obj["Key"] for obj in self._list(prefix)])

    def read_root_file(self, name: str) -> bytes | None:
        got = self._get(self.key(name), limit=layout.MAX_MANIFEST_BYTES + 1)
        return None if got is None else got[0]

    def write_root_file(self, name: str, data: bytes) -> None:
        self.put(self.key(name), data)

    def remove_root_file(self, name: str) -> None:
        self._delete_keys([self.key(name)])

    def _uploads(self, prefix: str) -> list[tuple[str, str]]:
        """(key, upload id) of every multipart upload under `prefix` that was never completed."""
        found = []
        try:
            paginator = self.client.get_paginator("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                found += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]
        except _s3.client_errors() as e:
            raise _s3.storage_error(e, "list uploads", self.uri) from None
        return found

    def abort_upload(self, key: str, upload_id: str) -> bool:
        """Aborts an upload; False when it is gone already (aborted or completed since it was listed)."""
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except _s3.client_errors() as e:
            if _s3.error_code(e) == "NoSuchUpload":
                return False
            raise _s3.storage_error(e, f"abort upload of {key}", self.uri) from None
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
            if not self.abort_upload(key, upload_id):
                continue  # aborted or completed since it was listed (e.g. by the writer it belonged to)
            removed.append(f"upload {upload_id} of s3://{self.bucket}/{key}")
        for step in sorted(seen - committed - claimed):
            if self._exists(self.key(layout.step_name(step), layout.COMMITTED)):
                continue  # committed since it was listed
            keys = [obj["Key"] for obj in self._list(self.key(layout.step_name(step)) + "/")]
            self._delete_keys(keys)
            removed += [f"s3://{self.bucket}/{k}" for k in keys]
        for key, claim, age in leases:
            if claim is None or claim.is_abandoned(age):
                self._delete_keys([key])
                removed.append(f"s3://{self.bucket}/{key}")
        for entry in os.scandir(self.staging_dir):
            pid = entry.name[len(layout.STAGE_PREFIX):].split("-", 1)[0]
            if entry.name.startswith(layout.STAGE_PREFIX) and pid.isdigit() and not lease.pid_alive(int(pid)):
                _fs.remove_tree(entry.path)
                removed.append(entry.path)
        return removed

    # -- what `sneppx ls` shows --

    def inventory(self) -> list[layout.Entry]:
        """Every step-like prefix under the root (storage.Entry), from one listing: a step is committed when
        its marker is there. Its files' sizes; nothing is read."""
        root = self.key("")
        strip = len(root) + 1 if root else 0
        files: dict[str, dict[str, int]] = {}
        for obj in self._list(root + "/" if root else ""):
            name, slash, leaf = obj["Key"][strip:].partition("/")
            if slash and leaf and layout.classify_entry(name) is not None:
                files.setdefault(name, {})[leaf] = int(obj["Size"])
        found = []
        for name, held in files.items():
            step, state = layout.classify_entry(name)  # type: ignore[misc]
            if state == "committed" and layout.COMMITTED not in held:
                state = "uncommitted"
            found.append(layout.Entry(name, step, state, held))
        return found

    def read_entry_file(self, name: str, leaf: str) -> bytes | None:
        """A small object (manifest, signature, marker) of an inventory entry, or None when it has none."""
        if layout.classify_entry(name) is None or not layout.is_plain_name(leaf):
            raise ValueError(f"{name}/{leaf} is not a file of a step")
        found = self._get(self.key(name, leaf))
        return None if found is None else found[0]


class S3StepReader:
    """base.StepReader over a committed step's objects: sizes from one listing, each read one ranged GET whose
    length is checked and whose blocks' CRC32C are taken on the bytes received."""

    def __init__(self, store: S3Storage, step_name: str, marker: bytes, sizes: dict[str, int]):
        self.location = f"s3://{store.bucket}/{store.key(step_name)}"
        self.marker: bytes | None = marker
        self.bytes_read = 0
        self._store, self._name, self._sizes = store, step_name, sizes

    def read_file(self, name: str) -> bytes | None:
        if name not in self._sizes:
            return None
        got = self._store._get(self._store.key(self._name, name), limit=layout.MAX_MANIFEST_BYTES + 1)
        return None if got is None else got[0]

    def size(self, name: str) -> int:
        if name not in self._sizes:
            raise errors.CheckpointNotFoundError(f"{self.location}/{name} is missing", path=self.location)
        return self._sizes[name]

    def read_blocks(self, name: str, buffer: memoryview, offset: int, block_bytes: int) -> list[int]:
        if not buffer:
            return []
        key = self._store.key(self._name, name)
        if offset + len(buffer) > self.size(name):
            raise errors.TruncatedCheckpointError(f"{self.location}/{name} ends before byte {offset + len(buffer)}",
                                                  path=self.location)
        try:
            response = self._store.client.get_object(Bucket=self._store.bucket, Key=key,
                                                     Range=f"bytes={offset}-{offset + len(buffer) - 1}")
            body = response["Body"].read()
        except _s3.client_errors() as e:
            if _s3.error_code(e) in ("404", "NoSuchKey", "NotFound"):
                raise errors.CheckpointNotFoundError(f"{self.location}/{name} is gone", path=self.location) from None
            raise _s3.storage_error(e, f"ranged get of {key}", self._store.uri) from None
        if len(body) != len(buffer):
            raise errors.TruncatedCheckpointError(f"{self.location}/{name}: {len(body)} bytes came back for a range "
                                                  f"of {len(buffer)}", path=self.location)
        buffer[:] = body
        self.bytes_read += len(buffer)
        return base.block_crcs(buffer, block_bytes)





