"""A process-group store in a local (or shared, NFS) directory, one file per key, for tests and benchmarks.

Why here and not in the runtime: an ElasticTrainer's process groups keep their keys in the run's record store
(`collectives.store.RecordKeyStore`, beside the rendezvous), so nothing in the runtime needs a second directory
store.
Tests and benchmarks that build a `ProcessGroup` outside any run (a scratch directory, ranks on threads or
spawned processes) use this one. Tests import it as `directory_store` (tests/ is on sys.path under pytest, and
scripts run from tests/integration put it there themselves); benchmarks as `tests.directory_store`.
"""

from __future__ import annotations

import os
import tempfile
import time

from SneppX_ALG import errors
from SneppX_ALG.collectives import store


class DirectoryStore:
    """A Store in a local (or shared, NFS) directory: one file per key.

    set() writes a temporary file and hard-links it to the key's name: link() is atomic and fails if the name
    exists, so a reader sees a whole value or nothing, and two writers of one key can't both win. Values are
    rendezvous data (addresses, ids) that die with the generation, so they are not fsynced.
    """

    def __init__(self, root: str | os.PathLike[str], *, poll_interval: float = 0.01):
        self.root = os.fspath(root)
        self.poll_interval = poll_interval
        os.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *store.check_key(key).split("/"))

    def set(self, key: str, value: bytes) -> None:
        path = self._path(key)
        if len(value) > store.MAX_VALUE_BYTES:
            raise ValueError(f"store value for {key!r} is {len(value)} bytes; the limit is {store.MAX_VALUE_BYTES}")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, temporary = tempfile.mkstemp(prefix=".set-", dir=os.path.dirname(path))
        except OSError as e:
            raise errors.StoreError(f"can't write store key {key!r} under {self.root}: {e}") from e
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.link(temporary, path)
        except FileExistsError:
            raise errors.StoreKeyExistsError(f"store key {key!r} is already set (keys are create-only)") from None
        except OSError as e:
            raise errors.StoreError(f"can't write store key {key!r} under {self.root}: {e}") from e
        finally:
            os.unlink(temporary)

    def get(self, key: str, timeout: float) -> bytes:
        path = self._path(key)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(path, "rb") as f:
                    value = f.read(store.MAX_VALUE_BYTES + 1)
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise errors.StoreTimeoutError(
                        f"store key {key!r} was not set within {timeout:g}s (under {self.root})") from None
                time.sleep(self.poll_interval)
                continue
            except OSError as e:
                raise errors.StoreError(f"can't read store key {key!r} under {self.root}: {e}") from e
            if len(value) > store.MAX_VALUE_BYTES:
                raise errors.StoreError(f"store key {key!r} holds more than {store.MAX_VALUE_BYTES} bytes")
            return value
