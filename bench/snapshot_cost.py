"""What a peer-memory snapshot costs (runtime/SneppX_ALG/elastic/snapshot/), for `python -m bench elastic`:

- bytes per rank per snapshot: what a rank of the demo's data-parallel training (ZeRO-1: parameters replicated,
  AdamW moments sharded) holds, and what of it goes to its peer, at world size 4; exact, from the snapshot's layout;
- a 256 MiB-per-rank state (128 MiB of replicated float32 "parameters", a 128 MiB Shard of "optimizer state"),
  2 ranks on 127.0.0.1 (a thread each, as different nodes), one snapshot after another: the copy on the training
  thread, the CRC32C, and the copy to the peer (the rest of take + wait), with the host memory used against the
  bound the Keeper checks. Side by side, in the same run: a memcpy of the same bytes and a loopback TCP transfer
  (the physical limits of the copy and of the network on this machine), and what a user would do instead to
  survive a failure at every step: a durable checkpoint of the same state every step (CheckpointCoordinator,
  sync, fsync'ed to the local disk);
- what a snapshot every step costs the training thread (`measure_training`): the demo's model trained by 2 rank
  processes (data parallel, ZeRO-1, over TCP on 127.0.0.1), blocks of steps with a snapshot after every step
  and blocks without, interleaved in the same run: the step with its snapshot against the step alone, and what
  the keeper's `take` reports of it (`take_ms`, of which the copy and the wait).
"""

from __future__ import annotations

import math
import multiprocessing
import shutil
import socket
import statistics
import tempfile
import threading
import time
from typing import Any

import numpy as np

from SneppX_ALG import collectives, coordinator
from SneppX_ALG.collectives import store as store_lib
from SneppX_ALG.coordinator import Shard
from SneppX_ALG.elastic import snapshot
from SneppX_ALG.records import open_record_store

MIB = 1 << 20


class _Shape:
    """The parts of a process group a DataParallelTrainer's constructor uses, for one rank of `world` (layout only:
    nothing is trained)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world_size = rank, world

    def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        return array

    def shard_range(self, count: int) -> tuple[int, int]:
        return count * self.rank // self.world_size, count * (self.rank + 1) // self.world_size


def report_demo_state(small: bool, world: int = 4) -> None:
    from SneppX_ALG import demo
    from SneppX_ALG.model import data, data_parallel, transformer

    sizes = demo.MODEL_SIZES["small" if small else "recipe"]
    rows = []
    for rank in range(world):
        language = data.SyntheticLanguage(vocab_size=sizes["vocab_size"], seq_len=sizes["max_seq_len"],
                                          num_sequences=64, seed=0)
        trainer = data_parallel.DataParallelTrainer(transformer.Transformer(**sizes, seed=0), language,
                                                    _Shape(rank, world), batch_size=8, lr=1e-2, seed=0)
        shot = snapshot.capture(trainer, 1, instance="bench", generation=0, rank=rank, world=world,
                                into=lambda n: np.empty(n, np.uint8))
        snapshot.seal(shot)
        rows.append((len(shot.payload), len(snapshot.wire_view(shot))))
    state, sent = statistics.mean(r[0] for r in rows), statistics.mean(r[1] for r in rows)
    print(f"\nBytes per snapshot, {'tiny' if small else 'recipe-1'} model at world size {world}: a rank holds "
          f"{state / MIB:.2f} MiB (parameters, its AdamW shards, data position, the description's slot); each "
          f"rank sends {sent / MIB:.3f} MiB ({100 * sent / state:.0f}% of it: its shards and their description), "
          f"once per replica: the replicated arrays stay in every rank's own snapshot.")


def _on_threads(n: int, fn: Any) -> list[Any]:
    out: list[Any] = [None] * n

    def body(i: int) -> None:
        out[i] = fn(i)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _loopback_seconds(nbytes: int) -> float:
    """One TCP transfer of nbytes over 127.0.0.1 (sendall / recv_into): the network's limit here."""
    listener = socket.create_server(("127.0.0.1", 0))
    payload = np.ones(nbytes, np.uint8)
    into = np.empty(nbytes, np.uint8)
    sender = socket.create_connection(listener.getsockname())
    receiver, _ = listener.accept()
    began = time.perf_counter()
    thread = threading.Thread(target=sender.sendall, args=(memoryview(payload),))
    thread.start()
    view, got = memoryview(into), 0
    while got < nbytes:
        got += receiver.recv_into(view[got:])
    thread.join()
    seconds = time.perf_counter() - began
    for s in (sender, receiver, listener):
        s.close()
    return seconds


def measure(state_mib: int = 256, repeats: int = 7) -> None:
    half = state_mib * MIB // 2
    world = 2
    params = np.random.default_rng(0).random(half // 4, dtype=np.float32)  # identical on both ranks
    shards = [np.full(half // 4, float(r), np.float32) for r in range(world)]
    states = [{"params": params.copy(), "optim": Shard(shards[r], (world * len(shards[r]),), (r * len(shards[r]),))}
              for r in range(world)]
    root = tempfile.mkdtemp(prefix="sneppx-bench-snapshot-")
    records = open_record_store(root)
    groups = _on_threads(world, lambda r: collectives.ProcessGroup(
        store_lib.RecordKeyStore(records, "g"), r, world, 0, key=b"k" * 32, timeout=300, backend="tcp"))
    keepers = [snapshot.Keeper() for _ in range(world)]
    before = _rss()  # the scratch buffers below (the bench's own copies, timed apart) are counted out after
    timings: list[list[dict[str, float]]] = [[] for _ in range(world)]

    def rank_loop(r: int) -> None:
        scratch = np.ones(state_mib * MIB + MIB, np.uint8)  # touched: as the Keeper's reused buffers are
        for step in range(1, repeats + 1):
            t0 = time.perf_counter()
            shot = snapshot.capture(states[r], step, instance="bench", generation=0, rank=r, world=world,
                                    into=lambda n, s=scratch: s[:n])
            t1 = time.perf_counter()
            snapshot.seal(shot)
            t2 = time.perf_counter()
            keepers[r].take(states[r], step, groups[r], instance="bench", generation=0, place=f"node-{r}")
            t3 = time.perf_counter()
            keepers[r].wait()
            t4 = time.perf_counter()
            timings[r].append({"copy": t1 - t0, "crc": t2 - t1, "take": t3 - t2, "total": t4 - t2})

    _on_threads(world, rank_loop)
    used = _rss() - before - world * (state_mib * MIB + MIB)
    bound = world * snapshot.needed_bytes(state_mib * MIB, half, 1)  # every rank sends its Shard
    for g in groups:
        g.close()

    copy_anchor = []
    target = np.empty(state_mib * MIB, np.uint8)
    source = np.ones(state_mib * MIB, np.uint8)
    for _ in range(repeats):
        began = time.perf_counter()
        np.copyto(target, source)
        copy_anchor.append(time.perf_counter() - began)
    network = statistics.median(_loopback_seconds(half) for _ in range(3))
    durable = []
    with tempfile.TemporaryDirectory(prefix="sneppx-bench-durable-") as d, \
            coordinator.CheckpointCoordinator(d, async_save=False, max_to_keep=2) as saver:
        for step in range(1, repeats + 1):
            began = time.perf_counter()
            saver.save({"params": params, "optim": shards[1]}, step)
            durable.append(time.perf_counter() - began)

    r1 = timings[1]
    med = {k: statistics.median(t[k] for t in r1) for k in r1[0]}
    network_part = med["total"] - med["crc"] - med["copy"]
    print(f"\nA {state_mib} MiB-per-rank state (half replicated parameters, half a Shard), 2 ranks on 127.0.0.1, "
          f"{repeats} snapshots, rank 1 (it sends its {half // MIB} MiB Shard), median:")
    print("| part | this | anchor (same run) | ratio |")
    print("|---|---:|---:|---:|")
    memcpy = statistics.median(copy_anchor)
    print(f"| copy into the reused buffer (training thread) | {1e3 * med['copy']:.0f} ms | memcpy of {state_mib} MiB "
          f"(np.copyto): {1e3 * memcpy:.0f} ms | {med['copy'] / memcpy:.2f}x |")
    print(f"| CRC32C, every 4 MiB (all CPUs) | {1e3 * med['crc']:.0f} ms | | |")
    print(f"| copy to the peer + agreement (the rest of take + wait) | {1e3 * network_part:.0f} ms | loopback TCP, "
          f"{half // MIB} MiB: {1e3 * network:.0f} ms | {network_part / network:.2f}x |")
    print(f"| a whole snapshot (take + wait) | {1e3 * med['total']:.0f} ms | a durable checkpoint of the same "
          f"state, sync, fsync'ed: {1e3 * statistics.median(durable):.0f} ms | "
          f"{statistics.median(durable) / med['total']:.2f}x faster |")
    parts = {"copy": med["copy"], "CRC": med["crc"], "network": network_part}
    print(f"What dominates: {max(parts, key=parts.get)}. With a step longer than a whole snapshot the training "
          f"thread waits only for the copy ({1e3 * med['copy']:.0f} ms a step); shorter steps wait for the rest too.")
    print(f"Host memory: {used / MIB:.0f} MiB more resident after the snapshots (both ranks, this process), the bound "
          f"Keeper checks is {bound / MIB:.0f} MiB ({100 * used / bound:.0f}% of it).")
    shutil.rmtree(root, ignore_errors=True)


def _training_rank(rank: int, world: int, root: str, small: bool, blocks: int, block_steps: int,
                   out: Any) -> None:
    """One rank of measure_training: blocks of steps, every odd block with a snapshot after each step."""
    from SneppX_ALG import demo
    from SneppX_ALG.model import data, data_parallel, transformer

    records = open_record_store(root)
    made = [collectives.ProcessGroup(store_lib.RecordKeyStore(records, name), rank, world, 0, key=b"k" * 32,
                                     timeout=300, backend="tcp") for name in ("train", "snapshot")]
    sizes = demo.MODEL_SIZES["small" if small else "recipe"]
    language = data.SyntheticLanguage(vocab_size=sizes["vocab_size"], seq_len=sizes["max_seq_len"],
                                      num_sequences=256, seed=0)
    trainer = data_parallel.DataParallelTrainer(transformer.Transformer(**sizes, seed=0), language, made[0],
                                                batch_size=16, lr=1e-2, seed=0)
    keeper = snapshot.Keeper()
    rows = []
    for block in range(blocks):
        on = block % 2 == 1
        for _ in range(block_steps):
            began, cpu, process = time.perf_counter(), time.thread_time(), time.process_time()
            trainer.train_step()
            trained, trained_cpu = time.perf_counter(), time.thread_time()
            if on:
                keeper.take(trainer, trainer.step, made[1], instance="bench", generation=0, place=f"node-{rank}")
            rows.append({"on": on, "block": block, "train": trained - began, "snapshot": time.perf_counter() - trained,
                         "train_cpu": trained_cpu - cpu, "snapshot_cpu": time.thread_time() - trained_cpu,
                         "process_cpu": time.process_time() - process,  # the background thread's too
                         **({k: keeper.costs.get(k, math.nan) for k in ("take_ms", "copy_ms", "wait_ms")} if on else {})})
    keeper.wait()
    for g in made:
        g.close()
    out.put((rank, rows))


def measure_training(small: bool, blocks: int = 21, block_steps: int = 10) -> dict[str, float]:
    """The demo's model, 2 rank processes, a snapshot every step in every other block of steps (the first block,
    a warm-up, is left out): medians of rank 1's steps, with snapshots against without, side by side."""
    world = 2
    root = tempfile.mkdtemp(prefix="sneppx-bench-snapshot-training-")
    context = multiprocessing.get_context("fork")  # before any thread: the ranks start from this process as is
    out = context.Queue()
    procs = [context.Process(target=_training_rank, args=(r, world, root, small, blocks, block_steps, out))
             for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    shutil.rmtree(root, ignore_errors=True)
    rows = [r for r in results[1] if r["block"] > 0]
    on, off = [r for r in rows if r["on"]], [r for r in rows if not r["on"]]
    med = statistics.median
    step_on, step_off = med(r["train"] + r["snapshot"] for r in on), med(r["train"] for r in off)
    figures = {"step_on_ms": 1e3 * step_on, "step_off_ms": 1e3 * step_off,
               "train_on_ms": 1e3 * med(r["train"] for r in on), "snapshot_call_ms": 1e3 * med(r["snapshot"] for r in on),
               "take_ms": med(r["take_ms"] for r in on), "copy_ms": med(r["copy_ms"] for r in on),
               "wait_ms": med(r["wait_ms"] for r in on), "overhead": step_on / step_off - 1,
               "cpu_on_ms": 1e3 * med(r["train_cpu"] + r["snapshot_cpu"] for r in on),
               "cpu_off_ms": 1e3 * med(r["train_cpu"] for r in off),
               "snapshot_cpu_ms": 1e3 * med(r["snapshot_cpu"] for r in on),
               "process_on_ms": 1e3 * med(r["process_cpu"] for r in on),
               "process_off_ms": 1e3 * med(r["process_cpu"] for r in off)}
    f = figures
    print(f"\nWhat a snapshot every step costs the training thread: the {'tiny' if small else 'recipe-1'} model, "
          f"{world} rank processes on 127.0.0.1, {len(on)} steps with a snapshot and {len(off)} without, in "
          f"interleaved blocks of {block_steps}; rank 1's medians:")
    print("| | with a snapshot every step | without | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| a step (train_step, then the snapshot call) | {f['step_on_ms']:.2f} ms | {f['step_off_ms']:.2f} ms | "
          f"{step_on / step_off:.3f}x ({100 * f['overhead']:+.1f}%) |")
    print(f"| train_step alone | {f['train_on_ms']:.2f} ms | {f['step_off_ms']:.2f} ms | "
          f"{f['train_on_ms'] / f['step_off_ms']:.3f}x |")
    print(f"| the snapshot call (Keeper.take), timed outside | {f['snapshot_call_ms']:.3f} ms | | |")
    print(f"| what take reports: take_ms (of it copy_ms, wait_ms) | {f['take_ms']:.3f} ms ({f['copy_ms']:.3f}, "
          f"{f['wait_ms']:.3f}) | | |")
    print(f"| the training thread's CPU time a step (of it the snapshot call) | {f['cpu_on_ms']:.2f} ms "
          f"({f['snapshot_cpu_ms']:.3f}) | {f['cpu_off_ms']:.2f} ms | {f['cpu_on_ms'] / f['cpu_off_ms']:.3f}x |")
    print(f"| the process's CPU time a step (the snapshot thread's too) | {f['process_on_ms']:.2f} ms | "
          f"{f['process_off_ms']:.2f} ms | {f['process_on_ms'] / f['process_off_ms']:.3f}x |")
    return figures
