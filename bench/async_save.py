"""Async checkpointing: what save() costs the training loop, and S3 upload speed.

    python -m bench async_save [-- --sizes 256,1024 --big --dir bench-output --s3-mib 256]

For each state size (MiB; --big adds 4096), in one run:
- blocking time of save() (steady state, staging >= state) vs a plain copy of the state into warm memory
  (np.copyto) and vs a synchronous save (async_save=False, through the commit);
- save() blocking time with staging bounded to a quarter of the state (it streams the rest through);
- the copy-on-write alternative: os.fork() of the process holding the state, and the cost of one pass of
  writes over the state while the forked child holds it (page faults + page copies) vs the same pass alone;
- training step time while a save persists in the background vs without (a step: three 384x384 matmuls,
  with numpy's BLAS limited to one thread here, plus an in-place update of 16 MiB of the state);
- peak host memory growth during save()+wait() as a fraction of the state (VmHWM reset per measure).
S3, on each test server in turn (moto, an emulation, itself the bottleneck; the Versity S3 Gateway, a real S3
server writing to the local disk), both on 127.0.0.1:
- end to end: a synchronous save() of an --s3-mib state (async_save=False: snapshot, shard streamed up in parts
  as it is written, manifest, parts check, commit marker; max_to_keep=None, so no retention read-back) vs
  boto3's upload_file (TransferManager defaults) of a file holding the same bytes, rounds interleaved;
- S3Storage.upload_file (a finished file: parallel multipart, per-part CRC32C, what signed steps still use)
  vs boto3's upload_file of the same file.
"""

from __future__ import annotations

import os

# One BLAS thread: on this 2-core machine the stand-in training step gets one core and the background writer
# the other, as on a GPU node where compute runs on the device and the host has spare cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import pathlib
import shutil
import signal
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from bench.format import as_fast
from SneppX_ALG import _native, coordinator, storage
from tests import s3_servers

MiB = 1 << 20


def make_state(total: int) -> dict[str, np.ndarray]:
    """16 float32 tensors, the last ones large, like a model's embeddings and layers."""
    rng = np.random.default_rng(0)
    sizes = [total // 32] * 8 + [3 * total // 32] * 8
    return {f"layer{i:02d}.w": rng.standard_normal(s // 4, dtype=np.float32) for i, s in enumerate(sizes)}


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Step:
    """A stand-in training step: compute plus an in-place update of part of the state."""

    def __init__(self, state: dict[str, np.ndarray]):
        rng = np.random.default_rng(1)
        self.a = rng.standard_normal((384, 384), dtype=np.float32)
        self.target = next(iter(state.values()))[: 4 * MiB]

    def __call__(self) -> None:
        x = self.a
        for _ in range(3):
            x = np.tanh(x @ self.a)
        self.target *= np.float32(0.999)


def step_times(step: Step, until: Any, minimum: int) -> list[float]:
    times: list[float] = []
    while len(times) < minimum or not until():
        times.append(timed(step))
    return times


def bench_size(total_mib: int, root: str) -> dict[str, float]:
    total = total_mib * MiB
    state = make_state(total)
    warm = {k: np.empty_like(v) for k, v in state.items()}
    for k in state:
        np.copyto(warm[k], state[k])
    copy_s = min(timed(lambda: [np.copyto(warm[k], v) for k, v in state.items()]) for _ in range(3))
    warm.clear()
    out: dict[str, float] = {"copy": copy_s}

    # async save, staging >= state: first save (cold pool) and steady state
    shutil.rmtree(root, ignore_errors=True)
    coord = coordinator.CheckpointCoordinator(root, max_to_keep=1, staging_bytes=total + 64 * MiB, device="cpu")
    rss0 = status_kib("VmRSS")
    reset_peak()
    out["save_first"] = timed(lambda: coord.save(state, step=1))
    coord.wait()
    out["peak_first"] = (status_kib("VmHWM") - rss0) * 1024 / total
    blocking = []
    for step in (2, 3, 4):
        blocking.append(timed(lambda step=step: coord.save(state, step=step)))
        coord.wait()
    out["save"] = min(blocking)

    # training steps without and with a save in flight
    train = Step(state)
    step_times(train, lambda: True, 5)
    alone = step_times(train, lambda: True, 15)
    reset_peak()
    rss1 = status_kib("VmRSS")
    coord.save(state, step=5)
    during = step_times(train, lambda: not coord.saving, 3)
    coord.wait()
    out["peak_steady"] = (status_kib("VmHWM") - rss1) * 1024 / total
    alone += step_times(train, lambda: True, 15)  # before and after, so drift in machine load evens out
    out["step_alone"] = statistics.median(alone)
    out["step_during"] = statistics.median(during)
    out["steps_during"] = len(during)
    coord.close()

    # bounded staging: a quarter of the state
    shutil.rmtree(root, ignore_errors=True)
    bounded = coordinator.CheckpointCoordinator(root, max_to_keep=1, staging_bytes=total // 4, device="cpu")
    bounded.save(state, step=1)
    bounded.wait()
    rss2 = status_kib("VmRSS")
    reset_peak()
    out["save_bounded"] = timed(lambda: bounded.save(state, step=2))
    bounded.wait()
    out["peak_bounded"] = (status_kib("VmHWM") - rss2) * 1024 / total
    bounded.close()

    # synchronous save through the commit
    shutil.rmtree(root, ignore_errors=True)
    sync = coordinator.CheckpointCoordinator(root, max_to_keep=1, async_save=False, staging_bytes=total + 64 * MiB,
                                             device="cpu")
    sync.save(state, step=1)
    out["save_sync"] = timed(lambda: sync.save(state, step=2))
    sync.close()
    shutil.rmtree(root, ignore_errors=True)

    # copy-on-write alternative: fork, then one pass of writes over the state while the child holds it
    def write_pass() -> None:
        for v in state.values():
            v += np.float32(0)

    out["write_pass"] = min(timed(write_pass) for _ in range(2))
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    out["fork"] = time.perf_counter() - start
    out["write_pass_cow"] = timed(write_pass)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return out


def bench_s3(size_mib: int, workdir: str, rounds: int) -> dict[str, dict[str, float] | str]:
    """GB/s per server kind ({"save": ..., "boto3_state": ..., "ours": ..., "boto3": ...}), or why that
    server was not measured."""
    path = os.path.join(workdir, "shard.bin")
    with open(path, "wb") as f:
        f.writelines(os.urandom(MiB) for _ in range(size_mib))
    state = make_state(size_mib * MiB)
    state_path = os.path.join(workdir, "state.bin")
    with open(state_path, "wb") as f:
        f.writelines(memoryview(v).cast("B") for v in state.values())
    os.environ.update(s3_servers.ENV)  # the dummy credentials both servers accept
    results: dict[str, dict[str, float] | str] = {}
    for kind in s3_servers.KINDS:
        server_dir = tempfile.mkdtemp(prefix=f"{kind}-", dir=workdir)
        try:
            server = s3_servers.start(kind, pathlib.Path(server_dir))
        except s3_servers.S3ServerError as e:
            results[kind] = str(e).splitlines()[0]
            continue
        try:
            client = server.client()
            client.create_bucket(Bucket="bench")
            results[kind] = {**save_rates(client, state, state_path, size_mib, rounds),
                             **upload_rates(client, path, size_mib)}
        finally:
            s3_servers.stop(server)
            shutil.rmtree(server_dir, ignore_errors=True)
    os.unlink(path)
    os.unlink(state_path)
    return results


def save_rates(client: Any, state: dict[str, np.ndarray], path: str, size_mib: int, rounds: int,
               ) -> dict[str, float]:
    """GB/s of a synchronous save() of `state` to S3, end to end, and of boto3's upload_file of the same bytes,
    the best of `rounds` interleaved rounds."""
    import boto3.s3.transfer

    coord = coordinator.CheckpointCoordinator("s3://bench/saves", s3_client=client, async_save=False,
                                              max_to_keep=None, staging_bytes=size_mib * MiB + 64 * MiB,
                                              device="cpu")
    coord.save(state, step=0)  # staging buffers allocated, part buffers made
    times: dict[str, list[float]] = {"save": [], "boto3_state": []}
    for i in range(rounds):
        times["save"].append(timed(lambda i=i: coord.save(state, step=i + 1)))
        times["boto3_state"].append(timed(lambda i=i: client.upload_file(
            path, "bench", f"boto3-state/{i}", Config=boto3.s3.transfer.TransferConfig())))
    coord.close()
    return {name: size_mib * MiB / min(t) / 1e9 for name, t in times.items()}


def upload_rates(client: Any, path: str, size_mib: int) -> dict[str, float]:
    import boto3.s3.transfer

    ours = storage.S3Storage("s3://bench/ours", client=client)
    results: dict[str, float] = {}
    for name, fn in (
        ("boto3", lambda i: client.upload_file(path, "bench", f"boto3/{i}",
                                               Config=boto3.s3.transfer.TransferConfig())),
        ("ours", lambda i: ours.upload_file(path, f"ours/{i}")),
    ):
        times = []
        for i in range(2):
            times.append(timed(lambda fn=fn, i=i: fn(i)))
            client.delete_object(Bucket="bench", Key=f"{name}/{i}")
        results[name] = size_mib * MiB / min(times) / 1e9
    return results


def bench_d2h(size_mib: int) -> dict[str, float] | None:
    if not _native.cuda_available():
        return None
    size = size_mib * MiB
    device_ptr = _native.cuda_malloc(0, size)
    try:
        copier = _native.Copier(0)
        staging = copier.alloc(size)
        view = copier.view(staging, size)
        copier.copy(view, device_ptr, size, kind=_native.COPY_D2H, crc=None)
        bare = min(timed(lambda: copier.copy(view, device_ptr, size, kind=_native.COPY_D2H, crc=None))
                   for _ in range(5))
        with_crc = min(timed(lambda: copier.copy(view, device_ptr, size, kind=_native.COPY_D2H)) for _ in range(5))
        return {"bare": size / bare / 1e9, "crc": size / with_crc / 1e9}
    finally:
        _native.cuda_free(0, device_ptr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench async_save")
    parser.add_argument("--sizes", default="256,1024", help="state sizes in MiB")
    parser.add_argument("--big", action="store_true", help="also 4096 MiB")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--s3-mib", type=int, default=256)
    parser.add_argument("--s3-rounds", type=int, default=3, help="interleaved S3 rounds; the fastest counts")
    parser.add_argument("--s3-only", action="store_true", help="only the S3 tables")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")] + ([4096] if args.big else [])
    base = args.dir or tempfile.mkdtemp(prefix="sneppx-bench-")
    os.makedirs(base, exist_ok=True)
    root = os.path.join(base, "ckpts")
    print("| state | copy | save() | save()/copy | sync save | sync/save() | save(), staging 1/4 | "
          "fork | write pass under COW / alone | step during save / alone | peak mem / state "
          "(first, steady, 1/4 staging) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for mib in [] if args.s3_only else sizes:
            r = bench_size(mib, root)
            print(f"| {mib} MiB | {r['copy'] * 1e3:.0f} ms | {r['save'] * 1e3:.0f} ms | "
                  f"{r['save'] / r['copy']:.2f}x | {r['save_sync'] * 1e3:.0f} ms | {r['save_sync'] / r['save']:.1f}x | "
                  f"{r['save_bounded'] * 1e3:.0f} ms | {r['fork'] * 1e3:.1f} ms | "
                  f"{r['write_pass_cow'] * 1e3:.0f} / {r['write_pass'] * 1e3:.0f} ms "
                  f"({r['write_pass_cow'] / r['write_pass']:.1f}x) | "
                  f"{r['step_during'] * 1e3:.1f} / {r['step_alone'] * 1e3:.1f} ms "
                  f"({r['step_during'] / r['step_alone']:.2f}x, {int(r['steps_during'])} steps) | "
                  f"{r['peak_first']:.2f}, {r['peak_steady']:.2f}, {r['peak_bounded']:.2f} |", flush=True)
        s3 = bench_s3(args.s3_mib, base, args.s3_rounds)
        print(f"\n| S3, {args.s3_mib} MiB on 127.0.0.1 (load {os.getloadavg()[0]:.1f}) | sync save(), end to end | "
              "boto3 upload_file, same bytes | save vs upload_file | S3Storage.upload_file | boto3 upload_file | "
              "ratio |")
        print("|---|---|---|---|---|---|---|")
        for kind, r in s3.items():
            if isinstance(r, str):
                print(f"| {kind} | not measured: {r} | | | | | |")
            else:
                print(f"| {kind} | {r['save']:.2f} GB/s | {r['boto3_state']:.2f} GB/s | "
                      f"{as_fast(r['save'] / r['boto3_state'])} | {r['ours']:.2f} GB/s | "
                      f"{r['boto3']:.2f} GB/s | {as_fast(r['ours'] / r['boto3'])} |", flush=True)
        d2h = bench_d2h(1024)
        if d2h is None:
            print("\nD2H copy engine: no GPU on this machine (run on a GPU machine for the pinned D2H figures)")
        else:
            print(f"\nD2H 1 GiB: copy engine with CRC {d2h['crc']:.1f} GB/s vs bare pinned cudaMemcpyAsync loop "
                  f"{d2h['bare']:.1f} GB/s ({d2h['crc'] / d2h['bare']:.2f}x)")
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
