"""Recording what a process does to the files under one directory: the LD_PRELOAD shim (recorder.c) and its log.

Why a shim and not strace or a FUSE file system: it needs nothing installed, costs almost nothing, sees the
native writer's threads and Python's os.* calls alike, and records the bytes of every write, so the log alone
rebuilds any state the directory could be in after a power cut (crashfs.py).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import subprocess
import urllib.parse
from collections.abc import Mapping, Sequence

SHIM_SOURCE = pathlib.Path(__file__).with_name("recorder.c")


class RecordingError(AssertionError):
    """The recorded process did something the log can't follow (a stdio write, sendfile, an unknown fd...)."""


@dataclasses.dataclass(frozen=True)
class Op:
    """One successful mutating call (or fd bookkeeping) under the root, in the order it happened.

    Paths are relative to the root ("" is the root itself). Which fields mean something depends on `kind`:
    open (fd, flags, path), close (fd), dup (fd -> fd2), setfl (fd, flags), write (fd, offset, data),
    trunc (fd, length), truncpath (path, length), falloc (fd, flags = mode, offset, length),
    fsync / fdatasync (fd), syncrange (fd, offset, length, flags), syncfs (fd, -1 when not under the root),
    sync, rename / link (path -> path2), unlink / rmdir / mkdir (path), mark (path = the text mark() was
    given; not a file-system call).
    """

    index: int
    kind: str
    fd: int = -1
    fd2: int = -1
    path: str = ""
    path2: str = ""
    offset: int = 0
    length: int = 0
    flags: int = 0
    data: bytes = b""


def mark(text: str) -> None:
    """Called by the recorded process: puts `text` in the log between the ops before and after this call, e.g.
    "saved 8" once wait() has returned (a crash state after it must still hold step 8). No-op unrecorded."""
    log = os.environ.get("SNEPPX_PL_LOG")
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND)
        try:  # one write on an O_APPEND fd: never interleaved with the shim's lines
            os.write(fd, f"mark\t{urllib.parse.quote(text)}\n".encode())
        finally:
            os.close(fd)


def build_shim(folder: pathlib.Path) -> pathlib.Path:
    """Compiles recorder.c into `folder` (a C compiler is there: the package itself is built with one)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    assert compiler, "a C compiler is needed to build the recording shim"
    library = folder / "librecorder.so"
    result = subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Wno-format-truncation", "-o",
                             str(library), str(SHIM_SOURCE), "-ldl", "-lpthread"],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"building the recording shim failed:\n{result.stderr}"
    return library


def record(shim: pathlib.Path, root: pathlib.Path, argv: Sequence[str], *, workdir: pathlib.Path,
           env: Mapping[str, str] | None = None, timeout: float = 300) -> list[Op]:
    """Runs `argv` with the shim preloaded, recording under `root`; returns the log (the command must exit 0)."""
    log, data = workdir / "ops.log", workdir / "ops.data"
    for stale in (log, data):
        stale.unlink(missing_ok=True)
    run_env = {**os.environ, **(env or {}), "LD_PRELOAD": str(shim), "SNEPPX_PL_ROOT": str(root),
               "SNEPPX_PL_LOG": str(log), "SNEPPX_PL_DATA": str(data)}
    result = subprocess.run(list(argv), env=run_env, check=False, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"the recorded process failed ({result.returncode}):\n{result.stderr[-4000:]}"
    return parse(log.read_text(), data.read_bytes() if data.exists() else b"", os.path.realpath(root))


def parse(text: str, data: bytes, root: str) -> list[Op]:
    """The shim's log as Ops; an `err` line raises RecordingError (the model would be wrong past it)."""
    ops = []
    for index, line in enumerate(text.splitlines()):
        kind, *fields = line.split("\t")
        if kind == "err":
            raise RecordingError(f"the recorder can't follow a call: {' '.join(map(_unescape, fields))}")
        ops.append(_op(index, kind, fields, data, root))
    return ops


def _unescape(field: str) -> str:
    return urllib.parse.unquote(field, errors="surrogateescape")


def _relative(field: str, root: str) -> str:
    path = _unescape(field)
    if path == root:
        return ""
    assert path.startswith(root + "/"), f"{path} is not under {root}"
    return path[len(root) + 1:]


def _op(index: int, kind: str, fields: list[str], data: bytes, root: str) -> Op:
    def num(i: int) -> int:
        return int(fields[i])

    def path(i: int) -> str:
        return _relative(fields[i], root)

    match kind:
        case "open":
            return Op(index, kind, fd=num(0), flags=num(1), path=path(2))
        case "close" | "fsync" | "fdatasync" | "syncfs":
            return Op(index, kind, fd=num(0))
        case "dup":
            return Op(index, kind, fd=num(0), fd2=num(1))
        case "setfl":
            return Op(index, kind, fd=num(0), flags=num(1))
        case "write":
            assert num(1) >= 0, f"op {index}: a write at an unknown offset"
            return Op(index, kind, fd=num(0), offset=num(1), length=num(2), data=data[num(3):num(3) + num(2)])
        case "trunc":
            return Op(index, kind, fd=num(0), length=num(1))
        case "truncpath":
            return Op(index, kind, path=path(0), length=num(1))
        case "falloc":
            return Op(index, kind, fd=num(0), flags=num(1), offset=num(2), length=num(3))
        case "syncrange":
            return Op(index, kind, fd=num(0), offset=num(1), length=num(2), flags=num(3))
        case "sync":
            return Op(index, kind)
        case "rename" | "link":
            return Op(index, kind, path=path(0), path2=path(1))
        case "unlink" | "rmdir" | "mkdir":
            return Op(index, kind, path=path(0))
        case "mark":
            return Op(index, kind, path=_unescape(fields[0]))
    raise RecordingError(f"op {index}: unknown log line kind {kind!r}")
