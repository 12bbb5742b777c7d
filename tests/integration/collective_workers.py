"""Bodies of the rank processes that tests/integration/test_collectives.py starts (a module of its own so each
spawned process imports only this, numpy and SneppX, not pytest and the tests)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for directory_store: also when run as a script

from directory_store import DirectoryStore

from SneppX_ALG import _native, collectives, errors
from SneppX_ALG.contract.env import ENV_HOST_KEY

KEY = b"collectives-test-job-key-32bytes"
NUMPY_OPS = {"sum": np.sum, "max": np.max, "min": np.min}


def connect(store_dir: str, rank: int, world: int, generation: int = 1, timeout: float = 120,
            backend: str = "tcp", **kwargs: Any) -> collectives.ProcessGroup:
    """The ring unless asked otherwise: most of these tests are about it (its handshake, what its sockets tell)."""
    return collectives.ProcessGroup(DirectoryStore(store_dir), rank, world, generation, key=KEY,
                                    timeout=timeout, backend=backend, **kwargs)


def rank_input(count: int, dtype: str, round_: int, rank: int) -> np.ndarray:
    """What `rank` contributes in `round_`; any rank can make any other rank's, to compute the answer itself."""
    rng = np.random.default_rng([round_, rank])
    if dtype.startswith("int"):
        return rng.integers(-10**6, 10**6, count).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


def battery(store_dir: str, rank: int, world: int, rounds: int, results: Any, backend: str = "tcp",
            host_key: str = "", address: str = "127.0.0.1") -> None:
    """Every collective against numpy: the fixed sizes 0, 1, odd, world +- 1 and large, then `rounds` rounds of
    random sizes, dtypes and ops (the same draws on every rank). Puts (rank, [failure, ...])."""
    failures: list[str] = []
    os.environ[ENV_HOST_KEY] = host_key  # ranks with different keys are on different "hosts"
    try:
        group = connect(store_dir, rank, world, chunk_bytes=1 << 16, backend=backend, host=address)
        if host_key and type(group._comm).__name__ != "_Hierarchical":
            failures.append(f"rank {rank}: not the hierarchical path but {type(group._comm).__name__}")
        draw = np.random.default_rng(7)
        fixed = [0, 1, 1001, world + 1, max(world - 1, 0), (1 << 20) + 3]
        for round_ in range(len(fixed) + rounds):
            count = fixed[round_] if round_ < len(fixed) else int(draw.integers(0, 50_000))
            dtype = ("float32", "float64", "int32", "int64")[round_ % 4]
            op = ("sum", "max", "min")[int(draw.integers(0, 3))]
            everyone = np.stack([rank_input(count, dtype, round_, r) for r in range(world)])
            reduced = NUMPY_OPS[op](everyone, axis=0)
            start, stop = group.shard_range(count)
            from_owners = np.zeros(count, dtype)  # rank r's shard of rank r's input, for each r
            for r in range(world):
                lo, hi = _native.shard_range(count, world, r)
                from_owners[lo:hi] = everyone[r][lo:hi]
            gathered = np.zeros(count, dtype)
            gathered[start:stop] = from_owners[start:stop]
            root = round_ % world
            outcomes = [
                ("allreduce", group.allreduce(everyone[rank].copy(), op), reduced),
                ("reduce_scatter", group.reduce_scatter(everyone[rank].copy(), op), reduced[start:stop]),
                ("allgather", group.allgather(gathered), from_owners),
                ("broadcast", group.broadcast(everyone[rank].copy(), root), everyone[root]),
            ]
            exact = dtype.startswith("int") or op != "sum"  # float sums: another order, another rounding
            for what, got, want in outcomes:
                if not (np.array_equal(got, want) if exact else np.allclose(got, want, rtol=1e-5, atol=1e-5)):
                    failures.append(f"round {round_}: {what} of {count} {dtype} ({op}) differs from numpy")
            group.barrier()
        group.close()
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        failures.append(traceback.format_exc())
    results.put((rank, failures))


def collective_forever(store_dir: str, rank: int, world: int, op_timeout: float, results: Any,
                       backend: str = "tcp", op: str = "allreduce", host_key: str = "") -> None:
    """Connects, reports ("ready", rank), then runs `op` on 4 MiB until a collective fails; reports
    ("failed", rank, error class name, blamed peer)."""
    os.environ[ENV_HOST_KEY] = host_key
    group = connect(store_dir, rank, world, timeout=op_timeout, backend=backend)
    data = np.ones(1 << 20, np.float32)
    calls = {"allreduce": group.allreduce, "reduce_scatter": group.reduce_scatter, "allgather": group.allgather,
             "broadcast": group.broadcast, "barrier": lambda _: group.barrier()}
    group.barrier()
    results.put(("ready", rank))
    try:
        while True:
            calls[op](data)
            data.fill(1.0)
    except errors.CollectiveError as e:
        results.put(("failed", rank, type(e).__name__, e.peer))
        time.sleep(600)  # alive until the test ends (the fixture kills it): the others learn from the group


def abort_while_peer_is_away(store_dir: str, rank: int, peer_may_go: Any, results: Any,
                             backend: str = "tcp") -> None:
    """Rank 0 enters an allreduce with a 10-minute deadline while rank 1 waits elsewhere; a thread of rank 0
    aborts it. Rank 1 then enters the same allreduce and must learn at once that its peer is gone."""
    group = connect(store_dir, rank, 2, timeout=600, backend=backend)
    group.barrier()
    data = np.ones(1000, np.float64)
    if rank == 0:
        import threading

        threading.Timer(0.5, group.abort).start()
        started = time.monotonic()
    else:
        peer_may_go.wait(300)
        started = time.monotonic()
    try:
        group.allreduce(data)
        results.put((rank, "no error", 0.0))
    except errors.CollectiveError as e:
        results.put((rank, type(e).__name__, time.monotonic() - started, e.peer))


class RefusingStore(DirectoryStore):
    """A DirectoryStore whose set() of a key containing `refuse` fails, as a store that went away would, keeping
    the values it refused (what a test could not learn otherwise: a shared-memory segment's nonce)."""

    def __init__(self, root: str, refuse: str):
        super().__init__(root)
        self.refuse, self.refused = refuse, []

    def set(self, key: str, value: bytes) -> None:
        if self.refuse and self.refuse in key:
            self.refused.append(value.decode())
            raise errors.StoreError(f"the store refuses {key!r}")
        super().set(key, value)


def set_up_once(store_dir: str, rank: int, world: int, results: Any, backend: str = "shm", timeout: float = 60,
                host_key: str = "", refuse: str = "") -> None:
    """Sets up a group (over a RefusingStore) and reports (rank, "ok", backend, refused) or (rank, error class
    name, blamed peer, refused), then closes it and returns."""
    os.environ[ENV_HOST_KEY] = host_key
    store = RefusingStore(store_dir, refuse)
    try:
        group = collectives.ProcessGroup(store, rank, world, 1, key=KEY, timeout=timeout, backend=backend)
    except errors.SneppXError as e:
        results.put((rank, type(e).__name__, getattr(e, "peer", None), store.refused))
        return
    results.put((rank, "ok", group.backend, store.refused))
    group.close()


SEGMENT_REFUSED_BYTES = 1 << 20  # a file-size limit under any segment (2 x ranks x slot): its creation gets EFBIG


def set_up_refused(store_dir: str, rank: int, world: int, results: Any, backend: str, host_key: str,
                   refused: bool) -> None:
    """Sets up a group (refused: this rank may make no file over 1 MiB, so a segment it creates fails with EFBIG,
    as on a /dev/shm it may not use) and allreduces [rank + 1] * 4 on it. Reports (rank, "ok", backend, sums)
    or (rank, error class name, blamed peer, message)."""
    import resource

    os.environ[ENV_HOST_KEY] = host_key
    if refused:
        resource.setrlimit(resource.RLIMIT_FSIZE, (SEGMENT_REFUSED_BYTES, SEGMENT_REFUSED_BYTES))
    try:
        with connect(store_dir, rank, world, timeout=60, backend=backend) as group:
            data = np.full(4, rank + 1.0)
            group.allreduce(data)
            results.put((rank, "ok", group.backend, data.tolist()))
    except Exception as e:  # noqa: BLE001 - reported to the test, which judges its kind
        results.put((rank, type(e).__name__, getattr(e, "peer", None), str(e)))


def allreduce_once(store_dir: str, rank: int, world: int, results: Any) -> None:
    """Connects, allreduces [rank + 1] * 8, reports (rank, result, refused-connection counts)."""
    try:
        group = connect(store_dir, rank, world)
        data = np.full(8, rank + 1.0)
        group.allreduce(data)
        results.put((rank, data.tolist(), dict(group.refused)))
        group.close()
    except Exception:  # noqa: BLE001
        results.put((rank, traceback.format_exc(), {}))


# ---- data-parallel training (tests/integration/test_data_parallel.py) ------------------------------------------

TINY_MODEL = {"vocab_size": 64, "dim": 32, "num_heads": 2, "num_layers": 2, "ffn_dim": 64, "max_seq_len": 16}
TINY_DATA = {"vocab_size": 64, "seq_len": 16, "num_sequences": 256, "seed": 1}
TRAINING = {"batch_size": 12, "seed": 5, "lr": 3e-3, "warmup_steps": 5}


def train_data_parallel(store_dir: str, rank: int, world: int, steps: int, bucket_bytes: int, results: Any) -> None:
    """Trains the tiny model for `steps` steps on `world` ranks; reports (rank, losses, params, pieces with their
    moments, data position) or (rank, traceback)."""
    from SneppX_ALG.model import data, data_parallel, transformer

    try:
        group = connect(store_dir, rank, world)
        model = transformer.Transformer(**TINY_MODEL, seed=3)
        trainer = data_parallel.DataParallelTrainer(model, data.SyntheticLanguage(**TINY_DATA), group,
                                                    bucket_bytes=bucket_bytes, **TRAINING)
        losses = trainer.train(steps)
        pieces = [(p.name, p.start, p.stop, trainer.optimizer.m[p.name].copy(), trainer.optimizer.v[p.name].copy())
                  for p in trainer.pieces]
        position = {k: v.copy() for k, v in trainer.stream.state_dict().items()}
        results.put((rank, losses, {k: v.copy() for k, v in model.params.items()}, pieces, position))
        group.close()
    except Exception:  # noqa: BLE001
        results.put((rank, traceback.format_exc()))


# ---- sharded checkpoints (tests/integration/test_sharded_checkpoint.py) --------------------------------------

# Large enough that each rank's piece of a moment spans several 4 KiB checksum blocks, small enough to train fast.
SHARDED_MODEL = {"vocab_size": 256, "dim": 64, "num_heads": 4, "num_layers": 2, "ffn_dim": 128, "max_seq_len": 16}
SHARDED_DATA = {"vocab_size": 256, "seq_len": 16, "num_sequences": 256, "seed": 2}
SHARDED_BUCKET_BYTES = 128 << 10  # buckets span tensors; a rank's piece of one spans up to 8 checksum blocks
SHARDED_BLOCK_BYTES = 4096


def rchar() -> int:
    """Bytes this process has read through read()/pread() so far (/proc/self/io), counted by the kernel."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def sharded_run(store_dir: str, root: str, rank: int, world: int, results: Any, *, restore: bool,
                train_steps: int, save_step: int | None = None, generation: int = 1,
                fault: dict[int, str] | None = None, save_again: int | None = None, count_gets: bool = False,
                coordinator_kwargs: dict[str, Any] | None = None) -> None:
    """One rank of a data-parallel job with a sharded checkpoint: (restore at this world size,) train, (save).
    Training and the checkpoint each get a ProcessGroup of their own (the coordinator's runs in its writer
    thread). Reports (rank, report) or (rank, traceback).

    fault: {rank: "SITE:N:ACTION"} arms the native fault hook of that rank just before the save: the N-th I/O at
    SITE kills the process (ACTION "kill", a real SIGKILL) or fails with an errno ("EIO"). save_again: after the
    save, save once more at this step. count_gets: count the bytes S3 GETs return during the restore (their
    Content-Length, through botocore's event hook: the server's count, not SneppX's)."""
    import dataclasses as dataclasses_lib

    from SneppX_ALG import CheckpointCoordinator, storage
    from SneppX_ALG.model import data, data_parallel, transformer

    def error_of(e: errors.SneppXError) -> tuple[str, str, Any]:
        return type(e).__name__, str(e), getattr(e, "failures", None)

    try:
        group = connect(os.path.join(store_dir, "train"), rank, world, generation)
        ckpt_group = connect(os.path.join(store_dir, "ckpt"), rank, world, generation)
        model = transformer.Transformer(**SHARDED_MODEL, seed=11 if restore else 3)
        trainer = data_parallel.DataParallelTrainer(model, data.SyntheticLanguage(**SHARDED_DATA), group,
                                                    bucket_bytes=SHARDED_BUCKET_BYTES, **TRAINING)
        kwargs = {"max_to_keep": None, "checksum_block_bytes": SHARDED_BLOCK_BYTES, **(coordinator_kwargs or {})}
        got = {"bytes": 0}
        if count_gets:
            client = storage.make_s3_client()
            client.meta.events.register(  # the Content-Length of every GET body the server sends
                "after-call.s3.GetObject",
                lambda parsed, **_: got.__setitem__("bytes", got["bytes"] + int(parsed.get("ContentLength", 0))))
            kwargs["s3_client"] = client
        coord = CheckpointCoordinator(root, group=ckpt_group, **kwargs)
        report: dict[str, Any] = {}
        if restore:
            before = rchar()
            info = coord.restore(trainer)
            report.update(rchar=rchar() - before, s3_get_bytes=got["bytes"],
                          restored=None if info is None else info.step, step_after_restore=trainer.step,
                          read=None if info is None or info.read is None else dataclasses_lib.asdict(info.read),
                          skipped=[(s.step, list(s.problems)) for s in coord.skipped])
        report["losses"] = trainer.train(train_steps)
        if save_step is not None:
            if fault is not None and rank in fault:
                site, countdown, action = fault[rank].split(":")
                _native.fault_arm(site, int(countdown), action)
            try:
                coord.save(trainer, step=save_step)
                coord.wait()
                report["saved"] = save_step
            except errors.SneppXError as e:
                report["save_error"] = error_of(e)
        if save_again is not None:
            coord.save(trainer, step=save_again)
            coord.wait()
            report["saved_again"] = save_again
        coord.close()
        results.put((rank, report))
        group.close()
        ckpt_group.close()
    except Exception:  # noqa: BLE001
        results.put((rank, traceback.format_exc()))


class _FileReport:
    """A results queue for a rank started outside multiprocessing (in a network namespace): put() writes JSON."""

    def __init__(self, path: str):
        self.path = path

    def put(self, value: Any) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump(value, f)
        os.replace(self.path + ".tmp", self.path)


if __name__ == "__main__":  # python collective_workers.py REPORT STORE RANK WORLD HOST_KEY ADDRESS: a battery
    report, store_dir, rank_arg, world_arg, host_key_arg, address_arg = sys.argv[1:7]
    battery(store_dir, int(rank_arg), int(world_arg), 4, _FileReport(report), "auto", host_key_arg, address_arg)
