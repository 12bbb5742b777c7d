"""Collectives (comm.c, shm.c, nccl.c): the TCP ring, shared memory on one host, and NCCL on GPUs."""

from __future__ import annotations

import os
import threading
from typing import Any

from SneppX_ALG import errors
from SneppX_ALG._native._lib import as_buffer, ffi, lib, raise_for
from SneppX_ALG._native.cuda import cuda_load, raise_cuda, wheel_library_candidates
from SneppX_ALG.contract.env import ENV_NCCL

COMM_DTYPES = {"float32": lib.SX_DTYPE_F32, "float64": lib.SX_DTYPE_F64, "int32": lib.SX_DTYPE_I32,
               "int64": lib.SX_DTYPE_I64, "uint8": lib.SX_DTYPE_U8}


REDUCE_DTYPES = ("float32", "float64", "int32", "int64")


REDUCE_OPS = {"sum": lib.SX_OP_SUM, "max": lib.SX_OP_MAX, "min": lib.SX_OP_MIN}


COMM_HEADER_BYTES = lib.SX_COMM_HEADER_BYTES


COMM_MAGIC = lib.SX_COMM_MAGIC


NCCL_UNIQUE_ID_BYTES = lib.SX_NCCL_UNIQUE_ID_BYTES


NCCL_SONAME = "libnccl.so.2"


_NCCL_IN_WHEEL = os.path.join("nvidia", "nccl", "lib", NCCL_SONAME)


def shard_range(count: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the shard of `count` elements that `rank` owns among `world_size` ranks:
    start = floor(count * rank / world_size). The ring's segments and ZeRO's optimizer shards both use it."""
    if not 0 <= rank < world_size or count < 0:
        raise ValueError(f"rank {rank} of world size {world_size}, count {count}")
    start, stop = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    lib.sx_shard_range(count, world_size, rank, start, stop)
    return int(start[0]), int(stop[0])


def raise_collective(code: int, what: str, *, rank: int | None, generation: int | None,
                     peer: int | None = None) -> None:
    """The typed CollectiveError for a comm.c/nccl.c status (no-op for SX_OK)."""
    if code == lib.SX_OK:
        return
    where = {"rank": rank, "generation": generation, "peer": peer}
    detail = ffi.string(lib.sx_strerror(code)).decode()
    blame = f" (rank {peer})" if peer is not None else ""
    message = f"{what} on rank {rank}, generation {generation}: {detail}{blame}"
    if code == lib.SX_EPEER:
        raise errors.PeerLostError(message, **where)
    if code == lib.SX_ETIMEDOUT:
        raise errors.CollectiveTimeoutError(message, **where)
    if code == lib.SX_EABORTED:
        raise errors.CollectiveAbortedError(message, **where)
    if code == lib.SX_ESTALE:
        raise errors.StaleGenerationError(message, **where)
    if code == lib.SX_EPROTO:
        raise errors.CommProtocolError(message, **where)
    if code == lib.SX_ENCCL:
        result = int(lib.sx_nccl_last_error())
        text = ffi.string(lib.sx_nccl_error_string(result)).decode(errors="replace")
        raise errors.NcclError(f"{message}: NCCL error {result}: {text}", nccl_error=result, **where)
    if code in (lib.SX_ENODEV, lib.SX_ENOLIB, lib.SX_ECUDA):
        raise_cuda(code, what)
    raise_for(code, what)


def _check_buffer(data: Any, count: int, dtype: str, dtypes: tuple[str, ...] | dict[str, int]) -> Any:
    if dtype not in dtypes:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(dtypes)}")
    buf = as_buffer(data)
    itemsize = 1 if dtype == "uint8" else int(dtype[-2:]) // 8
    if count < 0 or count * itemsize > len(buf):
        raise ValueError(f"{count} {dtype} elements do not fit a buffer of {len(buf)} bytes")
    return buf


class _Communicator:
    """What the TCP ring's and NCCL's communicators share: one call at a time (a lock keeps C's rule), abort()
    from any thread at any time without waiting for the running call, close() once that call has returned, and
    every status turned into its CollectiveError at once."""

    _abort: Any
    _destroy: Any

    def __init__(self, handle: Any, rank: int, world_size: int, generation: int):
        self._handle = handle
        self.rank, self.world_size, self.generation = rank, world_size, generation
        self._lock = threading.Lock()  # one call at a time, and no close() during one
        self._abort_lock = threading.Lock()  # held only for an instant: abort() never waits on a call

    def _blamed(self) -> int | None:
        """The rank the C side blames for a failure, when it knows one."""
        return None

    def _call(self, what: str, fn: Any, *args: Any) -> None:
        with self._lock:
            if self._handle == ffi.NULL:
                raise errors.CollectiveAbortedError(f"{what}: the communicator is closed", rank=self.rank,
                                                    generation=self.generation)
            code = fn(self._handle, *args)
            if code != lib.SX_OK:
                raise_collective(code, what, rank=self.rank, generation=self.generation, peer=self._blamed())

    def abort(self) -> None:
        """Ends a running call and fails every later one."""
        with self._abort_lock:
            if self._handle != ffi.NULL:
                type(self)._abort(self._handle)

    def close(self) -> None:
        """Releases the communicator once no call is running (abort() first to end one now)."""
        with self._lock:
            with self._abort_lock:
                handle, self._handle = self._handle, ffi.NULL
            if handle != ffi.NULL:
                type(self)._destroy(handle)


# The failures a communicator can pass on for an enclosing group (relay), as the C status each is.
_RELAYABLE = ((errors.PeerLostError, lib.SX_EPEER), (errors.CollectiveTimeoutError, lib.SX_ETIMEDOUT),
              (errors.StaleGenerationError, lib.SX_ESTALE), (errors.CommProtocolError, lib.SX_EPROTO))


class _HostCollectives(_Communicator):
    """The calls the two CPU communicators share, each through its class's C function of that name (sx_comm_* or
    sx_shm_*): both take host buffers and the same dtype and op codes."""

    _failed_peer: Any
    _failed_outer: Any
    _relay: Any
    _allreduce: Any
    _reduce_scatter: Any
    _allgather: Any
    _broadcast: Any
    _barrier: Any

    def _blamed(self) -> int | None:
        peer = int(type(self)._failed_peer(self._handle))
        return peer if peer >= 0 else None

    def failed_outer(self) -> int | None:
        """The rank an enclosing group blames for this communicator's failure (see relay), if any."""
        with self._abort_lock:
            outer = int(type(self)._failed_outer(self._handle)) if self._handle != ffi.NULL else -1
        return outer if outer >= 0 else None

    def relay(self, error: errors.CollectiveError, outer: int | None) -> bool:
        """Fails this communicator, between calls, with `error` of an enclosing group that blames `outer` (a rank
        as that group numbers them): every rank of it then raises that error and reports `outer` from
        failed_outer(), instead of blaming this rank. False (nothing done) for an error that is no failure of a
        peer (an abort: abort() this communicator instead)."""
        code = next((code for kind, code in _RELAYABLE if isinstance(error, kind)), None)
        if code is None:
            return False
        with self._lock:
            if self._handle != ffi.NULL:
                type(self)._relay(self._handle, code, -1 if outer is None else outer)
        return True

    def allreduce(self, data: Any, count: int, dtype: str, op: str, timeout: float) -> None:
        buf = _check_buffer(data, count, dtype, REDUCE_DTYPES)
        self._call("allreduce", type(self)._allreduce, buf, count, COMM_DTYPES[dtype], REDUCE_OPS[op], timeout)

    def reduce_scatter(self, data: Any, count: int, dtype: str, op: str, timeout: float) -> None:
        buf = _check_buffer(data, count, dtype, REDUCE_DTYPES)
        self._call("reduce_scatter", type(self)._reduce_scatter, buf, count, COMM_DTYPES[dtype], REDUCE_OPS[op],
                   timeout)

    def allgather(self, data: Any, count: int, dtype: str, timeout: float) -> None:
        buf = _check_buffer(data, count, dtype, COMM_DTYPES)
        self._call("allgather", type(self)._allgather, buf, count, COMM_DTYPES[dtype], timeout)

    def broadcast(self, data: Any, root: int, timeout: float) -> None:
        buf = as_buffer(data)
        self._call("broadcast", type(self)._broadcast, buf, len(buf), root, timeout)

    def barrier(self, timeout: float) -> None:
        self._call("barrier", type(self)._barrier, timeout)


class Comm(_HostCollectives):
    """One rank's end of the TCP ring (sx_comm_* in sneppx.h). Owns both sockets from construction on."""

    _abort, _destroy, _failed_peer = lib.sx_comm_abort, lib.sx_comm_destroy, lib.sx_comm_failed_peer
    _relay, _failed_outer = lib.sx_comm_relay, lib.sx_comm_failed_outer
    _allreduce, _reduce_scatter, _allgather = lib.sx_comm_allreduce, lib.sx_comm_reduce_scatter, lib.sx_comm_allgather
    _broadcast, _barrier = lib.sx_comm_broadcast, lib.sx_comm_barrier

    def __init__(self, rank: int, world_size: int, generation: int, send_fd: int = -1, recv_fd: int = -1,
                 chunk_bytes: int = 0):
        out = ffi.new("sx_comm **")
        code = lib.sx_comm_create(rank, world_size, generation, send_fd, recv_fd, chunk_bytes, out)
        raise_collective(code, "create communicator", rank=rank, generation=generation)
        super().__init__(out[0], rank, world_size, generation)

    def shift(self, send: Any, recv: Any, timeout: float) -> None:
        send_buf, recv_buf = as_buffer(send), as_buffer(recv)
        self._call("shift", lib.sx_comm_shift, send_buf, len(send_buf), recv_buf, len(recv_buf), timeout)


class ShmComm(_HostCollectives):
    """One rank's end of a shared-memory group on one host (sx_shm_* in sneppx.h): rank 0 creates the segment
    `name` (create=True), the others open it; wait_attached() then returns once every rank has mapped it."""

    _abort, _destroy, _failed_peer = lib.sx_shm_abort, lib.sx_shm_destroy, lib.sx_shm_failed_peer
    _relay, _failed_outer = lib.sx_shm_relay, lib.sx_shm_failed_outer
    _allreduce, _reduce_scatter, _allgather = lib.sx_shm_allreduce, lib.sx_shm_reduce_scatter, lib.sx_shm_allgather
    _broadcast, _barrier = lib.sx_shm_broadcast, lib.sx_shm_barrier

    def __init__(self, name: str, rank: int, world_size: int, generation: int, *, create: bool,
                 slot_bytes: int = 1 << 20):
        out = ffi.new("sx_shm **")
        code = lib.sx_shm_create(name.encode(), int(create), rank, world_size, generation, slot_bytes, out)
        if code in (lib.SX_ENOENT, lib.SX_EEXIST, lib.SX_EPERM, lib.SX_EIO, lib.SX_ENOMEM, lib.SX_ENOSPC):
            raise_for(code, f"shared-memory segment {name}")
        raise_collective(code, "create shared-memory communicator", rank=rank, generation=generation)
        super().__init__(out[0], rank, world_size, generation)

    def wait_attached(self, timeout: float) -> None:
        self._call("setup (every rank mapping the segment)", lib.sx_shm_wait_attached, timeout)


def nccl_candidates(sys_path: list[str], env: dict[str, str]) -> list[str]:
    """Where to look for libnccl: $SNEPPX_NCCL, the nvidia-nccl-cu12 wheel, the soname."""
    return wheel_library_candidates(_NCCL_IN_WHEEL, NCCL_SONAME, ENV_NCCL, sys_path, env)


def nccl_load() -> str:
    """Loads libnccl (first candidate that loads, 2.14.3 or newer) and returns the file it came from."""
    import sys

    for candidate in nccl_candidates(sys.path, dict(os.environ)):
        if lib.sx_nccl_load(os.fsencode(candidate)) == lib.SX_OK:
            return str(ffi.string(lib.sx_nccl_library()).decode())
    raise errors.AcceleratorUnavailableError(
        f"NCCL ({NCCL_SONAME}, 2.14.3 or newer) can't be loaded; install nvidia-nccl-cu12 (the `nccl` extra) "
        "or set SNEPPX_NCCL to the library's path")


def nccl_version() -> tuple[int, int, int]:
    """The loaded NCCL's (major, minor, patch)."""
    nccl_load()
    out = ffi.new("int *")
    raise_for(lib.sx_nccl_version(out), "ncclGetVersion")
    code = int(out[0])  # X*10000 + Y*100 + Z since 2.9 (X*1000 + Y*100 + Z before; older than we load)
    return code // 10000, code // 100 % 100, code % 100


def nccl_unique_id() -> bytes:
    """A fresh ncclUniqueId (rank 0 makes it; the store carries it to the others)."""
    nccl_load()
    out = ffi.new("unsigned char[]", NCCL_UNIQUE_ID_BYTES)
    raise_collective(lib.sx_nccl_unique_id(out), "ncclGetUniqueId", rank=None, generation=None)
    return bytes(ffi.buffer(out, NCCL_UNIQUE_ID_BYTES))


class NcclComm(_Communicator):
    """An NCCL communicator with an abort watchdog (sx_nccl_* in sneppx.h); calls take device pointers (ints)."""

    _abort = lib.sx_nccl_abort
    _destroy = lib.sx_nccl_destroy

    def __init__(self, unique_id: bytes, rank: int, world_size: int, generation: int, *, device: int,
                 timeout: float):
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        nccl_load()
        cuda_load()
        out = ffi.new("sx_nccl **")
        code = lib.sx_nccl_create(unique_id, rank, world_size, device, timeout, out)
        raise_collective(code, "ncclCommInitRankConfig", rank=rank, generation=generation)
        super().__init__(out[0], rank, world_size, generation)

    def allreduce(self, pointer: int, count: int, dtype: str, op: str, timeout: float) -> None:
        self._call("ncclAllReduce", lib.sx_nccl_allreduce, ffi.cast("void *", pointer), count, COMM_DTYPES[dtype],
                   REDUCE_OPS[op], timeout)

    def reduce_scatter(self, pointer: int, count: int, dtype: str, op: str, timeout: float) -> None:
        self._call("ncclReduceScatter", lib.sx_nccl_reduce_scatter, ffi.cast("void *", pointer), count,
                   COMM_DTYPES[dtype], REDUCE_OPS[op], timeout)

    def allgather(self, pointer: int, count: int, dtype: str, timeout: float) -> None:
        self._call("ncclAllGather", lib.sx_nccl_allgather, ffi.cast("void *", pointer), count, COMM_DTYPES[dtype],
                   timeout)

    def broadcast(self, pointer: int, nbytes: int, root: int, timeout: float) -> None:
        self._call("ncclBroadcast", lib.sx_nccl_broadcast, ffi.cast("void *", pointer), nbytes, root, timeout)
