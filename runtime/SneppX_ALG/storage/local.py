"""A local root (a disk, a PVC, an NFS mount): checkpoint steps as directories (temp dir, fsync, rename). Its
compare-and-swap records are records/local.py's.

A step's temporary directory is named for its owner (`.tmp-step-<step>-<writer>-<host>-<pid>-<pid start>`) and
touched by its writer while the save runs (storage/lease.py), so `cleanup()` removes only directories whose
writer is gone. In a group of ranks, rank 0 owns it and the others write their shard files into it too (they
`join` it by its name and touch it while they write): rank 0's rename commits every rank's files at once,
and if rank 0 is gone nothing can commit them, so cleanup's verdict on the owner is the right one for all.
Records live under their own keys (`rdzv/...`), which no step listing or cleanup touches.
"""

from __future__ import annotations

import contextlib
import errno as errno_module
import os
import secrets
import time
from collections.abc import Iterator

from SneppX_ALG import _fs, _native, errors
from SneppX_ALG.storage import base, layout, lease


class LocalStorage:
    """Steps as directories under a local root (a disk, a PVC, an NFS mount)."""

    def __init__(self, root: str, *, lease_expiry_s: float = lease.LEASE_EXPIRY_S):
        self.root = os.path.abspath(root)
        self.uri = self.root
        try:
            _make_durable_dirs(self.root)
        except OSError as e:
            raise errors.StorageError(f"can't create checkpoint root {self.root}: {e.strerror}", path=self.root,
                                      errno=e.errno) from None
        self.lease_expiry_s = lease_expiry_s
        self.lease = lease.WriterLease(publish=self._touch, refresh=self._touch, withdraw=lambda: None,
                                       expiry_s=lease_expiry_s)
        self._in_flight: dict[int, str] = {}  # step -> its temporary directory

    def _touch(self) -> None:
        """The writer's sign of life: the mtime of each temporary directory it has in flight."""
        for path in list(self._in_flight.values()):
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)

    def step_path(self, step: int) -> str:
        return os.path.join(self.root, layout.step_name(step))

    def committed_steps(self) -> list[int]:
        steps = []
        for entry in os.scandir(self.root):
            step = layout.parse_step_name(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):
                steps.append(step)
        return sorted(steps)

    def begin(self, step: int) -> base.PendingStep:
        self.lease.hold(step)
        tmp = os.path.join(self.root, f"{layout.TMP_PREFIX}{step:09d}-{self.lease.owner().name()}")
        try:
            os.mkdir(tmp)  # the claim: named for its owner, created whole
        except OSError as e:
            self.lease.release(step)
            raise _os_error(e, tmp) from None
        self._in_flight[step] = tmp
        return base.PendingStep(step=step, local_dir=tmp, token=os.path.basename(tmp))

    def join(self, step: int, token: str) -> base.PendingStep:
        """Another rank's step in flight (`token`: the temporary directory rank 0's begin() made): this rank
        writes its files into it, and touches it while it does (it is never this rank's to remove)."""
        if "/" in token or "\x00" in token or not token.startswith(f"{layout.TMP_PREFIX}{step:09d}-"):
            raise ValueError(f"{token!r} is not a temporary directory of step {step}")
        tmp = os.path.join(self.root, token)
        if not os.path.isdir(tmp):
            raise errors.StorageError(f"{tmp}, where rank 0 writes step {step}, is gone", path=tmp)
        self.lease.hold(step)
        self._in_flight[step] = tmp
        return base.PendingStep(step=step, local_dir=tmp, token=token, owner=False)

    def upload(self, pending: base.PendingStep, names: list[str]) -> base.Parts:
        """The files are in place already (written durably into the temporary directory): their sizes."""
        return {name: (self._size(pending.local_dir, name), "") for name in names}

    def shard_sink(self, pending: base.PendingStep, name: str) -> None:
        """None: shards are files in the step's temp directory, renamed into place by finalize()."""
        return

    def _end(self, step: int) -> None:
        self._in_flight.pop(step, None)
        self.lease.release(step)

    def finalize(self, pending: base.PendingStep, manifest: bytes, signature: bytes | None,
                 parts: base.Parts) -> str:
        try:
            return self._finalize(pending, manifest, signature, parts)
        finally:
            self._end(pending.step)

    def _finalize(self, pending: base.PendingStep, manifest: bytes, signature: bytes | None,
                  parts: base.Parts) -> str:
        final = self.step_path(pending.step)
        sizes = {name: size for name, (size, _) in parts.items()}
        missing = sorted(set(base.manifest_shards(manifest)) - set(sizes))
        if missing:
            raise errors.StorageError(f"no rank reported writing {', '.join(missing)}", path=pending.local_dir)
        for name, size in sizes.items():  # every rank's file is there as that rank wrote it
            if self._size(pending.local_dir, name) != size:
                raise errors.StorageError(f"{name} in {pending.local_dir} is not the size its writer reported",
                                          path=pending.local_dir)
        parts = dict(parts)
        _fs.write_durable(os.path.join(pending.local_dir, layout.MANIFEST), manifest)
        sizes[layout.MANIFEST] = len(manifest)
        if signature is not None:  # before the commit point: a committed signed step always has its signature
            _fs.write_durable(os.path.join(pending.local_dir, layout.SIGNATURE), signature)
            sizes[layout.SIGNATURE] = len(signature)
        if os.path.lexists(final):
            raise errors.CheckpointExistsError(f"{final} is already committed; a step is never overwritten",
                                               path=final)
        for name, size in sizes.items():  # nothing was removed under us (a cleaner that judged us gone)
            if self._size(pending.local_dir, name) != size:
                raise errors.StorageError(f"{name} in {pending.local_dir} changed size before the commit",
                                          path=pending.local_dir)
        try:
            _native.rename_durable(pending.local_dir, final)  # the commit point
        except BaseException:
            if not os.path.lexists(pending.local_dir) and os.path.lexists(final):
                self._uncommit(final, pending.local_dir)
            raise
        return final

    @staticmethod
    def _size(directory: str, name: str) -> int:
        path = os.path.join(directory, name)
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            raise errors.StorageError(f"{path} is missing at the commit: removed since it was written (by a "
                                      "cleanup that judged this writer gone?)", path=path) from None

    def _uncommit(self, final: str, tmp: str) -> None:
        """The rename happened but its fsync failed: the step must not stay visible as committed. Renamed
        back to its temporary name (abort() or the next cleanup() removes it), else removed (best effort)."""
        try:
            os.rename(final, tmp)
        except OSError:
            _fs.remove_tree(final)
            return
        with contextlib.suppress(OSError):
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def abort(self, pending: base.PendingStep) -> None:
        """Drops the step in flight: its directory (every rank's files) when this rank made it."""
        if pending.owner:
            _fs.remove_tree(pending.local_dir)
        self._end(pending.step)

    def leave(self, pending: base.PendingStep) -> None:
        """This rank is done with a step rank 0 commits (or aborts): the claim ends, the files stay."""
        self._end(pending.step)

    @contextlib.contextmanager
    def open_step(self, step: int) -> Iterator[str]:
        path = self.step_path(step)
        if not os.path.isdir(path):
            raise errors.CheckpointNotFoundError(f"no committed checkpoint for step {step} in {self.root}",
                                                 path=path)
        yield path

    @contextlib.contextmanager
    def read_step(self, step: int) -> Iterator[base.StepReader]:
        """Ranged reads of a committed step's files (pread through the native reader and its fault hook)."""
        with self.open_step(step) as path:
            reader = LocalStepReader(path)
            try:
                yield reader
            finally:
                reader.close()

    def delete(self, step: int) -> None:
        path = self.step_path(step)
        doomed = os.path.join(self.root, f"{layout.DELETING_PREFIX}{step:09d}-{secrets.token_hex(4)}")
        _native.rename_durable(path, doomed)  # invisible from here on, even if the removal is cut short
        _fs.remove_tree(doomed)

    def set_aside(self, step: int, reason: str) -> str:
        """Moves a committed step out of the step namespace, kept for inspection as `.<reason>-step-...`
        (one durable rename: invisible as a step from then on)."""
        aside = os.path.join(self.root, layout.set_aside_name(step, reason))
        _native.rename_durable(self.step_path(step), aside)
        return aside

    def set_aside_steps(self) -> list[tuple[int, str]]:
        """(step, name) of every set-aside step under the root."""
        found = []
        for entry in os.scandir(self.root):
            step = layout.parse_set_aside_name(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):
                found.append((step, entry.name))
        return sorted(found)

    def remove_set_aside(self, name: str) -> None:
        if layout.parse_set_aside_name(name) is None:
            raise ValueError(f"{name!r} is not a set-aside step")
        _fs.remove_tree(os.path.join(self.root, name))

    def read_root_file(self, name: str) -> bytes | None:
        return _fs.read_small(os.path.join(self.root, name), layout.MAX_MANIFEST_BYTES)

    def write_root_file(self, name: str, data: bytes) -> None:
        _fs.write_durable(os.path.join(self.root, name), data)

    def remove_root_file(self, name: str) -> None:
        _fs.unlink_quietly(os.path.join(self.root, name))
        _native.fsync_path(self.root)

    def cleanup(self) -> list[str]:
        """Removes what crashed or failed saves left: temporary directories whose writer is gone (by name: a
        dead process on this host, this process's own finished saves, or no sign of life for lease_expiry_s;
        a name without an owner, from an older version, counts as gone) and `.deleting-*` directories
        (invisible already: removing one twice is harmless), and a root file's temporary copy
        (`FENCE.<hex>.tmp`) a kill left. Set-aside steps and the coordinator's FENCE record are not leftovers:
        retention bounds the first, the next writer finishes the second."""
        removed = []
        for entry in os.scandir(self.root):
            if entry.name.startswith(layout.TMP_PREFIX):
                step, _, owner_name = entry.name[len(layout.TMP_PREFIX):].partition("-")
                owner = lease.Owner.from_name(owner_name)
                if owner is not None and step.isdigit() and lease.still_writing(
                        owner, int(step), self._age(entry.path), self.lease_expiry_s):
                    continue
            elif layout.ROOT_FILE_TMP_RE.match(entry.name) and entry.is_file(follow_symlinks=False):
                _fs.unlink_quietly(entry.path)  # a root file's write cut short: the file itself is intact or absent
                removed.append(entry.path)
                continue
            elif not entry.name.startswith(layout.DELETING_PREFIX):
                continue
            _fs.remove_tree(entry.path)
            removed.append(entry.path)
        return removed

    @staticmethod
    def _age(path: str) -> float:
        """Seconds since `path` was last touched, by this host's clock (0 if it is gone: nothing to judge)."""
        try:
            return max(0.0, time.time() - os.stat(path).st_mtime)
        except FileNotFoundError:
            return 0.0

    # -- what `sneppx ls` shows --

    def inventory(self) -> list[layout.Entry]:
        """Every step-like directory under the root (storage.Entry), with its files' sizes; nothing is read."""
        return _inventory(self.root)

    def read_entry_file(self, name: str, leaf: str) -> bytes | None:
        """A small file (manifest, signature) of an inventory entry, or None when it has none."""
        if layout.classify_entry(name) is None or not layout.is_plain_name(leaf):
            raise ValueError(f"{name}/{leaf} is not a file of a step")
        return _fs.read_small(os.path.join(self.root, name, leaf), layout.MAX_MANIFEST_BYTES)


def _make_durable_dirs(path: str) -> None:
    """os.makedirs, then an fsync of the parent of each directory it made: a new directory's name is durable
    only once its parent is synced, and without that a power cut could take a new root away with the steps
    committed in it (found by the power-loss sweep, tests/powerloss)."""
    made = []
    missing = path
    while not os.path.isdir(missing):
        made.append(missing)
        missing = os.path.dirname(missing)
    os.makedirs(path, exist_ok=True)
    for directory in made:
        _native.fsync_path(os.path.dirname(directory))


def _os_error(e: OSError, path: str) -> errors.StorageError:
    if e.errno in (errno_module.ENOSPC, errno_module.EDQUOT):
        return errors.DiskFullError(f"{path}: {e.strerror}", path=path, errno=e.errno)
    return errors.StorageError(f"{path}: {e.strerror}", path=path, errno=e.errno)


def _inventory(root: str) -> list[layout.Entry]:
    """LocalStorage.inventory(): every step-like directory under `root`, with its files' sizes."""
    found = []
    for entry in os.scandir(root):
        kind = layout.classify_entry(entry.name)
        if kind is None or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            files = {f.name: f.stat(follow_symlinks=False).st_size for f in os.scandir(entry.path)
                     if f.is_file(follow_symlinks=False)}
        except FileNotFoundError:
            continue  # removed since the root was listed
        found.append(layout.Entry(entry.name, kind[0], kind[1], files))
    return found


class LocalStepReader:
    """base.StepReader over a step directory: each file opened once (never through a symbolic link, never a
    FIFO waited on), read with pread through the native reader into the caller's buffer."""

    def __init__(self, directory: str):
        self.location = directory
        self.marker: bytes | None = None
        self.bytes_read = 0
        self._files: dict[str, tuple[int, int]] = {}

    def _open(self, name: str) -> tuple[int, int]:
        if name not in self._files:
            if not layout.is_plain_name(name):
                raise ValueError(f"{name!r} is not a file name in a step")
            self._files[name] = _fs.open_checked(os.path.join(self.location, name), follow_symlinks=False)
        return self._files[name]

    def read_file(self, name: str) -> bytes | None:
        return _fs.read_small(os.path.join(self.location, name), layout.MAX_MANIFEST_BYTES)

    def size(self, name: str) -> int:
        return self._open(name)[1]

    def read_blocks(self, name: str, buffer: memoryview, offset: int, block_bytes: int) -> list[int]:
        # One read for the whole range: the native reader spreads a large one over threads, and takes each
        # block's CRC as the block lands.
        crcs = _native.read_blocks_at(self._open(name)[0], buffer, offset, block_bytes,
                                      path=os.path.join(self.location, name))
        self.bytes_read += len(buffer)
        return crcs

    def close(self) -> None:
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()
