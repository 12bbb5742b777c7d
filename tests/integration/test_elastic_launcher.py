"""The ElasticTrainer's launcher as an operator of it meets it: killed (SIGTERM, SIGKILL), relaunched after a run
finished. Real launchers, agents and workers (tests/integration/recovery_script.py), real signals."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from recovery_script import Run


@pytest.fixture
def runs(launched: list[Run]) -> Any:
    def start(out: Path, checkpoint_dir: Path, **knobs: Any) -> Run:
        run = Run(out, str(checkpoint_dir), **knobs)
        launched.append(run)
        return run

    return start


def wait_until_gone(run: Run, timeout: float = 30) -> list[Any]:
    deadline = time.monotonic() + timeout
    while (left := run.processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_launcher_takes_its_agents_and_workers_with_it(tmp_path: Path, runs: Any, sig: int) -> None:
    run = runs(tmp_path / "out", tmp_path / "ckpts", nodes=2, gpus=2, steps=100000)
    run.wait_for(lambda p: p["step"] >= 2)
    assert len(run.processes()) == 6  # 2 agents, 4 workers
    run.proc.send_signal(sig)
    assert run.proc.wait(30) == -sig  # SIGTERM: it stops its nodes first, then ends as SIGTERM would
    assert wait_until_gone(run) == []


def test_a_relaunch_of_a_finished_run_trains_again_from_its_newest_checkpoint(tmp_path: Path, runs: Any) -> None:
    first = runs(tmp_path / "first", tmp_path / "ckpts", nodes=2, steps=6)
    assert "error" not in first.finish()
    # the same SNEPPX_RUN_ID and checkpoint_dir (as on several machines), more steps: it goes on from step 6
    again = runs(tmp_path / "again", tmp_path / "ckpts", run_id=first.run_id, nodes=2, steps=12)
    result = again.finish()
    assert "error" not in result, result
    restored = [e["step"] for e in result["events"] if e["kind"] == "restored"]
    assert restored and restored[0] == 6, restored
    assert again.final()["w"] == [12.0] * 4


def test_a_relaunch_of_a_failed_run_trains_again(tmp_path: Path, runs: Any) -> None:
    first = runs(tmp_path / "first", tmp_path / "ckpts", nodes=1, max_restarts=0, **{"raise": "always"})
    assert first.finish().get("error") == "RestartBudgetExhaustedError"
    again = runs(tmp_path / "again", tmp_path / "ckpts", run_id=first.run_id, nodes=1, steps=6)
    result = again.finish()
    assert "error" not in result, result
    assert again.final()["w"] == [6.0] * 4


def test_a_run_whose_training_completed_succeeds_though_a_late_joiner_waited_past_join_timeout(
        tmp_path: Path, runs: Any) -> None:
    # node-1 dies and comes back as a late joiner; the survivor trains on alone with no checkpoint boundary
    # before the end (EVERY > STEPS), so node-1 waits longer than join_timeout, then the run completes
    run = runs(tmp_path / "out", tmp_path / "ckpts", nodes=2, steps=200, every=1000, join_timeout=2,
               node_restart_delay=3)
    run.wait_for(lambda p: p["step"] >= 3)
    os.killpg(run.agent("node-1"), signal.SIGKILL)
    run.wait_for(lambda p: p["world_size"] == 1)
    result = run.finish()
    assert "error" not in result, result
    assert run.final()["w"] == [200.0] * 4
    assert len([e for e in result["events"] if e["kind"] == "started" and e["agent"] == "node-1"]) == 2
