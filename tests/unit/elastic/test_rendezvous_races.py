"""Races of the rendezvous, each steered one way: an injected clock whose `sleep` runs the other agents' steps
(so "while a waited, b renewed its lease" happens exactly then), and store wrappers that fail or act on cue.
Nothing here measures time: the clock moves only when an agent sleeps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from SneppX_ALG import errors
from SneppX_ALG.contract import record
from SneppX_ALG.elastic import rendezvous
from SneppX_ALG.records import LocalRecordStore

RUN = "run"
GIVE_UP_AT = 2000.0  # fake seconds: a scenario that runs this long went wrong (fail, don't hang)


class Clock:
    """Fake time for every agent of a scenario. `sleep` first runs the scenario's script at the current time
    (what the other agents do meanwhile), then moves time on."""

    def __init__(self) -> None:
        self.now = 0.0
        self.script: Callable[[float], None] = lambda now: None

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert self.now < GIVE_UP_AT, "the scenario never ended"
        self.script(self.now)
        self.now += max(seconds, 0.001)


class Outage:
    """A record store that nobody can reach while `down()` says so."""

    def __init__(self, store: record.RecordStore, down: Callable[[], bool]):
        self.store, self.down, self.uri = store, down, store.uri

    def _check(self, key: str) -> None:
        if self.down():
            raise errors.RecordUnavailableError("the store is out", key=key)

    def create(self, key: str, value: Any) -> record.Record:
        self._check(key)
        return self.store.create(key, value)

    def read(self, key: str) -> record.Record | None:
        self._check(key)
        return self.store.read(key)

    def swap(self, key: str, value: Any, version: str) -> record.Record:
        self._check(key)
        return self.store.swap(key, value, version)

    def keys(self, prefix: str = "", *, limit: int | None = None) -> list[str]:
        self._check(prefix)
        return self.store.keys(prefix, limit=limit)

    def delete(self, key: str) -> None:
        self._check(key)
        self.store.delete(key)


class AfterRead(Outage):
    """A record store that calls `hook(key)` after each read."""

    def __init__(self, store: record.RecordStore, hook: Callable[[str], None]):
        super().__init__(store, lambda: False)
        self.hook = hook

    def read(self, key: str) -> record.Record | None:
        stored = self.store.read(key)
        self.hook(key)
        return stored


@pytest.fixture
def store(tmp_path) -> record.RecordStore:
    return LocalRecordStore(str(tmp_path))


def agent(store: record.RecordStore, agent_id: str, clock: Clock | None = None,
          **config: Any) -> rendezvous.Rendezvous:
    timing: dict[str, Any] = {} if clock is None else {"clock": clock, "sleep": clock.sleep}
    return rendezvous.Rendezvous(store, RUN, agent_id=agent_id, host="127.0.0.1", heartbeat="127.0.0.1:29500",
                                 workers=1, config=rendezvous.RendezvousConfig(**config), **timing)


def member_of(x: rendezvous.Rendezvous) -> rendezvous.Member:
    return rendezvous.Member(x.agent_id, x.incarnation, x.host, x.heartbeat, x.workers, 0.0)


def sealed(store: record.RecordStore, generation: int, *agents: rendezvous.Rendezvous) -> rendezvous.Membership:
    """A generation of `agents` as if they had formed it (their processes: their incarnations)."""
    members = tuple(sorted((member_of(x) for x in agents), key=lambda m: m.agent_id))
    membership = rendezvous.Membership(RUN, generation, members, members[0].agent_id)
    store.create(rendezvous.membership_key(RUN, generation), rendezvous.membership_to_json(membership))
    return membership


def joins(store: record.RecordStore, generation: int, member: rendezvous.Member) -> None:
    """`member`'s join record at `generation`, written once (a member moving on, or a joiner that then died)."""
    store.create(rendezvous.join_key(RUN, generation, member.agent_id),
                 rendezvous.join_to_json(RUN, generation, rendezvous.Join(member)))


def dead_joiner(agent_id: str) -> rendezvous.Member:
    return rendezvous.Member(agent_id, "d" * 32, "127.0.0.1", "127.0.0.1:29500", 1, 0.0)


# ---- 5: the membership holds the joins as they are when it is sealed -------------------------------------


def test_a_node_restarted_before_the_seal_is_sealed_with_its_new_process_not_the_dead_one(store) -> None:
    first, second = (rendezvous.Member("b", digit * 32, "127.0.0.1", "127.0.0.1:1", 1, 0.0) for digit in "12")
    joins(store, 0, first)
    key = rendezvous.join_key(RUN, 0, "b")
    restarted = []

    def restart_b_once_a_has_read_it(read_key: str) -> None:  # b is killed and restarted right then
        if read_key == key and not restarted:
            restarted.append(True)
            stored = store.read(key)
            assert stored is not None
            store.swap(key, rendezvous.join_to_json(RUN, 0, rendezvous.Join(second)), stored.version)

    sealer = agent(AfterRead(store, restart_b_once_a_has_read_it), "a", Clock(), min_nodes=2, max_nodes=2)
    membership = sealer.join()
    assert restarted and membership.agent_ids == ("a", "b")
    assert membership.members[1].incarnation == second.incarnation, "sealed with b's dead process"


# ---- 6: a lease is timed only over what the observer could see --------------------------------------------


def test_an_outage_of_the_store_does_not_expire_a_healthy_generation(store) -> None:
    clock = Clock()
    outage = Outage(store, lambda: 20.0 <= clock.now < 60.0)  # 40 s, five lease timeouts, for everyone
    config = {"min_nodes": 1, "max_nodes": 3, "last_call": 0.0, "lease_timeout": 8.0}
    b = agent(outage, "b", clock, **config)
    m0 = sealed(store, 0, b)

    def script(now: float) -> None:  # b trains and renews its lease (when it can), then scales up at 80 s
        if now >= 80.0:
            if store.read(rendezvous.join_key(RUN, 1, "b")) is None:
                joins(store, 1, m0.members[0])
            return
        try:
            b.poll(m0)
        except errors.RecordUnavailableError:
            pass

    clock.script = script
    membership = agent(outage, "a", clock, **config).join()
    assert membership.agent_ids == ("a", "b"), "the late joiner sealed alone after the outage"


# ---- 7: last call starts when the generation before is over ------------------------------------------------


def test_a_late_joiner_with_the_lowest_id_waits_for_every_member_at_a_scale_up(store) -> None:
    clock = Clock()
    config = {"min_nodes": 1, "max_nodes": 4, "last_call": 10.0, "lease_timeout": 8.0}
    b, c = agent(store, "b", clock, **config), agent(store, "c", clock, **config)
    m0 = sealed(store, 0, b, c)

    def script(now: float) -> None:  # b and c train 100 s, then reach the boundary a moment apart
        if now < 100.0:
            b.poll(m0)
        for x, at in ((b, 100.0), (c, 101.0)):
            if now >= at and store.read(rendezvous.join_key(RUN, 1, x.agent_id)) is None:
                joins(store, 1, member_of(x))

    clock.script = script
    membership = agent(store, "a", clock, **config).join()
    assert membership.agent_ids == ("a", "b", "c"), "sealed at the first member's arrival, leaving c out"


# ---- 8: a spare beyond max_nodes is not admitted -----------------------------------------------------------


def test_poll_admits_late_joiners_only_below_max_nodes(store) -> None:
    b, c = agent(store, "b", max_nodes=2), agent(store, "c", max_nodes=2)
    m0 = sealed(store, 0, b, c)
    assert not b.poll(m0).admits  # no one waits
    joins(store, 1, dead_joiner("a"))  # (fresh: poll has just seen it)
    at_max = c.poll(m0)
    assert at_max.waiting == frozenset("a") and not at_max.admits and not at_max.superseded
    assert agent(store, "c", max_nodes=3).poll(m0).admits


# ---- 9: a join proves liveness only while its owner renews it -----------------------------------------------


def test_poll_stops_counting_a_late_joiner_whose_join_stopped_changing(store) -> None:
    clock = Clock()
    b = agent(store, "b", clock, max_nodes=3, lease_timeout=8.0)
    m0 = sealed(store, 0, b)
    joins(store, 1, dead_joiner("c"))  # c joined generation 1, then died
    assert b.poll(m0).admits
    while clock.now < 12.0:
        clock.sleep(1.0)
        nxt = b.poll(m0)
    assert nxt.waiting == frozenset() and not nxt.admits and not nxt.superseded


def test_a_waiting_late_joiner_renews_its_join_and_stays_admitted(store) -> None:
    clock = Clock()
    config = {"min_nodes": 1, "max_nodes": 3, "last_call": 0.0, "lease_timeout": 8.0}
    b = agent(store, "b", clock, **config)
    m0 = sealed(store, 0, b)
    seen: list[rendezvous.NextGeneration] = []

    def script(now: float) -> None:  # b trains 100 s (twelve lease timeouts), then scales up
        if now < 100.0:
            seen.append(b.poll(m0))
        elif store.read(rendezvous.join_key(RUN, 1, "b")) is None:
            joins(store, 1, m0.members[0])

    clock.script = script
    assert agent(store, "a", clock, **config).join().agent_ids == ("a", "b")
    assert len(seen) > 50 and all(nxt.waiting == frozenset("a") and nxt.admits for nxt in seen[1:])


def test_the_sealer_leaves_out_a_late_joiner_whose_join_stopped_changing(store) -> None:
    clock = Clock()
    b = agent(store, "b", clock, min_nodes=1, max_nodes=3, lease_timeout=8.0)
    m0 = sealed(store, 0, b)
    joins(store, 1, dead_joiner("c"))
    while clock.now < 12.0:  # b trains and polls; then it re-forms (a failure, a boundary: any)
        b.poll(m0)
        clock.sleep(1.0)
    assert b.join(previous=m0).agent_ids == ("b",), "sealed a dead late joiner into the generation"


# ---- 10: an agent that stalled while its generation was removed moves on -----------------------------------


def test_an_agent_that_stalls_past_a_sweep_moves_on_to_the_floor(store) -> None:
    clock = Clock()
    config = {"min_nodes": 1, "max_nodes": 3, "last_call": 0.0, "lease_timeout": 8.0, "join_timeout": 60.0}
    b = agent(store, "b", clock, **config)
    m0 = sealed(store, 0, b)
    stalled = []

    def script(now: float) -> None:
        if now < 20.0:
            b.poll(m0)
        elif not stalled:  # a stops here (SIGSTOP); meanwhile generations 1 and 2 run and a sweep removes them
            stalled.append(now)
            store.create(rendezvous.floor_key(RUN), {"version": 1, "kind": "floor", "run_id": RUN,
                                                     "generation": 3, "agent_id": "b", "at": 0.0})
            for key in store.keys(f"rdzv/{RUN}/"):
                if (rendezvous.generation_of(RUN, key) or 0) < 3 and key != rendezvous.floor_key(RUN):
                    store.delete(key)
            clock.now += 100.0

    clock.script = script
    a = agent(store, "a", clock, **config)
    membership = a.join()
    assert stalled and membership.generation == 3 and membership.includes("a", a.incarnation)
    assert not store.keys(rendezvous.generation_prefix(RUN, 1)), "a wrote into the removed generation"


# ---- 15: join_timeout bounds forming, not a late joiner's wait while the generation before runs -------------


def test_a_late_joiner_waits_past_join_timeout_while_the_generation_before_runs(store) -> None:
    clock = Clock()
    config = {"min_nodes": 1, "max_nodes": 3, "lease_timeout": 8.0, "join_timeout": 30.0}
    b = agent(store, "b", clock, **config)
    m0 = sealed(store, 0, b)

    def script(now: float) -> None:  # b trains for ten join timeouts, then the run ends
        b.poll(m0)
        if now >= 300.0:
            b.finish("training complete")

    clock.script = script
    with pytest.raises(errors.RendezvousClosedError, match="training complete"):
        agent(store, "a", clock, **config).join()


def test_a_late_joiner_times_out_join_timeout_after_the_generation_before_stopped(store) -> None:
    clock = Clock()
    config = {"min_nodes": 2, "max_nodes": 3, "lease_timeout": 8.0, "join_timeout": 30.0}
    b = agent(store, "b", clock, **config)
    m0 = sealed(store, 0, b)

    def script(now: float) -> None:  # b trains 100 s, then dies: a, alone, can't form (min_nodes=2)
        if now < 100.0:
            b.poll(m0)

    clock.script = script
    with pytest.raises(errors.RendezvousTimeoutError) as raised:
        agent(store, "a", clock, **config).join()
    assert raised.value.generation == 1 and clock.now >= 100.0 + 30.0


# ---- 17: a new launch of a finished run is a new run ------------------------------------------------------------


class Deletions(Outage):
    def __init__(self, store: record.RecordStore):
        super().__init__(store, lambda: False)
        self.deleted: list[str] = []

    def delete(self, key: str) -> None:
        self.deleted.append(key)
        self.store.delete(key)


def test_reopening_a_finished_run_removes_its_records_finished_last_and_a_new_launch_trains(store) -> None:
    a, b = agent(store, "a", max_nodes=2), agent(store, "b", max_nodes=2)
    m0 = sealed(store, 0, a, b)
    joins(store, 1, member_of(a))
    store.create(rendezvous.floor_key(RUN), {"version": 1, "kind": "floor", "run_id": RUN, "generation": 0,
                                             "agent_id": "a", "at": 0.0})
    a.poll(m0)  # its lease
    a.finish("training complete")
    with pytest.raises(errors.RendezvousClosedError):
        agent(store, "a").join()
    watched = Deletions(store)
    assert rendezvous.reopen_run(watched, RUN) == "training complete"
    assert store.keys(f"rdzv/{RUN}/") == []
    assert watched.deleted[-2:] == [rendezvous.floor_key(RUN), rendezvous.finished_key(RUN)]
    again = agent(store, "a").join()  # the relaunch forms generation 0 anew
    assert again.generation == 0 and again.agent_ids == ("a",)


def test_reopening_a_run_that_is_not_finished_changes_nothing(store, tmp_path) -> None:
    a = agent(store, "a")
    a.join()
    before = store.keys(f"rdzv/{RUN}/")
    assert rendezvous.reopen_run(store, RUN) is None
    assert store.keys(f"rdzv/{RUN}/") == before
    (tmp_path / "rdzv" / RUN / "finished").mkdir(parents=True)
    (tmp_path / "rdzv" / RUN / "finished" / ".v000000001").write_bytes(b"\xff")  # not a verdict: ignored
    assert rendezvous.reopen_run(store, RUN) is None
    with pytest.raises(ValueError):
        rendezvous.reopen_run(store, "../x")
