"""The node lifecycle (elastic.c) against a small Python model of the same rules.

The model is written from the rules in docs/ELASTIC.md ("Lifecycle"), not from the C table, so a wrong entry
in either shows up as a disagreement.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from SneppX_ALG import errors
from SneppX_ALG.elastic import lifecycle
from SneppX_ALG.elastic.lifecycle import Lifecycle

FINAL = {"stopped", "failed"}


def model_next(state: str, event: str) -> str | None:
    """The rules, one by one."""
    if state in FINAL:
        return None                                  # final: a returning node starts a new machine
    if event == "leave":
        return "stopped"                             # anyone may leave, cleanly
    if event in ("budget_exhausted", "fatal"):
        return "failed"                              # out of restarts, or an error no restart fixes: give up
    if event == "join":
        if state == "init":
            return "joining"
        return "reconfiguring" if state in ("running", "reconfiguring") else None  # someone joins: re-form
    if event == "peer_failed":
        if state == "running":
            return "reconfiguring"
        return state if state in ("joining", "reconfiguring") else None  # still forming: stay
    if event == "timeout":
        return "failed" if state in ("joining", "reconfiguring") else None  # only a pending formation times out
    if event == "reconfigured":
        return "running" if state in ("joining", "reconfiguring") else None
    raise AssertionError(event)


def test_table_matches_model_everywhere() -> None:
    for state in lifecycle.STATES:
        for event in lifecycle.EVENTS:
            assert lifecycle.next_state(state, event) == model_next(state, event), (state, event)


def test_illegal_event_raises_typed_error_and_changes_nothing() -> None:
    node = Lifecycle()
    node.fire("join")
    node.fire("reconfigured")
    with pytest.raises(errors.LifecycleError) as caught:
        node.fire("reconfigured")
    assert (caught.value.state, caught.value.event) == ("running", "reconfigured")
    assert "reconfigured" in str(caught.value) and "running" in str(caught.value)
    assert (node.state, node.generation, node.transitions) == ("running", 1, 2)


def test_generations_only_move_forward() -> None:
    node = Lifecycle()
    node.fire("join")
    assert node.fire("reconfigured", generation=7) == "running"
    node.fire("peer_failed")
    with pytest.raises(ValueError, match="not newer"):
        node.fire("reconfigured", generation=7)
    assert node.state == "reconfiguring"  # a refused event changes nothing
    node.fire("reconfigured")
    assert node.generation == 8


def test_an_explicit_generation_0_is_generation_0_on_the_first_membership() -> None:
    """The rendezvous numbers generations from 0: the first membership's own number is recorded as it is, and
    the next one (1) is newer. After that, 0 is never newer: refused, nothing changed."""
    node = Lifecycle()
    node.fire("join")
    assert node.fire("reconfigured", generation=0) == "running"
    assert (node.state, node.generation, node.transitions) == ("running", 0, 2)
    node.fire("peer_failed")
    with pytest.raises(ValueError, match="generation 0 is not newer than the current 0"):
        node.fire("reconfigured", generation=0)
    assert (node.state, node.generation, node.transitions) == ("reconfiguring", 0, 3)
    assert node.fire("reconfigured", generation=1) == "running" and node.generation == 1
    with pytest.raises(errors.LifecycleError):  # the state is checked first, as for any generation
        node.fire("reconfigured", generation=0)
    fresh = Lifecycle()
    fresh.fire("join")
    fresh.fire("reconfigured")  # no generation given: current + 1
    assert fresh.generation == 1


def test_unknown_event_and_misplaced_generation_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown lifecycle event"):
        Lifecycle().fire("explode")
    with pytest.raises(ValueError, match="only 'reconfigured'"):
        Lifecycle().fire("join", generation=3)


class LifecycleAgainstModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.node = Lifecycle()
        self.state, self.generation, self.transitions = "init", 0, 0
        self.formed = False  # a generation was recorded: the next must be newer (before, any one, 0 included)

    @rule(event=st.sampled_from(lifecycle.EVENTS), generation=st.none() | st.integers(0, 50))
    def fire(self, event: str, generation: int | None) -> None:
        if event != "reconfigured":
            generation = None
        expected = model_next(self.state, event)
        wanted_generation = self.generation + 1 if generation is None else generation
        if expected is None:
            with pytest.raises(errors.LifecycleError):
                self.node.fire(event, generation)
        elif event == "reconfigured" and self.formed and wanted_generation <= self.generation:
            with pytest.raises(ValueError):
                self.node.fire(event, generation)
        else:
            assert self.node.fire(event, generation) == expected
            self.state, self.transitions = expected, self.transitions + 1
            if event == "reconfigured":
                self.generation, self.formed = wanted_generation, True

    @invariant()
    def agrees(self) -> None:
        assert (self.node.state, self.node.generation, self.node.transitions) == (
            self.state, self.generation, self.transitions)
        assert set(self.node.allowed_events()) == {e for e in lifecycle.EVENTS if model_next(self.state, e)}
        assert self.node.finished == (self.state in FINAL)


LifecycleAgainstModel.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestLifecycleAgainstModel = LifecycleAgainstModel.TestCase
