"""Recovery from peer-memory snapshots (elastic/snapshot/): real launchers, agents and workers
(recovery_script.py, a snapshot every step, a durable checkpoint every 10), failures made with real signals.
Each run must end at the parameters of the same training uninterrupted (w replicated, m sharded over the ranks)
and say where each generation resumed from: steps redone = the last step done before the failure - the step
restored (at most 1 when the failure hit while that step's copies were in flight; storage alone would redo up
to 9 here).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import recovery_script
from recovery_script import M, Run

STEPS = 40
EVERY = 10  # the durable checkpoint interval


@pytest.fixture
def runs(launched: list[Run]) -> Any:
    def start(out: Path, **knobs: Any) -> Run:
        # recovery_script's hang_timeout (5 s) keeps a starved worker from being killed as hung, which would take
        # its snapshots with it and hide what the test looks at
        defaults = {"steps": STEPS, "every": EVERY, "snapshot": 1}
        run = Run(out, str(out.parent / "ckpts"), **{**defaults, **knobs})
        launched.append(run)
        return run

    return start


def assert_trained_to_the_end(run: Run, result: dict[str, Any], steps: int = STEPS) -> dict[str, Any]:
    assert "error" not in result, result
    final = run.final()
    assert final["step"] == steps and final["w"] == [float(steps)] * 4, final  # no step lost or repeated
    assert final["m_total"] == M * steps and final["spread"] == 0.0, final  # every shard, every rank alike
    return final


def resumed(run: Run) -> list[dict[str, Any]]:
    """The restores after the first generation's start from nothing. A generation formed before any step was
    trained restores nothing either (source None): on a loaded machine the last of the nodes may join after
    last_call, and is taken in at the first boundary, at step 0; that is a start, not a recovery."""
    return [r for r in run.restores() if r["generation"] > 0 and r["before"] > 0]


def assert_from_memory_redoing_at_most_one_step(run: Run, result: dict[str, Any]) -> None:
    restores = resumed(run)
    why = (run.restores(), [f["reason"][-300:] for f in result["failures"]])
    assert restores and all(r["source"] == "memory" for r in restores), why
    assert all(r["before"] - r["step"] <= 1 for r in restores), why


@pytest.mark.parametrize("nodes", [2, 4])
def test_a_killed_worker_is_replaced_and_resumes_from_peer_memory(tmp_path: Path, runs: Any, nodes: int) -> None:
    run = runs(tmp_path / "out", nodes=nodes)
    victim = run.worker(f"node-{nodes - 1}", 0)  # found first: a /proc scan can outlast the run's last steps
    run.wait_for(lambda p: p["step"] >= 13)  # past the checkpoint of step 10: storage would redo 3+
    os.kill(victim, signal.SIGKILL)
    result = run.finish()
    assert_trained_to_the_end(run, result)
    assert_from_memory_redoing_at_most_one_step(run, result)


def test_a_killed_node_is_left_behind_and_its_part_comes_from_its_peer(tmp_path: Path, runs: Any) -> None:
    # node-1's only copy of its part is on node-0 (rank 1 -> rank 2 mod 2); the survivor goes on alone
    run = runs(tmp_path / "out", nodes=2, node_restart_delay=30)
    victim = run.agent("node-1")
    run.wait_for(lambda p: p["step"] >= 13)
    os.killpg(victim, signal.SIGKILL)
    result = run.finish()
    assert assert_trained_to_the_end(run, result)["world_size"] == 1
    assert_from_memory_redoing_at_most_one_step(run, result)


def test_a_stopped_node_is_left_behind_and_the_survivor_resumes_from_memory(tmp_path: Path, runs: Any) -> None:
    run = runs(tmp_path / "out", nodes=2, steps=60)
    frozen = run.agent("node-1")
    run.wait_for(lambda p: p["step"] >= 13)
    os.killpg(frozen, signal.SIGSTOP)
    try:
        run.wait_for(lambda p: p["world_size"] == 1)
    finally:
        os.killpg(frozen, signal.SIGKILL)
    result = run.finish()
    assert_trained_to_the_end(run, result, steps=60)
    assert_from_memory_redoing_at_most_one_step(run, result)


def test_world_4_to_2_to_4_resumes_from_memory_each_time(tmp_path: Path, runs: Any) -> None:
    # node-1 and node-3 are not neighbours: each one's copy is on a survivor; back at the next checkpoint. They
    # restart well after the heartbeat timeout (2 s): a node back before the survivors judged it gone is waited
    # for, and the world never shrinks (it did every time at 1 s against 2 s, and once in CI against 0.8 s)
    run = runs(tmp_path / "out", nodes=4, steps=30, until_world=4, node_restart_delay=5)
    victims = [run.agent(node) for node in ("node-1", "node-3")]
    run.wait_for(lambda p: p["step"] >= 13)
    for victim in victims:
        os.killpg(victim, signal.SIGKILL)
    run.wait_for(lambda p: p["world_size"] == 2)
    result = run.finish()  # until_world: it trains on until the nodes are back
    assert "error" not in result, result
    final = run.final()
    assert final["w"] == [float(final["step"])] * 4 and final["m_total"] == M * final["step"], final
    assert_from_memory_redoing_at_most_one_step(run, result)
    sizes = [g["world_size"] for g in result["generations"]]
    assert 2 in sizes and sizes[-1] == 4, sizes


def test_two_neighbours_killed_at_once_fall_back_to_storage_and_say_why(tmp_path: Path, runs: Any) -> None:
    # rank 1's part lives on node-1 and its one copy on node-2: both gone
    run = runs(tmp_path / "out", nodes=4, node_restart_delay=30)
    victims = [run.agent(node) for node in ("node-1", "node-2")]
    run.wait_for(lambda p: p["step"] >= 13)
    for victim in victims:
        os.killpg(victim, signal.SIGKILL)
    result = run.finish()
    assert_trained_to_the_end(run, result)
    first = resumed(run)[0]
    assert first["source"] == "storage" and first["step"] == 10, run.restores()
    why = next(e for e in result["events"] if e["kind"] == "restored" and e["generation"] == first["generation"])
    assert "lost the part of rank(s) 1" in why["why"], why


@pytest.mark.parametrize(("nodes", "replicas", "source"), [(2, 1, "storage"), (3, 2, "memory")])
def test_a_flipped_byte_in_a_copy_is_caught_and_another_copy_or_storage_used(
        tmp_path: Path, runs: Any, nodes: int, replicas: int, source: str) -> None:
    # rank 0 flips a byte in the copies it holds, then the last rank fails: its own snapshot dies with its
    # process, so its part survives in rank 0's corrupt copy and, with 2 replicas, in rank 1's good one
    run = runs(tmp_path / "out", nodes=nodes, replicas=replicas, flip_at=13)
    result = run.finish()
    assert_trained_to_the_end(run, result)
    corrupt = [e for e in result["events"] if e["kind"] == "snapshot_corrupt"]
    assert corrupt and corrupt[0]["source"] == nodes - 1 and "CRC32C" in corrupt[0]["problems"][0], corrupt
    first = resumed(run)[0]
    assert first["source"] == source, run.restores()
    assert first["step"] == (13 if source == "memory" else 10), run.restores()


def test_replicas_that_disagree_are_named_and_the_job_rolls_back_to_where_they_agreed(tmp_path: Path,
                                                                                     runs: Any) -> None:
    run = runs(tmp_path / "out", nodes=2, diverge_at=13)
    result = run.finish()
    assert_trained_to_the_end(run, result)  # spread 0: rank 1's drifted replica was rolled back too
    reasons = [f["reason"] for f in result["failures"]]
    assert any("ReplicaDivergenceError" in r and "rank(s) 1 differ" in r for r in reasons), reasons
    first = resumed(run)[0]
    assert first["source"] == "memory" and first["step"] == 13, run.restores()  # the last step they agreed on


def test_a_step_saved_while_rank_0s_replica_drifted_is_not_restored_from_storage(tmp_path: Path, runs: Any) -> None:
    """Defect 1 of issue 37: rank 0 of 3 drifts at step 13, so the snapshot of 14 names it; rank 0 writes the
    replicated arrays of the checkpoint of 14, saved right after. On main that step was committed and, newer than
    the last good snapshot (13), restored to every rank: the run ended off the uninterrupted parameters, with a
    report that all was well. The verdict binds storage: the commit is refused (or the step rolled past)."""
    run = runs(tmp_path / "out", nodes=3, every=7, diverge_at=13, diverge_rank=0)
    result = run.finish()
    assert_trained_to_the_end(run, result)
    reasons = [f["reason"] for f in result["failures"]]
    assert any("ReplicaDivergenceError" in r and "rank(s) 0 differ" in r for r in reasons), reasons
    first = resumed(run)[0]
    assert first["source"] == "memory" and first["step"] == 13, run.restores()


def test_snapshots_over_the_memory_limit_end_the_run_at_the_first_snapshot(tmp_path: Path, runs: Any) -> None:
    run = runs(tmp_path / "out", nodes=2, snapshot_limit=64)
    result = run.finish()
    assert result.get("error") == "ElasticRunError", result
    assert "SnapshotMemoryError" in result["message"] and "snapshot_memory_limit" in result["message"], result
    assert not (run.out / "final.json").exists()


def test_a_node_killed_while_the_next_generation_recovers_from_memory_still_loses_nothing(tmp_path: Path,
                                                                                         runs: Any) -> None:
    # rank 3 dies; as soon as generation 1 is sealed (its ranks fetching their parts) node-1 dies too. Rank 3's
    # part is on node-0 and node-1's on node-2: the generation after that still finds every part
    run = runs(tmp_path / "out", nodes=4, node_restart_delay=30)
    victim, second = run.worker("node-3", 0), run.agent("node-1")
    run.wait_for(lambda p: p["step"] >= 13)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not any(e["kind"] == "generation" and e["generation"] >= 1 for e in run.events("node-0")):
        assert time.monotonic() < deadline, run.tail()
        time.sleep(0.005)
    os.killpg(second, signal.SIGKILL)
    result = run.finish()
    assert_trained_to_the_end(run, result)
    assert_from_memory_redoing_at_most_one_step(run, result)
    assert len(result["generations"]) >= 3, result["generations"]


def test_pods_sharing_a_kubernetes_node_still_lose_no_steps_when_the_lone_one_goes(tmp_path: Path) -> None:
    # node-0 and node-1 are pods on Kubernetes node host-a, node-2 alone on host-b: no one distance around the
    # ring leaves every node, and no copy was sent at all (issue 37, defect 4). Each part is placed on its own:
    # node-2's on host-a, host-a's on node-2. node-2 is killed: its part comes from host-a's memory. Then the
    # two left share one node: their parts have no copy off it, and each says so.
    env = {**os.environ, "SNEPPX_RUN_ID": f"colocated-{secrets.token_hex(4)}", "SNEPPX_HEARTBEAT_KEY":
           secrets.token_hex(32), "R_NODES": "3", "R_LOCAL_NODES": "1", "R_STEPS": "60", "R_EVERY": "10",
           "R_SNAPSHOT": "1", "R_HANG_TIMEOUT": "5"}
    hosts = {"node-0": "host-a", "node-1": "host-a", "node-2": "host-b"}
    procs = {}
    try:
        for agent, host in hosts.items():
            out = tmp_path / agent
            out.mkdir()
            with open(out / "log.txt", "wb") as log:
                procs[agent] = subprocess.Popen(
                    [sys.executable, recovery_script.__file__, str(out), str(tmp_path / "ckpts")],
                    env={**env, "SNEPPX_AGENT_ID": agent, "SNEPPX_NODE_NAME": host}, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True)

        def progress() -> dict[str, Any]:
            for path in tmp_path.glob("node-*/progress.json"):
                try:
                    return dict(json.loads(path.read_text()))
                except ValueError:  # being written
                    pass
            return {"step": 0, "world_size": 0}

        deadline = time.monotonic() + 180
        while not (progress()["world_size"] == 3 and progress()["step"] >= 13):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values()), progress()
            time.sleep(0.05)
        os.killpg(procs["node-2"].pid, signal.SIGKILL)
        codes = {agent: procs[agent].wait(240) for agent in ("node-0", "node-1")}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    logs = {agent: (tmp_path / agent / "log.txt").read_text()[-3000:] for agent in hosts}
    assert codes == {"node-0": 0, "node-1": 0}, logs
    restores = [json.loads(line) for path in tmp_path.glob("node-*/restores.jsonl")
                for line in path.read_text().splitlines() if line.strip()]
    after = [r for r in restores if r["generation"] > 0 and r["before"] > 0]
    assert after and all(r["source"] == "memory" and r["before"] - r["step"] <= 1 for r in after), restores
    final = next(json.loads(p.read_text()) for p in tmp_path.glob("node-*/final.json"))
    assert final["step"] == 60 and final["m_total"] == M * 60 and final["spread"] == 0.0, final
    events = [e for agent in ("node-0", "node-1")
              for e in json.loads((tmp_path / agent / "result.json").read_text()).get("events", [])]
    unprotected = [e for e in events if e["kind"] == "snapshot_unprotected"]
    assert {e["rank"] for e in unprotected} == {0, 1} and all(e["copies"] == 0 for e in unprotected), unprotected
