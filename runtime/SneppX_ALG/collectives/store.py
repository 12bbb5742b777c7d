"""The small key-value store through which the ranks of a process group (one membership generation) find each
other.

Why a Protocol of two calls: the same rendezvous must work on a laptop (a local directory), on a cluster with a
shared filesystem, on S3 and inside Kubernetes: `RecordKeyStore` puts the keys in the compare-and-swap records the
rendezvous already uses (`open_record_store`: a directory or S3), so the process groups need no store of their
own. Keys are create-only: a value is written once and never changes, so readers need no locks, a retried write
can't overwrite a peer's, and a key namespaced by generation (`generation_key`) can't be confused with the same
name in another generation. (Tests and benchmarks that build a group outside any run use the one-file-per-key
`DirectoryStore` of tests/directory_store.py.)
"""

from __future__ import annotations

import base64
import re
import time
from typing import Protocol

from SneppX_ALG import errors
from SneppX_ALG.contract import record

MAX_KEY_LENGTH = 512
MAX_VALUE_BYTES = 1 << 20
# Path-like keys: components of letters, digits, '.', '_' and '-', each starting with a letter or digit (so no
# '..', no hidden names, nothing that a directory store would read as a path outside its root).
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")


class Store(Protocol):
    """Create-only keys with bytes values, visible to every rank of the job."""

    def set(self, key: str, value: bytes) -> None:
        """Creates `key`; StoreKeyExistsError if it exists already (its value is left as it was)."""
        ...

    def get(self, key: str, timeout: float) -> bytes:
        """The value of `key`, waiting up to `timeout` seconds for someone to set it; StoreTimeoutError after."""
        ...


def check_key(key: str) -> str:
    """Returns `key` if it is a valid store key; ValueError (naming the rule) otherwise."""
    if not isinstance(key, str) or len(key) > MAX_KEY_LENGTH or not _KEY.fullmatch(key):
        raise ValueError(f"store key {key!r} must be '/'-separated names of letters, digits, '.', '_' and '-', "
                         f"each starting with a letter or digit, at most {MAX_KEY_LENGTH} characters")
    return key


def generation_key(generation: int, name: str) -> str:
    """`name` inside the namespace of one membership generation."""
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise ValueError(f"generation must be an int >= 0, got {generation!r}")
    return check_key(f"gen-{generation}/{name}")


class Namespace:
    """A Store inside another, its keys under `prefix/`: the groups of one generation (training's, an async
    checkpoint coordinator's) share one store without sharing a key (`ProcessGroup(name=...)`)."""

    def __init__(self, store: Store, prefix: str):
        self.store, self.prefix = store, check_key(prefix)

    def set(self, key: str, value: bytes) -> None:
        self.store.set(f"{self.prefix}/{check_key(key)}", value)

    def get(self, key: str, timeout: float) -> bytes:
        return self.store.get(f"{self.prefix}/{check_key(key)}", timeout)


class RecordKeyStore:
    """A Store over a `contract.record.RecordStore` (a directory or S3), under `prefix`: how the ranks of an
    ElasticTrainer run find each other on whatever store holds the run's checkpoints, with no server of its
    own. set() is the record store's create-if-absent; get() polls with backoff up to `poll_max`."""

    def __init__(self, records: record.RecordStore, prefix: str, *, poll_interval: float = 0.01,
                 poll_max: float = 0.2):
        self.prefix = prefix.rstrip("/")
        record.check_key(self.prefix)
        self.records = records
        self.poll_interval, self.poll_max = poll_interval, poll_max

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{check_key(key)}"

    def set(self, key: str, value: bytes) -> None:
        if len(value) > MAX_VALUE_BYTES:
            raise ValueError(f"store value for {key!r} is {len(value)} bytes; the limit is {MAX_VALUE_BYTES}")
        try:
            self.records.create(self._key(key), {"value": base64.b64encode(value).decode()})
        except errors.RecordExistsError:
            raise errors.StoreKeyExistsError(f"store key {key!r} is already set (keys are create-only)") from None
        except errors.RecordError as e:
            raise errors.StoreError(f"can't write store key {key!r} under {self.records.uri}: {e}") from e

    def get(self, key: str, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        interval = self.poll_interval
        while True:
            try:
                found = self.records.read(self._key(key))
            except errors.RecordUnavailableError:
                found = None  # transient: poll again until the deadline
            except errors.RecordError as e:
                raise errors.StoreError(f"can't read store key {key!r} under {self.records.uri}: {e}") from e
            if found is not None:
                try:
                    return base64.b64decode(found.value["value"], validate=True)
                except (KeyError, TypeError, ValueError) as e:
                    raise errors.StoreError(f"store key {key!r} does not hold a value: {e}") from None
            now = time.monotonic()
            if now >= deadline:
                raise errors.StoreTimeoutError(
                    f"store key {key!r} was not set within {timeout:g}s (under {self.records.uri})")
            time.sleep(min(interval, deadline - now))
            interval = min(interval * 1.5, self.poll_max)
