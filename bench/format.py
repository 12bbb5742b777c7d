"""Save, load and validate of one SNPX file against the physical limit and what users pick instead.

    python -m bench format [-- --sizes 16,64,256,1024 --dir bench-output --repeat 3]
    python -m bench format -- --big             # adds 2 GiB and 4 GiB

Save: CheckpointWriter (through its fsync, rename and directory fsync) as a user gets it (the write mode
measured for this filesystem, checkpoint/write_mode.py; SNEPPX_WRITE_MODE overrides) and in each mode forced,
vs the disk's limit in both modes: a raw O_DIRECT write of the same bytes from page-aligned memory and a raw
buffered write + fsync, each in 8 MiB writes; and vs what users pick instead: safetensors.numpy.save_file +
fsync, np.savez + fsync, pickle.dump + fsync.
Load (file in the page cache): CheckpointReader.read of every tensor with CRC verification, zero-copy and
copied into owned arrays, vs safetensors.numpy.load_file and np.load (neither verifies anything).
Validate: validate_checkpoint vs CRC32C alone over the same bytes in memory (one core).
Every figure is the best of --repeat rounds, each round running every candidate once; ratios compare figures
from this same run.
"""

from __future__ import annotations

import argparse
import mmap
import os
import pickle
import shutil
import time
from collections.abc import Callable

import numpy as np

from bench import common
from SneppX_ALG import _native, checkpoint
from SneppX_ALG.checkpoint import write_mode
from SneppX_ALG.contract.env import ENV_WRITE_MODE

TENSORS = 16


def aligned_state(total: int) -> dict[str, np.ndarray]:
    """TENSORS float32 arrays in page-aligned memory, so the raw O_DIRECT baseline needs no copy."""
    each = (total // TENSORS) // 4096 * 4096
    rng = np.random.default_rng(0)
    state = {}
    for i in range(TENSORS):
        buf = mmap.mmap(-1, each)
        arr = np.frombuffer(buf, dtype=np.float32)
        arr[:] = rng.standard_normal(arr.size, dtype=np.float32)
        state[f"layer{i:02d}.w"] = arr
    return state


def fastest(repeat: int, candidates: dict[str, Callable[[], object]],
            before: Callable[[str], object] | None = None) -> dict[str, float]:
    """Best time of each candidate; rounds interleave the candidates so a noisy spell hits them all alike."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeat):
        for name, fn in candidates.items():
            if before:
                before(name)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: min(ts) for name, ts in times.items()}


def raw_direct_write(path: str, state: dict[str, np.ndarray]) -> None:
    """The bytes written with O_DIRECT straight from the (page-aligned) arrays, 8 MiB a write, then fdatasync."""
    raw_write(path, state, os.O_DIRECT)


def raw_write(path: str, state: dict[str, np.ndarray], flags: int = 0) -> None:
    """The bytes written straight from the arrays, 8 MiB a write, then fdatasync: buffered unless flags say."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
    try:
        for arr in state.values():
            view = memoryview(arr).cast("B")
            for start in range(0, len(view), 8 << 20):
                os.write(fd, view[start:start + (8 << 20)])
        os.fdatasync(fd)
    finally:
        os.close(fd)


def as_fast(ratio: float, who: str = "SNPX", than: str = "") -> str:
    """A speed ratio (the other's time over ours) in words that read right both ways: "SNPX 1.20x as fast",
    "SNPX 0.87x as fast (slower)"."""
    return f"{who} {ratio:.2f}x as fast" + (f" as {than}" if than else "") + (" (slower)" if ratio < 1 else "")


def chosen_mode(directory: str) -> str:
    """What a default CheckpointWriter uses in `directory`, and why (probing now if it never has)."""
    env = write_mode.mode_from_env()
    if env != "auto":
        return f"{env} ({ENV_WRITE_MODE})"
    direct = write_mode.use_direct(directory)
    entry = write_mode.cached_entry(directory) or {}
    measured = (f": probe O_DIRECT {entry['direct_gbps']} GB/s, buffered {entry['buffered_gbps']} GB/s, "
                f"{entry.get('probed', '')}" if "direct_gbps" in entry else "")
    return f"{'direct' if direct else 'buffered'} (measured{measured})"


def warm(path: str) -> None:
    """Reads a file once so load timings measure the page cache, not the disk."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def run(size_mib: int, directory: str, repeat: int) -> list[tuple[str, float, str]]:
    total = size_mib << 20
    state = aligned_state(total)
    nbytes = sum(a.nbytes for a in state.values())
    keys = ("snpx", "snpx-direct", "snpx-buffered", "raw", "raw-buffered", "st", "npz", "pkl")
    paths = {k: os.path.join(directory, f"{k}-{size_mib}") for k in keys}

    def clean(key: str) -> None:
        if os.path.exists(paths[key]):
            os.remove(paths[key])

    def save_snpx(key: str, direct: bool | None) -> Callable[[], None]:
        def save() -> None:
            with checkpoint.CheckpointWriter(paths[key], direct=direct) as w:
                for name, arr in state.items():
                    w.write(name, arr)
        return save

    def save_st() -> None:
        from safetensors.numpy import save_file

        save_file(state, paths["st"])
        common.fsync_path(paths["st"])

    def save_npz() -> None:
        with open(paths["npz"], "wb") as f:
            np.savez(f, **state)
            f.flush()
            os.fsync(f.fileno())

    def save_pickle() -> None:
        with open(paths["pkl"], "wb") as f:
            pickle.dump(state, f, protocol=5)
            f.flush()
            os.fsync(f.fileno())

    rows = []
    t = fastest(repeat, {"raw": lambda: raw_direct_write(paths["raw"], state),
                         "raw-buffered": lambda: raw_write(paths["raw-buffered"], state),
                         "snpx": save_snpx("snpx", None), "snpx-direct": save_snpx("snpx-direct", True),
                         "snpx-buffered": save_snpx("snpx-buffered", False),
                         "st": save_st, "npz": save_npz, "pkl": save_pickle}, before=clean)
    gbps = {k: nbytes / v / 1e9 for k, v in t.items()}
    limit = min(t["raw"], t["raw-buffered"])
    rows.append(("save: SNPX CheckpointWriter (fsync, rename, dir fsync)", gbps["snpx"],
                 f"{limit / t['snpx']:.2f}x the faster raw write"))
    rows.append(("save: SNPX, O_DIRECT forced", gbps["snpx-direct"], f"{limit / t['snpx-direct']:.2f}x"))
    rows.append(("save: SNPX, buffered write-behind forced", gbps["snpx-buffered"],
                 f"{limit / t['snpx-buffered']:.2f}x"))
    rows.append(("save: raw O_DIRECT write, same bytes", gbps["raw"], f"{limit / t['raw']:.2f}x"))
    rows.append(("save: raw buffered write + fdatasync", gbps["raw-buffered"], f"{limit / t['raw-buffered']:.2f}x"))
    for key, label in (("st", "safetensors save_file + fsync"), ("npz", "np.savez + fsync"),
                       ("pkl", "pickle.dump + fsync")):
        rows.append((f"save: {label}", gbps[key], as_fast(t[key] / t["snpx"])))

    for p in (paths["snpx"], paths["st"], paths["npz"]):
        warm(p)

    def load_snpx(copy: bool) -> Callable[[], object]:
        def go() -> object:
            with checkpoint.CheckpointReader(paths["snpx"]) as r:
                return {n: (np.array(r.read(n)) if copy else r.read(n)) for n in r.names()}
        return go

    def load_st() -> object:
        from safetensors.numpy import load_file

        return load_file(paths["st"])

    def load_npz() -> object:
        with np.load(paths["npz"]) as z:
            return {k: z[k] for k in z.files}

    lt = fastest(repeat, {"zero": load_snpx(False), "copy": load_snpx(True), "st": load_st, "npz": load_npz})
    rows.append(("load: SNPX, CRC-verified, zero-copy", nbytes / lt["zero"] / 1e9,
                 as_fast(lt["st"] / lt["zero"], than="safetensors")))
    rows.append(("load: SNPX, CRC-verified, copied", nbytes / lt["copy"] / 1e9,
                 as_fast(lt["st"] / lt["copy"], than="safetensors")))
    rows.append(("load: safetensors load_file (no check)", nbytes / lt["st"] / 1e9, "1.00x"))
    rows.append(("load: np.load of .npz (no check)", nbytes / lt["npz"] / 1e9,
                 as_fast(lt["npz"] / lt["zero"], "SNPX zero-copy")))

    blob = np.concatenate([a.view(np.uint8) for a in state.values()])
    vc = fastest(3 * repeat, {"validate": lambda: checkpoint.validate_checkpoint(paths["snpx"]),
                          "crc": lambda: _native.crc32c(blob)})
    v, c = vc["validate"], vc["crc"]
    rows.append(("validate_checkpoint (cached file)", nbytes / v / 1e9, f"{c / v:.2f}x of CRC alone"))
    rows.append(("CRC32C alone, one core, in memory", nbytes / c / 1e9, "1.00x"))
    for p in paths.values():
        if os.path.exists(p):
            os.remove(p)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench format")
    parser.add_argument("--sizes", default="16,64,256,1024", help="state sizes in MiB (issue range: 16..4096)")
    parser.add_argument("--big", action="store_true", help="also 2 GiB and 4 GiB")
    parser.add_argument("--dir", default="bench-output")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    print(f"SNPX save/load/validate; {TENSORS} float32 tensors; best of {args.repeat}; dir {args.dir} "
          f"({shutil.disk_usage(args.dir).free >> 30} GiB free); CRC kernel {_native.crc32c_kernels()[-1]}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"write mode of a default CheckpointWriter here: {chosen_mode(args.dir)}\n")
    sizes = sorted({int(s) for s in args.sizes.split(",")} | ({2048, 4096} if args.big else set()))
    for size in sizes:
        print(f"### {size} MiB\n\n| operation | GB/s | ratio |\n|---|---|---|")
        for name, gbps, ratio in run(size, args.dir, args.repeat):
            print(f"| {name} | {gbps:.2f} | {ratio} |")
        print(flush=True)
