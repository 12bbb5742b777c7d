"""The snapshot copy engine (copy.c): threaded host copies with CRC, CUDA loading and the no-GPU fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from SneppX_ALG import _native, errors

HAS_GPU = _native.cuda_available()
gpu = pytest.mark.skipif(not HAS_GPU, reason="no GPU")


@pytest.mark.parametrize("size", [1, 63, 4096, (4 << 20) + 3, (9 << 20) + 17])
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_host_copy_lands_every_byte_and_returns_its_crc32c(size: int, threads: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    copier = _native.Copier(-1, threads=threads)
    dst = bytearray(size + 8)
    crc = copier.copy(memoryview(dst)[:size], data)
    assert bytes(dst[:size]) == data.tobytes()
    assert bytes(dst[size:]) == bytes(8), "the copy wrote past its end"
    assert crc == _native.crc32c(data)


# len / threads a whole number of cache lines and len % threads != 0: slices of
# exactly len / threads bytes leave the last len % threads bytes uncopied and unhashed.
@pytest.mark.parametrize(("size", "threads"), [((8 << 20) + 1, 2), ((12 << 20) + 2, 3), ((16 << 20) + 3, 4)])
def test_host_copy_lands_the_tail_that_whole_cache_line_slices_leave_over(size: int, threads: int) -> None:
    data = np.random.default_rng(size).integers(1, 256, size, dtype=np.uint8)
    dst = bytearray(size)
    crc = _native.Copier(-1, threads=threads).copy(dst, data)
    tail = size % threads
    assert bytes(dst[-tail:]) == data[-tail:].tobytes(), "the last bytes were never copied"
    assert bytes(dst) == data.tobytes()
    assert crc == _native.crc32c_with("portable", data)


MAX_SPLIT_SIZE = 20 << 20
SPLIT_SOURCE = np.random.default_rng(20).integers(0, 256, MAX_SPLIT_SIZE + 64, dtype=np.uint8)


@st.composite
def split_cases(draw: st.DrawFn) -> tuple[int, int, int]:
    """(size, threads, start): sizes anywhere, and sizes just past a whole number of cache lines per thread."""
    threads = draw(st.integers(1, 5))
    lines = draw(st.integers(0, MAX_SPLIT_SIZE // (64 * threads)))
    near_a_line_split = min(lines * 64 * threads + draw(st.integers(0, threads + 1)), MAX_SPLIT_SIZE)
    size = draw(st.one_of(st.integers(0, MAX_SPLIT_SIZE), st.just(near_a_line_split)))
    return size, threads, draw(st.integers(0, 63))


@settings(max_examples=60, deadline=None)
@given(case=split_cases())
def test_threaded_copy_and_parallel_crc_cover_every_byte_of_any_split(case: tuple[int, int, int]) -> None:
    # copy.c and crc32c_parallel cut the buffer with the same rule (native/src/split.h)
    size, threads, start = case
    src = SPLIT_SOURCE[start:start + size]
    dst = np.zeros(size + 64, dtype=np.uint8)
    crc = _native.Copier(-1, threads=threads).copy(dst[:size], src)
    expected = _native.crc32c_with("portable", src)
    assert np.array_equal(dst[:size], src)
    assert not dst[size:].any(), "the copy wrote past its end"
    assert crc == expected
    assert _native.crc32c_parallel(src, threads=threads) == expected


def test_crc_continues_from_the_value_given() -> None:
    a, b = os.urandom(1000), os.urandom(5 << 20)
    copier = _native.Copier(-1)
    dst = bytearray(len(b))
    assert copier.copy(dst, b, crc=_native.crc32c(a)) == _native.crc32c(a + b)


def test_copy_without_crc_returns_none_and_still_copies() -> None:
    src = os.urandom(12345)
    dst = bytearray(12345)
    assert _native.Copier(-1).copy(dst, src, crc=None) is None
    assert bytes(dst) == src


def test_staging_memory_from_alloc_is_writable_and_sized() -> None:
    copier = _native.Copier(-1)
    buffer = copier.alloc(1 << 20)
    view = copier.view(buffer, 1 << 20)
    src = os.urandom(1 << 20)
    assert copier.copy(view, src) == _native.crc32c(src)
    assert bytes(view) == src


def test_copy_refuses_to_overrun_either_buffer() -> None:
    copier = _native.Copier(-1)
    with pytest.raises(ValueError, match="into a buffer of 10"):
        copier.copy(bytearray(10), b"x" * 11)
    with pytest.raises(ValueError, match="from a buffer of 4"):
        copier.copy(bytearray(10), b"x" * 4, 8)


def test_cudart_search_order_env_override_then_wheel_then_soname(tmp_path) -> None:
    wheel_lib = tmp_path / "site" / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12"
    wheel_lib.parent.mkdir(parents=True)
    wheel_lib.write_bytes(b"")
    sys_path = [str(tmp_path / "empty"), str(tmp_path / "site")]
    assert _native.cudart_candidates(sys_path, {}) == [str(wheel_lib), "libcudart.so.12"]
    assert _native.cudart_candidates(sys_path, {"SNEPPX_CUDART": "/opt/x.so"}) == ["/opt/x.so"]
    assert _native.cudart_candidates([str(tmp_path / "empty")], {}) == ["libcudart.so.12"]


def test_libcudart_loads_from_the_installed_wheel() -> None:
    path = _native.cuda_load()
    assert path.endswith("libcudart.so.12")
    assert os.path.exists(path)


def test_device_count_reports_no_device_as_a_typed_error_or_counts_gpus() -> None:
    if HAS_GPU:
        assert _native.cuda_device_count() >= 1
        return
    with pytest.raises(errors.AcceleratorUnavailableError, match=r"CUDA error (35|100)"):
        _native.cuda_device_count()


def test_device_copier_without_a_gpu_fails_cleanly_and_the_cpu_copier_still_works() -> None:
    if HAS_GPU:
        assert _native.Copier(0).device == 0
        return
    with pytest.raises(errors.AcceleratorUnavailableError):
        _native.Copier(0)
    assert _native.Copier(-1).copy(bytearray(3), b"abc") == _native.crc32c(b"abc")


def test_a_missing_cudart_override_is_reported_and_saves_fall_back_to_cpu(tmp_path) -> None:
    # libcudart loads once per process, so this runs in a fresh interpreter.
    script = textwrap.dedent(f"""
        import numpy as np
        from SneppX_ALG import _native, errors, coordinator
        try:
            _native.cuda_load()
            raise SystemExit("loaded a library that does not exist")
        except errors.AcceleratorUnavailableError as e:
            assert "SNEPPX_CUDART" in str(e), e
        assert not _native.cuda_available()
        with coordinator.CheckpointCoordinator({str(tmp_path)!r}, device="auto") as c:
            assert not c.uses_gpu
            c.save({{"w": np.arange(10.0)}}, step=1)
        print("ok")
    """)
    env = {**os.environ, "SNEPPX_CUDART": str(tmp_path / "no-such-libcudart.so")}
    result = subprocess.run([sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert (tmp_path / "step-000000001" / "manifest.json").exists()


# ---- on a GPU ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("size", [1, (8 << 20) - 1, (64 << 20) + 5])
def test_device_to_host_copy_hashes_each_piece_as_it_lands(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    device_ptr = _native.cuda_malloc(0, size)
    try:
        _native.cuda_memcpy(0, device_ptr, _native.address_of(data), size, _native.COPY_H2D)
        copier = _native.Copier(0, piece_bytes=4 << 20)
        staging = copier.alloc(size)
        view = copier.view(staging, size)
        crc = copier.copy(view, device_ptr, size, kind=_native.COPY_D2H)
        assert crc == _native.crc32c(data)
        assert bytes(view) == data.tobytes()
        assert copier.copy(view, device_ptr, size, kind=_native.COPY_D2H, crc=None) is None
    finally:
        _native.cuda_free(0, device_ptr)


# ---- on a GPU: a copy is ordered after the producer's stream, and its source outlives it ------------------

needs_cuda = pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
BUSY_BYTES = 1 << 30


def queue_busy_work(pointer: int, stream: int, rounds: int = 200) -> None:
    """Memsets queued on `stream` ahead of the write a copy must see (~100 ms of work on an H200)."""
    for i in range(rounds):
        _native.cuda_memset_async(0, pointer, i & 0xFF, BUSY_BYTES, stream)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("producer", ["own stream", "legacy default stream"])
def test_a_copy_ordered_after_the_producer_stream_sees_its_last_write(producer: str) -> None:
    size = 64 << 20
    target, busy = _native.cuda_malloc(0, size), _native.cuda_malloc(0, BUSY_BYTES)
    stream = _native.cuda_stream_create(0) if producer == "own stream" else 1
    try:
        _native.cuda_memcpy(0, target, _native.address_of(np.full(size, 0x11, np.uint8)), size, _native.COPY_H2D)
        queue_busy_work(busy, stream)
        _native.cuda_memset_async(0, target, 0x22, size, stream)  # the producer's last write, still queued
        copier = _native.Copier(0)
        view = copier.view(copier.alloc(size), size)
        copier.wait_stream(stream)
        assert copier.copy(view, target, size, kind=_native.COPY_D2H) == _native.crc32c(np.full(size, 0x22, np.uint8))
    finally:
        _native.cuda_free(0, target)
        _native.cuda_free(0, busy)
        _native.cuda_stream_destroy(0, stream)


class OwnedDeviceTensor:
    """A device tensor that frees its memory when it is freed (as torch's caching allocator reuses it)."""

    def __init__(self, nbytes: int, stream: int):
        self.pointer = _native.cuda_malloc(0, nbytes)
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "strides": None,
                                         "data": (self.pointer, False), "version": 3, "stream": stream}

    def __del__(self) -> None:
        _native.cuda_free(0, self.pointer)


@pytest.mark.gpu
@needs_cuda
def test_a_coordinator_snapshot_waits_for_the_producer_and_keeps_fresh_tensors_alive(tmp_path) -> None:
    from SneppX_ALG import CheckpointCoordinator

    size = 32 << 20
    busy = _native.cuda_malloc(0, BUSY_BYTES)
    stream = _native.cuda_stream_create(0)

    class Model:
        def state_dict(self) -> dict:  # fresh tensors: the returned dict is their only owner
            tensor = OwnedDeviceTensor(size, stream)
            queue_busy_work(busy, stream)
            _native.cuda_memset_async(0, tensor.pointer, 0x5A, size, stream)
            return {"t": tensor}

    try:
        with CheckpointCoordinator(tmp_path, device=0, staging_bytes=16 << 20) as coord:
            coord.save(Model(), step=1)
        got = {"t": None}
        CheckpointCoordinator(tmp_path, device="cpu").restore(got)
        assert got["t"].tobytes() == bytes([0x5A]) * size
    finally:
        _native.cuda_free(0, busy)
        _native.cuda_stream_destroy(0, stream)


@pytest.mark.parametrize("threads", [1, 2, 3, 0])
def test_equal_pairs_finds_a_difference_in_any_byte_of_any_pair_over_any_thread_split(threads: int) -> None:
    rng = np.random.default_rng(7)
    firsts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 4095, 1 << 20, 3 << 20, 5 << 20, 1 << 20)]
    seconds = [a.copy() for a in firsts]
    for index in (2, 4, 6):  # the last byte, the first, one in the middle
        at = {2: -1, 4: 0, 6: 1 << 19}[index]
        seconds[index][at] ^= 0x80
    got = _native.equal_pairs(list(zip(firsts, seconds, strict=True)), threads=threads)
    assert got == [True, True, False, True, False, True, False]
    assert _native.equal_pairs([(firsts[3], firsts[3][:-1]), (b"", b"")], threads=threads) == [False, True]
