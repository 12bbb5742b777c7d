"""The rendezvous's decisions, pure: whom a sealer seals in (`choose_members`), whether the generation before is
over (`previous_is_over`), whether to seal now (`should_seal`), and what `poll` saw at the next generation
(`NextGeneration`: is the running one over, does it admit late joiners).

Separate because they are the protocol's safety and liveness rules (the package docstring states them): they take
what an agent observed and return a verdict, with no store, clock or thread, so tests check them alone.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from SneppX_ALG.elastic.rendezvous.codec import Join, Member, Membership


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
    """Whether to seal a generation now (rules in the package docstring).

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
