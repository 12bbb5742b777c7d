"""Collectives: allreduce bus bandwidth of the TCP ring and of shared memory against MPICH and memcpy; data-parallel
scaling 1 -> 2 ranks.

    python -m bench comm                          # 2 ranks; 64 KiB .. 64 MiB; DP scaling on the recipe-1 model
    python -m bench comm -- --world 4 --iterations 20 --sizes 1048576 16777216

Allreduce: each rank process allreduces a float32 array in place; an iteration is timed between a barrier and the
allreduce's return on every rank, and its time is the slowest rank's; the figure is the median over iterations.
Bus bandwidth is size x 2(N-1)/N / time (the nccl-tests convention: the bytes each rank must send, so the
figure is comparable across world sizes). Against it, in the same run:
- MPICH's MPI_Allreduce (mpi4py + the `mpich` wheel, launched with its mpiexec.gforker), the same sizes and
  timing, as the MPI a user would pick instead, twice: as it runs by default on one machine (shared memory between
  the ranks), and over the same transport as the ring (MPIR_CVAR_NOLOCAL=1: libfabric's tcp provider, pinned to
  `lo`), which is what it does between machines;
- gloo (torch.distributed's CPU backend, what a PyTorch user has at hand): `dist.all_reduce` on a tensor sharing the
  array's memory, one torch thread per rank, over TCP on `lo` (gloo has no shared-memory transport). torch is not a
  dependency of SneppX (the wheel and its CUDA libraries are about 5 GB): the bench uses the interpreter named by
  $SNEPPX_BENCH_TORCH_PYTHON, else this one if it has torch, else prints that gloo was not measured;
- memcpy (numpy copyto of the same size): the physical ceiling of moving those bytes once in memory on this host.

Peer death: 2 ranks allreduce 1 MiB without end; the bench SIGKILLs rank 1 and times rank 0's PeerLostError from the
moment before the signal (p50 / p99 over --kills kills, each backend): the ring learns it from the kernel closing the
dead process' sockets, shared memory from the dead process' pidfd.

Two hosts (`--hosts 2`, root): two network namespaces joined by a veth pair, 2 ranks in each, every byte between
them over the veth: SneppX's default there (shared memory in a host, a TCP ring per local index between hosts),
SneppX's flat TCP ring over the veth, MPICH over TCP on the veth (each rank's interface its namespace's end), and
gloo on the veth.

Data-parallel scaling: DataParallelTrainer steps of the recipe-1 model (global batch 16 x 64 tokens) on 1 and on 2
rank processes, each with one BLAS thread so that the ranks, not BLAS, are what scales. Speedup = step time at 1
rank / step time at 2 ranks; the ideal is 2 on two idle cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from bench import common
from SneppX_ALG.contract.env import ENV_HOST_KEY

KEY = b"bench-comm-job-key-0123456789abc"
DEFAULT_SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]
RECIPE = {"vocab_size": 1000, "dim": 128, "num_heads": 4, "num_layers": 2, "ffn_dim": 512, "max_seq_len": 64}
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# MPICH on one host talks through shared memory; any network endpoint it opens stays on the loopback interface.
MPICH_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo", "UCX_NET_DEVICES": "lo"}
ENV_TORCH_PYTHON = "SNEPPX_BENCH_TORCH_PYTHON"
GLOO_MISSING = f"not measured (no torch here: pip install torch, or ${ENV_TORCH_PYTHON}=a python that has it)"
GLOO_PORT = 29517  # inside a namespace this bench created: nothing else listens there


def time_allreduces(group: Any, sizes: list[int], iterations: int) -> dict[int, list[float]]:
    """Each iteration's allreduce of a float32 array of each size, timed from a barrier to its return."""
    times: dict[int, list[float]] = {}
    for size in sizes:
        data = np.ones(size // 4, np.float32)
        group.allreduce(data)  # warm: pages touched, connections' buffers grown
        times[size] = []
        for _ in range(iterations):
            group.barrier()
            started = time.perf_counter()
            group.allreduce(data)
            times[size].append(time.perf_counter() - started)
    return times


def ring_rank(store_dir: str, rank: int, world: int, sizes: list[int], iterations: int, backend: str,
              results: Any) -> None:
    from SneppX_ALG import collectives
    from tests.directory_store import DirectoryStore

    group = collectives.ProcessGroup(DirectoryStore(store_dir), rank, world, key=KEY, timeout=300,
                                     backend=backend)
    results.put((rank, time_allreduces(group, sizes, iterations)))
    group.close()


def doomed_rank(store_dir: str, rank: int, world: int, backend: str, results: Any) -> None:
    """Allreduces without end until a collective fails; reports ("ready", rank, pid) first, then ("failed", rank,
    time.time() at the failure, the error's class name)."""
    from SneppX_ALG import collectives, errors
    from tests.directory_store import DirectoryStore

    group = collectives.ProcessGroup(DirectoryStore(store_dir), rank, world, key=KEY, timeout=300,
                                     backend=backend)
    data = np.ones(1 << 18, np.float32)
    group.barrier()
    results.put(("ready", rank, os.getpid()))
    try:
        while True:
            group.allreduce(data)
    except errors.CollectiveError as e:
        results.put(("failed", rank, time.time(), type(e).__name__))


def time_to_peer_lost(backend: str, kills: int) -> list[float]:
    """Seconds from just before a SIGKILL of rank 1 to rank 0's PeerLostError, once per kill."""
    context = multiprocessing.get_context("spawn")
    seconds = []
    for _ in range(kills):
        results = context.Queue()
        store_dir = tempfile.mkdtemp(prefix="bench-comm-kill-")
        processes = [context.Process(target=doomed_rank, args=(store_dir, r, 2, backend, results)) for r in range(2)]
        for p in processes:
            p.start()
        pids = {r: pid for _, r, pid in (results.get(timeout=300) for _ in range(2))}
        time.sleep(0.05)  # well into the allreduces
        sent_at = time.time()
        os.kill(pids[1], signal.SIGKILL)
        _, _, failed_at, kind = results.get(timeout=300)
        if kind != "PeerLostError":
            raise RuntimeError(f"{backend}: rank 0 failed with {kind}, not PeerLostError")
        seconds.append(failed_at - sent_at)
        for p in processes:
            p.join(60)
        shutil.rmtree(store_dir, ignore_errors=True)
    return seconds


def torch_python() -> str | None:
    """An interpreter with torch, for the gloo anchor: $SNEPPX_BENCH_TORCH_PYTHON, else this one if it has torch."""
    named = os.environ.get(ENV_TORCH_PYTHON)
    if named:
        return named
    return sys.executable if importlib.util.find_spec("torch") is not None else None


def gloo_rank(report: str, rank: int, world: int, master: str, sizes: list[int], iterations: int) -> None:
    """One gloo rank (run by torch_python(), which need not have SneppX): the allreduce loop; its times as JSON."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world)

    class Gloo:
        def allreduce(self, data: np.ndarray) -> None:
            dist.all_reduce(torch.from_numpy(data))  # the array's own memory, as SneppX's calls use it

        def barrier(self) -> None:
            dist.barrier()

    times = time_allreduces(Gloo(), sizes, iterations)
    with open(report, "w") as f:
        json.dump({"transport": f"gloo (torch {torch.__version__})", "times": times}, f)
    dist.destroy_process_group()


def run_gloo(world: int, sizes: list[int], iterations: int,
             places: list[tuple[list[str], str, str]] | None = None) -> tuple[str, list[dict[int, list[float]]]] | None:
    """`world` gloo ranks; places[r] = (command prefix, master address, interface) for ranks in namespaces, else
    every rank on 127.0.0.1 over `lo`. None when no interpreter has torch."""
    python = torch_python()
    if python is None:
        return None
    if places is None:
        with socket.socket() as probe:  # a free port on loopback for rank 0's rendezvous
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        places = [([], f"127.0.0.1:{port}", "lo")] * world
    workdir = tempfile.mkdtemp(prefix="bench-comm-gloo-")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        processes = []
        for rank, (prefix, master, interface) in enumerate(places):
            env = {**os.environ, **ONE_THREAD, "GLOO_SOCKET_IFNAME": interface, "PYTHONPATH": repo}
            processes.append(subprocess.Popen(
                [*prefix, python, "-m", "bench.comm", "--gloo-rank", os.path.join(workdir, f"{rank}.json"),
                 str(rank), str(world), master, "--iterations", str(iterations), "--sizes", *map(str, sizes)],
                env=env, cwd=repo))
        for p in processes:
            if p.wait(timeout=1800) != 0:
                raise RuntimeError("a gloo rank failed")
        reports = []
        for rank in range(world):
            with open(os.path.join(workdir, f"{rank}.json")) as f:
                reports.append(json.load(f))
        return reports[0]["transport"], [{int(k): v for k, v in r["times"].items()} for r in reports]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def netns_rank(report: str, store_dir: str, rank: int, world: int, backend: str, host_key: str, address: str,
               sizes: list[int], iterations: int) -> None:
    """One rank inside a network namespace (started by `ip netns exec`): the allreduce loop; its times as JSON."""
    from SneppX_ALG import collectives
    from tests.directory_store import DirectoryStore

    os.environ[ENV_HOST_KEY] = host_key
    group = collectives.ProcessGroup(DirectoryStore(store_dir), rank, world, key=KEY, timeout=300,
                                     backend=backend, host=address)  # type: ignore[arg-type]
    times = time_allreduces(group, sizes, iterations)
    with open(report, "w") as f:
        json.dump({"transport": type(group._comm).__name__, "times": times}, f)
    group.close()


class TwoHosts:
    """Two network namespaces joined by a veth pair (10.78.0.1 and .2: addresses inside namespaces this bench
    creates, nothing leaves the machine); removed on exit."""

    def __init__(self) -> None:
        tag = f"sxb{os.getpid() % 10000}"
        self.hosts = [(f"{tag}a", "10.78.0.1", f"{tag}va"), (f"{tag}b", "10.78.0.2", f"{tag}vb")]
        commands = [["ip", "netns", "add", self.hosts[0][0]], ["ip", "netns", "add", self.hosts[1][0]],
                    ["ip", "link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb"]]
        for namespace, address, link in self.hosts:
            commands += [["ip", "link", "set", link, "netns", namespace],
                         ["ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", link],
                         ["ip", "-n", namespace, "link", "set", link, "up"],
                         ["ip", "-n", namespace, "link", "set", "lo", "up"]]
        for command in commands:
            subprocess.run(command, check=True, capture_output=True, timeout=60)

    def close(self) -> None:
        for namespace, _, _ in self.hosts:
            subprocess.run(["ip", "netns", "delete", namespace], check=False, capture_output=True, timeout=60)

    def run_sneppx(self, backend: str, sizes: list[int], iterations: int) -> tuple[str, list[dict[int, list[float]]]]:
        workdir = tempfile.mkdtemp(prefix="bench-comm-hosts-")
        try:
            processes = []
            for rank in range(4):
                namespace, address, _ = self.hosts[rank // 2]
                processes.append(subprocess.Popen(
                    ["ip", "netns", "exec", namespace, sys.executable, "-m", "bench.comm", "--netns-rank",
                     os.path.join(workdir, f"{rank}.json"), os.path.join(workdir, "store"), str(rank), "4",
                     backend, namespace, address, "--iterations", str(iterations), "--sizes", *map(str, sizes)],
                    env={**os.environ, **ONE_THREAD}))
            for p in processes:
                if p.wait(timeout=1800) != 0:
                    raise RuntimeError(f"a rank in a namespace failed ({backend})")
            reports = []
            for r in range(4):
                with open(os.path.join(workdir, f"{r}.json")) as f:
                    reports.append(json.load(f))
            return reports[0]["transport"], [{int(k): v for k, v in r["times"].items()} for r in reports]
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def run_mpich(self, sizes: list[int], iterations: int) -> list[dict[int, list[float]]] | None:
        """mpiexec.gforker starts 4 copies of a wrapper that moves each rank into its namespace (PMI's
        descriptors are inherited) with MPICH's TCP netmod on that namespace's end of the veth."""
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec.gforker")
        if not os.path.exists(mpiexec):
            return None
        workdir = tempfile.mkdtemp(prefix="bench-comm-hosts-mpi-")
        wrapper = os.path.join(workdir, "rank.sh")
        with open(wrapper, "w") as f:
            f.write("#!/bin/sh\nhost=$((PMI_RANK / 2))\n"
                    f"if [ $host = 0 ]; then ns={self.hosts[0][0]}; link={self.hosts[0][2]}; "
                    f"else ns={self.hosts[1][0]}; link={self.hosts[1][2]}; fi\n"
                    "exec ip netns exec $ns env FI_TCP_IFACE=$link \"$@\"\n")
        os.chmod(wrapper, 0o755)
        env = {**os.environ, **MPICH_ENV, **ONE_THREAD, "MPIR_CVAR_NOLOCAL": "1"}
        env.pop("FI_TCP_IFACE", None)
        try:
            done = subprocess.run([mpiexec, "-n", "4", wrapper, sys.executable, "-m", "bench.comm", "--mpi-rank",
                                   "--iterations", str(iterations), "--sizes", *map(str, sizes)],
                                  capture_output=True, text=True, env=env, timeout=1800, check=True)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        report = json.loads(done.stdout.strip().splitlines()[-1])
        return [{int(size): times for size, times in rank.items()} for rank in report["times"]]


def measure_two_hosts(sizes: list[int], iterations: int) -> None:
    hosts = TwoHosts()
    try:
        hierarchical, shm_times = hosts.run_sneppx("auto", sizes, iterations)
        _, ring_times = hosts.run_sneppx("tcp", sizes, iterations)
        mpich = hosts.run_mpich(sizes, iterations)
        gloo = run_gloo(4, sizes, iterations, [(["ip", "netns", "exec", hosts.hosts[r // 2][0]],
                                                f"{hosts.hosts[0][1]}:{GLOO_PORT}", hosts.hosts[r // 2][2])
                                               for r in range(4)])
    finally:
        hosts.close()
    factor = 2 * 3 / 4
    print(f"\nTwo hosts (network namespaces joined by a veth pair) x 2 ranks; SneppX default: {hierarchical}")
    print(f"gloo: {gloo[0] if gloo else GLOO_MISSING}")
    print("| size | SneppX default (shared memory + ring per local index) | SneppX flat ring | MPICH over TCP | gloo "
          "| default / MPICH | default / gloo | default / flat ring |")
    print("|---|---|---|---|---|---|---|---|")
    for size in sizes:
        ours, flat = (size * factor / slowest_rank_median(t, size) for t in (shm_times, ring_times))
        theirs = size * factor / slowest_rank_median(mpich, size) if mpich else float("nan")
        torch_s = size * factor / slowest_rank_median(gloo[1], size) if gloo else float("nan")
        print(f"| {size >> 10} KiB | {ours / 1e9:.2f} GB/s | {flat / 1e9:.2f} GB/s | {theirs / 1e9:.2f} GB/s | "
              f"{torch_s / 1e9:.2f} GB/s | {ours / theirs:.2f}x | {ours / torch_s:.2f}x | {ours / flat:.2f}x |",
              flush=True)


def mpi_rank(sizes: list[int], iterations: int) -> None:
    """Runs under mpiexec: the same loop with MPI_Allreduce; rank 0 prints every rank's times as JSON."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    times: dict[int, list[float]] = {}
    for size in sizes:
        data = np.ones(size // 4, np.float32)
        comm.Allreduce(MPI.IN_PLACE, data, op=MPI.SUM)
        times[size] = []
        for _ in range(iterations):
            comm.Barrier()
            started = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, data, op=MPI.SUM)
            times[size].append(time.perf_counter() - started)
    everyone = comm.gather(times, root=0)
    if comm.rank == 0:
        print(json.dumps({"library": MPI.Get_library_version().splitlines()[0], "times": everyone}))


def slowest_rank_median(per_rank: list[dict[int, list[float]]], size: int) -> float:
    return statistics.median(max(rank[size][i] for rank in per_rank) for i in range(len(per_rank[0][size])))


def spawn_ranks(world: int, target: Any, *args: Any) -> list[Any]:
    """Runs target(store_dir, rank, world, *args, results) on `world` spawned processes; returns their reports."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    store_dir = tempfile.mkdtemp(prefix="bench-comm-")
    saved = {k: os.environ.get(k) for k in ONE_THREAD}
    os.environ.update(ONE_THREAD)  # inherited by the spawned ranks
    try:
        processes = [context.Process(target=target, args=(store_dir, rank, world, *args, results))
                     for rank in range(world)]
        for p in processes:
            p.start()
        reports = dict(results.get(timeout=1800) for _ in range(world))
        for p in processes:
            p.join()
        return [reports[rank] for rank in range(world)]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(store_dir, ignore_errors=True)


def run_mpich(world: int, sizes: list[int], iterations: int,
              over_tcp: bool) -> tuple[str, list[dict[int, list[float]]]] | None:
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec.gforker")
    if not os.path.exists(mpiexec):
        return None
    command = [mpiexec, "-n", str(world), sys.executable, "-m", "bench.comm", "--mpi-rank",
               "--iterations", str(iterations), "--sizes", *map(str, sizes)]
    env = {**os.environ, **MPICH_ENV, **ONE_THREAD, **({"MPIR_CVAR_NOLOCAL": "1"} if over_tcp else {})}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    per_rank = [{int(size): times for size, times in rank.items()} for rank in report["times"]]
    return report["library"], per_rank


def memcpy_seconds(size: int, iterations: int) -> float:
    source, target = np.ones(size, np.uint8), np.empty(size, np.uint8)
    np.copyto(target, source)
    times = []
    for _ in range(iterations):
        started = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def dp_rank(store_dir: str, rank: int, world: int, steps: int, results: Any) -> None:
    from SneppX_ALG import collectives
    from SneppX_ALG.model import data, data_parallel, transformer
    from tests.directory_store import DirectoryStore

    group = collectives.ProcessGroup(DirectoryStore(store_dir), rank, world, key=KEY, timeout=300)
    model = transformer.Transformer(**RECIPE, seed=0)
    language = data.SyntheticLanguage(vocab_size=RECIPE["vocab_size"], seq_len=64, num_sequences=512)
    trainer = data_parallel.DataParallelTrainer(model, language, group, batch_size=16)
    trainer.train(2)  # warm-up: workspaces, connections
    times = []
    for _ in range(steps):
        group.barrier()
        times.append(trainer.train_step().seconds)
    results.put((rank, times))
    group.close()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench comm")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="bytes")
    parser.add_argument("--dp-steps", type=int, default=10)
    parser.add_argument("--kills", type=int, default=20, help="peer SIGKILLs timed per backend")
    parser.add_argument("--hosts", type=int, choices=[1, 2], default=1,
                        help="2: only the two-host measurement (network namespaces and a veth pair; needs root)")
    parser.add_argument("--mpi-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--netns-rank", nargs=7, help=argparse.SUPPRESS)
    parser.add_argument("--gloo-rank", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mpi_rank:
        mpi_rank(args.sizes, args.iterations)
        return
    if args.gloo_rank:
        report, rank, world, master = args.gloo_rank
        gloo_rank(report, int(rank), int(world), master, args.sizes, args.iterations)
        return
    if args.netns_rank:
        report, store_dir, rank, world, backend, host_key, address = args.netns_rank
        netns_rank(report, store_dir, int(rank), int(world), backend, host_key, address, args.sizes, args.iterations)
        return
    if args.hosts == 2:
        print(f"machine: {common.cpu_model()}, {os.cpu_count()} CPUs; median of {args.iterations} iterations")
        measure_two_hosts(args.sizes, args.iterations)
        return

    world = args.world
    print(f"machine: {common.cpu_model()}, {os.cpu_count()} CPUs; {world} ranks on 127.0.0.1; "
          f"median of {args.iterations} iterations (slowest rank of each)")
    ring = spawn_ranks(world, ring_rank, args.sizes, args.iterations, "tcp")
    shared = spawn_ranks(world, ring_rank, args.sizes, args.iterations, "shm")
    mpich_shm = run_mpich(world, args.sizes, args.iterations, over_tcp=False)
    mpich_tcp = run_mpich(world, args.sizes, args.iterations, over_tcp=True)
    gloo = run_gloo(world, args.sizes, args.iterations)
    print(f"MPICH: {mpich_shm[0] if mpich_shm else 'not installed (pip install mpi4py mpich)'}")
    print(f"gloo: {gloo[0] if gloo else GLOO_MISSING}\n")
    factor = 2 * (world - 1) / world

    def busbw(per_rank: list[dict[int, list[float]]] | None, size: int) -> float:
        return size * factor / slowest_rank_median(per_rank, size) if per_rank else float("nan")

    print("| size | SneppX ring (TCP) | SneppX shared memory | MPICH over TCP | MPICH shared memory | gloo (TCP) "
          "| memcpy | ring / MPICH TCP | shared / MPICH shared | shared / gloo | shared / memcpy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        ours, ours_shm = busbw(ring, size), busbw(shared, size)
        tcp = busbw(mpich_tcp[1] if mpich_tcp else None, size)
        shm = busbw(mpich_shm[1] if mpich_shm else None, size)
        torch_s = busbw(gloo[1] if gloo else None, size)
        copy = size / memcpy_seconds(size, args.iterations)
        print(f"| {size >> 10} KiB | {ours / 1e9:.2f} GB/s | {ours_shm / 1e9:.2f} GB/s | {tcp / 1e9:.2f} GB/s | "
              f"{shm / 1e9:.2f} GB/s | {torch_s / 1e9:.2f} GB/s | {copy / 1e9:.2f} GB/s | {ours / tcp:.2f}x | "
              f"{ours_shm / shm:.2f}x | {ours_shm / torch_s:.2f}x | {ours_shm / copy:.2f} |", flush=True)

    print(f"\nPeer SIGKILLed mid-allreduce (2 ranks, 1 MiB): time to the survivor's PeerLostError, {args.kills} kills")
    print("| transport | p50 | p99 | max |")
    print("|---|---|---|---|")
    for backend, name in (("tcp", "SneppX ring (TCP)"), ("shm", "SneppX shared memory")):
        lost = sorted(time_to_peer_lost(backend, args.kills))
        p99 = lost[min(len(lost) - 1, int(0.99 * len(lost)))]
        print(f"| {name} | {1e3 * statistics.median(lost):.1f} ms | {1e3 * p99:.1f} ms | {1e3 * lost[-1]:.1f} ms |",
              flush=True)

    step_times = {}
    for ranks in (1, 2):
        reports = spawn_ranks(ranks, dp_rank, args.dp_steps)
        step_times[ranks] = statistics.median(max(r[i] for r in reports) for i in range(args.dp_steps))
    tokens = 16 * 64
    print(f"\nData-parallel, recipe-1 model, global batch 16 x 64, one BLAS thread per rank, median of "
          f"{args.dp_steps} steps:")
    print("| ranks | step ms | tokens/s | speedup |")
    print("|---|---|---|---|")
    for ranks, seconds in step_times.items():
        print(f"| {ranks} | {seconds * 1e3:7.1f} | {tokens / seconds:9,.0f} | {step_times[1] / seconds:4.2f}x |")


if __name__ == "__main__":
    main(sys.argv[1:])
