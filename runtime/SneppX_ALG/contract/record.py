"""Small JSON records written by compare-and-swap: the one primitive the rendezvous needs from a store.

Why: the membership of every generation of an elastic job is decided through the store the job already has
for its checkpoints (a local or NFS directory, an S3 prefix; in a pod, a Kubernetes object of the job), not
through a server on one of its nodes that takes the job down with it (torchrun's TCPStore, pytorch#67742).
Each of those stores offers an atomic conditional write, and this module is the one interface over them:

* `create(key, value)`: create-if-absent. Of any number of concurrent creators of a key exactly one
  succeeds; the others get `RecordExistsError`. (Local: a version file hard-linked into place, which
  `link()` refuses with EEXIST, atomically on local filesystems and NFS. S3: PutObject with
  `If-None-Match: *`.)
* `read(key)`: the record and an opaque `version`, or None when the key is absent.
* `swap(key, value, version)`: replaces the value only if it is still at `version`, else
  `RecordConflictError` (also when the key is gone). A version changes whenever the value does; identical
  values may share one (on S3 it is the ETag, a digest of the bytes), so this is compare-and-swap on the
  value. (Local: create version N+1 with `link()`. S3: PutObject with `If-Match: <ETag>`.)
* `keys(prefix, limit=None)`: the keys of live records under a prefix ("" or ending in "/"), sorted.
* `delete(key)`: unconditional; deleting an absent key is not an error.

Errors are a closed set: `RecordExistsError` / `RecordConflictError` (the condition failed: read again),
`RecordCorruptError` (the store holds something under the key that is not a record), `RecordValueError`
(the caller's key or value can't be stored), `RecordUnavailableError` (transient: a read may simply be
retried; a write's outcome is unknown) and `RecordStoreError` (anything else the store refused). A write
whose reply was lost may be retried by the client library and then report `RecordExistsError` or
`RecordConflictError` for the caller's own write: callers that care compare the stored value with theirs.

Keys are "/"-separated segments of `[A-Za-z0-9][A-Za-z0-9._-]*` (at most 253 characters each, 1024 in all),
relative to the store's root: no "..", no absolute path, no empty segment, so no key names anything outside
`root + "/"`, and the same key maps onto a file path, an S3 key, or (encoded) a ConfigMap data key.
Values are JSON objects of at most `MAX_RECORD_BYTES` encoded, without NaN or Infinity; reading refuses
anything larger, not UTF-8, not an object, or with a duplicate key. Nothing is ever unpickled.

The Kubernetes implementation (`records/kube.py`) fits the same Protocol: the keys of a job are entries of one
ConfigMap of the job, the version of an entry is a digest of its value, and each call is a read-modify-write of
the object with compare-and-swap on its `resourceVersion`, retried on 409 while the entry's own condition still
holds. One object holds at most 1 MiB, so the rendezvous removes the records of old generations
(`elastic.rendezvous.Rendezvous.sweep`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from SneppX_ALG import errors

MAX_RECORD_BYTES = 1 << 20  # a membership of 1,024 nodes fits with room to spare; a ConfigMap holds 1 MiB
MAX_KEY_CHARS = 1024  # S3's limit on a whole key, which includes the store's own prefix
KEY_SEGMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


@dataclass(frozen=True)
class Record:
    """A record as read or written: its key, its JSON object, and the version a `swap` is conditional on."""

    key: str
    value: dict[str, Any]
    version: str


class RecordStore(Protocol):
    """Compare-and-swap on small JSON records under one root (semantics in the module docstring)."""

    uri: str

    def create(self, key: str, value: Mapping[str, Any]) -> Record: ...

    def read(self, key: str) -> Record | None: ...

    def swap(self, key: str, value: Mapping[str, Any], version: str) -> Record: ...

    def keys(self, prefix: str = "", *, limit: int | None = None) -> list[str]: ...

    def delete(self, key: str) -> None: ...


def is_segment(name: str) -> bool:
    """One path segment of a key (also the rule for agent and run ids, which become segments)."""
    return bool(KEY_SEGMENT_RE.match(name))


def check_key(key: str) -> list[str]:
    """The key's segments; `RecordValueError` unless every one is a plain segment."""
    segments = key.split("/") if isinstance(key, str) else []
    if not segments or len(key) > MAX_KEY_CHARS or not all(is_segment(s) for s in segments):
        raise errors.RecordValueError(f"{key!r} is not a record key: '/'-separated segments of "
                                      "[A-Za-z0-9][A-Za-z0-9._-]*, each at most 253 characters, at most "
                                      f"{MAX_KEY_CHARS} characters in all", key=str(key))
    return segments


def check_prefix(prefix: str) -> list[str]:
    """The segments of a listing prefix: "" (everything) or a key followed by "/"."""
    if prefix == "":
        return []
    if not isinstance(prefix, str) or not prefix.endswith("/"):
        raise errors.RecordValueError(f"{prefix!r} is not a key prefix: use '' or a key followed by '/'",
                                      key=str(prefix))
    return check_key(prefix[:-1])


def check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise errors.RecordValueError(f"limit must be a positive integer or None, not {limit!r}")


def encode(key: str, value: Mapping[str, Any]) -> bytes:
    """The stored bytes of a value: compact, sorted JSON. `RecordValueError` for anything else."""
    if not isinstance(value, Mapping):
        raise errors.RecordValueError(f"a record value is a JSON object, not {type(value).__name__}", key=key)
    try:
        data = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise errors.RecordValueError(f"the value is not plain JSON: {e}", key=key) from None
    if len(data) > MAX_RECORD_BYTES:
        raise errors.RecordValueError(f"the value is {len(data)} bytes encoded; a record holds at most "
                                      f"{MAX_RECORD_BYTES}", key=key)
    return data


def decode(key: str, data: bytes) -> dict[str, Any]:
    """The JSON object stored under a key; `RecordCorruptError` for anything else. `data` may be one byte
    longer than the limit (readers read `MAX_RECORD_BYTES + 1` to see that it is too long)."""
    if len(data) > MAX_RECORD_BYTES:
        raise errors.RecordCorruptError(f"the stored value is over {MAX_RECORD_BYTES} bytes", key=key)
    try:
        value = json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise errors.RecordCorruptError(f"the stored value is not JSON: {e}", key=key) from None
    if not isinstance(value, dict):
        raise errors.RecordCorruptError(f"the stored value is a JSON {type(value).__name__}, not an object",
                                        key=key)
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        raise ValueError("duplicate key in a JSON object")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def is_finite_number(value: Any) -> bool:
    """A JSON number that is a real, finite value (bool is not a number here)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
