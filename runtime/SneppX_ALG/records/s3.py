"""Compare-and-swap records as objects under an S3 prefix (the `contract.record.RecordStore` Protocol): conditional
PUTs, If-None-Match to create and If-Match on the ETag to swap."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from SneppX_ALG import _s3, errors
from SneppX_ALG.contract import record


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
        self.bucket, self.prefix = _s3.parse_s3_uri(self.uri)
        self.client = client if client is not None else _s3.make_s3_client()

    def _key(self, key: str) -> str:
        record.check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def create(self, key: str, value: Mapping[str, Any]) -> record.Record:
        data = record.encode(key, value)
        try:
            response = self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data,
                                              ChecksumCRC32C=_s3.crc32c_b64(data), IfNoneMatch="*")
        except _s3.client_errors() as e:
            if _s3.error_code(e) in _s3.CONDITION_FAILED:
                raise errors.RecordExistsError(f"{key} exists", key=key) from None
            raise _record_error(e, "create", key) from None
        return record.Record(key, record.decode(key, data), str(response["ETag"]))

    def read(self, key: str) -> record.Record | None:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except _s3.client_errors() as e:
            if _s3.error_code(e) in _s3.NOT_FOUND:
                return None
            raise _record_error(e, "read", key) from None
        body = response["Body"]
        try:
            if int(response.get("ContentLength") or 0) > record.MAX_RECORD_BYTES:
                raise errors.RecordCorruptError(f"{key} is {response['ContentLength']} bytes, over "
                                                f"{record.MAX_RECORD_BYTES}", key=key)
            data = body.read(record.MAX_RECORD_BYTES + 1)
        except _s3.client_errors() as e:
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
                                              ChecksumCRC32C=_s3.crc32c_b64(data), IfMatch=version)
        except _s3.client_errors() as e:
            if _s3.error_code(e) in _s3.CONDITION_FAILED + _s3.NOT_FOUND:
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
        except _s3.client_errors() as e:
            raise _record_error(e, "list", prefix) from None
        return found[:limit] if limit is not None else found

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except _s3.client_errors() as e:
            if _s3.error_code(e) not in _s3.NOT_FOUND:
                raise _record_error(e, "delete", key) from None


def _record_error(e: Exception, what: str, key: str) -> errors.RecordStoreError:
    """A transient failure (no answer, 5xx, throttling) or another refusal of the store."""
    import botocore.exceptions

    status = int((getattr(e, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    transient = (isinstance(e, botocore.exceptions.ConnectionError | botocore.exceptions.HTTPClientError)
                 or status >= 500 or _s3.error_code(e) in _s3.TRANSIENT_CODES)
    kind = errors.RecordUnavailableError if transient else errors.RecordStoreError
    return kind(f"S3 {what} of {key or '/'} failed: {e}", key=key)
