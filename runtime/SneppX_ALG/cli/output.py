"""What every `sneppx` subcommand shares: sizes for people, progress bars, and where a checkpoint is.

Exit codes, the same for every subcommand: 0 all good, 1 something invalid (or, for `diff`, different),
2 the command could not judge (a bad argument or key, an unreadable location).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
from collections.abc import Callable, Iterator

from SneppX_ALG import errors, storage
from SneppX_ALG.checkpoint import manifest as manifest_codec

OK, INVALID, TROUBLE = 0, 1, 2

# Less than this reads in a second or two: no progress bar ("a few hundred MB").
PROGRESS_MIN_BYTES = 256 << 20

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}


def human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def parse_size(text: str) -> int:
    """`5GB`, `500MiB`, `1000000`: a size in bytes (for argparse: ValueError on anything else)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def age(created: str | None, now: datetime.datetime | None = None) -> str:
    """`3h 20m` since an ISO time (a manifest's `created`); "?" when there is none."""
    try:
        then = datetime.datetime.fromisoformat(created or "")
    except ValueError:
        return "?"
    seconds = int(((now or datetime.datetime.now(datetime.UTC)) - then).total_seconds())
    if seconds < 0:
        return "in the future"
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {seconds}s" if minutes else f"{seconds}s"


@contextlib.contextmanager
def progress_bar(label: str, total: int, enabled: bool = True) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar on stderr while more than PROGRESS_MIN_BYTES are read and stderr is a terminal; the
    callback takes (bytes done, bytes in all). None otherwise."""
    if not enabled or total < PROGRESS_MIN_BYTES or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda done, in_all: bar.update(task, completed=done, total=in_all)


def file_size(path: str) -> int:
    """Bytes in a file, or in the files directly in a directory (a step, a sharded checkpoint); 0 if unreadable."""
    try:
        if os.path.isdir(path):
            return sum(e.stat().st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False))
        return os.path.getsize(path)
    except OSError:
        return 0


def split_step_uri(location: str) -> tuple[str, int] | None:
    """(root, step) of `s3://bucket/prefix/step-000000100`, or None for anything else."""
    if not location.startswith("s3://"):
        return None
    root, _, leaf = location.rstrip("/").rpartition("/")
    step = storage.parse_step_name(leaf)
    return (root, step) if step is not None and root.count("/") >= 2 else None


@contextlib.contextmanager
def local_path(location: str) -> Iterator[str]:
    """A local path for a checkpoint location: itself, or for an S3 step (`s3://bucket/prefix/step-N`) a
    temporary copy of the committed step (its marker checked as the coordinator checks it)."""
    s3_step = split_step_uri(location)
    if s3_step is None:
        if location.startswith("s3://"):
            raise ValueError(f"{location}: on S3, name a step (s3://bucket/prefix/step-000000100); "
                             "`sneppx ls s3://bucket/prefix` lists them")
        yield location
        return
    root, step = s3_step
    store = storage.open_storage(root)
    with store.open_step(step) as local:
        _fetch_references(store, local, step)
        yield local


_FETCH_PIECE = 8 << 20  # a referenced file is copied down in ranged reads of this size


def _fetch_references(store: storage.Storage, local: str, step: int) -> None:
    """The earlier steps' files an incremental step references, fetched beside its local copy, where the
    commands' readers look for them (checkpoint.verify.sibling_steps), as a local root lays them out. Only once
    its manifest parses and checks (the format bounds how many steps and files it may name), and only from
    committed steps (read_step reads the marker first); what is missing is for the reader to report."""
    try:
        with open(os.path.join(local, storage.MANIFEST), "rb") as f:
            manifest = manifest_codec.decode_manifest(f.read(storage.MAX_MANIFEST_BYTES + 1), step=step, where=local)
    except (OSError, errors.ManifestError):
        return
    wanted: dict[int, set[str]] = {}
    for tensor in manifest["tensors"]:
        for part in manifest_codec.parts_of(tensor):
            if "from" in part:
                wanted.setdefault(part["from"][0], set()).add(part["from"][1])
    buffer = bytearray(_FETCH_PIECE)
    for origin, names in sorted(wanted.items()):
        beside = os.path.join(os.path.dirname(local), storage.step_name(origin))
        try:
            with store.read_step(origin) as reader:
                os.makedirs(beside, exist_ok=True)
                for name in sorted(names):
                    size = reader.size(name)
                    with open(os.path.join(beside, name), "wb") as out:
                        for offset in range(0, size, _FETCH_PIECE):
                            piece = memoryview(buffer)[:min(_FETCH_PIECE, size - offset)]
                            reader.read_blocks(name, piece, offset, _FETCH_PIECE)
                            out.write(piece)
        except errors.CheckpointNotFoundError:
            continue


def fail(command: str, error: BaseException) -> None:
    """One line on stderr for an error: `sneppx CMD: ErrorClass: message`."""
    print(f"sneppx {command}: {type(error).__name__}: {error}", file=sys.stderr)
