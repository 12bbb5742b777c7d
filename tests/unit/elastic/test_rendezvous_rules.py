"""The pure parts of the rendezvous: rank assignment, the seal decision, and the record codecs."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from SneppX_ALG import errors
from SneppX_ALG.contract import record
from SneppX_ALG.elastic import rendezvous
from SneppX_ALG.records import LocalRecordStore

ids = st.from_regex(r"[a-z0-9][a-z0-9.-]{0,6}", fullmatch=True)


def member(agent_id: str, workers: int = 1) -> rendezvous.Member:
    return rendezvous.Member(agent_id, "0" * 32, "127.0.0.1", "127.0.0.1:29500", workers, 0.0)


def joins_of(*agent_ids: str, suspects: dict[str, set[str]] | None = None) -> list[rendezvous.Join]:
    return [rendezvous.Join(member(a), frozenset((suspects or {}).get(a, set()))) for a in agent_ids]


def membership(*agent_ids: str, generation: int = 0) -> rendezvous.Membership:
    return rendezvous.Membership("run", generation, tuple(member(a) for a in sorted(agent_ids)), agent_ids[0])


def decide(joins: list[rendezvous.Join], previous: rendezvous.Membership | None = None, *, over: bool = True,
           min_nodes: int = 1, max_nodes: int = 4, last_call: float = 10.0,
           waited: float | None = None) -> tuple[str, ...] | None:
    suspected: set[str] = set().union(*(j.suspects for j in joins))
    if not rendezvous.should_seal([j.member.agent_id for j in joins], suspected, previous, previous_over=over,
                                  min_nodes=min_nodes, max_nodes=max_nodes, last_call=last_call,
                                  min_reached_for=waited):
        return None
    return tuple(m.agent_id for m in rendezvous.choose_members(joins, previous, max_nodes))


# ---- ranks --------------------------------------------------------------------------------------------


@given(st.dictionaries(ids, st.integers(1, 8), min_size=1, max_size=24))
def test_ranks_follow_the_sorted_member_list_and_cover_the_world_once(workers: dict[str, int]) -> None:
    sealed = rendezvous.Membership("run", 3, tuple(member(a, w) for a, w in sorted(workers.items())), "x")
    assert sealed.world_size == sum(workers.values())
    ranks = [sealed.global_rank(a, local) for a in workers for local in range(workers[a])]
    assert sorted(ranks) == list(range(sealed.world_size))
    for node_rank, agent_id in enumerate(sorted(workers)):
        assert sealed.node_rank(agent_id) == node_rank
        assert sealed.rank_offset(agent_id) == sum(workers[a] for a in sorted(workers)[:node_rank])


@given(st.sets(ids, min_size=1, max_size=16), st.integers(1, 8))
def test_with_equal_workers_the_global_rank_is_node_rank_times_workers_plus_local(agents: set[str],
                                                                                  workers: int) -> None:
    sealed = rendezvous.Membership("run", 0, tuple(member(a, workers) for a in sorted(agents)), "x")
    for agent_id in agents:
        for local in range(workers):
            assert sealed.global_rank(agent_id, local) == sealed.node_rank(agent_id) * workers + local


def test_a_membership_refuses_unsorted_or_duplicate_members_and_ranks_outside_it() -> None:
    with pytest.raises(ValueError):
        rendezvous.Membership("run", 0, (member("b"), member("a")), "a")
    with pytest.raises(ValueError):
        rendezvous.Membership("run", 0, (member("a"), member("a")), "a")
    with pytest.raises(ValueError):
        rendezvous.Membership("run", 0, (), "a")
    sealed = membership("a", "b")
    with pytest.raises(ValueError, match="not a member"):
        sealed.node_rank("c")
    with pytest.raises(ValueError, match="local rank 1"):
        sealed.global_rank("a", 1)
    assert sealed.includes("a", "0" * 32) and not sealed.includes("a", "1" * 32)


# ---- the seal decision --------------------------------------------------------------------------------


def test_the_seal_decision_rules_one_by_one() -> None:
    assert decide(joins_of("a", "b", "c", "d")) == ("a", "b", "c", "d")  # max reached
    assert decide(joins_of("a"), min_nodes=2, waited=None) is None  # below min
    assert decide(joins_of("a", "b"), min_nodes=2, waited=9.9) is None  # last call still open
    assert decide(joins_of("a", "b"), min_nodes=2, waited=10.0) == ("a", "b")  # last call passed
    assert decide(joins_of("c", "d", "e", "f"), over=False) is None  # the running generation is not over
    assert decide([]) is None


def test_survivors_seal_at_once_when_every_member_not_suspected_has_joined() -> None:
    before = membership("a", "b", "c")
    assert decide(joins_of("a", "b"), before, min_nodes=2) is None  # c may still come: last call
    assert decide(joins_of("a", "b", suspects={"a": {"c"}}), before, min_nodes=2) == ("a", "b")
    assert decide(joins_of("a", suspects={"a": {"c"}}), before, min_nodes=2) is None  # b not here yet
    assert decide(joins_of("a", "n", suspects={"a": {"b", "c"}}), before, min_nodes=2) == ("a", "n")
    assert decide(joins_of("a", suspects={"a": {"b", "c"}}), before, min_nodes=2) is None  # below min


def test_over_max_the_members_of_the_previous_generation_come_first() -> None:
    before = membership("x", "y")
    assert decide(joins_of("a", "b", "x", "y"), before, max_nodes=3) == ("a", "x", "y")
    assert decide(joins_of("a", "b", "c", "d"), None, max_nodes=2) == ("a", "b")


def test_the_previous_generation_is_over_when_a_member_joins_or_its_lease_expires() -> None:
    before = membership("x", "y")
    assert not rendezvous.previous_is_over(["a", "b"], before, lease_expired=False)
    assert rendezvous.previous_is_over(["a", "y"], before, lease_expired=False)
    assert rendezvous.previous_is_over(["a"], before, lease_expired=True)
    assert rendezvous.previous_is_over(["a"], None, lease_expired=False)


@settings(max_examples=300)
@given(st.sets(ids, max_size=12), st.sets(ids, max_size=6), st.integers(1, 6), st.integers(0, 6),
       st.booleans(), st.one_of(st.none(), st.floats(0, 20)), st.randoms(use_true_random=False))
def test_any_seal_is_within_bounds_from_the_joins_and_independent_of_their_order(
        joined: set[str], before: set[str], min_nodes: int, extra: int, over: bool, waited: float | None,
        shuffle: random.Random) -> None:
    max_nodes = min_nodes + extra
    previous = membership(*sorted(before)) if before else None
    joins = joins_of(*sorted(joined))
    chosen = decide(joins, previous, over=over, min_nodes=min_nodes, max_nodes=max_nodes, last_call=10.0,
                    waited=waited)
    shuffle.shuffle(joins)
    assert decide(joins, previous, over=over, min_nodes=min_nodes, max_nodes=max_nodes, last_call=10.0,
                  waited=waited) == chosen
    if chosen is None:
        assert not over or not joined or len(joined) < max_nodes
        return
    assert over and min_nodes <= len(chosen) <= max_nodes and set(chosen) <= joined
    assert list(chosen) == sorted(chosen)
    assert len(chosen) == min(len(joined), max_nodes)


# ---- records ------------------------------------------------------------------------------------------


def valid_join() -> dict[str, Any]:
    return rendezvous.join_to_json("run", 2, rendezvous.Join(member("a"), frozenset({"b"})))


def valid_membership() -> dict[str, Any]:
    return rendezvous.membership_to_json(membership("a", "b", generation=2))


def test_records_round_trip() -> None:
    join = rendezvous.parse_join(valid_join(), key="k", run_id="run", generation=2, agent_id="a")
    assert join == rendezvous.Join(member("a"), frozenset({"b"}))
    renewed = rendezvous.join_to_json("run", 2, join, renewals=7)  # a late joiner's proof of life
    assert renewed != valid_join()
    assert rendezvous.parse_join(renewed, key="k", run_id="run", generation=2, agent_id="a") == join
    parsed = rendezvous.parse_membership(valid_membership(), key="k", run_id="run", generation=2)
    assert parsed == membership("a", "b", generation=2)


@pytest.mark.parametrize("change", [
    lambda v: v | {"version": 2}, lambda v: v | {"kind": "membership"}, lambda v: v | {"run_id": "other"},
    lambda v: v | {"generation": 3}, lambda v: v | {"generation": True}, lambda v: v | {"extra": 1},
    lambda v: {k: x for k, x in v.items() if k != "suspects"}, lambda v: v | {"suspects": "b"},
    lambda v: v | {"suspects": ["../b"]}, lambda v: v | {"suspects": ["b"] * 1025},
    lambda v: {k: x for k, x in v.items() if k != "renewals"}, lambda v: v | {"renewals": -1},
    lambda v: v | {"renewals": True}, lambda v: v | {"renewals": 1.5},
    lambda v: v | {"member": v["member"] | {"agent_id": "b"}},
    lambda v: v | {"member": v["member"] | {"agent_id": "../a"}},
    lambda v: v | {"member": v["member"] | {"incarnation": "xyz"}},
    lambda v: v | {"member": v["member"] | {"host": "a b"}},
    lambda v: v | {"member": v["member"] | {"heartbeat": ""}},
    lambda v: v | {"member": v["member"] | {"heartbeat": "h" * 301}},
    lambda v: v | {"member": v["member"] | {"workers": 0}},
    lambda v: v | {"member": v["member"] | {"workers": True}},
    lambda v: v | {"member": v["member"] | {"workers": 1.5}},
    lambda v: v | {"member": v["member"] | {"joined_at": "now"}},
    lambda v: v | {"member": v["member"] | {"joined_at": float("inf")}},
    lambda v: v | {"member": [1, 2]}, lambda v: [v], lambda v: None,
], ids=lambda _: "")
def test_an_invalid_join_record_is_refused_with_a_typed_error(change: Any) -> None:
    with pytest.raises(errors.InvalidRendezvousRecordError):
        rendezvous.parse_join(change(valid_join()), key="k", run_id="run", generation=2, agent_id="a")


@pytest.mark.parametrize("change", [
    lambda v: v | {"members": []}, lambda v: v | {"members": list(reversed(v["members"]))},
    lambda v: v | {"members": [v["members"][0]] * 2}, lambda v: v | {"members": "a,b"},
    lambda v: v | {"members": v["members"] * 600}, lambda v: v | {"sealed_by": 7},
    lambda v: v | {"sealed_by": "a/b"}, lambda v: v | {"kind": "join"}, lambda v: v | {"generation": 1},
], ids=lambda _: "")
def test_an_invalid_membership_record_is_refused_with_a_typed_error(change: Any) -> None:
    with pytest.raises(errors.InvalidRendezvousRecordError):
        rendezvous.parse_membership(change(valid_membership()), key="k", run_id="run", generation=2)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                           max_leaves=20)


@given(json_values, st.dictionaries(st.sampled_from(sorted(valid_join())), json_values, max_size=3))
def test_arbitrary_json_parses_to_a_record_or_a_typed_error_never_anything_else(noise: Any,
                                                                                 changes: dict[str, Any]) -> None:
    for value in (noise, valid_join() | changes, valid_membership() | changes):
        for parse in (lambda v: rendezvous.parse_join(v, key="k", run_id="run", generation=2, agent_id="a"),
                      lambda v: rendezvous.parse_membership(v, key="k", run_id="run", generation=2)):
            try:
                parse(value)
            except errors.InvalidRendezvousRecordError:
                pass


@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_to_an_object_or_a_typed_error(data: bytes) -> None:
    try:
        assert isinstance(record.decode("k", data), dict)
    except errors.RecordCorruptError:
        pass


# ---- configuration ------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [
    {"min_nodes": 0}, {"min_nodes": 3, "max_nodes": 2}, {"max_nodes": 1025}, {"last_call": -1},
    {"join_timeout": float("nan")}, {"poll_interval": 0}, {"poll_interval": 2.0, "poll_max": 1.0},
])
def test_bad_sizes_and_times_are_refused(config: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        rendezvous.RendezvousConfig(**config)


@pytest.mark.parametrize("agent", [
    {"agent_id": "../a"}, {"agent_id": ""}, {"agent_id": "a b"}, {"host": "a b"}, {"heartbeat": ""},
    {"workers": 0}, {"workers": 1025},
])
def test_bad_agent_identities_are_refused(tmp_path, agent: dict[str, Any]) -> None:

    identity = {"agent_id": "a", "host": "h", "heartbeat": "h:1", "workers": 1} | agent
    with pytest.raises(ValueError):
        rendezvous.Rendezvous(LocalRecordStore(str(tmp_path)), "run", **identity)
