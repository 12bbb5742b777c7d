"""Installing signed checkpoints as updates: only authentic, newer, unexpired weights, swapped in atomically.

A serving or training fleet that pulls weights from a bucket must not install a forged file, a corrupted one,
or an older signed release that an attacker replays (a rollback attack: an old version with a known flaw is
still validly signed). `SignedUpdateManager.install_update` therefore checks, in order: the signature by a
trusted key and every byte (verify.check_checkpoint), then the signed version and expiry in the checkpoint's
metadata (`sneppx.version`, `sneppx.expires`), and only then commits.

Layout of `install_dir`:

    state.json           the commit point: current and previous install, highest version ever installed
    versions/<v>-<id>.snpx  installed files (read-only); only those named by state.json are kept
    .lock                flock: one install at a time

The update file is untrusted until checked: it must be a regular file (a FIFO or device is refused, never
waited on while the install lock is held), its signature is checked over the raw table bytes before the table
is parsed, and it is copied with pread, never memory-mapped (a file truncated during the copy is a typed
error, not a SIGBUS). An install copies the update into `versions/` under a temporary name (so a file changed
on its source after it was checked can't slip in: the copy is what is verified), fsyncs it, renames it into
place, and then replaces state.json by writing a temporary file, fsync, rename and directory fsync. A process
killed at any point leaves state.json naming either the old install or the new one; leftovers are removed by
the next install.

Version policy: an update must be newer than every version ever installed here (the high-water mark), not
just the current one, so that after a `rollback()` the version that was rolled back from can't be replayed
without `force=True`. Versions are dotted numbers ("3", "1.10.2") compared numerically.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from SneppX_ALG import _fs, _native, errors
from SneppX_ALG.checkpoint import file, signing, verify

VERSION_KEY = "sneppx.version"
EXPIRES_KEY = "sneppx.expires"

STATE_NAME = "state.json"
VERSIONS_DIR = "versions"
LOCK_NAME = ".lock"
_TMP_MARK = ".tmp-"
_VERSION_RE = re.compile(r"^[0-9]{1,18}(\.[0-9]{1,18}){0,7}$")
_MAX_STATE_BYTES = 1 << 20
_COPY_PIECE = 8 << 20  # the native writer's buffer size: each read fills one write


# --- pure decisions ------------------------------------------------------------------------------------


def parse_version(value: Any) -> tuple[int, ...]:
    """'1.10.2' -> (1, 10, 2) with trailing zeros dropped, so '2' and '2.0' are the same version."""
    if not isinstance(value, str) or not _VERSION_RE.match(value):
        raise errors.UpdateRejectedError(
            f"signed version {value!r} is not a dotted number like '3' or '1.10.2' "
            f"(metadata {VERSION_KEY!r})")
    parts = [int(p) for p in value.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def parse_expiry(value: str) -> dt.datetime:
    """An RFC 3339 time with a zone ('2027-01-31T00:00:00Z'); without a zone it is ambiguous: refused."""
    try:
        when = dt.datetime.fromisoformat(value)
    except (TypeError, ValueError):
        when = None
    if when is None or when.tzinfo is None:
        raise errors.UpdateRejectedError(
            f"signed expiry {value!r} is not an RFC 3339 time with a zone, like '2027-01-31T00:00:00Z' "
            f"(metadata {EXPIRES_KEY!r})")
    return when


def check_update_policy(metadata: dict[str, str], *, high_water: str | None, now: float, force: bool = False,
                        require_expiry: bool = False) -> str:
    """Decides whether signed metadata may be installed; returns its version or raises why not.

    Expiry is checked even with `force`: force overrides only the version order.
    """
    if VERSION_KEY not in metadata:
        raise errors.UpdateRejectedError(f"the update has no signed version (metadata {VERSION_KEY!r})")
    version = metadata[VERSION_KEY]
    new = parse_version(version)
    expires = metadata.get(EXPIRES_KEY)
    if expires is None and require_expiry:
        raise errors.UpdateRejectedError(
            f"the update has no signed expiry (metadata {EXPIRES_KEY!r}), and this manager requires one")
    if expires is not None:
        when = parse_expiry(expires)
        if now >= when.timestamp():
            raise errors.ExpiredUpdateError(
                f"update version {version} expired at {expires} (now {_iso(now)}); it is not installed")
    if high_water is not None and not force and new <= parse_version(high_water):
        raise errors.RollbackRefusedError(
            f"update version {version} is not newer than version {high_water}, the highest installed here: "
            "refusing a rollback or replay (pass force=True to install it anyway)")
    return version


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


# --- state ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Installed:
    """One installed update. `path` is the verified, read-only file to load."""

    version: str
    path: str
    key_id: str
    installed_at: str


def _encode_state(current: Installed, previous: Installed | None, high_water: str) -> bytes:
    def rel(item: Installed | None) -> dict[str, str] | None:
        if item is None:
            return None
        d = asdict(item)
        d["path"] = os.path.join(VERSIONS_DIR, os.path.basename(item.path))
        return d

    doc = {"format": 1, "current": rel(current), "previous": rel(previous), "high_water": high_water}
    return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"


def _decode_state(raw: bytes, install_dir: str) -> tuple[Installed | None, Installed | None, str | None]:
    state_path = os.path.join(install_dir, STATE_NAME)

    def item(d: Any) -> Installed | None:
        if d is None:
            return None
        if not isinstance(d, dict) or set(d) != {"version", "path", "key_id", "installed_at"} or not all(
                isinstance(v, str) for v in d.values()):
            raise ValueError("bad install record")
        name = d["path"]
        if os.path.dirname(name) != VERSIONS_DIR or os.path.basename(name) in ("", ".", ".."):
            raise ValueError(f"install record points outside {VERSIONS_DIR}/")
        parse_version(d["version"])
        return Installed(d["version"], os.path.join(install_dir, name), d["key_id"], d["installed_at"])

    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != 1:
            raise ValueError("unknown state format")
        current, previous = item(doc.get("current")), item(doc.get("previous"))
        high_water = doc.get("high_water")
        if current is not None:
            parse_version(high_water)
    except (ValueError, errors.UpdateRejectedError) as e:
        raise errors.StorageError(f"{state_path} is unreadable ({e}); it was not written by SneppX or was "
                                  "edited by hand", path=state_path) from None
    return current, previous, high_water


# --- the manager ---------------------------------------------------------------------------------------


class SignedUpdateManager:
    """Installs signed checkpoints into `install_dir`, keeping the previous one for `rollback()`.

    `trusted_keys`: what signing.trusted_key_set accepts (public keys, PEM paths, ...). `require_expiry`:
    refuse updates without a signed `sneppx.expires`. `clock` returns the current time in seconds (tests).
    """

    def __init__(self, trusted_keys: Any, install_dir: str | os.PathLike[str], *,
                 require_expiry: bool = False, clock: Callable[[], float] = time.time):
        self.trusted_keys = signing.trusted_key_set(trusted_keys)
        if not self.trusted_keys:
            raise errors.KeyFormatError("SignedUpdateManager needs at least one trusted key")
        self.install_dir = os.path.abspath(os.fspath(install_dir))
        self.require_expiry = require_expiry
        self.clock = clock
        os.makedirs(os.path.join(self.install_dir, VERSIONS_DIR), exist_ok=True)

    # -- reading state (no lock: state.json is only ever replaced by rename) --

    def _state(self) -> tuple[Installed | None, Installed | None, str | None]:
        path = os.path.join(self.install_dir, STATE_NAME)
        try:
            with open(path, "rb") as f:
                raw = f.read(_MAX_STATE_BYTES + 1)
        except FileNotFoundError:
            return None, None, None
        if len(raw) > _MAX_STATE_BYTES:
            raise errors.StorageError(f"{path} is larger than {_MAX_STATE_BYTES} bytes", path=path)
        return _decode_state(raw, self.install_dir)

    def current(self) -> Installed | None:
        """What is installed now, or None before the first install."""
        return self._state()[0]

    def previous(self) -> Installed | None:
        """What `rollback()` would go back to, or None."""
        return self._state()[1]

    # -- changing state --

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(os.path.join(self.install_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def install_update(self, path: str | os.PathLike[str], *, force: bool = False) -> str:
        """Verifies and installs a signed checkpoint file; returns its version.

        Raises (and leaves the installed version unchanged): a `SignatureError` subclass (missing, untrusted,
        bad signature, digest mismatch), another `CheckpointFormatError` (corrupt, truncated, appended bytes),
        `RollbackRefusedError` (not newer than every installed version; `force=True` overrides),
        `ExpiredUpdateError`, or `UpdateRejectedError` (no or malformed signed version).
        """
        path = os.fspath(path)
        if os.path.isdir(path):
            raise errors.CheckpointFormatError("install_update takes one checkpoint file, not a directory",
                                               path=path)
        with self._locked():
            self._remove_leftovers()
            current, _, high_water = self._state()
            # Cheap checks on the source first (a regular file; header, the signature over the raw table bytes
            # before they are parsed, then the table and the version): a forged or replayed update is refused
            # before gigabytes are copied. The copy, from the descriptor just checked, is checked in full below.
            with file.CheckpointReader(path, verify=False, trusted_keys=self.trusted_keys) as reader:
                check_update_policy(reader.metadata, high_water=high_water, now=self.clock(), force=force,
                                    require_expiry=self.require_expiry)
                staged = self._stage(reader)
            try:
                verified = verify.check_checkpoint(staged, self.trusted_keys)
                version = check_update_policy(verified.metadata, high_water=high_water, now=self.clock(),
                                              force=force, require_expiry=self.require_expiry)
                final = os.path.join(self.install_dir, VERSIONS_DIR,
                                     f"{version}-{verified.key_id.hex()[:8]}-{secrets.token_hex(4)}.snpx")
                _native.rename_durable(staged, final)
            except errors.CheckpointFormatError as e:
                _fs.unlink_quietly(staged)
                raise type(e)(e.reason, path=path) from None  # name the update, not the staged copy
            except BaseException:
                _fs.unlink_quietly(staged)
                raise
            installed = Installed(version, final, verified.key_id.hex(), _iso(self.clock()))
            new_high = max(filter(None, (version, high_water)), key=parse_version)
            self._commit(installed, current, new_high)
            self._remove_unreferenced()
            return version

    def rollback(self) -> Installed:
        """Makes the previous install current again (re-verified first); returns it.

        The version rolled back from stays the high-water mark: installing it again needs force=True.
        Expiry is not checked: a rollback is an operator's decision to go back to what ran before.
        """
        with self._locked():
            self._remove_leftovers()
            current, previous, high_water = self._state()
            if current is None or previous is None or high_water is None:
                raise errors.UpdateRejectedError("there is no previous version to roll back to")
            verify.check_checkpoint(previous.path, self.trusted_keys)
            self._commit(previous, None, high_water)
            self._remove_unreferenced()
            return previous

    def _stage(self, source: file.CheckpointReader) -> str:
        """Copies the checked update into versions/ under a temporary name through the native writer, fsynced.

        Exactly the `file_size` bytes its header gives, read with pread from the descriptor the checks used
        (never a memory map: the source is untrusted, and a file truncated under a map kills the process
        with SIGBUS). A file that shrinks while it is copied is a TruncatedCheckpointError."""
        staged = os.path.join(self.install_dir, VERSIONS_DIR, f"{_TMP_MARK}{secrets.token_hex(8)}.snpx")
        size, fd = source.header.file_size, source.fileno()
        out = _native.NativeFile(staged)
        try:
            piece = memoryview(bytearray(min(size, _COPY_PIECE)))
            offset = 0
            while offset < size:
                try:
                    count = os.preadv(fd, [piece[:size - offset]], offset)
                except OSError as e:
                    raise errors.StorageError(f"can't read the update {source.path}: {e.strerror or e}",
                                              path=source.path, errno=e.errno) from None
                if count == 0:
                    raise errors.TruncatedCheckpointError(
                        f"file shrank to {offset} bytes while it was copied (its header says {size}): it was "
                        "truncated during the install", path=source.path)
                out.append(piece[:count])  # append copies the bytes, so the buffer is reused at once
                offset += count
            out.finish()
        except BaseException:
            out.abort()
            raise
        os.chmod(staged, 0o444)
        return staged

    def _commit(self, current: Installed, previous: Installed | None, high_water: str) -> None:
        """The commit point: state.json replaced by tmp, fsync, rename, directory fsync."""
        _fs.write_durable(os.path.join(self.install_dir, STATE_NAME),
                              _encode_state(current, previous, high_water))

    def _remove_leftovers(self) -> None:
        """Temporary files of an install that was killed (we hold the lock, so none is in progress)."""
        for directory in (self.install_dir, os.path.join(self.install_dir, VERSIONS_DIR)):
            for name in os.listdir(directory):
                if name.startswith(_TMP_MARK) or _is_state_tmp(name):
                    _fs.unlink_quietly(os.path.join(directory, name))
        self._remove_unreferenced()

    def _remove_unreferenced(self) -> None:
        """Installed files that state.json no longer names (the ones before `previous`)."""
        current, previous, _ = self._state()
        keep = {os.path.basename(i.path) for i in (current, previous) if i is not None}
        versions = os.path.join(self.install_dir, VERSIONS_DIR)
        for name in os.listdir(versions):
            if name not in keep and name.endswith(".snpx") and not name.startswith(_TMP_MARK):
                _fs.unlink_quietly(os.path.join(versions, name))


def _is_state_tmp(name: str) -> bool:
    """_fs.write_durable's temporary name for state.json (`state.json.<hex>.tmp`), left by a kill."""
    return name.startswith(f"{STATE_NAME}.") and name.endswith(".tmp")

