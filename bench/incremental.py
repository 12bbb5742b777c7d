"""Incremental checkpoints: bytes written and save time against a full save, and restore from a chain.

    python -m bench incremental [-- --mib 1024 --rounds 3 --dir bench-output --s3-mib 256 --only restore ...]

In one run, for a state of --mib MiB (16 float32 tensors):
- a second save after 90%, 50% and 0% of the state's bytes stayed the same (the first 10%, 50%, 100% of every
  tensor changed): bytes written and save()+wait() time, incremental (on, and "auto") vs a full SneppX save
  (incremental=False) of the same change, and beside them the physical floor (the changed bytes alone written
  to a file and fsynced) and what a user would write without SneppX (safetensors.numpy.save_file of the whole
  state, then fsync); median of --rounds rounds;
- a sparse embedding update on a --mib table of 1 KiB rows, 1% of the rows touched: spread at random (what
  block-level reuse can't help: most 1 MiB pieces hold a touched row) and clustered (the newest 1% of rows);
- restore of the 10th step of a chain (each save 90% unchanged, a different 10% each time) vs a full step of
  the same state, rounds interleaved: cold (the roots' files dropped from the page cache first, with
  posix_fadvise: what a restart after a failure reads) and warm (from the page cache: the work SneppX does,
  without the disk); per restore the CPU time of the process (all threads; the fewest of the rounds: what load on
  a shared machine disturbs least), the fastest wall round and the median, each as a ratio chain/full;
- on S3 (the Versity S3 Gateway on 127.0.0.1, writing to the local disk), the second save of an --s3-mib state
  90% unchanged, incremental vs full: where storage is the bottleneck.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from bench.common import cpu_model, evict, fsync_path
from SneppX_ALG import CheckpointCoordinator, storage
from tests import s3_servers

MiB = 1 << 20


def make_state(total: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"layer{i:02d}.w": rng.standard_normal(total // 16 // 4, dtype=np.float32) for i in range(16)}


def change(state: dict[str, np.ndarray], fraction: float) -> None:
    """Changes the first `fraction` of every tensor's bytes (a real update: every element in it moves)."""
    for array in state.values():
        array[:int(len(array) * fraction)] += 1.0


def stored(root: pathlib.Path, step: int) -> int:
    return sum(p.stat().st_size for p in (root / storage.step_name(step)).iterdir())


def timed_save(coord: CheckpointCoordinator, state: Any, step: int) -> float:
    started = time.perf_counter()
    coord.save(state, step=step)
    coord.wait()
    return time.perf_counter() - started


def second_save(workdir: pathlib.Path, total: int, unchanged: float, mode: Any) -> tuple[float, int]:
    """(seconds, bytes stored) of the save after `1 - unchanged` of the state changed."""
    root = pathlib.Path(tempfile.mkdtemp(dir=workdir))
    state = make_state(total)
    try:
        seconds = second_save_to(str(root), state, unchanged, mode)
        return seconds, stored(root, 2)
    finally:
        shutil.rmtree(root)


def second_save_to(root: str, state: dict[str, np.ndarray], unchanged: float, mode: Any, **kwargs: Any) -> float:
    with CheckpointCoordinator(root, max_to_keep=None, device="cpu", incremental=mode, **kwargs) as coord:
        coord.save(state, step=1)
        coord.wait()
        change(state, 1.0 - unchanged)
        return timed_save(coord, state, 2)


def s3_second_saves(workdir: pathlib.Path, total: int, rounds: int) -> dict[str, float] | str:
    """Median seconds of the second save (90% unchanged) to S3, full and incremental, or why not measured."""
    os.environ.update(s3_servers.ENV)
    server_dir = pathlib.Path(tempfile.mkdtemp(prefix="versitygw-", dir=workdir))
    try:
        server = s3_servers.start("versitygw", server_dir)
    except s3_servers.S3ServerError as e:
        return str(e).splitlines()[0]
    try:
        client = server.client()
        client.create_bucket(Bucket="bench")
        times: dict[str, list[float]] = {"full": [], "incr": []}
        for i in range(rounds):
            for name, mode in (("full", False), ("incr", True)):
                times[name].append(second_save_to(f"s3://bench/{name}-{i}", make_state(total), 0.9, mode,
                                                  s3_client=client, staging_dir=str(workdir)))
        return {name: statistics.median(t) for name, t in times.items()}
    finally:
        s3_servers.stop(server)
        shutil.rmtree(server_dir, ignore_errors=True)


def floor_write(workdir: pathlib.Path, nbytes: int) -> float:
    """The changed bytes alone, written to a file and fsynced: no format, no checksums."""
    path = workdir / "floor.bin"
    data = np.ones(max(nbytes, 1), np.uint8)
    started = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(data))
    fsync_path(str(path))
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def safetensors_save(workdir: pathlib.Path, total: int) -> float:
    from safetensors.numpy import save_file

    state = make_state(total)
    path = workdir / "state.safetensors"
    started = time.perf_counter()
    save_file(state, str(path))
    fsync_path(str(path))
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def sparse_table(workdir: pathlib.Path, total: int, clustered: bool) -> tuple[int, int]:
    """(bytes the second save stored, the table's size) after 1% of a table's 1 KiB rows were touched."""
    rows = total // 1024
    table = np.random.default_rng(1).standard_normal((rows, 256), dtype=np.float32)
    touched = (np.arange(rows - rows // 100, rows) if clustered
               else np.random.default_rng(2).choice(rows, rows // 100, replace=False))
    root = pathlib.Path(tempfile.mkdtemp(dir=workdir))
    try:
        with CheckpointCoordinator(str(root), max_to_keep=None, device="cpu", incremental=True) as coord:
            coord.save({"embedding": table}, step=1)
            coord.wait()
            table[touched] += 0.5
            coord.save({"embedding": table}, step=2)
            coord.wait()
        return stored(root, 2), table.nbytes
    finally:
        shutil.rmtree(root)


def chain_restore(workdir: pathlib.Path, total: int, rounds: int,
                  ) -> tuple[dict[str, dict[str, dict[str, float]]], int]:
    """What restoring the 10th step of a chain and a full step of the same state costs ({"cold" | "warm": {"chain"
    | "full": {"median" | "fastest": wall seconds, "cpu": the fewest CPU seconds of the process, all threads}}}:
    cold after the roots' files were dropped from the page cache; the fastest round and the CPU time are what the
    work costs when nothing else on a shared machine got in its way: a loaded machine stretches wall time, not the
    CPU time a restore needs), and the bytes the chain's ten steps store."""
    chain_root, full_root = (pathlib.Path(tempfile.mkdtemp(dir=workdir)) for _ in range(2))
    state = make_state(total)
    try:
        with CheckpointCoordinator(str(chain_root), max_to_keep=None, device="cpu", incremental=True,
                                   full_every=20) as coord:
            for step in range(1, 11):
                if step > 1:
                    for index, array in enumerate(state.values()):  # a different 10% each time
                        part = len(array) // 10
                        start = ((step + index) % 10) * part
                        array[start:start + part] += 1.0
                coord.save(state, step=step)
            coord.wait()
        with CheckpointCoordinator(str(full_root), max_to_keep=None, device="cpu", incremental=False) as coord:
            coord.save(state, step=10)
            coord.wait()
        samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(rounds):  # interleaved, cold then warm
            for name, root in (("chain", chain_root), ("full", full_root)):
                for cache in ("cold", "warm"):
                    if cache == "cold":
                        evict(root)
                    with CheckpointCoordinator(str(root), read_only=True, device="cpu") as coord:
                        got: dict[str, Any] = {}
                        started, cpu = time.perf_counter(), time.process_time()
                        info = coord.restore(got, 10)
                        samples.setdefault((cache, name), []).append((time.perf_counter() - started,
                                                                      time.process_time() - cpu))
                    assert info is not None and all(np.array_equal(got[k], state[k]) for k in state)
        times: dict[str, dict[str, dict[str, float]]] = {}
        for (cache, name), got_s in samples.items():
            walls = [wall for wall, _ in got_s]
            times.setdefault(cache, {})[name] = {"median": statistics.median(walls), "fastest": min(walls),
                                                 "cpu": min(cpu for _, cpu in got_s)}
        return times, sum(stored(chain_root, s) for s in range(1, 11))
    finally:
        shutil.rmtree(chain_root)
        shutil.rmtree(full_root)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench incremental")
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the roots go (default: a temporary directory)")
    parser.add_argument("--s3-mib", type=int, default=256)
    parser.add_argument("--only", choices=("saves", "sparse", "restore", "s3"), action="append",
                        help="run only these parts (repeatable; default: all)")
    args = parser.parse_args(argv)
    parts = set(args.only or ("saves", "sparse", "restore", "s3"))
    total = args.mib * MiB
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench-incremental-", dir=args.dir))
    try:
        print(f"machine: {cpu_model()}, {os.cpu_count()} cores; state {args.mib} MiB in 16 float32 tensors; "
              f"median of {args.rounds} rounds\n")
        if "saves" in parts:
            second_saves(workdir, total, args.rounds)
        if "sparse" in parts:
            sparse_tables(workdir, total)
        if "restore" in parts:
            chain_restores(workdir, total, args.rounds)
        if "s3" in parts:
            s3_saves(workdir, args.s3_mib, args.rounds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def second_saves(workdir: pathlib.Path, total: int, rounds: int) -> None:
    safetensors_s = statistics.median(safetensors_save(workdir, total) for _ in range(rounds))
    print("| unchanged | full save | incremental | auto | bytes full/incr | time full/incr | "
          "floor (changed bytes, fsync) | safetensors (all) |")
    print("|---|---|---|---|---|---|---|---|")
    for unchanged in (0.9, 0.5, 0.0):
        runs: dict[str, list[tuple[float, int]]] = {"full": [], "incr": [], "auto": []}
        for _ in range(rounds):  # interleaved, so drift on this noisy machine hits all three alike
            runs["full"].append(second_save(workdir, total, unchanged, False))
            runs["incr"].append(second_save(workdir, total, unchanged, True))
            runs["auto"].append(second_save(workdir, total, unchanged, "auto"))
        seconds = {k: statistics.median(s for s, _ in v) for k, v in runs.items()}
        written = {k: statistics.median(b for _, b in v) for k, v in runs.items()}
        floor = statistics.median(floor_write(workdir, int(total * (1 - unchanged))) for _ in range(rounds))
        print(f"| {unchanged:.0%} | {seconds['full']:.2f} s, {written['full'] / MiB:.0f} MiB "
              f"| {seconds['incr']:.2f} s, {written['incr'] / MiB:.0f} MiB "
              f"| {seconds['auto']:.2f} s, {written['auto'] / MiB:.0f} MiB "
              f"| {written['full'] / written['incr']:.1f}x | {seconds['full'] / seconds['incr']:.2f}x "
              f"| {floor:.2f} s ({seconds['incr'] / max(floor, 1e-9):.1f}x of it) | {safetensors_s:.2f} s |",
              flush=True)


def sparse_tables(workdir: pathlib.Path, total: int) -> None:
    print("\n| sparse table update (1% of 1 KiB rows) | bytes stored | of the table |")
    print("|---|---|---|")
    for clustered in (False, True):
        got, size = sparse_table(workdir, total, clustered)
        print(f"| {'clustered (the newest rows)' if clustered else 'random rows'} | {got / MiB:.1f} MiB "
              f"| {got / size:.1%} |", flush=True)


def chain_restores(workdir: pathlib.Path, total: int, rounds: int) -> None:
    restores, chain_bytes = chain_restore(workdir, total, rounds)
    print(f"\nrestore of the 10th step of a chain (each save 90% unchanged; the chain's 10 steps store "
          f"{chain_bytes / MiB:.0f} MiB, {chain_bytes / total:.2f}x the state) vs a full step of the same state:")
    print("| cache | CPU, fewest (all threads): chain / full | wall, fastest round | wall, median |")
    print("|---|---|---|---|")
    for cache, got in restores.items():
        chain, full = got["chain"], got["full"]
        cells = [f"{chain[k] * 1e3:.0f} / {full[k] * 1e3:.0f} ms, **{chain[k] / full[k]:.2f}x**"
                 for k in ("cpu", "fastest", "median")]
        print(f"| {cache} | {' | '.join(cells)} |", flush=True)


def s3_saves(workdir: pathlib.Path, s3_mib: int, rounds: int) -> None:
    s3 = s3_second_saves(workdir, s3_mib * MiB, rounds)
    if isinstance(s3, str):
        print(f"\nS3: not measured ({s3})")
    else:
        print(f"\nS3 (versitygw, 127.0.0.1), {s3_mib} MiB, second save 90% unchanged: full {s3['full']:.2f} s, "
              f"incremental {s3['incr']:.2f} s: {s3['full'] / s3['incr']:.2f}x")
