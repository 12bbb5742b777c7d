"""The node agent drives its node's lifecycle (elastic.c's table) through a whole run: each event where the agent
really goes through it, the rendezvous' generation numbers recorded, its state in every event it writes.

A one-node agent runs in this process with a stand-in worker (a few lines speaking the control channel, no
training) that fails generation 0 and completes generation 1: a failure, a re-formation, the end. The other
runs end the other ways a node's life ends: its restart budget, a worker's fatal error, a join timeout, a run
another agent marked finished. tests/unit/elastic/test_elastic_lifecycle.py checks the table itself.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from SneppX_ALG import errors
from SneppX_ALG.elastic import agent as agent_lib
from SneppX_ALG.elastic import rendezvous
from SneppX_ALG.elastic.agent import AgentSettings, NodeAgent
from SneppX_ALG.records import open_record_store

RUN = "life"
# says it is ready; fails generation 0 (its collectives "failed") and completes every later one
WORKER = """
import json, os, socket
channel = socket.socket(fileno=int(os.environ["SNEPPX_CONTROL_FD"]))
def send(kind, **fields):
    channel.sendall(json.dumps({"kind": kind, **fields}).encode() + b"\\n")
send("idle")
for line in channel.makefile("rb"):
    message = json.loads(line)
    if message["kind"] == "exit":
        break
    if message["kind"] == "assign":
        generation = message["membership"]["generation"]
        if generation == 0:
            send("failed", generation=generation, error="CollectiveError: planted")
        else:
            send("done", generation=generation)
        send("idle", generation=generation)
"""


def settings(root: Path, **overrides: Any) -> AgentSettings:
    config = overrides.pop("rendezvous", rendezvous.RendezvousConfig(last_call=0.0, poll_max=0.05))
    return AgentSettings(**{
        "run_id": RUN, "agent_id": "node-0", "host": "127.0.0.1", "workers": 1, "elastic_root": str(root / "records"),
        "worker_command": [sys.executable, "-c", WORKER], "worker_env": {}, "rendezvous": config,
        "restart_delay": 0.0, "hang_timeout": 60.0, "poll_period": 0.05, "events_path": str(root / "events.jsonl"),
        "result_path": str(root / "result.json"), **overrides})


def events(root: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]


def walk(root: Path) -> list[tuple[str, str, str, int | None, int]]:
    """The lifecycle events the agent wrote: (event, from, to, generation, transitions)."""
    return [(e["event"], e["previous"], e["state"], e["generation"], e["transitions"])
            for e in events(root) if e["kind"] == "lifecycle"]


def run(root: Path, **overrides: Any) -> tuple[int, NodeAgent]:
    node = NodeAgent(settings(root, **overrides))
    return node.run(), node


def test_a_failure_and_a_reformation_move_the_lifecycle_and_record_each_generation(tmp_path: Path) -> None:
    code, node = run(tmp_path)
    assert code == 0
    assert walk(tmp_path) == [
        ("join", "init", "joining", None, 1),  # the first join of the rendezvous
        ("reconfigured", "joining", "running", 0, 2),  # generation 0 sealed
        ("peer_failed", "running", "reconfiguring", 0, 3),  # its worker's collectives failed
        ("reconfigured", "reconfiguring", "running", 1, 4),  # generation 1 re-formed
        ("leave", "running", "stopped", 1, 5),  # training completed
    ]
    assert (node.lifecycle.state, node.lifecycle.generation, node.lifecycle.transitions) == ("stopped", 1, 5)
    written = events(tmp_path)
    assert all("lifecycle" in e for e in written)  # every event says where the node is
    by_kind = {e["kind"]: e for e in written}  # the last of each kind
    assert (by_kind["started"]["lifecycle"], by_kind["failure"]["lifecycle"]) == ("init", "running")
    assert (by_kind["generation"]["lifecycle"], by_kind["exit"]["lifecycle"]) == ("running", "stopped")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["lifecycle"] == {"state": "stopped", "generation": 1, "transitions": 5}


def test_an_exhausted_restart_budget_fails_the_node(tmp_path: Path) -> None:
    code, node = run(tmp_path, max_restarts=0)
    assert code == agent_lib.EXIT_FAILED
    assert [step[:3] for step in walk(tmp_path)] == [
        ("join", "init", "joining"), ("reconfigured", "joining", "running"),
        ("peer_failed", "running", "reconfiguring"), ("budget_exhausted", "reconfiguring", "failed")]
    assert (node.lifecycle.state, node.lifecycle.generation) == ("failed", 0)


def test_a_workers_fatal_error_fails_the_node_instead_of_stopping_it(tmp_path: Path) -> None:
    """A fatal error (a rollback limit, a train_fn error no restart fixes) ends the run: the node ends `failed`,
    so its state says how it ended, where a completed run ends `stopped`."""
    fatal_worker = WORKER.replace('send("failed", generation=generation, error="CollectiveError: planted")',
                                  'send("fatal", generation=generation, error="RollbackLimitError: planted")')
    assert fatal_worker != WORKER
    code, node = run(tmp_path, worker_command=[sys.executable, "-c", fatal_worker])
    assert code == agent_lib.EXIT_FAILED
    assert [step[:3] for step in walk(tmp_path)] == [
        ("join", "init", "joining"), ("reconfigured", "joining", "running"), ("fatal", "running", "failed")]
    assert (node.lifecycle.state, node.lifecycle.generation) == ("failed", 0)
    assert json.loads((tmp_path / "result.json").read_text())["lifecycle"]["state"] == "failed"


def test_no_generation_in_time_is_a_timeout(tmp_path: Path) -> None:
    waits_for_two = rendezvous.RendezvousConfig(min_nodes=2, max_nodes=2, join_timeout=0.3, poll_max=0.05)
    code, node = run(tmp_path, rendezvous=waits_for_two)
    assert code == agent_lib.EXIT_FAILED
    assert [step[:3] for step in walk(tmp_path)] == [("join", "init", "joining"), ("timeout", "joining", "failed")]
    assert not node.lifecycle.formed


def test_a_run_another_agent_finished_is_left(tmp_path: Path) -> None:
    rendezvous.Rendezvous(open_record_store(str(tmp_path / "records")), RUN, agent_id="node-1", host="127.0.0.1",
                          heartbeat="127.0.0.1:1", workers=1).finish("completed")
    code, node = run(tmp_path)
    assert code == 0
    assert [step[:3] for step in walk(tmp_path)] == [("join", "init", "joining"), ("leave", "joining", "stopped")]
    assert node.lifecycle.state == "stopped" and not node.lifecycle.formed


def test_an_event_the_nodes_state_forbids_raises_and_changes_nothing(tmp_path: Path) -> None:
    """A generation formed while the last one still runs (its end not marked), or a join deadline passing while
    training runs, is a bug of the agent's: refused, not drifted into, and not reported as a transition."""
    node = NodeAgent(settings(tmp_path))
    try:
        node._transition("join")
        node._transition("reconfigured", 4)
        for event, generation in (("reconfigured", 5), ("timeout", None)):
            with pytest.raises(errors.LifecycleError):
                node._transition(event, generation)
        assert (node.lifecycle.state, node.lifecycle.generation, node.lifecycle.transitions) == ("running", 4, 2)
        assert [step[0] for step in walk(tmp_path)] == ["join", "reconfigured"]
    finally:
        node.heartbeat_socket.close()
