"""One pass over the rank slots of the current pod generation: what each slot holds (a live pod, a pod being
replaced, nothing) and what to do about it (restart, force-delete, create).

Why apart: this is the per-rank half of a plan, the one that reads status.ranks as the durable record of each
slot; plan() then decides the job's phase from what it found.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from SneppX_ALG.contract import job_object
from sneppx_operator import builders, policy
from sneppx_operator.reconcile.actions import Action, Delete
from sneppx_operator.reconcile.decisions import Membership, Restart
from sneppx_operator.reconcile.observe import Job, ObservedNode, ObservedObject, ObservedPod, parse_time
from sneppx_operator.reconcile.status import rank_status


@dataclasses.dataclass
class Pass:
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


def _lost_failure(
    rank: int, name: str, pod: ObservedPod | None, node_name: str, nodes: Mapping[str, ObservedNode]
) -> policy.RankLoss:
    """Why a rank's pod left without the operator deleting it (`pod`: its last sight of it, if any).

    Judged first by what outlasts the pod, its node, so that one disruption reads the same whether the pass
    still sees the pod Terminating or finds it gone: a NotReady node is the cause whatever the pod's condition
    says (the taint manager's and the pod garbage collector's deletions follow from it); a pod gone from a
    cordoned node was taken for the node's maintenance (a drain, whose evictions may come and go between two
    passes); a pod whose node is gone was collected with it (the pod garbage collector force-deletes, grace 0,
    reason DeletionByPodGC, so a pass rarely sees the pod again). A node index that lists no node at all knows
    nothing yet."""
    node = nodes.get(node_name)
    if node is not None and not node.ready:
        return policy.RankLoss(rank, name, policy.NODE_NOT_READY, f"was on node {node_name}, which is NotReady")
    if node is not None and node.cordoned:
        return policy.RankLoss(rank, name, policy.EVICTED, f"was on node {node_name}, which is cordoned (a drain)",
                               disruption=policy.NODE_DRAINED)
    if pod is not None and pod.reason == "Evicted":
        return policy.RankLoss(rank, name, policy.EVICTED, _evicted(pod), disruption=pod.disruption)
    if node_name and nodes and node is None:
        return policy.RankLoss(rank, name, policy.EVICTED, f"was on node {node_name}, which is gone ({policy.POD_GC})",
                               disruption=policy.POD_GC)
    return policy.RankLoss(rank, name, policy.POD_DELETED, "was deleted")


def _evicted(pod: ObservedPod) -> str:
    return "was evicted" + (f" ({pod.disruption})" if pod.disruption else "")


def _pod_failure(
    rank: int, pod: ObservedPod, node: ObservedNode | None, hung: job_object.HungRank | None
) -> policy.RankLoss | None:
    """Why this rank's live pod must be replaced, if it must."""
    if pod.phase == "Failed":
        if pod.reason == "Evicted":
            return policy.RankLoss(rank, pod.name, policy.EVICTED, _evicted(pod), pod.exit_code, pod.disruption)
        how = "failed" + (f" ({pod.reason})" if pod.reason else "")
        return policy.RankLoss(rank, pod.name, policy.POD_FAILED, how, pod.exit_code)
    if pod.phase == "Succeeded":
        return None
    if node is not None and not node.ready:
        return policy.RankLoss(rank, pod.name, policy.NODE_NOT_READY, f"is on node {node.name}, which is NotReady")
    if hung is not None and pod.phase == "Running" and _is_current_report(hung, pod):  # not one still starting
        return policy.RankLoss(
            rank, pod.name, policy.HANG,
            f"was absent from its job's generations for {hung.silent_seconds:.0f}s (reported by {hung.reported_by})",
        )
    return None


def walk_slots(
    job: Job,
    membership: Membership,
    pods: Sequence[ObservedPod],
    nodes: Mapping[str, ObservedNode],
    rendezvous: ObservedObject | None,
    now: datetime.datetime,
) -> Pass:
    """Walk every rank slot of the current generation: what it holds, what to do about it.

    A slot's entry in status.ranks is its durable record: the uid of the pod in it and its phase, and
    `Replacing` (with the uid of the pod being replaced) once a restart was decided. So a restart is decided
    once per pod whatever happens later (the pod still seen by a late watch, the operator restarted between
    the decision and the delete), independent of how much of restartHistory is kept; and a rank that
    Succeeded stays done when its pod is deleted afterwards.
    """
    spec, previous = job.spec, job.status
    work = Pass()
    mine = [p for p in pods if p.controller_uid == job.uid]
    same_generation = int(previous.get("membershipGeneration") or 0) == membership.generation
    before = {int(r["rank"]): r for r in previous.get("ranks") or []} if same_generation else {}
    hung = {h.pod: h for h in (rendezvous.view.hung if rendezvous else ())}
    window = policy.terminating_timeout_seconds(spec)
    # Pods reported hung that this pass can't judge (its view lags their start: not there, or still Pending):
    # their reports stay for a pass that sees them. A report goes once acted on or stale (about an older pod).
    starting: set[str] = set()

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
                lost = next((p for p in holders if p.uid == known_uid), None)
                node_name = str(known.get("node") or (lost.node if lost else "") or "")
                _restart(work, spec, membership, _lost_failure(rank, name, lost, node_name, nodes), known_uid, None)
                restarted = True
            entry |= {"phase": "Replacing" if restarted else "Pending", "ready": False}
            if restarted:
                entry["uid"] = known_uid
                work.replacing.append(rank)
            (work.waiting if holders else work.missing).append(rank)  # an older pod may still hold the name
            work.ranks[rank] = entry
            if name in hung:  # about a pod this pass's view does not hold yet: judged when a pass sees it
                starting.add(name)
            continue

        entry |= rank_status(live)
        report = hung.get(live.name)
        if report is not None and live.phase == "Pending" and _is_current_report(report, live):
            starting.add(live.name)  # a view that lags its start: the pod may be Running (and hung) by now
        failure = _pod_failure(rank, live, nodes.get(live.node or ""), report)
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

    for record in hung.values():
        if record.pod not in starting:
            work.put[job_object.hung_key(record.pod)] = None
    return work


def _restart(
    work: Pass, spec: Mapping[str, Any], membership: Membership, failure: policy.RankLoss, pod_uid: str,
    delete: Delete | None,
) -> None:
    verdict = policy.verdict(spec, failure)
    work.restarts.append(Restart(failure, membership.generation, verdict.counted, verdict.why, pod_uid))
    if delete is not None:
        work.actions.append(delete)


def _is_current_report(report: job_object.HungRank, pod: ObservedPod) -> bool:
    """A hang report names a pod by name; it is about this pod only if the absence it reports began after
    this pod's trainer started (or, not known yet, after the pod was created): a report about its predecessor,
    or written while this pod was still Pending (scheduled, pulling its image), must never replace it."""
    reported = parse_time(report.reported_at)
    if reported is None:
        return False
    began = reported - datetime.timedelta(seconds=report.silent_seconds)
    since = pod.started_at or pod.created_at
    return since is None or began >= since
