"""Digests of checkpoint bytes: BLAKE3 (SHA-256 accepted when verifying), streamed on a background thread while
the writer copies the same bytes, per checksum block, and of whole files read back with bounded memory.

Why a module of its own: digests are what a signature vouches for (signing.py signs tables and manifests that
list them), but computing them is plain hashing that writers, readers and validators do without keys.
Digests are BLAKE3 (measured in bench/signing.py and docs/FORMAT.md: the only candidate faster than the disk on
this class of machine) and are computed on a background thread while the writer streams the same bytes to disk,
so signing costs little more than the hash work that the second core absorbs.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import os
import re
import threading
from collections.abc import Callable
from typing import Any

import blake3

from SneppX_ALG import errors

DIGEST_ALGORITHM = "blake3"
# Verification also accepts SHA-256 so that digests made by other tools (sha256sum, S3 checksums) verify.
_HASHERS: dict[str, Any] = {
    "blake3": blake3.blake3,
    "sha256": hashlib.sha256,
}
_DIGEST_HEX_LENGTH = {"blake3": 64, "sha256": 64}
_DIGEST_RE = re.compile(r"^([a-z0-9]+):([0-9a-f]+)$")

ALL_THREADS = blake3.blake3.AUTO
# Buffers below this are hashed inline: handing them to the worker costs more than hashing them.
_INLINE_BYTES = 1 << 20
# Large buffers are fed to the hasher in pieces of this size, so hashing starts before the copy ends.
_PIECE = 64 << 20
# At most this many buffers per digest wait for the worker, so a caller feeding fresh buffers faster
# than they can be hashed keeps bounded memory.
_MAX_QUEUED = 2

_worker_lock = threading.Lock()
_worker: concurrent.futures.ThreadPoolExecutor | None = None


def _forget_worker_after_fork() -> None:
    # A forked child has no worker thread (only the forking thread survives) and maybe a held lock.
    global _worker, _worker_lock
    _worker, _worker_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_worker_after_fork)


def _hash_worker() -> concurrent.futures.ThreadPoolExecutor:
    """One hashing thread per process: being one, it keeps each digest's updates in order."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sneppx-digest")
        return _worker


class StreamingDigest:
    """A hash whose large updates run on a background thread, overlapping the caller's own work.

    `update(buffer)` returns at once for large buffers: the buffer must stay unchanged until
    `hexdigest()` returns (the writer passes views of the tensor being written, which it holds until then).
    Hashing releases the GIL, so a write and its digest really run on two cores.
    """

    def __init__(self, name: str = DIGEST_ALGORITHM, *, threads: int = 1):
        if name not in _HASHERS:
            raise ValueError(f"unsupported digest algorithm {name!r}; supported: {', '.join(_HASHERS)}")
        self.name = name
        self._hasher = blake3.blake3(max_threads=threads) if name == "blake3" else _HASHERS[name]()
        self._queued: collections.deque[concurrent.futures.Future[Any]] = collections.deque()

    def update(self, data: Any) -> None:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        while self._queued and self._queued[0].done():
            self._queued.popleft().result()
        if not self._queued and len(view) < _INLINE_BYTES:
            self._hasher.update(view)
            return
        if len(self._queued) >= _MAX_QUEUED:
            self._queued.popleft().result()
        self._queued.append(_hash_worker().submit(self._hasher.update, view))

    def hexdigest(self) -> str:
        while self._queued:
            self._queued.popleft().result()
        return str(self._hasher.hexdigest())


def write_threads() -> int:
    """Hashing threads for a save: every core. A tensor's digest is awaited before the writer moves on (the
    caller may change the tensor once write() returns), so the hash of each tensor is on the save's critical
    path: split over all cores it ends sooner, and where the writer's own threads are busy it only shares
    them. Measured on tmpfs with two vCPUs: signed saves 1.10-1.18x an unsigned one with two BLAKE3 threads,
    1.08-1.27x with one (docs/BENCHMARKS.md, "Signing")."""
    return os.cpu_count() or 1


def block_digest(data: Any) -> str:
    """The BLAKE3 of one checksum block of a chunk, as 64 lowercase hex digits (a signed step lists one per
    block, so a load that reads part of a chunk still checks every byte it reads against the signature)."""
    return blake3.blake3(data).hexdigest()


def new_digest(name: str = DIGEST_ALGORITHM, *, threads: int | None = None) -> StreamingDigest:
    """The digest the writer feeds every tensor's bytes to; store as f"{d.name}:{d.hexdigest()}".

    `threads` defaults to write_threads(); checks that only read pass `threads=ALL_THREADS` (BLAKE3 then
    splits each large piece across every core).
    """
    return StreamingDigest(name, threads=write_threads() if threads is None else threads)


def parse_digest(value: str) -> tuple[str, str]:
    """'<alg>:<hex>' -> (alg, hex); DigestMismatchError for an unknown algorithm or a malformed value."""
    match = _DIGEST_RE.match(value) if isinstance(value, str) else None
    if match is None:
        raise errors.DigestMismatchError(f"digest {value!r} is not '<algorithm>:<lowercase hex>'")
    alg, hexdigest = match.groups()
    if alg not in _HASHERS:
        raise errors.DigestMismatchError(
            f"digest algorithm {alg!r} is not supported (supported: {', '.join(_HASHERS)})")
    if len(hexdigest) != _DIGEST_HEX_LENGTH[alg]:
        raise errors.DigestMismatchError(f"{alg} digest has {len(hexdigest)} hex digits, expected "
                                         f"{_DIGEST_HEX_LENGTH[alg]}")
    return alg, hexdigest


def digest_of(data: Any, name: str = DIGEST_ALGORITHM, *, threads: int | None = None) -> str:
    """'<alg>:<hex>' of a buffer (large buffers are hashed in pieces on the worker thread)."""
    digest = new_digest(name, threads=threads)
    view = memoryview(data).cast("B") if memoryview(data).format != "B" else memoryview(data)
    for start in range(0, len(view), _PIECE):
        digest.update(view[start:start + _PIECE])
    return f"{digest.name}:{digest.hexdigest()}"


def start_digest_check(data: Any, expected: str) -> Callable[[], str | None]:
    """Starts hashing `data` on the worker; the returned function waits and says what is wrong, or None.

    Lets a caller compute the CRC32C of the same bytes while the digest runs (validate, verify).
    """
    try:
        alg, _ = parse_digest(expected)
    except errors.DigestMismatchError as e:
        reason = e.reason
        return lambda: reason
    digest = new_digest(alg, threads=ALL_THREADS)
    view = memoryview(data)
    for start in range(0, len(view), _PIECE):
        digest.update(view[start:start + _PIECE])

    def finish() -> str | None:
        if f"{alg}:{digest.hexdigest()}" != expected:
            return f"does not match its signed {alg} digest"
        return None

    return finish


# A file is read in pieces of this size into a ring of three reused buffers: memory stays bounded (a memory
# map would count every page of the file in the process's RSS) and the next piece is read while the hashing
# thread hashes the previous one.
_READBACK_PIECE = 8 << 20


def file_digest(path: str | os.PathLike[str], name: str = DIGEST_ALGORITHM, *, threads: int = ALL_THREADS,
                drop_cache: bool = False) -> str:
    """'<alg>:<hex>' of a whole file (for manifests of multi-file checkpoints), read with bounded memory.

    `threads`: every core by default (a verify has nothing else to do); a background writer passes fewer so
    that the training loop keeps its cores. `drop_cache`: drop the file from the page cache afterwards, for
    a writer that hashes what it just wrote without growing its footprint (a verify keeps it cached for
    the load that follows).
    """
    digest = new_digest(name, threads=threads)
    ring = [bytearray(_READBACK_PIECE) for _ in range(3)]  # update() keeps at most 2 pieces queued
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        offset = pieces = 0
        while True:
            buffer = ring[pieces % 3]
            count = os.preadv(fd, [buffer], offset)
            if count == 0:
                break
            digest.update(memoryview(buffer)[:count])
            offset, pieces = offset + count, pieces + 1
        value = f"{digest.name}:{digest.hexdigest()}"
        if drop_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return value
    finally:
        os.close(fd)


def readback_digest(path: str | os.PathLike[str], name: str = DIGEST_ALGORITHM, *, threads: int = 1) -> str:
    """file_digest of a file just written, dropped from the page cache afterwards (the coordinator's
    background writer hashes each shard it wrote this way)."""
    return file_digest(path, name, threads=threads, drop_cache=True)
