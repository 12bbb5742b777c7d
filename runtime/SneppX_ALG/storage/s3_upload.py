"""Uploading one object to S3 in parts: a finished local file (`upload_file`) or a shard streamed up while it is
written (`StreamingUpload`). Parts go up in parallel, each with its CRC32C for the server to check, and a failed
upload is aborted before its error propagates, so a half-uploaded object never appears.

Separate from the step store (storage/s3.py) because it knows nothing of steps: only an object, its parts and the
bounded buffers they travel in. The store is the `UploadTarget` it writes through.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
from typing import Any, Protocol

from SneppX_ALG import _native, _s3, errors


class UploadTarget(Protocol):
    """What an upload needs from its store (storage/s3.py's S3Storage): where to write, how wide, and the part
    buffers it lends and takes back."""

    uri: str
    bucket: str
    client: Any
    part_bytes: int
    threads: int

    def put(self, key: str, body: bytes, *, if_none_match: bool = False) -> str: ...

    def abort_upload(self, key: str, upload_id: str) -> bool: ...

    def take_buffer(self) -> bytearray: ...

    def give_buffer(self, buffer: bytearray) -> None: ...


def upload_file(target: UploadTarget, path: str, key: str) -> str:
    """Uploads one local file: a single PUT when small, else parallel multipart with per-part CRC32C.
    A failed multipart upload is aborted before the error propagates. Returns the object's ETag."""
    size = os.path.getsize(path)
    if size <= target.part_bytes:
        with open(path, "rb") as f:
            return target.put(key, f.read())
    try:
        upload_id = target.client.create_multipart_upload(Bucket=target.bucket, Key=key,
                                                        ChecksumAlgorithm="CRC32C")["UploadId"]
    except _s3.client_errors() as e:
        raise _s3.storage_error(e, f"start upload of {key}", target.uri) from None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def upload_part(number: int) -> dict[str, Any]:
        offset = (number - 1) * target.part_bytes
        body = os.pread(fd, min(target.part_bytes, size - offset), offset)
        checksum = _s3.crc32c_b64(body)
        response = target.client.upload_part(Bucket=target.bucket, Key=key, UploadId=upload_id,
                                           PartNumber=number, Body=body, ChecksumAlgorithm="CRC32C",
                                           ChecksumCRC32C=checksum)
        return {"PartNumber": number, "ETag": response["ETag"], "ChecksumCRC32C": checksum}

    count = (size + target.part_bytes - 1) // target.part_bytes
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(target.threads, count)) as pool:
            parts = list(pool.map(upload_part, range(1, count + 1)))
        response = target.client.complete_multipart_upload(Bucket=target.bucket, Key=key, UploadId=upload_id,
                                                         MultipartUpload={"Parts": parts})
        return str(response["ETag"])
    except BaseException as e:  # abort on anything, then re-raise
        with contextlib.suppress(*_s3.client_errors()):
            target.client.abort_multipart_upload(Bucket=target.bucket, Key=key, UploadId=upload_id)
        if isinstance(e, Exception) and not isinstance(e, errors.SneppXError):
            raise _s3.storage_error(e, f"upload of {key}", target.uri) from None
        raise
    finally:
        os.close(fd)


class StreamingUpload:
    """One object uploaded in parts while it is written: a CheckpointWriter's sink (checkpoint.file.Sink).

    Why: staging a shard in a local file and uploading it afterwards costs a local write, an fsync and a
    read-back, and the upload can't start before the last byte is written; here each part goes up as soon as
    it is full, from memory, while the writer fills the next (measured in docs/BENCHMARKS.md, "S3 saves").

    The first part is held back until finish(): the SNPX header, at the start, is written last, and the parts
    of a multipart upload may be sent in any order. Each part's CRC32C is computed as the bytes are copied in
    (with the CRC the writer gets back for them) and sent for the server to check. Memory: at most
    `threads` parts in flight, one filling and the first, each `part_bytes`. An object that fits in one part
    is sent with a single PUT at finish(). finish() completes the upload, the object appearing whole or not at
    all; a failure aborts the upload (the parts are discarded by the server), as abort() does.
    """

    def __init__(self, store: UploadTarget, key: str):
        self.store, self.key = store, key
        self.size = 0
        self.result: tuple[int, str] | None = None  # (size, ETag) once finish() succeeded
        self._copier = _native.Copier(-1)
        self._part = store.take_buffer()  # the part being filled: number self._number
        self._number, self._fill, self._part_crc = 1, 0, 0
        self._first: bytearray | None = None  # part 1, once full: held until finish()
        self._upload_id: str | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: collections.deque[tuple[concurrent.futures.Future[dict[str, Any]], bytearray]] = (
            collections.deque())
        self._parts: list[dict[str, Any]] = []
        self._done = False

    def append(self, data: Any) -> int:
        """Copies bytes into the parts (their CRC32C computed as they are copied); returns that CRC."""
        self._check_open()
        view = memoryview(data).cast("B") if memoryview(data).format != "B" else memoryview(data)
        crc = 0
        while len(view):
            n = min(len(view), len(self._part) - self._fill)
            piece_crc = int(self._copier.copy(memoryview(self._part)[self._fill:self._fill + n], view[:n]) or 0)
            self._part_crc = _native.crc32c_combine(self._part_crc, piece_crc, n)
            crc = _native.crc32c_combine(crc, piece_crc, n)
            self._fill += n
            self.size += n
            view = view[n:]
            if self._fill == len(self._part):
                self._seal()
        return crc

    def pad(self, alignment: int) -> None:
        if self.size % alignment:
            self.append(bytes(alignment - self.size % alignment))

    def pwrite(self, data: Any, offset: int) -> None:
        """Changes bytes already appended: only in the first part (held back) or the part being filled."""
        self._check_open()
        data = bytes(data)
        end = offset + len(data)
        if offset < 0 or end > self.size:
            raise ValueError(f"pwrite of {len(data)} bytes at {offset} is outside the {self.size} bytes written")
        part_bytes = len(self._part)
        if end <= part_bytes:
            target = self._first if self._first is not None else self._part
            target[offset:end] = data
            if target is self._part:
                self._part_crc = _native.crc32c(memoryview(self._part)[:self._fill])
            return
        start = (self._number - 1) * part_bytes
        if offset < start:
            raise errors.StorageError(f"s3://{self.store.bucket}/{self.key}: bytes at {offset} were uploaded "
                                      "already and can't be changed", path=self.store.uri)
        self._part[offset - start:end - start] = data
        self._part_crc = _native.crc32c(memoryview(self._part)[:self._fill])

    def finish(self) -> None:
        """Uploads what is left (the last part, then the first) and completes the upload; on failure the upload
        is aborted and the error raised."""
        self._check_open()
        try:
            if self._first is None:  # one part: a single PUT
                body = bytes(memoryview(self._part)[:self._fill])
                self.result = (len(body), self.store.put(self.key, body))
            else:
                if self._fill:
                    self._submit(self._number, self._part, self._fill, self._part_crc)
                    self._part = bytearray(0)
                first, self._first = self._first, None  # final now: up alongside the last parts
                self._submit(1, first, len(first), _native.crc32c(first))
                while self._inflight:
                    self._collect(block=True)
                self._parts.sort(key=lambda p: p["PartNumber"])
                response = self.store.client.complete_multipart_upload(
                    Bucket=self.store.bucket, Key=self.key, UploadId=self._upload_id,
                    MultipartUpload={"Parts": self._parts})
                self.result = (self.size, str(response["ETag"]))
        except BaseException as e:
            self.abort()
            if isinstance(e, Exception) and not isinstance(e, errors.SneppXError):
                raise _s3.storage_error(e, f"upload of {self.key}", self.store.uri) from None
            raise
        self._close()

    def abort(self) -> None:
        """Stops the upload: waits for parts in flight, then aborts it on the server (best effort: cleanup()
        aborts what is left of a writer that is gone)."""
        if self._done:
            return
        for future, _ in self._inflight:
            with contextlib.suppress(BaseException):
                future.result()
        self._inflight.clear()
        if self._upload_id is not None:
            with contextlib.suppress(errors.StorageError):
                self.store.abort_upload(self.key, self._upload_id)
        self._close()

    def _check_open(self) -> None:
        if self._done:
            raise errors.StorageError(f"s3://{self.store.bucket}/{self.key}: this upload is over",
                                      path=self.store.uri)

    def _close(self) -> None:
        self._done = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for buffer in (self._part, self._first):
            if buffer is not None:
                self.store.give_buffer(buffer)
        self._part, self._first = bytearray(0), None

    def _seal(self) -> None:
        """The part being filled is full: the first is held back, any other goes up; a new part begins."""
        if self._number == 1:
            self._first = self._part
        else:
            self._submit(self._number, self._part, len(self._part), self._part_crc)
        self._number += 1
        self._fill, self._part_crc = 0, 0
        while len(self._inflight) >= self.store.threads:  # bounded memory: wait for the oldest part
            self._collect(block=True)
        self._collect(block=False)
        self._part = self.store.take_buffer()

    def _start(self) -> None:
        """Creates the multipart upload (when the second part is needed: a one-part object is one PUT)."""
        if self._upload_id is not None:
            return
        try:
            self._upload_id = self.store.client.create_multipart_upload(
                Bucket=self.store.bucket, Key=self.key, ChecksumAlgorithm="CRC32C")["UploadId"]
        except _s3.client_errors() as e:
            raise _s3.storage_error(e, f"start upload of {self.key}", self.store.uri) from None
        self._pool = concurrent.futures.ThreadPoolExecutor(self.store.threads, thread_name_prefix="sneppx-s3-part")

    def _submit(self, number: int, buffer: bytearray, length: int, crc: int) -> None:
        self._start()
        assert self._pool is not None
        body = buffer if length == len(buffer) else bytes(memoryview(buffer)[:length])  # boto3 takes no views
        self._inflight.append((self._pool.submit(self._upload_part, number, body, crc), buffer))

    def _collect(self, *, block: bool) -> None:
        """Takes finished parts off the front of the queue (waiting for the first one when `block`); a failed
        part raises its error."""
        while self._inflight and (block or self._inflight[0][0].done()):
            future, buffer = self._inflight.popleft()
            self._parts.append(future.result())
            self.store.give_buffer(buffer)
            block = False

    def _upload_part(self, number: int, body: bytes | bytearray, crc: int) -> dict[str, Any]:
        checksum = _s3.b64_crc(crc)
        try:
            response = self.store.client.upload_part(
                Bucket=self.store.bucket, Key=self.key, UploadId=self._upload_id, PartNumber=number, Body=body,
                ChecksumAlgorithm="CRC32C", ChecksumCRC32C=checksum)
        except _s3.client_errors() as e:  # on a pool thread: the writer gets it from the part's future, typed
            raise _s3.storage_error(e, f"upload part {number} of {self.key}", self.store.uri) from None
        return {"PartNumber": number, "ETag": response["ETag"], "ChecksumCRC32C": checksum}
