"""Sharded checkpoints: what a save at N ranks costs against one process saving the same state, and what a load
at M ranks reads against what it needs.

    python -m bench sharded [-- --world 4 --params-mib 32 --blocks 65536,262144,1048576 --dir bench-output]

The state is a data-parallel trainer's: TENSORS float32 parameters (replicated: every rank holds them) and
AdamW's two moments of each, sharded flat over the ranks (rank r holds elements shard_range(n, N, r) of each
flattened tensor, as model/data_parallel.py cuts them). Each rank is a process on 127.0.0.1 with a ProcessGroup
for its coordinator; files go to --dir (local disk), cold in the sense that nothing is reused between runs.

Saves, each timed from a barrier to the commit (the slowest rank's save() + wait()):
- one process saving the whole state (parameters and full moments): what a job does without sharding;
- N ranks, replicated parameters written whole, each by the rank replicated_owners gives it (SneppX's choice);
- N ranks, every parameter written by rank 0 (the simplest rule), expressed as rank 0's whole-tensor Shards;
- N ranks, every parameter cut into N row slices, one per rank (the other rule the issue names).
The bytes each rank writes (max and min over ranks) show the balance.

Loads at M ranks of the step saved at N (SneppX's choice, per --blocks checksum block size): each rank asks for
the whole parameters and its new slices of the moments; "read / needed" is the bytes of chunk data it read over
the bytes it asked for (the alignment to checksum blocks), "metadata" the manifest and the header blocks and
tables of the shard files it opened, and the manifest's size is what the block checksums cost. Against it, in
the same run: every rank reading the whole step into arrays of the full tensors (a restore without Shards: what
a loader that can't reshard does). Times are the slowest rank's restore(); both copy what they read into the
caller's arrays once the step is known good (the resharded one into its Shards).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from bench import common

KEY = b"bench-sharded-job-key-0123456789"
TENSORS = 16
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def parameters(params_mib: int) -> dict[str, np.ndarray]:
    """TENSORS float32 matrices of 256 columns, sizes from 1x to 3x of each other, params_mib MiB in all (the same
    on every rank: the seed is fixed)."""
    rng = np.random.default_rng(0)
    weights = [1 + (i % 3) for i in range(TENSORS)]
    total = params_mib << 20
    rows = [max(1, total * w // sum(weights) // 4 // 256) for w in weights]
    return {f"layer{i:02d}": rng.standard_normal((n, 256), dtype=np.float32) for i, n in enumerate(rows)}


def rank_state(params: dict[str, np.ndarray], rank: int, world: int, policy: str) -> dict[str, Any]:
    from SneppX_ALG import _native
    from SneppX_ALG.coordinator import Shard

    moments: dict[str, Any] = {"m": {}, "v": {}}
    model: dict[str, Any] = {}
    for name, value in params.items():
        lo, hi = _native.shard_range(value.size, world, rank)
        for kind, scale in (("m", 0.1), ("v", 0.01)):
            moments[kind][name] = Shard(value.reshape(-1)[lo:hi] * scale, (value.size,), (lo,))
        if policy == "owner":
            model[name] = value
        elif policy == "rank0":
            if rank == 0:
                model[name] = Shard(value, value.shape, (0, 0))
        else:  # "slices"
            r0, r1 = _native.shard_range(value.shape[0], world, rank)
            model[name] = Shard(value[r0:r1], value.shape, (r0, 0))
    return {"model": model, "optim": moments, "step": np.array(7)}


def targets(params: dict[str, np.ndarray], rank: int, world: int) -> dict[str, Any]:
    from SneppX_ALG import _native
    from SneppX_ALG.coordinator import Shard

    out: dict[str, Any] = {"model": {k: np.empty_like(v) for k, v in params.items()}, "optim": {"m": {}, "v": {}},
                           "step": np.zeros((), np.int64)}
    for name, value in params.items():
        lo, hi = _native.shard_range(value.size, world, rank)
        for kind in ("m", "v"):
            out["optim"][kind][name] = Shard(np.empty(hi - lo, np.float32), (value.size,), (lo,))
    return out


def rank_main(store_dir: str, root: str, rank: int, world: int, task: dict[str, Any], results: Any) -> None:
    os.environ.update(ONE_THREAD)
    from SneppX_ALG import CheckpointCoordinator, _native, collectives
    from tests.directory_store import DirectoryStore

    group = collectives.ProcessGroup(DirectoryStore(store_dir), rank, world, key=KEY, timeout=600)
    params = parameters(task["params_mib"])
    coord = CheckpointCoordinator(root, group=group, max_to_keep=None, checksum_block_bytes=task["block"],
                                  staging_bytes=2 * (task["params_mib"] << 20) + (64 << 20))
    report: dict[str, Any] = {}
    if task["op"] == "save":
        state = rank_state(params, rank, world, task["policy"]) if world > 1 else {
            "model": params, "optim": {k: {n: v.reshape(-1) * s for n, v in params.items()}
                                       for k, s in (("m", 0.1), ("v", 0.01))}, "step": np.array(7)}
        group.barrier()
        started = time.perf_counter()
        coord.save(state, step=1)
        coord.wait()
        report["seconds"] = time.perf_counter() - started
        shard = os.path.join(root, "step-000000001", f"shard-{rank:05d}.snpx")
        group.barrier()
        report["written"] = os.path.getsize(shard)
    else:
        # the whole step lands in arrays of the full tensors, as a loader that can't reshard would need
        target = targets(params, rank, world) if not task["whole"] else {
            "model": {k: np.empty_like(v) for k, v in params.items()}, "step": np.zeros((), np.int64),
            "optim": {kind: {k: np.empty(v.size, np.float32) for k, v in params.items()} for kind in ("m", "v")}}
        group.barrier()
        started = time.perf_counter()
        info = coord.restore(target)
        report["seconds"] = time.perf_counter() - started
        if info.read is not None:
            report.update(needed=info.read.needed, data=info.read.data, metadata=info.read.metadata)
        else:
            report["data"] = sum(t["nbytes"] for t in info.manifest["tensors"])
        if not task["whole"]:  # what was loaded is what was saved
            lo, hi = _native.shard_range(params["layer00"].size, world, rank)
            assert np.array_equal(target["optim"]["m"]["layer00"].data, params["layer00"].reshape(-1)[lo:hi] * 0.1)
    coord.close()
    group.close()
    results.put((rank, report))


def run(world: int, root: str, task: dict[str, Any]) -> dict[int, dict[str, Any]]:
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    store_dir = tempfile.mkdtemp(prefix="sneppx-bench-store-")
    processes = [spawn.Process(target=rank_main, args=(store_dir, root, r, world, task, results), daemon=True)
                 for r in range(world)]
    for p in processes:
        p.start()
    reports = dict(results.get(timeout=1800) for _ in range(world))
    for p in processes:
        p.join(60)
    shutil.rmtree(store_dir, ignore_errors=True)
    return reports


def slowest(reports: dict[int, dict[str, Any]]) -> float:
    return max(r["seconds"] for r in reports.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench sharded")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--params-mib", type=int, default=32)
    parser.add_argument("--blocks", default="65536,262144,1048576", help="checksum block sizes to load with")
    parser.add_argument("--loads", default="3,2,1,8", help="world sizes to load the step at")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="bench-output")
    args = parser.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    base = tempfile.mkdtemp(prefix="sharded-", dir=args.dir)
    n = args.world
    state_mib = 3 * args.params_mib
    print(f"state {state_mib} MiB ({args.params_mib} MiB parameters + 2 moments), {TENSORS} tensors, saved at {n} "
          f"ranks; median of {args.repeat}; {common.cpu_model()}, {os.cpu_count()} CPUs\n")

    def saved(world: int, policy: str, block: int, tag: str) -> tuple[str, dict[int, dict[str, Any]]]:
        root = os.path.join(base, tag)
        shutil.rmtree(root, ignore_errors=True)
        return root, run(world, root, {"op": "save", "policy": policy, "block": block,
                                       "params_mib": args.params_mib})

    print("| save | seconds | GB/s | vs one process | bytes written per rank (max / min) |")
    print("|---|---|---|---|---|")
    rounds: dict[str, list[float]] = {}
    written: dict[str, tuple[int, int]] = {}
    cases = [("one process", 1, "owner"), (f"{n} ranks, parameters by owner", n, "owner"),
             (f"{n} ranks, parameters by rank 0", n, "rank0"), (f"{n} ranks, parameters in slices", n, "slices")]
    for _ in range(args.repeat):  # interleaved, so that the machine's load shifts hit every case alike
        for label, world, policy in cases:
            _, reports = saved(world, policy, 1 << 18, "save")
            rounds.setdefault(label, []).append(slowest(reports))
            sizes = [r["written"] for r in reports.values()]
            written[label] = (max(sizes), min(sizes))
    single = statistics.median(rounds["one process"])
    for label, _, _ in cases:
        seconds = statistics.median(rounds[label])
        print(f"| {label} | {seconds:.2f} | {(state_mib << 20) / seconds / 1e9:.2f} | {single / seconds:.2f}x | "
              f"{written[label][0] / 2**20:.1f} / {written[label][1] / 2**20:.1f} MiB |", flush=True)

    print("\n| load | block | read / needed | metadata per rank | manifest | seconds | whole step per rank: "
          "seconds | read / needed |")
    print("|---|---|---|---|---|---|---|---|")
    for block in (int(b) for b in args.blocks.split(",")):
        root, _ = saved(n, "owner", block, f"blocks-{block}")
        manifest = os.path.getsize(os.path.join(root, "step-000000001", "manifest.json"))
        for m in (int(x) for x in args.loads.split(",")):
            times, whole_times = [], []
            for _ in range(args.repeat):
                reports = run(m, root, {"op": "load", "whole": False, "block": block,
                                        "params_mib": args.params_mib})
                times.append(slowest(reports))
            needed = sum(r["needed"] for r in reports.values())
            data = sum(r["data"] for r in reports.values())
            metadata = max(r["metadata"] for r in reports.values())
            whole_row = "| - | - |"
            if block == 1 << 18:
                for _ in range(args.repeat):
                    whole = run(m, root, {"op": "load", "whole": True, "block": block,
                                          "params_mib": args.params_mib})
                    whole_times.append(slowest(whole))
                whole_row = (f"| {statistics.median(whole_times):.2f} | "
                             f"{sum(r['data'] for r in whole.values()) / needed:.3f} |")
            print(f"| {n} -> {m} | {block >> 10} KiB | {data / needed:.4f} | {metadata / 1024:.0f} KiB | "
                  f"{manifest / 1024:.0f} KiB | {statistics.median(times):.2f} {whole_row}", flush=True)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
