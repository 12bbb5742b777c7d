"""FaultToleranceManager's restart budget, backoff and checkpoint rollback (quorum: tests/integration).

Rollback runs a real CheckpointCoordinator on real files: the steps are saved, one is corrupted on disk, and the
manager must resume from the newest step that still validates.
"""

from __future__ import annotations

import logging
import pathlib
import random

import numpy as np
import pytest

from SneppX_ALG import CheckpointCoordinator, FaultToleranceManager, errors, generate_keypair
from SneppX_ALG.contract import backoff
from SneppX_ALG.coordinator import SkippedCheckpoint
from SneppX_ALG.elastic import fault_tolerance


def test_backoff_doubles_up_to_the_cap_without_jitter() -> None:
    rng = random.Random(0)
    delays = [backoff.restart_delay(n, base=1.0, factor=2.0, cap=10.0, jitter=0.0, rng=rng)
              for n in range(1, 7)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_jitter_spreads_delays_within_bounds_and_never_past_the_cap() -> None:
    rng = random.Random(1)
    delays = [backoff.restart_delay(3, base=1.0, factor=2.0, cap=5.0, jitter=0.25, rng=rng)
              for _ in range(200)]
    assert all(3.0 <= d <= 4.0 for d in delays)
    assert len({round(d, 6) for d in delays}) > 100  # nodes that failed together come back apart


def test_budget_grants_max_restarts_then_raises_with_the_whole_history() -> None:
    ft = FaultToleranceManager(max_restarts=2, restart_delay=0.5, backoff=3.0, jitter=0.0)
    assert ft.record_failure("rank 1 exited with 137") == 0.5
    assert ft.record_failure("rank 0 heartbeat silent") == 1.5
    assert ft.restarts == 2 and ft.restarts_left == 0
    with pytest.raises(errors.RestartBudgetExhaustedError) as caught:
        ft.record_failure("rank 1 exited with 137")
    history = caught.value.history
    assert [f.reason for f in history] == ["rank 1 exited with 137", "rank 0 heartbeat silent",
                                           "rank 1 exited with 137"]
    assert [f.delay for f in history] == [0.5, 1.5, None]
    assert history[0].time <= history[1].time <= history[2].time
    assert "max_restarts=2" in str(caught.value) and "heartbeat silent" in str(caught.value)
    assert ft.status()["failures"][2]["delay"] is None


def test_zero_restarts_means_the_first_failure_is_final() -> None:
    with pytest.raises(errors.RestartBudgetExhaustedError):
        FaultToleranceManager(max_restarts=0).record_failure("oom")


def test_bad_budget_settings_are_refused() -> None:
    for kwargs in ({"max_restarts": -1}, {"backoff": 0.5}, {"jitter": 1.0}, {"rollback_depth": -1},
                   {"restart_delay": 10, "max_restart_delay": 5}):
        with pytest.raises(ValueError):
            FaultToleranceManager(**kwargs)  # type: ignore[arg-type]


def test_quorum_size_is_strictly_more_than_half() -> None:
    assert [fault_tolerance.quorum_size(n) for n in (1, 2, 3, 4, 5, 6)] == [1, 2, 2, 3, 3, 4]


# ---- rollback ------------------------------------------------------------------------------------------


def save(root: pathlib.Path, steps: list[int], signing_key: object = None) -> None:
    with CheckpointCoordinator(root, max_to_keep=None, device="cpu", signing_key=signing_key) as coord:
        for step in steps:
            coord.save({"w": np.full(2048, step, dtype=np.float32)}, step=step, training_state={"step": step})


def corrupt(root: pathlib.Path, step: int) -> None:
    """Flips one data byte of the step's first shard: its CRC32C no longer matches."""
    shard = next((root / f"step-{step:09d}").glob("shard-*.snpx"))
    with open(shard, "r+b") as f:
        f.seek(4096 + 100)
        byte = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([byte[0] ^ 0x01]))


def test_resume_point_rolls_back_past_a_corrupted_newest_step(tmp_path: pathlib.Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    save(tmp_path, [10, 20, 30])
    corrupt(tmp_path, 30)
    ft = FaultToleranceManager()
    with caplog.at_level(logging.INFO, logger="SneppX_ALG.elastic.fault_tolerance"):
        point = ft.resume_point(str(tmp_path))
    assert point is not None and point.step == 20 and point.training_state == {"step": 20}
    assert [s.step for s in point.rolled_back] == [30] and point.rolled_back[0].problems
    assert "rolled back past 30" in caplog.text and "step 30 is not valid" in caplog.text
    status = ft.status()
    assert status["resume_step"] == 20 and status["rolled_back"][0]["step"] == 30
    # the same with a coordinator the caller already has
    coord = CheckpointCoordinator(tmp_path, device="cpu")
    assert ft.resume_point(coord).step == 20
    coord.close()


def test_rollback_depth_limits_how_far_back_it_goes(tmp_path: pathlib.Path) -> None:
    save(tmp_path, [1, 2, 3])
    corrupt(tmp_path, 3)
    corrupt(tmp_path, 2)
    assert FaultToleranceManager(rollback_depth=2).resume_point(tmp_path).step == 1
    with pytest.raises(errors.RollbackLimitError) as caught:
        FaultToleranceManager(rollback_depth=1).resume_point(tmp_path)
    assert [s.step for s in caught.value.skipped] == [3, 2] and "rollback_depth=1" in str(caught.value)


def test_every_step_invalid_is_an_error_not_a_fresh_start(tmp_path: pathlib.Path) -> None:
    save(tmp_path, [1])
    corrupt(tmp_path, 1)
    with pytest.raises(errors.RollbackLimitError, match="none is valid"):
        FaultToleranceManager().resume_point(tmp_path)


def test_nothing_committed_is_a_fresh_start(tmp_path: pathlib.Path) -> None:
    ft = FaultToleranceManager()
    assert ft.resume_point(tmp_path) is None and ft.status()["resume_step"] is None


def test_with_trusted_keys_an_unsigned_newer_step_is_rolled_back(tmp_path: pathlib.Path) -> None:
    private, public = generate_keypair()
    save(tmp_path, [1, 2], signing_key=private)
    save(tmp_path, [3])  # valid bytes, but nobody trusted signed them
    assert FaultToleranceManager().resume_point(tmp_path).step == 3
    point = FaultToleranceManager().resume_point(tmp_path, trusted_keys=[public])
    assert point.step == 2 and [s.step for s in point.rolled_back] == [3]
    assert "signature" in " ".join(point.rolled_back[0].problems).lower()
    with CheckpointCoordinator(tmp_path, device="cpu") as coord, pytest.raises(ValueError, match="its own"):
        FaultToleranceManager().resume_point(coord, trusted_keys=[public])


def test_rollback_depth_defaults_to_the_operators_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SNEPPX_ROLLBACK_DEPTH", "5")
    assert FaultToleranceManager().rollback_depth == 5


def test_delays_at_the_cap_are_still_spread() -> None:
    """A crash loop that reached the cap must not bring every node back at the same instant."""
    rng = random.Random(2)
    delays = [backoff.restart_delay(12, base=1.0, factor=2.0, cap=5.0, jitter=0.2, rng=rng)
              for _ in range(100)]
    assert all(4.0 <= d <= 5.0 for d in delays) and len(set(delays)) > 50


def test_backoff_stays_at_the_cap_however_many_failures() -> None:
    """factor**(attempt-1) passes a float's range at attempt 1,025 with factor 2: the delay is the cap, not an
    OverflowError out of record_failure."""
    rng = random.Random(3)
    for attempt in (1025, 10**6):
        assert backoff.restart_delay(attempt, base=1.0, factor=2.0, cap=60.0, jitter=0.0, rng=rng) == 60.0
        assert backoff.restart_delay(attempt, base=0.0, factor=2.0, cap=60.0, jitter=0.0, rng=rng) == 0.0
        assert 54.0 <= backoff.restart_delay(attempt, base=1.0, factor=2.0, cap=60.0, jitter=0.1,
                                                     rng=rng) <= 60.0
    ft = FaultToleranceManager(max_restarts=2000, restart_delay=1.0, max_restart_delay=60.0, jitter=0.0)
    delays = [ft.record_failure(f"failure {n}") for n in range(1, 1026)]
    assert delays[:3] == [1.0, 2.0, 4.0] and delays[-1] == 60.0 and ft.restarts == 1025


def test_one_rollback_rule_for_the_manager_and_the_workers() -> None:
    """fault_tolerance.check_rollback is the rule; FaultToleranceManager.resume_point and the ElasticTrainer's
    TrainContext.restore both call it (tests/unit/elastic/test_elastic_trainer_parts.py checks the worker's side)."""
    bad = [SkippedCheckpoint(3, ("crc",)), SkippedCheckpoint(2, ("crc",))]
    fault_tolerance.check_rollback([], None, rollback_depth=0)  # nothing committed: a fresh start
    fault_tolerance.check_rollback(bad, 1, rollback_depth=2)
    with pytest.raises(errors.RollbackLimitError, match="rollback_depth=1") as caught:
        fault_tolerance.check_rollback(bad, 1, rollback_depth=1)
    assert [s.step for s in caught.value.skipped] == [3, 2]
    with pytest.raises(errors.RollbackLimitError, match="none is valid"):
        fault_tolerance.check_rollback(bad, None, rollback_depth=2)  # within the depth, but nothing to resume


def test_one_backoff_rule_for_the_operator_and_the_launcher() -> None:
    from sneppx_operator import policy

    spec = {"failurePolicy": {"restartDelay": {"initialSeconds": 3, "multiplier": 2, "maxSeconds": 40}}}
    assert [policy.restart_delay_seconds(spec, n) for n in (0, 1, 2, 3, 4, 5, 5000)] == [3, 3, 6, 12, 24, 40, 40]
    assert [backoff.restart_delay(n, base=3, factor=2, cap=40) for n in (0, 1, 2, 5000)] == [3, 3, 6, 40]
    with pytest.raises(ValueError, match="rng"):
        backoff.restart_delay(2, base=1, factor=2, cap=10, jitter=0.1)
