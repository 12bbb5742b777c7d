"""The only importer of the cffi-built native core (`_sneppx_native`).

Everything else in SneppX calls the functions here, which check arguments
before C sees them and turn every SX_E* status into a typed exception at once.
cffi releases the GIL around each C call, so CRC and file I/O run while other
Python threads keep going.
"""

from __future__ import annotations

import errno as _errno
import os
import threading
from typing import Any

from SneppX_ALG import errors
from SneppX_ALG._sneppx_native import ffi, lib
from SneppX_ALG.contract.env import ENV_CUDART, ENV_NCCL

KERNELS = {
    "portable": lib.SX_CRC_PORTABLE,
    "sse42": lib.SX_CRC_SSE42,
    "vpclmul256": lib.SX_CRC_VPCLMUL256,
    "vpclmul512": lib.SX_CRC_VPCLMUL512,
}

_SITES = {"write": lib.SX_SITE_WRITE, "fsync": lib.SX_SITE_FSYNC, "rename": lib.SX_SITE_RENAME,
          "dirsync": lib.SX_SITE_DIRSYNC, "read": lib.SX_SITE_READ}


def raise_for(code: int, what: str, path: str | None = None) -> None:
    """Raises the typed exception for a native status code (no-op for SX_OK)."""
    if code == lib.SX_OK:
        return
    err = lib.sx_last_errno() or None
    detail = ffi.string(lib.sx_strerror(code)).decode()
    if err:
        detail = f"{detail} ({os.strerror(err)})"
    message = f"{what}: {detail}" + (f" [{path}]" if path else "")
    if code == lib.SX_ENOSPC:
        raise errors.DiskFullError(message, path=path, errno=_errno.ENOSPC)
    if code == lib.SX_ENOENT:
        raise errors.CheckpointNotFoundError(message, path=path, errno=_errno.ENOENT)
    if code == lib.SX_EFSYNC:
        raise errors.DurabilityError(message, path=path, errno=err)
    if code == lib.SX_EEOF:
        raise errors.TruncatedCheckpointError(f"{what}: {detail}: the file is shorter than its header says",
                                              path=path)
    if code == lib.SX_EINVAL:
        raise ValueError(message)
    if code == lib.SX_ENOMEM:
        raise MemoryError(message)
    raise errors.StorageError(message, path=path, errno=err)


def as_buffer(data: Any) -> Any:
    """A zero-copy cffi view of bytes, bytearray, memoryview or a C-contiguous numpy array."""
    try:
        return ffi.from_buffer("char[]", data, require_writable=False)
    except (TypeError, ValueError, BufferError) as e:
        raise errors.UnsupportedTensorError(
            f"{type(data).__name__} is not a contiguous buffer ({e}); pass bytes or a C-contiguous array") from None


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC32C of a buffer, continuing from `crc`, with the best kernel for this CPU."""
    buf = as_buffer(data)
    return int(lib.sx_crc32c(crc, buf, len(buf)))


def equal_pairs(pairs: list[tuple[Any, Any]], threads: int = 0) -> list[bool]:
    """For each pair of buffers, whether they hold the same bytes (memcmp, the pairs spread over `threads`
    threads, 0: every core, without the GIL)."""
    views = [(as_buffer(a), as_buffer(b)) for a, b in pairs]
    n = len(views)
    lens = ffi.new("uint64_t[]", [min(len(x), len(y)) for x, y in views] or [0])
    firsts = ffi.new("void *[]", [ffi.cast("void *", x) for x, _ in views] or [ffi.NULL])
    seconds = ffi.new("void *[]", [ffi.cast("void *", y) for _, y in views] or [ffi.NULL])
    equal = ffi.new("uint8_t[]", max(1, n))
    raise_for(lib.sx_equal_ranges(n, firsts, seconds, lens, equal, threads), "compare")
    return [len(x) == len(y) and bool(equal[i]) for i, (x, y) in enumerate(views)]


def json_shape(data: Any, max_depth: int) -> tuple[int, int] | None:
    """(objects and arrays, deepest nesting) of a JSON document, found without parsing it; the depth stops at
    max_depth + 1. None when its brackets don't balance or match or a string never ends (sx_json_scan)."""
    buf = as_buffer(data)
    out = ffi.new("sx_json_shape *")
    code = lib.sx_json_scan(buf, len(buf), max_depth, out)
    if code == lib.SX_EPROTO:
        return None
    raise_for(code, "json scan")
    return int(out.containers), int(out.depth)


def crc32c_parallel(data: Any, crc: int = 0, threads: int = 0) -> int:
    """CRC32C split over threads (0 = all CPUs); the same value as crc32c()."""
    buf = as_buffer(data)
    return int(lib.sx_crc32c_parallel(crc, buf, len(buf), threads))


def crc32c_ranges(data: Any, ranges: list[tuple[int, int]], threads: int = 0) -> list[int]:
    """CRC32C of each (offset, length) range of a buffer, the bytes of all of them split over threads (0 = all
    CPUs): many small ranges use every core, as one large one does."""
    buf = as_buffer(data)
    for offset, length in ranges:
        if offset < 0 or length < 0 or offset + length > len(buf):
            raise ValueError(f"range ({offset}, {length}) is outside the buffer of {len(buf)} bytes")
    n = len(ranges)
    offsets = ffi.new("uint64_t[]", [r[0] for r in ranges])
    lengths = ffi.new("uint64_t[]", [r[1] for r in ranges])
    out = ffi.new("uint32_t[]", max(n, 1))
    raise_for(lib.sx_crc32c_ranges(buf, n, offsets, lengths, out, threads), "crc32c of ranges")
    return list(out)[:n]


def crc32c_with(kernel: str, data: Any, crc: int = 0) -> int:
    """CRC32C with one named kernel (tests and benchmarks); ValueError if the CPU lacks it."""
    buf = as_buffer(data)
    out = ffi.new("uint32_t *")
    raise_for(lib.sx_crc32c_with(KERNELS[kernel], crc, buf, len(buf), out), f"crc32c kernel {kernel}")
    return int(out[0])


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc(A + B) from crc(A), crc(B) and len(B)."""
    return int(lib.sx_crc32c_combine(crc_a, crc_b, len_b))


def crc32c_kernels() -> list[str]:
    """The kernels this CPU can run, best last."""
    mask = lib.sx_crc32c_kernels()
    return [name for name, k in KERNELS.items() if mask & (1 << k)]


class NativeFile:
    """A file written in one streaming pass by the native writer; see sx_file_* in sneppx.h.

    Use as: append()/pad() ..., pwrite() of a header, then finish() (durable) or abort() (unlinked).
    """

    def __init__(self, path: str, *, direct: bool = True, buffer_bytes: int = 0):
        self.path = path
        out = ffi.new("sx_file **")
        raise_for(lib.sx_file_create(os.fsencode(path), buffer_bytes, int(direct), out), "create", path)
        self._f = out[0]

    @property
    def size(self) -> int:
        return int(lib.sx_file_size(self._f))

    @property
    def is_direct(self) -> bool:
        return bool(lib.sx_file_is_direct(self._f))

    def append(self, data: Any) -> int:
        """Appends bytes; returns their CRC32C (computed while they are copied in)."""
        buf = as_buffer(data)
        crc = ffi.new("uint32_t *", 0)
        raise_for(lib.sx_file_append(self._f, buf, len(buf), crc), "write", self.path)
        return int(crc[0])

    def pad(self, alignment: int) -> None:
        raise_for(lib.sx_file_pad(self._f, alignment), "write", self.path)

    def pwrite(self, data: Any, offset: int) -> None:
        buf = as_buffer(data)
        raise_for(lib.sx_file_pwrite(self._f, buf, len(buf), offset), "write", self.path)

    def finish(self) -> None:
        f, self._f = self._f, ffi.NULL
        raise_for(lib.sx_file_finish(f), "write+fsync", self.path)

    def abort(self) -> None:
        if self._f != ffi.NULL:
            f, self._f = self._f, ffi.NULL
            lib.sx_file_abort(f)


def fsync_path(path: str) -> None:
    raise_for(lib.sx_fsync_path(os.fsencode(path)), "fsync", path)


def rename_durable(src: str, dst: str) -> None:
    """rename(src, dst) then fsync of the directories, so the rename survives a crash."""
    raise_for(lib.sx_rename_durable(os.fsencode(src), os.fsencode(dst)), "rename", dst)


def fault_arm(sites: str, countdown: int, action: str = "kill", *, times: int = 1) -> None:
    """Arms the native fault hook (tests): the countdown-th I/O at `sites` kills or fails, and with
    `times` > 1 so do the matching I/Os after it, `times` in all (a fault that persists).
    Sites: write, fsync, rename, dirsync, read."""
    mask = 0
    for site in sites.split(","):
        mask |= _SITES[site.strip()]
    code = 0 if action == "kill" else getattr(_errno, action)
    lib.sx_fault_arm_times(mask, countdown, max(1, times), code)


def fault_sites_passed() -> int:
    return int(lib.sx_fault_sites_passed())


# ---- copy engine (copy.c): CUDA by dlopen, pinned staging, CRC as bytes land ----------------------------

COPY_H2H = lib.SX_COPY_H2H
COPY_D2H = lib.SX_COPY_D2H
COPY_H2D = lib.SX_COPY_H2D
COPY_D2D = lib.SX_COPY_D2D
CUDART_SONAME = "libcudart.so.12"
_CUDART_IN_WHEEL = os.path.join("nvidia", "cuda_runtime", "lib", CUDART_SONAME)


def wheel_library_candidates(in_wheel: str, soname: str, override: str, sys_path: list[str],
                             env: dict[str, str]) -> list[str]:
    """Where to look for an NVIDIA library, in order: $override alone if set, else `in_wheel` (e.g.
    nvidia/nccl/lib/libnccl.so.2) under any sys.path entry (`nvidia` is a namespace package), then the soname."""
    if env.get(override):
        return [env[override]]
    found = [os.path.join(entry or ".", in_wheel) for entry in sys_path]
    return [path for path in found if os.path.isfile(path)] + [soname]


def cudart_candidates(sys_path: list[str], env: dict[str, str]) -> list[str]:
    """Where to look for libcudart: $SNEPPX_CUDART, the nvidia-cuda-runtime-cu12 wheel, the soname."""
    return wheel_library_candidates(_CUDART_IN_WHEEL, CUDART_SONAME, ENV_CUDART, sys_path, env)


def _raise_cuda(code: int, what: str) -> None:
    if code == lib.SX_OK:
        return
    cuda_err = int(lib.sx_cuda_last_error())
    text = ffi.string(lib.sx_cuda_error_string(cuda_err)).decode(errors="replace") if cuda_err else ""
    if code == lib.SX_ENOLIB:
        raise errors.AcceleratorUnavailableError(f"{what}: the CUDA runtime library ({CUDART_SONAME}) can't be "
                                                 "loaded; install nvidia-cuda-runtime-cu12 or set SNEPPX_CUDART")
    if code == lib.SX_ENODEV:
        raise errors.AcceleratorUnavailableError(f"{what}: no CUDA device (CUDA error {cuda_err}: {text})")
    if code == lib.SX_ECUDA:
        raise errors.CudaError(f"{what}: CUDA error {cuda_err}: {text}", cuda_error=cuda_err)
    raise_for(code, what)


def cuda_load() -> str:
    """Loads libcudart (first candidate that loads) and returns the file it came from."""
    import sys

    for candidate in cudart_candidates(sys.path, dict(os.environ)):
        if lib.sx_cuda_load(os.fsencode(candidate)) == lib.SX_OK:
            return ffi.string(lib.sx_cuda_library()).decode()
    _raise_cuda(lib.SX_ENOLIB, "load CUDA runtime")
    return ""  # unreachable: _raise_cuda raised


def cuda_device_count() -> int:
    """Number of CUDA devices; AcceleratorUnavailableError when the runtime or a device is missing."""
    cuda_load()
    count = ffi.new("int *")
    _raise_cuda(lib.sx_cuda_device_count(count), "cudaGetDeviceCount")
    return int(count[0])


def cuda_available() -> bool:
    """True when a CUDA device can be used; never raises."""
    try:
        return cuda_device_count() > 0
    except errors.AcceleratorUnavailableError:
        return False


def cuda_malloc(device: int, nbytes: int) -> int:
    """Device memory (tests, benchmarks); returns the pointer as an int."""
    out = ffi.new("void **")
    _raise_cuda(lib.sx_cuda_malloc(device, nbytes, out), "cudaMalloc")
    return int(ffi.cast("uintptr_t", out[0]))


def cuda_free(device: int, pointer: int) -> None:
    _raise_cuda(lib.sx_cuda_free(device, ffi.cast("void *", pointer)), "cudaFree")


def cuda_memcpy(device: int, dst: int, src: int, nbytes: int, kind: int) -> None:
    """Synchronous cudaMemcpy between int pointers (tests, benchmarks)."""
    _raise_cuda(lib.sx_cuda_memcpy(device, ffi.cast("void *", dst), ffi.cast("void *", src), nbytes, kind),
                "cudaMemcpy")


def address_of(data: Any) -> int:
    """The address of a buffer's first byte (bytes, bytearray, numpy array...)."""
    return int(ffi.cast("uintptr_t", as_buffer(data)))


class Copier:
    """The snapshot copy engine: copies into staging memory and returns the CRC32C of what landed.

    device=-1 copies host memory with plain threads; device>=0 also copies from CUDA device memory
    through pinned staging on its own stream (AcceleratorUnavailableError without a device).
    Staging buffers come from alloc() (pinned on a device copier) and go back with free().
    """

    def __init__(self, device: int = -1, *, piece_bytes: int = 0, threads: int = 0):
        if device >= 0:
            cuda_load()
        out = ffi.new("sx_copier **")
        _raise_cuda(lib.sx_copier_create(device, piece_bytes, threads, out), "create copier")
        self._c = ffi.gc(out[0], lib.sx_copier_destroy)
        self.device = device

    def alloc(self, nbytes: int) -> Any:
        """A writable buffer (cffi) of nbytes; pinned on a device copier. Keep it alive while in use."""
        out = ffi.new("void **")
        _raise_cuda(lib.sx_copier_alloc(self._c, nbytes, out), "allocate staging memory")
        # A cycle collection (as at interpreter exit) may destroy the copier before this buffer: the C copier
        # stays allocated until its last buffer is freed (copy.c). The finalizer holds the C function itself,
        # not the module global `lib`, which interpreter shutdown may have cleared by the time it runs.
        copier, free = self._c, lib.sx_copier_free
        return ffi.gc(ffi.cast("char *", out[0]), lambda p: free(copier, p), nbytes)

    def view(self, buffer: Any, nbytes: int) -> memoryview:
        """A memoryview over the first nbytes of a buffer from alloc()."""
        return memoryview(ffi.buffer(buffer, nbytes))

    def wait_stream(self, stream: int) -> None:
        """Orders this copier's next copies after the work queued so far on a producer's CUDA stream
        (the __cuda_array_interface__ "stream" value: 1 legacy default, 2 per-thread default, or a
        handle); returns without waiting for that work."""
        if self.device < 0:
            raise ValueError("a host copier has no stream to order")
        if not isinstance(stream, int) or stream <= 0:
            raise ValueError(f"stream must be a positive int (0 is ambiguous), not {stream!r}")
        _raise_cuda(lib.sx_copier_wait_stream(self._c, stream), "order the copy after the producer's stream")

    def copy(self, dst: Any, src: Any, nbytes: int | None = None, *, crc: int | None = 0,
             kind: int = COPY_H2H) -> int | None:
        """Copies into dst (writable buffer or int address) from src (buffer, or int device address for
        COPY_D2H). Returns the CRC32C of the bytes continued from `crc`, or None with crc=None."""
        dst_p, dst_len = _pointer(dst, writable=True)
        src_p, src_len = _pointer(src, writable=False)
        if nbytes is None:
            nbytes = src_len if src_len is not None else dst_len
        if nbytes is None:
            raise ValueError("nbytes is needed when both ends are raw pointers")
        for end, length in (("into", dst_len), ("from", src_len)):
            if length is not None and nbytes > length:
                raise ValueError(f"copy of {nbytes} bytes {end} a buffer of {length}")
        out = ffi.new("uint32_t *", crc or 0) if crc is not None else ffi.NULL
        _raise_cuda(lib.sx_copier_copy(self._c, dst_p, src_p, nbytes, kind, out), "copy")
        return int(out[0]) if crc is not None else None


def _pointer(data: Any, *, writable: bool) -> tuple[Any, int | None]:
    """A void* for an int address, a cffi pointer (length unknown) or a buffer (with its length)."""
    if isinstance(data, int):
        return ffi.cast("void *", data), None
    if isinstance(data, ffi.CData):
        return ffi.cast("void *", data), None
    buf = ffi.from_buffer("char[]", data, require_writable=writable)
    return buf, len(buf)


# ---- heartbeats (heartbeat.c, blake2s.c) and the node lifecycle (elastic.c) -------------------------------

HB_DROP_REASONS: tuple[str, ...] = tuple(ffi.string(lib.sx_hb_drop_name(i)).decode() for i in range(lib.SX_HB_NDROPS))
HB_STATES = {lib.SX_HB_UNKNOWN: "unknown", lib.SX_HB_HEALTHY: "healthy", lib.SX_HB_SUSPECTED: "suspected",
             lib.SX_HB_CONFIRMED: "confirmed"}
HB_EVENTS = {lib.SX_HB_EVENT_HEALTHY: "healthy", lib.SX_HB_EVENT_SUSPECTED: "suspected",
             lib.SX_HB_EVENT_CONFIRMED: "confirmed", lib.SX_HB_EVENT_RESTARTED: "restarted"}
HB_MODES = {lib.SX_HB_DIRECT: "direct", lib.SX_HB_GOSSIP: "gossip"}
HB_KEY_BYTES = lib.SX_HB_KEY_BYTES
HB_HEADER_BYTES = lib.SX_HB_HEADER_BYTES
HB_MAX_DATAGRAM = lib.SX_HB_MAX_DATAGRAM
_HB_PEER_FIELDS = ("addr", "port", "state_since_ns", "last_seen_ns", "last_alive_ns", "rtt_ns", "rtt_var_ns",
                   "probes_sent", "acks_received", "pings_received", "accepted", "suspicions", "instance",
                   "restarts", "incarnation")
_HB_STAT_FIELDS = ("port", "instance", "incarnation", "generation", "sent", "send_errors", "received", "accepted",
                   "relayed", "stalls", "events")
_EVENT_BATCH = 64


def blake2s(data: Any, *, key: bytes = b"", digest_size: int = 32) -> bytes:
    """Keyed BLAKE2s (RFC 7693) as the heartbeat computes it; the same bytes as hashlib.blake2s."""
    if not 1 <= digest_size <= 32 or len(key) > 32:
        raise ValueError(f"BLAKE2s takes a digest of 1-32 bytes and a key of at most 32, not {digest_size}/{len(key)}")
    buf = as_buffer(data)
    out = ffi.new("uint8_t[]", digest_size)
    raise_for(lib.sx_blake2s(out, digest_size, key, len(key), buf, len(buf)), "blake2s")
    return bytes(ffi.buffer(out, digest_size))


def _raise_elastic(code: int, what: str) -> None:
    if code == lib.SX_ENET:
        err = lib.sx_last_errno()
        raise errors.HeartbeatSocketError(err, f"{what}: {os.strerror(err) if err else 'socket error'}")
    if code == lib.SX_ETIMEDOUT:
        raise TimeoutError(what)
    raise_for(code, what)


class Heartbeat:
    """One heartbeat monitor in C (see sx_hb_* in sneppx.h): a bound UDP socket and, once started, its thread.

    peers: (IPv4 as int, port) pairs. Times are CLOCK_MONOTONIC nanoseconds. The memory is freed when the
    object is garbage; stop() ends the thread and frees the port at once.

    sock_fd: -1 to bind bind_addr:bind_port, else the descriptor of an IPv4 UDP socket the caller has bound
    and keeps: the monitor uses a dup of it and closes only that (bind_* are then taken from the socket).
    first_contact_grace_ns: a peer never heard from is suspected only timeout + this after start().
    """

    def __init__(self, *, bind_addr: int, bind_port: int, peers: list[tuple[int, int]], key: bytes, job_tag: bytes,
                 interval_ns: int, timeout_ns: int, probe_timeout_ns: int, suspicion_ns: int, direct_limit: int,
                 indirect_probes: int, retransmits: int, generation: int, first_contact_grace_ns: int = 0,
                 sock_fd: int = -1):
        if len(key) != HB_KEY_BYTES or len(job_tag) != 16:
            raise ValueError(f"the heartbeat key must be {HB_KEY_BYTES} bytes and the job tag 16")
        for name, value in (("interval_ns", interval_ns), ("timeout_ns", timeout_ns), ("retransmits", retransmits)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, not {value}")
        if first_contact_grace_ns < 0:
            raise ValueError(f"first_contact_grace_ns must not be negative, not {first_contact_grace_ns}")
        cfg = ffi.new("sx_hb_config *")
        cfg.bind_addr, cfg.bind_port = bind_addr, bind_port
        cfg.interval_ns, cfg.timeout_ns = interval_ns, timeout_ns
        cfg.probe_timeout_ns, cfg.suspicion_ns = probe_timeout_ns, suspicion_ns
        cfg.direct_limit, cfg.indirect_probes, cfg.retransmits = direct_limit, indirect_probes, retransmits
        cfg.generation = generation
        cfg.first_contact_grace_ns, cfg.sock_fd = first_contact_grace_ns, sock_fd
        ffi.memmove(cfg.key, key, len(key))
        ffi.memmove(cfg.job_tag, job_tag, 16)
        self.npeers = len(peers)
        addrs = ffi.new("uint32_t[]", [a for a, _ in peers] or [0])
        ports = ffi.new("uint16_t[]", [p for _, p in peers] or [0])
        out = ffi.new("sx_hb **")
        code = lib.sx_hb_create(cfg, addrs, ports, len(peers), out)
        ffi.memmove(cfg.key, bytes(len(key)), len(key))
        _raise_elastic(code, "heartbeat socket")
        self._hb = ffi.gc(out[0], lib.sx_hb_destroy)

    def start(self) -> None:
        _raise_elastic(lib.sx_hb_start(self._hb), "start heartbeat")

    def stop(self) -> None:
        lib.sx_hb_stop(self._hb)

    def set_generation(self, generation: int) -> None:
        _raise_elastic(lib.sx_hb_set_generation(self._hb, generation), f"set heartbeat generation {generation}")

    def stats(self) -> dict[str, Any]:
        """Counters of the whole monitor; `drops` by reason name, `mode` "direct" or "gossip"."""
        out = ffi.new("sx_hb_stats *")
        raise_for(lib.sx_hb_get_stats(self._hb, out), "heartbeat stats")
        stats: dict[str, Any] = {name: int(getattr(out, name)) for name in _HB_STAT_FIELDS}
        stats["mode"] = HB_MODES[out.mode]
        stats["drops"] = {name: int(out.drops[i]) for i, name in enumerate(HB_DROP_REASONS)}
        return stats

    def peers(self) -> list[dict[str, Any]]:
        """Every peer's state and counters, in the order given, from one consistent snapshot."""
        out = ffi.new("sx_hb_peer[]", max(1, self.npeers))
        raise_for(lib.sx_hb_get_peers(self._hb, out, self.npeers), "heartbeat peers")
        rows = []
        for i in range(self.npeers):
            row: dict[str, Any] = {name: int(getattr(out[i], name)) for name in _HB_PEER_FIELDS}
            row["state"] = HB_STATES[out[i].state]
            rows.append(row)
        return rows

    def wait_events(self, after: int, timeout: float | None) -> list[dict[str, Any]]:
        """Events with index > after (waits up to timeout seconds for the first; None = forever). [] on a timeout
        or once stopped."""
        out = ffi.new("sx_hb_event[]", _EVENT_BATCH)
        count = ffi.new("size_t *")
        timeout_ns = -1 if timeout is None else max(0, int(timeout * 1e9))
        code = lib.sx_hb_wait_events(self._hb, after, out, _EVENT_BATCH, timeout_ns, count)
        if code in (lib.SX_ETIMEDOUT, lib.SX_ESTATE):
            return []
        raise_for(code, "heartbeat events")
        return [{"index": int(e.index), "kind": HB_EVENTS[e.kind], "peer": int(e.peer), "time_ns": int(e.time_ns),
                 "generation": int(e.generation)} for e in (out[i] for i in range(count[0]))]


LIFECYCLE_STATES: tuple[str, ...] = tuple(ffi.string(lib.sx_elastic_state_name(i)).decode() for i in range(lib.SX_EL_NSTATES))
LIFECYCLE_EVENTS: tuple[str, ...] = tuple(ffi.string(lib.sx_elastic_event_name(i)).decode() for i in range(lib.SX_EL_NEVENTS))


def lifecycle_new() -> Any:
    """A fresh lifecycle machine (sx_elastic) in state "init", generation 0."""
    machine = ffi.new("sx_elastic *")
    lib.sx_elastic_init(machine)
    return machine


def lifecycle_next(state: str, event: str) -> str | None:
    """The state `event` leads to from `state`, or None where it is illegal."""
    code = lib.sx_elastic_next(LIFECYCLE_STATES.index(state), LIFECYCLE_EVENTS.index(event))
    return None if code == lib.SX_ESTATE else LIFECYCLE_STATES[code]


def lifecycle_fire(machine: Any, event: str, generation: int = 0) -> None:
    """Applies event to the machine; LifecycleError if its state doesn't allow it (nothing changes then)."""
    if event not in LIFECYCLE_EVENTS:
        raise ValueError(f"unknown lifecycle event {event!r}; one of {', '.join(LIFECYCLE_EVENTS)}")
    if generation < 0:
        raise ValueError(f"generation must be >= 0, not {generation}")
    state = LIFECYCLE_STATES[machine.state]
    code = lib.sx_elastic_fire(machine, LIFECYCLE_EVENTS.index(event), generation)
    if code == lib.SX_ESTATE:
        raise errors.LifecycleError(f"event {event!r} is not allowed in state {state!r}", state=state, event=event)
    if code == lib.SX_EINVAL:
        raise ValueError(f"generation {generation} is not newer than the current {int(machine.generation)}")
    raise_for(code, f"lifecycle event {event}")

# ---- collectives: the TCP ring (comm.c) and NCCL (nccl.c) -------------------------------------------------

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
        _raise_cuda(code, what)
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


class _HostCollectives(_Communicator):
    """The calls the two CPU communicators share, each through its class's C function of that name (sx_comm_* or
    sx_shm_*): both take host buffers and the same dtype and op codes."""

    _failed_peer: Any
    _allreduce: Any
    _reduce_scatter: Any
    _allgather: Any
    _broadcast: Any
    _barrier: Any

    def _blamed(self) -> int | None:
        peer = int(type(self)._failed_peer(self._handle))
        return peer if peer >= 0 else None

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
            return ffi.string(lib.sx_nccl_library()).decode()
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



# ---- reads through the fault hook; ordering a copy after the producer's stream ----------------------------


def read_at(fd: int, buffer: Any, offset: int, crc: int = 0, *, path: str | None = None) -> int:
    """Reads exactly len(buffer) bytes of fd at offset into a writable buffer; returns their CRC32C
    continued from `crc`. A failed read is StorageError with .errno (never a SIGBUS, as a memory map
    gives); a file that ends first is TruncatedCheckpointError."""
    if offset < 0:
        raise ValueError(f"offset must be >= 0, not {offset}")
    try:
        buf = ffi.from_buffer("char[]", buffer, require_writable=True)
    except (TypeError, ValueError, BufferError) as e:
        raise errors.UnsupportedTensorError(f"{type(buffer).__name__} is not a writable contiguous buffer "
                                            f"({e})") from None
    out = ffi.new("uint32_t *", crc)
    raise_for(lib.sx_read_at(fd, buf, len(buf), offset, out), "read", path)
    return int(out[0])


def read_blocks_at(fd: int, buffer: Any, offset: int, block_bytes: int, *, path: str | None = None) -> list[int]:
    """As read_at, returning the CRC32C of each block_bytes block of what was read (the last may be shorter),
    each taken as the block landed."""
    if offset < 0 or block_bytes <= 0:
        raise ValueError(f"offset must be >= 0 and block_bytes > 0, not {offset} and {block_bytes}")
    try:
        buf = ffi.from_buffer("char[]", buffer, require_writable=True)
    except (TypeError, ValueError, BufferError) as e:
        raise errors.UnsupportedTensorError(f"{type(buffer).__name__} is not a writable contiguous buffer "
                                            f"({e})") from None
    crcs = ffi.new("uint32_t[]", max(1, -(-len(buf) // block_bytes)))
    raise_for(lib.sx_read_blocks_at(fd, buf, len(buf), offset, block_bytes, crcs), "read", path)
    return list(crcs)[:-(-len(buf) // block_bytes)]


def cuda_stream_create(device: int) -> int:
    """A new non-blocking CUDA stream (tests, benchmarks); returns its handle."""
    out = ffi.new("uintptr_t *")
    _raise_cuda(lib.sx_cuda_stream_create(device, out), "cudaStreamCreate")
    return int(out[0])


def cuda_stream_destroy(device: int, stream: int) -> None:
    _raise_cuda(lib.sx_cuda_stream_destroy(device, stream), "cudaStreamDestroy")


def cuda_memset_async(device: int, pointer: int, value: int, nbytes: int, stream: int) -> None:
    """cudaMemsetAsync on a stream (tests, benchmarks): work a copy can be ordered after."""
    _raise_cuda(lib.sx_cuda_memset_async(device, ffi.cast("void *", pointer), value, nbytes, stream),
                "cudaMemsetAsync")


# ---- benchmarks only: the memory read ceiling ----------------------------------------------------------

MEMORY_READ_WIDTHS = {"scalar64": 0, "avx2": 1, "avx512": 2, "avx512x4": 3}


def memory_read_widths() -> list[str]:
    """The load widths this CPU runs for memory_read, widest last ("avx512x4": four streams at once)."""
    mask = lib.sx_memory_read_widths()
    return [name for name, w in MEMORY_READ_WIDTHS.items() if mask & (1 << w)]


def memory_read(data: Any, width: str | None = None) -> int:
    """Reads every byte of a buffer once with loads of `width` (default: the widest this CPU runs) on the
    calling thread, for the memory read ceiling in benchmarks; returns the xor of its 64-bit words."""
    buf = as_buffer(data)
    name = width or memory_read_widths()[-1]  # (four AVX-512 streams where the CPU has AVX-512)
    if name not in MEMORY_READ_WIDTHS:
        raise ValueError(f"unknown load width {name!r}; choose from {', '.join(MEMORY_READ_WIDTHS)}")
    out = ffi.new("uint64_t *")
    raise_for(lib.sx_memory_read(MEMORY_READ_WIDTHS[name], buf, len(buf), out), f"memory read ({name})")
    return int(out[0])
