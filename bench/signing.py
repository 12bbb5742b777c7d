"""What signing costs: signed vs unsigned save, verify vs CRC-only validate, and the digest candidates.

    python -m bench signing                         # 64, 256 and 512 MiB, on the disk and on tmpfs
    python -m bench signing -- --big                # adds 1 GiB and 2 GiB
    python -m bench signing -- --sizes 256 --repeat 5 --dir bench-output --tmpfs ''

Saves run on the disk (--dir) and on tmpfs (--tmpfs, default /dev/shm/sneppx-bench: no disk to hide behind,
so the CPU cost of signing shows in full; the issue's target is <= 1.25x an unsigned save there).

Per size, in one run (best of --repeat each, so a burst of load elsewhere hits every candidate alike):
- digests over the same in-memory buffer: SHA-256 (hashlib; SHA-NI where the CPU has it), BLAKE2b
  (hashlib), BLAKE3 on one thread and on all threads, with memcpy for scale: the evidence for the digest
  choice in docs/FORMAT.md;
- save: a raw O_DIRECT write of the same bytes (the disk's limit), CheckpointWriter unsigned, and
  CheckpointWriter with signing_key (digests on the worker thread plus the Ed25519 signature), all through
  fsync; the target is signed <= 1.25x unsigned;
- check, file in the page cache: validate_checkpoint (CRC32C only) vs verify_checkpoint (signature, CRC32C
  and BLAKE3 of every byte).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import time
from collections.abc import Callable

import blake3
import numpy as np

from bench import common
from bench import format as format_bench
from SneppX_ALG import checkpoint
from SneppX_ALG.checkpoint import signing, verify

MIB = 1024 * 1024


def digest_rows(state: dict[str, np.ndarray], repeat: int) -> list[tuple[str, float]]:
    """(name, GB/s) of memcpy and each digest candidate over all of `state`'s bytes in one buffer."""
    buf = np.concatenate(list(state.values())).view(np.uint8)
    view = memoryview(buf)
    target = np.ones_like(buf)  # touched once, so the memcpy below measures copying, not page faults
    candidates: list[tuple[str, Callable[[], object]]] = [
        ("memcpy (numpy copyto)", lambda: np.copyto(target, buf)),
        ("SHA-256 (hashlib)", lambda: hashlib.sha256(view).digest()),
        ("BLAKE2b (hashlib)", lambda: hashlib.blake2b(view).digest()),
        ("BLAKE3, 1 thread", lambda: blake3.blake3(view).digest()),
        (f"BLAKE3, {os.cpu_count()} threads", lambda: blake3.blake3(view, max_threads=blake3.blake3.AUTO).digest()),
    ]
    times = {name: float("inf") for name, _ in candidates}
    for _ in range(repeat):
        for name, fn in candidates:
            t0 = time.perf_counter()
            fn()
            times[name] = min(times[name], time.perf_counter() - t0)
    return [(name, len(buf) / t / 1e9) for name, t in times.items()]


def save(path: str, state: dict[str, np.ndarray], key: object = None) -> None:
    if os.path.exists(path):
        os.unlink(path)
    with checkpoint.CheckpointWriter(path, metadata={"bench": "signing"}, signing_key=key) as w:
        for name, array in state.items():
            w.write(name, array)


def run(size: int, directory: str, repeat: int) -> None:
    state = format_bench.aligned_state(size)
    total = sum(a.nbytes for a in state.values())
    private, public = signing.generate_keypair()
    raw_path = os.path.join(directory, "raw.bin")
    unsigned_path = os.path.join(directory, "unsigned.snpx")
    signed_path = os.path.join(directory, "signed.snpx")

    print(f"\n### {total // MIB} MiB ({len(state)} float32 tensors)\n")
    digests = digest_rows(state, repeat)
    memcpy = digests[0][1]
    print("| digest | GB/s | vs memcpy |")
    print("|---|---:|---:|")
    for name, gbps in digests:
        print(f"| {name} | {gbps:.2f} | {gbps / memcpy:.2f}x |")

    # Interleaved rounds: raw, unsigned, signed, raw, unsigned, signed, ...
    saves = {"raw O_DIRECT write": (lambda: format_bench.raw_direct_write(raw_path, state)),
             "CheckpointWriter, unsigned": (lambda: save(unsigned_path, state)),
             "CheckpointWriter, signed": (lambda: save(signed_path, state, private))}
    save_times = {name: float("inf") for name in saves}
    for _ in range(repeat):
        for name, fn in saves.items():
            t0 = time.perf_counter()
            fn()
            save_times[name] = min(save_times[name], time.perf_counter() - t0)
    print("\n| save (through fsync) | GB/s | vs unsigned | vs raw O_DIRECT |")
    print("|---|---:|---:|---:|")
    for name, t in save_times.items():
        print(f"| {name} | {total / t / 1e9:.2f} | {t / save_times['CheckpointWriter, unsigned']:.2f}x time | "
              f"{t / save_times['raw O_DIRECT write']:.2f}x time |")

    for path in (unsigned_path, signed_path):
        format_bench.warm(path)
    checks: dict[str, Callable[[], tuple[bool, list[str]]]] = {
        "validate_checkpoint (CRC32C only)": lambda: checkpoint.validate_checkpoint(signed_path),
        "verify_checkpoint (signature + CRC32C + BLAKE3)": lambda: verify.verify_checkpoint(signed_path, [public]),
        "validate_checkpoint(trusted_keys=...)": lambda: checkpoint.validate_checkpoint(
            signed_path, trusted_keys=[public]),
    }
    check_times = {name: float("inf") for name in checks}
    for _ in range(repeat):
        for name, fn in checks.items():
            t0 = time.perf_counter()
            ok, problems = fn()
            check_times[name] = min(check_times[name], time.perf_counter() - t0)
            if not ok:
                raise SystemExit(f"{name} failed on a good file: {problems}")
    base = check_times["validate_checkpoint (CRC32C only)"]
    print("\n| check (page cache) | GB/s | vs CRC-only validate |")
    print("|---|---:|---:|")
    for name, t in check_times.items():
        print(f"| {name} | {total / t / 1e9:.2f} | {t / base:.2f}x time |")
    overhead = save_times["CheckpointWriter, signed"] / save_times["CheckpointWriter, unsigned"] - 1
    print(f"\nsigning adds {overhead * 100:+.0f}% to a save of {total // MIB} MiB in {directory} "
          f"(signed {1 + overhead:.2f}x the unsigned save's time; target <= 1.25x on tmpfs)", flush=True)
    for path in (raw_path, unsigned_path, signed_path):
        os.unlink(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench signing", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 512], metavar="MIB",
                        help="checkpoint sizes in MiB (default 64 256 512)")
    parser.add_argument("--tmpfs", default="/dev/shm/sneppx-bench" if os.path.isdir("/dev/shm") else "",
                        help="a tmpfs directory to run the same saves in ('' for none)")
    parser.add_argument("--big", action="store_true", help="also 1 GiB and 2 GiB")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the fastest of each counts")
    parser.add_argument("--dir", default="bench-output", help="where to write (a real disk, not tmpfs)")
    args = parser.parse_args(argv)
    sizes = sorted(set(args.sizes + ([1024, 2048] if args.big else [])))
    print(f"CPU: {common.cpu_model()}, {os.cpu_count()} logical CPUs; digest {signing.DIGEST_ALGORITHM}; "
          f"best of {args.repeat}; load average {os.getloadavg()[0]:.1f}")
    for directory in [d for d in (args.dir, args.tmpfs) if d]:
        os.makedirs(directory, exist_ok=True)
        print(f"\n## {directory} ({shutil.disk_usage(directory).free >> 30} GiB free)")
        for size_mib in sizes:
            run(size_mib * MIB, directory, args.repeat)
        if directory == args.tmpfs:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
