"""Peer-memory snapshots: each rank's training state at a recent step kept in host memory, with a copy on
another node, so a failure costs the steps since the last snapshot (none, with one every step) instead of up to a
checkpoint interval.

Why memory, and a peer: a durable save of a large state is expensive, so checkpoints are minutes apart; a copy
into host memory is a memcpy, and a copy on the next node survives the loss of this one (Gemini, SOSP'23; NVIDIA
resiliency extension's local checkpoints). A snapshot is not a checkpoint: it never reaches storage, and when no
complete one survives the job restores the newest durable checkpoint as before.

What a snapshot is: one rank's tensors (its `Shard`s first, then a slot for the description of its unique part,
then the replicated arrays) copied into a buffer reused from step to step, a CRC32C per `PIECE` bytes of each
tensor, and a small JSON description (paths, dtypes, boxes, plain values). Only the unique part travels to the
peer, straight from that buffer: a rank's Shards, which is about 1/N of the state per rank with ZeRO-1 data
parallelism. The replicated arrays and plain values survive in every rank's own snapshot (equal on every rank:
the digests compared at each snapshot say so), so any one survivor's restores them.

Per snapshot of step s (the generation's `snapshot` group, a TCP ring of its own, docs/ELASTIC.md):
1. the training thread copies the state into a free buffer: the only part it waits for;
2. a background thread computes the CRCs; one allgather of (bytes to send, a CRC of the replicated arrays) tells
   every rank what it will receive and catches replicas that disagree (silent data corruption) before anything
   is sent; then the unique bytes and their description travel around the ring, h ranks per copy, each rank
   keeping what arrives from h, 2h, .. replicas x h ranks back: h is the smallest distance at which no rank has
   a neighbour on its own node (`placement_hop`; the first snapshot of a generation allgathers where each rank
   is: its agent, or its Kubernetes node in a pod). The snapshot group's ring visits the nodes in turn
   (`ring_order`), so with as many workers on every node h is 1: each part crosses the network once;
3. a barrier: every rank holds its copies, the step is complete, and older snapshots go.
One is in flight at a time: the next snapshot waits for it.

Recovery (`recover`, every rank of the new generation, before train_fn resumes): each rank checks every CRC of
what it holds and lists it; the lists are allgathered; the newest step for which every old rank's unique part
survives somewhere, and one old rank's own snapshot whole (the replicated arrays), wins when it is newer than the
newest durable checkpoint (`choose`, pure); for each old rank the lowest new rank that holds it broadcasts it, and
each rank copies out the boxes it needs, resharding to the new world size, after checking the CRCs of what
arrived.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from SneppX_ALG import _native, errors
from SneppX_ALG.checkpoint import chunks, format
from SneppX_ALG.coordinator import state as state_lib
from SneppX_ALG.elastic import collectives

log = logging.getLogger(__name__)

PIECE = 4 << 20  # bytes per CRC32C
MAX_FREE_BUFFERS = 8  # buffers kept for reuse: a snapshot cycle frees its own, its wire and its copies
DEFAULT_MEMORY_FRACTION = 0.25  # of the host's memory, when no snapshot_memory_limit is given


@dataclasses.dataclass(eq=False)  # one snapshot is one object: lists of them are searched by identity
class Snapshot:
    """One rank's state at one step: `meta` describes `payload` (tensors at byte offsets, their CRCs)."""

    meta: dict[str, Any]
    payload: np.ndarray  # uint8

    @property
    def key(self) -> tuple[str, int, int]:
        """(run instance, generation, step): the ranks of one generation snapshot the same steps."""
        return self.meta["instance"], self.meta["generation"], self.meta["step"]

    @property
    def source(self) -> int:
        return int(self.meta["rank"])

    @property
    def unique_end(self) -> int:
        """Where the unique part's bytes (the Shards, first) end: its description's slot starts there."""
        return int(self.meta["unique_end"])

    def problems(self) -> list[str]:
        """What does not match its CRCs (empty: every byte checked and good)."""
        ranges = [(t["at"] + i * PIECE, min(PIECE, t["nbytes"] - i * PIECE))
                  for t in self.meta["tensors"] for i in range(len(t["crcs"]))]
        expected = [c for t in self.meta["tensors"] for c in t["crcs"]]
        if not ranges:
            return []
        got = _native.crc32c_ranges(self.payload, ranges)
        return [f"rank {self.source}'s snapshot of step {self.meta['step']}: bytes {at}..{at + n} fail their CRC32C"
                for (at, n), want, have in zip(ranges, expected, got, strict=True) if want != have]

    def unique(self) -> Snapshot:
        """What a peer keeps of it: the Shards (a view, no copy), without plain values or training state."""
        return Snapshot(_unique_meta(self.meta), self.payload[:self.unique_end])


def capture(obj: Any, step: int, *, instance: str, generation: int, rank: int, world: int,
            into: Callable[[int], np.ndarray], training_state: Any = None,
            admit: Callable[[int, int], None] | None = None,
            copier: Callable[[int], Any] | None = None) -> Snapshot:
    """Copies `obj` (what `ctx.save` takes) into a buffer from `into(nbytes)`: host arrays with a memcpy, their
    CRCs later (`seal`, off the training thread); CUDA tensors through `copier(device)`'s pinned staging, after
    the work queued on their producer's stream, hashed as they land. `admit(state bytes, unique bytes)` is asked
    first, before anything is allocated (it raises to refuse). `copier(device)`: a copy engine per device (the
    Keeper keeps them; by default one per call)."""
    copier = copier or functools.cache(_native.Copier)
    kind, leaves, values = state_lib.flatten_state(obj)
    for path, value in values:
        state_lib.check_json_safe(value, "/".join(path))
    ordered = sorted(leaves, key=lambda leaf: leaf[2] is None)  # Shards first: the unique part is a prefix
    meta: dict[str, Any] = {"instance": instance, "generation": generation, "step": int(step), "rank": rank,
                            "world": world, "kind": kind, "tensors": [], "unique_end": 0, "slot": 0}
    at = 0
    for path, leaf, shard in ordered:
        if shard is None and not meta["slot"]:  # the Shards end here: the slot for their description
            at = _reserve_slot(meta, at)
        on_device = isinstance(leaf, state_lib.DeviceArray)
        array = leaf if on_device else np.asarray(leaf)  # not ascontiguousarray: it makes a 0-d array 1-d
        shape, nbytes = tuple(array.shape), int(np.prod(array.shape, dtype=np.int64)) * array.dtype.itemsize
        meta["tensors"].append({"path": list(path), "dtype": _dtype_name(array.dtype), "local": list(shape),
                                "shape": list(shard.global_shape) if shard else list(shape),
                                "offset": list(shard.global_offset) if shard else None, "at": at,
                                "nbytes": nbytes, "crcs": []})
        at += _aligned(nbytes)  # each tensor starts 64-byte aligned
    if not meta["slot"]:
        at = _reserve_slot(meta, at)
    if admit is not None:
        admit(at, meta["unique_end"])
    payload = into(at)
    ordered_streams: set[tuple[int, int]] = set()
    for t, (_, leaf, _) in zip(meta["tensors"], ordered, strict=True):
        if isinstance(leaf, state_lib.DeviceArray):
            t["crcs"] = _copy_from_device(leaf, payload[t["at"]:t["at"] + t["nbytes"]], copier(leaf.device),
                                          ordered_streams)
            continue
        view = payload[t["at"]:t["at"] + t["nbytes"]].view(format.numpy_dtype(t["dtype"]))
        np.copyto(view.reshape(t["local"]), np.asarray(leaf), casting="no")
    meta["values"] = [{"path": list(p), "value": v} for p, v in values]
    meta["training_state"] = training_state
    return Snapshot(meta, payload)


_dtype_name = functools.lru_cache(maxsize=64)(format.dtype_name)  # numpy's dtype.name is slow, and asked per leaf


def _copy_from_device(leaf: state_lib.DeviceArray, into: np.ndarray, copier: Any,
                      ordered_streams: set[tuple[int, int]]) -> list[int]:
    """A CUDA tensor's bytes into host memory, PIECE by PIECE, and their CRCs: the copy engine hashes each piece
    as it lands. Ordered after the producer's stream (once per stream a snapshot), which may still be writing."""
    if leaf.stream is not None and (leaf.device, leaf.stream) not in ordered_streams:
        copier.wait_stream(leaf.stream)
        ordered_streams.add((leaf.device, leaf.stream))
    crcs = []
    for at in range(0, max(1, len(into)), PIECE):
        n = min(PIECE, len(into) - at)
        crcs.append(int(copier.copy(into[at:at + n], leaf.pointer + at, n, kind=_native.COPY_D2H) or 0) if n else 0)
    return crcs


_MAX_CRC = 0xFFFFFFFF  # the widest a CRC is written in JSON: the slot is sized with it
_LENGTH = 8  # bytes of the description's length, at the end of the slot


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def _unique_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """The description of the unique part: its Shards; no plain values or training state (every rank's own
    snapshot has those)."""
    return {**meta, "tensors": [t for t in meta["tensors"] if t["offset"] is not None], "values": [],
            "training_state": None}


def _reserve_slot(meta: dict[str, Any], at: int) -> int:
    """Marks the unique part's end at `at` and reserves room after it for its description, as long as it can be
    once the CRCs are known: the part then travels from the snapshot's own buffer (`wire_view`)."""
    widest = [{**t, "crcs": [_MAX_CRC] * max(1, -(-t["nbytes"] // PIECE))} for t in meta["tensors"]]
    text = json.dumps({**_unique_meta({**meta, "tensors": widest}), "unique_end": at, "slot": 1 << 62},
                      separators=(",", ":"))
    meta["unique_end"], meta["slot"] = at, _aligned(len(text) + _LENGTH)
    return at + meta["slot"]


def wire_view(snapshot: Snapshot) -> np.ndarray:
    """What travels of a sealed snapshot, a view of its own buffer: [unique part][its description, padded with
    spaces][the description's length, 8 bytes]. The unique part stays at offset 0, aligned, in the buffer that
    receives it."""
    start, slot = snapshot.unique_end, snapshot.meta["slot"]
    text = json.dumps(_unique_meta(snapshot.meta), separators=(",", ":")).encode()
    if len(text) > slot - _LENGTH:
        raise errors.SnapshotError(f"a snapshot's description ({len(text)} bytes) outgrew its slot ({slot})")
    wire = snapshot.payload[:start + slot]
    wire[start:start + slot - _LENGTH] = np.frombuffer(text.ljust(slot - _LENGTH), np.uint8)  # JSON allows spaces
    wire[-_LENGTH:] = np.frombuffer((slot - _LENGTH).to_bytes(_LENGTH, "little"), np.uint8)
    return wire


def seal(snapshot: Snapshot) -> None:
    """Fills in the CRCs of the host arrays (the background thread's first job; a CUDA tensor's came with its
    copy)."""
    ranges, owners = [], []
    for t in snapshot.meta["tensors"]:
        if t["crcs"]:
            continue
        pieces = max(1, -(-t["nbytes"] // PIECE))
        for i in range(pieces):
            ranges.append((t["at"] + i * PIECE, max(0, min(PIECE, t["nbytes"] - i * PIECE))))
            owners.append(t)
    crcs = _native.crc32c_ranges(snapshot.payload, ranges) if ranges else []
    for t, crc in zip(owners, crcs, strict=True):
        t["crcs"].append(int(crc))


def replicated_digest(snapshot: Snapshot) -> int:
    """One CRC32C over the CRCs of the replicated arrays: equal on every rank whose replicas agree."""
    crcs = [c for t in snapshot.meta["tensors"] if t["offset"] is None for c in t["crcs"]]
    return _native.crc32c(np.asarray(crcs, dtype=np.uint32)) if crcs else 0


def needed_bytes(state_bytes: int, unique_bytes: int, replicas: int) -> int:
    """Host memory snapshots of this rank hold at most: two of its own (the complete one and the one being
    taken), two of each peer's unique part it keeps (assumed as large as its own), and two parts in transit
    (what it sends, what it forwards)."""
    return 2 * (state_bytes + replicas * unique_bytes) + 2 * unique_bytes


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1


def host_memory(limits: tuple[str, ...] = CGROUP_LIMITS) -> int:
    """The memory this process may use: the machine's, or its container's limit when lower (in a pod the
    machine's memory is not what the OOM killer counts against)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in limits:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(total, int(text))
    return total


# ---- keeping them: what a worker holds across generations ------------------------------------------------------


class Keeper:
    """A worker's snapshots (its own and its peers'), which outlive a generation: the worker process does.

    `take` (training thread) copies and hands the rest to a background thread; `recover` (every rank, at the
    start of a generation) restores the newest complete snapshot."""

    def __init__(self, *, replicas: int = 1, memory_limit: int | None = None,
                 report: Callable[..., None] = lambda *a, **k: None):
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.replicas = replicas
        self.memory_limit = memory_limit if memory_limit is not None else int(host_memory() * DEFAULT_MEMORY_FRACTION)
        self.report = report
        self.own: list[Snapshot] = []
        self.held: list[Snapshot] = []
        self.complete: tuple[str, int, int] | None = None  # the newest key every rank holds copies of
        self.sent_bytes = 0  # unique bytes this rank sent to peers (all hops), since it started
        self.costs: dict[str, float] = {}  # of the newest snapshot: see _replicate
        self._free: list[np.ndarray] = []
        self._copiers: dict[int, Any] = {}  # a copy engine per CUDA device the state lives on
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._checked_memory = False
        self._placed: tuple[Any, list[str], int] = (None, [], 0)  # (group, each rank's place, the hop to copy at)

    # -- taking a snapshot --

    def take(self, obj: Any, step: int, group: collectives.ProcessGroup, *, instance: str, generation: int,
             place: str, rank: int | None = None, training_state: Any = None) -> None:
        """Snapshot `step` (every rank of the generation, same step; `place`: the node this rank is on, whose
        loss takes it; `rank`: its rank in the generation, when the group's ring visits the ranks in another
        order, `ring_order`). Waits for the previous one first and raises what it failed with."""
        began = time.perf_counter()
        self.wait()
        waited = time.perf_counter()
        if self._placed[0] is not group:  # a new generation: where is everyone?
            places = allgather_json(group, place) if group.world_size > 1 else [place]
            self._placed = (group, places, placement_hop(places))
        snapshot = capture(obj, step, instance=instance, generation=generation,
                           rank=group.rank if rank is None else rank,
                           world=group.world_size, into=self._buffer, training_state=training_state,
                           admit=None if self._checked_memory else self._check_memory, copier=self._copier)
        self.costs = {"wait_ms": 1e3 * (waited - began), "copy_ms": 1e3 * (time.perf_counter() - waited)}
        self._thread = threading.Thread(target=self._replicate, args=(snapshot, group),
                                        name="sneppx-snapshot", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the snapshot in flight is complete (or failed: its error is raised here, once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if isinstance(error, errors.SneppXError):
            raise error
        if error is not None:  # not the user's code: the generation ends, not the process with its snapshots
            raise errors.SnapshotError(f"the snapshot in flight failed: {type(error).__name__}: {error}") from error

    def _check_memory(self, total: int, unique: int) -> None:
        needed = needed_bytes(total, unique, self.replicas)
        if needed > self.memory_limit:
            raise errors.SnapshotMemoryError(
                f"peer-memory snapshots need {needed / 2**20:.1f} MiB of host memory on this rank "
                f"(2 x (state {total / 2**20:.1f} MiB + {self.replicas} peer copies) + 2 in transit), over "
                f"snapshot_memory_limit {self.memory_limit / 2**20:.1f} MiB: raise the limit, or snapshot less "
                "state", needed=needed, limit=self.memory_limit)
        self._checked_memory = True

    def _copier(self, device: int) -> Any:
        if device not in self._copiers:
            self._copiers[device] = _native.Copier(device)  # AcceleratorUnavailableError without CUDA
        return self._copiers[device]

    def _buffer(self, nbytes: int) -> np.ndarray:
        """A buffer of nbytes: the smallest free one that fits (their sizes repeat from snapshot to snapshot), else
        a new one."""
        fits = [i for i, buffer in enumerate(self._free) if len(buffer) >= nbytes]
        if fits:
            return self._free.pop(min(fits, key=lambda i: len(self._free[i])))[:nbytes]
        return np.empty(nbytes, np.uint8)

    def _replicate(self, snapshot: Snapshot, group: collectives.ProcessGroup) -> None:
        """The background thread: CRCs; one allgather of (wire bytes, replicated digest) per rank, which tells each
        rank what it will receive and catches replicas that disagree before anything is sent; the shifts; a
        barrier, after which every rank holds its copies. 2 + h ring rounds in all. Records what it cost in
        `costs` (the training thread's wait and copy, the background's wall and CPU time, the bytes sent)."""
        began, cpu, sent = time.perf_counter(), time.thread_time(), self.sent_bytes
        try:
            seal(snapshot)
            self.own.append(snapshot)
            if group.world_size > 1:
                _, places, hops = self._placed
                wire = wire_view(snapshot) if hops else np.zeros(0, np.uint8)
                sizes = np.zeros((group.world_size, 3), np.int64)  # ring position: wire bytes, digest, rank
                sizes[group.rank] = (len(wire), replicated_digest(snapshot), snapshot.source)
                group.allgather(sizes)
                different = sorted(int(sizes[p, 2]) for p in divergent(sizes[:, 1]))
                if different:
                    self.own.remove(snapshot)
                    raise errors.ReplicaDivergenceError(
                        f"step {snapshot.meta['step']}: the replicated arrays of rank(s) "
                        f"{', '.join(map(str, different))} differ from the other ranks' (silent data corruption "
                        "in a core or memory): the step is not kept. Arrays meant to differ between ranks are "
                        "not replicated: give them as Shards", step=snapshot.meta["step"], ranks=different)
                if hops:  # 0: every rank on one node, none to hold a copy
                    self._send_to_peers(wire, group, sizes[:, 0], places, hops)
                group.barrier()  # every rank holds its copies: the step is complete
            self._completed(snapshot.key)
            self.costs = {**self.costs, "background_ms": 1e3 * (time.perf_counter() - began),
                          "background_cpu_ms": 1e3 * (time.thread_time() - cpu), "sent_bytes": self.sent_bytes - sent}
        except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = e

    def _send_to_peers(self, wire: np.ndarray, group: collectives.ProcessGroup, sizes: np.ndarray,
                       places: list[str], hops: int) -> None:
        """Shifts this rank's wire `replicas x h` ranks around the ring, forwarding what arrives; keeps the copies
        from h, 2h, .. ranks back that come from another node."""
        outgoing, kept = wire, True  # the first to go is the rank's own snapshot: its buffer is not free
        for hop in range(1, min(self.replicas * hops, group.world_size - 1) + 1):
            source = (group.rank - hop) % group.world_size
            incoming = group.shift(outgoing, self._buffer(int(sizes[source])))
            self.sent_bytes += len(outgoing)
            if not kept:
                self._release(outgoing)  # sent, and not a copy this rank keeps: its buffer serves again
            kept = hop % hops == 0 and places[source] != places[group.rank]
            if kept:
                self.held.append(from_wire(incoming))
            outgoing = incoming
        if not kept:
            self._release(outgoing)

    def _release(self, buffer: np.ndarray) -> None:
        self._free.append(buffer.base if buffer.base is not None else buffer)
        if len(self._free) > MAX_FREE_BUFFERS:  # a layout that changed: the smallest are least likely to serve
            self._free.pop(min(range(len(self._free)), key=lambda i: len(self._free[i])))

    def _completed(self, key: tuple[str, int, int]) -> None:
        """`key` is held everywhere: older snapshots are no longer needed (their buffers are reused)."""
        self.complete = key
        for kept in (self.own, self.held):
            for snapshot in [s for s in kept if s.key != key]:
                kept.remove(snapshot)
                self._release(snapshot.payload)

    # -- recovering from them --

    def inventory(self) -> list[dict[str, Any]]:
        """What this rank holds that checks out, CRC by CRC (corrupt copies are dropped and reported)."""
        listed = []
        for kept in (self.own, self.held):
            for snapshot in list(kept):
                problems = snapshot.problems()
                if problems:
                    kept.remove(snapshot)
                    log.warning("dropping a corrupt snapshot copy: %s", problems[0])
                    self.report("snapshot_corrupt", step=snapshot.meta["step"], source=snapshot.source,
                                problems=problems[:3])
                    continue
                meta = json.dumps(snapshot.meta, separators=(",", ":")).encode()
                listed.append({"instance": snapshot.meta["instance"], "generation": snapshot.meta["generation"],
                               "step": snapshot.meta["step"], "world": snapshot.meta["world"],
                               "source": snapshot.source, "whole": kept is self.own, "meta": len(meta),
                               "payload": len(snapshot.payload)})
        return listed

    def find(self, key: tuple[str, int, int], source: int) -> Snapshot:
        return next(s for kept in (self.own, self.held) for s in kept if s.key == key and s.source == source)

    def recover(self, obj: Any, group: collectives.ProcessGroup, durable_step: int | None) -> Recovered:
        """Restores the newest snapshot every old rank's part of survives into `obj`, if newer than the newest
        durable checkpoint (every rank of the new generation calls it). Recovered.step is None when there is
        none, with the reason: restore from storage then."""
        try:
            self.wait()
        except errors.SneppXError as e:  # the last generation's snapshot in flight: it ended with it
            log.info("the snapshot in flight when the generation ended: %s", e)
        views = allgather_json(group, {"held": self.inventory(), "durable": durable_step})
        lists = [v["held"] for v in views]
        durable = [v["durable"] for v in views if v["durable"] is not None]  # a commit may land between listings
        plan = choose(lists, max(durable, default=None))
        if isinstance(plan, str):
            return Recovered(None, plan, 0)
        key, holders, whole = plan
        parts, received = [], 0
        for source in [whole] + [s for s in range(len(holders)) if s != whole]:  # the whole one first: apply()
            holder = holders[source]
            entry = next(e for e in lists[holder] if (e["instance"], e["generation"], e["step"]) == key
                         and e["source"] == source)
            if group.rank == holder:
                mine = self.find(key, source)
                meta = np.frombuffer(json.dumps(mine.meta, separators=(",", ":")).encode(), np.uint8).copy()
                payload = mine.payload
            else:
                meta, payload = np.empty(entry["meta"], np.uint8), np.empty(entry["payload"], np.uint8)
            group.broadcast(meta, root=holder)
            group.broadcast(payload, root=holder)
            part = Snapshot(json.loads(meta.tobytes()), payload)
            problems = part.problems()
            if problems:  # it checked out where it was held: it was corrupted on the way; the next generation
                raise errors.CommProtocolError(  # tries again, without that copy if it was the holder's memory
                    f"a snapshot part received from rank {holder}: {problems[0]}", rank=group.rank,
                    generation=group.generation, peer=holder)
            parts.append(part if source == whole else part.unique())
            received += len(payload) if group.rank != holder else 0
        try:
            apply(obj, parts)
            failure = ""
        except (errors.SneppXError, ValueError, TypeError) as e:  # e.g. a state that changed shape since
            failure = f"{type(e).__name__}: {e}"
        agreed = np.array([0 if failure else 1], np.int64)
        group.allreduce(agreed, op="min")  # one rank's failure sends every rank to storage, alike
        if not agreed[0]:
            log.warning("the snapshot of step %d did not apply here (%s): restoring from storage", key[2],
                        failure or "on another rank")
            return Recovered(None, f"the snapshot of step {key[2]} did not apply on every rank"
                             + (f" ({failure[:300]})" if failure else ""), received)
        return Recovered(key[2], f"restored from peer memory (step {key[2]})", received,
                         training_state=parts[0].meta.get("training_state"))


@dataclasses.dataclass(frozen=True)
class Recovered:
    """What `recover` did: the step restored (None: no snapshot could be used, `why` says why), the bytes
    this rank received from peers."""

    step: int | None
    why: str
    received: int
    training_state: Any = None


def from_wire(wire: np.ndarray) -> Snapshot:
    """A part as it arrived (`wire_view`'s layout); its payload a view of `wire`."""
    meta_len = int.from_bytes(wire[-8:].tobytes(), "little")
    end = len(wire) - 8 - meta_len
    return Snapshot(json.loads(wire[end:-8].tobytes()), wire[:end])


def ring_order(workers: list[int]) -> list[int]:
    """The generation's ranks in the order the snapshot group's ring visits them (node i has `workers[i]` ranks,
    numbered on from node i - 1's): one of each node in turn, so that with as many workers on every node no
    rank's neighbour is on its own node and a copy crosses one link, not h."""
    starts = [sum(workers[:i]) for i in range(len(workers))]
    return [starts[node] + local for local in range(max(workers, default=0))
            for node in range(len(workers)) if local < workers[node]]


def placement_hop(places: list[str]) -> int:
    """The smallest h such that rank r + h (around the ring) is on another node than rank r, for every r: each
    rank's copy then never shares its node. 0 when there is none (one node: no copy can survive its loss)."""
    world = len(places)
    return next((h for h in range(1, world) if all(places[r] != places[(r + h) % world] for r in range(world))), 0)


def divergent(digests: np.ndarray) -> list[int]:
    """Ranks whose replicated-array digest differs from the most common one (ties: from rank 0's)."""
    counts = Counter(int(d) for d in digests)
    top = max(counts.values())
    majority = int(digests[0]) if counts[int(digests[0])] == top else next(d for d, n in counts.items() if n == top)
    return [r for r, d in enumerate(digests) if int(d) != majority]


def allgather_json(group: collectives.ProcessGroup, value: Any) -> list[Any]:
    """Every rank's JSON value, in rank order (two allgathers: the lengths, then the padded bytes)."""
    data = json.dumps(value, separators=(",", ":")).encode()
    lengths = np.zeros(group.world_size, np.int64)
    lengths[group.rank] = len(data)
    group.allgather(lengths)
    rows = np.zeros((group.world_size, max(1, int(lengths.max()))), np.uint8)
    rows[group.rank, :len(data)] = np.frombuffer(data, np.uint8)
    group.allgather(rows)
    return [json.loads(rows[r, :int(n)].tobytes()) for r, n in enumerate(lengths)]


Choice = tuple[tuple[str, int, int], list[int], int]


def choose(lists: list[list[dict[str, Any]]], durable_step: int | None) -> Choice | str:
    """The snapshot to restore: its key, for each of its old ranks the new rank that sends that rank's part, and
    the old rank whose part is sent whole (its own snapshot, which also holds the replicated arrays and plain
    values). The newest step (then the newest generation) for which every old rank's part is held by someone
    and one old rank's own snapshot survives; the lowest new rank holding a part sends it, and an own snapshot
    is preferred to a copy. A reason instead when there is none, or none newer than the newest durable
    checkpoint. Pure: every rank decides alike."""
    holders: dict[tuple[str, int, int], dict[int, int]] = {}
    wholes: dict[tuple[str, int, int], dict[int, int]] = {}
    worlds: dict[tuple[str, int, int], int] = {}
    for rank, listed in enumerate(lists):
        for e in listed:
            key = (e["instance"], e["generation"], e["step"])
            holders.setdefault(key, {}).setdefault(e["source"], rank)
            if e.get("whole"):
                wholes.setdefault(key, {}).setdefault(e["source"], rank)
            worlds[key] = e["world"]
    if not holders:
        return "no snapshot survives (a new job, or every rank that held one is gone)"
    for key in sorted(holders, key=lambda k: (k[2], k[1]), reverse=True):
        if any(r not in holders[key] for r in range(worlds[key])) or not wholes.get(key):
            continue
        if durable_step is not None and durable_step > key[2]:
            return f"the durable checkpoint of step {durable_step} is newer than any snapshot (step {key[2]})"
        senders = [holders[key][r] for r in range(worlds[key])]
        whole = min(wholes[key])
        senders[whole] = wholes[key][whole]
        return key, senders, whole
    newest = max(holders, key=lambda k: (k[2], k[1]))
    lost = [r for r in range(worlds[newest]) if r not in holders[newest]]
    if not lost:
        return (f"no complete snapshot survives: the newest, step {newest[2]}, has no rank's own snapshot left "
                "(the replicated arrays)")
    return (f"no complete snapshot survives: the newest, step {newest[2]}, lost the part of rank(s) "
            f"{', '.join(map(str, lost))} with every copy")


def apply(obj: Any, parts: list[Snapshot]) -> None:
    """Copies what `parts` (one per old rank; the first whole, with the replicated arrays and plain values, the
    others their unique parts) hold into `obj`, each target getting its box of each tensor: the resharding."""
    pieces: dict[tuple[str, ...], list[tuple[dict[str, Any], np.ndarray]]] = {}
    for part in parts:
        for t in part.meta["tensors"]:
            data = part.payload[t["at"]:t["at"] + t["nbytes"]].view(format.numpy_dtype(t["dtype"]))
            pieces.setdefault(tuple(t["path"]), []).append((t, data.reshape(t["local"])))
    values = {tuple(v["path"]): v["value"] for v in parts[0].meta["values"]}
    targets = state_lib.restore_targets(obj)
    if targets is None:
        _apply_whole(obj, parts[0].meta["kind"], pieces, values)
        return
    for need, destination in zip(targets.needs, targets.destinations, strict=True):
        out = destination.data if isinstance(destination, state_lib.Shard) else destination
        want = need.box if need.box is not None else chunks.Box.whole(tuple(out.shape))
        filled = 0
        for t, data in pieces.get(need.path, []):
            if need.dtype is not None and need.dtype != t["dtype"]:
                raise errors.ShardingMismatchError(f"{'/'.join(need.path)} was snapshot as {t['dtype']}, the "
                                                   f"target is {need.dtype}")
            have = chunks.Box(tuple(t["offset"] or [0] * len(t["shape"])), tuple(t["local"]))
            common = chunks.intersect(have, want)
            if common is not None:
                out[common.slices(want.offset)] = data[common.slices(have.offset)]
                filled += common.volume
        if filled != want.volume:
            raise errors.ShardingMismatchError(f"{'/'.join(need.path)}: the snapshot covers {filled} of the "
                                               f"{want.volume} elements the target needs")
    missing = [p for p in targets.values if p not in values]
    if missing:
        raise errors.ShardingMismatchError(f"the snapshot has no value {'/'.join(missing[0])}")
    for path in targets.values:
        state_lib.set_path(targets.tree, list(path), values[path])  # type: ignore[arg-type]
    if targets.finish is not None:
        targets.finish(targets.tree)


def _apply_whole(obj: Any, kind: str, pieces: Mapping[tuple[str, ...], list[tuple[dict[str, Any], np.ndarray]]],
                 values: Mapping[tuple[str, ...], Any]) -> None:
    """A target with no Shards: every tensor whole, assembled from its boxes (as coordinator's whole restore)."""
    tree: dict[str, Any] = {}
    for path, boxes in pieces.items():
        first = boxes[0][0]
        whole = np.empty(first["shape"], format.numpy_dtype(first["dtype"]))
        for t, data in boxes:
            have = chunks.Box(tuple(t["offset"] or [0] * len(t["shape"])), tuple(t["local"]))
            whole[have.slices()] = data
        state_lib.set_path(tree, list(path), whole)
    for path, value in values.items():
        state_lib.set_path(tree, list(path), value)
    state_lib.load_whole(obj, kind, tree)
