"""`ProcessGroup`: the ranks of one membership generation, and the collectives they run together.

It picks the backend, the same on every rank (the TCP ring, shared memory, shared memory per host with rings
between hosts, or NCCL; where shared memory is tried, from every host's published outcome of making its segment), connects it through `ring.py` or `shm.py`, and runs the collectives on the native
communicator, staging host arrays through device memory for NCCL. One concept: the group as callers see it.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections import Counter
from typing import Any, Literal, Self

import numpy as np

from SneppX_ALG import _native, errors, job_key
from SneppX_ALG.collectives import store as store_lib
from SneppX_ALG.collectives.arrays import (
    array_dtype,
    device_pointer,
    dtype_name,
    element_count,
    host_array,
    reduce_dtype,
)
from SneppX_ALG.collectives.ring import (
    MAX_PENDING_HANDSHAKES,
    SETUP_POLL,
    Identity,
    address_key,
    check_setup_aborted,
    connect_ring,
)
from SneppX_ALG.collectives.shm import host_identity, shm_key, shm_name, unlink_segment

DEFAULT_TIMEOUT = 300.0
SHM_MIN_SLOT = 64  # native/src/shm.c: a slot is a whole number of cache lines
MIN_SUB_CALL_TIMEOUT = 1e-3  # what a hierarchical call's sub-call gets once its deadline has passed

Backend = Literal["auto", "tcp", "shm", "nccl"]


def nccl_id_key(generation: int) -> str:
    return store_lib.generation_key(generation, "comm/nccl-unique-id")


class ProcessGroup:
    """The ranks of one membership generation and the collectives they run together.

    Every rank of the generation constructs one with the same `store`, `world_size` and `generation` and its own
    `rank`; the constructor returns when the group is connected (or raises CollectiveTimeoutError at `timeout`).
    Collectives work in place on C-contiguous numpy arrays and take a `timeout` (default: the group's); every
    rank must call the same collectives in the same order. A failure raises a CollectiveError subclass on every
    surviving rank (PeerLostError, CollectiveTimeoutError, CollectiveAbortedError, StaleGenerationError,
    CommProtocolError) and leaves the group unusable: the next generation builds a new one.

    backend="auto" (CPU: "shm" when every rank is on one host, else "tcp"; every rank alike, from the published setup outcomes), "tcp" (CPU,
    the TCP ring, any machines), "shm" (CPU, every rank on one host: shared memory, native/src/shm.c) or "nccl"
    (GPU `device`; arrays are staged through device memory, and objects with __cuda_array_interface__ are used in
    place). The CPU backends need the job key when world_size > 1. `backend` then says the one in use. `abort()`
    may be called from any thread.

    name: several groups of one generation over one store (training's, and an async checkpoint coordinator's,
    whose writer thread runs collectives beside training) each take a name: their keys live apart
    (`store.Namespace`), so no second store is needed.

    aborted: an Event another thread may set while the constructor still connects (there is no group yet to
    call abort() on): setup then raises CollectiveAbortedError, as a collective that abort() ends does. The
    tcp backend sees it within SETUP_POLL seconds at any step of setup; nccl while rank > 0 waits for rank 0's
    id, not inside NCCL's own initialisation.
    """

    def __init__(self, store: store_lib.Store, rank: int, world_size: int, generation: int = 0, *,
                 backend: Backend = "auto", key: bytes | str | None = None, host: str = "127.0.0.1",
                 timeout: float = DEFAULT_TIMEOUT, chunk_bytes: int = 1 << 20, device: int = 0,
                 aborted: threading.Event | None = None, name: str = ""):
        for what, value, low in (("world_size", world_size, 1), ("generation", generation, 0),
                                 ("rank", rank, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{what} must be an int >= {low}, got {value!r}")
        if rank >= world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if not timeout > 0 or timeout == float("inf"):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        if backend not in ("auto", "tcp", "shm", "nccl"):
            raise ValueError(f"backend must be 'auto', 'tcp', 'shm' or 'nccl', got {backend!r}")
        if not 8 <= chunk_bytes <= 1 << 30:
            raise ValueError(f"chunk_bytes must be in 8..2^30, got {chunk_bytes}")
        if backend in ("auto", "shm") and chunk_bytes < SHM_MIN_SLOT:  # every rank says so before setup begins
            raise ValueError(f"backend {backend!r} needs chunk_bytes >= {SHM_MIN_SLOT} (a shared-memory slot is a "
                             f"multiple of {SHM_MIN_SLOT} bytes), got {chunk_bytes}")
        if name:
            store = store_lib.Namespace(store, f"group/{name}")  # ValueError for a name no key may hold
        self.rank, self.world_size, self.generation, self.name = rank, world_size, generation, name
        self.backend: Backend = backend
        self.timeout = timeout
        self.refused: Counter[str] = Counter()  # connections turned away during setup, by reason
        self._staging: dict[str, Any] = {}  # nccl: device buffer for host arrays
        self.device = device
        deadline = time.monotonic() + timeout
        check_setup_aborted(aborted, rank, generation)
        if backend == "nccl":
            self._comm: Any = self._connect_nccl(store, device, deadline, aborted)
            return
        if world_size == 1:  # no peers: nothing to connect or authenticate
            self.backend = "tcp" if backend == "auto" else backend
            self._comm = _native.Comm(0, 1, generation, chunk_bytes=chunk_bytes & ~7)
            return
        # The job's one key, as the heartbeat reads it: key=, else $SNEPPX_HEARTBEAT_KEY_FILE, else the hex variable.
        mac_key = job_key.load_key(key, os.environ)
        segment = self._open_segment(store, backend, mac_key, chunk_bytes & ~63, deadline, aborted) \
            if backend != "tcp" else None
        if isinstance(segment, list):  # several hosts, as many ranks on each: shared memory in each, or the ring
            hierarchical = self._connect_hierarchical(store, segment, backend, mac_key, host, chunk_bytes, deadline,
                                                      aborted)
            if hierarchical is not None:
                self.backend = "shm"
                self._comm = hierarchical
                return
            segment = None  # "auto", and a host's segment can't be made: the ring, on every rank
        if segment is not None:
            self.backend = "shm"
            self._comm = self._attach(segment, deadline, aborted)
        else:
            self.backend = "tcp"
            self._comm = self._connect_tcp(store, mac_key, host, chunk_bytes & ~7, deadline, aborted)

    def _connect_tcp(self, store: store_lib.Store, key: bytes, host: str, chunk_bytes: int,
                     deadline: float, aborted: threading.Event | None) -> _native.Comm:
        me = Identity(key, self.generation, self.rank, self.world_size, chunk_bytes)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind((host, 0))
            listener.listen(MAX_PENDING_HANDSHAKES)
            bound_host, port = listener.getsockname()[:2]
            store.set(address_key(self.generation, self.rank), json.dumps({"host": bound_host, "port": port}).encode())
            send_sock, recv_sock = connect_ring(listener, store, me, deadline, self.refused, aborted)
        return _native.Comm(self.rank, self.world_size, self.generation, send_sock.detach(), recv_sock.detach(),
                            chunk_bytes)

    def _open_segment(self, store: store_lib.Store, backend: Backend, key: bytes, slot_bytes: int, deadline: float,
                      aborted: threading.Event | None) -> _native.ShmComm | list[list[int]] | None:
        """Shared memory or the ring ("auto"), shared memory or an error ("shm"): every rank publishes where it runs
        (`host_identity`); rank 0 reads them all, creates the segment if they are one host, and publishes the
        outcome (its nonce); the others read it and open the segment (2N store operations, not N^2). Returns this
        rank's end of the segment, None for the ring, or the ranks of each host when there are several hosts with
        as many ranks (at least 2) on each: shared memory inside each, a ring between (`_Hierarchical`)."""
        g, rank = self.generation, self.rank
        store.set(shm_key(g, f"host/{rank}"), json.dumps({"host": host_identity()}).encode())
        if rank != 0:
            outcome = json.loads(self._poll_published(store, shm_key(g, "segment"), key, deadline, aborted,
                                                      "transport from rank 0", 0))
            if "error" in outcome:
                raise errors.CommProtocolError(outcome["error"], rank=rank, generation=g, peer=0)
            if "hosts" in outcome:
                return [[int(r) for r in ranks] for ranks in outcome["hosts"]]
            if "nonce" not in outcome:
                return None
            return self._open_published(shm_name(key, g, bytes.fromhex(outcome["nonce"])), rank, self.world_size,
                                        slot_bytes, 0)
        try:
            comm, outcome = self._decide_segment(store, backend, key, slot_bytes, deadline, aborted)
        except BaseException as e:
            # The others wait for this outcome: a failure here is one too, or they would wait out the deadline.
            self._publish_failure(store, shm_key(g, "segment"), f"rank 0 failed setting up: {e!r}")
            raise
        try:
            store.set(shm_key(g, "segment"), json.dumps(outcome).encode())
        except BaseException:
            if isinstance(comm, _native.ShmComm):
                comm.close()
            raise
        if "error" in outcome:
            raise errors.CommProtocolError(outcome["error"], rank=rank, generation=g, peer=0)
        return comm

    def _decide_segment(self, store: store_lib.Store, backend: Backend, key: bytes, slot_bytes: int,
                        deadline: float, aborted: threading.Event | None,
                        ) -> tuple[_native.ShmComm | list[list[int]] | None, dict[str, Any]]:
        """Rank 0's part of `_open_segment`: what this rank holds (the segment, the hosts' ranks or None for the
        ring) and the outcome to publish for the others. A segment that can't be created (/dev/shm full,
        read-only, not writable) is the ring for "auto" and a reason for "shm"."""
        g = self.generation
        hosts = [json.loads(self._poll_store(store, shm_key(g, f"host/{r}"), deadline, aborted,
                                             f"host of rank {r}", r))["host"] for r in range(self.world_size)]
        elsewhere = ", ".join(str(r) for r, host in enumerate(hosts) if host != hosts[0])
        by_host: dict[str, list[int]] = {}
        for r, host in enumerate(hosts):
            by_host.setdefault(host, []).append(r)
        groups = list(by_host.values())
        if elsewhere and len({len(ranks) for ranks in groups}) == 1 and len(groups[0]) > 1:
            return groups, {"hosts": groups}
        if elsewhere:
            return None, {"ring": f"rank(s) {elsewhere} on other hosts"} if backend == "auto" else \
                {"error": "backend 'shm' needs every rank on one host (one boot, /dev/shm and PID namespace): "
                          f"rank(s) {elsewhere} are not on rank 0's"}
        return self._create_segment(backend, key, self.world_size, slot_bytes, "the segment")

    def _create_segment(self, backend: Backend, key: bytes, world: int, slot_bytes: int, what: str,
                        ) -> tuple[_native.ShmComm | None, dict[str, Any]]:
        """A new segment for `world` ranks and its outcome to publish (its nonce), or None and why it can't be
        made (/dev/shm full, read-only, not writable, over a file-size limit, a failed mapping): the ring for
        "auto", an error for "shm". The one rule of the single-host and the hierarchical paths."""
        nonce = secrets.token_bytes(16)
        try:
            comm = _native.ShmComm(shm_name(key, self.generation, nonce), 0, world, self.generation, create=True,
                                   slot_bytes=slot_bytes)
        except (errors.StorageError, MemoryError) as e:  # ENOSPC (a container's 64 MiB), EACCES, EROFS, EFBIG, mmap
            why = f"/dev/shm has no room for {what}: {e}" if isinstance(e, errors.DiskFullError) else \
                f"can't create {what} in /dev/shm: {e}"
            return None, {"ring": why} if backend == "auto" else {"error": f"backend 'shm': {why}"}
        return comm, {"nonce": nonce.hex()}  # published once the segment exists

    def _open_published(self, name: str, rank: int, world: int, slot_bytes: int, creator: int) -> _native.ShmComm:
        """The segment rank `creator` published. Gone already means its setup failed (a rank that fails in setup
        unlinks the name: nothing leaks, and nobody else attaches)."""
        try:
            return _native.ShmComm(name, rank, world, self.generation, create=False, slot_bytes=slot_bytes)
        except errors.StorageError as e:
            raise errors.CommProtocolError(
                f"setup of generation {self.generation}: the shared-memory segment rank {creator} published can't "
                f"be opened (its setup failed on another rank first?): {e}", rank=self.rank,
                generation=self.generation, peer=creator) from None

    @staticmethod
    def _publish_failure(store: store_lib.Store, key: str, why: str) -> None:
        """Best effort: a store that fails here too leaves the others to their deadline, as nothing else can."""
        try:
            store.set(key, json.dumps({"error": why}).encode())
        except errors.StoreError:
            pass

    def _connect_hierarchical(self, store: store_lib.Store, hosts: list[list[int]], backend: Backend, key: bytes,
                              host: str, chunk_bytes: int, deadline: float, aborted: threading.Event | None,
                              ) -> _Hierarchical | None:
        """This rank's shared-memory group (its host's ranks) and its ring between hosts (the ranks of its local
        index on every host); None for the ring of every rank instead. Each host's first rank creates its
        segment and publishes the outcome (`_create_segment`: its nonce, or why it can't be made); every rank
        reads every host's before it opens anything, so all take one path: each host's segment, or (a host's
        refused) the ring for "auto" and that host's reason as an error for "shm", on every rank alike."""
        g, slot_bytes = self.generation, chunk_bytes & ~63
        index = next(h for h, ranks in enumerate(hosts) if self.rank in ranks)
        local_rank = hosts[index].index(self.rank)
        where = [shm_key(g, f"host-segment/{h}") for h in range(len(hosts))]
        local: _native.ShmComm | None = None
        if local_rank == 0:
            try:
                local, outcome = self._create_segment(
                    backend, key, len(hosts[index]), slot_bytes,
                    f"host {index}'s segment (ranks {', '.join(map(str, hosts[index]))})")
            except BaseException as e:
                self._publish_failure(store, where[index], f"rank {self.rank} failed creating host {index}'s "
                                                           f"segment: {e!r}")
                raise
            try:
                store.set(where[index], json.dumps(outcome).encode())
            except BaseException:
                if local is not None:
                    local.close()  # unlinks the name: nobody else can, since nobody else learnt it
                raise
        try:
            outcomes = [json.loads(self._poll_store(store, where[h], deadline, aborted, f"segment of host {h}",
                                                    hosts[h][0])) for h in range(len(hosts))]
        except BaseException:
            if local is not None:
                local.close()
            else:  # the creator may have died after publishing: a name nobody opened would stay in /dev/shm
                self._unlink_published(store, where[index], key)
            raise
        refused = [(h, outcome) for h, outcome in enumerate(outcomes) if "nonce" not in outcome]
        if refused:  # every rank read the same outcomes: the same verdict everywhere
            if local is not None:
                local.close()
            failed = [(h, outcome) for h, outcome in refused if "error" in outcome]
            if failed:
                h, outcome = failed[0]
                raise errors.CommProtocolError(outcome["error"], rank=self.rank, generation=g, peer=hosts[h][0])
            return None
        if local is None:
            local = self._open_published(shm_name(key, g, bytes.fromhex(outcomes[index]["nonce"])), local_rank,
                                         len(hosts[index]), slot_bytes, hosts[index][0])
        local = self._attach(local, deadline, aborted)
        try:
            cross = ProcessGroup(store_lib.Namespace(store, f"cross/{local_rank}"), index, len(hosts), g,
                                 backend="tcp", key=key, host=host, timeout=max(deadline - time.monotonic(), 1e-3),
                                 chunk_bytes=chunk_bytes, aborted=aborted)
        except BaseException:
            local.close()
            raise
        return _Hierarchical(local, cross, hosts, self.rank)

    def _attach(self, comm: _native.ShmComm, deadline: float, aborted: threading.Event | None) -> _native.ShmComm:
        """Waits until every rank has mapped the segment (its name is then unlinked)."""
        try:
            while True:  # in slices: an abort must end the wait
                try:
                    comm.wait_attached(min(SETUP_POLL, max(deadline - time.monotonic(), 1e-3)))
                    return comm
                except errors.CollectiveTimeoutError:
                    check_setup_aborted(aborted, self.rank, self.generation)
                    if time.monotonic() >= deadline:
                        raise errors.CollectiveTimeoutError(
                            f"setup of generation {self.generation}: not every rank mapped the shared-memory "
                            "segment in time", rank=self.rank, generation=self.generation) from None
        except BaseException:
            comm.close()
            raise

    def _poll_published(self, store: store_lib.Store, where: str, key: bytes, deadline: float,
                        aborted: threading.Event | None, what: str, creator: int) -> bytes:
        """`_poll_store` of the outcome the segment's creator publishes. A wait that fails (an abort, the
        deadline) unlinks the segment published by then: the creator may have died after publishing it (its
        death is what ended this setup), and a rank that never opened the name would leave it in /dev/shm."""
        try:
            return self._poll_store(store, where, deadline, aborted, what, creator)
        except BaseException:
            self._unlink_published(store, where, key)
            raise

    def _unlink_published(self, store: store_lib.Store, where: str, key: bytes) -> None:
        try:
            outcome = json.loads(store.get(where, 0))
        except (errors.StoreError, ValueError):
            return  # nothing published (or nothing readable): nothing to unlink
        if isinstance(outcome, dict) and isinstance(outcome.get("nonce"), str):
            unlink_segment(shm_name(key, self.generation, bytes.fromhex(outcome["nonce"])))

    def _poll_store(self, store: store_lib.Store, key: str, deadline: float, aborted: threading.Event | None,
                    what: str, peer: int) -> bytes:
        """A store value rank `peer` will publish, polled here with backoff, not in store.get: an abort must
        end the wait."""
        interval = 0.01
        while True:
            check_setup_aborted(aborted, self.rank, self.generation)
            try:
                return store.get(key, 0)
            except errors.StoreTimeoutError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise errors.CollectiveTimeoutError(
                        f"setup of generation {self.generation}: no {what} (never published)", rank=self.rank,
                        generation=self.generation, peer=peer) from None
            if aborted is not None:
                aborted.wait(min(interval, left))
            else:
                time.sleep(min(interval, left))
            interval = min(interval * 2, 0.25)

    def _connect_nccl(self, store: store_lib.Store, device: int, deadline: float,
                      aborted: threading.Event | None) -> _native.NcclComm:
        if self.rank == 0:
            unique_id = _native.nccl_unique_id()
            store.set(nccl_id_key(self.generation), unique_id)
        else:
            unique_id = self._poll_store(store, nccl_id_key(self.generation), deadline, aborted,
                                         "NCCL id from rank 0", 0)
        return _native.NcclComm(unique_id, self.rank, self.world_size, self.generation, device=device,
                                timeout=max(deadline - time.monotonic(), 1e-3))

    # --- collectives ---

    def shard_range(self, count: int) -> tuple[int, int]:
        """[start, stop) of the elements of a flat array of `count` that this rank owns in reduce_scatter and
        allgather (the same rule as optimizer shards: start = floor(count * rank / world_size))."""
        return _native.shard_range(count, self.world_size, self.rank)

    def allreduce(self, array: np.ndarray, op: str = "sum", timeout: float | None = None) -> np.ndarray:
        """Reduces `array` over all ranks, in place; every rank ends with the same bits. Returns `array`."""
        dtype = reduce_dtype(array, op)
        if self.backend == "nccl":
            return self._nccl(array, lambda p: self._comm.allreduce(p, element_count(array), dtype, op, self._t(timeout)))
        self._comm.allreduce(host_array(array), array.size, dtype, op, self._t(timeout))
        return array

    def reduce_scatter(self, array: np.ndarray, op: str = "sum", timeout: float | None = None) -> np.ndarray:
        """Reduces this rank's shard of the flattened `array` (see shard_range) over all ranks, in place, and
        returns a view of it; the rest of `array` is left unspecified."""
        dtype = reduce_dtype(array, op)
        start, stop = self.shard_range(array.size)
        if self.backend == "nccl":
            self._nccl_sharded(array, "reduce_scatter", lambda p, n: self._comm.reduce_scatter(
                p, n, dtype, op, self._t(timeout)))
        else:
            self._comm.reduce_scatter(host_array(array), array.size, dtype, op, self._t(timeout))
        return array.reshape(-1)[start:stop]

    def allgather(self, array: np.ndarray, timeout: float | None = None) -> np.ndarray:
        """Fills every rank's shard of the flattened `array` from the rank that owns it, in place; returns `array`.
        With a first axis of world_size, row r comes from rank r (torch's all_gather_into_tensor)."""
        dtype = dtype_name(array, _native.COMM_DTYPES)
        if self.backend == "nccl":
            self._nccl_sharded(array, "allgather", lambda p, n: self._comm.allgather(p, n, dtype, self._t(timeout)))
        else:
            self._comm.allgather(host_array(array), array.size, dtype, self._t(timeout))
        return array

    def broadcast(self, array: np.ndarray, root: int = 0, timeout: float | None = None) -> np.ndarray:
        """Copies root's `array` into every rank's, in place (any dtype: the bytes travel). Returns `array`."""
        if not 0 <= root < self.world_size:
            raise ValueError(f"root {root} is outside world size {self.world_size}")
        if self.backend == "nccl":
            nbytes = element_count(array) * np.dtype(array_dtype(array)).itemsize
            return self._nccl(array, lambda p: self._comm.broadcast(p, nbytes, root, self._t(timeout)))
        self._comm.broadcast(host_array(array), root, self._t(timeout))
        return array

    def shift(self, send: np.ndarray, recv: np.ndarray, timeout: float | None = None) -> np.ndarray:
        """Sends `send`'s bytes to rank + 1 while rank - 1's land in `recv` (sized for what that rank sends),
        around the ring; returns `recv`. TCP groups only: peer-memory snapshots (elastic/snapshot/) run on a
        host group of their own."""
        if self.backend != "tcp":
            raise ValueError("shift runs on a tcp group")
        self._comm.shift(host_array(send), host_array(recv), self._t(timeout))
        return recv

    def barrier(self, timeout: float | None = None) -> None:
        """Returns when every rank has entered the barrier."""
        if self.backend == "nccl":
            self.allreduce(np.zeros(1, np.int32), timeout=timeout)
        else:
            self._comm.barrier(self._t(timeout))

    def abort(self) -> None:
        """Ends a running collective at once (it raises CollectiveAbortedError) and fails every later one; the
        peers' collectives fail too. Safe from any thread: the heartbeat calls it when a peer is suspected."""
        self._comm.abort()

    def close(self) -> None:
        """Releases the connections (after a running collective ends: abort() first to end it now)."""
        self._comm.close()
        for pointer in self._staging.values():
            _native.cuda_free(self.device, pointer[0])
        self._staging.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ProcessGroup(rank={self.rank}, world_size={self.world_size}, generation={self.generation}, "
                f"backend={self.backend!r})")

    def _t(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    # --- NCCL: host arrays travel through a device buffer; device arrays are used where they are ---

    def _device_buffer(self, nbytes: int) -> int:
        have = self._staging.get("buffer")
        if have is None or have[1] < nbytes:
            if have is not None:
                _native.cuda_free(self.device, have[0])
                del self._staging["buffer"]
            self._staging["buffer"] = (_native.cuda_malloc(self.device, max(nbytes, 1)), max(nbytes, 1))
        return int(self._staging["buffer"][0])

    def _nccl(self, array: Any, run: Any) -> Any:
        pointer = device_pointer(array)
        if pointer is not None:
            run(pointer)
            return array
        host = host_array(array)
        device = self._device_buffer(host.nbytes)
        _native.cuda_memcpy(self.device, device, _native.address_of(host), host.nbytes, _native.COPY_H2D)
        run(device)
        _native.cuda_memcpy(self.device, _native.address_of(host), device, host.nbytes, _native.COPY_D2H)
        return array

    def _nccl_sharded(self, array: Any, what: str, run: Any) -> None:
        """NCCL shards are equal: a host array is laid out in world_size slots of ceil(size / world_size)
        elements on the device, each holding one shard_range shard, so results match the TCP ring's layout."""
        world = self.world_size
        pointer = device_pointer(array)
        if pointer is not None:
            count = element_count(array)
            if count % world:
                raise errors.UnsupportedTensorError(
                    f"{what} of a device array needs a size divisible by world size {world}, got {count}")
            run(pointer, count)
            return
        flat = host_array(array).reshape(-1)
        slot = -(-flat.size // world)
        device = self._device_buffer(slot * world * flat.itemsize)
        shards = [_native.shard_range(flat.size, world, r) for r in range(world)]
        for r, (start, stop) in enumerate(shards):
            if what == "reduce_scatter" or r == self.rank:
                _native.cuda_memcpy(self.device, device + r * slot * flat.itemsize,
                                    _native.address_of(flat[start:stop]), (stop - start) * flat.itemsize,
                                    _native.COPY_H2D)
        run(device, slot * world)
        for r, (start, stop) in enumerate(shards):
            if (r == self.rank) if what == "reduce_scatter" else (r != self.rank):
                _native.cuda_memcpy(self.device, _native.address_of(flat[start:stop]),
                                    device + r * slot * flat.itemsize, (stop - start) * flat.itemsize,
                                    _native.COPY_D2H)


class _Hierarchical:
    """Collectives of ranks on several hosts, as many on each: shared memory inside a host, and between hosts one
    TCP ring per local index, each carrying its local rank's share (the inter-host leg striped over every rank of
    a host, not funnelled through one). The same calls as a communicator (`_native.Comm`). A call's `timeout` is
    one deadline for all its sub-calls: each gets what is left of it, not the whole again."""

    def __init__(self, local: _native.ShmComm, cross: ProcessGroup, hosts: list[list[int]], rank: int):
        self.local, self.cross, self.hosts, self.rank = local, cross, hosts, rank
        self.index = next(h for h, ranks in enumerate(hosts) if rank in ranks)
        self.local_size = len(hosts[0])
        self.local_rank = hosts[self.index].index(rank)
        self.clock = time.monotonic  # a test's fake clock goes here

    def _left(self, until: float) -> float:
        """What is left of a call's deadline for its next sub-call (a past deadline still gets a sliver: the
        sub-call then fails as a timeout, and its peers hear of it)."""
        return max(until - self.clock(), MIN_SUB_CALL_TIMEOUT)

    def _in(self, group: Literal["host", "ring"], call: Any, *args: Any) -> None:
        """call(*args) on one of the two groups. A failure is raised with the blamed rank as a rank of the whole
        group (a host's groups number their ranks 0..local size, a ring its hosts), and fails the other group
        too, passing that rank on (`relay`): its ranks learn at once instead of waiting on this one until their
        deadline, and name the rank that failed, not this one, which only told them. An abort (this rank's own)
        aborts the other group: to its ranks, this one left."""
        try:
            call(*args)
        except errors.CollectiveError as e:
            comm = self.local if group == "host" else self.cross._comm
            peer = comm.failed_outer()  # a failure relayed from a third group carries its blame along
            if peer is None and e.peer is not None:
                peer = self.hosts[self.index][e.peer] if group == "host" else self.hosts[e.peer][self.local_rank]
            other = self.cross._comm if group == "host" else self.local
            if not other.relay(e, peer):
                self.abort()
            raise type(e)(f"{e}; of the whole group: rank {peer}" if peer is not None else str(e), rank=self.rank,
                          generation=e.generation, peer=peer) from None

    def allreduce(self, data: np.ndarray, count: int, dtype: str, op: str, timeout: float) -> None:
        """Reduce-scatter in the host, allreduce of this rank's share between hosts, allgather in the host."""
        until = self.clock() + timeout
        self._in("host", self.local.reduce_scatter, data, count, dtype, op, self._left(until))
        lo, hi = _native.shard_range(count, self.local_size, self.local_rank)
        self._in("ring", self.cross.allreduce, data.reshape(-1)[lo:hi], op, self._left(until))
        self._in("host", self.local.allgather, data, count, dtype, self._left(until))

    def reduce_scatter(self, data: np.ndarray, count: int, dtype: str, op: str, timeout: float) -> None:
        self.allreduce(data, count, dtype, op, timeout)  # every shard reduced, this rank's among them

    def allgather(self, data: np.ndarray, count: int, dtype: str, timeout: float) -> None:
        """Every element is one rank's: the others' are zeroed and the bytes summed as integers, exact for any
        dtype (one rank contributes each element)."""
        world = sum(len(ranks) for ranks in self.hosts)
        start, stop = _native.shard_range(count, world, self.rank)
        flat = data.reshape(-1)
        flat[:start] = 0
        flat[stop:] = 0
        if flat.itemsize in (4, 8):
            words = flat.view(np.int32 if flat.itemsize == 4 else np.int64)
            self.allreduce(words, words.size, str(words.dtype), "sum", timeout)
        else:  # bytes: widened so that sums fit, then narrowed back
            wide = flat.astype(np.int32)
            self.allreduce(wide, wide.size, "int32", "sum", timeout)
            flat[:] = wide

    def broadcast(self, data: np.ndarray, root: int, timeout: float) -> None:
        """From root to its local index's ring's other hosts, then inside each host."""
        index = next(h for h, ranks in enumerate(self.hosts) if root in ranks)
        root_local = self.hosts[index].index(root)
        until = self.clock() + timeout
        if self.local_rank == root_local:
            self._in("ring", self.cross.broadcast, data, index, self._left(until))
        self._in("host", self.local.broadcast, data, root_local, self._left(until))

    def barrier(self, timeout: float) -> None:
        until = self.clock() + timeout
        self._in("host", self.local.barrier, self._left(until))
        self._in("ring", self.cross.barrier, self._left(until))
        self._in("host", self.local.barrier, self._left(until))

    def shift(self, send: Any, recv: Any, timeout: float) -> None:
        raise ValueError("shift runs on a tcp group")

    def abort(self) -> None:
        self.local.abort()
        self.cross.abort()

    def close(self) -> None:
        self.local.close()
        self.cross.close()
