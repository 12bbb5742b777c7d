"""The native streaming writer (io.c): O_DIRECT when the filesystem takes it, buffered when it doesn't.

The filesystems here all take O_DIRECT, so the ones that don't are faked at the libc boundary: a small
LD_PRELOAD shim, built for the test, makes open/fcntl/pwrite behave the way such filesystems do, and the
writer runs in a fresh interpreter under it.
"""

from __future__ import annotations

import errno
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from SneppX_ALG import _native, errors

BUFFER = 8192  # two O_DIRECT blocks per staging buffer, so a few KiB cross several buffers

SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

/* SHIM_REFUSE_DIRECT=open: like a filesystem that creates the inode, then refuses O_DIRECT
 *                         (in open and in fcntl F_SETFL).
 * SHIM_REFUSE_DIRECT=write: O_DIRECT is accepted, but every write through such a fd is EINVAL. */
static int refuses(const char *where) {
    const char *mode = getenv("SHIM_REFUSE_DIRECT");
    return mode && !strcmp(mode, where);
}

static int real_open(const char *path, int flags, mode_t mode) {
    static int (*real)(const char *, int, ...);
    if (!real) *(void **)&real = dlsym(RTLD_NEXT, "open");
    return real(path, flags, mode);
}

static int real_fcntl(int fd, int cmd, long arg) {
    static int (*real)(int, int, ...);
    if (!real) *(void **)&real = dlsym(RTLD_NEXT, "fcntl");
    return real(fd, cmd, arg);
}

static int shim_open(const char *path, int flags, va_list ap) {
    mode_t mode = (flags & O_CREAT) ? (mode_t)va_arg(ap, int) : 0;
    if ((flags & O_DIRECT) && refuses("open")) {
        int fd = real_open(path, flags & ~O_DIRECT, mode);
        if (fd < 0) return -1;
        close(fd);
        errno = EINVAL;
        return -1;
    }
    return real_open(path, flags, mode);
}

int open(const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags);
    int fd = shim_open(path, flags, ap);
    va_end(ap);
    return fd;
}

int open64(const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags);
    int fd = shim_open(path, flags, ap);
    va_end(ap);
    return fd;
}

static int shim_fcntl(int fd, int cmd, va_list ap) {
    long arg = va_arg(ap, long);
    if (cmd == F_SETFL && (arg & O_DIRECT) && refuses("open")) { errno = EINVAL; return -1; }
    return real_fcntl(fd, cmd, arg);
}

int fcntl(int fd, int cmd, ...) {
    va_list ap; va_start(ap, cmd);
    int rc = shim_fcntl(fd, cmd, ap);
    va_end(ap);
    return rc;
}

int fcntl64(int fd, int cmd, ...) {
    va_list ap; va_start(ap, cmd);
    int rc = shim_fcntl(fd, cmd, ap);
    va_end(ap);
    return rc;
}

static ssize_t shim_pwrite(int fd, const void *buf, size_t len, off_t off) {
    static ssize_t (*real)(int, const void *, size_t, off_t);
    if (!real) *(void **)&real = dlsym(RTLD_NEXT, "pwrite");
    if (refuses("write") && (real_fcntl(fd, F_GETFL, 0) & O_DIRECT)) {
        usleep(20000); /* slow to refuse, so every writer thread is refused before the first falls back */
        errno = EINVAL;
        return -1;
    }
    return real(fd, buf, len, off);
}

ssize_t pwrite(int fd, const void *buf, size_t len, off_t off) { return shim_pwrite(fd, buf, len, off); }
ssize_t pwrite64(int fd, const void *buf, size_t len, off_t off) { return shim_pwrite(fd, buf, len, off); }
"""


@pytest.fixture(scope="module")
def refuse_direct_shim(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    assert compiler, "a C compiler is needed (the package itself is built with one)"
    folder = tmp_path_factory.mktemp("shim")
    (folder / "shim.c").write_text(SHIM_SOURCE)
    library = folder / "librefuse_direct.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(folder / "shim.c"), "-ldl"],
                   check=True, capture_output=True, timeout=120)
    return library


def write_under_shim(library: pathlib.Path, mode: str, path: pathlib.Path, payload_size: int) -> str:
    """Writes payload_size bytes plus a 16-byte header pwrite at 0 in a fresh interpreter; prints what it saw."""
    script = textwrap.dedent(f"""
        from SneppX_ALG import _native
        payload = bytes(range(251)) * ({payload_size} // 251 + 1)
        payload = payload[:{payload_size}]
        f = _native.NativeFile({str(path)!r}, direct=True, buffer_bytes={BUFFER})
        opened_direct = f.is_direct
        f.append(payload)
        f.pwrite(b"H" * 16, 0)  # waits for the first buffer to reach the file
        after_first_write = f.is_direct
        f.finish()
        print(opened_direct, after_first_write)
    """)
    env = {**os.environ, "LD_PRELOAD": str(library), "SHIM_REFUSE_DIRECT": mode}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def expected_file(payload_size: int) -> bytes:
    payload = (bytes(range(251)) * (payload_size // 251 + 1))[:payload_size]
    return b"H" * 16 + payload[16:]


def test_a_filesystem_that_refuses_o_direct_after_creating_the_file_gets_a_buffered_file(
        refuse_direct_shim: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # The old open(O_DIRECT) then open(O_EXCL) retry failed here with "file exists" on its own empty file.
    path = tmp_path / "shard.bin"
    size = 3 * BUFFER + 4000
    assert write_under_shim(refuse_direct_shim, "open", path, size) == "False False"
    assert path.read_bytes() == expected_file(size)


@pytest.mark.parametrize("size", [3 * BUFFER, 3 * BUFFER + 4000, 3 * BUFFER + 1])
def test_a_filesystem_that_refuses_o_direct_writes_falls_back_and_keeps_every_byte(
        refuse_direct_shim: pathlib.Path, tmp_path: pathlib.Path, size: int) -> None:
    path = tmp_path / "shard.bin"
    assert write_under_shim(refuse_direct_shim, "write", path, size) == "True False"
    assert path.read_bytes() == expected_file(size), "padding left in, or bytes lost, after the fall back"


@pytest.mark.parametrize("size", [0, 1, 4096, BUFFER + 17, 5 * BUFFER - 1])
@pytest.mark.parametrize("direct", [True, False])
def test_a_file_holds_exactly_what_was_appended_and_patched(tmp_path: pathlib.Path, size: int, direct: bool) -> None:
    path = tmp_path / "shard.bin"
    payload = os.urandom(size)
    f = _native.NativeFile(str(path), direct=direct, buffer_bytes=BUFFER)
    assert f.is_direct == direct  # ext4 and tmpfs (the test machines' tmp) take O_DIRECT
    assert f.append(payload) == _native.crc32c(payload)
    if size:
        f.pwrite(b"\xff", 0)
    assert f.size == size
    f.finish()
    assert path.read_bytes() == (b"\xff" + payload[1:] if size else b"")


@pytest.mark.parametrize("direct", [True, False])
def test_a_stream_of_mixed_appends_lands_in_order(tmp_path: pathlib.Path, direct: bool) -> None:
    # Small appends go through the staging buffers, large ones (buffered mode) straight from the caller's
    # memory, and two writer threads finish in any order: the file must still be the stream, byte for byte.
    path = tmp_path / "shard.bin"
    rng = np.random.default_rng(7)
    f = _native.NativeFile(str(path), direct=direct, buffer_bytes=64 << 10)
    expected = bytearray()
    for size in [100, 3 << 20, 4096, (1 << 20) + 1, 7, (2 << 20) - 5, 0, 5 << 20]:
        chunk = rng.integers(0, 256, size, dtype=np.uint8)
        unaligned = memoryview(np.concatenate([[0], chunk]).astype(np.uint8))[1:]  # not page-aligned
        assert f.append(unaligned) == _native.crc32c(chunk)
        expected += chunk.tobytes()
        f.pad(4096)
        expected += bytes(-len(expected) % 4096)
    f.pwrite(b"HEAD", 0)
    f.finish()
    assert path.read_bytes() == b"HEAD" + bytes(expected[4:])


@pytest.mark.parametrize("direct", [True, False])
def test_an_append_never_reads_the_callers_memory_after_it_returns(tmp_path: pathlib.Path, direct: bool) -> None:
    path = tmp_path / "shard.bin"
    source = np.frombuffer(os.urandom(16 << 20), dtype=np.uint8).copy()
    kept = source.tobytes()
    f = _native.NativeFile(str(path), direct=direct)
    f.append(source)
    source[:] = 0  # training goes on writing its state once the save has it
    f.finish()
    assert path.read_bytes() == kept


def test_creating_over_an_existing_file_fails_and_leaves_it_intact(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "shard.bin"
    path.write_bytes(b"committed")
    with pytest.raises(errors.StorageError) as caught:
        _native.NativeFile(str(path), direct=True)
    assert caught.value.errno == errno.EEXIST
    assert path.read_bytes() == b"committed"


# ---- reads (sx_read_at): exact, hashed as they land, failures as errors -----------------------------------


@pytest.fixture
def _disarm_faults():
    yield
    _native.fault_arm("write", 0, "kill")  # countdown 0: disarmed


@pytest.mark.parametrize("size", [0, 1, 4095, (256 << 10) + 3, (8 << 20) + 17, (19 << 20) + 5])
def test_a_read_lands_every_byte_and_its_crc32c_over_any_split(tmp_path: pathlib.Path, size: int) -> None:
    data = os.urandom(size + 4100)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        buffer = bytearray(size)
        assert _native.read_at(fd, buffer, 4100) == _native.crc32c(data[4100:])
        assert bytes(buffer) == data[4100:]
        assert _native.read_at(fd, bytearray(10), 0, crc=_native.crc32c(b"x")) == _native.crc32c(b"x" + data[:10])
    finally:
        os.close(fd)


@pytest.mark.parametrize("size,block", [(0, 4096), (1, 4096), (4096, 4096), ((256 << 10) * 3 + 5, 256 << 10),
                                        ((19 << 20) + 5, 256 << 10), ((16 << 20), 1 << 20), ((9 << 20) + 1, 3000)])
def test_a_blocked_read_lands_every_byte_and_each_block_s_crc32c_over_any_split(tmp_path: pathlib.Path, size: int,
                                                                               block: int) -> None:
    data = os.urandom(size + 100)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        buffer = bytearray(size)
        crcs = _native.read_blocks_at(fd, buffer, 100, block)
        assert bytes(buffer) == data[100:]
        assert crcs == [_native.crc32c(data[100 + i:100 + min(i + block, size)]) for i in range(0, size, block)]
        with pytest.raises(errors.TruncatedCheckpointError):
            _native.read_blocks_at(fd, bytearray(size + 1), 100, block)
    finally:
        os.close(fd)


def test_a_read_past_the_end_is_a_truncation_not_garbage(tmp_path: pathlib.Path) -> None:
    (tmp_path / "f").write_bytes(b"abc")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(errors.TruncatedCheckpointError):
            _native.read_at(fd, bytearray(4), 0, path=str(tmp_path / "f"))
    finally:
        os.close(fd)


def test_the_read_fault_site_fails_reads_with_the_errno_asked_for_as_many_times(tmp_path: pathlib.Path,
                                                                               _disarm_faults) -> None:
    (tmp_path / "f").write_bytes(b"x" * 100)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        _native.fault_arm("read", 2, "ESTALE", times=2)
        _native.read_at(fd, bytearray(10), 0)
        for _ in range(2):
            with pytest.raises(errors.StorageError) as info:
                _native.read_at(fd, bytearray(10), 0)
            assert info.value.errno == errno.ESTALE
        assert _native.read_at(fd, bytearray(10), 0) == _native.crc32c(b"x" * 10)
    finally:
        os.close(fd)
