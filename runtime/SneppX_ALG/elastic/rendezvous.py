"""Membership generations agreed through the shared store, with no single point of failure.

Why: torchrun keeps its rendezvous in a TCPStore hosted by one agent, so losing that host ends the job
(pytorch#67742). Here the membership of each generation is one record in the store the job already has
for its checkpoints (a local or NFS directory, an S3 prefix; in a pod, a Kubernetes object), written once
with create-if-absent by whichever agent seals first: any agent can seal, none has to survive.

Records of generation g of run R (keys of a `contract.record.RecordStore`):

    rdzv/R/g000000007/join/<agent_id>   one per agent, created by that agent: N agents, N writes, no contention
    rdzv/R/g000000007/membership        created once, by the first agent to seal: one per generation
    rdzv/R/g000000007/sealer            renewed by whoever is sealing generation 7 while it forms
    rdzv/R/g000000007/alive             renewed by node 0 of generation 7 while it runs (compare-and-swap)
    rdzv/R/floor                        raised by each sweep: generations below it were removed
    rdzv/R/finished                     created when the run ends

1. An agent finds the newest generation g (probing prefixes: O(log G) listings). If g is sealed and lists
   it (same agent id and incarnation), that is its generation. If g is sealed without it, or g's
   membership is not a valid record (the generation is then void, for every agent alike), it moves on to
   g+1: a late joiner waits for the next generation.
2. It creates its join record at g and waits, polling with backoff (up to `poll_cap`). Every
   `lease_timeout / 4` it reads the floor (stalled while g was removed: it moves on to the floor's
   generation) and the lease of g-1; a late joiner (not a member of g-1) also renews its join record then,
   since a join proves liveness only while its owner renews it.
3. The natural sealer is the agent with the lowest id among the joins: it renews the generation's
   `sealer` record, lists the joins at every poll, reads each join record once and the chosen ones again
   right before it seals (a node killed and restarted meanwhile has replaced its join with its new
   incarnation), leaves out a late joiner whose join has not changed for `lease_timeout` (it died
   waiting), and seals as soon as `should_seal` says so.
   Every other agent only watches the `sealer` record; when it has stood still for k * `seal_grace`
   seconds (or k times three of the sealer's own poll periods, which it writes there, if longer: a slow
   store is not a dead sealer), the agent with the k-th lowest id takes over (the k before it died), so
   backups step in one at a time instead of as a herd, and N waiting agents never each read N records.
   Sealers may still race: create-if-absent lets exactly one membership exist, and the losers read it.
4. Ranks follow from the sealed member list alone (sorted by agent id): node rank = position; global
   rank = the workers of all lower node ranks + local rank (node_rank * workers + local_rank when every
   node runs the same number of workers); world size = all workers.

The seal decision (`should_seal`, pure; `choose_members` picks who). Generation g+1 seals only once
generation g is over: a member of g (by agent id) has joined g+1, or g is void, or node 0 of g has not
renewed g's `alive` record for `lease_timeout` seconds of the observer's own clock (no clocks are compared
between machines; silence is timed only between the observer's successful reads, so its own store outage
expires nothing). Until then agents that were not in g wait at g+1: the members of g see them with `poll`
(`waiting`: those whose join changed within `lease_timeout`; `admits`: and g has fewer than `max_nodes`)
and join them at a checkpoint boundary. Then it seals when `max_nodes` agents joined; or at once when every
member of g that no joiner suspects to be gone has joined (and at least `min_nodes` did): survivors of a
failure re-form without waiting; or when at least `min_nodes` joined and `last_call` seconds passed since
the observer first saw that many with g over (not since a late joiner began waiting: members arriving a
moment apart at a boundary all get in). `join_timeout` bounds forming (`RendezvousTimeoutError`); while g
demonstrably runs (its lease seen changing) the deadline stays `join_timeout` ahead: a late joiner waits as
long as the run goes on, until the run is marked finished (`RendezvousClosedError`).

Old generations go: the agent that sealed generation g raises the run's floor to g-1 and then deletes the records
of every generation below it (`sweep`, from `poll`), so a run keeps about two generations' records however long
it runs (in operator mode they share one ConfigMap of 1 MiB). Everything that could still look at a removed
generation reads the floor first (joins, a sealer right before it seals, every `check_fence`, `poll` every
`lease_timeout / 4`, a waiting agent every `lease_timeout / 4`).

A new launch of a finished run is a new run: the launcher calls `reopen_run` once, which removes the records
of a run marked finished (the `finished` record last) and returns the old verdict.

Requests beyond the join itself: every waiting agent reads the floor and g-1's lease every `lease_timeout / 4`
(and g-1's membership once, unless `join` was given it); a late joiner writes its join every `lease_timeout / 4`;
the sealer reads each late joiner's join every `lease_timeout / 4`; `poll` reads each late joiner's join
every `lease_timeout / 4` (few: late joiners are the agents outside the running generation).

docs/ELASTIC.md ("Rendezvous") has the safety argument (one membership per generation; no single point of
failure; why a partitioned minority can't commit a checkpoint, with `check_fence`) and the request counts.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import random
import re
import secrets
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from SneppX_ALG import errors
from SneppX_ALG.contract import record

log = logging.getLogger(__name__)

RECORD_VERSION = 1
MAX_NODES = 1024  # a membership of this many nodes stays well under contract.record.MAX_RECORD_BYTES
MAX_WORKERS = 1024
MAX_ADDRESS_CHARS = 300  # a DNS name (253) plus a port, or a bracketed IPv6 address and a port
READ_THREADS = 16  # parallel reads of join records by a sealer
MAX_PERIOD = 600.0  # the longest poll period a sealer's record may claim (a bigger one is ignored)
GENERATION_DIGITS = 9  # g000000007: listings sort like numbers up to a billion generations
INCARNATION_RE = re.compile(r"^[0-9a-f]{32}$")
ADDRESS_RE = re.compile(r"^[\x21-\x7e]{1,300}$")  # printable ASCII, no spaces
MAX_GENERATION = 10**GENERATION_DIGITS - 1


# ---- the records ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Member:
    """One node agent as it joined a generation."""

    agent_id: str  # unique among the live agents of a run, stable across restarts (host name, pod name)
    incarnation: str  # random per agent process: tells a restarted agent from the one that died
    host: str
    heartbeat: str  # "host:port" of the agent's heartbeat endpoint
    workers: int  # worker processes on this node (GPUs, or CPU slots)
    joined_at: float  # the joiner's wall clock, for people; never compared between machines


@dataclass(frozen=True)
class Join:
    """A join record: the member, and the agents it believes are gone (from heartbeat silence)."""

    member: Member
    suspects: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Membership:
    """A sealed generation. `members` are in node-rank order (sorted by agent id)."""

    run_id: str
    generation: int
    members: tuple[Member, ...]
    sealed_by: str

    def __post_init__(self) -> None:
        ids = [m.agent_id for m in self.members]
        if not ids or ids != sorted(set(ids)):
            raise ValueError("a membership lists at least one member, sorted by agent id, each once")

    @property
    def agent_ids(self) -> tuple[str, ...]:
        return tuple(m.agent_id for m in self.members)

    @property
    def world_size(self) -> int:
        return sum(m.workers for m in self.members)

    def includes(self, agent_id: str, incarnation: str) -> bool:
        """True if this very agent process (not only an agent of that id) is a member."""
        return any(m.agent_id == agent_id and m.incarnation == incarnation for m in self.members)

    def node_rank(self, agent_id: str) -> int:
        for rank, member in enumerate(self.members):
            if member.agent_id == agent_id:
                return rank
        raise ValueError(f"{agent_id} is not a member of generation {self.generation}")

    def rank_offset(self, agent_id: str) -> int:
        """The global rank of the agent's local rank 0: the workers of every lower node rank."""
        return sum(m.workers for m in self.members[:self.node_rank(agent_id)])

    def global_rank(self, agent_id: str, local_rank: int) -> int:
        workers = self.members[self.node_rank(agent_id)].workers
        if not 0 <= local_rank < workers:
            raise ValueError(f"local rank {local_rank} is outside 0..{workers - 1} on {agent_id}")
        return self.rank_offset(agent_id) + local_rank

    @property
    def instance(self) -> str:
        """16 hex digits naming this sealed membership and no other: its generation and its members' agent ids
        and incarnations (random per process). Keys derived from it can't collide with those of a run that
        reused the run id and generation numbers (a job deleted and created again under the same name)."""
        text = f"{self.run_id}/{self.generation}/" + ",".join(f"{m.agent_id}:{m.incarnation}" for m in self.members)
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class NextGeneration:
    """What `Rendezvous.poll` saw at the generation after a running one."""

    generation: int
    sealed: bool  # its membership exists: the running generation is over
    closing: frozenset[str]  # members of the running generation that joined it: the running one is over
    waiting: frozenset[str]  # agents not in the running generation that joined it: late joiners (from `poll`:
    #                          only those that renewed their join within lease_timeout, i.e. alive)
    collected: bool = False  # the running generation's records were removed: newer generations have run
    has_room: bool = True  # the running generation has fewer than max_nodes members

    @property
    def admits(self) -> bool:
        """Late joiners wait and the running generation is below `max_nodes`: re-form at the next checkpoint
        boundary to take them in. (A spare beyond max_nodes is never admitted: members come first.)"""
        return bool(self.waiting) and self.has_room

    @property
    def superseded(self) -> bool:
        """The running generation is over: stop its collectives and join this one."""
        return self.sealed or bool(self.closing) or self.collected

    def why(self) -> str:
        """Why the running generation is over, for people (only when `superseded`)."""
        if self.collected:
            return f"generation {self.generation - 1}'s records were removed: newer generations have run"
        if self.sealed:
            return f"generation {self.generation} is sealed"
        return f"generation {self.generation} was joined by {', '.join(sorted(self.closing))}"


@dataclass(frozen=True)
class RendezvousConfig:
    """Sizes and times of the rendezvous (seconds). Every agent of a run uses the same: whoever seals
    applies its own, and the others judge its silence by their `seal_grace`."""

    min_nodes: int = 1
    max_nodes: int = 1
    last_call: float = 10.0  # after min_nodes joined, how long to wait for more (torchrun: 30 s)
    join_timeout: float = 600.0  # how long join() waits for a generation that includes this agent
    seal_grace: float = 3.0  # silence of the sealer's record after which the next agent in line takes over
    lease_timeout: float = 30.0  # silence of a running generation's `alive` record that means it is gone
    poll_interval: float = 0.05  # first wait between reads of the membership; grows 1.5x per poll ...
    poll_max: float = 1.0  # ... up to this, or to max_nodes / job_poll_rate if longer:
    job_poll_rate: float = 50.0  # reads per second all waiting agents of a job make together, at most

    @property
    def poll_cap(self) -> float:
        """The longest wait between two polls of one agent. It grows with the job so that N waiting agents
        don't load the store (or the bill) N times as much: a store busy answering polls seals late."""
        return max(self.poll_max, self.max_nodes / self.job_poll_rate)

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes <= MAX_NODES:
            raise ValueError(f"need 1 <= min_nodes <= max_nodes <= {MAX_NODES}, got min_nodes={self.min_nodes}, "
                             f"max_nodes={self.max_nodes}")
        times = {"last_call": self.last_call, "join_timeout": self.join_timeout, "seal_grace": self.seal_grace,
                 "lease_timeout": self.lease_timeout, "poll_max": self.poll_max}
        for name, value in times.items():
            if not record.is_finite_number(value) or value < 0:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, not {value!r}")
        if not record.is_finite_number(self.poll_interval) or not 0 < self.poll_interval <= self.poll_max:
            raise ValueError(f"need 0 < poll_interval <= poll_max, got {self.poll_interval}, {self.poll_max}")
        if not record.is_finite_number(self.job_poll_rate) or self.job_poll_rate <= 0:
            raise ValueError(f"job_poll_rate must be a positive number, not {self.job_poll_rate!r}")


def generation_prefix(run_id: str, generation: int) -> str:
    return f"rdzv/{run_id}/g{generation:0{GENERATION_DIGITS}d}/"


def join_prefix(run_id: str, generation: int) -> str:
    return generation_prefix(run_id, generation) + "join/"


def join_key(run_id: str, generation: int, agent_id: str) -> str:
    return join_prefix(run_id, generation) + agent_id


def membership_key(run_id: str, generation: int) -> str:
    return generation_prefix(run_id, generation) + "membership"


def lease_key(run_id: str, generation: int) -> str:
    return generation_prefix(run_id, generation) + "alive"


def sealer_key(run_id: str, generation: int) -> str:
    return generation_prefix(run_id, generation) + "sealer"


def finished_key(run_id: str) -> str:
    return f"rdzv/{run_id}/finished"


def floor_key(run_id: str) -> str:
    return f"rdzv/{run_id}/floor"


def generation_of(run_id: str, key: str) -> int | None:
    """The generation a record key of the run belongs to (None: a key of the whole run, or another run's)."""
    head = f"rdzv/{run_id}/g"
    digits = key[len(head):len(head) + GENERATION_DIGITS]
    if not key.startswith(head) or len(digits) != GENERATION_DIGITS or not digits.isdigit():
        return None
    return int(digits) if key[len(head) + GENERATION_DIGITS:].startswith("/") else None


def member_to_json(member: Member) -> dict[str, Any]:
    return {"agent_id": member.agent_id, "incarnation": member.incarnation, "host": member.host,
            "heartbeat": member.heartbeat, "workers": member.workers, "joined_at": member.joined_at}


def join_to_json(run_id: str, generation: int, join: Join, renewals: int = 0) -> dict[str, Any]:
    """`renewals` changes whenever a waiting late joiner renews its join: the record changing is its proof
    of life."""
    return {"version": RECORD_VERSION, "kind": "join", "run_id": run_id, "generation": generation,
            "member": member_to_json(join.member), "suspects": sorted(join.suspects), "renewals": renewals}


def membership_to_json(membership: Membership) -> dict[str, Any]:
    return {"version": RECORD_VERSION, "kind": "membership", "run_id": membership.run_id,
            "generation": membership.generation, "sealed_by": membership.sealed_by,
            "members": [member_to_json(m) for m in membership.members]}


def parse_join(value: Any, *, key: str, run_id: str, generation: int, agent_id: str) -> Join:
    """A join record read from `key`, checked field by field; `InvalidRendezvousRecordError` otherwise."""
    _header(value, key, "join", {"member", "suspects", "renewals"}, run_id, generation)
    member = _member(value["member"], key)
    if member.agent_id != agent_id:
        raise errors.InvalidRendezvousRecordError(f"joins as {member.agent_id!r} under the key of {agent_id!r}",
                                                  key=key)
    suspects = value["suspects"]
    if (not isinstance(suspects, list) or len(suspects) > MAX_NODES
            or not all(isinstance(s, str) and record.is_segment(s) for s in suspects)):
        raise errors.InvalidRendezvousRecordError(f"suspects is not a list of at most {MAX_NODES} agent ids",
                                                  key=key)
    renewals = value["renewals"]
    if not isinstance(renewals, int) or isinstance(renewals, bool) or renewals < 0:
        raise errors.InvalidRendezvousRecordError("renewals is not an integer >= 0", key=key)
    return Join(member, frozenset(suspects))


def parse_membership(value: Any, *, key: str, run_id: str, generation: int) -> Membership:
    """A membership record read from `key`, checked field by field; `InvalidRendezvousRecordError`
    otherwise."""
    _header(value, key, "membership", {"sealed_by", "members"}, run_id, generation)
    members = value["members"]
    if not isinstance(members, list) or not 1 <= len(members) <= MAX_NODES:
        raise errors.InvalidRendezvousRecordError(f"members is not a list of 1 to {MAX_NODES} members", key=key)
    parsed = tuple(_member(m, key) for m in members)
    ids = [m.agent_id for m in parsed]
    if ids != sorted(set(ids)):
        raise errors.InvalidRendezvousRecordError("members are not sorted by agent id, each once", key=key)
    sealed_by = value["sealed_by"]
    if not isinstance(sealed_by, str) or not record.is_segment(sealed_by):
        raise errors.InvalidRendezvousRecordError("sealed_by is not an agent id", key=key)
    return Membership(run_id, generation, parsed, sealed_by)


def _header(value: Any, key: str, kind: str, fields: set[str], run_id: str, generation: int) -> None:
    expected = {"version", "kind", "run_id", "generation"} | fields
    if not isinstance(value, Mapping) or set(value) != expected:
        found = sorted(value) if isinstance(value, Mapping) else type(value).__name__
        raise errors.InvalidRendezvousRecordError(f"a {kind} record has the fields {sorted(expected)}, this one "
                                                  f"{found}", key=key)
    if value["version"] != RECORD_VERSION or value["kind"] != kind:
        raise errors.InvalidRendezvousRecordError(f"not a version {RECORD_VERSION} {kind} record (version "
                                                  f"{value['version']!r}, kind {value['kind']!r})", key=key)
    if value["run_id"] != run_id or value["generation"] != generation or isinstance(value["generation"], bool):
        raise errors.InvalidRendezvousRecordError(f"names run {value['run_id']!r} generation "
                                                  f"{value['generation']!r}, not where it is stored", key=key)


def _member(value: Any, key: str) -> Member:
    names = {"agent_id", "incarnation", "host", "heartbeat", "workers", "joined_at"}
    if not isinstance(value, Mapping) or set(value) != names:
        raise errors.InvalidRendezvousRecordError(f"a member has the fields {sorted(names)}", key=key)
    agent_id, incarnation, host, heartbeat = (value[n] for n in ("agent_id", "incarnation", "host", "heartbeat"))
    workers, joined_at = value["workers"], value["joined_at"]
    problems = [
        (isinstance(agent_id, str) and record.is_segment(agent_id), "agent_id is not an id"),
        (isinstance(incarnation, str) and bool(INCARNATION_RE.match(incarnation)),
         "incarnation is not 32 hex digits"),
        (isinstance(host, str) and bool(ADDRESS_RE.match(host)), "host is not printable ASCII of 1-300 chars"),
        (isinstance(heartbeat, str) and bool(ADDRESS_RE.match(heartbeat)),
         "heartbeat is not printable ASCII of 1-300 chars"),
        (isinstance(workers, int) and not isinstance(workers, bool) and 1 <= workers <= MAX_WORKERS,
         f"workers is not an integer in 1..{MAX_WORKERS}"),
        (record.is_finite_number(joined_at), "joined_at is not a finite number"),
    ]
    for ok, problem in problems:
        if not ok:
            raise errors.InvalidRendezvousRecordError(problem, key=key)
    return Member(agent_id, incarnation, host, heartbeat, workers, float(joined_at))


# ---- the decisions (pure) ------------------------------------------------------------------------------


def choose_members(joins: Sequence[Join], previous: Membership | None, max_nodes: int) -> tuple[Member, ...]:
    """At most `max_nodes` of the joiners, the members of the previous generation first (they hold the
    running state), then the others by agent id; returned in node-rank order (sorted by agent id)."""
    before = set(previous.agent_ids) if previous is not None else set()
    preferred = sorted(joins, key=lambda j: (j.member.agent_id not in before, j.member.agent_id))
    return tuple(sorted((j.member for j in preferred[:max_nodes]), key=lambda m: m.agent_id))


def previous_is_over(joined: Collection[str], previous: Membership | None, *, lease_expired: bool) -> bool:
    """Whether the generation before can no longer be running: there is none (or it is void), one of its
    members (by agent id) has joined this one, or its lease expired."""
    if previous is None or lease_expired:
        return True
    return not set(previous.agent_ids).isdisjoint(joined)


def should_seal(joined: Collection[str], suspected: Collection[str], previous: Membership | None, *,
                previous_over: bool, min_nodes: int, max_nodes: int, last_call: float,
                min_reached_for: float | None) -> bool:
    """Whether to seal a generation now (rules in the module docstring).

    `joined` are the agent ids of the valid join records; `suspected` the union of their suspects;
    `previous` is the sealed generation before (None if there is none or it is void); `min_reached_for` is
    how long the observer has seen at least `min_nodes` joins with the generation before over (None if it
    has not): last call starts when the generation before ends, not when a late joiner started waiting."""
    joined = set(joined)
    if not joined or not previous_over:
        return False
    if len(joined) >= max_nodes:
        return True
    if len(joined) < min_nodes:
        return False
    if previous is not None and set(previous.agent_ids) - set(suspected) <= joined:
        return True  # every member of the generation before that is not known to be gone is here
    return min_reached_for is not None and min_reached_for >= last_call


# ---- one agent's side of the protocol ------------------------------------------------------------------

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
    """

    def __init__(self, store: record.RecordStore, run_id: str, *, agent_id: str, host: str, heartbeat: str,
                 workers: int, config: RendezvousConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 wall_clock: Callable[[], float] = time.time):
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
        over commits nothing. docs/ELASTIC.md says what this does and doesn't guarantee."""
        nxt = self._next(membership, check_floor=True)
        if nxt.superseded:
            raise errors.StaleGenerationError(f"generation {membership.generation} of run {self.run_id} is over: "
                                              f"{nxt.why()}", generation=membership.generation)

    def _next(self, membership: Membership, *, check_floor: bool) -> NextGeneration:
        """What the generation after `membership` holds: one listing. With `check_floor`, and nothing there
        that ends `membership`, also one read of the floor: when newer generations have run and removed
        `membership`'s records and those of the generation after it, the listing is empty and only the floor
        tells (a process that stalled through several generations must not commit for its old one)."""
        generation = membership.generation + 1
        prefix = generation_prefix(self.run_id, generation)
        keys = self.store.keys(prefix)
        joined = {k[len(prefix) + len("join/"):] for k in keys if k.startswith(prefix + "join/")}
        members = set(membership.agent_ids)
        nxt = NextGeneration(generation, membership_key(self.run_id, generation) in keys,
                             frozenset(joined & members), frozenset(joined - members),
                             has_room=len(members) < self.config.max_nodes)
        if check_floor and not nxt.superseded and self.floor() > membership.generation:
            return replace(nxt, collected=True)
        return nxt

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
        try:
            stored = self.store.read(floor_key(self.run_id))
        except errors.RecordCorruptError as e:
            log.warning("%s: ignoring an invalid floor record: %s", self.agent_id, e)
            return 0
        value = None if stored is None else stored.value.get("generation")
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_GENERATION:
            return value
        return 0

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


# ---- a new launch of a finished run --------------------------------------------------------------------


def reopen_run(store: record.RecordStore, run_id: str) -> str | None:
    """Makes a finished run new: a launch under the run id of a run marked finished trains again (from its
    newest checkpoint) instead of stopping every agent with the old verdict. If `rdzv/<run_id>/finished`
    exists, removes every record of the run and returns the old verdict (its reason, for a log line);
    otherwise changes nothing and returns None. The launcher calls it once, before any agent of the launch
    joins.

    Why this order is safe: the records are listed before `finished` is read, so the list holds records of
    the finished run only (agents of a new launch write theirs once `finished` is gone); `finished` is removed
    last, so an agent of the old run still on its way out keeps finding the run finished, not generations
    vanishing under it; and the floor goes just before it, so the generations below it never reappear as
    "not sealed yet" while it stands. Interrupted, it is done again by the next launch (`finished` stays)."""
    if not isinstance(run_id, str) or not record.is_segment(run_id):
        raise ValueError(f"run_id {run_id!r} is not an id: [A-Za-z0-9][A-Za-z0-9._-]*, at most 253 chars")
    keys = store.keys(f"rdzv/{run_id}/")
    try:
        finished = store.read(finished_key(run_id))
    except errors.RecordCorruptError as e:  # not a verdict: `Rendezvous.join` ignores it too
        log.warning("run %s: ignoring an invalid finished record: %s", run_id, e)
        return None
    if finished is None:
        return None
    last = (floor_key(run_id), finished_key(run_id))
    for key in [k for k in keys if k not in last] + list(last):
        store.delete(key)
    log.info("run %s was finished (%r): its rendezvous records were removed for a new launch", run_id,
             finished.value.get("reason"))
    return str(finished.value.get("reason", ""))
