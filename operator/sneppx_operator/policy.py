"""Pure failure policy: what a rank's end means for the job (spec.failurePolicy and spec.quorum).

Why a module of its own: these are the rules a user tunes (exit-code rules, the restart budget, the delay
between restarts, the quorum and what losing it does), each small and each tested alone; reconcile.plan
applies them to what it observed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# Why a rank is being replaced (restartHistory[].reason; the restarts metric's `reason` label).
POD_FAILED = "PodFailed"  # its training container exited non-zero
EVICTED = "Evicted"  # the kubelet or the Eviction API took the pod away
POD_DELETED = "PodDeleted"  # someone deleted the pod
NODE_NOT_READY = "NodeNotReady"  # its node stopped reporting
HANG = "Hang"  # an agent reported it stopped stepping for hangTimeoutSeconds
QUORUM_LOST = "QuorumLost"  # quorum.actionOnLoss RestartGroup: every rank replaced at once

FAIL_JOB, RESTART, IGNORE = "FailJob", "Restart", "Ignore"


@dataclasses.dataclass(frozen=True)
class Failure:
    """One rank lost: which, why, and (when its container exited) with which code."""

    rank: int
    pod: str
    reason: str
    message: str
    exit_code: int | None = None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a failure leads to: FailJob, Restart (counted against maxRestarts) or Ignore (a restart that is
    not counted), and the words that say why."""

    action: str
    why: str

    @property
    def counted(self) -> bool:
        return self.action == RESTART


def _policy(spec: Mapping[str, Any]) -> Mapping[str, Any]:
    return spec.get("failurePolicy") or {}


def verdict(spec: Mapping[str, Any], failure: Failure) -> Verdict:
    """The first failurePolicy.rules entry that matches the exit code decides; without an exit code (evicted,
    deleted, node lost, hung) or without a match, the rank restarts and the restart counts."""
    if failure.exit_code is not None:
        for index, rule in enumerate(_policy(spec).get("rules") or []):
            on = rule["onExitCodes"]
            listed = failure.exit_code in on["values"]
            if listed == (on["operator"] == "In"):
                values = ", ".join(str(v) for v in on["values"])
                return Verdict(
                    rule["action"],
                    f"failurePolicy.rules[{index}] ({rule['action']} on exit codes {on['operator']} [{values}])",
                )
    return Verdict(RESTART, "the default for a lost rank")


def max_restarts(spec: Mapping[str, Any]) -> int:
    return int(_policy(spec).get("maxRestarts", 3))


def restart_delay_seconds(spec: Mapping[str, Any], restart_number: int) -> float:
    """The wait before restart n (1-based) brings its replacement up: initialSeconds * multiplier^(n-1),
    capped at maxSeconds."""
    delay = _policy(spec).get("restartDelay") or {}
    initial = float(delay.get("initialSeconds", 10))
    multiplier = float(delay.get("multiplier", 2))
    cap = float(delay.get("maxSeconds", 300))
    return min(initial * multiplier ** min(max(restart_number, 1) - 1, 64), cap)


def terminating_timeout_seconds(spec: Mapping[str, Any]) -> float:
    return float(_policy(spec).get("terminatingPodTimeoutSeconds", 300))


def quorum_settings(spec: Mapping[str, Any]) -> tuple[int, str]:
    """(minHealthyPercent, actionOnLoss)."""
    quorum = spec.get("quorum") or {}
    return int(quorum.get("minHealthyPercent", 51)), str(quorum.get("actionOnLoss", "Pause"))


def quorum(healthy: int, desired: int, min_healthy_percent: int) -> tuple[int, bool]:
    """(healthy percent, met). Met means at least min_healthy_percent of desired, which is > half."""
    if desired <= 0:
        return 0, False
    return healthy * 100 // desired, healthy * 100 >= min_healthy_percent * desired


def describe(failure: Failure) -> str:
    code = f" with exit code {failure.exit_code}" if failure.exit_code is not None else ""
    return f"rank {failure.rank} (pod {failure.pod}) {failure.message}{code}"
