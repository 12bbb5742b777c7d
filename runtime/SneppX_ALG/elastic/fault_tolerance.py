"""FaultToleranceManager: when may a job go on, how often may it restart, and from which checkpoint.

Three decisions every elastic runtime makes after a failure, kept together and out of the trainer:
  - quorum: go on only when strictly more than half of the expected members (peers plus this node) are healthy
    by the heartbeat, so two halves of a partitioned job can never both continue;
  - the restart budget: at most `max_restarts` restarts, spaced by exponential backoff with jitter and a cap
    (so a crash loop neither spins nor restarts every node in lock-step), with a history of every failure;
  - versioned rollback: resume from the newest committed checkpoint that validates (and is signed, with trusted
    keys), rolling back past corrupt ones, reporting each, but never further than `rollback_depth` steps.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

from SneppX_ALG import coordinator, errors
from SneppX_ALG.contract.backoff import restart_delay
from SneppX_ALG.contract.env import ENV_ROLLBACK_DEPTH
from SneppX_ALG.elastic import heartbeat as heartbeat_module

log = logging.getLogger(__name__)

DEFAULT_ROLLBACK_DEPTH = 2
# Quorum checks also poll this often, in case an event was missed (the event ring holds the last 4096).
_QUORUM_POLL = 1.0


def quorum_size(members: int) -> int:
    """Healthy members needed out of `members` (peers plus self): strictly more than half.

    The standalone manager's rule (the seed's `wait_for_quorum`: peers known only by their heartbeats, no shared
    store to decide membership). An elastic job decides by other means and needs no majority: its rendezvous
    forms a generation by compare-and-swap once `min_nodes` joined, and the operator's QuorumRule
    (elastic.minNodes, quorum.minHealthyPercent) judges the same count from the cluster's side."""
    return members // 2 + 1


def check_rollback(skipped: Sequence[coordinator.SkippedCheckpoint], resumed_step: int | None, *,
                   rollback_depth: int) -> None:
    """The rollback rule, one place for FaultToleranceManager.resume_point and the ElasticTrainer's workers
    (`TrainContext.restore`): `skipped` are the newer committed steps that did not validate, `resumed_step`
    the step found instead (None: none). RollbackLimitError when more than `rollback_depth` were skipped, or
    when steps were committed and none validates: resuming from far back, or from scratch, is a decision for a
    person. Nothing committed at all (no step, none skipped) is a fresh start, and passes."""
    if len(skipped) <= rollback_depth and (resumed_step is not None or not skipped):
        return
    found = "none is valid" if resumed_step is None else f"the newest valid one is step {resumed_step}"
    raise errors.RollbackLimitError(
        f"{len(skipped)} newer committed checkpoints are invalid (steps "
        f"{', '.join(str(s.step) for s in skipped)}) and {found}; rollback_depth={rollback_depth}",
        skipped=list(skipped))


@dataclasses.dataclass(frozen=True)
class Failure:
    """One recorded failure: when (wall clock, UTC), why, which restart it asked for and the delay granted
    (None for the one that exhausted the budget)."""

    time: datetime.datetime
    reason: str
    attempt: int
    delay: float | None


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where to resume: the newest valid checkpoint within the rollback depth, and what was rolled back past."""

    step: int
    location: str
    training_state: Any
    rolled_back: tuple[coordinator.SkippedCheckpoint, ...]


class FaultToleranceManager:
    """Quorum, restart budget and checkpoint rollback for one node of an elastic job.

    heartbeat: the HeartbeatMonitor whose peers (plus this node) are the expected members; needed by
        wait_for_quorum() only.
    max_restarts: failures that may be restarted from; one more raises RestartBudgetExhaustedError.
    restart_delay: seconds before the first restart; each further one waits backoff times longer, at most
        max_restart_delay, shortened by a random fraction up to jitter.
    rollback_depth: how many newer committed checkpoints resume_point() may roll back past (default
        SNEPPX_ROLLBACK_DEPTH or 2).
    """

    def __init__(self, heartbeat: heartbeat_module.HeartbeatMonitor | None = None, max_restarts: int = 3,
                 restart_delay: float = 1.0, *, backoff: float = 2.0, max_restart_delay: float = 60.0,
                 jitter: float = 0.1, rollback_depth: int | None = None, seed: int | None = None):
        if max_restarts < 0 or restart_delay < 0 or backoff < 1 or max_restart_delay < restart_delay:
            raise ValueError("need max_restarts >= 0, restart_delay >= 0, backoff >= 1 and "
                             f"max_restart_delay >= restart_delay (got {max_restarts}, {restart_delay}, "
                             f"{backoff}, {max_restart_delay})")
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter is a fraction in [0, 1), not {jitter}")
        if rollback_depth is None:
            rollback_depth = int(os.environ.get(ENV_ROLLBACK_DEPTH, DEFAULT_ROLLBACK_DEPTH))
        if rollback_depth < 0:
            raise ValueError(f"rollback_depth must be >= 0, not {rollback_depth}")
        self.heartbeat = heartbeat
        self.max_restarts = max_restarts
        self.restart_delay = restart_delay
        self.backoff = backoff
        self.max_restart_delay = max_restart_delay
        self.jitter = jitter
        self.rollback_depth = rollback_depth
        self.history: list[Failure] = []
        self.last_resume_point: ResumePoint | None = None
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    # -- quorum --

    def members(self) -> list[str]:
        """The expected members: this node (its heartbeat address) and its peers."""
        hb = self._require_heartbeat()
        return [hb.address, *hb.peers]

    def is_quorum_met(self) -> bool:
        hb = self._require_heartbeat()
        return len(hb.healthy_peers()) + 1 >= quorum_size(len(hb.peers) + 1)

    def wait_for_quorum(self, timeout: float | None = None) -> list[str]:
        """Blocks until strictly more than half of the members (peers plus this node) are healthy; returns the
        healthy members. Starts the heartbeat monitor if it isn't running. timeout: seconds (None: no limit);
        QuorumTimeoutError, naming the members missing, when it passes."""
        hb = self._require_heartbeat()
        hb.start()
        needed = quorum_size(len(hb.peers) + 1)
        stream = hb.watch()  # before the first look, so no change falls between the two
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            healthy = hb.healthy_peers()
            if len(healthy) + 1 >= needed:
                log.info("quorum: %d of %d members healthy (need %d)", len(healthy) + 1, len(hb.peers) + 1, needed)
                return [hb.address, *healthy]
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                missing = [p for p in hb.peers if p not in healthy]
                raise errors.QuorumTimeoutError(
                    f"no quorum after {timeout}s: {len(healthy) + 1} of {len(hb.peers) + 1} members healthy, "
                    f"{needed} needed; missing: {', '.join(missing)}",
                    missing=missing, healthy=[hb.address, *healthy], needed=needed)
            if not hb.running:
                raise errors.HeartbeatError("the heartbeat monitor was stopped while waiting for a quorum")
            stream.next(_QUORUM_POLL if left is None else min(left, _QUORUM_POLL))

    def _require_heartbeat(self) -> heartbeat_module.HeartbeatMonitor:
        if self.heartbeat is None:
            raise errors.HeartbeatError("this FaultToleranceManager has no heartbeat monitor (pass heartbeat=)")
        return self.heartbeat

    # -- restart budget --

    @property
    def restarts(self) -> int:
        """Restarts granted so far."""
        return sum(1 for f in self.history if f.delay is not None)

    @property
    def restarts_left(self) -> int:
        return self.max_restarts - self.restarts

    def record_failure(self, reason: str) -> float:
        """Records a failure and returns the seconds to wait before restarting (backoff with jitter). Past the
        budget it raises RestartBudgetExhaustedError with the whole history (the failure included)."""
        with self._lock:
            attempt = self.restarts + 1
            now = datetime.datetime.now(datetime.UTC)
            if attempt > self.max_restarts:
                self.history.append(Failure(now, reason, attempt, None))
                lines = "; ".join(f"{f.time:%H:%M:%S} {f.reason}" for f in self.history)
                raise errors.RestartBudgetExhaustedError(
                    f"restart budget exhausted: {len(self.history)} failures, max_restarts={self.max_restarts} "
                    f"({lines})", history=list(self.history))
            delay = restart_delay(attempt, base=self.restart_delay, factor=self.backoff,
                                  cap=self.max_restart_delay, jitter=self.jitter, rng=self._rng)
            self.history.append(Failure(now, reason, attempt, delay))
        log.warning("failure %d/%d (%s): restarting in %.2fs", attempt, self.max_restarts, reason, delay)
        return delay

    # -- rollback --

    def resume_point(self, coordinator_or_root: coordinator.CheckpointCoordinator | str | os.PathLike[str], *,
                     trusted_keys: Any = None) -> ResumePoint | None:
        """The newest committed checkpoint that validates (and, with trusted keys, is signed by one of them),
        rolling back past invalid ones, each reported and logged. None when nothing was ever committed.

        coordinator_or_root: a CheckpointCoordinator (its trusted keys apply) or a checkpoint root (local path
        or s3://); trusted_keys only with a root. RollbackLimitError when more than rollback_depth newer steps
        fail, or when every committed step does."""
        if isinstance(coordinator_or_root, coordinator.CheckpointCoordinator):
            if trusted_keys is not None:
                raise ValueError("trusted_keys go with a checkpoint root; a CheckpointCoordinator uses its own")
            point = self._resume_point(coordinator_or_root)
        else:
            with coordinator.CheckpointCoordinator(coordinator_or_root, device="cpu", cleanup_on_start=False,
                                                   trusted_keys=trusted_keys) as coord:
                point = self._resume_point(coord)
        self.last_resume_point = point
        return point

    def _resume_point(self, coord: coordinator.CheckpointCoordinator) -> ResumePoint | None:
        already = len(coord.skipped)
        info = coord.latest()
        skipped = tuple(coord.skipped[already:])
        for bad in skipped:
            log.warning("rollback: step %d is not valid: %s", bad.step, "; ".join(bad.problems[:3]))
        check_rollback(skipped, None if info is None else info.step, rollback_depth=self.rollback_depth)
        if info is None:
            log.info("no committed checkpoint: starting from scratch")
            return None
        log.info("resuming from step %d (%s)%s", info.step, info.location,
                 f", rolled back past {', '.join(str(s.step) for s in skipped)}" if skipped else "")
        return ResumePoint(info.step, info.location, info.training_state, skipped)

    # -- status --

    def status(self) -> dict[str, Any]:
        """What an operator or a status endpoint reports: restarts, the failure history, the resume decision."""
        point = self.last_resume_point
        return {
            "restarts": self.restarts,
            "max_restarts": self.max_restarts,
            "failures": [{"time": f.time.isoformat(), "reason": f.reason, "attempt": f.attempt, "delay": f.delay}
                         for f in self.history],
            "resume_step": None if point is None else point.step,
            "rolled_back": [] if point is None else [{"step": s.step, "problems": list(s.problems)}
                                                    for s in point.rolled_back],
            "quorum": None if self.heartbeat is None or not self.heartbeat.running else self.is_quorum_met(),
        }
