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
from SneppX_ALG.elastic import control, rendezvous, worker

RUN = "run-1"


class Solo:
    """A TrainContext for rank 0 of a world of 1, and what its worker reported to the agent."""

    def __init__(self, tmp_path: Path, *, async_save: bool = True, rollback_depth: int = 2):
        self.checkpoints = tmp_path / "ckpts"
        member = rendezvous.Member("node-0", "0" * 32, "127.0.0.1", "127.0.0.1:9", 1, 0.0)
        assignment = worker.Assignment(rendezvous.Membership(RUN, 0, (member,), "node-0"), "node-0", 0, 0)
        settings = worker.WorkerSettings(checkpoint_dir=str(self.checkpoints), elastic_root=str(tmp_path / "rec"),
                                         run_id=RUN, async_save=async_save, rollback_depth=rollback_depth)
        mine, theirs = socket.socketpair()
        self.agent_end = control.Channel(theirs)
        self.worker = worker.Worker(control.Channel(mine), settings, lambda ctx: None)
        self.group = collectives.ProcessGroup(DirectoryStore(tmp_path / "comm"), 0, 1)
        self.coordinator = CheckpointCoordinator(self.checkpoints, async_save=async_save, device="cpu",
                                                 group=self.group)
        self.ctx = worker.TrainContext(assignment, settings, self.group, self.coordinator, self.worker)

    def reports(self) -> list[dict[str, Any]]:
        return self.agent_end.receive(1.0)

    def close(self) -> None:
        self.coordinator.close()
        self.group.close()
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
