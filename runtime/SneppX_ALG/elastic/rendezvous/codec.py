"""The rendezvous records' values: the member, join and membership types, their JSON encoding, and the checks
that turn any value read from the store into one of them or `InvalidRendezvousRecordError`.

Separate because a record is read by more than the agent that wrote it (every agent, the workers, the fuzz
targets): what a valid record is must not depend on the state machine that writes it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from SneppX_ALG import errors
from SneppX_ALG.contract import record

RECORD_VERSION = 1
MAX_NODES = 1024  # a membership of this many nodes stays well under contract.record.MAX_RECORD_BYTES
MAX_WORKERS = 1024
MAX_ADDRESS_CHARS = 300  # a DNS name (253) plus a port, or a bracketed IPv6 address and a port
INCARNATION_RE = re.compile(r"^[0-9a-f]{32}$")
ADDRESS_RE = re.compile(r"^[\x21-\x7e]{1,300}$")  # printable ASCII, no spaces


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
