"""Benchmarks only (membench.c): the memory read ceiling."""

from __future__ import annotations

from typing import Any

from SneppX_ALG._native._lib import as_buffer, ffi, lib, raise_for

MEMORY_READ_WIDTHS = {"scalar64": 0, "avx2": 1, "avx512": 2, "avx512x4": 3}


def memory_read_widths() -> list[str]:
    """The load widths this CPU runs for memory_read, widest last ("avx512x4": four streams at once)."""
    mask = lib.sx_memory_read_widths()
    return [name for name, w in MEMORY_READ_WIDTHS.items() if mask & (1 << w)]


def memory_read(data: Any, width: str | None = None) -> int:
    """Reads every byte of a buffer once with loads of `width` (default: the widest this CPU runs) on the
    calling thread, for the memory read ceiling in benchmarks; returns the xor of its 64-bit words."""
    buf = as_buffer(data)
    name = width or memory_read_widths()[-1]  # (four AVX-512 streams where the CPU has AVX-512)
    if name not in MEMORY_READ_WIDTHS:
        raise ValueError(f"unknown load width {name!r}; choose from {', '.join(MEMORY_READ_WIDTHS)}")
    out = ffi.new("uint64_t *")
    raise_for(lib.sx_memory_read(MEMORY_READ_WIDTHS[name], buf, len(buf), out), f"memory read ({name})")
    return int(out[0])
