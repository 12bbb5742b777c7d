"""Peer-memory snapshots: each rank's training state at a recent step kept in host memory, with a copy on
another node, so a failure costs the steps since the last snapshot (none, with one every step) instead of up to a
checkpoint interval.

Why memory, and a peer: a durable save of a large state is expensive, so checkpoints are minutes apart; a copy
into host memory is a memcpy, and a copy on the next node survives the loss of this one (Gemini, SOSP'23; NVIDIA
resiliency extension's local checkpoints). A snapshot is not a checkpoint: it never reaches storage, and when no
complete one survives the job restores the newest durable checkpoint as before.

What a snapshot is: one rank's tensors (its `Shard`s first, then the replicated arrays) copied into a buffer
reused from step to step, a CRC32C per `PIECE` bytes of each tensor, and a small JSON description (paths,
dtypes, boxes, plain values). Only the unique part travels to the peer: a rank's Shards, and rank 0's
replicated arrays too, which is about 1/N of the state per rank with ZeRO-1 data parallelism.

Per snapshot of step s (the generation's `snapshot` group, a TCP ring of its own, docs/ELASTIC.md):
1. the training thread copies the state into a free buffer: the only part it waits for;
2. a background thread computes the CRCs; one allgather of (bytes to send, a CRC of the replicated arrays) tells
   every rank what it will receive and catches replicas that disagree (silent data corruption) before anything
   is sent; then the unique bytes and their description travel around the ring, h ranks per copy, each rank
   keeping what arrives from h, 2h, .. replicas x h ranks back: h is the smallest distance at which no rank has
   a neighbour on its own node (`placement_hop`; the first snapshot of a generation allgathers where each rank
   is: its agent, or its Kubernetes node in a pod);
3. a barrier: every rank holds its copies, the step is complete, and older snapshots go.
One is in flight at a time: the next snapshot waits for it.

Recovery (`recover`, every rank of the new generation, before train_fn resumes): each rank checks every CRC of
what it holds and lists it; the lists are allgathered; the newest step for which every old rank's unique part
survives somewhere wins when it is newer than the newest durable checkpoint (`choose`, pure); for each old rank
the lowest new rank that holds it broadcasts it, and each rank copies out the boxes it needs, resharding to the
new world size, after checking the CRCs of what arrived.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
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
        """What a peer keeps of it: the Shards, and rank 0's replicated arrays (a view, no copy)."""
        if self.meta["rank"] == 0:
            return self
        tensors = [t for t in self.meta["tensors"] if t["offset"] is not None]
        end = max((t["at"] + t["nbytes"] for t in tensors), default=0)
        return Snapshot({**self.meta, "tensors": tensors, "values": []}, self.payload[:end])


def capture(obj: Any, step: int, *, instance: str, generation: int, rank: int, world: int,
            into: Callable[[int], np.ndarray], training_state: Any = None,
            admit: Callable[[int, int], None] | None = None) -> Snapshot:
    """Copies `obj` (what `ctx.save` takes) into a buffer from `into(nbytes)`; the CRCs come later (`seal`).
    `admit(state bytes, unique bytes)` is asked first, before anything is allocated (it raises to refuse)."""
    kind, leaves, values = state_lib.flatten_state(obj)
    for path, leaf, _ in leaves:
        if isinstance(leaf, state_lib.DeviceArray):
            raise errors.UnsupportedTensorError(f"{'/'.join(path)}: snapshots take host arrays for now; copy "
                                                "CUDA tensors to the host (docs/ELASTIC.md, what is not covered)")
    for path, value in values:
        state_lib.check_json_safe(value, "/".join(path))
    ordered = sorted(leaves, key=lambda leaf: leaf[2] is None)  # Shards first: the unique part is a prefix
    tensors, at = [], 0
    for path, leaf, shard in ordered:
        array = np.asarray(leaf)  # not ascontiguousarray: it makes a 0-d array 1-d
        tensors.append({"path": list(path), "dtype": _dtype_name(array.dtype), "local": list(array.shape),
                        "shape": list(shard.global_shape) if shard else list(array.shape),
                        "offset": list(shard.global_offset) if shard else None, "at": at, "nbytes": array.nbytes,
                        "crcs": []})
        at += -(-array.nbytes // 64) * 64  # each tensor starts 64-byte aligned
    if admit is not None:
        unique = at if rank == 0 else max((t["at"] + t["nbytes"] for t in tensors if t["offset"] is not None),
                                          default=0)
        admit(at, unique)
    payload = into(at)
    for t, (_, leaf, _) in zip(tensors, ordered, strict=True):
        view = payload[t["at"]:t["at"] + t["nbytes"]].view(format.numpy_dtype(t["dtype"]))
        np.copyto(view.reshape(t["local"]), np.asarray(leaf), casting="no")
    meta = {"instance": instance, "generation": generation, "step": int(step), "rank": rank, "world": world,
            "kind": kind, "tensors": tensors, "values": [{"path": list(p), "value": v} for p, v in values],
            "training_state": training_state}
    return Snapshot(meta, payload)


_dtype_name = functools.lru_cache(maxsize=64)(format.dtype_name)  # numpy's dtype.name is slow, and asked per leaf


def seal(snapshot: Snapshot) -> None:
    """Fills in the CRCs (the background thread's first job)."""
    ranges, owners = [], []
    for t in snapshot.meta["tensors"]:
        pieces = max(1, -(-t["nbytes"] // PIECE))
        for i in range(pieces):
            ranges.append((t["at"] + i * PIECE, max(0, min(PIECE, t["nbytes"] - i * PIECE))))
            owners.append(t)
    crcs = _native.crc32c_ranges(snapshot.payload, ranges) if ranges else []
    for t in snapshot.meta["tensors"]:
        t["crcs"] = []
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
        self._free: list[np.ndarray] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._checked_memory = False
        self._placed: tuple[Any, list[str], int] = (None, [], 0)  # (group, each rank's place, the hop to copy at)

    # -- taking a snapshot --

    def take(self, obj: Any, step: int, group: collectives.ProcessGroup, *, instance: str, generation: int,
             place: str, training_state: Any = None) -> None:
        """Snapshot `step` (every rank of the generation, same step; `place`: the node this rank is on, whose
        loss takes it). Waits for the previous one first and raises what it failed with."""
        self.wait()
        if self._placed[0] is not group:  # a new generation: where is everyone?
            places = allgather_json(group, place) if group.world_size > 1 else [place]
            self._placed = (group, places, placement_hop(places))
        snapshot = capture(obj, step, instance=instance, generation=generation, rank=group.rank,
                           world=group.world_size, into=self._buffer, training_state=training_state,
                           admit=None if self._checked_memory else self._check_memory)
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
        barrier, after which every rank holds its copies. 2 + h ring rounds in all."""
        try:
            seal(snapshot)
            self.own.append(snapshot)
            if group.world_size > 1:
                _, places, hops = self._placed
                wire = self._wire(snapshot.unique()) if hops else np.zeros(0, np.uint8)
                sizes = np.zeros((group.world_size, 2), np.int64)
                sizes[group.rank] = (len(wire), replicated_digest(snapshot))
                group.allgather(sizes)
                different = divergent(sizes[:, 1])
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
        except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = e

    def _wire(self, part: Snapshot) -> np.ndarray:
        """What travels: the payload, then the description, then its length (8 bytes): the payload stays at
        offset 0, aligned, in the buffer that receives it."""
        meta = json.dumps(part.meta, separators=(",", ":")).encode()
        wire = self._buffer(len(part.payload) + len(meta) + 8)
        wire[:len(part.payload)] = part.payload
        wire[len(part.payload):-8] = np.frombuffer(meta, np.uint8)
        wire[-8:] = np.frombuffer(len(meta).to_bytes(8, "little"), np.uint8)
        return wire

    def _send_to_peers(self, wire: np.ndarray, group: collectives.ProcessGroup, sizes: np.ndarray,
                       places: list[str], hops: int) -> None:
        """Shifts this rank's wire `replicas x h` ranks around the ring, forwarding what arrives; keeps the copies
        from h, 2h, .. ranks back that come from another node."""
        outgoing, kept = wire, False
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
                               "source": snapshot.source, "meta": len(meta), "payload": len(snapshot.payload)})
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
        key, holders = plan
        parts, received = [], 0
        for source, holder in enumerate(holders):
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
            parts.append(part if source == 0 else part.unique())
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
    """A part as it arrived (Keeper._wire's layout); its payload a view of `wire`."""
    meta_len = int.from_bytes(wire[-8:].tobytes(), "little")
    end = len(wire) - 8 - meta_len
    return Snapshot(json.loads(wire[end:-8].tobytes()), wire[:end])


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


def choose(lists: list[list[dict[str, Any]]], durable_step: int | None) -> tuple[tuple[str, int, int], list[int]] | str:
    """The snapshot to restore and, for each of its old ranks, the new rank that sends it: the newest step
    (then the newest generation) for which every old rank's part is held by someone. A reason instead when
    there is none, or none newer than the newest durable checkpoint. Pure: every rank decides alike."""
    holders: dict[tuple[str, int, int], dict[int, int]] = {}
    worlds: dict[tuple[str, int, int], int] = {}
    for rank, listed in enumerate(lists):
        for e in listed:
            key = (e["instance"], e["generation"], e["step"])
            holders.setdefault(key, {}).setdefault(e["source"], rank)
            worlds[key] = e["world"]
    if not holders:
        return "no snapshot survives (a new job, or every rank that held one is gone)"
    for key in sorted(holders, key=lambda k: (k[2], k[1]), reverse=True):
        missing = [r for r in range(worlds[key]) if r not in holders[key]]
        if missing:
            continue
        if durable_step is not None and durable_step > key[2]:
            return f"the durable checkpoint of step {durable_step} is newer than any snapshot (step {key[2]})"
        return key, [holders[key][r] for r in range(worlds[key])]
    newest = max(holders, key=lambda k: (k[2], k[1]))
    lost = [r for r in range(worlds[newest]) if r not in holders[newest]]
    return (f"no complete snapshot survives: the newest, step {newest[2]}, lost the part of rank(s) "
            f"{', '.join(map(str, lost))} with every copy")


def apply(obj: Any, parts: list[Snapshot]) -> None:
    """Copies what `parts` (part r: old rank r's; part 0 also holds the replicated arrays and plain values)
    hold into `obj`, each target getting its box of each tensor: the resharding."""
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
