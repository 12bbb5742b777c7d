"""`Rendezvous`: one node agent's side of the protocol (the package docstring), a state machine over the shared
store: joining a generation (waiting, sealing, taking over from a silent sealer), watching the running one
(`poll`, `check_fence`), and removing old generations (`sweep`).

One concept, hence over 500 lines: the class and the private state it keeps between polls (`_Watch`, `_Beat`,
`_Observation`, `_Deadline`: what this agent has seen, timed on its own clock only). The records it writes, their
keys and the rules it applies live below it, pure; it adds the store requests, the clock and the waiting.
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
import secrets
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from SneppX_ALG import errors
from SneppX_ALG.contract import record
from SneppX_ALG.elastic.rendezvous import fence
from SneppX_ALG.elastic.rendezvous.codec import (
    ADDRESS_RE,
    MAX_ADDRESS_CHARS,
    MAX_WORKERS,
    RECORD_VERSION,
    Join,
    Member,
    Membership,
    join_to_json,
    membership_to_json,
    parse_join,
    parse_membership,
)
from SneppX_ALG.elastic.rendezvous.config import RendezvousConfig
from SneppX_ALG.elastic.rendezvous.keys import (
    MAX_GENERATION,
    finished_key,
    floor_key,
    generation_of,
    generation_prefix,
    join_key,
    join_prefix,
    lease_key,
    membership_key,
    sealer_key,
)
from SneppX_ALG.elastic.rendezvous.rules import NextGeneration, choose_members, previous_is_over, should_seal

log = logging.getLogger(__name__)

READ_THREADS = 16  # parallel reads of join records by a sealer
MAX_PERIOD = 600.0  # the longest poll period a sealer's record may claim (a bigger one is ignored)

VOID = "void"  # a generation whose membership record is not valid: every agent skips it


@dataclass
class _Watch:
    """A record another agent renews, as this agent sees it: its version, and for how long (this agent's
    clock) it has been seen not to change. An absent or invalid record counts as one unchanging version.
    Silence accumulates only between two successful reads: time this agent could not read the store (an
    outage of its own) is no evidence that the writer stopped."""

    observed: bool = False  # read at least once
    version: str | None = None
    read_at: float | None = None  # the last successful read; None: never read, or blind since
    silent_for: float = 0.0
    changed: bool = False  # this agent has seen the record change: its writer was alive meanwhile
    sealed: bool = False  # a `sealer` record that says the membership is written ...
    period: float = 0.0  # ... and how long its writer's polls take

    def blind(self) -> None:
        """A read failed: the silence resumes from the next successful read, without the gap."""
        self.read_at = None


@dataclass
class _Beat:
    """A record this agent renews (a generation's lease, a sealer's beat): what it last wrote, and when
    it is due again."""

    key: str
    written: record.Record | None = None
    due: float = 0.0
    count: int = 0


@dataclass
class _Observation:
    """What one agent has seen of one generation while waiting for it to seal (its own clock)."""

    joins: dict[str, Join | None] = field(default_factory=dict)  # by key; None: an invalid record
    previous: Membership | None = None
    previous_read: bool = False
    lease: _Watch = field(default_factory=_Watch)  # the generation before's `alive` record
    sealer: _Watch = field(default_factory=_Watch)  # this generation's `sealer` record
    beat: _Beat | None = None  # ours, while this agent is a sealer
    join: _Beat | None = None  # our join record, renewed while we wait as a late joiner ...
    join_value: dict[str, Any] = field(default_factory=dict)  # ... with this value
    looked_at: float | None = None  # the last look at the floor and the generation before (see `_look`)
    min_seen_at: float | None = None  # since when min_nodes joined with the generation before over
    natural: bool | None = None  # this agent seals: it has the lowest id, or it took over ...
    took_over: bool = False  # ... from a silent sealer
    place: int | None = None  # this agent's place among the joins, while the sealer is silent
    stepped_at: float | None = None  # while sealing: when the previous poll began
    finished_checked_at: float = 0.0
    joined: tuple[str, ...] = ()

    def blind(self) -> None:
        for watch in (self.lease, self.sealer):
            watch.blind()


@dataclass
class _Deadline:
    """When `join()` gives up; pushed back while the generation before demonstrably runs (see `_wait`)."""

    at: float


class Rendezvous:
    """One node agent's side of the rendezvous of run `run_id` (one per agent process; not thread-safe).

    Call order (the ElasticTrainer's agent)::

        rdzv = Rendezvous(store, "run-1", agent_id="node-0", host="node-0", heartbeat="127.0.0.1:29501",
                          workers=4, config=RendezvousConfig(min_nodes=2, max_nodes=4))
        membership = rdzv.join()                   # a first start or a restart: finds where the run is
        while training:
            nxt = rdzv.poll(membership)            # about once a second: one listing (+ the lease, node 0)
            if nxt.superseded or a peer failed:    # stop the workers' collectives first, then
                membership = rdzv.join(previous=membership, suspects=failed_agent_ids)
            elif nxt.admits and a checkpoint just committed:    # scale up at a checkpoint boundary
                membership = rdzv.join(previous=membership)
            ...
            rdzv.check_fence(membership)           # right before a checkpoint's commit point
        rdzv.finish()

    Store errors: `RecordUnavailableError` inside `join()` is retried until `join_timeout`; from `poll()` and
    `check_fence()` it propagates (a fence that can't be checked refuses the commit).

    `on_forming(previous, joined)`, if given, is called at each poll of the agent sealing a generation that has
    a sealed generation before it, with that generation and the agent ids joined so far (the listing the sealer
    makes anyway): in operator mode the agent reports there a member of `previous` that stalls the forming
    (pod.AbsentMembers). It must not block; a `RecordUnavailableError` from it counts as the store's.
    """

    def __init__(self, store: record.RecordStore, run_id: str, *, agent_id: str, host: str, heartbeat: str,
                 workers: int, config: RendezvousConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 wall_clock: Callable[[], float] = time.time,
                 on_forming: Callable[[Membership, tuple[str, ...]], None] | None = None):
        for name, value in (("run_id", run_id), ("agent_id", agent_id)):
            if not isinstance(value, str) or not record.is_segment(value):
                raise ValueError(f"{name} {value!r} is not an id: [A-Za-z0-9][A-Za-z0-9._-]*, at most 253 chars")
        for name, value in (("host", host), ("heartbeat", heartbeat)):
            if not isinstance(value, str) or not ADDRESS_RE.match(value):
                raise ValueError(f"{name} {value!r} is not printable ASCII of 1 to {MAX_ADDRESS_CHARS} chars")
        if not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"workers must be an integer in 1..{MAX_WORKERS}, not {workers!r}")
        self.store = store
        self.run_id = run_id
        self.agent_id = agent_id
        self.host = host
        self.heartbeat = heartbeat
        self.workers = workers
        self.config = config or RendezvousConfig()
        self.incarnation = secrets.token_hex(16)
        self._clock, self._sleep, self._wall_clock = clock, sleep, wall_clock
        self._on_forming = on_forming
        self._random = random.Random()
        self._newest_seen = 0
        self._lease: _Beat | None = None
        self._sweep_below: int | None = None  # records of generations below this are to be removed (we sealed)
        self._floor_checked_at: float | None = None
        self._join_watches: dict[str, _Watch] = {}  # the join records of late joiners, by key (`poll`, a sealer)

    # -- joining ------------------------------------------------------------------------------------------

    def join(self, *, previous: Membership | None = None, suspects: Iterable[str] = ()) -> Membership:
        """Blocks until a generation that includes this agent is sealed, and returns it.

        Without `previous` (a first start, a restart) the agent joins where the run is; with it (its
        generation is over: a peer failed, the next generation was opened, or it scales up at a checkpoint
        boundary) it joins the generation after. `suspects` are agent ids it believes gone; the sealer then
        does not wait for them. Raises `RendezvousTimeoutError` when no generation including it formed within
        `join_timeout` (time during which the generation before demonstrably ran does not count: a late
        joiner waits as long as it trains), and `RendezvousClosedError` if the run was marked finished."""
        deadline = _Deadline(self._clock() + self.config.join_timeout)
        gone = frozenset(suspects) - {self.agent_id}
        self._retrying(self._raise_if_finished, deadline)
        if previous is not None:
            generation = previous.generation + 1
        else:
            generation = self._retrying(self.newest_generation, deadline) or 0
        while True:
            if generation > MAX_GENERATION:
                raise errors.RendezvousError(f"run {self.run_id} has used up its {MAX_GENERATION} generations")
            outcome = self._join_generation(generation, gone, deadline, previous)
            if isinstance(outcome, Membership):
                return outcome
            generation = outcome

    def _join_generation(self, generation: int, suspects: frozenset[str], deadline: _Deadline,
                         previous: Membership | None) -> Membership | int:
        """The sealed membership this agent is in, or the next generation to try."""
        floor: int = self._retrying(self.floor, deadline)
        if generation < floor:
            return floor  # its records were removed: it ended long ago
        sealed = self._retrying(lambda: self._membership(generation), deadline)
        if sealed is not None:
            return self._outcome(generation, sealed)
        written: record.Record = self._retrying(lambda: self._write_join(generation, suspects), deadline)
        now = self._clock()
        seen = _Observation(finished_checked_at=now,  # join() just checked
                            join=_Beat(written.key, written, now + self.config.lease_timeout / 4),
                            join_value=written.value)
        if previous is not None and previous.generation == generation - 1:
            seen.previous, seen.previous_read = previous, True  # no need to read what the caller holds
        return self._wait(generation, deadline, seen)

    def _outcome(self, generation: int, sealed: Membership | str) -> Membership | int:
        if isinstance(sealed, Membership) and sealed.includes(self.agent_id, self.incarnation):
            log.info("%s: generation %d of %s sealed by %s: %d nodes, world size %d", self.agent_id, generation,
                     self.run_id, sealed.sealed_by, len(sealed.members), sealed.world_size)
            return sealed
        log.info("%s: generation %d of %s is %s; joining %d", self.agent_id, generation, self.run_id,
                 "void" if sealed == VOID else "sealed without this agent", generation + 1)
        return generation + 1

    def _write_join(self, generation: int, suspects: frozenset[str]) -> record.Record:
        """Creates this agent's join record; replaces one a previous incarnation of it left (that agent died:
        agent ids are unique among live agents) or garbage under its key. Returns the record as stored."""
        key = join_key(self.run_id, generation, self.agent_id)
        member = Member(self.agent_id, self.incarnation, self.host, self.heartbeat, self.workers,
                        self._wall_clock())
        value = join_to_json(self.run_id, generation, Join(member, suspects))
        for _ in range(8):
            try:
                return self.store.create(key, value)
            except errors.RecordExistsError:
                pass
            try:
                existing = self.store.read(key)
                if existing is None:
                    continue
                parsed = parse_join(existing.value, key=key, run_id=self.run_id, generation=generation,
                                    agent_id=self.agent_id)
            except (errors.RecordCorruptError, errors.InvalidRendezvousRecordError) as e:
                log.warning("%s: replacing an invalid record under its join key: %s", self.agent_id, e)
                self.store.delete(key)
                continue
            if parsed.member.incarnation == self.incarnation:
                return existing  # our own create, retried after its reply was lost
            try:
                return self.store.swap(key, value, existing.version)
            except errors.RecordConflictError:
                continue
        raise errors.RendezvousError(f"{key} kept changing while {self.agent_id} wrote its join record")

    def _wait(self, generation: int, deadline: _Deadline, seen: _Observation) -> Membership | int:
        """Waits for `generation` to seal, sealing it when this agent should.

        The sealer (the lowest id among the joins, as it last saw them) renews the generation's `sealer`
        record every `seal_grace / 3` seconds, polls at least every `seal_grace / 4`, reads the membership
        and lists the joins at every poll, reads each join record once, and once more right before it seals
        (a restarted agent may have replaced its join with its new incarnation since), and seals; its last
        renewal says `sealed`. The others read only the `sealer` record at each poll (one small read), and
        the membership once it says `sealed`. When it has stood still for k * `seal_grace` (k: their place
        among the joins, from one listing), the agent with the k-th lowest id takes over. N waiting agents
        never each list or read N records. Every `lease_timeout / 4` each also looks at the floor and the
        generation before (`_look`), and the sealer at the join records of the late joiners.

        While the generation before demonstrably runs (this agent saw its lease change, within
        `lease_timeout`), the deadline stays `join_timeout` ahead: it bounds forming, not a late joiner's
        wait for a checkpoint boundary."""
        interval = self.config.poll_interval
        while True:
            try:
                outcome = self._step(generation, seen, self._clock())
                if outcome is not None:
                    return outcome
            except errors.RecordUnavailableError as e:
                log.warning("%s: the store is unavailable (retrying until join_timeout): %s", self.agent_id, e)
                seen.blind()
                for watch in self._join_watches.values():
                    watch.blind()
            now = self._clock()
            lease = seen.lease
            if (seen.previous is not None and lease.changed and lease.read_at is not None
                    and lease.silent_for < self.config.lease_timeout):  # the generation before runs
                deadline.at = max(deadline.at, now + self.config.join_timeout)
            if now >= deadline.at:
                return self._give_up(generation, seen)
            pause = interval * self._random.uniform(0.8, 1.2)
            if seen.natural:
                pause = min(pause, self.config.seal_grace / 4)  # a sealer renews its record on time
            if self._is_late(seen):
                pause = min(pause, self.config.lease_timeout / 4)  # it renews its join on time
            self._sleep(min(pause, max(0.0, deadline.at - now)))
            interval = min(interval * 1.5, self.config.poll_cap)

    def _step(self, generation: int, seen: _Observation, now: float) -> Membership | int | None:
        """One poll while waiting (see `_wait`). None: keep waiting."""
        prefix = join_prefix(self.run_id, generation)
        if seen.natural is None:  # the first poll lists one key: is this agent the lowest id?
            seen.natural = self.store.keys(prefix, limit=1) == [prefix + self.agent_id]
        if now - seen.finished_checked_at >= self.config.lease_timeout:
            self._raise_if_finished()
            seen.finished_checked_at = now
        looking = seen.looked_at is None or now - seen.looked_at >= self.config.lease_timeout / 4
        if looking:
            floor = self._look(generation, seen, now)
            if floor is not None:
                return floor
        if not seen.natural:
            still = self._unchanged_for(sealer_key(self.run_id, generation), seen.sealer, now)
            if seen.sealer.sealed:
                sealed = self._membership(generation)
                if sealed is not None:
                    return self._outcome(generation, sealed)
            # a slow store slows the sealer's loop down: it says how long its loop takes, and silence is
            # judged against that too, so a busy store doesn't make every agent take over
            grace = max(self.config.seal_grace, 3 * seen.sealer.period)
            if still < grace:
                seen.place = None
                return None
            sealed = self._membership(generation)  # sealed by a sealer that died before saying so?
            if sealed is not None:
                return self._outcome(generation, sealed)
            if seen.place is None:  # one listing per silence: this agent's place in the line of sealers
                listed = [key[len(prefix):] for key in self.store.keys(prefix)]
                seen.joined = tuple(listed)
                seen.place = listed.index(self.agent_id) if self.agent_id in listed else len(listed)
            if still < grace * seen.place:
                return None
            log.info("%s: the sealer of generation %d is silent; taking over", self.agent_id, generation)
            seen.natural = seen.took_over = True
        sealed = self._membership(generation)
        if sealed is not None:
            return self._outcome(generation, sealed)
        if seen.beat is None:
            seen.beat = _Beat(sealer_key(self.run_id, generation))
        period = 0.0 if seen.stepped_at is None else round(now - seen.stepped_at, 3)
        seen.stepped_at = now
        self._renew(seen.beat, self._stamp("sealer", generation, sealed=False, period=period),
                    self.config.seal_grace / 3, now)
        keys = self.store.keys(prefix)
        if keys and keys[0] != prefix + self.agent_id and not seen.took_over:
            seen.natural = False  # a lower id joined since this agent first looked: it seals
            return None
        joins = self._read_joins(generation, keys, seen)
        previous = self._previous(generation, seen)
        if previous is not None:  # a late joiner that stopped renewing its join is gone: it is not sealed in
            late = [j.member.agent_id for j in joins
                    if j.member.agent_id not in previous.agent_ids and j.member.agent_id != self.agent_id]
            gone = self._gone_late_joiners(generation, late, now, look=looking)
            joins = [j for j in joins if j.member.agent_id not in gone]
            if self._on_forming is not None:
                self._on_forming(previous, tuple(j.member.agent_id for j in joins))
        suspected: set[str] = set().union(*(j.suspects for j in joins))
        if not self._ready(generation, [j.member.agent_id for j in joins], suspected, previous, seen, now):
            return None
        members = choose_members(joins, previous, self.config.max_nodes)
        if not self._joins_unchanged(generation, members, seen):
            return None  # e.g. a member restarted and replaced its join: decide again with what is there now
        floor = self.floor()
        if generation < floor:  # a sealer that stalled while newer generations ran and removed this one
            return floor
        outcome = self._seal(generation, members)
        if outcome is not None:  # tell the waiting agents to read the membership
            seen.beat.due = 0.0
            self._renew(seen.beat, self._stamp("sealer", generation, sealed=True, period=period),
                        self.config.seal_grace / 3, now)
        return outcome

    def _look(self, generation: int, seen: _Observation, now: float) -> int | None:
        """What every waiting agent checks every `lease_timeout / 4`: the floor (an agent that stalled while
        its generation was removed moves on to the floor's, instead of waiting in a generation no one will
        seal: the generation to try is returned), the lease of the generation before (is it running: see
        `_wait`), and, as a late joiner, it renews its own join record (members take a join that stopped
        changing for a dead agent's)."""
        floor = self.floor()
        if generation < floor:
            return floor
        previous = self._previous(generation, seen)
        if previous is not None:
            self._unchanged_for(lease_key(self.run_id, generation - 1), seen.lease, now)
        if seen.join is not None and self._is_late(seen):
            self._renew(seen.join, seen.join_value, self.config.lease_timeout / 4, now)
        seen.looked_at = now  # (not before: a look the store interrupted is done again at the next poll)
        return None

    def _is_late(self, seen: _Observation) -> bool:
        """This agent waits behind a sealed generation it is not a member of (by id): a late joiner."""
        return seen.previous is not None and self.agent_id not in seen.previous.agent_ids

    def _gone_late_joiners(self, generation: int, agent_ids: Iterable[str], now: float, *, look: bool) -> set[str]:
        """Of the late joiners `agent_ids` waiting at `generation`, those whose join record has not changed for
        `lease_timeout` (this agent's clock; time it could not read the store does not count): they stopped
        renewing it, so they are gone. Reads the record of each one seen for the first time, and of every one
        when `look` (every `lease_timeout / 4`): there are few late joiners."""
        watches: dict[str, _Watch] = {}
        for agent_id in agent_ids:
            key = join_key(self.run_id, generation, agent_id)
            watch = self._join_watches.get(key)
            if watch is None or look:
                watch = watch or _Watch()
                self._unchanged_for(key, watch, now)
            watches[key] = watch
        self._join_watches = watches  # the others stopped waiting
        prefix = join_prefix(self.run_id, generation)
        return {key[len(prefix):] for key, watch in watches.items() if watch.silent_for >= self.config.lease_timeout}

    def _fetch_joins(self, generation: int, keys: Collection[str], seen: _Observation) -> None:
        """Reads the join records under `keys` into `seen.joins`: one request each, in parallel (on S3 a few
        hundred in a row would take seconds)."""
        prefix = join_prefix(self.run_id, generation)

        def read(key: str) -> None:
            try:
                stored = self.store.read(key)
                if stored is None:  # withdrawn since the listing
                    seen.joins.pop(key, None)
                else:
                    seen.joins[key] = parse_join(stored.value, key=key, run_id=self.run_id,
                                                 generation=generation, agent_id=key[len(prefix):])
            except (errors.RecordCorruptError, errors.InvalidRendezvousRecordError) as e:
                log.warning("%s: ignoring an invalid join record: %s", self.agent_id, e)
                seen.joins[key] = None

        if keys:
            with concurrent.futures.ThreadPoolExecutor(min(READ_THREADS, len(keys))) as pool:
                list(pool.map(read, keys))

    def _read_joins(self, generation: int, keys: list[str], seen: _Observation) -> list[Join]:
        """The valid join records among the listed keys, sorted by agent id; each key is read once."""
        self._fetch_joins(generation, [key for key in keys if key not in seen.joins], seen)
        joins = [join for key in keys if (join := seen.joins.get(key)) is not None]
        seen.joined = tuple(j.member.agent_id for j in joins)
        return joins

    def _joins_unchanged(self, generation: int, members: Sequence[Member], seen: _Observation) -> bool:
        """Reads the chosen members' join records again right before the seal: True if each still holds what
        was read before (the same process; renewals aside). A killed and restarted agent replaces its join with
        its new incarnation, and the membership must name the process that is there, not the dead one."""
        keys = [join_key(self.run_id, generation, m.agent_id) for m in members]
        before = [seen.joins.get(key) for key in keys]
        self._fetch_joins(generation, keys, seen)
        return [seen.joins.get(key) for key in keys] == before

    def _previous(self, generation: int, seen: _Observation) -> Membership | None:
        """The sealed generation before (read once; None if there is none, or it is void)."""
        if not seen.previous_read and generation > 0:
            previous = self._membership(generation - 1)
            seen.previous = previous if isinstance(previous, Membership) else None
            seen.previous_read = previous is not None  # absent now may still be sealed later
        return seen.previous

    def _ready(self, generation: int, joined: list[str], suspected: set[str], previous: Membership | None,
               seen: _Observation, now: float) -> bool:
        """`should_seal` with what this agent has observed (its clock for last call and the lease)."""
        over = previous_is_over(joined, previous, lease_expired=False)
        if not over and previous is not None:
            over = self._unchanged_for(lease_key(self.run_id, generation - 1), seen.lease,
                                       now) >= self.config.lease_timeout
        # last call runs from when the generation before is over: a late joiner that waited through a whole
        # generation must not seal with the first of its members to arrive and leave the others out
        if over and len(joined) >= self.config.min_nodes:
            seen.min_seen_at = seen.min_seen_at if seen.min_seen_at is not None else now
        else:
            seen.min_seen_at = None
        return should_seal(joined, suspected, previous, previous_over=over, min_nodes=self.config.min_nodes,
                           max_nodes=self.config.max_nodes, last_call=self.config.last_call,
                           min_reached_for=None if seen.min_seen_at is None else now - seen.min_seen_at)

    def _unchanged_for(self, key: str, watch: _Watch, now: float) -> float:
        """For how long (this agent's clock, only between successful reads) the record under `key` has been
        seen not to change; reads it once."""
        try:
            stored = self.store.read(key)
            version = None if stored is None else stored.version
        except errors.RecordCorruptError:
            stored, version = None, "invalid"
        value: dict[str, Any] = {} if stored is None else stored.value
        watch.sealed = value.get("sealed") is True
        period: Any = value.get("period")
        watch.period = float(period) if record.is_finite_number(period) and 0 <= period <= MAX_PERIOD else 0.0
        if not watch.observed:
            watch.observed, watch.version = True, version
        elif version != watch.version:
            watch.changed, watch.version, watch.silent_for = True, version, 0.0
        elif watch.read_at is not None:
            watch.silent_for += now - watch.read_at
        watch.read_at = now
        return watch.silent_for

    def _seal(self, generation: int, members: tuple[Member, ...]) -> Membership | int | None:
        membership = Membership(self.run_id, generation, members, self.agent_id)
        try:
            self.store.create(membership_key(self.run_id, generation), membership_to_json(membership))
        except errors.RecordExistsError:
            sealed = self._membership(generation)  # sealed by another agent first (or our own retried write)
            return None if sealed is None else self._outcome(generation, sealed)
        log.info("%s: sealed generation %d of %s with %s", self.agent_id, generation, self.run_id,
                 ", ".join(membership.agent_ids))
        if generation >= 2:
            self._sweep_below = generation - 1  # removed by poll(), off the path to training
        return self._outcome(generation, membership)

    def _give_up(self, generation: int, seen: _Observation) -> Membership:
        """Withdraws this agent's join and raises `RendezvousTimeoutError`, unless a sealer included it in
        the meantime (then that membership is returned)."""
        prefix = join_prefix(self.run_id, generation)
        try:
            self._raise_if_finished()
            if self._membership(generation) is None:
                # who was there, for the error (the agents that only watched the sealer never listed)
                seen.joined = tuple(key[len(prefix):] for key in self.store.keys(prefix))
                self._previous(generation, seen)
                self.store.delete(join_key(self.run_id, generation, self.agent_id))
                sealed = self._membership(generation)  # sealed with us between the check and the delete?
                if isinstance(sealed, Membership) and sealed.includes(self.agent_id, self.incarnation):
                    return sealed
        except errors.RecordError as e:
            log.warning("%s: could not withdraw its join record: %s", self.agent_id, e)
        waiting_for = ""
        lease_expired = seen.lease.silent_for >= self.config.lease_timeout
        if seen.previous is not None and not previous_is_over(seen.joined, seen.previous, lease_expired=lease_expired):
            waiting_for = (f"; generation {generation - 1} ({', '.join(seen.previous.agent_ids)}) is still running "
                           "and none of its members joined")
        raise errors.RendezvousTimeoutError(
            f"{self.agent_id}: no generation of run {self.run_id} including it was sealed within "
            f"join_timeout={self.config.join_timeout}s: generation {generation} had {len(seen.joined)} agents "
            f"joined ({', '.join(seen.joined) or 'none seen'}), min_nodes={self.config.min_nodes}{waiting_for}",
            generation=generation, joined=seen.joined, min_nodes=self.config.min_nodes)

    # -- while a generation runs ---------------------------------------------------------------------------

    def poll(self, membership: Membership) -> NextGeneration:
        """What is happening at the generation after `membership`: one listing. Node 0 of the generation
        also renews its `alive` record here when due (every `lease_timeout / 4`), which keeps late joiners
        waiting for a checkpoint boundary instead of forming a generation of their own. Every
        `lease_timeout / 4` it also reads the run's floor (a generation whose records were removed is over,
        whatever the listing says) and the join record of each late joiner (one seen for the first time at
        once): `waiting` counts only those whose record changed within `lease_timeout` (a waiting late joiner
        renews it; a dead one's stands still). The agent that sealed `membership` removes the records of the
        generations before the previous one here (`sweep`)."""
        now = self._clock()
        if membership.members[0].agent_id == self.agent_id and membership.includes(self.agent_id,
                                                                                    self.incarnation):
            key = lease_key(self.run_id, membership.generation)
            if self._lease is None or self._lease.key != key:
                self._lease = _Beat(key)
            self._renew(self._lease, self._stamp("alive", membership.generation), self.config.lease_timeout / 4,
                        now)
        if self._sweep_below is not None:
            self.sweep()
        check_floor = self._floor_checked_at is None or now - self._floor_checked_at >= self.config.lease_timeout / 4
        if check_floor:
            self._floor_checked_at = now
        try:
            nxt = self._next(membership, check_floor=check_floor)
            gone = self._gone_late_joiners(nxt.generation, nxt.waiting, now, look=check_floor)
        except errors.RecordUnavailableError:
            for watch in self._join_watches.values():
                watch.blind()
            raise
        return replace(nxt, waiting=nxt.waiting - gone)

    def check_fence(self, membership: Membership) -> None:
        """Raises `StaleGenerationError` if a newer generation than `membership` exists (sealed, or joined
        by one of its members): called right before a checkpoint's commit point, so a generation that is
        over commits nothing (fence.py; docs/ELASTIC.md says what this does and doesn't guarantee)."""
        fence.check(self.store, membership)

    def _next(self, membership: Membership, *, check_floor: bool) -> NextGeneration:
        """What the generation after `membership` holds (fence.next_generation)."""
        return fence.next_generation(self.store, membership, check_floor=check_floor,
                                     max_nodes=self.config.max_nodes)

    def _stamp(self, kind: str, generation: int, **fields: Any) -> dict[str, Any]:
        """The value of a record only this agent renews (a lease, a sealer's record), less `renewals`."""
        return {"version": RECORD_VERSION, "kind": kind, "run_id": self.run_id, "generation": generation,
                "agent_id": self.agent_id, "incarnation": self.incarnation, **fields}

    def _renew(self, beat: _Beat, value: dict[str, Any], period: float, now: float) -> None:
        """Rewrites a record this agent renews (compare-and-swap on what it wrote last) with `value` and a
        new count of `renewals`, if it is due. Only that it changes matters to the agents watching it; a
        failed renewal is tried again next time."""
        if beat.written is not None and now < beat.due:
            return
        beat.count += 1
        value = {**value, "renewals": beat.count}
        try:
            if beat.written is None:
                try:
                    existing = self.store.read(beat.key)
                except errors.RecordCorruptError:
                    self.store.delete(beat.key)
                    existing = None
                beat.written = (self.store.create(beat.key, value) if existing is None
                                else self.store.swap(beat.key, value, existing.version))
            else:
                beat.written = self.store.swap(beat.key, value, beat.written.version)
            beat.due = now + period
        except errors.RecordConflictError:
            beat.written = None  # written by someone else since: read it next time
        except errors.RecordUnavailableError as e:
            log.warning("%s: could not renew %s: %s", self.agent_id, beat.key, e)

    # -- the run as a whole --------------------------------------------------------------------------------

    def newest_generation(self) -> int | None:
        """The newest generation with any record (None for a new run): exponential then binary search over
        generation prefixes, O(log G) listings of one key each. Generations are opened in order (an agent
        joins g+1 only after seeing g sealed or void), so every generation before the newest has records."""
        def opened(generation: int) -> bool:
            return bool(self.store.keys(generation_prefix(self.run_id, generation), limit=1))

        floor = self.floor()  # generations below it were removed; the floor's own has records
        low = max(self._newest_seen, floor)
        if not opened(low):
            if low == floor or not opened(floor):
                return None if floor == 0 else floor  # (the floor moved on meanwhile: joining finds it again)
            low = floor
        step = 1
        while low + step <= MAX_GENERATION and opened(low + step):
            low, step = low + step, step * 2
        high = min(low + step, MAX_GENERATION + 1)  # low is opened, high is not (or past the last)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if opened(middle) else (low, middle)
        self._newest_seen = low
        return low

    # -- removing old generations ---------------------------------------------------------------------------

    def floor(self) -> int:
        """The lowest generation of the run that may still have records (0 until a sweep raised it): records
        of generations below it were removed, and no agent joins, seals or commits for one of them."""
        return fence.floor(self.store, self.run_id)

    def sweep(self, limit: int = 64) -> bool:
        """Removes the records of the generations before the one before the generation this agent sealed last
        (`poll()` calls it; at most `limit` deletions per call). True when nothing is left to remove.

        Why it is safe: generation g is sealed, so g-1 is over, and g-2 ended before g-1 was sealed. Nothing
        live reads a generation below g-1: agents join g+1 or later, a sealer of g+1 reads only g's
        membership and lease, `poll`/`check_fence` of g-1 list only g. The floor is raised to g-1 *before*
        anything is removed, so an agent that stalled through all this (a join, a seal, a commit for an old
        generation) learns from the floor that its generation is over instead of reading its absence as
        "not sealed yet". What is left: an agent that read the floor and then stalled for a whole
        generation before creating a membership writes one stray record; its own next poll finds it over,
        and the next sweep removes it."""
        below = self._sweep_below
        if below is None:
            return True
        try:
            self._raise_floor(below)
            old = [k for k in self.store.keys(f"rdzv/{self.run_id}/")
                   if (g := generation_of(self.run_id, k)) is not None and g < below]
            for key in old[:limit]:
                self.store.delete(key)
        except errors.RecordError as e:  # tried again at the next poll
            log.warning("%s: could not remove the records of generations before %d: %s", self.agent_id, below, e)
            return False
        if len(old) > limit:
            return False
        self._sweep_below = None
        return True

    def _raise_floor(self, generation: int) -> None:
        """Sets the floor to `generation` unless it is already there or higher (compare-and-swap)."""
        key = floor_key(self.run_id)
        value = {"version": RECORD_VERSION, "kind": "floor", "run_id": self.run_id, "generation": generation,
                 "agent_id": self.agent_id, "at": self._wall_clock()}
        for _ in range(8):
            try:
                stored = self.store.read(key)
            except errors.RecordCorruptError:
                self.store.delete(key)
                continue
            current = None if stored is None else stored.value.get("generation")
            if isinstance(current, int) and not isinstance(current, bool) and current >= generation:
                return
            try:
                if stored is None:
                    self.store.create(key, value)
                else:
                    self.store.swap(key, value, stored.version)
                return
            except (errors.RecordExistsError, errors.RecordConflictError):
                continue  # another sweeper moved it: look again
        raise errors.RecordUnavailableError(f"{key} kept changing while {self.agent_id} raised it", key=key)

    def membership(self, generation: int) -> Membership | None:
        """The sealed membership of a generation; None if it is not sealed, or void."""
        sealed = self._membership(generation)
        return sealed if isinstance(sealed, Membership) else None

    def finish(self, reason: str = "") -> None:
        """Marks the run finished: agents still waiting to join stop with `RendezvousClosedError`."""
        value = {"version": RECORD_VERSION, "kind": "finished", "run_id": self.run_id, "agent_id": self.agent_id,
                 "reason": reason[:1000], "at": self._wall_clock()}
        try:
            self.store.create(finished_key(self.run_id), value)
        except errors.RecordExistsError:
            pass

    def _raise_if_finished(self) -> None:
        try:
            finished = self.store.read(finished_key(self.run_id))
        except errors.RecordCorruptError as e:
            log.warning("%s: ignoring an invalid finished record: %s", self.agent_id, e)
            return
        if finished is not None:
            raise errors.RendezvousClosedError(f"run {self.run_id} was marked finished by "
                                               f"{finished.value.get('agent_id')!r}: {finished.value.get('reason')!r}")

    def _membership(self, generation: int) -> Membership | str | None:
        """The generation's membership, VOID if its record is not valid, None if it is not sealed."""
        key = membership_key(self.run_id, generation)
        try:
            stored = self.store.read(key)
            if stored is None:
                return None
            return parse_membership(stored.value, key=key, run_id=self.run_id, generation=generation)
        except (errors.RecordCorruptError, errors.InvalidRendezvousRecordError) as e:
            log.warning("%s: generation %d is void: %s", self.agent_id, generation, e)
            return VOID

    def _retrying(self, action: Callable[[], Any], deadline: _Deadline) -> Any:
        """Runs a store action, retrying `RecordUnavailableError` with backoff until the deadline."""
        interval = self.config.poll_interval
        while True:
            try:
                return action()
            except errors.RecordUnavailableError as e:
                now = self._clock()
                if now >= deadline.at:
                    raise errors.RendezvousTimeoutError(
                        f"{self.agent_id}: the store stayed unavailable until join_timeout: {e}",
                        generation=self._newest_seen, min_nodes=self.config.min_nodes) from e
                log.warning("%s: the store is unavailable (retrying): %s", self.agent_id, e)
                self._sleep(min(interval, deadline.at - now))
                interval = min(interval * 2, self.config.poll_cap)
