"""CRC32C of the native core: every kernel, through the Python wrapper.

Each SIMD kernel is checked against the portable slicing-by-8 kernel (and the
portable one against published vectors and two independent libraries) over
lengths and alignments that reach every code path: the byte-wise head that
aligns to a cache line, the three-stream crc32 path, the plain folding loop,
the folding loop fused with crc32 streams (from 4 KiB) and the tails.
"""

from __future__ import annotations

import itertools
import os
import threading

import crc32c as crc32c_pypi
import google_crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from SneppX_ALG import _native, errors

MASK32 = 0xFFFFFFFF
AVAILABLE = _native.crc32c_kernels()
SIMD_AVAILABLE = [k for k in AVAILABLE if k != "portable"]

# A fixed random pool; tests hash slices of it at chosen offsets and lengths.
POOL = np.random.default_rng(20240229).integers(0, 256, size=256 * 1024, dtype=np.uint8).tobytes()

# RFC 3720 (iSCSI) appendix B.4: a SCSI Read (10) command PDU.
ISCSI_READ_PDU = bytes.fromhex(
    "01c00000000000000000000000000000"
    "14000000000004000000001400000018"
    "28000000000000000200000000000000"
)

KNOWN_VECTORS = [
    (b"", 0x00000000),
    (b"a", 0xC1D04330),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (ISCSI_READ_PDU, 0xD9963A56),
]

# Lengths at and around every threshold of the kernels (the 3-stream path from
# 192 bytes, fold blocks of 256 bytes, fusion from 4 KiB with steps of 448 and
# 376 bytes) plus the cache-line head of up to 63 bytes in front of them.
BOUNDARY_LENGTHS = sorted(
    {n + d for n in (0, 8, 16, 64, 191, 192, 256, 512, 575, 576, 1024, 4096, 4096 + 63, 4480, 8192, 65536)
     for d in (-1, 0, 1, 7, 8, 9, 15, 16, 17)
     if n + d >= 0}
)


def vector_id(value: object) -> str | None:
    return f"{value:#010x}" if isinstance(value, int) else None


def portable(data: bytes, crc: int = 0) -> int:
    return _native.crc32c_with("portable", data, crc)


@pytest.mark.parametrize("kernel", AVAILABLE)
@pytest.mark.parametrize(("data", "expected"), KNOWN_VECTORS, ids=vector_id)
def test_every_kernel_gives_the_published_check_values(kernel: str, data: bytes, expected: int) -> None:
    assert _native.crc32c_with(kernel, data) == expected


@pytest.mark.parametrize(("data", "expected"), KNOWN_VECTORS, ids=vector_id)
def test_default_kernel_gives_the_published_check_values(data: bytes, expected: int) -> None:
    assert _native.crc32c(data) == expected


def test_kernel_list_starts_portable_and_default_is_the_best() -> None:
    assert AVAILABLE[0] == "portable"
    assert list(_native.KERNELS) == ["portable", "sse42", "vpclmul256", "vpclmul512"]
    assert all(k in _native.KERNELS for k in AVAILABLE)
    data = POOL[3 : 3 + 100_000]
    assert _native.crc32c(data) == _native.crc32c_with(AVAILABLE[-1], data) == portable(data)


@pytest.mark.parametrize("kernel", list(_native.KERNELS))
def test_a_kernel_this_cpu_lacks_is_refused_and_others_run(kernel: str) -> None:
    data = POOL[:5000]
    if kernel in AVAILABLE:
        assert _native.crc32c_with(kernel, data) == portable(data)
    else:
        with pytest.raises(ValueError, match=kernel):
            _native.crc32c_with(kernel, data)


@pytest.mark.parametrize("kernel", SIMD_AVAILABLE)
@pytest.mark.parametrize("offset", [0, 1, 7, 8, 31, 32, 63])
def test_simd_kernels_match_portable_at_every_threshold(kernel: str, offset: int) -> None:
    mismatches = []
    for length in BOUNDARY_LENGTHS:
        data = POOL[offset : offset + length]
        if _native.crc32c_with(kernel, data, 0x5A5A5A5A) != portable(data, 0x5A5A5A5A):
            mismatches.append(length)
    assert mismatches == [], f"{kernel} differs from portable at offset {offset}, lengths {mismatches}"


@settings(max_examples=300, deadline=None)
@given(
    offset=st.integers(0, 63),
    start=st.integers(0, 128 * 1024),
    length=st.one_of(st.integers(0, 600), st.integers(0, 100 * 1024)),
    crc=st.integers(0, MASK32),
)
def test_simd_kernels_match_portable_on_random_slices(offset: int, start: int, length: int, crc: int) -> None:
    # `start` picks different data, `offset` the alignment mod 64 of the first byte.
    first = start - start % 64 + offset
    data = memoryview(POOL)[first : first + length]
    expected = portable(data, crc)
    for kernel in SIMD_AVAILABLE:
        assert _native.crc32c_with(kernel, data, crc) == expected, (kernel, first, length)


@settings(max_examples=100, deadline=None)
@given(length=st.integers(0, 100 * 1024), cuts=st.lists(st.integers(0, 100 * 1024), max_size=6))
def test_crc_continued_across_any_splits_equals_one_pass(length: int, cuts: list[int]) -> None:
    data = memoryview(POOL)[:length]
    bounds = [0, *sorted(c for c in cuts if c <= length), length]
    for kernel in AVAILABLE:
        crc = 0
        for lo, hi in itertools.pairwise(bounds):
            crc = _native.crc32c_with(kernel, data[lo:hi], crc)
        assert crc == portable(data), (kernel, bounds)


@settings(max_examples=200, deadline=None)
@given(len_a=st.integers(0, 70_000), len_b=st.integers(0, 70_000), skip=st.integers(0, 1000))
def test_combine_of_two_crcs_equals_crc_of_the_concatenation(len_a: int, len_b: int, skip: int) -> None:
    a = POOL[skip : skip + len_a]
    b = POOL[skip + len_a : skip + len_a + len_b]
    assert _native.crc32c_combine(_native.crc32c(a), _native.crc32c(b), len(b)) == _native.crc32c(a + b)


def crc_of_zeros(length: int) -> int:
    """crc of `length` zero bytes (1 KiB times a power of two), by doubling with combine."""
    crc, n = _native.crc32c(bytes(1024)), 1024
    while n < length:
        crc, n = _native.crc32c_combine(crc, crc, n), n * 2
    assert n == length
    return crc


def test_combine_doubling_matches_hashing_the_bytes() -> None:
    assert crc_of_zeros(4 * 1024 * 1024) == _native.crc32c(bytes(4 * 1024 * 1024))


def test_combine_handles_lengths_past_4_gib() -> None:
    crc_a = _native.crc32c(b"prefix")
    four_gib = crc_of_zeros(1 << 32)
    eight_gib = crc_of_zeros(1 << 33)
    in_one = _native.crc32c_combine(crc_a, eight_gib, 1 << 33)
    in_two = _native.crc32c_combine(_native.crc32c_combine(crc_a, four_gib, 1 << 32), four_gib, 1 << 32)
    assert in_one == in_two
    assert len({crc_a, in_one, _native.crc32c_combine(crc_a, four_gib, 1 << 32)}) == 3


def test_combine_with_an_empty_second_part_is_the_first_crc() -> None:
    assert _native.crc32c_combine(0x12345678, 0, 0) == 0x12345678


@pytest.mark.parametrize("threads", [0, 1, 2, 3, 4])
def test_parallel_equals_serial_on_a_few_mib(threads: int) -> None:
    data = np.random.default_rng(7).integers(0, 256, size=17 * 1024 * 1024 + 13, dtype=np.uint8)
    expected = _native.crc32c(data)
    assert _native.crc32c_parallel(data, threads=threads) == expected
    continued = _native.crc32c(data[5:], 0xDEADBEEF)
    assert _native.crc32c_parallel(data[5:], crc=0xDEADBEEF, threads=threads) == continued


def test_parallel_on_small_buffers_is_the_serial_value() -> None:
    for length in (0, 1, 1000, 4 * 1024 * 1024 - 1):
        data = memoryview(POOL * 17)[:length]
        assert _native.crc32c_parallel(data, threads=8) == portable(data)


def test_bytes_bytearray_and_memoryview_slices_hash_the_same_bytes() -> None:
    raw = POOL[:70_001]
    expected = portable(raw[1:-1])
    assert _native.crc32c(raw[1:-1]) == expected
    assert _native.crc32c(bytearray(raw)[1:-1]) == expected
    assert _native.crc32c(memoryview(raw)[1:-1]) == expected
    assert _native.crc32c(memoryview(bytearray(raw))[1:-1]) == expected


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.float32, np.float64, np.complex64, np.bool_])
def test_numpy_arrays_are_hashed_as_their_raw_bytes(dtype: type) -> None:
    array = np.frombuffer(POOL[: 96 * 1024], dtype=np.uint8).view(np.uint8)
    if dtype is np.bool_:
        typed = (array & 1).astype(np.bool_)
    else:
        typed = array.view(dtype)
    typed = typed.reshape(2, -1)  # 2-D and C-contiguous
    assert _native.crc32c(typed) == portable(typed.tobytes())
    assert _native.crc32c(typed[1]) == portable(typed[1].tobytes())
    for kernel in AVAILABLE:
        assert _native.crc32c_with(kernel, typed) == portable(typed.tobytes())


def test_non_contiguous_buffers_are_refused_not_hashed_wrong() -> None:
    array = np.arange(1000, dtype=np.uint32)
    for bad in (array[::2], memoryview(POOL)[::2], "text is not bytes"):
        with pytest.raises(errors.UnsupportedTensorError, match="contiguous"):
            _native.crc32c(bad)  # type: ignore[arg-type]


@settings(max_examples=50, deadline=None)
@given(start=st.integers(0, 1000), length=st.integers(0, 200_000), crc=st.integers(0, MASK32))
def test_agrees_with_google_crc32c_and_the_crc32c_package(start: int, length: int, crc: int) -> None:
    data = POOL[start : start + length]
    ours = _native.crc32c(data)
    assert ours == google_crc32c.value(data)
    assert ours == crc32c_pypi.crc32c(data)
    assert _native.crc32c(data, crc) == google_crc32c.extend(crc, data)


def test_threads_hashing_large_buffers_concurrently_get_the_right_values() -> None:
    # cffi releases the GIL around each call, so these run in C at the same time.
    buffers = [np.frombuffer(os.urandom(16 * 1024 * 1024 + i), dtype=np.uint8) for i in range(4)]
    expected = [google_crc32c.value(b.tobytes()) for b in buffers]
    results: dict[int, list[int]] = {}

    def work(i: int) -> None:
        fn = _native.crc32c_parallel if i % 2 else _native.crc32c
        results[i] = [fn(buffers[i]) for _ in range(3)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert results == {i: [expected[i]] * 3 for i in range(4)}


def _xor_fold(data: bytes) -> int:
    """The fold sx_memory_read computes, in numpy: xor of the whole 64-bit words, then of the last bytes."""
    words = len(data) // 8
    value = int(np.bitwise_xor.reduce(np.frombuffer(data[:words * 8], dtype="<u8"))) if words else 0
    for byte in data[words * 8:]:
        value ^= byte
    return value


@pytest.mark.parametrize("width", _native.memory_read_widths())
@pytest.mark.parametrize("start,length", [(0, 0), (3, 7), (0, 64), (5, 511), (1, 513), (0, 4096 + 77),
                                          (11, 200_000)])
def test_memory_read_reads_every_byte_at_every_width(width: str, start: int, length: int) -> None:
    # The benchmark ceiling must read everything it is timed over: a loop that skipped a tail or a block
    # would report a bandwidth it never achieved.
    data = POOL[start:start + length]
    assert _native.memory_read(data, width) == _xor_fold(data)


def test_memory_read_refuses_an_unknown_width() -> None:
    with pytest.raises(ValueError, match="unknown load width"):
        _native.memory_read(b"abc", "avx1024")


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.tuples(st.integers(0, len(POOL)), st.integers(0, 70_000)), max_size=12),
       threads=st.integers(0, 5))
def test_ranges_get_the_crc_of_each_range_whatever_the_split(cuts: list[tuple[int, int]], threads: int) -> None:
    # Ranges in any order, overlapping, empty: each gets its own CRC (these stay under the per-thread minimum;
    # the test below has shares whose edges fall inside ranges).
    ranges = [(offset, min(length, len(POOL) - offset)) for offset, length in cuts]
    expected = [_native.crc32c(POOL[o:o + n]) for o, n in ranges]
    assert _native.crc32c_ranges(POOL, ranges, threads) == expected


def test_ranges_large_enough_for_several_threads() -> None:
    # The bytes of all ranges are cut into equal shares across threads, so a share's edge falls inside ranges
    # (and a range spans several shares): every range's CRC must still be its own.
    data = np.frombuffer(os.urandom(20 << 20), dtype=np.uint8)
    ranges = [(0, 3 << 20), (5 << 20, 1), (5 << 20, 9 << 20), ((14 << 20) + 7, (6 << 20) - 7), (100, 0)]
    expected = [google_crc32c.value(data[o:o + n].tobytes()) for o, n in ranges]
    for threads in (1, 2, 3, 0):
        assert _native.crc32c_ranges(data, ranges, threads) == expected


def test_a_range_outside_the_buffer_is_refused() -> None:
    with pytest.raises(ValueError, match="outside the buffer"):
        _native.crc32c_ranges(b"abcd", [(2, 3)])
