"""`Keeper`: what a worker holds across generations (its own snapshots and its peers' copies): `take` (the copy on
the training thread; the CRCs, one allgather, the shifts around the snapshot group's ring and a barrier on a
background thread) and `recover` at the start of a generation.

Separate because it is the stateful side of peer-memory snapshots, over the group (buffers, the thread in flight,
what each rank holds); the format, the decisions, the memory bound and the resharding it uses live below it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from SneppX_ALG import _native, collectives, errors
from SneppX_ALG.elastic.snapshot.image import (
    STATE,
    Cut,
    Snapshot,
    Wanted,
    bundle,
    bundle_bytes,
    capture,
    cut,
    from_wire,
    layout_of,
    replicated_digest,
    seal,
    unbundle,
    wanted_boxes,
    wire_view,
)
from SneppX_ALG.elastic.snapshot.memory import (
    DEFAULT_MEMORY_FRACTION,
    host_memory,
    needed_by_rank,
    needed_bytes,
    recovery_by_rank,
)
from SneppX_ALG.elastic.snapshot.plan import (
    Decision,
    Divergence,
    Durable,
    Held,
    choose,
    copy_distance,
    copy_holders,
    divergent,
)
from SneppX_ALG.elastic.snapshot.restore import apply

log = logging.getLogger(__name__)

MAX_FREE_BUFFERS = 8  # buffers kept for reuse: a snapshot cycle frees its own, its wire and its copies


class Keeper:
    """A worker's snapshots (its own and its peers'), which outlive a generation: the worker process does.

    `take` (training thread) copies and hands the rest to the keeper's background thread (one, started with the
    first snapshot, for the life of the process); `recover` (every rank, at the start of a generation) restores
    the newest complete snapshot."""

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
        self._taken: dict[str, float] = {}  # what the newest snapshot cost the training thread (take)
        self._background: dict[str, float] = {}  # and its background thread, once done (_replicate)
        self._free: list[np.ndarray] = []
        self._copiers: dict[int, Any] = {}  # a copy engine per CUDA device the state lives on
        self._jobs: queue.SimpleQueue[tuple[Snapshot, collectives.ProcessGroup]] = queue.SimpleQueue()
        self._idle = threading.Event()  # no snapshot in flight
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._placed: tuple[Any, list[list[int]]] = (None, [])  # (group, each position's copy holders)

    # -- taking a snapshot --

    def take(self, obj: Any, step: int, group: collectives.ProcessGroup, *, instance: str, generation: int,
             place: str, rank: int | None = None, training_state: Any = None, role: str = STATE) -> None:
        """Snapshot `step` (every rank of the generation, same step; `place`: the node this rank is on, whose
        loss takes it; `rank`: its rank in the generation, when the group's ring visits the ranks in another
        order, `ring_order`; `role`: image.STATE for what a restore fills, image.OTHER for state beside it). Waits
        for the previous one first and raises what it failed with. `costs` then says
        what it cost this (the training) thread: waiting, the copy, and all of take (`take_ms`)."""
        began = time.perf_counter()
        self.wait()
        waited = time.perf_counter()
        if self._placed[0] is not group:  # a new generation: where is everyone, and where do their copies go?
            self._place(group, place, group.rank if rank is None else rank)
        snapshot = capture(obj, step, instance=instance, generation=generation,
                           rank=group.rank if rank is None else rank,
                           world=group.world_size, into=self._buffer, training_state=training_state,
                           admit=functools.partial(self._check_memory, kept=self._kept_count(group.rank)),
                           copier=self._copier, role=role)
        copied = time.perf_counter()
        if self._thread is None:  # one thread for the life of the process: starting one costs a step's worth
            self._thread = threading.Thread(target=self._serve, name="sneppx-snapshot", daemon=True)
            self._thread.start()
        self._idle.clear()
        self._background = {}
        self._jobs.put((snapshot, group))
        self._taken = {"wait_ms": 1e3 * (waited - began), "copy_ms": 1e3 * (copied - waited),
                       "take_ms": 1e3 * (time.perf_counter() - began)}  # the hand-off (a thread woken) too

    @property
    def costs(self) -> dict[str, float]:
        """What the newest snapshot cost: the training thread (`take_ms`, all of take; of it `copy_ms` and
        `wait_ms`) and, once it is done, the background thread (`background_ms`, `background_cpu_ms`,
        `sent_bytes`)."""
        return {**self._taken, **self._background}

    def wait(self) -> None:
        """Until the snapshot in flight is complete (or failed: its error is raised here, once)."""
        self._idle.wait()
        error, self._error = self._error, None
        if isinstance(error, errors.SneppXError):
            raise error
        if error is not None:  # not the user's code: the generation ends, not the process with its snapshots
            raise errors.SnapshotError(f"the snapshot in flight failed: {type(error).__name__}: {error}") from error

    def _serve(self) -> None:
        while True:
            snapshot, group = self._jobs.get()
            try:
                self._replicate(snapshot, group)
            finally:
                self._idle.set()

    def _place(self, group: collectives.ProcessGroup, place: str, rank: int) -> None:
        """Where every position of the group is, and so which positions keep copies of each part; a part with
        fewer copies off its node than asked for is reported (the node's loss loses it: storage then), by its
        own rank, and rank 0 reports every such rank (`snapshot_placed`: the job's status says it)."""
        seen: list[Any] = allgather_json(group, [place, rank]) if group.world_size > 1 else [[place, rank]]
        places = [p for p, _ in seen]
        holders = copy_holders(places, self.replicas)
        if rank == 0:
            short = sorted(r for (_, r), h in zip(seen, holders, strict=True) if len(h) < self.replicas)
            self.report("snapshot_placed", rank=rank, replicas=self.replicas, unprotected=short)
        self._placed = (group, holders)
        mine = holders[group.rank]
        if len(mine) < self.replicas:
            log.warning("rank %d's snapshots have %d of %d copies off its node %s: %s", rank, len(mine),
                        self.replicas, place, "losing that node loses its part (storage then)" if not mine else
                        "fewer nodes than copies")
            self.report("snapshot_unprotected", rank=rank, place=place, copies=len(mine), replicas=self.replicas,
                        nodes=len(set(places)))

    def _kept_count(self, position: int) -> int:
        return sum(position in h for h in self._placed[1])

    def _check_memory(self, total: int, unique: int, *, kept: int) -> None:
        """Before the snapshot's buffer is allocated: this rank's own estimate (its peers' parts as large as its
        own); `_replicate` checks again with every rank's sizes before any copy arrives."""
        needed = needed_bytes(total, unique, kept)
        if needed > self.memory_limit:
            raise self._over(needed, self.memory_limit, f"state {size(total)} + {kept} peer copies")

    def _over(self, needed: int, limit: int, what: str, rank: str = "this rank") -> errors.SnapshotMemoryError:
        return errors.SnapshotMemoryError(
            f"peer-memory snapshots need {size(needed)} of host memory on {rank} (2 x ({what}) + 2 in "
            f"transit), over snapshot_memory_limit {size(limit)}: raise the limit, or snapshot less "
            "state", needed=needed, limit=limit)

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
        """The background thread: CRCs; one allgather of each rank's sizes, replicated digest and memory limit,
        which tells each rank what it will receive, checks every rank's memory bound with the sizes as they are
        and catches replicas that disagree, before anything is sent; the shifts; a barrier, after which every
        rank holds its copies. Records what it cost in `costs` (the background's wall and CPU time, the bytes
        sent)."""
        began, cpu, sent = time.perf_counter(), time.thread_time(), self.sent_bytes
        try:
            seal(snapshot)
            self.own.append(snapshot)  # unchecked until the allgather agrees: cut off before it, it says so
            snapshot.meta["agreed"] = group.world_size == 1
            if group.world_size > 1:
                holders = self._placed[1]
                wire = wire_view(snapshot) if holders[group.rank] else np.zeros(0, np.uint8)
                sizes = np.zeros((group.world_size, 5), np.int64)  # ring position: wire, digest, rank, state, limit
                sizes[group.rank] = (len(wire), replicated_digest(snapshot), snapshot.source, len(snapshot.payload),
                                     self.memory_limit)
                group.allgather(sizes)
                refused = self._refusal(sizes, holders)
                if refused is not None:
                    self.own.remove(snapshot)
                    raise refused
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
                self._send_to_peers(wire, group, sizes[:, 0], holders)
                group.barrier()  # every rank holds its copies: the step is complete
            self._completed(snapshot)
            self._background = {"background_ms": 1e3 * (time.perf_counter() - began),
                                "background_cpu_ms": 1e3 * (time.thread_time() - cpu),
                                "sent_bytes": self.sent_bytes - sent}
        except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
            if snapshot not in self.own:
                self._release(snapshot.payload)  # refused: its buffer serves again
            self._error = e

    def _refusal(self, sizes: np.ndarray, holders: list[list[int]]) -> errors.SnapshotMemoryError | None:
        """Every rank's bound, from every rank's sizes: all refuse alike, before a byte is sent, when any is over
        (a rank alone refusing would leave the others waiting in the ring)."""
        needed = needed_by_rank([int(n) for n in sizes[:, 3]], [int(n) for n in sizes[:, 0]], holders)
        over = [p for p in range(len(needed)) if needed[p] > int(sizes[p, 4])]
        if over:
            p = over[0]
            kept = sum(int(sizes[s, 0]) for s in range(len(holders)) if p in holders[s])
            return self._over(needed[p], int(sizes[p, 4]), f"state {size(int(sizes[p, 3]))} + peer copies "
                              f"{size(kept)}", rank=f"rank {int(sizes[p, 2])}")
        return None

    def _send_to_peers(self, wire: np.ndarray, group: collectives.ProcessGroup, sizes: np.ndarray,
                       holders: list[list[int]]) -> None:
        """Shifts every part around the ring as far as its farthest holder (`plan.copy_holders`), each rank
        forwarding what arrives while it still has a holder ahead, and keeping what is its to keep. Each round
        every rank sends (an empty array once the part it forwards has arrived everywhere it goes)."""
        world, me = group.world_size, group.rank
        distance = [copy_distance(holders, s) for s in range(world)]
        outgoing, kept = wire, True  # the first to go is the rank's own snapshot: its buffer is not free
        for hop in range(1, max(distance) + 1):
            sending = (me - hop + 1) % world  # whose part goes out this round
            source = (me - hop) % world  # whose arrives
            if hop > distance[sending]:
                outgoing = outgoing[:0]
            arriving = int(sizes[source]) if hop <= distance[source] else 0
            incoming = group.shift(outgoing, self._buffer(arriving) if arriving else np.empty(0, np.uint8))
            self.sent_bytes += len(outgoing)
            if not kept:
                self._release(outgoing)  # sent, and not a copy this rank keeps: its buffer serves again
            kept = hop <= distance[source] and me in holders[source]
            if kept:
                self.held.append(from_wire(incoming))
            outgoing = incoming
        if not kept:
            self._release(outgoing)

    def _release(self, buffer: np.ndarray) -> None:
        if buffer.base is None and not len(buffer):
            return  # an empty one of a round with nothing to send: no buffer of the keeper's
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
        try:
            layout: str | None = layout_of(obj)
        except (errors.SneppXError, ValueError, TypeError):  # the storage restore says what is wrong, on this rank
            layout = None
        views = allgather_json(group, {"held": self.inventory(), "target": layout,
                                       "divergences": [dataclasses.astuple(d) for d in self.divergences]})
        lists = [v["held"] for v in views]
        held = [Held(holder, e["instance"], e["generation"], e["step"], e["world"], e["source"], e["whole"],
                     e["agreed"], e["digest"], e["holds"]) for holder, listed in enumerate(lists) for e in listed]
        # every rank keeps every verdict: a rank new to the job learns what the old ones found
        self.divergences = sorted({Divergence(*d) for v in views for d in v["divergences"]},
                                  key=dataclasses.astuple)
        # every rank decides for the same target: a rank whose state is laid out otherwise than the others' would
        # decide alone (storage, while they wait for it in the transfer); then no snapshot holds it on every rank
        layouts = {v["target"] for v in views}
        target = layouts.pop() if len(layouts) == 1 and None not in layouts else "the ranks' states differ in layout"
        first = choose(held, [], [], self.divergences, target)
        checked, unchecked = durable(first.step if first.source == "memory" else None, self.divergences)
        decision = choose(held, checked, unchecked, self.divergences, target)
        if decision.source != "memory":
            return Recovered(None, decision.why, 0, decision=decision)
        assert decision.key is not None
        key = decision.key
        moved = self._transfer(obj, group, key, decision.parts(), target)
        if isinstance(moved, str):  # nothing was written
            log.warning("the snapshot of step %d is not restored: %s", key[2], moved)
            fallback = choose([], checked, unchecked, self.divergences, target)
            return Recovered(None, f"{moved}; {fallback.why}", 0, decision=fallback)
        parts, received = moved
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


    def _transfer(self, obj: Any, group: collectives.ProcessGroup, key: tuple[str, int, int],
                  senders: list[tuple[int, int]], holds: str) -> tuple[list[Snapshot], int] | str:
        """Each rank receives, of each old rank's part, only the boxes its own targets need (`wanted_boxes`; the
        whole part's replicated arrays and plain values too): one piece per old rank, the whole part's first, as
        `apply` takes them. One allgather of what each rank wants, one of what each sends each (and holds, and may
        use): every rank checks every rank's memory bound alike before a byte moves (a reason when one is over:
        storage then). Then, for each distance k around the ring, each holder's bundle for the rank k on is
        shifted k times; the CRCs of what arrives are checked."""
        world, me = group.world_size, group.rank
        try:
            mine: Wanted = wanted_boxes(obj)
        except (errors.SneppXError, ValueError, TypeError):  # apply says what is wrong with the target, alike
            mine = None
        wanted = allgather_json(group, mine)
        sources = [source for source, _ in senders]  # the whole one first: apply()
        holders, whole = dict(senders), sources[0]

        def cuts_for(dest: int) -> list[Cut]:
            return [cut(self.find(key, s, holds), wanted[dest], whole=s == whole) for s in sources if holders[s] == me]

        sizes = np.zeros((world, world + 2), np.int64)  # per position: bytes to each position, held, its limit
        sizes[me, :world] = [bundle_bytes(cuts_for(d)) for d in range(world)]
        sizes[me, world:] = (sum(len(s.payload) for kept in (self.own, self.held) for s in kept), self.memory_limit)
        group.allgather(sizes)
        needed = recovery_by_rank([[int(n) for n in row[:world]] for row in sizes], [int(n) for n in sizes[:, world]])
        over = [q for q in range(world) if needed[q] > sizes[q, world + 1]]
        if over:
            q = over[0]
            return (f"recovering the snapshot of step {key[2]} would hold {size(needed[q])} on rank {q} of "
                    f"the snapshot group (its snapshots, the boxes it receives, 2 in transit), over "
                    f"snapshot_memory_limit {size(int(sizes[q, world + 1]))}")
        pieces = unbundle(bundle(cuts_for(me), np.empty(int(sizes[me, me]), np.uint8)))
        received, corrupt = 0, ""
        for k in range(1, world):
            if not any(sizes[h, (h + k) % world] for h in range(world)):
                continue  # nothing travels this far
            outgoing = bundle(cuts_for((me + k) % world), np.empty(int(sizes[me, (me + k) % world]), np.uint8))
            for hop in range(1, k + 1):
                origin = (me - hop) % world
                outgoing = group.shift(outgoing, np.empty(int(sizes[origin, (origin + k) % world]), np.uint8))
            try:
                arrived = unbundle(outgoing)
                problems = [p for piece in arrived for p in piece.problems()]
            except (ValueError, KeyError, TypeError, IndexError) as e:  # its description (no CRC covers it)
                arrived, problems = [], [f"its description does not read: {type(e).__name__}: {e}"]
            if problems and not corrupt:  # it checked out where it was held: it was corrupted on the way
                corrupt = f"a snapshot piece received from rank {(me - k) % world}: {problems[0]}"
            pieces += arrived
            received += len(outgoing)
        bad = np.array([1 if corrupt else 0], np.int64)
        group.allreduce(bad, op="max")  # every rank ends alike: one raising alone leaves the others in a collective
        if bad[0]:  # the next generation tries again
            raise errors.CommProtocolError(corrupt or "a snapshot piece arrived corrupt on another rank", rank=me,
                                           generation=group.generation)
        by_source = {piece.source: piece for piece in pieces}
        return [by_source[s] for s in sources], received


def size(nbytes: int) -> str:
    """Bytes as a reason says them: MiB from 1 MiB on, else the bytes (a small state's 34560 needed against a
    33000 limit is not '0.0 MiB over 0.0 MiB')."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes} bytes"


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
