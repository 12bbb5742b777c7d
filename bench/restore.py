"""Checking and restoring a coordinator step: one pass through one descriptor vs check-then-reopen.

    python -m bench restore [-- --sizes 256,1024 --dir bench-output --repeat 3]

A step (one shard, TENSORS float32 tensors) is saved unsigned and signed, then, with its files in the page
cache (the case where the CPU, not the disk, is the limit):

- check: validate.check_step (what latest() runs: one pass of native pread + CRC32C, and the BLAKE3 of the
  file when signed) vs the way it was checked before (the shard's CRCs through a memory map, its table
  opened again, and for a signed step a separate BLAKE3 pass: signing.file_digest);
- restore: validate.load_step (the same pass, reading straight into the arrays restore hands back) vs
  check-then-reopen (the check above, then the shard opened again by path and every tensor read with its
  CRC checked and copied into an owned array): what restore() did before.
- the limit: np.copyto of the state into already-touched memory (a load can't be cheaper than one copy).

Every figure is the best of --repeat rounds that interleave the candidates; ratios are from this run.
"""

from __future__ import annotations

import argparse
import os
import shutil

import numpy as np

from bench import common
from bench.format import fastest
from SneppX_ALG import CheckpointCoordinator, storage
from SneppX_ALG.checkpoint import file, signing, validate

TENSORS = 16


def check_then_reopen(local: str, keys: dict | None, load: bool) -> None:
    """The checks before this change, and with `load` the reads restore made after them."""
    shard = os.path.join(local, "shard-00000.snpx")
    validate.validate_checkpoint(shard)
    with file.CheckpointReader(shard, verify=False) as reader:
        reader.names()
    if keys is not None:
        signing.file_digest(shard)
    if load:
        with file.CheckpointReader(shard) as reader:
            [np.array(reader.read(name), copy=True) for name in reader.names()]


def bench_step(local: str, keys: dict | None, state: dict[str, np.ndarray], repeat: int) -> dict[str, float]:
    target = {k: np.empty_like(v) for k, v in state.items()}
    return fastest(repeat, {
        "check": lambda: validate.check_step(local, 1, keys),
        "check, before": lambda: check_then_reopen(local, keys, load=False),
        "restore": lambda: validate.load_step(local, 1, keys),
        "restore, before": lambda: check_then_reopen(local, keys, load=True),
        "copy": lambda: [np.copyto(target[k], v) for k, v in state.items()],
    })


def run(size_mib: int, directory: str, repeat: int) -> list[str]:
    each = (size_mib << 20) // TENSORS // 4
    rng = np.random.default_rng(0)
    state = {f"t{i:02d}": rng.standard_normal(each, dtype=np.float32) for i in range(TENSORS)}
    private, public = signing.generate_keypair()
    rows = []
    for signed in (False, True):
        kind = "signed" if signed else "unsigned"
        root = os.path.join(directory, f"restore-{size_mib}-{kind}")
        shutil.rmtree(root, ignore_errors=True)
        with CheckpointCoordinator(root, max_to_keep=None, signing_key=private if signed else None) as coord:
            coord.save(state, step=1)
        keys = {signing.key_id(public): public} if signed else None
        t = bench_step(os.path.join(root, storage.step_name(1)), keys, state, repeat)
        nbytes = size_mib << 20
        rows.append(f"| {size_mib} MiB | {kind} | {nbytes / t['check'] / 1e9:.1f} GB/s | "
                    f"{t['check, before'] / t['check']:.2f}x | {nbytes / t['restore'] / 1e9:.1f} GB/s | "
                    f"{t['restore, before'] / t['restore']:.2f}x | {t['restore'] / t['copy']:.2f}x |")
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench restore")
    parser.add_argument("--sizes", default="256,1024", help="state sizes in MiB, comma-separated")
    parser.add_argument("--dir", default="bench-output")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    print(f"step check/restore, files cached; {TENSORS} float32 tensors; best of {args.repeat}; "
          f"{common.cpu_model()}, {os.cpu_count()} CPUs\n")
    print("| state | step | check | check: before / now | restore | restore: before / now | restore / copy |")
    print("|---|---|---|---|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        for row in run(size, args.dir, args.repeat):
            print(row, flush=True)


if __name__ == "__main__":
    main()
