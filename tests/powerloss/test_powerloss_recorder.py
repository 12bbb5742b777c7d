"""The recording shim (recorder.c) misses nothing: replaying its log rebuilds the tree bit for bit.

The sweep is only as good as the log: a write the shim does not see is a write the model never loses. So each
way SneppX (and Python under it) changes files is run under the shim, and the log replayed on the tree from
before must give exactly the tree after. What the model can't follow must fail the recording, not pass
unnoticed; and every libc function that can change a file, imported by Python or the native library, must be
one the shim wraps.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import crashfs
import oplog
import pytest

from SneppX_ALG import _native


def record_script(shim: pathlib.Path, tmp_path: pathlib.Path, script: str) -> tuple[crashfs.Replay, crashfs.Tree]:
    """Runs `script` (ROOT is its root) under the shim; returns the replayed log and the tree it left."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "before").write_bytes(b"there before")
    initial = crashfs.read_tree(root)
    source = f"ROOT = {str(root)!r}\n" + textwrap.dedent(script)
    ops = oplog.record(shim, root, [sys.executable, "-c", source], workdir=tmp_path)
    return crashfs.Replay(initial, ops), crashfs.read_tree(root)


def kinds(replay: crashfs.Replay) -> set[str]:
    return {op.kind for op in replay.ops}


PYTHON_CALLS = """
import os, shutil, pathlib
os.chdir(ROOT)                                              # relative paths below are resolved by the shim
fd = os.open("a", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)    # open64
os.write(fd, b"hello world")                                # write
os.pwrite(fd, b"HELLO", 0)                                  # pwrite64
os.pwritev(fd, [b"-", b"v"], 5)                             # pwritev64v2
os.lseek(fd, 100, os.SEEK_SET)
os.writev(fd, [b"after", b" a hole"])                       # writev at the file position
os.ftruncate(fd, 110)                                       # ftruncate64
os.posix_fallocate(fd, 0, 200)                              # posix_fallocate64
os.fsync(fd)
os.fdatasync(fd)
copy = os.dup(fd)                                           # fcntl(F_DUPFD_CLOEXEC)
os.write(copy, b"!")
os.close(copy)
os.dup2(fd, 50)                                             # dup2
os.write(50, b"via 50")
os.close(50)
os.close(fd)
fd = os.open("a", os.O_WRONLY | os.O_APPEND)
os.write(fd, b" appended")                                  # O_APPEND: goes to the end
os.pwrite(fd, b" also appended", 0)                         # Linux: pwrite on O_APPEND appends too
os.close(fd)
with open("b", "wb") as f:                                  # io.FileIO
    f.write(b"x" * 10000)
with open("b", "ab") as f:
    f.write(b"y")
pathlib.Path("c").write_bytes(b"c")
pathlib.Path("t").write_bytes(b"t" * 1000)
os.truncate("t", 300)                                       # truncate64
os.mkdir("d")                                               # mkdir
os.makedirs("d/e/f")
dir_fd = os.open("d", os.O_RDONLY | os.O_DIRECTORY)
inner = os.open("g", os.O_WRONLY | os.O_CREAT, dir_fd=dir_fd)  # openat64
os.write(inner, b"g")
os.close(inner)
os.rename("g", "h", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # renameat
os.mkdir("m", dir_fd=dir_fd)                                # mkdirat
os.link("h", "h2", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)   # linkat
os.unlink("h2", dir_fd=dir_fd)                              # unlinkat
os.rmdir("m", dir_fd=dir_fd)                                # unlinkat(AT_REMOVEDIR)
assert sorted(e.name for e in os.scandir(dir_fd)) == ["e", "h"]  # reads a dup of dir_fd, closedir closes it
elsewhere = os.open(os.path.join(ROOT, "..", "elsewhere"), os.O_WRONLY | os.O_CREAT)  # may reuse that number
os.write(elsewhere, b"not under the root")
os.close(elsewhere)
os.fsync(dir_fd)
os.close(dir_fd)
os.rename("c", "d/e/c")                                     # rename across directories
pathlib.Path("r").write_bytes(b"replaced")
os.replace("b", "r")                                        # rename over an existing file
os.link("a", "a2")                                          # link
os.unlink("before")                                         # unlink
os.rmdir("d/e/f")                                           # rmdir
os.sync()                                                   # sync
os.mkdir("gone")
pathlib.Path("gone/x").write_bytes(b"x")
shutil.rmtree("gone")                                       # the fd-based rmtree (openat, unlinkat, closedir)
"""


def test_replaying_the_log_of_pythons_os_calls_rebuilds_the_tree(recorder_shim: pathlib.Path,
                                                                 tmp_path: pathlib.Path) -> None:
    replay, after = record_script(recorder_shim, tmp_path, PYTHON_CALLS)
    assert replay.final() == after
    assert kinds(replay) >= {"open", "close", "dup", "write", "trunc", "truncpath", "falloc", "fsync", "fdatasync",
                             "sync", "rename", "link", "unlink", "rmdir", "mkdir"}


NATIVE_WRITER = """
import os
from SneppX_ALG import _native
payload = bytes(range(251)) * 400                       # ~100 KiB: a dozen 8 KiB staging buffers
for name, direct in (("direct.snpx", True), ("buffered.snpx", False)):
    tmp = os.path.join(ROOT, name + ".tmp")
    f = _native.NativeFile(tmp, direct=direct, buffer_bytes=8192)
    f.append(payload)
    f.pwrite(b"H" * 16, 0)                              # already on its way to disk: the second, buffered fd
    f.append(b"tail")                                   # not a whole block: padded, then trimmed
    f.finish()
    _native.rename_durable(tmp, os.path.join(ROOT, name))
aborted = _native.NativeFile(os.path.join(ROOT, "aborted.tmp"), direct=True, buffer_bytes=8192)
aborted.append(payload)
aborted.abort()
"""


def test_replaying_the_log_of_the_native_writer_rebuilds_the_tree(recorder_shim: pathlib.Path,
                                                                  tmp_path: pathlib.Path) -> None:
    replay, after = record_script(recorder_shim, tmp_path, NATIVE_WRITER)
    assert replay.final() == after
    payload = bytes(range(251)) * 400
    assert after["direct.snpx"] == after["buffered.snpx"] == b"H" * 16 + payload[16:] + b"tail"
    assert replay.direct_writes > 1 and replay.buffered_writes > 1, "both writer modes must have been recorded"
    assert {"setfl", "syncrange", "trunc", "fsync", "rename", "unlink"} <= kinds(replay)


@pytest.mark.parametrize(("what", "script"), [
    ("symlink", "os.symlink('before', os.path.join(ROOT, 'link'))"),
    ("sendfile", "shutil.copyfile(os.path.join(ROOT, 'before'), os.path.join(ROOT, 'copy'))"),
    ("mkfifo", "os.mkfifo(os.path.join(ROOT, 'fifo'))"),
    ("shared writable mmap", "f = open(os.path.join(ROOT, 'before'), 'r+b'); mmap.mmap(f.fileno(), 4)"),
    ("fopen64 for writing", "ctypes.CDLL(None).fopen64(os.path.join(ROOT, 'stdio').encode(), b'w')"),
    ("O_TMPFILE", "os.open(ROOT, os.O_TMPFILE | os.O_WRONLY)"),
])
def test_a_call_the_model_cannot_follow_fails_the_recording(recorder_shim: pathlib.Path, tmp_path: pathlib.Path,
                                                             what: str, script: str) -> None:
    with pytest.raises(oplog.RecordingError, match=what):
        record_script(recorder_shim, tmp_path, "import ctypes, mmap, os, shutil\n" + script)


# libc functions that can change a file or a directory, or move an fd the shim follows
MUTATING = {
    "open", "open64", "openat", "openat64", "__open_2", "__open64_2", "__openat_2", "__openat64_2", "creat",
    "creat64", "close", "close_range", "closedir", "fclose", "dup", "dup2", "dup3", "fcntl", "fcntl64", "write",
    "pwrite", "pwrite64", "writev", "pwritev", "pwritev64", "pwritev2", "pwritev64v2", "ftruncate", "ftruncate64",
    "truncate", "truncate64", "fallocate", "fallocate64", "posix_fallocate", "posix_fallocate64", "fsync",
    "fdatasync", "syncfs", "sync", "sync_file_range", "rename", "renameat", "renameat2", "link", "linkat", "unlink",
    "unlinkat", "rmdir", "mkdir", "mkdirat", "symlink", "symlinkat", "fopen", "fopen64", "fdopen", "freopen",
    "freopen64", "copy_file_range", "sendfile", "sendfile64", "splice", "tee", "vmsplice", "mmap", "mmap64",
    "mknod", "mknodat", "mkfifo", "mkfifoat", "remove", "aio_write", "aio_write64", "lio_listio", "lio_listio64",
}


def dynamic_symbols(path: str | os.PathLike[str], which: str) -> set[str]:
    out = subprocess.run(["nm", "-D", which, str(path)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is not installed")
def test_the_shim_wraps_every_mutating_libc_call_python_and_the_native_library_import(
        recorder_shim: pathlib.Path) -> None:
    libpython = pathlib.Path(sysconfig.get_config_var("LIBDIR") or "") / (sysconfig.get_config_var("LDLIBRARY") or "")
    native = next(pathlib.Path(_native.__file__).parents[1].glob("_sneppx_native*.so"))  # _native/__init__.py
    binaries = [pathlib.Path(sys.executable).resolve(), native]
    if libpython.is_file():
        binaries.append(libpython)
    binaries += sorted(pathlib.Path(sysconfig.get_config_var("DESTSHARED")).glob("*.so"))
    imported = set().union(*(dynamic_symbols(b, "--undefined-only") for b in binaries)) & MUTATING
    assert {"open64", "pwrite", "fsync", "rename"} <= imported, f"implausible imports: {sorted(imported)}"
    missing = imported - dynamic_symbols(recorder_shim, "--defined-only")
    assert not missing, f"imported but not wrapped by recorder.c, so their effects would go unrecorded: {missing}"

