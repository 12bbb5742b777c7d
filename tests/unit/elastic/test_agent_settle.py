"""The agent's rules for a generation's end. The settle rule (agent.settle_verdict): who a node agent names as gone
when it joins the next generation after a failure. Naming a live peer gone leaves it out of the next generation; not naming a dead one makes the sealer
wait for it (last_call). And `at_boundary`: other members leaving for a scale-up is not a failure."""

from __future__ import annotations

from dataclasses import replace

from SneppX_ALG.elastic.agent import at_boundary, settle_verdict
from SneppX_ALG.elastic.rendezvous import NextGeneration

TIMEOUT = 0.8
PEERS = {"node-1", "node-2", "node-3"}


def verdict(suspected: set[str], alive: set[str], moved: set[str], elapsed: float) -> tuple[bool, frozenset[str]]:
    return settle_verdict(PEERS, suspected, alive, moved, elapsed, TIMEOUT)


def test_live_peers_settle_at_once() -> None:
    assert verdict(set(), {"node-1", "node-2"}, {"node-3"}, 0.1) == (True, frozenset())


def test_a_peer_suspected_when_the_failure_is_declared_gets_a_timeout_to_answer() -> None:
    # node-1 was suspected a moment before the failure (a stall, a lost burst): it is not named gone at once ...
    assert verdict({"node-1"}, {"node-2", "node-3"}, set(), 0.0) == (False, frozenset())
    assert verdict({"node-1"}, {"node-2", "node-3"}, set(), TIMEOUT / 2) == (False, frozenset())
    # ... and when it answers it settles as alive
    assert verdict({"node-1"}, PEERS, set(), TIMEOUT / 2) == (True, frozenset())


def test_a_suspect_that_stays_silent_for_a_timeout_is_gone() -> None:
    assert verdict({"node-1"}, {"node-2", "node-3"}, set(), TIMEOUT) == (True, frozenset({"node-1"}))


def test_a_peer_that_joined_the_next_generation_is_not_gone_even_if_suspected() -> None:
    assert verdict({"node-1"}, {"node-2", "node-3"}, {"node-1"}, TIMEOUT) == (True, frozenset())


def test_an_unsuspected_peer_not_heard_yet_is_waited_for_and_gone_after_two_timeouts() -> None:
    assert verdict(set(), {"node-2", "node-3"}, set(), TIMEOUT) == (False, frozenset())
    assert verdict(set(), {"node-2", "node-3"}, set(), 2 * TIMEOUT) == (True, frozenset({"node-1"}))


def test_members_that_left_for_a_boundary_before_this_agent_saw_anyone_wait_are_not_a_failure() -> None:
    waiting = NextGeneration(4, sealed=False, closing=frozenset({"node-1"}), waiting=frozenset({"node-9"}))
    assert at_boundary(waiting)
    assert not at_boundary(replace(waiting, waiting=frozenset()))  # nobody to admit: they left for a failure
    assert not at_boundary(replace(waiting, has_room=False))  # a spare beyond max_nodes is no boundary
    assert not at_boundary(replace(waiting, sealed=True))  # sealed without this agent: over for it
    assert not at_boundary(replace(waiting, collected=True))
