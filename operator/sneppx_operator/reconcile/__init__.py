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

The package, by concept (each module's docstring says why it stands apart), lowest first; `.importlinter`
holds the layering:

    observe, actions   the cluster read into frozen summaries; the actions k8s.apply carries out, and their outcome
    decisions          what a pass decides and hands on: Plan, Restart, Membership, Event, Settled
    status             the status's fields, conditions, bounds and merge patch
    events, slots      the events a pass posts; the walk over the rank slots of the current pod generation
    planning, settling plan() and settle()

Every name callers use is re-exported here: `from sneppx_operator import reconcile; reconcile.plan(...)`.
"""

from __future__ import annotations

from sneppx_operator.reconcile.actions import (
    Action,
    Create,
    Delete,
    DeleteJob,
    DropFinalizer,
    Outcome,
    PutRecords,
    Refusal,
)
from sneppx_operator.reconcile.decisions import Event, Membership, Plan, Restart, Settled
from sneppx_operator.reconcile.events import events_for
from sneppx_operator.reconcile.observe import (
    ACTIVE_POD_PHASES,
    Job,
    ObservedNode,
    ObservedObject,
    ObservedPod,
    controller_uid,
    observe_node,
    observe_pod,
    observe_rendezvous,
    owned_rendezvous,
    parse_time,
    pods_lag_status,
)
from sneppx_operator.reconcile.planning import LEGACY_FINALIZER, next_membership, plan
from sneppx_operator.reconcile.settling import SPEC_REJECTED_CODES, describe_refusal, settle
from sneppx_operator.reconcile.status import (
    CONDITION_RESOURCE_FAILURE,
    MAX_HISTORY,
    MAX_MESSAGE_CHARS,
    MAX_PROBLEMS,
    REASON_BUDGET_EXHAUSTED,
    REASON_DEADLINE,
    REASON_EXIT_CODE_RULE,
    REASON_FAILED_CREATE,
    REASON_FAILED_DELETE,
    REASON_INVALID_SPEC,
    REASON_NAME_IN_USE,
    REASON_QUORUM_LOST,
    TERMINAL_PHASES,
    clip,
    condition,
    describe_ranks,
    find_condition,
    restart_entry,
    status_patch,
    timestamp,
)

__all__ = [
    "ACTIVE_POD_PHASES",
    "CONDITION_RESOURCE_FAILURE",
    "LEGACY_FINALIZER",
    "MAX_HISTORY",
    "MAX_MESSAGE_CHARS",
    "MAX_PROBLEMS",
    "REASON_BUDGET_EXHAUSTED",
    "REASON_DEADLINE",
    "REASON_EXIT_CODE_RULE",
    "REASON_FAILED_CREATE",
    "REASON_FAILED_DELETE",
    "REASON_INVALID_SPEC",
    "REASON_NAME_IN_USE",
    "REASON_QUORUM_LOST",
    "SPEC_REJECTED_CODES",
    "TERMINAL_PHASES",
    "Action",
    "Create",
    "Delete",
    "DeleteJob",
    "DropFinalizer",
    "Event",
    "Job",
    "Membership",
    "ObservedNode",
    "ObservedObject",
    "ObservedPod",
    "Outcome",
    "Plan",
    "PutRecords",
    "Refusal",
    "Restart",
    "Settled",
    "clip",
    "condition",
    "controller_uid",
    "describe_ranks",
    "describe_refusal",
    "events_for",
    "find_condition",
    "next_membership",
    "observe_node",
    "observe_pod",
    "observe_rendezvous",
    "owned_rendezvous",
    "parse_time",
    "plan",
    "pods_lag_status",
    "restart_entry",
    "settle",
    "status_patch",
    "timestamp",
]
