"""Pure reconciliation: (job spec, observed pods) -> the actions to take and the status to write.

Why pure: every decision the operator makes (which pods to create or delete, which phase and conditions
to report) is tested here without a cluster, and the same function serves every trigger (create, update,
resume, the periodic resync): level-triggered, so a missed event is repaired on the next pass.

Call order (see handlers.py): observe pods (an index kopf keeps) -> plan() -> k8s.apply() the actions ->
events_for() what actually happened -> write status_patch().
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from SneppX_ALG import errors
from sneppx_operator import builders

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
REASON_INVALID_SPEC = "InvalidSpec"


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    namespace: str
    uid: str
    generation: int
    spec: Mapping[str, Any]
    status: Mapping[str, Any]

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Job:
        meta = body["metadata"]
        return cls(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            generation=int(meta.get("generation", 0)),
            spec=body.get("spec") or {},
            status=body.get("status") or {},
        )


@dataclasses.dataclass(frozen=True)
class ObservedPod:
    """What the operator needs to know about one rank's pod."""

    name: str
    rank: int
    generation: int
    phase: str
    ready: bool
    terminating: bool
    node: str | None = None


def observe_pod(
    name: str, meta: Mapping[str, Any], spec: Mapping[str, Any], status: Mapping[str, Any]
) -> ObservedPod | None:
    """Summarise a pod; None for pods not made by this operator (labels missing or not numbers)."""
    labels = meta.get("labels") or {}
    try:
        rank = int(labels[builders.LABEL_RANK])
        generation = int(labels[builders.LABEL_GENERATION])
    except (KeyError, TypeError, ValueError):
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in (status.get("conditions") or [])
    )
    return ObservedPod(
        name=name,
        rank=rank,
        generation=generation,
        phase=str(status.get("phase") or "Pending"),
        ready=ready,
        terminating=meta.get("deletionTimestamp") is not None,
        node=spec.get("nodeName"),
    )


@dataclasses.dataclass(frozen=True)
class Create:
    body: Mapping[str, Any]

    @property
    def kind(self) -> str:
        return str(self.body["kind"])

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])


@dataclasses.dataclass(frozen=True)
class Delete:
    kind: str
    name: str


Action = Create | Delete


@dataclasses.dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    status: dict[str, Any]


def timestamp(now: datetime.datetime) -> str:
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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
        "message": message,
    }


def quorum(ready: int, desired: int, min_healthy_percent: int) -> tuple[int, bool]:
    """(healthy percent, met). Met means at least min_healthy_percent of desired, which is > half."""
    if desired <= 0:
        return 0, False
    return ready * 100 // desired, ready * 100 >= min_healthy_percent * desired


def _is_terminal(status: Mapping[str, Any]) -> bool:
    if status.get("phase") not in TERMINAL_PHASES:
        return False
    # A job failed only for an invalid spec gets another chance once the spec is edited.
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    return ready.get("reason") != REASON_INVALID_SPEC


def plan(job: Job, pods: Sequence[ObservedPod], *, now: datetime.datetime, heartbeat_key: bytes) -> Plan:
    """Decide what to create or delete and what status to report for one job."""
    previous = job.status
    if _is_terminal(previous):
        return Plan((), {})
    spec = job.spec
    suspended = bool(spec.get("suspend", False))
    membership = int(previous.get("membershipGeneration") or 1)
    desired = 0 if suspended else int(spec["elastic"]["maxNodes"])
    min_nodes = int(spec["elastic"]["minNodes"])
    min_healthy = int((spec.get("quorum") or {}).get("minHealthyPercent", 51))

    live = [p for p in pods if not p.terminating]
    current: dict[int, ObservedPod] = {}
    stale: list[ObservedPod] = []  # older generations, ranks above the desired size, or all when suspended
    for pod in sorted(live, key=lambda p: (p.rank, p.name)):
        if pod.generation == membership and pod.rank < desired and pod.rank not in current:
            current[pod.rank] = pod
        else:
            stale.append(pod)
    missing = [rank for rank in range(desired) if rank not in current]

    actions: list[Action] = [Delete("Pod", p.name) for p in stale]
    invalid: errors.JobSpecError | None = None
    if missing:
        try:
            new_pods = [
                builders.build_pod(job.name, job.namespace, job.uid, spec, rank, desired, membership)
                for rank in missing
            ]
        except errors.JobSpecError as exc:
            invalid = exc
        else:
            # The Service and Secret go first: pods mount the Secret and resolve rank 0 through the Service.
            # Creating them whenever a pod is missing repairs them too, at no cost in the steady state.
            actions.append(Create(builders.build_service(job.name, job.namespace, job.uid, spec)))
            actions.append(Create(builders.build_secret(job.name, job.namespace, job.uid, heartbeat_key)))
            actions.extend(Create(body) for body in new_pods)

    ready = sum(1 for p in current.values() if p.ready)
    healthy_percent, quorum_met = quorum(ready, desired, min_healthy)
    succeeded = desired > 0 and not missing and all(p.phase == "Succeeded" for p in current.values())
    conditions_before = previous.get("conditions") or []

    if invalid is not None:
        phase, ready_reason, ready_message = "Failed", REASON_INVALID_SPEC, str(invalid)
    elif suspended:
        phase, ready_reason, ready_message = "Suspended", "Suspended", "spec.suspend is true: no pods run"
    elif succeeded:
        phase, ready_reason, ready_message = "Succeeded", "Succeeded", "every rank exited successfully"
    elif missing:
        phase, ready_reason, ready_message = "Creating", "CreatingPods", f"creating pods for ranks {missing}"
    elif ready >= min_nodes and quorum_met:
        phase, ready_reason, ready_message = "Running", "Running", f"{ready} of {desired} nodes ready"
    else:
        phase, ready_reason, ready_message = (
            "Pending",
            "WaitingForPods",
            f"{ready} of {desired} nodes ready, need {min_nodes} and quorum",
        )

    quorum_message = f"{ready} of {desired} nodes healthy ({healthy_percent}%), quorum needs {min_healthy}%"
    conditions = [
        condition(
            conditions_before, "Ready", phase == "Running", ready_reason, ready_message, job.generation, now
        ),
        condition(
            conditions_before,
            "QuorumMet",
            quorum_met,
            "QuorumMet" if quorum_met else "NotEnoughHealthyNodes",
            quorum_message,
            job.generation,
            now,
        ),
        condition(
            conditions_before,
            "Suspended",
            suspended,
            "Suspended" if suspended else "NotSuspended",
            "spec.suspend is true" if suspended else "spec.suspend is false",
            job.generation,
            now,
        ),
    ]
    if phase == "Succeeded":
        conditions.append(
            condition(conditions_before, "Succeeded", True, "Succeeded", ready_message, job.generation, now)
        )

    status: dict[str, Any] = {
        "phase": phase,
        "observedGeneration": job.generation,
        "membershipGeneration": membership,
        "worldSize": desired,
        "desiredNodes": desired,
        "readyNodes": ready,
        "readyDesired": f"{ready}/{desired}",
        "quorum": {"healthyPercent": healthy_percent, "met": quorum_met},
        "restartCount": int(previous.get("restartCount") or 0),
        "conditions": conditions,
        "ranks": [_rank_status(p) for _, p in sorted(current.items())],
    }
    if previous.get("startTime") or not suspended:
        status["startTime"] = previous.get("startTime") or timestamp(now)
    if phase in TERMINAL_PHASES and invalid is None:
        status["completionTime"] = previous.get("completionTime") or timestamp(now)
    return Plan(tuple(actions), status)


def _rank_status(pod: ObservedPod) -> dict[str, Any]:
    entry: dict[str, Any] = {"rank": pod.rank, "pod": pod.name, "phase": pod.phase, "ready": pod.ready}
    if pod.node:
        entry["node"] = pod.node
    return entry


def status_patch(previous: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """Only the status fields that changed, so a steady job costs no writes."""
    return {key: value for key, value in desired.items() if previous.get(key) != value}


def cleanup_actions(job_name: str, pod_names: Iterable[str]) -> tuple[Action, ...]:
    """What deleting a job removes. The test cluster (and any cluster whose garbage collector lags) would
    otherwise keep the pods running after their owner is gone."""
    return (
        *(Delete("Pod", name) for name in sorted(pod_names)),
        Delete("Service", builders.service_name(job_name)),
        Delete("Secret", builders.secret_name(job_name)),
    )


def events_for(done: Sequence[Action], previous_phase: str | None, status: Mapping[str, Any]) -> list[Event]:
    """Events for what actually happened (actions that took effect) and for a phase change."""
    events: list[Event] = []
    created_ranks = sorted(
        int(a.body["metadata"]["labels"][builders.LABEL_RANK])
        for a in done
        if isinstance(a, Create) and a.kind == "Pod"
    )
    deleted_pods = sorted(a.name for a in done if isinstance(a, Delete) and a.kind == "Pod")
    phase = status.get("phase")
    if created_ranks:
        events.append(
            Event(
                "Normal",
                "CreatedPods",
                f"created pods for ranks {created_ranks} (membership generation "
                f"{status.get('membershipGeneration')}, world size {status.get('worldSize')})",
            )
        )
    if deleted_pods:
        reason = "Suspended" if phase == "Suspended" else "DeletedPods"
        events.append(Event("Normal", reason, f"deleted pods {deleted_pods}"))
    if phase and phase != previous_phase:
        ready = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), None)
        detail = f": {ready['message']}" if ready else ""
        kind = "Warning" if phase == "Failed" else "Normal"
        reason = REASON_INVALID_SPEC if ready and ready["reason"] == REASON_INVALID_SPEC else "PhaseChanged"
        events.append(Event(kind, reason, f"{previous_phase or 'New'} -> {phase}{detail}"))
    return events
