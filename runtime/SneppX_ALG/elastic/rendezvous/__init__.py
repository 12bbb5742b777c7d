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

The package, one concept a module (each imports only those below it; `.importlinter` checks it):

    machine.py   `Rendezvous`: one agent's side of the protocol, a state machine over the store
    reopen.py    `reopen_run`: a new launch of a finished run (the launcher's, not an agent's)
    rules.py     the seal decision and what `poll` saw (`should_seal`, `choose_members`, `NextGeneration`): pure
    config.py    `RendezvousConfig`: the sizes and times every agent of a run applies alike
    codec.py     the records' values (`Member`, `Join`, `Membership`): JSON encoding, and field-by-field checks
    keys.py      the records' key names, and the generation a key belongs to

Every name is re-exported here: callers import `SneppX_ALG.elastic.rendezvous` and nothing below it.
"""

from __future__ import annotations

from SneppX_ALG.elastic.rendezvous.codec import (
    ADDRESS_RE,
    INCARNATION_RE,
    MAX_ADDRESS_CHARS,
    MAX_NODES,
    MAX_WORKERS,
    RECORD_VERSION,
    Join,
    Member,
    Membership,
    join_to_json,
    member_to_json,
    membership_to_json,
    parse_join,
    parse_membership,
)
from SneppX_ALG.elastic.rendezvous.config import RendezvousConfig
from SneppX_ALG.elastic.rendezvous.keys import (
    GENERATION_DIGITS,
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
from SneppX_ALG.elastic.rendezvous.machine import MAX_PERIOD, READ_THREADS, VOID, Rendezvous
from SneppX_ALG.elastic.rendezvous.reopen import reopen_run
from SneppX_ALG.elastic.rendezvous.rules import NextGeneration, choose_members, previous_is_over, should_seal

__all__ = [
    "ADDRESS_RE",
    "GENERATION_DIGITS",
    "INCARNATION_RE",
    "MAX_ADDRESS_CHARS",
    "MAX_GENERATION",
    "MAX_NODES",
    "MAX_PERIOD",
    "MAX_WORKERS",
    "READ_THREADS",
    "RECORD_VERSION",
    "VOID",
    "Join",
    "Member",
    "Membership",
    "NextGeneration",
    "Rendezvous",
    "RendezvousConfig",
    "choose_members",
    "finished_key",
    "floor_key",
    "generation_of",
    "generation_prefix",
    "join_key",
    "join_prefix",
    "join_to_json",
    "lease_key",
    "member_to_json",
    "membership_key",
    "membership_to_json",
    "parse_join",
    "parse_membership",
    "previous_is_over",
    "reopen_run",
    "sealer_key",
    "should_seal",
]
