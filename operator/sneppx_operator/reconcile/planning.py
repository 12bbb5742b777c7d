"""plan(): one job's observation -> the actions to take and the status that records every decision.

Why apart: this is the decision itself (membership, quorum, the restart budget, the deadline, the phase),
pure, so every rule is tested without a cluster. One concept, plan() and the small decisions it is made of,
hence about 500 lines. The module is not named plan.py so that `sneppx_operator.reconcile.plan` stays the
function.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from SneppX_ALG.contract import job_object
from sneppx_operator import builders, defaults, policy
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
    snapshot_conditions,
    timestamp,
    with_phase,
)

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
    world_size = 0 if defaults.field(spec, "suspend") else int(spec["elastic"]["maxNodes"])
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


@dataclasses.dataclass(frozen=True)
class _Quorum:
    healthy_percent: int
    met: bool
    lost: bool


def _quorum_judgement(job: Job, membership: Membership, work: Pass, rule: policy.QuorumRule) -> _Quorum:
    """Quorum is lost only once the current pod generation has had it: a new generation (a resize, a group
    restart, a resume) starts without quorum, and that is no loss."""
    desired = membership.world_size
    percent, met = rule.judge(work.healthy + work.succeeded, desired)  # a rank that finished is not lost
    previous = job.status
    same_generation = int(previous.get("membershipGeneration") or 0) == membership.generation
    had = same_generation and (
        (find_condition(previous, "QuorumMet") or {}).get("status") == "True" or previous.get("phase") == "Paused"
    )
    return _Quorum(percent, met, had and not met and desired > 0)


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


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What every decision of one plan() reads: the job, what was observed of it, and its spec's rules."""

    job: Job
    pods: Sequence[ObservedPod]
    nodes: Mapping[str, ObservedNode]
    rendezvous: ObservedObject | None
    now: datetime.datetime
    suspended: bool
    rule: policy.QuorumRule
    budget: int  # failurePolicy.maxRestarts
    restart_count: int  # restarts counted before this pass

    def walk(self, membership: Membership) -> Pass:
        return walk_slots(self.job, membership, self.pods, self.nodes, self.rendezvous, self.now)


# Why the job fails in this pass: (the Ready condition's reason, its message).
_Failing = tuple[str, str]


def plan(
    job: Job,
    pods: Sequence[ObservedPod],
    *,
    now: datetime.datetime,
    heartbeat_key: bytes,
    nodes: Mapping[str, ObservedNode] | None = None,
    rendezvous: ObservedObject | None = None,
) -> Plan:
    """Decide what to create, delete or write and what status to report for one job.

    Each decision is its own function below, in the order plan() takes them: the slots, quorum, whether the
    job fails (exit-code rule, restart budget, deadline), which pods go and which are created, the phase, the
    status, the rendezvous object's records.
    """
    legacy = [DropFinalizer(job.name, job.uid, f) for f in job.finalizers if f == LEGACY_FINALIZER]
    if job.deleting:  # the garbage collector takes its pods (foreground deletion): nothing is replaced or counted
        return Plan(tuple(legacy), {})
    if _is_terminal(job.status):
        finished = _plan_finished(job, pods, now)
        return dataclasses.replace(finished, actions=(*legacy, *finished.actions))
    spec = job.spec
    given = _Inputs(
        job, pods, nodes or {}, rendezvous, now,
        suspended=bool(defaults.field(spec, "suspend")),
        rule=policy.quorum_rule(spec),
        budget=policy.max_restarts(spec),
        restart_count=int(job.status.get("restartCount") or 0),
    )
    membership = next_membership(spec, job.status)
    work = given.walk(membership)
    quorum = _quorum_judgement(job, membership, work, given.rule)
    events = _quorum_lost_events(given, membership, work, quorum)
    membership, work, quorum, failing = _on_quorum_loss(given, membership, work, quorum)
    failing = _restart_failure(given, work, failing)
    suspended_seconds = _suspended_seconds(job, given.suspended, now)
    if failing is None:
        failing = _deadline_failure(given, suspended_seconds, work.wake)

    actions: list[Action] = [*legacy, *_stale_pod_deletes(given, membership)]
    if failing is not None:  # nothing more starts; the ranks still running stop
        work.restarts, work.missing = [], []
        work.ranks.update(work.live_phases)
        actions += _active_pod_deletes(given)
    else:
        actions += work.actions

    # Every replacement waits, counted or not (a kubelet's CrashLoopBackOff): restartDelay for the n-th
    # restart in a row, from the last one.
    streak = _restart_streak(job, now) + (1 if work.restarts else 0)
    last_restart = now if work.restarts else _last_restart_at(job.status)
    creatable = _creatable_now(given, work, streak, last_restart)
    resources, new_pods, invalid = _creations(
        given, membership, creatable, heartbeat_key, _rejected_spec(job) or builders.spec_problem(spec)
    )

    phase, ready_reason, ready_message = _phase(given, membership, work, quorum, failing, invalid)
    if job.status.get("phase") == "Paused" and phase == "Running":
        events.append(Event("Normal", "QuorumRestored", given.rule.describe(work.healthy, membership.world_size)))
    status = _status(given, membership, work, quorum, streak, suspended_seconds, events)

    # The agents' side: the control record (pause, node bounds) and hang reports that were handled.
    control = builders.control_record(
        spec, paused=phase == "Paused", reason=ready_message if phase == "Paused" else "",
        pod_generation=membership.generation,
    )
    if rendezvous is None:
        resources.append(Create(builders.build_rendezvous_object(job.name, job.namespace, job.uid, control)))
    actions += _rendezvous_puts(given, work, control, failing)
    if invalid is not None:
        resources, new_pods = [], []
    final = with_phase(job, status, phase, ready_reason, ready_message, now)
    ttl = _ttl_wake(spec, final, now)
    if ttl is not None:
        work.wake.append(ttl)
    events += restart_events(work.restarts, given.restart_count, given.budget)
    return Plan(
        (*actions, *resources, *new_pods),
        final,
        tuple(work.restarts),
        tuple(events),
        min(work.wake) if work.wake else None,
        _recovered_after(job, phase, last_restart, now),
    )


def _quorum_lost_events(given: _Inputs, membership: Membership, work: Pass, quorum: _Quorum) -> list[Event]:
    """A warning when quorum is lost by a job that had it (QuorumMet was True)."""
    if not quorum.lost or (find_condition(given.job.status, "QuorumMet") or {}).get("status") != "True":
        return []
    rule = given.rule
    return [Event("Warning", REASON_QUORUM_LOST, rule.describe(work.healthy, membership.world_size)
                  + f"; actionOnLoss is {rule.action_on_loss}")]


def _on_quorum_loss(
    given: _Inputs, membership: Membership, work: Pass, quorum: _Quorum
) -> tuple[Membership, Pass, _Quorum, _Failing | None]:
    """What losing quorum does, by quorum.actionOnLoss (never while suspended): RestartGroup starts the next pod
    generation, a counted restart that fails the job when the budget is used up (and gives way to an exit-code
    rule's FailJob); Fail fails the job; Pause is a phase (see _phase)."""
    rule = given.rule
    if not quorum.lost or given.suspended:
        return membership, work, quorum, None
    if rule.action_on_loss == "RestartGroup" and work.fail_job is None:
        group = policy.RankLoss(-1, "", policy.QUORUM_LOST, rule.describe(work.healthy, membership.world_size))
        counted, why = _group_restart_verdict(work.restarts)
        if counted and given.restart_count + 1 > given.budget:
            return membership, work, quorum, (REASON_BUDGET_EXHAUSTED, _budget_message(given.budget, [group]))
        membership = next_membership(given.job.spec, given.job.status, group_restart=True)
        work = given.walk(membership)
        work.restarts = [Restart(group, membership.generation - 1, counted, why)]
        healthy_percent, met = rule.judge(0, membership.world_size)
        return membership, work, _Quorum(healthy_percent, met, lost=False), None
    if rule.action_on_loss == "Fail":
        message = rule.describe(work.healthy, membership.world_size) + " and quorum.actionOnLoss is Fail"
        return membership, work, quorum, (REASON_QUORUM_LOST, message)
    return membership, work, quorum, None


def _group_restart_verdict(losses: Sequence[Restart]) -> tuple[bool, str]:
    """(counted, why) of the group restart that stands for this pass's losses: it counts, once, when one of
    them counts, or when quorum fell without a loss decided (pods that stopped being ready); losses that
    are none of them counted (an Ignored exit, a drain, a pod collected with its node) leave it uncounted."""
    if losses and not any(r.counted for r in losses):
        whys = sorted({r.why for r in losses})
        more = f" and {len(whys) - 2} more" if len(whys) > 2 else ""
        return False, clip("every loss behind it is uncounted: " + "; ".join(whys[:2]) + more, 512)
    return True, "quorum.actionOnLoss RestartGroup"


def _restart_failure(given: _Inputs, work: Pass, failing: _Failing | None) -> _Failing | None:
    """An exit-code rule's FailJob ends the job whatever else did; otherwise the counted restarts of this pass
    end it when they overrun failurePolicy.maxRestarts."""
    if work.fail_job is not None:
        return REASON_EXIT_CODE_RULE, work.fail_job
    counted = [r.failure for r in work.restarts if r.counted]
    if failing is None and counted and given.restart_count + len(counted) > given.budget:
        return REASON_BUDGET_EXHAUSTED, _budget_message(given.budget, counted)
    return failing


def _deadline_failure(given: _Inputs, suspended_seconds: int, wake: list[float]) -> _Failing | None:
    """spec.activeDeadlineSeconds, counted from startTime without the time spent suspended: the job fails once
    it has passed; until then the plan wakes when it will."""
    job, now = given.job, given.now
    deadline = job.spec.get("activeDeadlineSeconds")
    started = parse_time(job.status.get("startTime"))
    if not deadline or started is None or given.suspended:
        return None
    due = started + datetime.timedelta(seconds=int(deadline) + suspended_seconds)
    if now < due:
        wake.append((due - now).total_seconds())
        return None
    return REASON_DEADLINE, (f"the job ran longer than spec.activeDeadlineSeconds ({deadline}s since "
                             f"{timestamp(started)}, not counting {suspended_seconds}s suspended)")


def _live_pods(given: _Inputs) -> list[ObservedPod]:
    return [p for p in given.pods if not p.terminating and p.controller_uid == given.job.uid]


def _stale_pod_deletes(given: _Inputs, membership: Membership) -> list[Action]:
    """The job's live pods of another pod generation, or of a rank the world size no longer has."""
    stale = [p for p in sorted(_live_pods(given), key=lambda p: (p.rank, p.name))
             if p.generation != membership.generation or p.rank >= membership.world_size]
    return [Delete("Pod", p.name, given.job.uid, p.uid or None) for p in stale]


def _active_pod_deletes(given: _Inputs) -> list[Action]:
    """A failing job stops every pod of its that still runs (or may), a sidecar beside an ended trainer too."""
    return [Delete("Pod", p.name, given.job.uid, p.uid or None) for p in _live_pods(given) if p.still_runs()]


def _creatable_now(
    given: _Inputs, work: Pass, streak: int, last_restart: datetime.datetime | None
) -> list[int]:
    """The missing slots a pod is created for now: none until the restart delay since the last restart has
    passed (the plan wakes then)."""
    creatable = list(work.missing)
    if creatable and streak and last_restart is not None:
        ready_at = last_restart + datetime.timedelta(seconds=policy.restart_delay_seconds(given.job.spec, streak))
        if given.now < ready_at:
            work.wake.append((ready_at - given.now).total_seconds())
            return []
    return creatable


def _creations(
    given: _Inputs, membership: Membership, creatable: Sequence[int], heartbeat_key: bytes, invalid: str | None
) -> tuple[list[Action], list[Action], str | None]:
    """(the objects the pods need, the pods, why the spec is invalid): nothing is created for an invalid spec,
    and a pod the builder can't make from the spec makes it invalid."""
    job = given.job
    if not creatable or invalid is not None:
        return [], [], invalid
    try:
        new_pods: list[Action] = [
            Create(builders.build_pod(job.name, job.namespace, job.uid, job.spec, rank, membership.world_size,
                                      membership.generation))
            for rank in creatable
        ]
    except JobSpecError as exc:
        return [], [], str(exc)
    # Everything the pods need goes first: they mount the Secret, resolve rank 0 through the Service
    # and run as the job's ServiceAccount. Creating these whenever a pod is missing repairs them too.
    resources: list[Action] = [
        Create(builders.build_service(job.name, job.namespace, job.uid, job.spec)),
        Create(builders.build_secret(job.name, job.namespace, job.uid, heartbeat_key)),
        Create(builders.build_service_account(job.name, job.namespace, job.uid)),
        Create(builders.build_role(job.name, job.namespace, job.uid)),
        Create(builders.build_role_binding(job.name, job.namespace, job.uid)),
    ]
    return resources, new_pods, None


def _phase(
    given: _Inputs, membership: Membership, work: Pass, quorum: _Quorum, failing: _Failing | None,
    invalid: str | None,
) -> tuple[str, str, str]:
    """(phase, the Ready condition's reason, its message), the first that applies: an invalid spec, suspended,
    failing, every rank done, paused for quorum, recovering from a restart, creating pods, running, waiting."""
    desired = membership.world_size
    rule = given.rule
    quorum_text = rule.describe(work.healthy, desired)
    # Restarting from a restart decided until the job trains again as it would without one: quorum met and
    # every slot holding a pod (one still Pending is a slot that is no longer being replaced).
    recovering = bool(work.replacing or work.restarts) or (
        given.job.status.get("phase") == "Restarting" and bool(work.missing or work.waiting or not quorum.met)
    )
    if invalid is not None:
        return "Failed", REASON_INVALID_SPEC, invalid
    if given.suspended:
        return "Suspended", "Suspended", "spec.suspend is true: no pods run"
    if failing is not None:
        return "Failed", *failing
    if desired > 0 and work.succeeded == desired:
        return "Succeeded", "Succeeded", "every rank exited successfully"
    if quorum.lost and rule.action_on_loss == "Pause":
        return "Paused", REASON_QUORUM_LOST, quorum_text + ": training is paused until it returns"
    if recovering:
        return (
            "Restarting", "Restarting", f"replacing the pods of ranks {describe_ranks(work.replacing)}"
            if work.replacing else f"{work.healthy} of {desired} nodes ready after a restart",
        )
    if work.missing or work.waiting:
        return "Creating", "CreatingPods", f"creating pods for ranks {describe_ranks(work.missing + work.waiting)}"
    if quorum.met:
        return "Running", "Running", f"{work.healthy} of {desired} nodes ready"
    return "Pending", "WaitingForPods", f"{work.healthy} of {desired} nodes ready, quorum needs {rule.needed(desired)}"


def _status(
    given: _Inputs, membership: Membership, work: Pass, quorum: _Quorum, streak: int, suspended_seconds: int,
    events: list[Event],
) -> dict[str, Any]:
    """The status this pass decided, before its phase (with_phase adds it): sizes, ranks, restarts, quorum,
    what rank 0 reported (its events go to `events`), the QuorumMet and Suspended conditions, startTime."""
    job, now, suspended = given.job, given.now, given.suspended
    previous = job.status
    desired = membership.world_size
    counted = sum(1 for r in work.restarts if r.counted)
    status: dict[str, Any] = {
        "membershipGeneration": membership.generation,
        "worldSize": desired,
        "desiredNodes": desired,
        "readyNodes": work.healthy,
        "readyDesired": f"{work.healthy}/{desired}",
        "restartCount": given.restart_count + counted,
        "ranks": [work.ranks[r] for r in sorted(work.ranks)],
    }
    history = [*(previous.get("restartHistory") or []), *(restart_entry(r, now) for r in work.restarts)]
    if history:
        status["restartHistory"] = history[-MAX_HISTORY:]
    if streak:
        status["restartStreak"] = streak
    if suspended_seconds:
        status["suspendedSeconds"] = suspended_seconds
    status["quorum"] = {"healthyPercent": quorum.healthy_percent, "met": quorum.met}
    status.update(reported(previous, given.rendezvous, events))
    conditions_before = previous.get("conditions") or []
    status["conditions"] = [
        condition(
            conditions_before,
            "QuorumMet",
            quorum.met,
            "QuorumMet" if quorum.met else "NotEnoughHealthyNodes",
            given.rule.describe(work.healthy, desired),
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
        *snapshot_conditions(previous, given.rendezvous, bool(defaults.field(
            job.spec.get("checkpoint") or {}, "checkpoint.snapshotEveryNSteps")), job.generation, now),
    ]
    if previous.get("startTime") or not suspended:
        status["startTime"] = previous.get("startTime") or timestamp(now)
    return status


def _rendezvous_puts(
    given: _Inputs, work: Pass, control: job_object.Control, failing: _Failing | None
) -> list[Action]:
    """The records to write to the job's own rendezvous object: the control record when it changed, and the
    removal of hang reports handled (none while the job fails)."""
    rendezvous, job = given.rendezvous, given.job
    if rendezvous is None or rendezvous.controller_uid != job.uid:
        return []
    if rendezvous.view.control != control:
        work.put[job_object.CONTROL_KEY] = job_object.control_to_json(control)
    if not work.put or failing is not None:
        return []
    return [PutRecords(job_object.object_name(job.name), job.uid, tuple(sorted(work.put.items())))]


def _recovered_after(
    job: Job, phase: str, last_restart: datetime.datetime | None, now: datetime.datetime
) -> float | None:
    """Seconds from the last restart to the pass the job is Running again (phase Restarting says until when)."""
    if job.status.get("phase") in ("Restarting", "Paused") and phase == "Running" and last_restart is not None:
        return max(0.0, (now - last_restart).total_seconds())
    return None


def _plan_finished(job: Job, pods: Sequence[ObservedPod], now: datetime.datetime) -> Plan:
    """A job that has succeeded or failed: stop what still runs (a pod whose trainer ended but whose sidecar
    runs on too: it holds its node), and delete the job once its ttlSecondsAfterFinished has passed."""
    actions: list[Action] = [
        Delete("Pod", p.name, job.uid, p.uid or None)
        for p in sorted(pods, key=lambda p: p.name)
        if p.controller_uid == job.uid and not p.terminating and p.still_runs()
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


def _budget_message(budget: int, failures: Sequence[policy.RankLoss], limit: int = 8) -> str:
    """Why the budget ran out, bounded: the first `limit` failures in words, then how many more (a thousand
    ranks failing at once must still fit the status)."""
    words = [policy.describe(f) if f.rank >= 0 else f"quorum was lost ({f.message})" for f in failures[:limit]]
    if len(failures) > limit:
        more = [f.rank for f in failures[limit:] if f.rank >= 0]
        words.append(f"and {len(failures) - limit} more (ranks {describe_ranks(more)})")
    return clip(f"{'; '.join(words)}; the restart budget (failurePolicy.maxRestarts {budget}) is used up, "
                "so the job has failed")
