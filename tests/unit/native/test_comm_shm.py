"""The shared-memory collectives of native/src/shm.c through their wrapper (`_native.ShmComm`), with the ranks as
threads of this process (cffi releases the GIL, so they really run at once), each with its own mapping of one
segment. Real processes, real SIGKILL and SIGSTOP are in tests/integration/test_collectives.py."""

from __future__ import annotations

import errno
import os
import secrets
import threading
import time
from typing import Any

import numpy as np
import pytest
from ranks_on_threads import NUMPY_OPS, inputs, run_ranks

from SneppX_ALG import _native, errors
from SneppX_ALG.contract.env import ENV_HOST_KEY

TOLERANCE = {"float32": 1e-5, "float64": 1e-12, "int32": 0, "int64": 0}  # sums in another order; integers exact


def make_group(world: int, generation: int = 3, slot_bytes: int = 4096) -> list[_native.ShmComm]:
    name = f"/sneppx-test-{secrets.token_hex(8)}"
    comms = [_native.ShmComm(name, rank, world, generation, create=rank == 0, slot_bytes=slot_bytes)
             for rank in range(world)]
    run_ranks(comms, lambda rank, comm: comm.wait_attached(30))
    return comms


def each(comms: list[_native.ShmComm], method: str, data: list[np.ndarray], *args: Any) -> list[np.ndarray]:
    """comms[r].method(copy of data[r], *args) on every rank at once; returns the copies."""
    copies = [x.copy() for x in data]
    results = run_ranks(comms, lambda r, c: getattr(c, method)(copies[r], *args))
    assert all(result is None for result in results), results
    return copies


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("count", [0, 1, 7, 1_000_003])
def test_every_collective_matches_numpy_for_every_dtype_and_op(world: int, count: int) -> None:
    comms = make_group(world, slot_bytes=1 << 16 if count > 1000 else 256)  # many chunks, each slot set reused
    for dtype in ("float32", "float64", "int32", "int64"):
        data = inputs(world, count, dtype, seed=count + world)
        for op in ("sum", "max", "min"):
            want = NUMPY_OPS[op](np.stack(data), axis=0)
            got = each(comms, "allreduce", data, count, dtype, op, 30)
            for x in got:
                np.testing.assert_allclose(x, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
            assert all(np.array_equal(x, got[0]) for x in got)  # the same bits on every rank
            for rank, x in enumerate(each(comms, "reduce_scatter", data, count, dtype, op, 30)):
                lo, hi = _native.shard_range(count, world, rank)
                np.testing.assert_allclose(x[lo:hi], want[lo:hi], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
        owners = np.concatenate([data[r][slice(*_native.shard_range(count, world, r))] for r in range(world)])
        own_shards = [np.where(np.isin(np.arange(count), np.arange(*_native.shard_range(count, world, r))),
                               data[r], 0).astype(dtype) for r in range(world)]
        assert all(np.array_equal(x, owners) for x in each(comms, "allgather", own_shards, count, dtype, 30))
        root = count % world
        assert all(np.array_equal(x, data[root]) for x in each(comms, "broadcast", data, root, 30))
    assert run_ranks(comms, lambda r, c: c.barrier(30)) == [None] * world
    for c in comms:
        c.close()


def test_ranks_in_different_calls_fail_the_group_naming_the_odd_one() -> None:
    comms = make_group(3)
    results = run_ranks(comms, lambda r, c: c.allreduce(np.ones(8), 8, "float64", "sum", 30) if r != 1 else
                        c.allreduce(np.ones(9), 9, "float64", "sum", 30))
    assert all(isinstance(e, errors.CommProtocolError) for e in results), results
    assert {e.peer for e in results} <= {0, 1, 2} and any(e.peer == 1 for e in results)
    assert all(isinstance(e, errors.CollectiveAbortedError) for e in run_ranks(comms, lambda r, c: c.barrier(30)))
    for c in comms:
        c.close()


def test_an_abort_ends_the_running_call_and_every_peer_learns_who_left() -> None:
    comms = make_group(3)
    timer = threading.Timer(0.3, comms[2].abort)  # rank 2 never calls: the others wait on it until the abort
    timer.start()
    results = run_ranks(comms[:2], lambda r, c: c.allreduce(np.ones(8), 8, "float64", "sum", 600))
    timer.join()
    assert all(isinstance(e, errors.PeerLostError) and e.peer == 2 for e in results), results
    with pytest.raises(errors.CollectiveAbortedError):
        comms[2].barrier(30)
    for c in comms:
        c.close()


def test_a_rank_that_never_comes_ends_the_call_at_its_deadline() -> None:
    comms = make_group(2)
    began = time.monotonic()
    with pytest.raises(errors.CollectiveTimeoutError) as waited:
        comms[0].barrier(0.2)
    assert time.monotonic() - began < 60 and waited.value.peer == 1  # the one it waited for
    with pytest.raises(errors.CollectiveTimeoutError) as told:  # the group is spent, for the other rank too
        comms[1].barrier(30)
    assert told.value.peer == 1
    with pytest.raises(errors.CollectiveAbortedError):
        comms[1].barrier(30)
    for c in comms:
        c.close()


def test_a_segment_of_another_generation_or_shape_is_refused() -> None:
    name = f"/sneppx-test-{secrets.token_hex(8)}"
    first = _native.ShmComm(name, 0, 2, 5, create=True, slot_bytes=4096)
    with pytest.raises(errors.StaleGenerationError):
        _native.ShmComm(name, 1, 2, 4, create=False, slot_bytes=4096)
    with pytest.raises(errors.CommProtocolError):
        _native.ShmComm(name, 1, 2, 5, create=False, slot_bytes=8192)
    with pytest.raises(errors.SneppXError):  # taken: O_EXCL
        _native.ShmComm(name, 0, 2, 5, create=True, slot_bytes=4096)
    second = _native.ShmComm(name, 1, 2, 5, create=False, slot_bytes=4096)
    assert run_ranks([first, second], lambda r, c: c.wait_attached(30)) == [None, None]
    with pytest.raises(errors.SneppXError):  # unlinked once both mapped it: nobody else can attach
        _native.ShmComm(name, 1, 2, 5, create=False, slot_bytes=4096)
    first.close()
    second.close()


def test_a_shm_group_with_a_rank_on_another_host_is_refused_by_every_rank(tmp_path: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from directory_store import DirectoryStore

    from SneppX_ALG import collectives

    # ranks as threads: each "runs" on the host its thread is named after
    monkeypatch.setattr(collectives.group, "host_identity", lambda: threading.current_thread().name.split("-")[0])

    def join(rank: int) -> Any:
        threading.current_thread().name = ("here", "there")[rank] + "-rank"
        return collectives.ProcessGroup(DirectoryStore(tmp_path), rank, 2, 1, backend="shm",
                                        key=b"k" * 32, timeout=30)

    results = run_ranks([None, None], lambda rank, _: join(rank))
    assert all(isinstance(e, errors.CommProtocolError) and "rank(s) 1 are not on rank 0's" in str(e)
               for e in results), results


def test_a_host_key_keeps_ranks_of_one_machine_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    from SneppX_ALG import collectives

    here = collectives.host_identity()
    monkeypatch.setenv(ENV_HOST_KEY, "numa-1")
    assert collectives.host_identity() != here and collectives.host_identity().startswith(here)


def test_a_shm_group_is_a_process_group_like_any_other(tmp_path: Any) -> None:
    from directory_store import DirectoryStore

    from SneppX_ALG import collectives

    def train(rank: int) -> list[float]:
        with collectives.ProcessGroup(DirectoryStore(tmp_path), rank, 3, 2, backend="shm", key=b"k" * 32,
                                      timeout=30) as group:
            data = np.full(5, rank + 1.0)
            group.allreduce(data)
            with pytest.raises(ValueError, match="tcp group"):
                group.shift(data, data)
            return data.tolist()

    assert run_ranks([None] * 3, lambda rank, _: train(rank)) == [[6.0] * 5] * 3


# What creating the segment raises on a /dev/shm that is full (posix_fallocate), not writable, read-only, or when
# the mapping fails (_native's raise_for of SX_ENOSPC, SX_EPERM, SX_EIO, SX_ENOMEM).
CREATE_FAILURES = {
    "no room": errors.DiskFullError("no space left on device (No space left on device)"),
    "EACCES": errors.StorageError("permission denied (Permission denied)", errno=errno.EACCES),
    "EROFS": errors.StorageError("I/O error (Read-only file system)", errno=errno.EROFS),
    "mmap": MemoryError("out of memory"),
}


@pytest.mark.parametrize("failure", sorted(CREATE_FAILURES))
@pytest.mark.parametrize("backend", ["auto", "shm"])
def test_a_dev_shm_without_room_means_the_ring_or_a_clear_error(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                                 backend: str, failure: str) -> None:
    """Any failure to create the segment is published: "auto" goes on over the ring, "shm" fails on every rank
    with rank 0's reason. (Only a full /dev/shm was: otherwise rank 0 raised and rank 1 waited out its deadline.)"""
    from directory_store import DirectoryStore

    from SneppX_ALG import collectives

    real = _native.ShmComm

    def small_dev_shm(name: str, rank: int, world: int, generation: int, *, create: bool, slot_bytes: int) -> Any:
        if create:
            raise CREATE_FAILURES[failure]
        return real(name, rank, world, generation, create=create, slot_bytes=slot_bytes)

    monkeypatch.setattr(_native, "ShmComm", small_dev_shm)

    def join(rank: int) -> Any:
        with collectives.ProcessGroup(DirectoryStore(tmp_path), rank, 2, 1, backend=backend, key=b"k" * 32,
                                      timeout=30) as group:
            data = np.full(2, rank + 1.0)
            group.allreduce(data)
            return group.backend, data.tolist()

    results = run_ranks([None, None], lambda rank, _: join(rank))
    if backend == "auto":
        assert results == [("tcp", [3.0, 3.0])] * 2
    else:
        reason = str(CREATE_FAILURES[failure])
        assert all(isinstance(e, errors.CommProtocolError) and reason in str(e) for e in results), results


@pytest.mark.parametrize("refused", [(0,), (1,), (0, 1)])
@pytest.mark.parametrize("failure", sorted(CREATE_FAILURES))
@pytest.mark.parametrize("backend", ["auto", "shm"])
def test_a_host_whose_segment_cant_be_made_means_one_path_for_every_rank_of_every_host(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, backend: str, failure: str, refused: tuple[int, ...]) -> None:
    """2 "hosts" x 2 ranks (threads named after their host), the segment of the `refused` hosts failing as
    CREATE_FAILURES says: "auto" goes on over the ring on all 4 ranks, "shm" fails on all 4 with the first
    refused host's reason, naming its creator. (Before, the creator raised the StorageError itself, and the
    ranks of the other host waited out their deadline in the ring between hosts.)"""
    from directory_store import DirectoryStore

    from SneppX_ALG import collectives

    monkeypatch.setattr(collectives.group, "host_identity", lambda: threading.current_thread().name.split("-")[0])
    real = _native.ShmComm

    def refusing(name: str, rank: int, world: int, generation: int, *, create: bool, slot_bytes: int) -> Any:
        if create and int(threading.current_thread().name[4]) in refused:
            raise CREATE_FAILURES[failure]
        return real(name, rank, world, generation, create=create, slot_bytes=slot_bytes)

    monkeypatch.setattr(_native, "ShmComm", refusing)

    def join(rank: int) -> Any:
        threading.current_thread().name = f"host{rank // 2}-rank"
        with collectives.ProcessGroup(DirectoryStore(tmp_path), rank, 4, 1, backend=backend, key=b"k" * 32,
                                      timeout=30) as group:
            data = np.full(2, rank + 1.0)
            group.allreduce(data)
            return group.backend, data.tolist()

    results = run_ranks([None] * 4, lambda rank, _: join(rank))
    if backend == "auto":
        assert results == [("tcp", [10.0, 10.0])] * 4
    else:
        reason = str(CREATE_FAILURES[failure])
        assert all(isinstance(e, errors.CommProtocolError) and reason in str(e) and e.peer == 2 * refused[0]
                   for e in results), results
        assert len({str(e) for e in results}) == 1, results


@pytest.mark.parametrize("backend", ["auto", "shm"])
@pytest.mark.parametrize("chunk_bytes", [8, 32, 63])
def test_a_chunk_too_small_for_a_shared_memory_slot_is_refused_before_setup(tmp_path: Any, backend: str,
                                                                           chunk_bytes: int) -> None:
    """Every rank refuses it before it touches the store (rank 0 used to fail creating the segment, and the
    others waited out the deadline); "tcp" still takes frames from 8 bytes."""
    from directory_store import DirectoryStore

    from SneppX_ALG import collectives

    for rank in range(2):
        with pytest.raises(ValueError, match="chunk_bytes >= 64"):
            collectives.ProcessGroup(DirectoryStore(tmp_path), rank, 2, 1, backend=backend, key=b"k" * 32,
                                     timeout=5, chunk_bytes=chunk_bytes)
    assert os.listdir(tmp_path) == []


def test_rank_0_failing_in_setup_fails_the_others_at_once(tmp_path: Any) -> None:
    """Rank 0 of 3 waits for rank 2, which never comes, and is aborted: it publishes its failure, so rank 1
    (deadline 10 minutes, past this test's wait) fails at once with rank 0's reason instead of waiting it out."""
    from directory_store import DirectoryStore

    from SneppX_ALG import collectives

    aborted = threading.Event()

    def abort_rank_0_in_setup() -> None:
        DirectoryStore(tmp_path).get(collectives.shm_key(1, "host/0"), timeout=60)  # it waits for the others
        aborted.set()

    threading.Thread(target=abort_rank_0_in_setup, daemon=True).start()

    def join(rank: int) -> Any:
        return collectives.ProcessGroup(DirectoryStore(tmp_path), rank, 3, 1, backend="shm", key=b"k" * 32,
                                        timeout=600, aborted=aborted if rank == 0 else None)

    results = run_ranks([None, None], lambda rank, _: join(rank))
    assert isinstance(results[0], errors.CollectiveAbortedError), results
    assert isinstance(results[1], errors.CommProtocolError) and "CollectiveAbortedError" in str(results[1]), results
    assert results[1].peer == 0


def test_a_rank_whose_setup_ends_before_it_opened_the_published_segment_unlinks_it(tmp_path: Any) -> None:
    """Issue 37 defect 8 as the recovery chaos harness found it (kill_creator): rank 0 created and published the
    segment and was SIGKILLed; rank 1, aborted (its agent saw rank 0 die) before it read the outcome, never
    opened the name, and it stayed in /dev/shm after every process exited. A wait for the outcome that fails
    unlinks the segment published by then."""
    import json

    from directory_store import DirectoryStore

    from SneppX_ALG import collectives

    key, nonce, aborted = b"k" * 32, secrets.token_bytes(16), threading.Event()
    name = collectives.shm_name(key, 1, nonce)
    creator = _native.ShmComm(name, 0, 2, 1, create=True, slot_bytes=4096)  # never closed: as if SIGKILLed
    store = DirectoryStore(tmp_path)
    store.set(collectives.shm_key(1, "segment"), json.dumps({"nonce": nonce.hex()}).encode())

    class AbortedOnceItJoins:  # rank 1's agent aborts it right after it says where it runs
        def set(self, k: str, value: bytes) -> None:
            store.set(k, value)
            aborted.set()

        def get(self, k: str, timeout: float) -> bytes:
            return store.get(k, timeout)

    try:
        with pytest.raises(errors.CollectiveAbortedError):
            collectives.ProcessGroup(AbortedOnceItJoins(), 1, 2, 1, backend="shm", key=key, timeout=60,
                                     aborted=aborted)
        assert not os.path.exists("/dev/shm" + name), "the published segment leaked"
    finally:
        creator.close()


@pytest.mark.parametrize("dtype", ["uint8", "float32", "float64"])
def test_a_hierarchical_allgather_keeps_every_bit(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """2 "hosts" x 2 ranks (threads named after their host): allgather sums bytes as integers, so -0.0, NaN
    payloads and bytes come through exactly."""
    from directory_store import DirectoryStore

    from SneppX_ALG import collectives

    monkeypatch.setattr(collectives.group, "host_identity", lambda: threading.current_thread().name.split("-")[0])
    count = 1003
    values = np.frombuffer(np.random.default_rng(3).bytes(count * np.dtype(dtype).itemsize), dtype).copy()
    if dtype != "uint8":
        values[:3] = np.array([-0.0, np.nan, -np.inf], dtype)

    def gather(rank: int) -> bytes:
        threading.current_thread().name = f"host{rank // 2}-rank"
        with collectives.ProcessGroup(DirectoryStore(tmp_path), rank, 4, 1, key=b"k" * 32, timeout=30) as g:
            assert type(g._comm).__name__ == "_Hierarchical"
            mine = np.zeros(count, dtype)
            lo, hi = g.shard_range(count)
            mine[lo:hi] = values[lo:hi]
            return g.allgather(mine).tobytes()

    assert run_ranks([None] * 4, lambda rank, _: gather(rank)) == [values.tobytes()] * 4


@pytest.mark.parametrize("kind", [errors.PeerLostError, errors.CollectiveTimeoutError, errors.StaleGenerationError,
                                  errors.CommProtocolError])
@pytest.mark.parametrize("outer", [None, 0, 9])
def test_a_relayed_failure_reaches_every_rank_of_the_segment_with_the_outer_blame(
        kind: type[errors.CollectiveError], outer: int | None) -> None:
    """As over the ring (test_comm_ring.py): rank 0 relays, between calls, a failure of an enclosing group; ranks
    1 and 2, in a barrier, raise the same kind and report the same outer rank, not rank 0."""
    comms = make_group(3)

    def body(rank: int, comm: _native.ShmComm) -> Any:
        if rank == 0:
            return comm.relay(kind("elsewhere", rank=0, generation=3), outer)
        comm.barrier(60)
        return None

    results = run_ranks(comms, body)
    assert results[0] is True
    assert all(isinstance(e, kind) and e.peer is None for e in results[1:]), results
    assert [c.failed_outer() for c in comms] == [outer] * 3
    for comm in comms:
        comm.close()
