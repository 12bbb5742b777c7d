"""The ElasticTrainer end to end: recipe 3 as a real program (tests/integration/elastic_script.py), its agents
and workers real processes on 127.0.0.1, failures made with real signals, checkpoints in a real directory (and
on a real S3 server). Every run must end at the parameters of the same training run uninterrupted in one
process: a restore that lost or repeated a step, or restored the wrong data position, would not.

Steps lost to a failure are bounded by the checkpoint interval: the run resumes from the newest committed step,
which is at most EVERY steps behind, or 2 x EVERY when the failure hit while that step was still being written
in the background (async save).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from elastic_script import Run, assert_params_match, process_state

EVERY = 3


@pytest.fixture
def runs(launched: list[Run]) -> Any:
    def start(out: Path, checkpoint_dir: str, **knobs: Any) -> Run:
        run = Run(out, checkpoint_dir, **{"every": EVERY, **knobs})
        launched.append(run)
        return run

    return start


def kinds(result: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in result["events"] if e["kind"] == kind]


def steps_lost(result: dict[str, Any]) -> list[int]:
    """For each failure: the newest step rank 0 finished before it, minus the step the run resumed from."""
    lost = []
    for failure in kinds(result, "failure"):
        before = [e["step"] for e in kinds(result, "step") if e["t"] <= failure["t"]]
        after = [e for e in kinds(result, "restored") if e["t"] > failure["t"]]
        if before and after:
            lost.append(max(before) - (after[0]["step"] or 0))
    return lost


def test_recipe_3_as_written_trains_to_the_uninterrupted_result(tmp_path: Path, runs: Any) -> None:
    run = runs(tmp_path / "out", str(tmp_path / "ckpts"), nodes=2, gpus=4, steps=12, sleep=0)
    result = run.finish()
    assert [(g["generation"], g["world_size"]) for g in result["generations"]] == [(0, 8)]
    assert result["failures"] == []
    assert_params_match(run.out, 12)
    final = __import__("json").loads((run.out / "final.json").read_text())
    assert final["env"]["RANK"] == "0" and final["env"]["WORLD_SIZE"] == "8" and final["env"]["LOCAL_RANK"] == "0"
    assert final["env"]["MASTER_ADDR"] == "127.0.0.1" and int(final["env"]["MASTER_PORT"]) > 0


def test_a_killed_worker_is_replaced_and_the_others_keep_their_processes(tmp_path: Path, runs: Any) -> None:
    run = runs(tmp_path / "out", str(tmp_path / "ckpts"), steps=40)
    run.wait_for(lambda p: p["step"] >= 8)
    survivors = {pid for pid, role, _, _ in run.processes() if role == "worker"}
    victim = run.worker("node-1", 1)
    os.kill(victim, signal.SIGKILL)
    run.wait_for(lambda p: p["generation"] >= 1 and p["step"] >= 20)
    now = {pid for pid, role, _, _ in run.processes() if role == "worker"}
    assert survivors - {victim} <= now and victim not in now  # in-process reconfiguration for the survivors
    result = run.finish()
    assert any("killed by SIGKILL" in f["reason"] for f in result["failures"]), result["failures"]
    assert all(g["world_size"] == 4 for g in result["generations"]) and len(result["generations"]) >= 2
    assert steps_lost(result) and max(steps_lost(result)) <= 2 * EVERY, steps_lost(result)
    assert_params_match(run.out, 40)


def test_a_killed_node_shrinks_the_world_and_grows_it_back_when_it_returns(tmp_path: Path, runs: Any) -> None:
    # 120 steps: the survivors must still be training when node-1 is back (4 s, then its start and join)
    run = runs(tmp_path / "out", str(tmp_path / "ckpts"), steps=120, node_restart_delay=4)
    run.wait_for(lambda p: p["step"] >= 6)
    os.killpg(run.agent("node-1"), signal.SIGKILL)  # the agent and its workers: the whole node
    run.wait_for(lambda p: p["world_size"] == 2)
    run.wait_for(lambda p: p["world_size"] == 4 and p["generation"] >= 2)
    result = run.finish()
    sizes = [g["world_size"] for g in result["generations"]]
    assert sizes[:1] == [4] and 2 in sizes and sizes[-1] == 4, sizes
    assert any("node-1" in f["reason"] or "rank" in f["reason"] for f in result["failures"]), result["failures"]
    growth = kinds(result, "join_pending")
    assert growth and growth[0]["waiting"] == ["node-1"]
    assert max(steps_lost(result)) <= 2 * EVERY, steps_lost(result)
    assert_params_match(run.out, 120)


def test_a_stopped_worker_is_killed_and_replaced(tmp_path: Path, runs: Any) -> None:
    run = runs(tmp_path / "out", str(tmp_path / "ckpts"), steps=40, hang_timeout=1)
    run.wait_for(lambda p: p["step"] >= 8)
    victim = run.worker("node-0", 1)
    os.kill(victim, signal.SIGSTOP)
    result = run.finish()
    assert process_state(victim) is None  # killed, not left stopped
    assert any("sent no heartbeat" in f["reason"] for f in result["failures"]), result["failures"]
    assert max(steps_lost(result)) <= 2 * EVERY, steps_lost(result)
    assert_params_match(run.out, 40)


def test_a_corrupt_newest_checkpoint_is_rolled_back_past_and_reported(tmp_path: Path, runs: Any) -> None:
    ckpts = tmp_path / "ckpts"
    run = runs(tmp_path / "out", str(ckpts), steps=40, restart_delay=1.5)
    run.wait_for(lambda p: p["step"] >= 10)
    os.kill(run.worker("node-0", 0), signal.SIGKILL)
    # While the agents back off (restart_delay): flip a byte in every shard of the newest committed step.
    newest = max((p for p in ckpts.iterdir() if p.name.startswith("step-")), key=lambda p: p.name)
    for shard in newest.glob("*.snpx"):
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    result = run.finish()
    restored = [e for e in kinds(result, "restored") if e["rolled_back"]]
    assert restored, kinds(result, "restored")
    assert restored[0]["rolled_back"][0]["step"] == int(newest.name.split("-")[1])
    assert restored[0]["step"] < restored[0]["rolled_back"][0]["step"]
    assert_params_match(run.out, 40)


def test_when_the_budget_is_spent_run_raises_with_the_history(tmp_path: Path, runs: Any) -> None:
    run = runs(tmp_path / "out", str(tmp_path / "ckpts"), steps=400, max_restarts=1)
    run.wait_for(lambda p: p["step"] >= 4)
    os.kill(run.worker("node-0", 1), signal.SIGKILL)
    run.wait_for(lambda p: p["generation"] >= 1)
    os.kill(run.worker("node-1", 0), signal.SIGKILL)
    result = run.finish()
    assert result["error"] == "RestartBudgetExhaustedError", result
    assert len(result["history"]) >= 2 and "killed by SIGKILL" in str(result["history"]), result["history"]
    assert run.proc.returncode == 1 and run.processes() == []


def test_the_rendezvous_and_the_checkpoints_can_live_on_s3(s3_bucket: str, tmp_path: Path, runs: Any) -> None:
    run = runs(tmp_path / "out", f"s3://{s3_bucket}/job", steps=24)
    run.wait_for(lambda p: p["step"] >= 8)
    os.kill(run.worker("node-1", 0), signal.SIGKILL)
    result = run.finish()
    assert len(result["generations"]) >= 2 and result["failures"]
    assert_params_match(run.out, 24)
