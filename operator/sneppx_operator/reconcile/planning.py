"""plan(): one job's observation -> the actions to take and the status that records every decision.

Why apart: this is the decision itself (membership, quorum, the restart budget, the deadline, the phase),
pure, so every rule is tested without a cluster. The module is not named plan.py so that
`sneppx_operator.reconcile.plan` stays the function.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from SneppX_ALG.storage import job_object
from sneppx_operator import builders, policy
from sneppx_operator.errors import JobSpecError
from sneppx_operator.reconcile.actions import Action, Create, Delete, DeleteJob, DropFinalizer, PutRecords
from sneppx_operator.reconcile.decisions import Event, Membership, Plan, Restart
from sneppx_operator.reconcile.events import restart_events
from sneppx_operator.reconcile.observe import Job, ObservedNode, ObservedObject, ObservedPod, parse_time
from sneppx_operator.reconcile.slots import Pass, walk_slots
from sneppx_operator.reconcile.status import (
    MAX_HISTORY,
    REASON_BUDGET_EXHAUSTED,
    REASON_DEADLINE,
    REASON_EXIT_CODE_RULE,
    REASON_INVALID_SPEC,
    REASON_QUORUM_LOST,
    TERMINAL_PHASES,
    clip,
    condition,
    describe_ranks,
    find_condition,
    reported,
    restart_entry,
    timestamp,
    with_phase,
)

ACTIVE_POD_PHASES = frozenset({"Pending", "Running", "Unknown"})
# Put on jobs by operator versions that deleted a job's objects themselves; taken off by this one.
LEGACY_FINALIZER = "sneppx.io/finalizer"


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


def _last_restart_at(status: Mapping[str, Any]) -> datetime.datetime | None:
    history = status.get("restartHistory") or []
    return parse_time(history[-1].get("time")) if history else None


def _quorum_judgement(
    job: Job, membership: Membership, work: Pass, rule: policy.QuorumRule
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
    work = walk_slots(job, membership, pods, nodes, rendezvous, now)
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
            work = walk_slots(job, membership, pods, nodes, rendezvous, now)
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
    status.update(reported(previous, rendezvous, events))
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
    final = with_phase(job, status, phase, ready_reason, ready_message, now)
    ttl = _ttl_wake(spec, final, now)
    if ttl is not None:
        work.wake.append(ttl)
    events += restart_events(work.restarts, restart_count, budget)
    return Plan(
        (*actions, *resources, *new_pods),
        final,
        tuple(work.restarts),
        tuple(events),
        min(work.wake) if work.wake else None,
        recovered_after,
    )


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
