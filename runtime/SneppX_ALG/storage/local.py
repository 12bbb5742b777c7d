"""Steps as directories under a local root (a disk, a PVC, an NFS mount): temp dir, fsync, rename."""

from __future__ import annotations

import contextlib
import errno as errno_module
import os
import secrets
from collections.abc import Iterator

from SneppX_ALG import _native, errors
from SneppX_ALG.storage import base


class LocalStorage:
    """Steps as directories under a local root (a disk, a PVC, an NFS mount)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.uri = self.root
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise errors.StorageError(f"can't create checkpoint root {self.root}: {e.strerror}", path=self.root,
                                      errno=e.errno) from None

    def step_path(self, step: int) -> str:
        return os.path.join(self.root, base.step_name(step))

    def committed_steps(self) -> list[int]:
        steps = []
        for entry in os.scandir(self.root):
            step = base.parse_step_name(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):
                steps.append(step)
        return sorted(steps)

    def begin(self, step: int) -> base.PendingStep:
        tmp = os.path.join(self.root, f"{base.TMP_PREFIX}{step:09d}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(tmp)
        except OSError as e:
            raise _os_error(e, tmp) from None
        return base.PendingStep(step=step, local_dir=tmp)

    def finalize(self, pending: base.PendingStep, manifest: bytes, signature: bytes | None = None) -> str:
        final = self.step_path(pending.step)
        base.write_durable(os.path.join(pending.local_dir, base.MANIFEST), manifest)
        if signature is not None:  # before the commit point: a committed signed step always has its signature
            base.write_durable(os.path.join(pending.local_dir, base.SIGNATURE), signature)
        if os.path.lexists(final):
            raise errors.CheckpointExistsError(f"{final} is already committed; a step is never overwritten",
                                               path=final)
        try:
            _native.rename_durable(pending.local_dir, final)  # the commit point
        except BaseException:
            if not os.path.lexists(pending.local_dir) and os.path.lexists(final):
                self._uncommit(final, pending.local_dir)
            raise
        return final

    def _uncommit(self, final: str, tmp: str) -> None:
        """The rename happened but its fsync failed: the step must not stay visible as committed. Renamed
        back to its temporary name (abort() or the next cleanup() removes it), else removed (best effort)."""
        try:
            os.rename(final, tmp)
        except OSError:
            base.remove_tree(final)
            return
        with contextlib.suppress(OSError):
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def abort(self, pending: base.PendingStep) -> None:
        base.remove_tree(pending.local_dir)

    @contextlib.contextmanager
    def open_step(self, step: int) -> Iterator[str]:
        path = self.step_path(step)
        if not os.path.isdir(path):
            raise errors.CheckpointNotFoundError(f"no committed checkpoint for step {step} in {self.root}",
                                                 path=path)
        yield path

    def delete(self, step: int) -> None:
        path = self.step_path(step)
        doomed = os.path.join(self.root, f"{base.DELETING_PREFIX}{step:09d}-{secrets.token_hex(4)}")
        _native.rename_durable(path, doomed)  # invisible from here on, even if the removal is cut short
        base.remove_tree(doomed)

    def set_aside(self, step: int, reason: str) -> str:
        """Moves a committed step out of the step namespace, kept for inspection as `.<reason>-step-...`
        (one durable rename: invisible as a step from then on)."""
        aside = os.path.join(self.root, base.set_aside_name(step, reason))
        _native.rename_durable(self.step_path(step), aside)
        return aside

    def set_aside_steps(self) -> list[tuple[int, str]]:
        """(step, name) of every set-aside step under the root."""
        found = []
        for entry in os.scandir(self.root):
            step = base.parse_set_aside_name(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):
                found.append((step, entry.name))
        return sorted(found)

    def remove_set_aside(self, name: str) -> None:
        if base.parse_set_aside_name(name) is None:
            raise ValueError(f"{name!r} is not a set-aside step")
        base.remove_tree(os.path.join(self.root, name))

    def read_record(self, name: str) -> bytes | None:
        try:
            with open(os.path.join(self.root, name), "rb") as f:
                return f.read(base.MAX_MANIFEST_BYTES + 1)
        except FileNotFoundError:
            return None

    def write_record(self, name: str, data: bytes) -> None:
        base.write_durable(os.path.join(self.root, name), data)

    def remove_record(self, name: str) -> None:
        base.unlink_quietly(os.path.join(self.root, name))
        _native.fsync_path(self.root)

    def cleanup(self) -> list[str]:
        removed = []
        for entry in os.scandir(self.root):
            if entry.name.startswith((base.TMP_PREFIX, base.DELETING_PREFIX)):
                base.remove_tree(entry.path)
                removed.append(entry.path)
        return removed


def _os_error(e: OSError, path: str) -> errors.StorageError:
    if e.errno in (errno_module.ENOSPC, errno_module.EDQUOT):
        return errors.DiskFullError(f"{path}: {e.strerror}", path=path, errno=e.errno)
    return errors.StorageError(f"{path}: {e.strerror}", path=path, errno=e.errno)
