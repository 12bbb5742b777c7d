"""Pure reconciliation: (job spec, observed pods, nodes and rendezvous object) -> the actions to take and the
status to write.

Why pure: every decision the operator makes (which pods to create, delete or force-delete, when a rank is
restarted and whether that counts, when the job pauses, fails or is done, which phase and conditions to
report, what to do when the API server refuses something) is tested here without a cluster, and the same
function serves every trigger: level-triggered, so a missed event is repaired on the next pass.

Call order (see handlers.py): observe pods, nodes and the rendezvous object (indexes kopf keeps) -> plan() ->
k8s.apply() the actions -> settle() what happened into the status to write, the events to post, the restarts
to count and when to look again.

Ownership: the job acts only on objects whose controller ownerReference carries its uid. A pod with the
job's labels but another controller is neither counted nor deleted; a name held by someone else's object
is reported (condition ResourceFailure, reason NameInUse) and never taken over.

Lifecycle (docs/OPERATOR.md has it for users): each rank has a slot, a pod named <job>-<rank>, in the current
pod generation (`membershipGeneration`, one world size). A slot whose pod failed, was evicted or deleted, sits
on a NotReady node or was reported hung by an agent is restarted: its pod is deleted and, once the name is free
and the restart delay has passed, a replacement is created. A pod stuck Terminating past
terminatingPodTimeoutSeconds is force-deleted. Each restart is counted once (by the uid of the pod it
replaces) against maxRestarts unless an Ignore rule says otherwise. Quorum is counted over healthy slots.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from SneppX_ALG.contract import job_object
from sneppx_operator import builders, policy
from sneppx_operator.errors import JobSpecError

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
ACTIVE_POD_PHASES = frozenset({"Pending", "Running", "Unknown"})
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
# The API server's answers that no retry can change: the object itself is invalid.
SPEC_REJECTED_CODES = frozenset({400, 422})
MAX_HISTORY = 32  # status.restartHistory keeps the most recent restarts
MAX_PROBLEMS = 8
MAX_MESSAGE_CHARS = 4096  # a condition's message (the CRD allows 32768; a person reads far less)
# Put on jobs by operator versions that deleted a job's objects themselves; taken off by this one.
LEGACY_FINALIZER = "sneppx.io/finalizer"


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    namespace: str
    uid: str
    generation: int
    spec: Mapping[str, Any]
    status: Mapping[str, Any]
    resource_version: str = ""  # of the body read: every status write is conditional on it
    finalizers: tuple[str, ...] = ()

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
            resource_version=str(meta.get("resourceVersion") or ""),
            finalizers=tuple(meta.get("finalizers") or ()),
        )


def parse_time(text: Any) -> datetime.datetime | None:
    try:
        return job_object.parse_time(text)
    except ValueError:
        return None


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
    deleted_at: datetime.datetime | None = None  # deletionTimestamp: when its grace period ends
    created_at: datetime.datetime | None = None
    disruption: str | None = None  # why the cluster is taking it away (its DisruptionTarget condition's reason)


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
    phase = str(status.get("phase") or "Pending")
    if exit_code is not None:
        # The rank is its trainer: a classic sidecar that keeps running holds the pod Running (Ready false) after
        # the trainer ended, and a sidecar that failed makes the pod Failed although the trainer succeeded.
        phase = "Succeeded" if exit_code == 0 else "Failed"
    disruption = next((c.get("reason") for c in status.get("conditions") or []
                       if c.get("type") == "DisruptionTarget" and c.get("status") == "True"), None)
    if status.get("reason") == "Evicted" or disruption is not None:  # beats the killed container's word
        reason = "Evicted"
    return ObservedPod(
        name=name,
        rank=rank,
        generation=generation,
        phase=phase,
        ready=ready,
        terminating=meta.get("deletionTimestamp") is not None,
        node=spec.get("nodeName"),
        uid=str(meta.get("uid") or ""),
        controller_uid=controller_uid(meta),
        exit_code=exit_code,
        reason=reason or status.get("reason"),
        deleted_at=parse_time(meta.get("deletionTimestamp")),
        created_at=parse_time(meta.get("creationTimestamp")),
        disruption=str(disruption) if disruption is not None else None,
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
class ObservedNode:
    name: str
    ready: bool
    since: datetime.datetime | None = None  # when its Ready condition last changed


def observe_node(name: str, status: Mapping[str, Any]) -> ObservedNode:
    """A node is ready while its Ready condition is True (False: the kubelet says so; Unknown: it went silent
    and the node controller noticed)."""
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None:
        return ObservedNode(name, True)
    return ObservedNode(name, ready.get("status") == "True", parse_time(ready.get("lastTransitionTime")))


@dataclasses.dataclass(frozen=True)
class ObservedObject:
    """The job's rendezvous ConfigMap as the operator sees it."""

    uid: str
    controller_uid: str | None
    view: job_object.View


def observe_rendezvous(meta: Mapping[str, Any], data: Mapping[str, str] | None) -> ObservedObject:
    return ObservedObject(str(meta.get("uid") or ""), controller_uid(meta), job_object.read_view(data))


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
    delete's precondition so an object replaced under the same name is never the one deleted. `force`
    deletes with a grace period of 0 (a pod whose kubelet is gone or stuck)."""

    kind: str
    name: str
    owner_uid: str
    uid: str | None = None
    force: bool = False


@dataclasses.dataclass(frozen=True)
class PutRecords:
    """Write (or, with None, remove) records of the job's rendezvous object, by record key."""

    name: str
    owner_uid: str
    records: tuple[tuple[str, Mapping[str, Any] | None], ...]
    kind: str = "ConfigMap"


@dataclasses.dataclass(frozen=True)
class DeleteJob:
    """Delete the job itself (ttlSecondsAfterFinished), only while it is still the object with `uid`."""

    name: str
    uid: str
    kind: str = builders.KIND


@dataclasses.dataclass(frozen=True)
class DropFinalizer:
    """Take a finalizer an earlier operator version put on the job off it (owner references collect the job's
    objects; a finalizer would only make deleting the job hang while no operator serves its namespace)."""

    name: str
    uid: str
    finalizer: str
    kind: str = builders.KIND


Action = Create | Delete | PutRecords | DeleteJob | DropFinalizer


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
class Restart:
    """A restart the plan decided: the failure and whether it counts. The plan's status already holds it
    (restartCount, restartHistory, the rank's slot marked Replacing with the uid of the pod it replaces), and
    that status is written before any action: an operator that dies before the pod's delete goes through finds
    the decision in the status and finishes it, and never decides (or counts) it again."""

    failure: policy.Failure
    generation: int
    counted: bool
    why: str
    pod_uid: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    status: dict[str, Any]
    restarts: tuple[Restart, ...] = ()
    events: tuple[Event, ...] = ()
    wake_after: float | None = None  # seconds until a time-based decision is due (backoff, windows, TTL)
    recovered_after: float | None = None  # seconds from the last restart to every rank healthy again


@dataclasses.dataclass(frozen=True)
class Settled:
    """What one pass ends with: the status to write, the events to post, and `error` when the pass fell
    short; `retryable` says whether trying again (with backoff) can help or only a spec edit can."""

    status: dict[str, Any]
    events: list[Event]
    error: str | None = None
    retryable: bool = True
    wake_after: float | None = None


@dataclasses.dataclass(frozen=True)
class Membership:
    """The pod generation the job's pods belong to and its world size (WORLD_SIZE in every pod)."""

    generation: int
    world_size: int


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


def next_membership(spec: Mapping[str, Any], status: Mapping[str, Any], *, group_restart: bool = False) -> Membership:
    """The generation the job's pods must carry now, and its world size.

    A generation's world size never changes: every pod of generation g was started with the same
    WORLD_SIZE, so a pod is never created (or kept) with another size under the same generation. When
    the size the spec asks for differs from the current generation's (maxNodes edited, suspend, resume),
    or the whole group restarts (quorum lost with actionOnLoss RestartGroup), the next generation starts and
    the pods of the old one are replaced. A single rank's restart keeps the generation: its replacement has
    the same size. (Inside the pods the agents number their own membership generations; rank 0 reports
    theirs in status.rendezvous.)
    """
    world_size = 0 if spec.get("suspend", False) else int(spec["elastic"]["maxNodes"])
    generation = int(status.get("membershipGeneration") or 0)
    if generation == 0:
        return Membership(1, world_size)
    current = int(status.get("worldSize") or 0)
    if current == world_size and not group_restart:
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


# ---- one pass --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Pass:
    """What one plan() works out, slot by slot, before the phase is decided."""

    actions: list[Action] = dataclasses.field(default_factory=list)
    restarts: list[Restart] = dataclasses.field(default_factory=list)
    ranks: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    healthy: int = 0
    succeeded: int = 0
    replacing: list[int] = dataclasses.field(default_factory=list)
    missing: list[int] = dataclasses.field(default_factory=list)  # slots to create a pod for now
    waiting: list[int] = dataclasses.field(default_factory=list)  # slots whose name an older pod still holds
    live_phases: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # slots this pass restarts
    fail_job: str | None = None  # an exit-code rule said FailJob: the message
    wake: list[float] = dataclasses.field(default_factory=list)
    put: dict[str, Mapping[str, Any] | None] = dataclasses.field(default_factory=dict)


def _last_restart_at(status: Mapping[str, Any]) -> datetime.datetime | None:
    history = status.get("restartHistory") or []
    return parse_time(history[-1].get("time")) if history else None


def _lost_failure(rank: int, name: str, pod: ObservedPod | None, node: ObservedNode | None) -> policy.Failure:
    """Why a rank's pod left without the operator deleting it (`pod`: its last sight of it, if any)."""
    if pod is not None and pod.reason == "Evicted":
        return policy.Failure(rank, name, policy.EVICTED, _evicted(pod), disruption=pod.disruption)
    if node is not None and not node.ready:
        return policy.Failure(rank, name, policy.NODE_NOT_READY, f"was on node {node.name}, which is NotReady")
    return policy.Failure(rank, name, policy.POD_DELETED, "was deleted")


def _evicted(pod: ObservedPod) -> str:
    return "was evicted" + (f" ({pod.disruption})" if pod.disruption else "")


def _pod_failure(
    rank: int, pod: ObservedPod, node: ObservedNode | None, hung: job_object.HungRank | None
) -> policy.Failure | None:
    """Why this rank's live pod must be replaced, if it must."""
    if pod.phase == "Failed":
        if pod.reason == "Evicted":
            return policy.Failure(rank, pod.name, policy.EVICTED, _evicted(pod), pod.exit_code, pod.disruption)
        how = "failed" + (f" ({pod.reason})" if pod.reason else "")
        return policy.Failure(rank, pod.name, policy.POD_FAILED, how, pod.exit_code)
    if pod.phase == "Succeeded":
        return None
    if node is not None and not node.ready:
        return policy.Failure(rank, pod.name, policy.NODE_NOT_READY, f"is on node {node.name}, which is NotReady")
    if hung is not None and pod.phase == "Running" and _is_current_report(hung, pod):  # not one still starting
        return policy.Failure(
            rank, pod.name, policy.HANG,
            f"was absent from its job's generations for {hung.silent_seconds:.0f}s (reported by {hung.reported_by})",
        )
    return None


def _slots(
    job: Job,
    membership: Membership,
    pods: Sequence[ObservedPod],
    nodes: Mapping[str, ObservedNode],
    rendezvous: ObservedObject | None,
    now: datetime.datetime,
) -> _Pass:
    """Walk every rank slot of the current generation: what it holds, what to do about it.

    A slot's entry in status.ranks is its durable record: the uid of the pod in it and its phase, and
    `Replacing` (with the uid of the pod being replaced) once a restart was decided. So a restart is decided
    once per pod whatever happens later (the pod still seen by a late watch, the operator restarted between
    the decision and the delete), independent of how much of restartHistory is kept; and a rank that
    Succeeded stays done when its pod is deleted afterwards.
    """
    spec, previous = job.spec, job.status
    work = _Pass()
    mine = [p for p in pods if p.controller_uid == job.uid]
    same_generation = int(previous.get("membershipGeneration") or 0) == membership.generation
    before = {int(r["rank"]): r for r in previous.get("ranks") or []} if same_generation else {}
    hung = {h.pod: h for h in (rendezvous.view.hung if rendezvous else ())}
    window = policy.terminating_timeout_seconds(spec)

    for pod in mine:  # a pod stuck Terminating past the window is force-deleted, whatever its slot
        if not pod.terminating:
            continue
        node = nodes.get(pod.node or "")
        since = [t for t in (pod.deleted_at, node.since if node and not node.ready else None) if t]
        due = min(since) + datetime.timedelta(seconds=window) if since else None
        if due is not None and now >= due:
            work.actions.append(Delete("Pod", pod.name, job.uid, pod.uid or None, force=True))
        elif due is not None:
            work.wake.append((due - now).total_seconds())

    for rank in range(membership.world_size):
        name = builders.pod_name(job.name, rank)
        holders = [p for p in mine if p.name == name]
        live = next(
            (p for p in holders if not p.terminating and p.generation == membership.generation), None
        )
        known = before.get(rank) or {}
        known_uid = str(known.get("uid") or "")
        entry: dict[str, Any] = {"rank": rank, "pod": name}

        if known.get("phase") == "Succeeded" and (live is None or live.uid == known_uid):
            work.ranks[rank] = dict(known)  # done; its pod may be gone (cleaned up): it is not run again
            work.succeeded += 1
            continue
        restarted = known.get("phase") == "Replacing"
        if live is not None and restarted and live.uid == known_uid:
            # Restarted already (by this operator or its predecessor): delete it until the delete is seen.
            work.actions.append(Delete("Pod", live.name, job.uid, live.uid or None))
            work.ranks[rank] = dict(known)
            work.replacing.append(rank)
            continue
        if live is None:
            if known_uid and not restarted:  # it left without the operator deleting it
                node = nodes.get(str(known.get("node") or ""))
                lost = next((p for p in holders if p.uid == known_uid), None)
                _restart(work, spec, membership, _lost_failure(rank, name, lost, node), known_uid, None)
                restarted = True
            entry |= {"phase": "Replacing" if restarted else "Pending", "ready": False}
            if restarted:
                entry["uid"] = known_uid
                work.replacing.append(rank)
            (work.waiting if holders else work.missing).append(rank)  # an older pod may still hold the name
            work.ranks[rank] = entry
            continue

        entry |= _rank_status(live)
        failure = _pod_failure(rank, live, nodes.get(live.node or ""), hung.get(live.name))
        if failure is None:
            if live.phase == "Succeeded":
                work.succeeded += 1
            elif live.phase == "Running" and live.ready:
                work.healthy += 1
            work.ranks[rank] = entry
            continue
        verdict = policy.verdict(spec, failure)
        if verdict.action == policy.FAIL_JOB:
            work.fail_job = f"{policy.describe(failure)}, and {verdict.why} ends the job"
            work.ranks[rank] = entry
            continue
        work.live_phases[rank] = entry
        _restart(work, spec, membership, failure, live.uid, Delete("Pod", live.name, job.uid, live.uid or None))
        work.ranks[rank] = {**entry, "phase": "Replacing", "ready": False}
        work.replacing.append(rank)

    for record in hung.values():  # every hung report is acted on (above) or stale: it goes either way
        work.put[job_object.hung_key(record.pod)] = None
    return work


def _restart(
    work: _Pass, spec: Mapping[str, Any], membership: Membership, failure: policy.Failure, pod_uid: str,
    delete: Delete | None,
) -> None:
    verdict = policy.verdict(spec, failure)
    work.restarts.append(Restart(failure, membership.generation, verdict.counted, verdict.why, pod_uid))
    if delete is not None:
        work.actions.append(delete)


def _is_current_report(report: job_object.HungRank, pod: ObservedPod) -> bool:
    """A hang report names a pod by name; it is about this pod only if the absence it reports began after
    this pod was created (a report about its predecessor must never replace a pod that is still starting)."""
    reported = parse_time(report.reported_at)
    if reported is None:
        return False
    began = reported - datetime.timedelta(seconds=report.silent_seconds)
    return pod.created_at is None or began >= pod.created_at


def _quorum_judgement(
    job: Job, membership: Membership, work: _Pass, rule: policy.QuorumRule
) -> tuple[int, bool, bool]:
    """(healthy percent, met, lost). Quorum is lost only once the current pod generation has had it: a
    new generation (a resize, a group restart, a resume) starts without quorum, and that is no loss."""
    desired = membership.world_size
    percent, met = rule.judge(work.healthy + work.succeeded, desired)  # a rank that finished is not lost
    previous = job.status
    same_generation = int(previous.get("membershipGeneration") or 0) == membership.generation
    had = same_generation and (
        (find_condition(previous, "QuorumMet") or {}).get("status") == "True" or previous.get("phase") == "Paused"
    )
    return percent, met, had and not met and desired > 0


def _restart_streak(job: Job, now: datetime.datetime) -> int:
    """Restarts in a row so far: reset once the job has run Ready for policy.backoff_reset_seconds."""
    previous = job.status
    ready = find_condition(previous, "Ready") or {}
    since = parse_time(ready.get("lastTransitionTime"))
    healthy_for = (now - since).total_seconds() if ready.get("status") == "True" and since else 0.0
    if healthy_for >= policy.backoff_reset_seconds(job.spec):
        return 0
    return int(previous.get("restartStreak") or 0)


def _suspended_seconds(job: Job, suspended: bool, now: datetime.datetime) -> int:
    """Seconds the job has spent suspended since it started: activeDeadlineSeconds counts only running time.
    Added up when a suspension ends (the Suspended condition says since when)."""
    total = int(job.status.get("suspendedSeconds") or 0)
    was = find_condition(job.status, "Suspended") or {}
    since = parse_time(was.get("lastTransitionTime"))
    if not suspended and was.get("status") == "True" and since and job.status.get("startTime"):
        total += max(0, int((now - since).total_seconds()))
    return total


def plan(
    job: Job,
    pods: Sequence[ObservedPod],
    *,
    now: datetime.datetime,
    heartbeat_key: bytes,
    nodes: Mapping[str, ObservedNode] | None = None,
    rendezvous: ObservedObject | None = None,
) -> Plan:
    """Decide what to create, delete or write and what status to report for one job."""
    previous = job.status
    legacy = [DropFinalizer(job.name, job.uid, f) for f in job.finalizers if f == LEGACY_FINALIZER]
    if _is_terminal(previous):
        finished = _plan_finished(job, pods, now)
        return dataclasses.replace(finished, actions=(*legacy, *finished.actions))
    spec = job.spec
    nodes = nodes or {}
    suspended = bool(spec.get("suspend", False))
    membership = next_membership(spec, previous)
    rule = policy.quorum_rule(spec)
    work = _slots(job, membership, pods, nodes, rendezvous, now)
    restart_count = int(previous.get("restartCount") or 0)
    budget = policy.max_restarts(spec)
    events: list[Event] = []

    healthy_percent, quorum_met, quorum_lost = _quorum_judgement(job, membership, work, rule)
    failed_reason: str | None = None
    failed_message = ""
    if quorum_lost and (find_condition(previous, "QuorumMet") or {}).get("status") == "True":
        events.append(Event("Warning", REASON_QUORUM_LOST, rule.describe(work.healthy, membership.world_size)
                            + f"; actionOnLoss is {rule.action_on_loss}"))
    if quorum_lost and rule.action_on_loss == "RestartGroup" and not suspended and work.fail_job is None:
        group = policy.Failure(-1, "", policy.QUORUM_LOST, rule.describe(work.healthy, membership.world_size))
        if restart_count + 1 > budget:
            failed_reason, failed_message = REASON_BUDGET_EXHAUSTED, _budget_message(budget, [group])
        else:
            membership = next_membership(spec, previous, group_restart=True)
            work = _slots(job, membership, pods, nodes, rendezvous, now)
            work.restarts = [Restart(group, membership.generation - 1, True, "quorum.actionOnLoss RestartGroup")]
            quorum_lost = False
            healthy_percent, quorum_met = rule.judge(0, membership.world_size)
    elif quorum_lost and rule.action_on_loss == "Fail" and not suspended:
        failed_reason = REASON_QUORUM_LOST
        failed_message = rule.describe(work.healthy, membership.world_size) + " and quorum.actionOnLoss is Fail"

    counted = sum(1 for r in work.restarts if r.counted)
    if work.fail_job is not None:
        failed_reason, failed_message = REASON_EXIT_CODE_RULE, work.fail_job
    elif failed_reason is None and counted and restart_count + counted > budget:
        failed_reason = REASON_BUDGET_EXHAUSTED
        failed_message = _budget_message(budget, [r.failure for r in work.restarts if r.counted])
    suspended_seconds = _suspended_seconds(job, suspended, now)
    deadline = spec.get("activeDeadlineSeconds")
    started = parse_time(previous.get("startTime"))
    if failed_reason is None and deadline and started is not None and not suspended:
        due = started + datetime.timedelta(seconds=int(deadline) + suspended_seconds)
        if now >= due:
            failed_reason = REASON_DEADLINE
            failed_message = (f"the job ran longer than spec.activeDeadlineSeconds ({deadline}s since "
                              f"{timestamp(started)}, not counting {suspended_seconds}s suspended)")
        else:
            work.wake.append((due - now).total_seconds())

    live = [p for p in pods if not p.terminating and p.controller_uid == job.uid]
    stale = [p for p in sorted(live, key=lambda p: (p.rank, p.name))
             if p.generation != membership.generation or p.rank >= membership.world_size]
    actions: list[Action] = [*legacy, *(Delete("Pod", p.name, job.uid, p.uid or None) for p in stale)]
    if failed_reason is not None:  # nothing more starts; the ranks still running stop
        work.restarts, work.missing = [], []
        work.ranks.update(work.live_phases)
        actions += [Delete("Pod", p.name, job.uid, p.uid or None) for p in live if p.phase in ACTIVE_POD_PHASES]
    else:
        actions += work.actions
    counted = sum(1 for r in work.restarts if r.counted)

    # Every replacement waits, counted or not (a kubelet's CrashLoopBackOff): restartDelay for the n-th
    # restart in a row, from the last one.
    streak = _restart_streak(job, now) + (1 if work.restarts else 0)
    last_restart = now if work.restarts else _last_restart_at(previous)
    invalid = _rejected_spec(job) or builders.spec_problem(spec)
    resources: list[Action] = []
    new_pods: list[Action] = []
    creatable = list(work.missing)
    if creatable and streak and last_restart is not None:
        ready_at = last_restart + datetime.timedelta(seconds=policy.restart_delay_seconds(spec, streak))
        if now < ready_at:
            work.wake.append((ready_at - now).total_seconds())
            creatable = []
    if creatable and invalid is None:
        try:
            new_pods = [
                Create(builders.build_pod(job.name, job.namespace, job.uid, spec, rank, membership.world_size,
                                          membership.generation))
                for rank in creatable
            ]
        except JobSpecError as exc:
            invalid, new_pods = str(exc), []
        else:
            # Everything the pods need goes first: they mount the Secret, resolve rank 0 through the Service
            # and run as the job's ServiceAccount. Creating these whenever a pod is missing repairs them too.
            resources = [
                Create(builders.build_service(job.name, job.namespace, job.uid, spec)),
                Create(builders.build_secret(job.name, job.namespace, job.uid, heartbeat_key)),
                Create(builders.build_service_account(job.name, job.namespace, job.uid)),
                Create(builders.build_role(job.name, job.namespace, job.uid)),
                Create(builders.build_role_binding(job.name, job.namespace, job.uid)),
            ]

    desired = membership.world_size
    finished = desired > 0 and work.succeeded == desired
    recovering = bool(work.replacing) or (previous.get("phase") == "Restarting" and work.healthy < desired)
    quorum_text = rule.describe(work.healthy, desired)
    if invalid is not None:
        phase, ready_reason, ready_message = "Failed", REASON_INVALID_SPEC, invalid
    elif suspended:
        phase, ready_reason, ready_message = "Suspended", "Suspended", "spec.suspend is true: no pods run"
    elif failed_reason is not None:
        phase, ready_reason, ready_message = "Failed", failed_reason, failed_message
    elif finished:
        phase, ready_reason, ready_message = "Succeeded", "Succeeded", "every rank exited successfully"
    elif quorum_lost and rule.action_on_loss == "Pause":
        phase, ready_reason, ready_message = (
            "Paused", REASON_QUORUM_LOST, quorum_text + ": training is paused until it returns",
        )
    elif recovering:
        phase, ready_reason, ready_message = (
            "Restarting", "Restarting", f"replacing the pods of ranks {describe_ranks(work.replacing)}"
            if work.replacing else f"{work.healthy} of {desired} nodes ready after a restart",
        )
    elif work.missing or work.waiting:
        phase, ready_reason, ready_message = (
            "Creating", "CreatingPods", f"creating pods for ranks {describe_ranks(work.missing + work.waiting)}"
        )
    elif quorum_met:
        phase, ready_reason, ready_message = "Running", "Running", f"{work.healthy} of {desired} nodes ready"
    else:
        phase, ready_reason, ready_message = (
            "Pending", "WaitingForPods", f"{work.healthy} of {desired} nodes ready, quorum needs {rule.needed(desired)}",
        )
    if previous.get("phase") == "Paused" and phase == "Running":
        events.append(Event("Normal", "QuorumRestored", quorum_text))
    recovered_after = None
    if previous.get("phase") in ("Restarting", "Paused") and phase == "Running" and last_restart is not None:
        recovered_after = max(0.0, (now - last_restart).total_seconds())

    status: dict[str, Any] = {
        "membershipGeneration": membership.generation,
        "worldSize": desired,
        "desiredNodes": desired,
        "readyNodes": work.healthy,
        "readyDesired": f"{work.healthy}/{desired}",
        "restartCount": restart_count + counted,
        "ranks": [work.ranks[r] for r in sorted(work.ranks)],
    }
    history = [*(previous.get("restartHistory") or []), *(restart_entry(r, now) for r in work.restarts)]
    if history:
        status["restartHistory"] = history[-MAX_HISTORY:]
    if streak:
        status["restartStreak"] = streak
    if suspended_seconds:
        status["suspendedSeconds"] = suspended_seconds
    status["quorum"] = {"healthyPercent": healthy_percent, "met": quorum_met}
    status.update(_reported(previous, rendezvous, events))
    conditions_before = previous.get("conditions") or []
    status["conditions"] = [
        condition(
            conditions_before,
            "QuorumMet",
            quorum_met,
            "QuorumMet" if quorum_met else "NotEnoughHealthyNodes",
            quorum_text,
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

    # The agents' side: the control record (pause, node bounds) and hang reports that were handled.
    control = builders.control_record(
        spec, paused=phase == "Paused", reason=ready_message if phase == "Paused" else "",
        pod_generation=membership.generation,
    )
    object_name = job_object.object_name(job.name)
    if rendezvous is None:
        resources.append(Create(builders.build_rendezvous_object(job.name, job.namespace, job.uid, control)))
    elif rendezvous.controller_uid == job.uid:
        if rendezvous.view.control != control:
            work.put[job_object.CONTROL_KEY] = job_object.control_to_json(control)
        if work.put and failed_reason is None:
            actions.append(PutRecords(object_name, job.uid, tuple(sorted(work.put.items()))))
    if invalid is not None:
        resources, new_pods = [], []
    final = _with_phase(job, status, phase, ready_reason, ready_message, now)
    ttl = _ttl_wake(spec, final, now)
    if ttl is not None:
        work.wake.append(ttl)
    events += _restart_events(work.restarts, restart_count, budget)
    return Plan(
        (*actions, *resources, *new_pods),
        final,
        tuple(work.restarts),
        tuple(events),
        min(work.wake) if work.wake else None,
        recovered_after,
    )


def _restart_events(restarts: Sequence[Restart], count: int, budget: int) -> list[Event]:
    events = []
    for restart in restarts:
        count += 1 if restart.counted else 0
        numbered = f"restart {count} of {budget}" if restart.counted else "not counted"
        what = policy.describe(restart.failure) if restart.failure.rank >= 0 else restart.failure.message
        replaced = "its pod is replaced" if restart.failure.rank >= 0 else "every rank's pod is replaced"
        events.append(Event("Warning", restart.failure.reason, f"{numbered}: {what}; {replaced}"))
    return events


def _plan_finished(job: Job, pods: Sequence[ObservedPod], now: datetime.datetime) -> Plan:
    """A job that has succeeded or failed: stop what still runs, and delete the job once its
    ttlSecondsAfterFinished has passed."""
    actions: list[Action] = [
        Delete("Pod", p.name, job.uid, p.uid or None)
        for p in sorted(pods, key=lambda p: p.name)
        if p.controller_uid == job.uid and not p.terminating and p.phase in ACTIVE_POD_PHASES
    ]
    wake = _ttl_wake(job.spec, job.status, now)
    if wake == 0.0:
        actions.append(DeleteJob(job.name, job.uid))
        wake = None
    return Plan(tuple(actions), {}, wake_after=wake)


def _ttl_wake(spec: Mapping[str, Any], status: Mapping[str, Any], now: datetime.datetime) -> float | None:
    """Seconds until a finished job's TTL runs out (0.0: it has); None without a TTL."""
    ttl = spec.get("ttlSecondsAfterFinished")
    finished = parse_time(status.get("completionTime"))
    if ttl is None or finished is None:
        return None
    return max(0.0, (finished + datetime.timedelta(seconds=int(ttl)) - now).total_seconds())


def _budget_message(budget: int, failures: Sequence[policy.Failure], limit: int = 8) -> str:
    """Why the budget ran out, bounded: the first `limit` failures in words, then how many more (a thousand
    ranks failing at once must still fit the status)."""
    words = [policy.describe(f) if f.rank >= 0 else f"quorum was lost ({f.message})" for f in failures[:limit]]
    if len(failures) > limit:
        more = [f.rank for f in failures[limit:] if f.rank >= 0]
        words.append(f"and {len(failures) - limit} more (ranks {describe_ranks(more)})")
    return clip(f"{'; '.join(words)}; the restart budget (failurePolicy.maxRestarts {budget}) is used up, "
                "so the job has failed")


def _checkpoint_status(ref: job_object.CheckpointRef | None) -> dict[str, Any] | None:
    return None if ref is None else {"step": ref.step, "location": ref.location, "time": ref.time}


def _reported(
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


def _rank_status(pod: ObservedPod) -> dict[str, Any]:
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


def settle(job: Job, plan: Plan, outcome: Outcome, *, now: datetime.datetime) -> Settled:
    """The status, events and retry decision once the plan's actions were tried (k8s.apply's outcome).

    The plan's decisions (restarts and their counts, phases) are already in its status, written before the
    actions; settle adds only what the API server said. A spec it rejects (400/422) fails the job with
    InvalidSpec until the spec is edited; any other refusal (403 quota or RBAC, a name held by someone else,
    5xx) is reported in the ResourceFailure condition and retried with backoff (a refused delete of a restarted
    pod is sent again on the next pass, never counted again). Events go out when something changes, not on
    every retry.
    """
    if not plan.status:  # a finished job: only its cleanup (and TTL) was tried
        return Settled({}, [], wake_after=plan.wake_after)
    refused = outcome.refused
    status = dict(plan.status)
    events = list(plan.events)
    if refused is None:
        events += events_for(outcome.done, job.status.get("phase"), status, job.status)
        return Settled(status, events, wake_after=plan.wake_after)
    error = describe_refusal(refused)
    if refused.code in SPEC_REJECTED_CODES and isinstance(refused.action, Create):
        status = _with_phase(job, status, "Failed", REASON_INVALID_SPEC, error, now)
        events += events_for(outcome.done, job.status.get("phase"), status, job.status)
        return Settled(status, events, error, False)
    reason = _refusal_reason(refused)
    before = job.status.get("conditions") or []
    failure = condition(before, CONDITION_RESOURCE_FAILURE, True, reason, error, job.generation, now)
    status["conditions"] = [*status["conditions"], failure]
    events += events_for(outcome.done, job.status.get("phase"), status, job.status)
    known = find_condition(job.status, CONDITION_RESOURCE_FAILURE) or {}
    if (known.get("reason"), known.get("message")) != (reason, failure["message"]):  # once per new problem
        events.append(Event("Warning", reason, error))
    return Settled(status, events, error, True, plan.wake_after)


def describe_refusal(refused: Refusal) -> str:
    what = f'{refused.action.kind} "{refused.action.name}"'
    if refused.name_in_use:
        holder = f"its controller is {refused.holder}" if refused.holder else "it has no controller"
        return (
            f"{what} already exists and is not controlled by this job ({holder}); the job won't take it over "
            f"or delete it: rename the job or remove that {refused.action.kind}"
        )
    verb = {Create: "create", PutRecords: "update", DropFinalizer: "update"}.get(type(refused.action), "delete")
    return clip(f"the API server refused to {verb} {what} ({refused.code}): {refused.message}")


def _refusal_reason(refused: Refusal) -> str:
    if refused.name_in_use:
        return REASON_NAME_IN_USE
    if isinstance(refused.action, (PutRecords, DropFinalizer)):
        return "FailedUpdate"
    return REASON_FAILED_CREATE if isinstance(refused.action, Create) else REASON_FAILED_DELETE


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
    deleted_pods = sorted(a.name for a in done if isinstance(a, Delete) and a.kind == "Pod" and not a.force)
    forced = sorted(a.name for a in done if isinstance(a, Delete) and a.kind == "Pod" and a.force)
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
                f"created pods for ranks {describe_ranks(created_ranks)} (membership generation "
                f"{status.get('membershipGeneration')}, world size {status.get('worldSize')})",
            )
        )
    if deleted_pods:
        reason = "Suspended" if phase == "Suspended" else "DeletedPods"
        events.append(Event("Normal", reason, clip(f"deleted pods {deleted_pods}", 1024)))
    if forced:
        events.append(Event(
            "Warning", "ForceDeletedPods",
            clip(f"force-deleted pods {forced}: stuck Terminating past failurePolicy.terminatingPodTimeoutSeconds",
                 1024),
        ))
    if phase and phase != previous_phase:
        ready = find_condition(status, "Ready")
        detail = f": {ready['message']}" if ready else ""
        failed = phase == "Failed"
        reason = str(ready["reason"]) if failed and ready else "PhaseChanged"
        events.append(
            Event("Warning" if failed else "Normal", reason, f"{previous_phase or 'New'} -> {phase}{detail}")
        )
    return events
