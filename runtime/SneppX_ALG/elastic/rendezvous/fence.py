"""The commit fence: is the generation a process trains in still the newest? Read from the run's records alone.

Why a module of its own: a worker's checkpoint coordinator asks this right before each commit point (a
generation that is over commits nothing: docs/ELASTIC.md, "Safety"), and the question needs only the run's
records, not an agent: the worker calls `check` with the store, and the agent's `Rendezvous` (machine.py) asks
the same functions, so there is one rule. Generation g is over once g+1 is sealed, or a member of g joined g+1,
or the run's floor has moved past g (newer generations ran and removed g's records). Late joiners waiting at g+1
do not end g.
"""

from __future__ import annotations

import dataclasses
import logging

from SneppX_ALG import errors
from SneppX_ALG.contract import record
from SneppX_ALG.elastic.rendezvous.codec import Membership
from SneppX_ALG.elastic.rendezvous.keys import MAX_GENERATION, floor_key, generation_prefix, membership_key
from SneppX_ALG.elastic.rendezvous.rules import NextGeneration

log = logging.getLogger(__name__)


def check(store: record.RecordStore, membership: Membership) -> None:
    """Raises `StaleGenerationError` if a newer generation than `membership` exists (sealed, or joined by one of
    its members, or its records were removed). Store errors propagate: a fence that can't be checked refuses
    the commit."""
    nxt = next_generation(store, membership)
    if nxt.superseded:
        raise errors.StaleGenerationError(f"generation {membership.generation} of run {membership.run_id} is "
                                          f"over: {nxt.why()}", generation=membership.generation)


def next_generation(store: record.RecordStore, membership: Membership, *, check_floor: bool = True,
                    max_nodes: int | None = None) -> NextGeneration:
    """What the generation after `membership` holds: one listing. With `check_floor`, and nothing there that
    ends `membership`, also one read of the floor: when newer generations have run and removed `membership`'s
    records and those of the generation after it, the listing is empty and only the floor tells (a process that
    stalled through several generations must not commit for its old one). `max_nodes` (the agent's) says
    whether the running generation has room for a late joiner."""
    run_id, generation = membership.run_id, membership.generation + 1
    prefix = generation_prefix(run_id, generation)
    keys = store.keys(prefix)
    joined = {k[len(prefix) + len("join/"):] for k in keys if k.startswith(prefix + "join/")}
    members = set(membership.agent_ids)
    nxt = NextGeneration(generation, membership_key(run_id, generation) in keys, frozenset(joined & members),
                         frozenset(joined - members), has_room=max_nodes is None or len(members) < max_nodes)
    if check_floor and not nxt.superseded and floor(store, run_id) > membership.generation:
        return dataclasses.replace(nxt, collected=True)
    return nxt


def floor(store: record.RecordStore, run_id: str) -> int:
    """The run's floor: records of generations below it were removed (0 while there is none, or it is not a
    valid record)."""
    try:
        stored = store.read(floor_key(run_id))
    except errors.RecordCorruptError as e:
        log.warning("run %s: ignoring an invalid floor record: %s", run_id, e)
        return 0
    value = None if stored is None else stored.value.get("generation")
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_GENERATION:
        return value
    return 0
