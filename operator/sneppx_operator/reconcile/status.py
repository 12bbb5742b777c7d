"""The job's status as a plan writes it: the reasons and limits of its fields, conditions, the per-rank and
restart entries, the fields rank 0 reports through the rendezvous object, and the merge patch that writes it.

Why apart: the status is the operator's durable record (a restart is decided once because the status says
so); its shapes and bounds (the CRD caps every string) live in one place, apart from the decisions.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any

from SneppX_ALG.contract import job_object
from sneppx_operator import policy
from sneppx_operator.reconcile.decisions import Event, Restart
from sneppx_operator.reconcile.observe import Job, ObservedObject, ObservedPod

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
REASON_INVALID_SPEC = "InvalidSpec"
REASON_BUDGET_EXHAUSTED = "RestartBudgetExhausted"
REASON_EXIT_CODE_RULE = "ExitCodeRule"
REASON_QUORUM_LOST = "QuorumLost"
REASON_DEADLINE = "DeadlineExceeded"
# Like a ReplicaSet's ReplicaFailure: True while an object the job needs can't be created or deleted.
CONDITION_RESOURCE_FAILURE = "ResourceFailure"
REASON_NAME_IN_USE = "NameInUse"
REASON_FAILED_CREATE = "FailedCreate"
REASON_FAILED_DELETE = "FailedDelete"
# True while every rank's peer-memory snapshot has snapshotReplicas copies off its own node (rank 0 reports it).
CONDITION_SNAPSHOTS_PROTECTED = "SnapshotsProtected"
REASON_COPIES_OFF_NODE = "CopiesOffNode"
REASON_COPIES_ON_SAME_NODE = "CopiesOnSameNode"
MAX_HISTORY = 32  # status.restartHistory keeps the most recent restarts
MAX_PROBLEMS = 8
MAX_MESSAGE_CHARS = 4096  # a condition's message (the CRD allows 32768; a person reads far less)


def timestamp(now: datetime.datetime) -> str:
    return job_object.timestamp(now)


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """Text bounded for a status field (the CRD caps every string; an over-long status is refused whole)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def describe_ranks(ranks: Iterable[int], limit: int = 16) -> str:
    """Ranks as a person reads them, bounded whatever their number: "0-3, 7, 9-1023" (at most `limit` runs)."""
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    words = [str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit]]
    if len(runs) > limit:
        words.append(f"and {sum(b - a + 1 for a, b in runs[limit:])} more")
    return ", ".join(words)


def condition(
    previous: Iterable[Mapping[str, Any]],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    generation: int,
    now: datetime.datetime,
) -> dict[str, Any]:
    """A metav1.Condition; lastTransitionTime only moves when the status flips."""
    value = "True" if status else "False"
    old = next((c for c in previous if c.get("type") == type_), None)
    changed_at = old["lastTransitionTime"] if old and old.get("status") == value else timestamp(now)
    return {
        "type": type_,
        "status": value,
        "observedGeneration": generation,
        "lastTransitionTime": changed_at,
        "reason": reason,
        "message": clip(message),
    }


def find_condition(status: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)


def _checkpoint_status(ref: job_object.CheckpointRef | None) -> dict[str, Any] | None:
    return None if ref is None else {"step": ref.step, "location": ref.location, "time": ref.time}


def reported(
    previous: Mapping[str, Any], rendezvous: ObservedObject | None, events: list[Event]
) -> dict[str, Any]:
    """Status fields rank 0 reports through the rendezvous object (kept as they were without a report), and
    an event when the job resumed from a checkpoint or rolled back past newer ones."""
    out = {k: previous[k] for k in ("lastValidCheckpoint", "resumedFrom", "rendezvous") if previous.get(k)}
    view = rendezvous.view if rendezvous else job_object.View()
    report = view.report
    if report is not None:
        out["rendezvous"] = {
            "generation": report.generation,
            "worldSize": report.world_size,
            "members": list(report.members),
            "reportedAt": report.reported_at,
        }
        last, resumed = _checkpoint_status(report.last_valid_checkpoint), _checkpoint_status(report.resumed_from)
        if last is not None:
            out["lastValidCheckpoint"] = last
        if resumed is not None:
            out["resumedFrom"] = resumed
            if resumed != previous.get("resumedFrom"):
                newest = (previous.get("lastValidCheckpoint") or {}).get("step")
                if newest is not None and resumed["step"] < newest:
                    events.append(Event(
                        "Warning", "RolledBack",
                        f"resumed from step {resumed['step']} ({resumed['location']}), rolled back past step "
                        f"{newest}, which did not validate",
                    ))
                else:
                    events.append(Event(
                        "Normal", "Resumed", f"resumed from step {resumed['step']} ({resumed['location']})"
                    ))
    if view.problems:
        out.setdefault("rendezvous", {})
        out["rendezvous"] = {**out["rendezvous"], "problems": [clip(p, 256) for p in view.problems[:MAX_PROBLEMS]]}
    elif "rendezvous" in out and "problems" in out["rendezvous"]:
        rest = {k: v for k, v in out["rendezvous"].items() if k != "problems"}
        if rest:
            out["rendezvous"] = rest
        else:  # nothing left: the whole field goes (an empty object would be patched away once more)
            del out["rendezvous"]
    return out


def snapshot_conditions(
    previous: Mapping[str, Any], rendezvous: ObservedObject | None, snapshots_on: bool, generation: int,
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """SnapshotsProtected, while peer-memory snapshots are on: False (CopiesOnSameNode, naming the ranks) when
    rank 0 reports ranks whose part has fewer copies off its node than asked (that node's loss then costs the
    steps since the last checkpoint), True when it reports none; as it was while no report says (a generation
    whose first snapshot is still to come, an agent that predates the field)."""
    if not snapshots_on:
        return []
    report = rendezvous.view.report if rendezvous else None
    ranks = None if report is None else report.snapshot_unprotected
    if report is None or ranks is None:
        kept = find_condition(previous, CONDITION_SNAPSHOTS_PROTECTED)
        return [dict(kept)] if kept else []
    if ranks:
        reason = REASON_COPIES_ON_SAME_NODE
        message = (f"the snapshots of rank{'s' if len(ranks) > 1 else ''} {describe_ranks(ranks)} have fewer copies "
                   f"off their node than snapshotReplicas (membership generation {report.generation}): losing "
                   "that node resumes from the last checkpoint; spread the pods over more nodes")
    else:
        reason, message = REASON_COPIES_OFF_NODE, "every rank's snapshots have their copies on other nodes"
    return [condition(previous.get("conditions") or [], CONDITION_SNAPSHOTS_PROTECTED, not ranks, reason, message,
                      generation, now)]


def with_phase(
    job: Job, status: Mapping[str, Any], phase: str, reason: str, message: str, now: datetime.datetime
) -> dict[str, Any]:
    """The status with its phase set and what follows from it: the Ready condition (first), a
    Succeeded/Failed condition (last) and completionTime. Other conditions keep their place."""
    before = job.status.get("conditions") or []
    others = [c for c in status.get("conditions") or [] if c["type"] not in {"Ready", *TERMINAL_PHASES}]
    conditions = [
        condition(before, "Ready", phase == "Running", reason, message, job.generation, now),
        *others,
    ]
    if phase in TERMINAL_PHASES:
        conditions.append(condition(before, phase, True, reason, message, job.generation, now))
    result = {**status, "phase": phase, "observedGeneration": job.generation, "conditions": conditions}
    result.pop("completionTime", None)
    if phase in TERMINAL_PHASES and reason != REASON_INVALID_SPEC:
        result["completionTime"] = job.status.get("completionTime") or timestamp(now)
    return result


def rank_status(pod: ObservedPod) -> dict[str, Any]:
    entry: dict[str, Any] = {"rank": pod.rank, "pod": pod.name, "phase": pod.phase, "ready": pod.ready}
    if pod.uid:
        entry["uid"] = pod.uid
    if pod.node:
        entry["node"] = pod.node
    if pod.exit_code is not None:
        entry["exitCode"] = pod.exit_code
    if pod.reason:
        entry["reason"] = clip(pod.reason, 128)
    return entry


def restart_entry(restart: Restart, now: datetime.datetime) -> dict[str, Any]:
    failure = restart.failure
    entry: dict[str, Any] = {
        "time": timestamp(now),
        "reason": failure.reason,
        "message": clip(
            (policy.describe(failure) if failure.rank >= 0 else failure.message)
            + ("" if restart.counted else f"; not counted: {restart.why}"),
            1024,
        ),
        "membershipGeneration": restart.generation,
        "counted": restart.counted,
    }
    if failure.rank >= 0:
        entry["rank"] = failure.rank
    if failure.exit_code is not None:
        entry["exitCode"] = failure.exit_code
    if restart.pod_uid:
        entry["podUid"] = restart.pod_uid
    return entry


def status_patch(previous: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `previous` into `desired`: only what changed, so a steady
    job costs no writes, and null for every key `desired` no longer has (a merge patch never removes a key by
    leaving it out, at any depth)."""
    patch: dict[str, Any] = {key: None for key in previous if key not in desired}
    for key, value in desired.items():
        old = previous.get(key)
        if isinstance(value, Mapping) and isinstance(old, Mapping):
            nested = status_patch(old, value)
            if nested:
                patch[key] = nested
        elif key not in previous or old != value:
            patch[key] = value
    return patch
