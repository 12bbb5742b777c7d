"""TrainContext, the worker's side of train_fn, on a group of one: its restore applies the FaultToleranceManager's
rollback rule, and its save counts a step that is committed already as saved. Real coordinators on real files;
the whole trainer runs in tests/integration/test_elastic_worker_rules.py."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from directory_store import DirectoryStore

from SneppX_ALG import CheckpointCoordinator, collectives, errors
from SneppX_ALG.elastic import control, rendezvous, snapshot, worker
from SneppX_ALG.records import open_record_store

RUN = "run-1"


class Solo:
    """A TrainContext for rank 0 of a world of 1, and what its worker reported to the agent."""

    def __init__(self, tmp_path: Path, *, async_save: bool = True, rollback_depth: int = 2, snapshot_every: int = 0):
        self.checkpoints = tmp_path / "ckpts"
        member = rendezvous.Member("node-0", "0" * 32, "127.0.0.1", "127.0.0.1:9", 1, 0.0)
        assignment = worker.Assignment(rendezvous.Membership(RUN, 0, (member,), "node-0"), "node-0", 0, 0)
        settings = worker.WorkerSettings(checkpoint_dir=str(self.checkpoints), elastic_root=str(tmp_path / "rec"),
                                         run_id=RUN, async_save=async_save, rollback_depth=rollback_depth,
                                         snapshot_every=snapshot_every)
        mine, theirs = socket.socketpair()
        self.agent_end = control.Channel(theirs)
        self.worker = worker.Worker(control.Channel(mine), settings, lambda ctx: None)
        self.group = collectives.ProcessGroup(DirectoryStore(tmp_path / "comm"), 0, 1)
        self.coordinator = CheckpointCoordinator(self.checkpoints, async_save=async_save, device="cpu",
                                                 group=self.group)
        self.snapshot_group = collectives.ProcessGroup(DirectoryStore(tmp_path / "snap"), 0, 1) if snapshot_every else None
        self.ctx = worker.TrainContext(assignment, settings, self.group, self.coordinator, self.worker,
                                       self.snapshot_group)
        self.instance = assignment.membership.instance

    def reports(self) -> list[dict[str, Any]]:
        return self.agent_end.receive(1.0)

    def close(self) -> None:
        self.coordinator.close()
        self.group.close()
        if self.snapshot_group is not None:
            self.snapshot_group.close()
        self.agent_end.close()
        self.worker.channel.close()


@pytest.fixture
def solo(tmp_path: Path) -> Iterator[Any]:
    made: list[Solo] = []

    def make(**kwargs: Any) -> Solo:
        made.append(Solo(tmp_path, **kwargs))
        return made[-1]

    yield make
    for s in made:
        try:
            s.close()
        except errors.SneppXError:
            pass


def commit(root: Path, steps: list[int]) -> None:
    """Steps committed by someone else (an earlier generation, an earlier run) in the same checkpoint_dir."""
    with CheckpointCoordinator(root, max_to_keep=None, device="cpu") as coord:
        for step in steps:
            coord.save({"w": np.full(2048, step, dtype=np.float32)}, step=step, training_state={"step": step})


def corrupt(root: Path, step: int) -> None:
    """Flips one data byte of the step's first shard: its CRC32C no longer matches."""
    shard = next((root / f"step-{step:09d}").glob("shard-*.snpx"))
    with open(shard, "r+b") as f:
        f.seek(4096 + 100)
        byte = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([byte[0] ^ 0x01]))


def test_restore_refuses_to_start_from_scratch_when_every_committed_step_is_invalid(solo: Any) -> None:
    """Within rollback_depth, but nothing valid to resume from: a decision for a person (the manager's rule),
    not a silent start from step 0."""
    s = solo(rollback_depth=2)
    commit(s.checkpoints, [1, 2])
    corrupt(s.checkpoints, 1)
    corrupt(s.checkpoints, 2)
    with pytest.raises(errors.RollbackLimitError, match="none is valid") as caught:
        s.ctx.restore({"w": np.zeros(2048, dtype=np.float32)})
    assert [getattr(b, "step", None) for b in caught.value.skipped] == [2, 1]


def test_restore_rolls_back_within_the_depth_and_reports_it(solo: Any) -> None:
    s = solo(rollback_depth=1)
    commit(s.checkpoints, [1, 2])
    corrupt(s.checkpoints, 2)
    state = {"w": np.zeros(2048, dtype=np.float32)}
    info = s.ctx.restore(state)
    assert info is not None and info.step == 1 and float(state["w"][0]) == 1.0
    restored = [r for r in s.reports() if r["kind"] == "restored"]
    assert restored[0]["step"] == 1 and [b["step"] for b in restored[0]["rolled_back"]] == [2]


@pytest.mark.parametrize("async_save", [True, False])
def test_saving_a_step_committed_already_counts_as_saved_and_training_goes_on(solo: Any, async_save: bool) -> None:
    """Step 3 was committed by an earlier generation: saving it again is not train_fn failing (the worker would
    exit 1 and a failure be counted). With async saves the refusal comes with the next call: then the step of
    that call is saved as well."""
    s = solo(async_save=async_save)
    commit(s.checkpoints, [3])
    state = {"w": np.full(2048, 7, dtype=np.float32)}
    s.ctx.save(state, 3)
    while s.coordinator.saving:  # step 3's outcome is decided, not taken: the next save is the call that learns it
        time.sleep(0.01)
    s.ctx.save(state, 4)
    worker.call_counting_committed_as_saved(s.coordinator.close)
    saved = [r["step"] for r in s.reports() if r["kind"] == "saved"]
    assert saved == [3, 4]
    with CheckpointCoordinator(s.checkpoints, device="cpu", read_only=True) as reader:
        assert reader.committed_steps() == [3, 4]
        newest = reader.latest()
        assert newest is not None and newest.training_state is None  # 4 is ours; 3 kept the earlier one's
        kept = {"w": np.zeros(2048, dtype=np.float32)}
        reader.restore(kept, step=3)
        assert float(kept["w"][0]) == 3.0


def test_only_a_refusal_to_overwrite_a_committed_step_counts_as_saved() -> None:
    """How the other ranks of a group learn rank 0's refusal (engine.py's reports carry errors as text)."""
    exists = "CheckpointExistsError: /ckpts/step-000000003 is already committed; a step is never overwritten"
    assert worker.is_committed_already(errors.CheckpointExistsError("x", path="/ckpts/step-000000003"))
    assert worker.is_committed_already(errors.ShardedCheckpointError("step 3 was not committed", failures={0: exists}))
    for failures in ({1: exists}, {0: "StorageError: disk gone"}, {0: exists, 1: "PeerLostError: gone"}):
        assert not worker.is_committed_already(errors.ShardedCheckpointError("not committed", failures=failures))
    assert not worker.is_committed_already(errors.StorageError("x"))


def test_a_rollback_past_the_depth_ends_the_run_even_with_a_valid_step_beyond_it(solo: Any) -> None:
    """Two invalid steps against rollback_depth=1: step 1 validates, and is still too far back (a mutation that
    let check_rollback allow one more passed every other test)."""
    s = solo(rollback_depth=1)
    commit(s.checkpoints, [1, 2, 3])
    corrupt(s.checkpoints, 2)
    corrupt(s.checkpoints, 3)
    with pytest.raises(errors.RollbackLimitError, match="the newest valid one is step 1") as caught:
        s.ctx.restore({"w": np.zeros(2048, dtype=np.float32)})
    assert [getattr(b, "step", None) for b in caught.value.skipped] == [3, 2]


def snapshot_of(s: Any, state: dict[str, Any], step: int) -> None:
    s.ctx.snapshot(state, step)
    s.worker.snapshots.wait()


def restored_report(s: Any) -> dict[str, Any]:
    return next(r for r in s.reports() if r["kind"] == "restored")


def test_a_checked_snapshot_outranks_a_newer_committed_step_that_does_not_validate(solo: Any) -> None:
    """Committed 9 and 12, 12 corrupt; a whole snapshot of 11 in memory: 11 is restored, not 9 (nor the run
    ended, with rollback_depth=0): the decision compares the snapshot with validated steps, not listed ones."""
    s = solo(rollback_depth=0, snapshot_every=1)
    commit(s.checkpoints, [9, 12])
    corrupt(s.checkpoints, 12)
    snapshot_of(s, {"w": np.full(2048, 11, dtype=np.float32)}, 11)
    state = {"w": np.zeros(2048, dtype=np.float32)}
    info = s.ctx.restore(state)
    assert info is not None and (info.step, info.location) == (11, "memory") and float(state["w"][0]) == 11.0
    report = restored_report(s)
    assert report["source"] == "memory" and [b["step"] for b in report["rolled_back"]] == [12]


@pytest.mark.parametrize(("since", "passed"), [(12, [12]), (10, [12, 10])])
def test_a_committed_step_saved_after_replicas_diverged_is_never_restored(solo: Any, since: int,
                                                                          passed: list[int]) -> None:
    """The snapshot of step 12 found rank 0's replicated arrays unlike the others'; rank 0 wrote them into the
    checkpoint of step 12, which validates. The verdict binds storage too, from the step after the last
    snapshot that agreed: step 9 is restored, and says why."""
    s = solo(rollback_depth=2, snapshot_every=1)
    commit(s.checkpoints, [9, 10, 12] if since == 10 else [9, 12])
    s.worker.snapshots.divergences.append(snapshot.Divergence(s.instance, 0, 12, since))
    state = {"w": np.zeros(2048, dtype=np.float32)}
    info = s.ctx.restore(state)
    assert info is not None and info.step == 9 and float(state["w"][0]) == 9.0
    report = restored_report(s)
    assert report["source"] == "storage" and [b["step"] for b in report["rolled_back"]] == passed
    assert "diverged" in report["rolled_back"][0]["problems"][0]


def test_a_divergence_verdict_with_every_committed_step_bound_ends_the_run_with_a_typed_reason(solo: Any) -> None:
    s = solo(rollback_depth=2, snapshot_every=1)
    commit(s.checkpoints, [12])
    s.worker.snapshots.divergences.append(snapshot.Divergence(s.instance, 0, 12, 12))
    with pytest.raises(errors.RollbackLimitError, match="divergence"):
        s.ctx.restore({"w": np.zeros(2048, dtype=np.float32)})


def test_a_snapshot_of_other_state_neither_displaces_the_restore_state_nor_is_restored_into_it(solo: Any) -> None:
    """`ctx.snapshot(other, step)` beside `report(step)` each step: each object keeps its own snapshot, and a
    restore takes the one of the object it restores (before, the other's array was added into the model)."""
    s = solo(snapshot_every=1)
    model = {"w": np.zeros(4)}
    other = {"o": np.zeros(3)}
    assert s.ctx.restore(model) is None  # a fresh start: report() now snapshots the model
    for step in (1, 2, 3):
        model["w"][:] = step
        other["o"][:] = 100 + step
        s.ctx.snapshot(other, step)
        s.ctx.report(step)
    s.worker.snapshots.wait()
    again = {"w": np.zeros(4)}
    info = s.ctx.restore(again)
    assert info is not None and info.step == 3 and np.array_equal(again["w"], np.full(4, 3.0))
    s.reports()
    alone = solo(snapshot_every=1)  # only the other object was ever snapshot
    snapshot_of(alone, {"o": np.ones(3)}, 5)
    assert alone.ctx.restore({"w": np.zeros(4)}) is None
    assert "another object" in restored_report(alone)["why"]


def test_a_snapshot_of_other_state_laid_out_as_the_model_is_never_restored_into_it(solo: Any) -> None:
    """Defect 2 of issue 37, for the object a user most often keeps beside the model: an average of its
    parameters, laid out exactly like them. Its snapshot, taken first at each step, is kept apart from the
    model's (on the old code one key and one layout: the restore took the average, 'from peer memory')."""
    s = solo(snapshot_every=1)
    model = {"w": np.zeros(4)}
    average = {"w": np.zeros(4)}
    assert s.ctx.restore(model) is None
    for step in (1, 2, 3):
        model["w"][:] = step
        average["w"][:] = step / 2
        s.ctx.snapshot(average, step)
        s.ctx.report(step)
    s.worker.snapshots.wait()
    again = {"w": np.zeros(4)}
    info = s.ctx.restore(again)
    assert info is not None and info.step == 3 and np.array_equal(again["w"], np.full(4, 3.0)), again


def test_a_generation_whose_replicas_diverged_commits_nothing_more(tmp_path: Path) -> None:
    """Defect 1 of issue 37: the snapshot of step 2 found the replicas unequal, and rank 0's copy went into the
    checkpoint of step 2. The worker's commit fence now refuses every commit of that generation once its keeper
    holds the verdict; another generation's verdict does not stop this one."""
    records = open_record_store(str(tmp_path / "rec"))
    member = rendezvous.Member("node-0", "0" * 32, "127.0.0.1", "127.0.0.1:9", 1, 0.0)
    m = rendezvous.Membership(RUN, 0, (member,), "node-0")
    keeper = snapshot.Keeper()
    coord = CheckpointCoordinator(tmp_path / "ckpts", async_save=False, device="cpu",
                                  commit_fence=lambda: worker.commit_fence(records, m, keeper))
    try:
        keeper.divergences.append(snapshot.Divergence("an earlier generation", 0, 1, 1))
        coord.save({"w": np.ones(8)}, step=1)
        keeper.divergences.append(snapshot.Divergence(m.instance, 0, 2, 2))
        with pytest.raises(errors.ReplicaDivergenceError, match="nothing it saves is committed"):
            coord.save({"w": np.ones(8)}, step=2)
        assert coord.committed_steps() == [1]
    finally:
        try:
            coord.close()
        except errors.SneppXError:
            pass
