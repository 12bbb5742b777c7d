"""Pure reconciliation: (job spec, observed pods) -> the actions to take and the status to write.

Why pure: every decision the operator makes (which pods to create or delete, which phase and conditions
to report, what to do when the API server refuses something) is tested here without a cluster, and the
same function serves every trigger (create, update, resume, the periodic resync): level-triggered, so a
missed event is repaired on the next pass.

Call order (see handlers.py): observe pods (an index kopf keeps) -> plan() -> k8s.apply() the actions ->
settle() what happened into the status to write, the events to post and whether to retry.

Ownership: the job acts only on objects whose controller ownerReference carries its uid. A pod with the
job's labels but another controller is neither counted nor deleted; a name held by someone else's object
is reported (condition ResourceFailure, reason NameInUse) and never taken over.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from SneppX_ALG import errors
from sneppx_operator import builders

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
ACTIVE_POD_PHASES = frozenset({"Pending", "Running", "Unknown"})
REASON_INVALID_SPEC = "InvalidSpec"
REASON_RANKS_FAILED = "RanksFailed"
# Like a ReplicaSet's ReplicaFailure: True while an object the job needs can't be created or deleted.
CONDITION_RESOURCE_FAILURE = "ResourceFailure"
REASON_NAME_IN_USE = "NameInUse"
REASON_FAILED_CREATE = "FailedCreate"
REASON_FAILED_DELETE = "FailedDelete"
# The API server's answers that no retry can change: the object itself is invalid.
SPEC_REJECTED_CODES = frozenset({400, 422})


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
    uid: str = ""
    controller_uid: str | None = None  # the uid in its controller ownerReference: which job owns it
    exit_code: int | None = None  # the training container's, once it has terminated
    reason: str | None = None  # why it ended (OOMKilled, Error, Evicted), when the kubelet says


def controller_uid(meta: Mapping[str, Any]) -> str | None:
    """The uid of the object's controller (the ownerReference with controller: true), if it has one."""
    return next((ref.get("uid") for ref in meta.get("ownerReferences") or [] if ref.get("controller")), None)


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
    exit_code, reason = _training_container_end(spec, status)
    return ObservedPod(
        name=name,
        rank=rank,
        generation=generation,
        phase=str(status.get("phase") or "Pending"),
        ready=ready,
        terminating=meta.get("deletionTimestamp") is not None,
        node=spec.get("nodeName"),
        uid=str(meta.get("uid") or ""),
        controller_uid=controller_uid(meta),
        exit_code=exit_code,
        reason=reason or status.get("reason"),
    )


def _training_container_end(
    spec: Mapping[str, Any], status: Mapping[str, Any]
) -> tuple[int | None, str | None]:
    """(exit code, reason) of the first container (the training agent), once it has terminated."""
    containers = spec.get("containers") or []
    name = containers[0].get("name") if containers else None
    for container_status in status.get("containerStatuses") or []:
        terminated = (container_status.get("state") or {}).get("terminated")
        if container_status.get("name") == name and terminated:
            code = terminated.get("exitCode")
            return (int(code) if code is not None else None), terminated.get("reason")
    return None, None


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
    """Delete an object only while `owner_uid` (the job) controls it; `uid`, when known, is sent as the
    delete's precondition so an object replaced under the same name is never the one deleted."""

    kind: str
    name: str
    owner_uid: str
    uid: str | None = None


Action = Create | Delete


@dataclasses.dataclass(frozen=True)
class Refusal:
    """The API server refused an action, or (name_in_use) its name is held by an object the job doesn't
    control. `holder` describes that object's controller ("" when it has none)."""

    action: Action
    code: int
    message: str
    name_in_use: bool = False
    holder: str = ""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What k8s.apply did: the actions that changed something, and the refusal that stopped it, if any.
    Actions run in order and stop at the first refusal: later ones depend on earlier ones (pods mount
    the Secret) or would be refused the same way (quota)."""

    done: tuple[Action, ...] = ()
    refused: Refusal | None = None


@dataclasses.dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    status: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Settled:
    """What one pass ends with: the status to write, the events to post, and `error` when the pass fell
    short; `retryable` says whether trying again (with backoff) can help or only a spec edit can."""

    status: dict[str, Any]
    events: list[Event]
    error: str | None = None
    retryable: bool = True


@dataclasses.dataclass(frozen=True)
class Membership:
    """The membership generation the job's pods belong to and its world size (WORLD_SIZE in every pod)."""

    generation: int
    world_size: int


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


def find_condition(status: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)


def quorum(ready: int, desired: int, min_healthy_percent: int) -> tuple[int, bool]:
    """(healthy percent, met). Met means at least min_healthy_percent of desired, which is > half."""
    if desired <= 0:
        return 0, False
    return ready * 100 // desired, ready * 100 >= min_healthy_percent * desired


def next_membership(spec: Mapping[str, Any], status: Mapping[str, Any]) -> Membership:
    """The generation the job's pods must carry now, and its world size.

    A generation's world size never changes: every pod of generation g was started with the same
    WORLD_SIZE, so a pod is never created (or kept) with another size under the same generation. When
    the size the spec asks for differs from the current generation's (maxNodes edited, suspend, resume),
    the next generation starts and the pods of the old one are replaced. The elastic lifecycle (agents
    re-forming with the ranks that are alive, restarts) decides generations here too, from more inputs.
    """
    world_size = 0 if spec.get("suspend", False) else int(spec["elastic"]["maxNodes"])
    generation = int(status.get("membershipGeneration") or 0)
    if generation == 0:
        return Membership(1, world_size)
    current = int(status.get("worldSize") or 0)
    if current == world_size:
        return Membership(generation, world_size)
    return Membership(generation + 1, world_size)


def _is_terminal(status: Mapping[str, Any]) -> bool:
    if status.get("phase") not in TERMINAL_PHASES:
        return False
    # A job failed only for an invalid spec gets another chance once the spec is edited.
    ready = find_condition(status, "Ready") or {}
    return ready.get("reason") != REASON_INVALID_SPEC


def _rejected_spec(job: Job) -> str | None:
    """The message when this very generation of the spec was already found invalid (by the builder or
    the API server): it is not tried again until the spec is edited (metadata.generation moves)."""
    ready = find_condition(job.status, "Ready")
    if (
        ready
        and ready.get("reason") == REASON_INVALID_SPEC
        and ready.get("observedGeneration") == job.generation
    ):
        return str(ready.get("message") or "")
    return None


def plan(job: Job, pods: Sequence[ObservedPod], *, now: datetime.datetime, heartbeat_key: bytes) -> Plan:
    """Decide what to create or delete and what status to report for one job."""
    previous = job.status
    if _is_terminal(previous):
        return Plan((), {})
    spec = job.spec
    suspended = bool(spec.get("suspend", False))
    membership = next_membership(spec, previous)
    desired = membership.world_size
    min_nodes = int(spec["elastic"]["minNodes"])
    min_healthy = int((spec.get("quorum") or {}).get("minHealthyPercent", 51))

    # Only pods this job controls count; a look-alike with the job's labels is someone else's.
    live = [p for p in pods if not p.terminating and p.controller_uid == job.uid]
    current: dict[int, ObservedPod] = {}
    stale: list[ObservedPod] = []  # older generations, ranks above the desired size, or all when suspended
    for pod in sorted(live, key=lambda p: (p.rank, p.name)):
        if pod.generation == membership.generation and pod.rank < desired and pod.rank not in current:
            current[pod.rank] = pod
        else:
            stale.append(pod)
    missing = [rank for rank in range(desired) if rank not in current]

    actions: list[Action] = [Delete("Pod", p.name, job.uid, p.uid or None) for p in stale]
    invalid = _rejected_spec(job)
    if missing and invalid is None:
        try:
            new_pods = [
                builders.build_pod(
                    job.name, job.namespace, job.uid, spec, rank, desired, membership.generation
                )
                for rank in missing
            ]
        except errors.JobSpecError as exc:
            invalid = str(exc)
        else:
            # The Service and Secret go first: pods mount the Secret and resolve rank 0 through the Service.
            # Creating them whenever a pod is missing repairs them too, at no cost in the steady state.
            actions.append(Create(builders.build_service(job.name, job.namespace, job.uid, spec)))
            actions.append(Create(builders.build_secret(job.name, job.namespace, job.uid, heartbeat_key)))
            actions.extend(Create(body) for body in new_pods)

    ready = sum(1 for p in current.values() if p.ready)
    finished = desired > 0 and not missing and not any(p.phase in ACTIVE_POD_PHASES for p in current.values())
    failed = [p for _, p in sorted(current.items()) if p.phase == "Failed"] if finished else []

    if invalid is not None:
        phase, ready_reason, ready_message = "Failed", REASON_INVALID_SPEC, invalid
    elif suspended:
        phase, ready_reason, ready_message = "Suspended", "Suspended", "spec.suspend is true: no pods run"
    elif failed:
        phase, ready_reason, ready_message = "Failed", REASON_RANKS_FAILED, _ranks_failed(membership, failed)
    elif finished:
        phase, ready_reason, ready_message = "Succeeded", "Succeeded", "every rank exited successfully"
    elif missing:
        phase, ready_reason, ready_message = "Creating", "CreatingPods", f"creating pods for ranks {missing}"
    elif ready >= min_nodes and quorum(ready, desired, min_healthy)[1]:
        phase, ready_reason, ready_message = "Running", "Running", f"{ready} of {desired} nodes ready"
    else:
        phase, ready_reason, ready_message = (
            "Pending",
            "WaitingForPods",
            f"{ready} of {desired} nodes ready, need {min_nodes} and quorum",
        )

    status: dict[str, Any] = {
        "membershipGeneration": membership.generation,
        "worldSize": desired,
        "desiredNodes": desired,
        "readyNodes": ready,
        "readyDesired": f"{ready}/{desired}",
        "restartCount": int(previous.get("restartCount") or 0),
        "ranks": [_rank_status(p) for _, p in sorted(current.items())],
    }
    healthy_percent, quorum_met = quorum(ready, desired, min_healthy)
    status["quorum"] = {"healthyPercent": healthy_percent, "met": quorum_met}
    quorum_message = f"{ready} of {desired} nodes healthy ({healthy_percent}%), quorum needs {min_healthy}%"
    conditions_before = previous.get("conditions") or []
    status["conditions"] = [
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
    if previous.get("startTime") or not suspended:
        status["startTime"] = previous.get("startTime") or timestamp(now)
    return Plan(tuple(actions), _with_phase(job, status, phase, ready_reason, ready_message, now))


def _with_phase(
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


def _ranks_failed(membership: Membership, failed: Sequence[ObservedPod]) -> str:
    def how(pod: ObservedPod) -> str:
        parts = [f"exit code {pod.exit_code}" if pod.exit_code is not None else "", pod.reason or ""]
        return ", ".join(part for part in parts if part) or "no exit code reported"

    details = "; ".join(f"rank {p.rank}: {how(p)}" for p in failed)
    return (
        f"every rank of membership generation {membership.generation} has exited and ranks "
        f"{[p.rank for p in failed]} failed ({details}); this operator version does not restart the "
        "group (spec.failurePolicy), so the job has failed"
    )


def _rank_status(pod: ObservedPod) -> dict[str, Any]:
    entry: dict[str, Any] = {"rank": pod.rank, "pod": pod.name, "phase": pod.phase, "ready": pod.ready}
    if pod.node:
        entry["node"] = pod.node
    if pod.exit_code is not None:
        entry["exitCode"] = pod.exit_code
    if pod.reason:
        entry["reason"] = pod.reason[:128]
    return entry


def settle(job: Job, plan: Plan, outcome: Outcome, *, now: datetime.datetime) -> Settled:
    """The status, events and retry decision once the plan's actions were tried (k8s.apply's outcome).

    A spec the API server rejects (400/422) fails the job with InvalidSpec until the spec is edited; any
    other refusal (403 quota or RBAC, a name held by someone else, 5xx) is reported in the ResourceFailure
    condition and retried with backoff. Events go out when something changes, not on every retry.
    """
    if not plan.status:  # a finished job: nothing was planned or tried
        return Settled({}, [])
    refused = outcome.refused
    status = dict(plan.status)
    if refused is None:
        return Settled(status, events_for(outcome.done, job.status.get("phase"), status, job.status))
    error = describe_refusal(refused)
    if refused.code in SPEC_REJECTED_CODES and isinstance(refused.action, Create):
        status = _with_phase(job, status, "Failed", REASON_INVALID_SPEC, error, now)
        return Settled(
            status, events_for(outcome.done, job.status.get("phase"), status, job.status), error, False
        )
    reason = _refusal_reason(refused)
    before = job.status.get("conditions") or []
    failure = condition(before, CONDITION_RESOURCE_FAILURE, True, reason, error, job.generation, now)
    status["conditions"] = [*status["conditions"], failure]
    events = events_for(outcome.done, job.status.get("phase"), status, job.status)
    known = find_condition(job.status, CONDITION_RESOURCE_FAILURE) or {}
    if (known.get("reason"), known.get("message")) != (reason, error):  # once per new problem, not per retry
        events.append(Event("Warning", reason, error))
    return Settled(status, events, error, True)


def describe_refusal(refused: Refusal) -> str:
    what = f'{refused.action.kind} "{refused.action.name}"'
    if refused.name_in_use:
        holder = f"its controller is {refused.holder}" if refused.holder else "it has no controller"
        return (
            f"{what} already exists and is not controlled by this job ({holder}); the job won't take it over "
            f"or delete it: rename the job or remove that {refused.action.kind}"
        )
    verb = "create" if isinstance(refused.action, Create) else "delete"
    return f"the API server refused to {verb} {what} ({refused.code}): {refused.message}"


def _refusal_reason(refused: Refusal) -> str:
    if refused.name_in_use:
        return REASON_NAME_IN_USE
    return REASON_FAILED_CREATE if isinstance(refused.action, Create) else REASON_FAILED_DELETE


def status_patch(previous: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """Only the status fields that changed, so a steady job costs no writes."""
    return {key: value for key, value in desired.items() if previous.get(key) != value}


def cleanup_actions(job_name: str, job_uid: str, pods: Iterable[ObservedPod]) -> tuple[Action, ...]:
    """What deleting a job removes: only what the job controls. The test cluster (and any cluster whose
    garbage collector lags) would otherwise keep the pods running after their owner is gone."""
    mine = sorted((p for p in pods if p.controller_uid == job_uid), key=lambda p: p.name)
    return (
        *(Delete("Pod", p.name, job_uid, p.uid) for p in mine),
        Delete("Service", builders.service_name(job_name), job_uid),
        Delete("Secret", builders.secret_name(job_name, job_uid), job_uid),
    )


def events_for(
    done: Sequence[Action],
    previous_phase: str | None,
    status: Mapping[str, Any],
    previous_status: Mapping[str, Any] | None = None,
) -> list[Event]:
    """Events for what actually happened (actions that took effect), a new membership generation and a
    phase change."""
    events: list[Event] = []
    created_ranks = sorted(
        int(a.body["metadata"]["labels"][builders.LABEL_RANK])
        for a in done
        if isinstance(a, Create) and a.kind == "Pod"
    )
    deleted_pods = sorted(a.name for a in done if isinstance(a, Delete) and a.kind == "Pod")
    phase = status.get("phase")
    before = previous_status or {}
    generation_before = before.get("membershipGeneration")
    generation = status.get("membershipGeneration")
    if (
        generation_before is not None
        and generation not in (None, generation_before)
        and status.get("worldSize")
    ):
        events.append(
            Event(
                "Normal",
                "MembershipChanged",
                f"membership generation {status['membershipGeneration']} starts with world size "
                f"{status.get('worldSize')} (was {before.get('worldSize')}); ranks of generation "
                f"{generation_before} are replaced",
            )
        )
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
        ready = find_condition(status, "Ready")
        detail = f": {ready['message']}" if ready else ""
        failed = phase == "Failed"
        reason = str(ready["reason"]) if failed and ready else "PhaseChanged"
        events.append(
            Event("Warning" if failed else "Normal", reason, f"{previous_phase or 'New'} -> {phase}{detail}")
        )
    return events
