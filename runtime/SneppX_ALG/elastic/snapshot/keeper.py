"""`Keeper`: what a worker holds across generations (its own snapshots and its peers' copies): `take` (the copy on
the training thread; the CRCs, one allgather, the shifts around the snapshot group's ring and a barrier on a
background thread) and `recover` at the start of a generation.

Separate because it is the stateful side of peer-memory snapshots, over the group (buffers, the thread in flight,
what each rank holds); the format, the decisions, the memory bound and the resharding it uses live below it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from SneppX_ALG import _native, collectives, errors
from SneppX_ALG.elastic.snapshot.image import (
    Snapshot,
    capture,
    from_wire,
    layout_of,
    replicated_digest,
    seal,
    wire_view,
)
from SneppX_ALG.elastic.snapshot.memory import DEFAULT_MEMORY_FRACTION, host_memory, needed_bytes
from SneppX_ALG.elastic.snapshot.plan import (
    Decision,
    Divergence,
    Durable,
    Held,
    choose,
    divergent,
    placement_hop,
)
from SneppX_ALG.elastic.snapshot.restore import apply

log = logging.getLogger(__name__)

MAX_FREE_BUFFERS = 8  # buffers kept for reuse: a snapshot cycle frees its own, its wire and its copies


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
        self.divergences: list[Divergence] = []  # steps whose replicas disagreed: they bind every source
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
            self.own.append(snapshot)  # unchecked until the allgather agrees: cut off before it, it says so
            snapshot.meta["agreed"] = group.world_size == 1
            if group.world_size > 1:
                _, places, hops = self._placed
                wire = wire_view(snapshot) if hops else np.zeros(0, np.uint8)
                sizes = np.zeros((group.world_size, 3), np.int64)  # ring position: wire bytes, digest, rank
                sizes[group.rank] = (len(wire), replicated_digest(snapshot), snapshot.source)
                group.allgather(sizes)
                different = sorted(int(sizes[p, 2]) for p in divergent(sizes[:, 1]))
                if different:
                    self.own.remove(snapshot)
                    agreed = [s.meta["step"] for s in self.own if s.key[:2] == snapshot.key[:2]
                              and s.meta["holds"] == snapshot.meta["holds"] and s.meta["agreed"]]
                    self.divergences.append(Divergence(*snapshot.key, since=max(agreed, default=-1) + 1))
                    raise errors.ReplicaDivergenceError(
                        f"step {snapshot.meta['step']}: the replicated arrays of rank(s) "
                        f"{', '.join(map(str, different))} differ from the other ranks' (silent data corruption "
                        "in a core or memory): the step is not kept. Arrays meant to differ between ranks are "
                        "not replicated: give them as Shards", step=snapshot.meta["step"], ranks=different)
                snapshot.meta["agreed"] = True
                if hops:  # 0: every rank on one node, none to hold a copy
                    self._send_to_peers(wire, group, sizes[:, 0], places, hops)
                group.barrier()  # every rank holds its copies: the step is complete
            self._completed(snapshot)
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

    def _completed(self, done: Snapshot) -> None:
        """`done` is held everywhere: older snapshots of the same object are no longer needed (their buffers are
        reused); another object's (`ctx.snapshot` of state not given to restore) stay."""
        key, holds = done.key, done.meta["holds"]
        self.complete = key
        for kept in (self.own, self.held):
            for snapshot in [s for s in kept if s.key != key and s.meta["holds"] == holds]:
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
                whole = kept is self.own
                listed.append({"instance": snapshot.meta["instance"], "generation": snapshot.meta["generation"],
                               "step": snapshot.meta["step"], "world": snapshot.meta["world"],
                               "source": snapshot.source, "whole": whole, "meta": len(meta),
                               "payload": len(snapshot.payload), "holds": snapshot.meta["holds"],
                               # a copy was sent only once the allgather agreed; an own one says what it found
                               "agreed": not whole or bool(snapshot.meta["agreed"]),
                               "digest": replicated_digest(snapshot) if whole else 0})
        return listed

    def find(self, key: tuple[str, int, int], source: int, holds: str) -> Snapshot:
        return next(s for kept in (self.own, self.held) for s in kept
                    if s.key == key and s.source == source and s.meta["holds"] == holds)

    def recover(self, obj: Any, group: collectives.ProcessGroup,
                durable: Callable[[int | None, Sequence[Divergence]], tuple[list[Durable], list[int]]]
                = lambda floor, verdicts: ([], [])) -> Recovered:
        """Decides where `obj` is restored from (`choose`, over what every rank holds, the divergence verdicts every
        rank knows, and the committed steps `durable(floor, verdicts)` checked: at least every one at or above
        `floor`, the newest usable snapshot's step; with verdicts, newest first until one counts) and, when it is
        memory, restores it (every rank of the new generation calls it). Recovered.step is None when storage is
        to be used, Recovered.decision says which step and why."""
        try:
            self.wait()
        except errors.SneppXError as e:  # the last generation's snapshot in flight: it ended with it
            log.info("the snapshot in flight when the generation ended: %s", e)
        views = allgather_json(group, {"held": self.inventory(),
                                       "divergences": [dataclasses.astuple(d) for d in self.divergences]})
        lists = [v["held"] for v in views]
        held = [Held(holder, e["instance"], e["generation"], e["step"], e["world"], e["source"], e["whole"],
                     e["agreed"], e["digest"], e["holds"]) for holder, listed in enumerate(lists) for e in listed]
        # every rank keeps every verdict: a rank new to the job learns what the old ones found
        self.divergences = sorted({Divergence(*d) for v in views for d in v["divergences"]},
                                  key=dataclasses.astuple)
        target = layout_of(obj)
        first = choose(held, [], [], self.divergences, target)
        checked, unchecked = durable(first.step if first.source == "memory" else None, self.divergences)
        decision = choose(held, checked, unchecked, self.divergences, target)
        if decision.source != "memory":
            return Recovered(None, decision.why, 0, decision=decision)
        assert decision.key is not None
        key = decision.key
        parts, received = [], 0
        for source, holder in decision.parts():  # the whole one first: apply() takes the plain values from it
            entry = next(e for e in lists[holder] if (e["instance"], e["generation"], e["step"]) == key
                         and e["source"] == source and e["holds"] == target)
            if group.rank == holder:
                mine = self.find(key, source, target)
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
            parts.append(part if source == decision.whole else part.unique())
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
            fallback = choose([], checked, unchecked, self.divergences, target)  # apply() wrote nothing
            return Recovered(None, f"the snapshot of step {key[2]} did not apply on every rank"
                             + (f" ({failure[:300]})" if failure else "") + f"; {fallback.why}", received,
                             decision=fallback)
        return Recovered(key[2], decision.why, received, training_state=parts[0].meta.get("training_state"),
                         decision=decision)


@dataclasses.dataclass(frozen=True)
class Recovered:
    """What `recover` did: the step restored from memory (None: storage is to be used, `decision` says which step
    and why), the bytes this rank received from peers."""

    step: int | None
    why: str
    received: int
    training_state: Any = None
    decision: Decision | None = None


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
