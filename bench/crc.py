"""CRC32C throughput: SneppX's kernels against what a user would pick instead, and against the memory.

Every checkpoint byte is hashed on save and on load, so the question is whether
the CRC keeps up with reading the bytes at all. Per buffer size this prints,
measured in the same run (these machines are noisy, absolute numbers mean
little): each SneppX kernel this CPU runs on one core, the threaded
crc32c_parallel, google-crc32c and the `crc32c` package (both take bytes), and
the memory read ceiling: a C loop of the widest loads this CPU runs (AVX-512,
AVX2, 64-bit scalar; and AVX-512 over four streams at once, as the CRC kernels
read three; `_native.memory_read`) over the same buffer, the fastest counting.
A numpy xor-reduce is shown too; it is not the limit.

    python -m bench crc                       # 64 MiB, 256 MiB, 1 GiB
    python -m bench crc -- --big              # adds 2 GiB
    python -m bench crc -- --sizes 16 64 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import crc32c as crc32c_pypi
import google_crc32c
import numpy as np

from bench import common
from SneppX_ALG import _native

MIB = 1024 * 1024
RANDOM_BLOCK = 16 * MIB  # random bytes repeated to the buffer size: CRC speed doesn't depend on content


NUMPY_READ = "numpy xor-reduce (not the limit)"


def numpy_read(array: np.ndarray) -> int:
    """Reads every byte once with numpy's reduction: what the previous ceiling was, for comparison."""
    return int(np.bitwise_xor.reduce(array.view(np.uint64)))


def is_memory_read(name: str) -> bool:
    return name.startswith("memory read") or name == NUMPY_READ

def measure(size: int, repeat: int, random: bytes) -> list[tuple[str, float]]:
    """(name, GB/s) for every implementation on one buffer of `size` bytes; checks they agree."""
    data = random * (size // len(random)) + random[: size % len(random)]
    array = np.frombuffer(data, dtype=np.uint8)  # the same memory, zero-copy
    candidates: list[tuple[str, Callable[[], object]]] = [
        (f"memory read, C {width} loads, 1 core", lambda w=width: _native.memory_read(array, w))
        for width in _native.memory_read_widths()
    ]
    candidates.append((NUMPY_READ, lambda: numpy_read(array)))
    for kernel in _native.crc32c_kernels():
        candidates.append((f"sneppx {kernel}, 1 core", lambda k=kernel: _native.crc32c_with(k, array)))
    candidates.append((f"sneppx parallel, {os.cpu_count()} threads", lambda: _native.crc32c_parallel(array)))
    candidates.append(("google-crc32c (bytes)", lambda: google_crc32c.value(data)))
    candidates.append(("crc32c package (bytes)", lambda: crc32c_pypi.crc32c(data)))

    # Round-robin, fastest of `repeat` each: a burst of load elsewhere then hits every candidate alike.
    best = {name: float("inf") for name, _ in candidates}
    crcs = set()
    _native.memory_read(array)  # warm-up: page tables and CPU clocks
    for _ in range(repeat):
        for name, fn in candidates:
            start = time.perf_counter()
            result = fn()
            best[name] = min(best[name], time.perf_counter() - start)
            if not is_memory_read(name):
                crcs.add(result)
    rows = [(name, size / seconds / 1e9) for name, seconds in best.items()]
    if len(crcs) != 1:
        raise SystemExit(f"implementations disagree on the CRC of {size} bytes: {sorted(map(hex, crcs))}")
    return rows


def print_table(size: int, rows: list[tuple[str, float]]) -> None:
    speeds = dict(rows)
    google = speeds["google-crc32c (bytes)"]
    memory = max(v for n, v in rows if n.startswith("memory read"))  # the read ceiling: the fastest C loop
    print(f"\n### {size // MIB} MiB\n")
    print("| implementation | GB/s | vs google-crc32c | vs read ceiling |")
    print("|---|---:|---:|---:|")
    for name, gbps in rows:
        print(f"| {name} | {gbps:.1f} | {gbps / google:.2f}x | {gbps / memory:.2f}x |")
    single = {n: v for n, v in rows if n.startswith("sneppx") and "1 core" in n}
    best_name = max(single, key=single.__getitem__)
    print(
        f"\nSneppX best on one core ({best_name.split(',')[0].removeprefix('sneppx ')}): "
        f"{single[best_name] / google:.2f}x google-crc32c, {single[best_name] / memory:.2f}x the read ceiling "
        f"({memory:.1f} GB/s)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench crc", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024], metavar="MIB",
                        help="buffer sizes in MiB (default 64 256 1024)")
    parser.add_argument("--big", action="store_true", help="also 2 GiB")
    parser.add_argument("--repeat", type=int, default=5,
                        help="rounds over all candidates; the fastest of each counts")
    args = parser.parse_args(argv)
    sizes = sorted(set(args.sizes + ([2048] if args.big else [])))

    kernels = ", ".join(_native.crc32c_kernels())
    print(f"CPU: {common.cpu_model()}, {os.cpu_count()} logical CPUs; kernels: {kernels}; "
          f"best of {args.repeat} rounds")
    random = np.random.default_rng(0).bytes(RANDOM_BLOCK)
    for size_mib in sizes:
        size = size_mib * MIB
        print_table(size, measure(size, args.repeat, random))


if __name__ == "__main__":
    main()
