"""The rendezvous with real agent processes on a real directory and on both real S3 servers.

Every scenario runs on a directory (`TestOnADirectory`) and on S3 (`TestOnS3`, once per test server: moto
and the Versity S3 Gateway). Agents are separate processes (tests/integration/rdzv_agent.py) killed with
real signals; what they report is checked against what the store holds.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from SneppX_ALG import errors, storage
from SneppX_ALG.elastic import rendezvous
from SneppX_ALG.records import RecordStore, open_record_store

AGENT = pathlib.Path(__file__).with_name("rdzv_agent.py")
DEADLINE_S = 120.0  # generous: agents are processes on a loaded 2-core machine


def start_agent(root: str, run_id: str, agent_id: str, out: pathlib.Path, *options: str) -> subprocess.Popen[bytes]:
    with open(out / f"{agent_id}.log", "ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, str(AGENT), root, run_id, agent_id,
                                 str(out / f"{agent_id}.json"), *options], stdout=log, stderr=subprocess.STDOUT)


def result_of(out: pathlib.Path, agent_id: str) -> dict[str, Any] | None:
    try:
        return json.loads((out / f"{agent_id}.json").read_text())  # type: ignore[no-any-return]
    except FileNotFoundError:
        return None


def finish(processes: dict[str, subprocess.Popen[bytes]], out: pathlib.Path) -> dict[str, dict[str, Any]]:
    """Waits for every agent to exit; returns what each reported (a test fails on an agent that didn't)."""
    results = {}
    for agent_id, process in processes.items():
        try:
            process.wait(DEADLINE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        result = result_of(out, agent_id)
        log = (out / f"{agent_id}.log").read_text(errors="replace")[-3000:]
        assert process.returncode == 0 and result is not None, f"agent {agent_id} failed:\n{log}"
        results[agent_id] = result
    return results


def wait_for(condition: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def sealed_generations(store: RecordStore, run_id: str) -> list[str]:
    return [k for k in store.keys(f"rdzv/{run_id}/") if k.endswith("/membership")]


def make_agent(store: RecordStore, run_id: str, agent_id: str, **config: Any) -> rendezvous.Rendezvous:
    return rendezvous.Rendezvous(store, run_id, agent_id=agent_id, host="127.0.0.1", heartbeat="127.0.0.1:29500",
                                 workers=1, config=rendezvous.RendezvousConfig(**config))


class Joining(threading.Thread):
    """An agent's join() on a thread of this process (for the scenarios that need no process of their own)."""

    def __init__(self, agent: rendezvous.Rendezvous, **kwargs: Any):
        super().__init__(daemon=True)
        self.agent, self.kwargs = agent, kwargs
        self.membership: rendezvous.Membership | None = None
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            self.membership = self.agent.join(**self.kwargs)
        except Exception as e:  # noqa: BLE001 (any failure of the thread is re-raised by result())
            self.error = e

    def result(self) -> rendezvous.Membership:
        self.join(DEADLINE_S)
        assert not self.is_alive(), f"{self.agent.agent_id} is still joining"
        if self.error is not None:
            raise self.error
        assert self.membership is not None
        return self.membership


def put_raw(root: str, key: str, data: bytes) -> None:
    """Bytes under a record key, bypassing the record store: what a buggy or hostile writer could leave."""
    if root.startswith("s3://"):
        bucket, prefix = storage.parse_s3_uri(root)
        storage.make_s3_client().put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=data)
    else:
        os.makedirs(os.path.join(root, key), exist_ok=True)
        with open(os.path.join(root, key, ".v000000001"), "wb") as f:
            f.write(data)


class Scenarios:
    """The rendezvous scenarios; the subclasses say which store they run on."""

    @pytest.fixture
    def root(self) -> str:
        raise NotImplementedError

    @pytest.fixture
    def store(self, root: str) -> RecordStore:
        return open_record_store(root)

    def test_agents_in_separate_processes_agree_on_one_membership_and_ranks(self, root, store, tmp_path) -> None:
        workers = {"n0": 2, "n1": 1, "n2": 3, "n3": 2, "n4": 1}
        agents = {a: start_agent(root, "run", a, tmp_path, "--min", "5", "--max", "5", "--workers", str(w))
                  for a, w in workers.items()}
        results = finish(agents, tmp_path)
        assert all(r["error"] is None for r in results.values()), results
        views = {a: r["memberships"][0] for a, r in results.items()}
        ids = sorted(workers)
        for agent_id, view in views.items():
            assert view["generation"] == 0 and view["members"] == ids
            assert view["sealed_by"] == views["n0"]["sealed_by"]  # one sealer, the same for everyone
            assert view["incarnations"] == views["n0"]["incarnations"]
            assert view["node_rank"] == ids.index(agent_id)
            assert view["rank_offset"] == sum(workers[a] for a in ids[:ids.index(agent_id)])
            assert view["world_size"] == 9
        assert views["n0"]["sealed_by"] == "n0"  # the natural sealer: the lowest agent id
        assert sealed_generations(store, "run") == ["rdzv/run/g000000000/membership"]
        assert store.keys("rdzv/run/g000000000/join/") == [f"rdzv/run/g000000000/join/{a}" for a in ids]

    def test_two_agents_racing_for_each_generation_leave_exactly_one_membership(self, root, store,
                                                                                tmp_path) -> None:
        runs = 6  # two processes race through six runs, each a fresh generation 0 for both
        agents = {a: start_agent(root, "race", a, tmp_path, "--min", "2", "--max", "2", "--runs", str(runs))
                  for a in ("a", "b")}
        results = finish(agents, tmp_path)
        for i in range(runs):
            a, b = (results[x]["memberships"][i] for x in ("a", "b"))
            assert a["run_id"] == b["run_id"] == f"race-{i}"
            assert a == b | {"node_rank": 0, "rank_offset": 0}  # the same record: members, incarnations, sealer
            assert sealed_generations(store, f"race-{i}") == [f"rdzv/race-{i}/g000000000/membership"]

    def test_many_agents_all_sealing_at_once_leave_exactly_one_membership(self, root, store, tmp_path) -> None:
        # seal_grace 0: every agent is a sealer at every poll, so all of them race to create the membership
        names = [f"n{i}" for i in range(6)]
        agents = {a: start_agent(root, "herd", a, tmp_path, "--min", "6", "--max", "6", "--seal-grace", "0",
                                 "--runs", "3") for a in names}
        results = finish(agents, tmp_path)
        for i in range(3):
            views = [results[a]["memberships"][i] for a in names]
            assert len({(v["sealed_by"], tuple(v["incarnations"])) for v in views}) == 1, views
            assert sealed_generations(store, f"herd-{i}") == [f"rdzv/herd-{i}/g000000000/membership"]

    def test_a_natural_sealer_killed_before_sealing_is_replaced_by_another(self, root, store, tmp_path) -> None:
        options = ("--min", "3", "--max", "3", "--seal-grace", "1")
        first = start_agent(root, "orphan", "a", tmp_path, *options)  # the lowest id: the natural sealer
        wait_for(lambda: store.keys("rdzv/orphan/g000000000/join/") == ["rdzv/orphan/g000000000/join/a"],
                 "agent a joined")
        first.send_signal(signal.SIGKILL)  # alone, it could not seal yet (min 3); now it never will
        first.wait()
        results = finish({a: start_agent(root, "orphan", a, tmp_path, *options) for a in ("b", "c")}, tmp_path)
        views = [results[a]["memberships"][0] for a in ("b", "c")]
        assert views[0] == views[1] | {"node_rank": 1, "rank_offset": 1}
        assert views[0]["members"] == ["a", "b", "c"]  # a's join stands; its heartbeat silence ends generation 0
        assert views[0]["sealed_by"] in ("b", "c")

    def test_a_late_joiner_waits_for_the_members_to_open_the_next_generation(self, root, store,
                                                                             tmp_path) -> None:
        # a and b form generation 0 and stay; c comes later with min_nodes=1: it must not form generation 1
        # alone while a and b run (node 0 renews generation 0's lease), but wait for them to join it.
        # a and b scale up at their next "checkpoint boundary", 3 s after c appears: c, alone with min_nodes 1
        # and a 0.2 s last call until then, must wait for them. Last call is long (8 s): generation 1 must seal
        # at once when a and b have joined it (every member of generation 0 is there), not because b was slow
        # to see c on a loaded machine.
        running = {a: start_agent(root, "late", a, tmp_path, "--min", "2", "--max", "3", "--last-call", "8",
                                  "--stay", "25", "--boundary-every", "3") for a in ("a", "b")}
        wait_for(lambda: (result_of(tmp_path, "a") or {}).get("memberships"), "a and b formed generation 0")
        late = start_agent(root, "late", "c", tmp_path, "--min", "1", "--max", "3", "--last-call", "0.2")
        results = finish({**running, "c": late}, tmp_path)
        assert [m["members"] for m in results["a"]["memberships"]] == [["a", "b"], ["a", "b", "c"]]
        assert results["c"]["memberships"] == [results["a"]["memberships"][1] | {"node_rank": 2, "rank_offset": 2}]
        assert results["c"]["memberships"][0]["generation"] == 1

    def test_late_joiners_form_a_generation_once_the_running_one_stops_renewing(self, root, store,
                                                                                tmp_path) -> None:
        running = {a: start_agent(root, "gone", a, tmp_path, "--min", "2", "--max", "2", "--lease-timeout", "2",
                                  "--stay", "300") for a in ("a", "b")}
        wait_for(lambda: sealed_generations(store, "gone"), "a and b formed generation 0")
        late = start_agent(root, "gone", "c", tmp_path, "--min", "1", "--max", "3", "--last-call", "0.2",
                           "--lease-timeout", "2")
        wait_for(lambda: store.keys("rdzv/gone/g000000001/join/"), "c waits at generation 1")
        for process in running.values():  # the whole running generation dies at once
            process.send_signal(signal.SIGKILL)
            process.wait()
        result = finish({"c": late}, tmp_path)["c"]
        assert [(m["generation"], m["members"]) for m in result["memberships"]] == [(1, ["c"])]

    def test_a_late_joiner_killed_while_it_waits_is_neither_admitted_nor_sealed_in(self, root, store,
                                                                                  tmp_path) -> None:
        # a trains alone (this test polls for it: its lease is renewed); c waits at generation 1, renewing its
        # join, and is SIGKILLed. Its join record stays, but stops changing: a stops counting it as waiting,
        # and when a re-forms, c is left out instead of being sealed in dead.
        a = make_agent(store, "dead", "a", min_nodes=1, max_nodes=3, last_call=0.1, lease_timeout=3.0)
        generation0 = a.join()

        def poll_until(condition: Callable[[rendezvous.NextGeneration], bool], what: str) -> None:
            wait_for(lambda: condition(a.poll(generation0)), what)

        late = start_agent(root, "dead", "c", tmp_path, "--min", "1", "--max", "3", "--last-call", "0.2",
                           "--lease-timeout", "3")
        poll_until(lambda nxt: nxt.waiting == frozenset("c") and nxt.admits, "c waits at generation 1")
        late.send_signal(signal.SIGKILL)
        late.wait()
        poll_until(lambda nxt: not nxt.waiting and not nxt.superseded, "a no longer counts the dead c")
        assert store.keys("rdzv/dead/g000000001/join/") == ["rdzv/dead/g000000001/join/c"]  # it stays
        current = a.join(previous=generation0)
        assert (current.generation, current.agent_ids) == (1, ("a",))

    # ---- sizes and times: min, max, last call, join timeout (agents on threads) --------------------------

    def test_min_nodes_seal_after_last_call_without_waiting_for_max(self, store) -> None:
        joining = [Joining(make_agent(store, "min", a, min_nodes=2, max_nodes=4, last_call=0.5)) for a in "ab"]
        memberships = [j.result() for j in joining]
        assert [m.agent_ids for m in memberships] == [("a", "b")] * 2

    def test_an_agent_that_joins_within_last_call_is_included(self, store) -> None:
        config = {"min_nodes": 2, "max_nodes": 4, "last_call": 8.0}
        first = [Joining(make_agent(store, "call", a, **config)) for a in "ab"]
        wait_for(lambda: len(store.keys("rdzv/call/g000000000/join/")) == 2, "a and b joined")
        third = Joining(make_agent(store, "call", "c", **config))  # well within the 8 s of last call
        assert {j.result().agent_ids for j in [*first, third]} == {("a", "b", "c")}

    def test_max_nodes_caps_a_generation_and_the_rest_wait_for_the_next(self, store) -> None:
        config = {"min_nodes": 3, "max_nodes": 3, "join_timeout": 4.0, "seal_grace": 0.5}
        joining = {a: Joining(make_agent(store, "max", a, **config)) for a in "abcde"}
        for j in joining.values():
            j.join(DEADLINE_S)
        formed = {a for a, j in joining.items() if j.error is None}
        assert len(formed) == 3 and {joining[a].result().agent_ids for a in formed} == {tuple(sorted(formed))}
        for a in set(joining) - formed:  # generation 0 runs (its lease is fresh): they wait at 1, then time out
            error = joining[a].error
            assert isinstance(error, errors.RendezvousTimeoutError) and error.generation == 1, error
            assert "is still running" in str(error)
        assert store.keys("rdzv/max/g000000001/join/") == []  # each withdrew its join when it gave up

    def test_join_timeout_raises_with_who_joined_and_withdraws_the_join(self, store) -> None:
        joining = [Joining(make_agent(store, "short", a, min_nodes=3, max_nodes=3, join_timeout=timeout))
                   for a, timeout in (("a", 1.5), ("b", 4.0))]  # b withdraws after a has given up
        wait_for(lambda: all(not j.is_alive() for j in joining), "both gave up", timeout=60)
        for j in joining:
            assert isinstance(j.error, errors.RendezvousTimeoutError) and j.error.min_nodes == 3
            assert j.error.generation == 0
        assert joining[0].error.joined == ("a", "b")  # type: ignore[union-attr]  # a is the natural sealer
        assert store.keys("rdzv/short/g000000000/join/") == []  # both withdrew their joins

    def test_survivors_of_a_failure_re_form_at_once_without_waiting_for_last_call(self, store) -> None:
        config = {"min_nodes": 2, "max_nodes": 3, "last_call": 600.0, "join_timeout": 60.0}
        agents = {a: make_agent(store, "fail", a, **config) for a in "abc"}
        first = [Joining(agent) for agent in agents.values()]
        generation0 = first[0].result()
        assert generation0.agent_ids == ("a", "b", "c")  # max reached
        survivors = [Joining(agents[a], previous=generation0, suspects={"c"}) for a in "ab"]  # c died
        assert {j.result().agent_ids for j in survivors} == {("a", "b")}  # not 600 s of last call later

    # ---- generations: late, old, hostile -------------------------------------------------------------------

    def test_poll_sees_late_joiners_then_the_fence_closes_when_a_member_leaves(self, store) -> None:
        # last call 5 s: after b joins generation 1, a has that long to join it too (this test's own calls)
        running = [Joining(make_agent(store, "fence", a, min_nodes=2, max_nodes=3, last_call=5.0)) for a in "ab"]
        a, b = (j.agent for j in running)
        generation0 = running[0].result()
        late = Joining(make_agent(store, "fence", "c", min_nodes=1, max_nodes=3, last_call=0.2))
        wait_for(lambda: store.keys("rdzv/fence/g000000001/join/"), "c joined generation 1")
        upcoming = a.poll(generation0)  # a is node 0: this also renews generation 0's lease
        assert (upcoming.waiting, upcoming.closing, upcoming.superseded) == (frozenset("c"), frozenset(), False)
        a.check_fence(generation0)  # late joiners waiting do not end generation 0: it may still commit
        b_moves = Joining(b, previous=generation0)
        wait_for(lambda: len(store.keys("rdzv/fence/g000000001/join/")) == 2, "b joined generation 1")
        upcoming = a.poll(generation0)
        assert upcoming.closing == frozenset("b") and upcoming.superseded
        with pytest.raises(errors.StaleGenerationError, match="generation 1 was joined by b"):
            a.check_fence(generation0)
        a_moves = Joining(a, previous=generation0)
        assert {j.result().agent_ids for j in (late, b_moves, a_moves)} == {("a", "b", "c")}
        with pytest.raises(errors.StaleGenerationError, match="generation 1 is sealed"):
            a.check_fence(generation0)

    def test_an_older_generation_is_never_taken_as_current(self, store) -> None:
        old = make_agent(store, "old", "x", min_nodes=2, max_nodes=2)
        y_old = make_agent(store, "old", "y", min_nodes=2, max_nodes=2)
        generation0 = {j.result() for j in (Joining(old), Joining(y_old))}.pop()
        assert generation0.includes("x", old.incarnation)
        generation1 = {j.result() for j in (Joining(make_agent(store, "old", "y", min_nodes=2, max_nodes=2),
                                                    previous=generation0, suspects={"x"}),
                                            Joining(make_agent(store, "old", "z", min_nodes=2, max_nodes=2)))}.pop()
        assert (generation1.generation, generation1.agent_ids) == (1, ("y", "z"))
        # x comes back as a new process: generation 0 lists an agent named x, but not this one, and generation
        # 1 (sealed, running, never renewing its lease here) does not list it at all: x waits at generation 2
        x = make_agent(store, "old", "x", min_nodes=1, max_nodes=3, last_call=0.1, seal_grace=0.2,
                       lease_timeout=0.5)
        current = x.join()
        assert (current.generation, current.agent_ids) == (2, ("x",)) and current.includes("x", x.incarnation)
        with pytest.raises(errors.StaleGenerationError):
            x.check_fence(generation0)
        with pytest.raises(errors.StaleGenerationError):
            x.check_fence(generation1)
        assert x.newest_generation() == 2
        x.check_fence(current)

    def test_a_restarted_agent_never_takes_its_predecessors_place(self, store) -> None:
        first = {a: make_agent(store, "restart", a, min_nodes=2, max_nodes=2) for a in "xy"}
        generation0 = {j.result() for j in [Joining(agent) for agent in first.values()]}.pop()
        # x's process dies and a new one starts under the same agent id: generation 0 lists x, but not it
        again = make_agent(store, "restart", "x", min_nodes=1, max_nodes=2, last_call=0.1)
        current = again.join()
        assert current.generation == 1 and current.includes("x", again.incarnation)
        assert not generation0.includes("x", again.incarnation)
        upcoming = first["y"].poll(generation0)  # y learns that generation 0 is over: x joined the next one
        assert upcoming.superseded and upcoming.closing == frozenset("x")

    def test_hostile_join_records_are_ignored(self, root, store) -> None:
        garbage = {
            "not-json": b"\x80\x81 not json", "array": b"[1, 2]", "nan": b'{"version": NaN}',
            "duplicate": b'{"version": 1, "version": 1}', "huge": b'{"pad": "' + b"x" * (2 << 20) + b'"}',
            "empty-object": b"{}", "deep": b"[" * 100_000 + b"]" * 100_000,
        }
        join = rendezvous.join_to_json("evil", 0, rendezvous.Join(rendezvous.Member(
            "0impostor", "0" * 32, "h", "h:1", 1, 0.0)))
        wrong = {"0impostor": join | {"member": join["member"] | {"agent_id": "a"}},  # under another's key
                 "0wrong-run": join | {"run_id": "other"}, "0bool-gen": join | {"generation": True},
                 "0many-workers": join | {"member": join["member"] | {"workers": 10**9}},
                 "0extra": join | {"extra": 1}}
        for name, data in garbage.items():  # all sort before "a": the first in line to seal is garbage
            put_raw(root, f"rdzv/evil/g000000000/join/0{name}", data)
        for name, value in wrong.items():
            store.create(f"rdzv/evil/g000000000/join/{name}", value)
        put_raw(root, "rdzv/evil/g000000000/sealer", b"garbage")
        put_raw(root, "rdzv/evil/finished", b"\xff")  # an invalid finished marker does not stop the run
        joining = [Joining(make_agent(store, "evil", a, min_nodes=2, max_nodes=2, seal_grace=0.3,
                                      join_timeout=60)) for a in "ab"]
        memberships = {j.result() for j in joining}
        assert [(m.generation, m.agent_ids) for m in memberships] == [(0, ("a", "b"))]

    def test_an_invalid_membership_voids_its_generation_for_every_agent(self, root, store) -> None:
        put_raw(root, "rdzv/void/g000000000/membership", b'{"version": 1, "kind": "membership"}')
        put_raw(root, "rdzv/void/g000000000/alive", b"garbage")
        joining = [Joining(make_agent(store, "void", a, min_nodes=2, max_nodes=2, join_timeout=20))
                   for a in "ab"]
        memberships = {j.result() for j in joining}
        assert [(m.generation, m.agent_ids) for m in memberships] == [(1, ("a", "b"))]

    # ---- old generations are removed --------------------------------------------------------------------

    def test_old_generations_are_removed_and_nothing_goes_back_to_them(self, store) -> None:
        a, b = (make_agent(store, "sweep", x, min_nodes=2, max_nodes=2, join_timeout=60) for x in "ab")
        history = [{j.result() for j in (Joining(a), Joining(b))}.pop()]
        for _ in range(4):  # generations 1-4: both move on together; the sealer removes the old at its poll
            m = history[-1]
            history.append({j.result() for j in (Joining(a, previous=m), Joining(b, previous=m))}.pop())
            for agent in (a, b):
                agent.poll(history[-1])
        assert history[-1].generation == 4
        left = {rendezvous.generation_of("sweep", k) for k in store.keys("rdzv/sweep/")}
        assert left == {3, 4, None}, store.keys("rdzv/sweep/")  # None: the run's floor record
        assert a.floor() == 3
        # a stalled process of generation 1 (a new object: it has read nothing since) finds it over
        stalled = make_agent(store, "sweep", "a")
        assert stalled.poll(history[1]).superseded
        with pytest.raises(errors.StaleGenerationError, match="records were removed"):
            stalled.check_fence(history[1])
        b.check_fence(history[-1])  # the running generation is not over
        # a new agent joins where the run is (generation 5, once 4 stops renewing its lease), not at 0
        c = make_agent(store, "sweep", "c", min_nodes=1, max_nodes=3, last_call=0.1, seal_grace=0.2,
                       lease_timeout=0.5)
        assert c.newest_generation() == 4
        assert c.join().generation == 5
        # and so does an agent still holding generation 0
        a_again = make_agent(store, "sweep", "a", min_nodes=1, max_nodes=3, last_call=0.1, seal_grace=0.2,
                             lease_timeout=0.5)
        assert a_again.join(previous=history[0]).generation == 6  # 5 sealed without it; 6 once 5 is over
        assert not store.keys("rdzv/sweep/g000000001/")

    def test_a_sealer_that_stalled_while_its_generation_was_removed_does_not_seal_it(self, store) -> None:
        first = make_agent(store, "stall", "b")
        generation0 = first.join()

        def stall(seconds: float) -> None:  # while x waits: two generations run and are removed (as by a sweep)
            if store.read("rdzv/stall/floor") is None:
                store.create("rdzv/stall/floor", {"version": 1, "kind": "floor", "run_id": "stall",
                                                  "generation": 3, "agent_id": "b", "at": 0.0})
            time.sleep(seconds)

        x = rendezvous.Rendezvous(store, "stall", agent_id="a", host="127.0.0.1", heartbeat="127.0.0.1:29500",
                                  workers=1, sleep=stall, config=rendezvous.RendezvousConfig(
                                      min_nodes=1, max_nodes=2, last_call=0.1, lease_timeout=0.3))
        assert x.join(previous=generation0).generation == 3
        assert store.read(rendezvous.membership_key("stall", 1)) is None  # (its join stays until a sweep)

    def test_a_finished_run_refuses_new_joins(self, store) -> None:
        agent = make_agent(store, "done", "a")
        agent.join()
        agent.finish("training complete")
        with pytest.raises(errors.RendezvousClosedError, match="training complete"):
            make_agent(store, "done", "b").join()


class TestOnADirectory(Scenarios):
    @pytest.fixture
    def root(self, tmp_path: pathlib.Path) -> str:
        return str(tmp_path / "store")


class TestOnS3(Scenarios):
    @pytest.fixture
    def root(self, s3_bucket: str) -> str:
        return f"s3://{s3_bucket}/job"


def test_rendezvous_keys_never_look_like_checkpoint_steps(tmp_path) -> None:
    # the rendezvous shares the checkpoint root: nothing it writes may be listed or cleaned up as a step
    root = str(tmp_path)
    agent = rendezvous.Rendezvous(open_record_store(root), "r", agent_id="a", host="h", heartbeat="h:1",
                                  workers=1)
    agent.join()
    steps = storage.open_storage(root)
    assert steps.committed_steps() == [] and steps.cleanup() == []
    assert os.listdir(root) == ["rdzv"]
