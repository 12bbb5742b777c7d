"""CRC32C (crc32c.c): the best kernel this CPU has, in parallel over many ranges, and combined."""

from __future__ import annotations

from typing import Any

from SneppX_ALG._native._lib import as_buffer, ffi, lib, raise_for

KERNELS = {
    "portable": lib.SX_CRC_PORTABLE,
    "sse42": lib.SX_CRC_SSE42,
    "vpclmul256": lib.SX_CRC_VPCLMUL256,
    "vpclmul512": lib.SX_CRC_VPCLMUL512,
}


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC32C of a buffer, continuing from `crc`, with the best kernel for this CPU."""
    buf = as_buffer(data)
    return int(lib.sx_crc32c(crc, buf, len(buf)))


def crc32c_parallel(data: Any, crc: int = 0, threads: int = 0) -> int:
    """CRC32C split over threads (0 = all CPUs); the same value as crc32c()."""
    buf = as_buffer(data)
    return int(lib.sx_crc32c_parallel(crc, buf, len(buf), threads))


def crc32c_ranges(data: Any, ranges: list[tuple[int, int]], threads: int = 0) -> list[int]:
    """CRC32C of each (offset, length) range of a buffer, the bytes of all of them split over threads (0 = all
    CPUs): many small ranges use every core, as one large one does."""
    buf = as_buffer(data)
    for offset, length in ranges:
        if offset < 0 or length < 0 or offset + length > len(buf):
            raise ValueError(f"range ({offset}, {length}) is outside the buffer of {len(buf)} bytes")
    n = len(ranges)
    offsets = ffi.new("uint64_t[]", [r[0] for r in ranges])
    lengths = ffi.new("uint64_t[]", [r[1] for r in ranges])
    out = ffi.new("uint32_t[]", max(n, 1))
    raise_for(lib.sx_crc32c_ranges(buf, n, offsets, lengths, out, threads), "crc32c of ranges")
    return list(out)[:n]


def crc32c_with(kernel: str, data: Any, crc: int = 0) -> int:
    """CRC32C with one named kernel (tests and benchmarks); ValueError if the CPU lacks it."""
    buf = as_buffer(data)
    out = ffi.new("uint32_t *")
    raise_for(lib.sx_crc32c_with(KERNELS[kernel], crc, buf, len(buf), out), f"crc32c kernel {kernel}")
    return int(out[0])


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc(A + B) from crc(A), crc(B) and len(B)."""
    return int(lib.sx_crc32c_combine(crc_a, crc_b, len_b))


def crc32c_kernels() -> list[str]:
    """The kernels this CPU can run, best last."""
    mask = lib.sx_crc32c_kernels()
    return [name for name, k in KERNELS.items() if mask & (1 << k)]
