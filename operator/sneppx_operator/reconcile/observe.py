"""Reading the cluster: the job's body and the pods, nodes and rendezvous object kopf's indexes hold, each
summarised into the few fields a plan decides on, and which of them a pass may trust.

Why apart: this is the only place that knows the shape of the API objects (labels, ownerReferences, container
statuses, conditions); everything after it works on these frozen summaries.

What a pass may trust (docs/OPERATOR.md, "Guarantees"): an object is the job's only when its controller
ownerReference carries the job's uid (and, for the rendezvous object, it has the job's name for it): labels
route watch events, never decisions. And the pods a watch index holds may be older than the status the pass
read with a fresh GET (the index of a replica that just took over lags its predecessor's writes): when they
contradict that status, the pass lists them fresh.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping
from typing import Any

from SneppX_ALG.contract import job_object
from sneppx_operator import builders

# The kubelet's phases of a pod some container of which may still run.
ACTIVE_POD_PHASES = frozenset({"Pending", "Running", "Unknown"})


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
    deleting: bool = False  # metadata.deletionTimestamp is set: the garbage collector is taking it apart

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
            deleting=meta.get("deletionTimestamp") is not None,
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
    started_at: datetime.datetime | None = None  # when its training container last started running
    disruption: str | None = None  # why the cluster is taking it away (its DisruptionTarget condition's reason)
    pod_phase: str = ""  # the kubelet's, where `phase` (the trainer's) differs: a sidecar runs on

    def still_runs(self) -> bool:
        """Whether a container of the pod may still run: the kubelet's phase, not the trainer's. The one rule
        for "is this pod done" as a pod (it holds its node until then); `phase` says whether its rank is done."""
        return (self.pod_phase or self.phase) in ACTIVE_POD_PHASES


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
    phase = pod_phase = str(status.get("phase") or "Pending")
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
        started_at=_training_container_started(spec, status),
        disruption=str(disruption) if disruption is not None else None,
        pod_phase=pod_phase if pod_phase != phase else "",
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


def _training_container_started(spec: Mapping[str, Any], status: Mapping[str, Any]) -> datetime.datetime | None:
    """When the first container (the training agent) started running, while it runs."""
    containers = spec.get("containers") or []
    name = containers[0].get("name") if containers else None
    for container_status in status.get("containerStatuses") or []:
        running = (container_status.get("state") or {}).get("running")
        if container_status.get("name") == name and running:
            return parse_time(running.get("startedAt"))
    return None


@dataclasses.dataclass(frozen=True)
class ObservedNode:
    name: str
    ready: bool
    since: datetime.datetime | None = None  # when its Ready condition last changed
    cordoned: bool = False  # spec.unschedulable: taken out of service (`kubectl drain` cordons first)


def observe_node(name: str, status: Mapping[str, Any], spec: Mapping[str, Any] | None = None) -> ObservedNode:
    """A node is ready while its Ready condition is True (False: the kubelet says so; Unknown: it went silent
    and the node controller noticed)."""
    cordoned = bool((spec or {}).get("unschedulable"))
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None:
        return ObservedNode(name, True, cordoned=cordoned)
    return ObservedNode(name, ready.get("status") == "True", parse_time(ready.get("lastTransitionTime")), cordoned)


@dataclasses.dataclass(frozen=True)
class ObservedObject:
    """The job's rendezvous ConfigMap as the operator sees it."""

    uid: str
    controller_uid: str | None
    view: job_object.View
    name: str = ""


def observe_rendezvous(meta: Mapping[str, Any], data: Mapping[str, str] | None) -> ObservedObject:
    return ObservedObject(
        str(meta.get("uid") or ""), controller_uid(meta), job_object.read_view(data), str(meta.get("name") or "")
    )


def owned_rendezvous(job: Job, found: Iterable[ObservedObject]) -> ObservedObject | None:
    """The job's rendezvous object among those its label names: the one called `<job>-rendezvous` and controlled
    by the job. Anyone who may patch a ConfigMap may set its labels (a job's agent may patch its own object),
    so a label never makes an object the job's."""
    name = job_object.object_name(job.name)
    return next((o for o in found if o.name == name and o.controller_uid == job.uid), None)


LIVE_PHASES = ("Pending", "Running")


def pods_lag_status(job: Job, pods: Iterable[ObservedPod]) -> bool:
    """Whether the pods contradict the status read with them: a rank the status has live (Pending or Running)
    in pod uid U while the pods show no pod of that name with uid U, or show it under another uid. Either the
    pod really went (a fresh list confirms it and the plan restarts the rank) or the pods are older than the
    status (a new leader's watch behind its predecessor's last writes), and planning from them would restart a
    healthy rank that only the watch has not seen yet."""
    uids: dict[str, set[str]] = {}
    for pod in pods:
        uids.setdefault(pod.name, set()).add(pod.uid)
    return any(
        rank.get("phase") in LIVE_PHASES and rank.get("uid") and rank.get("uid") not in uids.get(str(rank.get("pod")), ())
        for rank in job.status.get("ranks") or []
        if isinstance(rank, Mapping)
    )
