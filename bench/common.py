"""Helpers every benchmark area shares: what machine this is, and durable writes for the baselines."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """The CPU's model name, for the machine line of each result."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fsync_path(path: str) -> None:
    """fsync of a written file, so a baseline that writes through Python pays for durability as SNPX does."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(root: str | os.PathLike[str]) -> None:
    """Drops the clean pages of every file under `root` from the page cache (posix_fadvise DONTNEED: no root
    access needed), so the next read of them comes from the disk."""
    for folder, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
