"""Pure failure policy: what a rank's end means for the job (spec.failurePolicy and spec.quorum).

Why a module of its own: these are the rules a user tunes (exit-code rules, the restart budget, the delay
between restarts, the quorum and what losing it does), each small and each tested alone; reconcile.plan
applies them to what it observed.

Quorum is what the agents need to train: elastic.minNodes healthy ranks (and, if set, minHealthyPercent of the
desired ones). No majority is needed for safety: a membership is decided by compare-and-swap on the job's one
rendezvous object, so two groups can never both form a generation, whatever the network splits. (The strict
majority of `SneppX_ALG.elastic.fault_tolerance.quorum_size` is the standalone manager's rule, for peers that
share no store.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from SneppX_ALG.contract import backoff
from sneppx_operator import defaults

# Why a rank is being replaced (restartHistory[].reason; the restarts metric's `reason` label).
POD_FAILED = "PodFailed"  # its training container exited non-zero
EVICTED = "Evicted"  # the kubelet or the Eviction API took the pod away
POD_DELETED = "PodDeleted"  # someone deleted the pod
NODE_NOT_READY = "NodeNotReady"  # its node stopped reporting
HANG = "Hang"  # an agent reported it stopped stepping for hangTimeoutSeconds
QUORUM_LOST = "QuorumLost"  # quorum.actionOnLoss RestartGroup: every rank replaced at once

FAIL_JOB, RESTART, IGNORE = "FailJob", "Restart", "Ignore"

# The DisruptionTarget reasons of a pod the cluster took away for its own ends: a drain or any other use of the
# Eviction API, a preemption, a NoExecute taint, the collection of a pod whose node is gone. The job did nothing
# wrong, so such a restart is not counted against maxRestarts (a node upgrade must not fail a long job). The
# kubelet's own evictions (TerminationByKubelet: node pressure, often the job's own memory) still count.
POD_GC = "DeletionByPodGC"  # the pod garbage collector's (a pod whose node is gone, among others)
NODE_DRAINED = "NodeCordoned"  # not Kubernetes': a pod that left a cordoned node, seen Terminating or not
CLUSTER_DISRUPTIONS = frozenset({"EvictionByEvictionAPI", "PreemptionByScheduler", "DeletionByTaintManager", POD_GC,
                                 NODE_DRAINED})


@dataclasses.dataclass(frozen=True)
class RankLoss:
    """One rank lost: which, why, and (when its container exited) with which code. (The runtime's
    `fault_tolerance.Failure` is another thing: a failure the in-process manager recorded against its budget.)"""

    rank: int
    pod: str
    reason: str
    message: str
    exit_code: int | None = None
    disruption: str | None = None  # the pod's DisruptionTarget reason, when the cluster set one


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


def verdict(spec: Mapping[str, Any], failure: RankLoss) -> Verdict:
    """The first failurePolicy.rules entry that matches the exit code decides; without an exit code (evicted,
    deleted, node lost, hung) or without a match, the rank restarts and the restart counts, unless the cluster
    itself took the pod away (CLUSTER_DISRUPTIONS)."""
    if failure.disruption in CLUSTER_DISRUPTIONS:
        return Verdict(IGNORE, f"the cluster took the pod away ({failure.disruption}), not the job")
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
    return int(defaults.field(_policy(spec), "failurePolicy.maxRestarts"))


def restart_delay_seconds(spec: Mapping[str, Any], restart_number: int) -> float:
    """The wait before the replacements of the n-th restart in a row (1-based) come up:
    initialSeconds * multiplier^(n-1), capped at maxSeconds."""
    initial, multiplier, cap = _restart_delay(spec)
    return backoff.restart_delay(restart_number, base=initial, factor=multiplier, cap=cap)


def _restart_delay(spec: Mapping[str, Any]) -> tuple[float, float, float]:
    delay = _policy(spec).get("restartDelay") or {}
    return (float(defaults.field(delay, "failurePolicy.restartDelay.initialSeconds")), float(defaults.field(delay, "failurePolicy.restartDelay.multiplier")),
            float(defaults.field(delay, "failurePolicy.restartDelay.maxSeconds")))


def backoff_reset_seconds(spec: Mapping[str, Any]) -> float:
    """How long the job must have run healthy for the next restart to wait only initialSeconds again: twice
    the cap, as a kubelet forgets a container's CrashLoopBackOff after it ran twice its longest backoff."""
    return 2 * _restart_delay(spec)[2]


def terminating_timeout_seconds(spec: Mapping[str, Any]) -> float:
    return float(defaults.field(_policy(spec), "failurePolicy.terminatingPodTimeoutSeconds"))


@dataclasses.dataclass(frozen=True)
class QuorumRule:
    """How many healthy ranks a job needs to go on training: at least elastic.minNodes (what the agents need to
    form a generation) and, when quorum.minHealthyPercent is set, that share of the desired nodes too."""

    min_nodes: int
    min_healthy_percent: int  # 0: not set
    action_on_loss: str

    def needed(self, desired: int) -> int:
        by_percent = -(-self.min_healthy_percent * desired // 100)  # ceil
        return max(self.min_nodes, by_percent)

    def judge(self, healthy: int, desired: int) -> tuple[int, bool]:
        """(healthy percent of desired, met). Nothing is met with nothing desired (a suspended job)."""
        if desired <= 0:
            return 0, False
        return healthy * 100 // desired, healthy >= self.needed(desired)

    def describe(self, healthy: int, desired: int) -> str:
        percent = self.judge(healthy, desired)[0]
        return f"{healthy} of {desired} nodes healthy ({percent}%), quorum needs {self.needed(desired)}"


def quorum_rule(spec: Mapping[str, Any]) -> QuorumRule:
    quorum = spec.get("quorum") or {}
    return QuorumRule(int(spec["elastic"]["minNodes"]), int(quorum.get("minHealthyPercent") or 0),
                      str(defaults.field(quorum, "quorum.actionOnLoss")))


def describe(failure: RankLoss) -> str:
    code = f" with exit code {failure.exit_code}" if failure.exit_code is not None else ""
    return f"rank {failure.rank} (pod {failure.pod}) {failure.message}{code}"
