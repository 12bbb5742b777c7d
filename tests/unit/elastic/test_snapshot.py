"""Peer-memory snapshots (elastic/snapshot/): what a snapshot holds and checks, which one a recovery picks,
the resharding copy, and a Keeper per rank over real process groups (TCP on 127.0.0.1, one thread per rank)."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable
from typing import Any

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from SneppX_ALG import _native, collectives, errors
from SneppX_ALG.collectives import store as store_lib
from SneppX_ALG.coordinator import Shard
from SneppX_ALG.elastic import snapshot
from SneppX_ALG.records import open_record_store

M = 10  # elements of the sharded vector "m"


def shard_of(rank: int, world: int, fill: float = 0.0) -> Shard:
    start, stop = M * rank // world, M * (rank + 1) // world
    return Shard(np.arange(start, stop, dtype=np.float64) + fill, (M,), (start,))


def state(rank: int, world: int, step: int) -> dict[str, Any]:
    return {"w": np.full(3, float(step)), "m": shard_of(rank, world, fill=1000.0 * step), "epoch": step // 4}


def taken(rank: int, world: int, step: int, generation: int = 0) -> snapshot.Snapshot:
    shot = snapshot.capture(state(rank, world, step), step, instance="i", generation=generation, rank=rank,
                            world=world, into=lambda n: np.empty(n, np.uint8))
    snapshot.seal(shot)
    return shot


def test_a_sealed_snapshot_checks_out_and_a_flipped_byte_is_named() -> None:
    shot = taken(1, 2, 5)
    assert shot.problems() == []
    shot.payload[3] ^= 0x10
    problems = shot.problems()
    assert len(problems) == 1 and "rank 1's snapshot of step 5" in problems[0] and "CRC32C" in problems[0]


@pytest.mark.parametrize("rank", [0, 1])
def test_only_the_shards_travel_from_the_snapshots_own_buffer(rank: int) -> None:
    shot = taken(rank, 2, 5)
    wire = snapshot.wire_view(shot)
    assert np.shares_memory(wire, shot.payload)  # no copy on the way out
    arrived = snapshot.from_wire(wire.copy())
    assert [t["path"] for t in arrived.meta["tensors"]] == [["m"]] and arrived.meta["values"] == []
    assert len(arrived.payload) < len(shot.payload) and arrived.problems() == []
    assert np.array_equal(arrived.payload, shot.unique().payload)
    assert shot.problems() == []  # the description written into the slot touched no tensor


def test_a_description_that_outgrew_its_slot_is_refused() -> None:
    shot = taken(1, 2, 5)
    shot.meta["instance"] = "x" * 1000
    with pytest.raises(errors.SnapshotError, match="outgrew its slot"):
        snapshot.wire_view(shot)


def test_a_state_without_shards_sends_only_its_description() -> None:
    shot = snapshot.capture({"w": np.ones(100)}, 1, instance="i", generation=0, rank=1, world=2,
                            into=lambda n: np.empty(n, np.uint8))
    snapshot.seal(shot)
    arrived = snapshot.from_wire(snapshot.wire_view(shot).copy())
    assert len(arrived.payload) == 0 and arrived.meta["tensors"] == [] and arrived.meta["step"] == 1


def held(holder: int, source: int, step: int, world: int = 2, whole: bool = True) -> snapshot.Held:
    return snapshot.Held(holder, "i", 0, step, world, source, whole, True, 7, "t")


def chosen(parts: list[snapshot.Held], durable: list[snapshot.Durable] | None = None) -> Any:
    decision = snapshot.choose(parts, durable or [], [], [], "t")
    return (decision.key, list(decision.senders), decision.whole) if decision.source == "memory" else decision.why


def test_choose_takes_the_newest_step_every_old_rank_survives_in() -> None:
    # step 6 lost rank 1's part; step 5 is whole: rank 0 holds its own, rank 1 (a new rank) holds rank 1's copy
    parts = [held(0, 0, 6), held(0, 0, 5), held(1, 1, 5, whole=False)]
    assert chosen(parts) == (("i", 0, 5), [0, 1], 0)
    assert chosen(parts, [snapshot.Durable(5, 0, ())]) == (("i", 0, 5), [0, 1], 0)  # as new: memory is faster
    assert "newer than the newest usable snapshot" in chosen(parts, [snapshot.Durable(6, 0, ())])
    assert "lost the part of rank(s) 1" in chosen([held(0, 0, 6)])
    assert "no snapshot survives" in chosen([], [snapshot.Durable(3, 0, ())])


def test_the_lowest_rank_holding_a_part_sends_it_and_an_own_snapshot_sends_the_replicated_arrays() -> None:
    parts = [held(0, 1, 4, whole=False), held(1, 0, 4, whole=False), held(1, 1, 4)]
    assert chosen(parts) == (("i", 0, 4), [1, 1], 1)  # rank 1's own, whole, not rank 0's copy


def test_only_copies_left_are_not_enough_the_replicated_arrays_died_with_every_own_snapshot() -> None:
    assert "no rank's own snapshot left" in chosen([held(0, 1, 4, whole=False), held(1, 0, 4, whole=False)])


def test_the_snapshot_ring_visits_the_nodes_in_turn() -> None:
    assert snapshot.ring_order([2, 2]) == [0, 2, 1, 3]
    assert snapshot.ring_order([3, 1, 2]) == [0, 3, 4, 1, 5, 2]
    assert snapshot.ring_order([4]) == [0, 1, 2, 3]
    places = ["a", "a", "b", "b", "c", "c"]
    order = snapshot.ring_order([2, 2, 2])
    holders = snapshot.copy_holders([places[r] for r in order], 1)
    assert [snapshot.copy_distance(holders, p) for p in range(6)] == [1] * 6  # the next node, one hop away


@pytest.mark.parametrize("new_world", [1, 3, 4])
def test_apply_reshards_the_old_ranks_parts_into_the_new_ones(new_world: int) -> None:
    parts = [taken(r, 2, 7) for r in range(2)]
    parts = [parts[0], parts[1].unique()]
    for rank in range(new_world):
        target = {"w": np.zeros(3), "m": shard_of(rank, new_world), "epoch": 0}
        snapshot.apply(target, parts)
        assert np.array_equal(target["w"], np.full(3, 7.0)) and target["epoch"] == 1
        want = shard_of(rank, new_world, fill=7000.0).data
        assert np.array_equal(target["m"].data, want)


@hypothesis.given(old_world=st.integers(1, 4), new_world=st.integers(1, 4), whole=st.integers(0, 3))
def test_the_boxes_a_rank_wants_cut_from_every_part_restore_exactly_its_new_shard(old_world: int, new_world: int,
                                                                               whole: int) -> None:
    whole %= old_world
    parts = [taken(r, old_world, 7) for r in range(old_world)]
    parts = [p if r == whole else p.unique() for r, p in enumerate(parts)]
    order = [whole] + [r for r in range(old_world) if r != whole]
    for rank in range(new_world):
        target = {"w": np.zeros(3), "m": shard_of(rank, new_world), "epoch": 0}
        cuts = [snapshot.cut(parts[r], snapshot.wanted_boxes(target), whole=r == whole) for r in order]
        wire = snapshot.bundle(cuts, np.empty(snapshot.bundle_bytes(cuts), np.uint8))
        pieces = snapshot.unbundle(wire.copy())
        assert [p.source for p in pieces] == order and all(p.problems() == [] for p in pieces)
        mine = shard_of(rank, new_world).data.nbytes
        assert sum(t["nbytes"] for p in pieces for t in p.meta["tensors"] if t["offset"] is not None) == mine
        snapshot.apply(target, pieces)
        assert np.array_equal(target["m"].data, shard_of(rank, new_world, fill=7000.0).data)
        assert np.array_equal(target["w"], np.full(3, 7.0)) and target["epoch"] == 1


def test_a_byte_flipped_in_a_bundle_on_its_way_is_named_by_its_crcs() -> None:
    parts = [taken(0, 2, 3), taken(1, 2, 3).unique()]
    target = {"w": np.zeros(3), "m": shard_of(0, 1), "epoch": 0}
    cuts = [snapshot.cut(p, snapshot.wanted_boxes(target), whole=i == 0) for i, p in enumerate(parts)]
    wire = snapshot.bundle(cuts, np.empty(snapshot.bundle_bytes(cuts), np.uint8))
    pieces = snapshot.unbundle(wire)
    at = pieces[1].meta["tensors"][0]["at"]
    wire[at] ^= 0x01
    assert pieces[0].problems() == [] and "rank 1's snapshot of step 3" in pieces[1].problems()[0]


def test_apply_fills_a_target_without_shards_whole() -> None:
    parts = [taken(0, 2, 3), taken(1, 2, 3).unique()]
    target: dict[str, Any] = {"w": np.zeros(3), "m": np.zeros(M), "epoch": 0}
    snapshot.apply(target, parts)
    assert np.array_equal(target["m"], np.arange(M) + 3000.0) and target["epoch"] == 0


def test_apply_refuses_a_target_the_snapshot_does_not_cover() -> None:
    parts = [taken(0, 2, 3)]  # rank 1's part missing
    with pytest.raises(errors.ShardingMismatchError, match="covers 5 of the 10"):
        snapshot.apply({"w": np.zeros(3), "m": Shard(np.zeros(M), (M,), (0,)), "epoch": 0}, parts)


def test_divergent_names_the_ranks_off_the_majority() -> None:
    assert snapshot.divergent(np.array([7, 7, 9, 7])) == [2]
    assert snapshot.divergent(np.array([7, 9])) == [1]  # a tie: rank 0's is taken as right
    assert snapshot.divergent(np.array([5, 5])) == []


# ---- Keepers over real process groups -------------------------------------------------------------------------


def durable_at(step: int) -> Callable[..., tuple[list[snapshot.Durable], list[int]]]:
    """What TrainContext.restore hands `recover`: committed step `step`, checked and valid."""
    return lambda floor, verdicts: ([snapshot.Durable(step, 0, ())], [])


def groups(world: int, generation: int, root: str) -> list[collectives.ProcessGroup]:
    records = open_record_store(root)
    made: list[Any] = [None] * world

    def connect(rank: int) -> None:
        made[rank] = collectives.ProcessGroup(store_lib.RecordKeyStore(records, f"g{generation}"), rank, world,
                                              generation, key=b"k" * 32, timeout=30, backend="tcp")  # shift

    on_threads(world, connect)
    return made


def on_threads(world: int, fn: Callable[[int], Any]) -> list[Any]:
    results: list[Any] = [None] * world

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except Exception as e:  # noqa: BLE001 - handed back to the test to assert on
            results[rank] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


@pytest.mark.parametrize("lost", [2, 0])  # rank 0's own snapshot is not the only home of the replicated arrays
def test_keepers_replicate_to_the_next_rank_free_old_steps_and_recover_after_a_rank_is_lost(lost: int) -> None:
    root = tempfile.mkdtemp()
    old = groups(3, 0, root)
    keepers = [snapshot.Keeper() for _ in range(3)]

    def train(rank: int) -> None:
        for step in (1, 2, 3):
            keepers[rank].take(state(rank, 3, step), step, old[rank], instance="i", generation=0, place=f"node-{rank}")
        keepers[rank].wait()

    assert on_threads(3, train) == [None] * 3
    for rank, keeper in enumerate(keepers):
        assert [s.meta["step"] for s in keeper.own] == [3]  # steps 1 and 2 freed once 3 was complete
        assert [(s.source, s.meta["step"]) for s in keeper.held] == [((rank - 1) % 3, 3)]
        assert keeper.complete == ("i", 0, 3)
    for g in old:
        g.close()
    # rank `lost` is gone; the other two form a world of 2: its part is the copy its right-hand neighbour holds
    survivors = [keepers[r] for r in range(3) if r != lost]
    new = groups(2, 1, root)
    targets = [{"w": np.zeros(3), "m": shard_of(r, 2), "epoch": 0} for r in range(2)]
    got = on_threads(2, lambda r: survivors[r].recover(targets[r], new[r], durable_at(2)))
    assert [g.step for g in got] == [3, 3], got
    for rank in range(2):
        assert np.array_equal(targets[rank]["m"].data, shard_of(rank, 2, fill=3000.0).data)
        assert np.array_equal(targets[rank]["w"], np.full(3, 3.0)) and targets[rank]["epoch"] == 0
    for g in new:
        g.close()


def test_a_copy_that_fails_its_crcs_is_dropped_reported_and_not_used() -> None:
    root = tempfile.mkdtemp()
    old = groups(2, 0, root)
    reports: list[tuple[str, dict[str, Any]]] = []
    keepers = [snapshot.Keeper(report=lambda kind, **f: reports.append((kind, f))) for _ in range(2)]
    assert on_threads(2, lambda r: (keepers[r].take(state(r, 2, 4), 4, old[r], instance="i", generation=0,
                                                     place=f"node-{r}"), keepers[r].wait())) == [(None, None)] * 2
    for g in old:
        g.close()
    keepers[0].held[0].payload[1] ^= 0x01  # rank 1's part, as rank 0 holds it
    alone = groups(1, 1, root)[0]  # rank 1 is gone
    got = keepers[0].recover({"w": np.zeros(3), "m": shard_of(0, 1), "epoch": 0}, alone)
    assert got.step is None and "lost the part of rank(s) 1" in got.why
    assert reports[1:] and reports[1][0] == "snapshot_corrupt" and reports[1][1]["source"] == 1  # after placed
    alone.close()


def test_replicated_arrays_that_differ_fail_the_snapshot_naming_the_rank() -> None:
    root = tempfile.mkdtemp()
    old = groups(3, 0, root)
    keepers = [snapshot.Keeper() for _ in range(3)]

    def train(rank: int) -> None:
        keepers[rank].take(state(rank, 3, 1), 1, old[rank], instance="i", generation=0, place=f"node-{rank}")
        keepers[rank].wait()
        drifted = state(rank, 3, 2)
        if rank == 2:
            drifted["w"][1] += 1e-12
        keepers[rank].take(drifted, 2, old[rank], instance="i", generation=0, place=f"node-{rank}")
        keepers[rank].wait()

    results = on_threads(3, train)
    assert all(isinstance(r, errors.ReplicaDivergenceError) and r.ranks == [2] and r.step == 2 for r in results)
    assert [[s.meta["step"] for s in k.own] for k in keepers] == [[1]] * 3  # step 2 kept nowhere
    assert [k.divergences for k in keepers] == [[snapshot.Divergence("i", 0, 2, since=2)]] * 3  # 1 agreed
    for g in old:
        g.close()


def test_more_than_the_memory_limit_is_refused_before_anything_is_allocated_or_sent() -> None:
    group = groups(1, 0, tempfile.mkdtemp())[0]
    keeper = snapshot.Keeper(memory_limit=100)
    keeper._buffer = lambda nbytes: pytest.fail(f"{nbytes} bytes allocated before the limit was checked")
    with pytest.raises(errors.SnapshotMemoryError, match="snapshot_memory_limit") as refused:
        keeper.take(state(0, 1, 1), 1, group, instance="i", generation=0, place="node-0")
    assert refused.value.limit == 100 and refused.value.needed > 100
    assert keeper.own == [] and keeper.sent_bytes == 0
    group.close()


def test_a_refusal_under_a_mib_says_its_bytes() -> None:
    """The recovery chaos harness's limits are KiBs: the reason said 'need 0.0 MiB ..., over snapshot_memory_limit
    0.0 MiB'."""
    group = groups(1, 0, tempfile.mkdtemp())[0]
    with pytest.raises(errors.SnapshotMemoryError) as refused:
        snapshot.Keeper(memory_limit=100).take(state(0, 1, 1), 1, group, instance="i", generation=0, place="node-0")
    assert f"need {refused.value.needed} bytes" in str(refused.value), refused.value
    assert "over snapshot_memory_limit 100 bytes" in str(refused.value) and "0.0 MiB" not in str(refused.value)
    assert snapshot.keeper.size(3 << 20) == "3.0 MiB"
    group.close()


def test_a_0_d_array_keeps_its_shape() -> None:
    shot = snapshot.capture({"step": np.array(7, np.int64)}, 1, instance="i", generation=0, rank=0, world=1,
                            into=lambda n: np.empty(n, np.uint8))
    snapshot.seal(shot)
    target = {"step": np.array(0, np.int64)}
    snapshot.apply(target, [shot])
    assert target["step"].shape == () and int(target["step"]) == 7


def test_copies_go_as_far_around_the_ring_as_it_takes_to_leave_the_node() -> None:
    assert snapshot.copy_holders(["a", "b", "c"], 1) == [[1], [2], [0]]
    assert snapshot.copy_holders(["a", "a", "b", "b"], 1) == [[2], [3], [0], [1]]  # 2 workers a node: r + 2
    assert snapshot.copy_holders(["a", "a", "b"], 1) == [[2], [2], [0]]  # pods sharing a node: each part placed
    assert snapshot.copy_holders(["a", "a", "b"], 2) == [[2], [2], [0, 1]]  # as many as there are off its node
    assert snapshot.copy_holders(["a", "a"], 1) == [[], []]  # one node: no copy survives its loss
    assert snapshot.copy_holders(["a"], 1) == [[]]


@hypothesis.given(places=st.lists(st.sampled_from("abcd"), min_size=1, max_size=7),
                  replicas=st.integers(1, 3))
def test_every_part_gets_its_copies_off_its_node_on_as_many_nodes_as_there_are(places: list[str],
                                                                                replicas: int) -> None:
    holders = snapshot.copy_holders(places, replicas)
    for source, chosen in enumerate(holders):
        elsewhere = [q for q in range(len(places)) if places[q] != places[source]]
        other_nodes = {places[q] for q in elsewhere}
        assert all(places[q] != places[source] for q in chosen), (source, chosen)
        assert len(set(chosen)) == len(chosen) == min(replicas, len(elsewhere))
        assert len({places[q] for q in chosen}) == min(len(chosen), len(other_nodes))  # spread over nodes first
    if len(set(places)) == len(places):  # a node each: a copy a rank, the next ones around the ring
        assert holders == [[(s + h) % len(places) for h in range(1, min(replicas, len(places) - 1) + 1)]
                           for s in range(len(places))]


def test_the_memory_each_rank_needs_counts_the_parts_it_keeps_and_those_passing_through() -> None:
    # parts of 10, 20, 30 bytes, states of 100 each; rank 2 keeps parts 0 and 1, part 0 passing rank 1 on its way
    assert snapshot.needed_by_rank([100, 100, 100], [10, 20, 30], [[2], [2], [0]]) == [
        2 * (100 + 30) + 2 * 30, 2 * 100 + 2 * 10, 2 * (100 + 30) + 2 * 20]
    # a node each, parts alike: the estimate a rank makes alone is exact
    assert snapshot.needed_by_rank([100] * 3, [10] * 3, [[1], [2], [0]]) == [snapshot.needed_bytes(100, 10, 1)] * 3


def test_pods_on_one_kubernetes_node_keep_no_copies_of_each_other() -> None:
    root = tempfile.mkdtemp()
    old = groups(4, 0, root)
    keepers = [snapshot.Keeper() for _ in range(4)]
    places = ["node-x", "node-x", "node-y", "node-y"]
    assert on_threads(4, lambda r: (keepers[r].take(state(r, 4, 1), 1, old[r], instance="i", generation=0,
                                                     place=places[r]), keepers[r].wait())) == [(None, None)] * 4
    assert [[s.source for s in k.held] for k in keepers] == [[2], [3], [0], [1]]
    for g in old:
        g.close()


def take_everywhere(keepers: list[snapshot.Keeper], made: list[collectives.ProcessGroup], places: list[str],
                    states: Callable[[int], Any], steps: range, generation: int = 0) -> list[Any]:
    def train(rank: int) -> None:
        for step in steps:
            keepers[rank].take(states(rank), step, made[rank], instance="i", generation=generation,
                               place=places[rank])
        keepers[rank].wait()

    return on_threads(len(keepers), train)


def test_co_located_pods_still_get_a_copy_off_their_node_and_a_node_alone_is_reported() -> None:
    # 2 of 3 pods on one Kubernetes node: no single distance works, each part is placed on its own
    root = tempfile.mkdtemp()
    old = groups(3, 0, root)
    reports: list[list[tuple[str, dict[str, Any]]]] = [[] for _ in range(3)]
    keepers = [snapshot.Keeper(report=lambda kind, r=r, **f: reports[r].append((kind, f))) for r in range(3)]
    places = ["node-x", "node-x", "node-y"]
    assert take_everywhere(keepers, old, places, lambda r: state(r, 3, 1), range(1, 2)) == [None] * 3
    assert [sorted(s.source for s in k.held) for k in keepers] == [[2], [], [0, 1]]
    assert reports == [[("snapshot_placed", {"rank": 0, "replicas": 1, "unprotected": []})], [], []]  # for the job
    for r in reports:
        r.clear()
    for g in old:
        g.close()
    # the node-x pods alone (node-y is gone): their parts can't leave the node, and each says so
    alone = groups(2, 1, root)
    assert take_everywhere(keepers[:2], alone, places[:2], lambda r: state(r, 2, 2), range(2, 3), 1) == [None] * 2
    assert [k.held for k in keepers[:2]] == [[], []]
    assert [[(kind, f.get("rank"), f.get("copies"), f.get("nodes"), f.get("unprotected")) for kind, f in r]
            for r in reports[:2]] == [
        [("snapshot_placed", 0, None, None, [0, 1]), ("snapshot_unprotected", 0, 0, 1, None)],
        [("snapshot_unprotected", 1, 0, 1, None)]]
    for g in alone:
        g.close()


@pytest.mark.parametrize("nodes", [2, 3])
def test_two_replicas_with_two_workers_a_node_keep_no_copy_from_their_own_node(nodes: int) -> None:
    # the ring visits the nodes in turn: with 2 nodes the part 2 hops on is from the rank's own node
    world = 2 * nodes
    root = tempfile.mkdtemp()
    old = groups(world, 0, root)
    keepers = [snapshot.Keeper(replicas=2) for _ in range(world)]
    places = [f"node-{n}" for n in range(nodes)] * 2
    assert take_everywhere(keepers, old, places, lambda r: state(r, world, 1), range(1, 3)) == [None] * world
    held_by = {s: [q for q, k in enumerate(keepers) if s in [c.source for c in k.held]] for s in range(world)}
    for source, holders in held_by.items():  # 2 copies, none on its node, on as many other nodes as there are
        assert len(holders) == 2 and all(places[q] != places[source] for q in holders), held_by
        assert {places[q] for q in holders} == set(places) - {places[source]}, held_by
    assert all(k.held and all(c.meta["step"] == 2 for c in k.held) for k in keepers)
    for g in old:
        g.close()


@pytest.mark.parametrize("seed", range(6))
def test_random_layouts_hold_exactly_the_planned_copies_and_survive_the_loss_of_any_one_node(seed: int) -> None:
    # the oracle: copy_holders' plan (checked alone above) is what the ring delivers, and after any one node is
    # lost the survivors restore the state exactly, whenever every part still has a home
    rng = np.random.default_rng(seed)
    world, replicas = int(rng.integers(2, 6)), int(rng.integers(1, 3))
    places = [f"node-{int(n)}" for n in rng.integers(0, 3, world)]
    root = tempfile.mkdtemp()
    old = groups(world, 0, root)
    keepers = [snapshot.Keeper(replicas=replicas) for _ in range(world)]
    assert take_everywhere(keepers, old, places, lambda r: state(r, world, 4), range(3, 5)) == [None] * world
    for g in old:
        g.close()
    plan = snapshot.copy_holders(places, replicas)
    for q, keeper in enumerate(keepers):
        assert sorted(c.source for c in keeper.held) == [s for s in range(world) if q in plan[s]], (places, plan)
    lost = places[int(rng.integers(0, world))]
    left = [r for r in range(world) if places[r] != lost]
    if not left:
        return
    new = groups(len(left), 1, root)  # someone is left on another node: so is a copy of every part
    targets = [state(r, len(left), 0) for r in range(len(left))]
    got = on_threads(len(left), lambda r: keepers[left[r]].recover(targets[r], new[r]))
    assert [g.step for g in got] == [4] * len(left), (places, plan, lost, got)
    for r, target in enumerate(targets):
        assert np.array_equal(target["m"].data, shard_of(r, len(left), fill=4000.0).data)
        assert np.array_equal(target["w"], np.full(3, 4.0)) and target["epoch"] == 1
    for g in new:
        g.close()


def big_state(rank: int, world: int, elements: int, step: int = 1) -> dict[str, Any]:
    start, stop = elements * rank // world, elements * (rank + 1) // world
    return {"w": np.full(3, float(step)), "m": Shard(np.full(stop - start, float(step)), (elements,), (start,))}


def test_the_memory_bound_is_checked_again_when_a_shrink_doubles_each_shard() -> None:
    # 8 MiB of Shards: 2 MiB a rank at world 4 (12 MiB needed), 4 MiB at world 2 (24 MiB): the limit is 16 MiB
    elements, limit = 1 << 20, 16 << 20
    root = tempfile.mkdtemp()
    keepers = [snapshot.Keeper(memory_limit=limit) for _ in range(4)]
    four = groups(4, 0, root)
    places = [f"node-{r}" for r in range(4)]
    assert take_everywhere(keepers, four, places, lambda r: big_state(r, 4, elements), range(1, 3)) == [None] * 4
    for g in four:
        g.close()
    two = groups(2, 1, root)
    owned = [list(k.own) for k in keepers[:2]]
    got = take_everywhere(keepers[:2], two, places[:2], lambda r: big_state(r, 2, elements, 3), range(3, 4), 1)
    assert all(isinstance(e, errors.SnapshotMemoryError) and e.limit == limit and e.needed > limit for e in got), got
    assert [k.own for k in keepers[:2]] == owned  # refused before the new buffer: step 2 stays the one held
    for g in two:
        g.close()


def test_a_rank_that_keeps_a_larger_peers_part_is_checked_with_its_size_not_its_own() -> None:
    # uneven shards: rank 0 holds 1/16 of "m" and keeps rank 1's 15/16, on a smaller host (a lower limit)
    elements = 1 << 20
    small, large = 4 << 20, 64 << 20  # rank 0 alone estimates 3 MiB; it needs 31 MiB
    root = tempfile.mkdtemp()
    made = groups(2, 0, root)
    keepers = [snapshot.Keeper(memory_limit=small), snapshot.Keeper(memory_limit=large)]

    def uneven(rank: int) -> dict[str, Any]:
        cut = elements // 16
        start, stop = (0, cut) if rank == 0 else (cut, elements)
        return {"m": Shard(np.ones(stop - start), (elements,), (start,))}

    got = take_everywhere(keepers, made, ["node-0", "node-1"], uneven, range(1, 2))
    assert all(isinstance(e, errors.SnapshotMemoryError) and "on rank 0" in str(e) for e in got), got
    assert [k.held for k in keepers] == [[], []] and [k.sent_bytes for k in keepers] == [0, 0]
    for g in made:
        g.close()


@pytest.mark.parametrize("lost, new_world", [(2, 4), (3, 3), (1, 2)])
def test_a_recovery_sends_each_rank_only_the_boxes_its_new_shards_need(lost: int, new_world: int) -> None:
    # 8 MiB of Shards over 4 ranks; rank `lost` is gone (replaced by an empty keeper when the world stays 4)
    elements = 1 << 20
    root = tempfile.mkdtemp()
    keepers = [snapshot.Keeper() for _ in range(4)]
    old = groups(4, 0, root)
    places = [f"node-{r}" for r in range(4)]
    assert take_everywhere(keepers, old, places, lambda r: big_state(r, 4, elements, 5), range(5, 6)) == [None] * 4
    for g in old:
        g.close()
    alive = [k for r, k in enumerate(keepers) if r != lost]
    if new_world == 2:  # two lost: rank 0 holds rank 3's copy, rank 2 rank 1's
        alive = [keepers[0], keepers[2]]
    ranks = alive + [snapshot.Keeper()] * (new_world - len(alive))
    new = groups(new_world, 1, root)
    targets = [big_state(r, new_world, elements, 0) for r in range(new_world)]
    got = on_threads(new_world, lambda r: ranks[r].recover(targets[r], new[r]))
    assert [g.step for g in got] == [5] * new_world, got
    for rank in range(new_world):
        want = big_state(rank, new_world, elements, 5)
        assert np.array_equal(targets[rank]["m"].data, want["m"].data) and np.array_equal(targets[rank]["w"], want["w"])
        # at most what its new state is (its shard and the replicated w), and the pieces' descriptions
        assert got[rank].received <= want["m"].data.nbytes + want["w"].nbytes + (16 << 10), (rank, got[rank].received)
    for g in new:
        g.close()


def test_a_recovery_that_would_hold_more_than_the_limit_goes_to_storage_on_every_rank_and_says_why() -> None:
    # the replacement of rank 1 runs on a smaller host: its 4 MiB shard does not fit its 1 MiB
    elements = 1 << 20
    root = tempfile.mkdtemp()
    keepers = [snapshot.Keeper() for _ in range(2)]
    old = groups(2, 0, root)
    assert take_everywhere(keepers, old, ["node-0", "node-1"], lambda r: big_state(r, 2, elements, 5),
                           range(5, 6)) == [None] * 2
    for g in old:
        g.close()
    ranks = [keepers[0], snapshot.Keeper(memory_limit=1 << 20)]
    new = groups(2, 1, root)
    targets = [big_state(r, 2, elements, 0) for r in range(2)]
    got = on_threads(2, lambda r: ranks[r].recover(targets[r], new[r]))
    assert [g.step for g in got] == [None, None], got
    assert all("snapshot_memory_limit 1.0 MiB" in g.why and "on rank 1" in g.why for g in got), got
    assert not targets[1]["m"].data.any()  # nothing was written
    for g in new:
        g.close()


def test_the_memory_a_recovery_holds_counts_what_passes_through_each_rank() -> None:
    # position 0 sends 10 bytes to 2 (through 1), 2 sends 5 to 1 (through 0); each holds 100
    bundles = [[1, 0, 10], [0, 2, 0], [0, 5, 3]]
    assert snapshot.recovery_by_rank(bundles, [100, 100, 100]) == [101 + 2 * 5, 107 + 2 * 10, 113]


def test_the_default_limit_follows_a_containers_memory_limit(tmp_path: Any) -> None:
    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "unlimited").write_text("max\n")
    assert snapshot.host_memory((str(tmp_path / "memory.max"),)) == min(1 << 30, snapshot.host_memory(()))
    assert snapshot.host_memory((str(tmp_path / "unlimited"),)) == snapshot.host_memory(())


def test_many_snapshots_two_workers_a_node_reuse_a_bounded_set_of_buffers() -> None:
    # h = 2: each copy is forwarded once on its way, and every snapshot frees its own, its wire and its copies
    root = tempfile.mkdtemp()
    old = groups(4, 0, root)
    keepers = [snapshot.Keeper() for _ in range(4)]
    places = ["node-x", "node-x", "node-y", "node-y"]

    def train(rank: int) -> None:
        for step in range(1, 16):
            keepers[rank].take(state(rank, 4, step), step, old[rank], instance="i", generation=0,
                               place=places[rank])
        keepers[rank].wait()

    assert on_threads(4, train) == [None] * 4
    for rank, keeper in enumerate(keepers):
        assert [s.meta["step"] for s in keeper.own] == [15]
        assert [(s.source, s.meta["step"]) for s in keeper.held] == [((rank - 2) % 4, 15)]
        assert len(keeper._free) <= snapshot.MAX_FREE_BUFFERS
    for g in old:
        g.close()


def test_one_background_thread_serves_every_snapshot_and_take_reports_all_it_spent(monkeypatch: Any) -> None:
    started: list[str] = []
    start = threading.Thread.start

    def counting(thread: threading.Thread) -> None:
        started.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", counting)
    group = groups(1, 0, tempfile.mkdtemp())[0]
    keeper = snapshot.Keeper()
    for step in range(1, 11):
        keeper.take(state(0, 1, step), step, group, instance="i", generation=0, place="node-0")
        costs = keeper.costs
        assert costs["take_ms"] >= costs["copy_ms"] + costs["wait_ms"], costs
    keeper.wait()
    assert started.count("sneppx-snapshot") == 1, started  # a thread a snapshot cost the training thread ~2 ms
    assert [s.meta["step"] for s in keeper.own] == [10] and "background_cpu_ms" in keeper.costs
    group.close()


# ---- state on a CUDA device ------------------------------------------------------------------------------------


class HostBackedDeviceTensor:
    """A stand-in for a CUDA tensor (its "device memory" a host array), seen through __cuda_array_interface__."""

    def __init__(self, values: np.ndarray, stream: int | None):
        self.memory = np.ascontiguousarray(values)
        self.__cuda_array_interface__ = {"shape": values.shape, "typestr": values.dtype.str, "strides": None,
                                         "data": (self.memory.ctypes.data, False), "version": 3, "stream": stream}


class FakeDeviceCopier:
    """The copy engine's boundary without a GPU: D2H copies read host memory at the "device" pointer."""

    def __init__(self) -> None:
        self.host = _native.Copier(-1)
        self.calls: list[tuple[str, int]] = []

    def wait_stream(self, stream: int) -> None:
        self.calls.append(("wait", stream))

    def copy(self, dst: Any, src: Any, nbytes: int | None = None, *, crc: int | None = 0,
             kind: int = _native.COPY_H2H) -> int | None:
        assert kind == _native.COPY_D2H
        self.calls.append(("copy", nbytes or 0))
        return self.host.copy(dst, src, nbytes, crc=crc)


def test_cuda_tensors_are_copied_after_their_producer_stream_and_hashed_as_they_land() -> None:
    m = np.arange(M // 2, dtype=np.float32)
    big = np.arange((snapshot.PIECE + 100) // 4, dtype=np.float32)  # two pieces
    obj = {"w": HostBackedDeviceTensor(big, stream=7), "m": Shard(HostBackedDeviceTensor(m, stream=7), (M,), (0,)),
           "epoch": 3}
    copier = FakeDeviceCopier()
    shot = snapshot.capture(obj, 1, instance="i", generation=0, rank=0, world=2,
                            into=lambda n: np.empty(n, np.uint8), copier=lambda device: copier)
    assert copier.calls[0] == ("wait", 7) and [c for c in copier.calls if c[0] == "wait"] == [("wait", 7)]
    assert [n for kind, n in copier.calls if kind == "copy"] == [m.nbytes, snapshot.PIECE, 100]
    snapshot.seal(shot)
    assert shot.problems() == []
    target = {"w": np.zeros_like(big), "m": Shard(np.zeros(M // 2, np.float32), (M,), (0,)), "epoch": 0}
    snapshot.apply(target, [shot])
    assert np.array_equal(target["w"], big) and np.array_equal(target["m"].data, m) and target["epoch"] == 3
    shot.payload[shot.meta["tensors"][1]["at"] + snapshot.PIECE + 3] ^= 1  # the CRC of the copy's second piece
    assert len(shot.problems()) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(), reason="no CUDA device")
def test_a_snapshot_of_real_device_memory_restores_into_host_arrays() -> None:
    values = np.random.default_rng(0).standard_normal((snapshot.PIECE + 12345) // 8)
    pointer = _native.cuda_malloc(0, values.nbytes)
    try:
        _native.cuda_memcpy(0, pointer, _native.address_of(values), values.nbytes, _native.COPY_H2D)
        tensor = type("DeviceTensor", (), {})()
        tensor.__cuda_array_interface__ = {"shape": values.shape, "typestr": values.dtype.str, "strides": None,
                                           "data": (pointer, False), "version": 3, "stream": 1}
        keeper = snapshot.Keeper()
        shot = snapshot.capture({"w": tensor}, 1, instance="i", generation=0, rank=0, world=1,
                                into=lambda n: np.empty(n, np.uint8), copier=keeper._copier)
        snapshot.seal(shot)
        assert shot.problems() == []
        target = {"w": np.zeros_like(values)}
        snapshot.apply(target, [shot])
        assert np.array_equal(target["w"], values)
    finally:
        _native.cuda_free(0, pointer)


# ---- all or nothing; verdicts that bind ---------------------------------------------------------------------


def test_apply_refuses_a_replicated_array_of_another_shape_before_writing_anything() -> None:
    """A (world,)-shaped replicated array saved at world 2 restored at world 1 was cut to (1,); a grown one
    failed only after earlier tensors were written. Now nothing is written, and the error is typed."""
    def shot(rank: int) -> snapshot.Snapshot:
        taken = snapshot.capture({"m": shard_of(rank, 2, 5.0), "r": np.arange(2.0)}, 5, instance="i",
                                 generation=0, rank=rank, world=2, into=lambda n: np.empty(n, np.uint8))
        snapshot.seal(taken)
        return taken

    parts = [shot(0), shot(1).unique()]
    for size in (1, 3):
        target = {"m": shard_of(0, 1), "r": np.zeros(size)}
        with pytest.raises(errors.ShardingMismatchError, match="shape"):
            snapshot.apply(target, parts)
        assert np.array_equal(target["m"].data, shard_of(0, 1).data) and not target["r"].any()
    dtype = {"m": shard_of(0, 1), "r": np.zeros(2, np.float32)}
    with pytest.raises(errors.ShardingMismatchError, match="float"):
        snapshot.apply(dtype, parts)
    assert np.array_equal(dtype["m"].data, shard_of(0, 1).data)


def test_a_divergence_is_kept_as_a_verdict_on_every_rank() -> None:
    root = tempfile.mkdtemp()
    old = groups(2, 0, root)
    keepers = [snapshot.Keeper() for _ in range(2)]

    def train(rank: int) -> None:
        drifted = state(rank, 2, 3)
        drifted["w"][0] += rank
        keepers[rank].take(drifted, 3, old[rank], instance="i", generation=0, place=f"node-{rank}")
        keepers[rank].wait()

    assert all(isinstance(r, errors.ReplicaDivergenceError) for r in on_threads(2, train))
    assert [k.divergences for k in keepers] == [[snapshot.Divergence("i", 0, 3, since=0)]] * 2  # none agreed
    for g in old:
        g.close()


@pytest.mark.parametrize("diverged", [True, False])
def test_a_step_cut_off_before_its_allgather_restores_only_if_every_own_snapshot_agrees(diverged: bool) -> None:
    """Suspicion 2 of issue 37, confirmed: step 2's snapshot was cut off before its allgather (the group
    aborted), so no one compared its replicated arrays; every rank survives with its own. Recovery took rank 0's
    unchecked arrays. Now their digests are compared at recovery: equal, step 2 is restored; not, step 1."""
    root = tempfile.mkdtemp()
    old = groups(2, 0, root)
    keepers = [snapshot.Keeper() for _ in range(2)]
    assert on_threads(2, lambda r: (keepers[r].take(state(r, 2, 1), 1, old[r], instance="i", generation=0,
                                                     place=f"node-{r}"), keepers[r].wait())) == [(None, None)] * 2
    for g in old:
        g.abort()

    def cut_off(rank: int) -> None:
        shot = state(rank, 2, 2)
        if diverged and rank == 0:
            shot["w"][1] = -1.0
        keepers[rank].take(shot, 2, old[rank], instance="i", generation=0, place=f"node-{rank}")
        keepers[rank].wait()

    assert all(isinstance(r, errors.SneppXError) for r in on_threads(2, cut_off))
    assert [[s.meta["step"] for s in k.own] for k in keepers] == [[1, 2]] * 2
    for g in old:
        g.close()
    new = groups(2, 1, root)
    targets = [{"w": np.zeros(3), "m": shard_of(r, 2), "epoch": 0} for r in range(2)]
    got = on_threads(2, lambda r: keepers[r].recover(targets[r], new[r]))
    want = 1 if diverged else 2
    assert [g.step for g in got] == [want, want], got
    assert np.array_equal(targets[0]["w"], np.full(3, float(want)))
    for g in new:
        g.close()


def two_keepers_after_a_snapshot_of_step_5() -> tuple[list[snapshot.Keeper], list[Any]]:
    """Two ranks' keepers holding a whole snapshot of step 5 (generation 0), and generation 1's groups."""
    root = tempfile.mkdtemp()
    keepers = [snapshot.Keeper() for _ in range(2)]
    old = groups(2, 0, root)
    assert take_everywhere(keepers, old, ["node-0", "node-1"], lambda r: state(r, 2, 5), range(5, 6)) == [None] * 2
    for g in old:
        g.close()
    return keepers, groups(2, 1, root)


def test_a_rank_whose_state_is_laid_out_otherwise_decides_as_every_other_rank() -> None:
    """Every rank decided for its own target's layout: rank 1's state changed shape since (its w is (4,)), so
    rank 1 went to storage ("holds another object") while rank 0 chose memory and waited for rank 1 in the
    transfer's allgather until CollectiveTimeoutError. Now the layouts are allgathered: both go to storage."""
    keepers, new = two_keepers_after_a_snapshot_of_step_5()
    targets = [{"w": np.zeros(3 + r), "m": shard_of(r, 2), "epoch": 0} for r in range(2)]
    got = on_threads(2, lambda r: keepers[r].recover(targets[r], new[r]))
    assert [(g.step, g.decision.source) for g in got] == [(None, "storage")] * 2, got
    assert got[0].why == got[1].why
    for r, target in enumerate(targets):  # nothing was written
        assert not target["w"].any() and np.array_equal(target["m"].data, shard_of(r, 2).data), (r, target)
    for g in new:
        g.close()



@pytest.mark.parametrize("elements, old_world, new_world", [(2, 2, 3), (1, 2, 3), (3, 3, 4), (2, 1, 3)])
def test_a_rank_whose_new_shard_is_empty_still_restores(elements: int, old_world: int, new_world: int) -> None:
    """Fewer rows than new ranks: a rank's new shard holds none of them. It wants an empty box, meets no part's
    box, received no piece of the tensor, and apply refused it for "no tensor": the whole recovery went to
    storage although every byte was there."""
    def sharded(rank: int, world: int, step: int) -> dict[str, Any]:
        start, stop = elements * rank // world, elements * (rank + 1) // world
        return {"w": np.full(3, float(step)),
                "m": Shard(np.arange(start, stop, dtype=np.float64) + 1000.0 * step, (elements,), (start,))}

    root = tempfile.mkdtemp()
    keepers = [snapshot.Keeper() for _ in range(old_world)]
    old = groups(old_world, 0, root)
    places = [f"node-{r}" for r in range(old_world)]
    assert take_everywhere(keepers, old, places, lambda r: sharded(r, old_world, 5), range(5, 6)) == [None] * old_world
    for g in old:
        g.close()
    ranks = keepers + [snapshot.Keeper() for _ in range(new_world - old_world)]
    new = groups(new_world, 1, root)
    targets = [sharded(r, new_world, 0) for r in range(new_world)]
    got = on_threads(new_world, lambda r: ranks[r].recover(targets[r], new[r]))
    assert [g.step for g in got] == [5] * new_world, got
    for r, target in enumerate(targets):
        want = sharded(r, new_world, 5)
        assert np.array_equal(target["m"].data, want["m"].data) and np.array_equal(target["w"], want["w"])
    for g in new:
        g.close()


def split(global_array: np.ndarray, rank: int, world: int, axis: int) -> Shard:
    n = global_array.shape[axis]
    start, stop = n * rank // world, n * (rank + 1) // world
    offset = [0] * global_array.ndim
    offset[axis] = start
    return Shard(np.take(global_array, range(start, stop), axis=axis).copy(), global_array.shape, tuple(offset))


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(rows=st.integers(0, 5), cols=st.integers(1, 4), old_world=st.integers(1, 5),
                  new_world=st.integers(1, 5), old_axis=st.integers(0, 1), new_axis=st.integers(0, 1),
                  whole=st.integers(0, 4))
def test_random_2d_reshards_with_empty_shards_get_every_box_they_need(rows: int, cols: int, old_world: int,
                                                                      new_world: int, old_axis: int, new_axis: int,
                                                                      whole: int) -> None:
    """The boxes-only transfer against the global array as oracle: any split axis, old and new, and more ranks
    than rows or columns (empty shards on either side)."""
    whole %= old_world
    saved = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) + 1
    parts = []
    for r in range(old_world):
        shot = snapshot.capture({"m": split(saved, r, old_world, old_axis), "w": np.full(2, 3.0)}, 7,
                                instance="i", generation=0, rank=r, world=old_world,
                                into=lambda n: np.empty(n, np.uint8))
        snapshot.seal(shot)
        parts.append(shot if r == whole else shot.unique())
    order = [whole] + [r for r in range(old_world) if r != whole]
    for rank in range(new_world):
        target = {"m": split(np.zeros_like(saved), rank, new_world, new_axis), "w": np.zeros(2)}
        cuts = [snapshot.cut(parts[r], snapshot.wanted_boxes(target), whole=r == whole) for r in order]
        pieces = snapshot.unbundle(snapshot.bundle(cuts, np.empty(snapshot.bundle_bytes(cuts), np.uint8)).copy())
        assert all(p.problems() == [] for p in pieces)
        snapshot.apply(target, pieces)
        assert np.array_equal(target["m"].data, split(saved, rank, new_world, new_axis).data)
        assert np.array_equal(target["w"], np.full(2, 3.0))


@pytest.mark.parametrize("where", ["data", "description"])
def test_a_piece_corrupted_on_its_way_ends_the_recovery_alike_on_every_rank(where: str) -> None:
    """Rank 1 found a piece corrupt and raised at once; rank 0 went on to apply and into the allreduce after it,
    where it waited for rank 1 until CollectiveTimeoutError (a collective one rank skipped). A description no
    CRC covers failed as a JSONDecodeError (a ValueError, untyped). Now every rank raises CommProtocolError, and
    none wrote anything."""
    root = tempfile.mkdtemp()
    keepers = [snapshot.Keeper() for _ in range(2)]
    old = groups(2, 0, root)
    assert take_everywhere(keepers, old, ["node-0", "node-1"], lambda r: big_state(r, 2, 1 << 12, 5),
                           range(5, 6)) == [None] * 2
    for g in old:
        g.close()
    new = groups(2, 1, root)
    shift = new[1].shift

    def flipping(send: np.ndarray, recv: np.ndarray, timeout: float | None = None) -> np.ndarray:
        got = shift(send, recv, timeout)
        if len(got):  # the bundle is mostly data; its description (JSON, padded) ends 8 bytes before its end
            got[len(got) // 2 if where == "data" else -9] ^= 0x01
        return got

    new[1].shift = flipping  # type: ignore[method-assign]
    targets = [big_state((r + 1) % 2, 2, 1 << 12, 0) for r in range(2)]  # swapped: each shard travels
    got = on_threads(2, lambda r: keepers[r].recover(targets[r], new[r]))
    assert all(isinstance(g, errors.CommProtocolError) for g in got), got
    assert not any(t["m"].data.any() or t["w"].any() for t in targets)
    for g in new:
        g.close()


@pytest.mark.parametrize("sharded_target", [True, False])
def test_parts_that_overlap_and_leave_a_hole_are_refused(sharded_target: bool) -> None:
    """apply counted coverage as the sum of the overlaps' volumes: old shards [0:4), [3:7), [8:10) of a (10,)
    tensor (a description that lies: a flipped digit in an offset, which no CRC covers, or a user's sharding
    off by one) sum to 10, so element 7 was never written and the restore said all was well."""
    def shot(rank: int, start: int, stop: int) -> snapshot.Snapshot:
        taken = snapshot.capture({"m": Shard(np.arange(start, stop, dtype=np.float64) + 1, (M,), (start,))}, 5,
                                 instance="i", generation=0, rank=rank, world=3, into=lambda n: np.empty(n, np.uint8))
        snapshot.seal(taken)
        return taken

    parts = [shot(0, 0, 4), shot(1, 3, 7).unique(), shot(2, 8, 10).unique()]
    target = {"m": Shard(np.zeros(M), (M,), (0,))} if sharded_target else {"m": np.zeros(M)}
    with pytest.raises(errors.ShardingMismatchError, match="overlap"):
        snapshot.apply(target, parts)
    assert not (target["m"].data if sharded_target else target["m"]).any()



def test_a_rank_whose_state_does_not_describe_itself_goes_to_storage_with_every_other_rank() -> None:
    """Rank 1's shard lies outside its tensor (5 rows at offset 8 of a (10,)): its layout raised
    UnsupportedTensorError before the inventory's allgather, and rank 0 waited there for it until
    CollectiveTimeoutError. Now every rank goes to storage alike."""
    keepers, new = two_keepers_after_a_snapshot_of_step_5()
    targets = [{"w": np.zeros(3), "m": shard_of(0, 2), "epoch": 0},
               {"w": np.zeros(3), "m": Shard(np.zeros(5), (M,), (8,)), "epoch": 0}]
    got = on_threads(2, lambda r: keepers[r].recover(targets[r], new[r]))
    assert [(g.step, g.decision.source) for g in got] == [(None, "storage")] * 2, got
    assert not any(t["w"].any() for t in targets) and np.array_equal(targets[0]["m"].data, shard_of(0, 2).data)
    for g in new:
        g.close()
