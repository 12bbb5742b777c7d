"""Compare-and-swap records under a local root (a disk, a PVC, an NFS mount), without locks: immutable version
files hard-linked into place (the `contract.record.RecordStore` Protocol; the class docstring says why links)."""

from __future__ import annotations

import errno as errno_module
import os
import re
import secrets
import stat
from collections.abc import Mapping
from typing import Any

from SneppX_ALG import _fs, _native, errors
from SneppX_ALG.contract import record

VERSION_RE = re.compile(r"^\.v(\d{9,})$")
TRANSIENT_ERRNOS = frozenset({errno_module.ETIMEDOUT, errno_module.ESTALE, errno_module.EAGAIN,
                              errno_module.EINTR, errno_module.ENETDOWN, errno_module.ENETUNREACH,
                              errno_module.EHOSTUNREACH, errno_module.ECONNREFUSED, errno_module.ECONNRESET})
RETENTION_S = 600.0  # how long a superseded version's name stays taken (see _remove_superseded)
MAX_READ_RETRIES = 8  # a reader racing the cleanup of old versions lists again; more races than this is an error


class LocalRecordStore:
    """Compare-and-swap records under a local root (a disk, a PVC, an NFS mount), without locks.

    A key is a directory; every value it has had is an immutable file in it, `.v000000001`, `.v000000002`,
    ..., written under a temporary name, fsynced, then hard-linked to its version's name, and the directory
    fsynced. The highest version is the value; an empty version file is a tombstone (the key was deleted),
    so version numbers never repeat while the key's directory exists, and a stale version never matches
    again. Creating version N+1 is the whole compare-and-swap: `link()` fails with EEXIST when another writer
    made it first. That is atomic on local filesystems and on NFS, where the server performs the LINK; when
    an NFS reply is lost and the client retransmits, the retry may say EEXIST for our own link, so EEXIST
    is checked against the link count of our temporary file (2 means it was ours), as open(2) recommends
    for lock files on NFS. Why not the alternatives: rename() replaces its target (last writer wins, no
    compare), O_EXCL create-in-place exposes a half-written file, and fcntl locks over NFS depend on the
    lock manager and on lease recovery after a client dies.

    Readers list the key's directory and read the highest version, which is complete by construction.
    Writers remove versions older than the newest two once they have been superseded for `RETENTION_S`
    (10 minutes): a removed name could be linked again by a writer that checked the version before it and
    then stalled, which would be a lost update, so names stay taken long past any such stall. A key
    swapped every few seconds keeps a few hundred small files. A reader that listed just before a removal
    sees its file vanish only when two newer ones exist; it lists again. On NFS, a
    client's attribute cache may show a directory listing a little stale (mount with `lookupcache=positive`
    or a short `actimeo` to see new records sooner): a stale read can only make a later swap fail with
    `RecordConflictError`, never succeed wrongly, because the LINK is decided by the server.
    """

    def __init__(self, root: str):
        self.uri = os.path.abspath(root)
        try:
            os.makedirs(self.uri, exist_ok=True)
        except OSError as e:
            raise _record_error(e, "", self.uri) from None
        self.root = os.path.realpath(self.uri)  # paths are built from here, so a symlink inside stands out

    def _dir(self, key: str) -> str:
        """The key's directory, refused if any part of it under the root is a symlink (which could lead a
        write outside the root)."""
        path = os.path.join(self.root, *record.check_key(key))
        if os.path.realpath(path) != path:
            raise errors.RecordCorruptError(f"{path} goes through a symlink", key=key)
        return path

    def create(self, key: str, value: Mapping[str, Any]) -> record.Record:
        data = record.encode(key, value)
        newest = self._newest(key)
        if newest is not None and newest[1]:
            raise errors.RecordExistsError(f"{key} exists", key=key)
        number = newest[0] + 1 if newest else 1
        if not self._write_version(key, number, data):
            raise errors.RecordExistsError(f"{key} was created by another writer", key=key)
        return record.Record(key, record.decode(key, data), str(number))

    def read(self, key: str) -> record.Record | None:
        for _ in range(MAX_READ_RETRIES):
            newest = self._newest(key)
            if newest is None or not newest[1]:
                return None
            try:
                data = self._read_version(key, newest[0])
            except FileNotFoundError:
                continue  # removed by a writer's cleanup: two newer versions exist now
            return record.Record(key, record.decode(key, data), str(newest[0]))
        raise errors.RecordUnavailableError(f"{key} changed {MAX_READ_RETRIES} times while being read", key=key)

    def swap(self, key: str, value: Mapping[str, Any], version: str) -> record.Record:
        data = record.encode(key, value)
        number = _version_number(key, version)
        directory = self._dir(key)
        path = os.path.join(directory, _version_name(number))
        try:  # the version must exist and be a value, not a tombstone (else this would create a key)
            live = os.stat(path, follow_symlinks=False).st_size > 0
        except FileNotFoundError:
            live = False  # never existed, or cleaned up because newer versions exist
        except OSError as e:
            raise _record_error(e, key, path) from None
        # a newer version already there fails fast, before the write and fsync the link would waste
        if (not live or os.path.lexists(os.path.join(directory, _version_name(number + 1)))
                or not self._write_version(key, number + 1, data)):
            raise errors.RecordConflictError(f"{key} is no longer at version {version}", key=key)
        return record.Record(key, record.decode(key, data), str(number + 1))

    def delete(self, key: str) -> None:
        for _ in range(MAX_READ_RETRIES):
            newest = self._newest(key)
            if newest is None or not newest[1]:
                return
            if self._write_version(key, newest[0] + 1, b""):
                return
        raise errors.RecordConflictError(f"{key} kept changing while being deleted", key=key)

    def keys(self, prefix: str = "", *, limit: int | None = None) -> list[str]:
        record.check_limit(limit)
        top = os.path.join(self.root, *record.check_prefix(prefix))
        found: list[str] = []
        pending = [(top, prefix)]
        while pending:
            directory, key_prefix = pending.pop()
            try:
                entries = list(os.scandir(directory))
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as e:
                raise _record_error(e, key_prefix, directory) from None
            for entry in entries:
                if record.is_segment(entry.name) and entry.is_dir(follow_symlinks=False):
                    pending.append((entry.path, f"{key_prefix}{entry.name}/"))
            if key_prefix != prefix and self._is_live(key_prefix[:-1], entries):
                found.append(key_prefix[:-1])
        found.sort()
        return found[:limit] if limit is not None else found

    def _is_live(self, key: str, entries: list[os.DirEntry[str]]) -> bool:
        versions = [(int(m.group(1)), e) for e in entries if (m := VERSION_RE.match(e.name))]
        if not versions:
            return False
        try:
            return max(versions, key=lambda v: v[0])[1].stat(follow_symlinks=False).st_size > 0
        except FileNotFoundError:  # cleaned up under us: newer versions exist
            newest = self._newest(key)
            return newest is not None and newest[1]
        except OSError as e:
            raise _record_error(e, key, self._dir(key)) from None

    def _newest(self, key: str) -> tuple[int, bool] | None:
        """(number, is a value) of the key's newest version, None if it never had one."""
        directory = self._dir(key)
        for _ in range(MAX_READ_RETRIES):
            try:
                names = os.listdir(directory)
            except FileNotFoundError:
                return None
            except NotADirectoryError:
                raise errors.RecordCorruptError(f"{directory} is a file, not a record directory",
                                                key=key) from None
            except OSError as e:
                raise _record_error(e, key, directory) from None
            numbers = [int(m.group(1)) for name in names if (m := VERSION_RE.match(name))]
            if not numbers:
                return None
            number = max(numbers)
            path = os.path.join(directory, _version_name(number))
            try:
                info = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                continue  # cleaned up under us: newer versions exist, list again
            except OSError as e:
                raise _record_error(e, key, directory) from None
            if not stat.S_ISREG(info.st_mode):
                raise errors.RecordCorruptError(f"{path} is not a regular file", key=key)
            return (number, info.st_size > 0)
        raise errors.RecordUnavailableError(f"{key} changed {MAX_READ_RETRIES} times while being read", key=key)

    def _read_version(self, key: str, number: int) -> bytes:
        """The bytes of one version file: a regular file (no symlink, FIFO or directory), bounded."""
        path = os.path.join(self._dir(key), _version_name(number))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise
        except OSError as e:
            if e.errno in (errno_module.ELOOP, errno_module.EISDIR, errno_module.ENXIO):
                raise errors.RecordCorruptError(f"{path} is not a regular file", key=key) from None
            raise _record_error(e, key, path) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise errors.RecordCorruptError(f"{path} is not a regular file", key=key)
            chunks, size = [], 0
            while size <= record.MAX_RECORD_BYTES:
                chunk = os.read(fd, record.MAX_RECORD_BYTES + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            return b"".join(chunks)
        except OSError as e:
            raise _record_error(e, key, path) from None
        finally:
            os.close(fd)

    def _write_version(self, key: str, number: int, data: bytes) -> bool:
        """Links a new version file into place: True if it is ours, False if that version already exists."""
        directory = self._dir(key)
        self._make_dirs(key, directory)
        tmp = os.path.join(directory, f".tmp-{os.getpid()}-{secrets.token_hex(8)}")
        final = os.path.join(directory, _version_name(number))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, final)
            except FileExistsError:
                if os.stat(tmp).st_nlink != 2:  # 2: our own link, its reply lost and retried (NFS)
                    return False
            self._fsync_dir(key, directory)
        except OSError as e:
            raise _record_error(e, key, directory) from None
        finally:
            _fs.unlink_quietly(tmp)
        self._remove_superseded(directory, number)
        return True

    def _remove_superseded(self, directory: str, newest: int) -> None:
        """Removes versions older than the newest two, once the newest is `RETENTION_S` younger than them
        (by the file system's clock: the NFS server's, not this machine's). Removing a version frees its
        name, and a writer that checked version N, stalled, and only then linked N+1 into a freed name
        would write below the newest version, a lost update; so a name is freed only after it was
        superseded for longer than any stall inside a swap we account for."""
        try:
            names = os.listdir(directory)
            newest_time = os.stat(os.path.join(directory, _version_name(newest))).st_mtime
            for number in sorted(int(m.group(1)) for name in names if (m := VERSION_RE.match(name))):
                path = os.path.join(directory, _version_name(number))
                if number >= newest - 1 or newest_time - os.stat(path).st_mtime <= RETENTION_S:
                    return  # versions are written in order: the rest are younger still
                _fs.unlink_quietly(path)
        except OSError:
            return  # cleanup is best effort; the next write tries again

    def _make_dirs(self, key: str, directory: str) -> None:
        """Creates the key's directories, each made durable in its parent (a record must survive a crash
        of the machine once a writer saw it written)."""
        if os.path.isdir(directory):
            return
        path = self.root
        for segment in record.check_key(key):
            parent, path = path, os.path.join(path, segment)
            try:
                os.mkdir(path)
            except FileExistsError:
                continue
            except OSError as e:
                raise _record_error(e, key, path) from None
            self._fsync_dir(key, parent)

    def _fsync_dir(self, key: str, directory: str) -> None:
        try:
            _native.fsync_path(directory)
        except errors.StorageError as e:
            raise errors.RecordStoreError(f"fsync of {directory} failed: {e}", key=key) from None


def _version_name(number: int) -> str:
    return f".v{number:09d}"


def _version_number(key: str, version: str) -> int:
    if not isinstance(version, str) or not re.fullmatch(r"[0-9]{1,18}", version):
        raise errors.RecordValueError(f"{version!r} is not a version of this store", key=key)
    return int(version)


def _record_error(e: OSError, key: str, path: str) -> errors.RecordStoreError:
    if e.errno in TRANSIENT_ERRNOS:
        return errors.RecordUnavailableError(f"{path}: {e.strerror}", key=key)
    return errors.RecordStoreError(f"{path}: {e.strerror}", key=key)
