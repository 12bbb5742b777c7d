"""The worker's rules under a real ElasticTrainer (tests/integration/worker_rules_script.py): real launchers,
agents and workers on 127.0.0.1, checkpoints in a real directory.

- the restart count a worker sees (ctx.restarts, TORCHELASTIC_RESTART_COUNT): 0 before any failure, 1 after one;
- the rollback rule of ctx.restore is the FaultToleranceManager's: committed steps that are all corrupt end the run
  (a decision for a person), never a silent start from step 0;
- a state that does not fit the committed step (ShardingMismatchError) ends the run at once, as a rollback past
  the limit does: no restart can fix it;
- a step an earlier run committed, saved again, counts as saved: not a failure of train_fn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from worker_rules_script import Run

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def runs(launched: list[Run]) -> Any:
    def start(out: Path, checkpoint_dir: Path, **knobs: Any) -> Run:
        run = Run(out, str(checkpoint_dir), **knobs)
        launched.append(run)
        return run

    return start


def corrupt_every_step(checkpoint_dir: Path) -> list[int]:
    """Writes bytes into each committed step's shard files (one flipped byte in the data): none validates."""
    steps = []
    for step_dir in sorted(checkpoint_dir.glob("step-*")):
        for shard in step_dir.glob("shard-*.snpx"):
            with open(shard, "r+b") as f:
                f.seek(4096 + 100)
                byte = f.read(1)
                f.seek(4096 + 100)
                f.write(bytes([byte[0] ^ 0x01]))
        steps.append(int(step_dir.name.split("-")[1]))
    return steps


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_restart_count_a_worker_sees_is_0_then_1_after_one_failure(tmp_path: Path, runs: Any,
                                                                       nodes: int) -> None:
    run = runs(tmp_path / "out", tmp_path / "ckpts", nodes=nodes, mode="raise_once")
    result = run.finish()
    assert "error" not in result, (result, run.tail())
    seen = run.seen()
    assert [(s["restarts"], s["env"]) for s in seen] == [(0, "0"), (1, "1")], seen
    assert seen[1]["generation"] > seen[0]["generation"]
    failures = result["failures"]  # one failure, as each agent recorded it
    assert {f["generation"] for f in failures} == {seen[0]["generation"]}, failures
    assert any("planted failure" in f["reason"] for f in failures), failures
    assert run.final() == {"step": 6, "w": 6.0, "restored": None}


def test_every_committed_step_corrupt_ends_the_run_instead_of_starting_from_0(tmp_path: Path, runs: Any) -> None:
    """Two committed steps (within the default rollback_depth of 2), both corrupt: the worker's restore raises
    RollbackLimitError, the worker reports it as fatal, and the run fails with it; no step is trained."""
    checkpoints = tmp_path / "ckpts"
    earlier = runs(tmp_path / "earlier", checkpoints, steps=6, every=3)
    assert "error" not in earlier.finish()
    assert corrupt_every_step(checkpoints) == [3, 6]
    run = runs(tmp_path / "out", checkpoints, steps=9, every=3)  # another run id, the same checkpoint_dir
    result = run.finish()
    assert result.get("error") == "ElasticRunError", (result, run.tail())
    assert "RollbackLimitError" in result["message"] and "none is valid" in result["message"], result
    assert not (run.out / "final.json").exists()
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-000000003", "step-000000006"]


def test_a_state_that_does_not_fit_the_committed_step_ends_the_run_instead_of_spending_its_restarts(
        tmp_path: Path, runs: Any) -> None:
    """A restore target shaped unlike the committed step (w of 1024 where 2048 was saved, in a sharded state, whose
    restore checks replicated arrays' shapes; a plain dict's takes the saved arrays whole): the restore raises
    ShardingMismatchError, which no restart can fix (the same state meets the same step), so the worker reports it
    as fatal and the run ends with it in its first generation, not after its restart budget (chaos seed 1058)."""
    checkpoints = tmp_path / "ckpts"
    earlier = runs(tmp_path / "earlier", checkpoints, steps=3, every=3, sharded=1)
    assert "error" not in earlier.finish()
    run = runs(tmp_path / "out", checkpoints, steps=6, every=3, sharded=1, size=1024, max_restarts=2)
    result = run.finish()
    assert result.get("error") == "ElasticRunError", (result, run.tail())
    assert "ShardingMismatchError" in result["message"], result
    assert len(run.seen()) == 1, run.seen()  # one generation: no restart was spent on it
    assert not (run.out / "final.json").exists()


def test_a_step_committed_by_an_earlier_run_saved_again_counts_as_saved(tmp_path: Path, runs: Any) -> None:
    """The second run restores step 6 and saves step 6 again (two ranks: rank 0 finds it committed, rank 1 learns
    it from rank 0): the step counts as saved and training goes on to step 9, with no failure."""
    checkpoints = tmp_path / "ckpts"
    earlier = runs(tmp_path / "earlier", checkpoints, gpus=2, steps=6, every=3)
    assert "error" not in earlier.finish()
    run = runs(tmp_path / "out", checkpoints, gpus=2, steps=9, every=3, mode="resave", max_restarts=1)
    result = run.finish()
    assert "error" not in result, (result, run.tail())
    assert result["failures"] == [] and len(result["generations"]) == 1, result
    saved = [e["step"] for e in result["events"] if e["kind"] == "saved"]
    assert saved[:2] == [6, 9], saved
    assert run.final() == {"step": 9, "w": 9.0, "restored": 6}
    assert max(p.name for p in checkpoints.glob("step-*")) == "step-000000009"
