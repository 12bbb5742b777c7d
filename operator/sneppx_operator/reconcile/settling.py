"""settle(): what the API server did with a plan's actions -> the status, events and retry decision a pass
ends with.

Why apart: the plan's decisions are written before any action; settle adds only what the API server said (a
spec it rejects fails the job, anything else is a ResourceFailure retried with backoff). Not named settle.py so
that `sneppx_operator.reconcile.settle` stays the function.
"""

from __future__ import annotations

import datetime

from sneppx_operator.reconcile.actions import Create, DropFinalizer, Outcome, PutRecords, Refusal
from sneppx_operator.reconcile.decisions import Event, Plan, Settled
from sneppx_operator.reconcile.events import events_for
from sneppx_operator.reconcile.observe import Job
from sneppx_operator.reconcile.status import (
    CONDITION_RESOURCE_FAILURE,
    REASON_FAILED_CREATE,
    REASON_FAILED_DELETE,
    REASON_INVALID_SPEC,
    REASON_NAME_IN_USE,
    clip,
    condition,
    find_condition,
    with_phase,
)

# The API server's answers that no retry can change: the object itself is invalid.
SPEC_REJECTED_CODES = frozenset({400, 422})


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
        status = with_phase(job, status, "Failed", REASON_INVALID_SPEC, error, now)
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
