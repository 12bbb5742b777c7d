"""The S3 client every S3 user of the runtime shares: how it is built, how a root's URI is read, what its errors
mean. Checkpoint steps (storage/s3.py) and compare-and-swap records (records/s3.py) both talk to S3 through it.

boto3 and botocore are imported late: they cost ~0.1 s, and local roots never need them.
"""

from __future__ import annotations

import base64
import os
from typing import Any

from SneppX_ALG import _native, errors

CONDITION_FAILED = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")
NOT_FOUND = ("404", "NoSuchKey", "NotFound")
TRANSIENT_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                             "RequestTimeTooSkewed", "ServiceUnavailable", "InternalError"})


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


def crc32c_b64(data: Any) -> str:
    return b64_crc(_native.crc32c(data))


def b64_crc(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def client_errors() -> tuple[type[Exception], ...]:
    """What boto3 raises (imported late: botocore costs ~0.1 s, and local roots never need it)."""
    import botocore.exceptions

    return (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)


def error_code(e: Exception) -> str:
    response = getattr(e, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def storage_error(e: Exception, what: str, uri: str) -> errors.StorageError:
    """A failed S3 call on a checkpoint root, as the StorageError its caller raises."""
    return errors.StorageError(f"S3 {what} failed for {uri}: {e}", path=uri)
