"""The Kubernetes events a pass posts: for what took effect (pods created, deleted, force-deleted), a new
membership generation, a phase change, and each restart the plan decided.

Why apart: events are what a person reads in `kubectl describe`; their wording is kept together, and posted
only when something changed, never on every retry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sneppx_operator import builders, policy
from sneppx_operator.reconcile.actions import Action, Create, Delete
from sneppx_operator.reconcile.decisions import Event, Restart
from sneppx_operator.reconcile.status import clip, describe_ranks, find_condition


def restart_events(restarts: Sequence[Restart], count: int, budget: int) -> list[Event]:
    events = []
    for restart in restarts:
        count += 1 if restart.counted else 0
        numbered = f"restart {count} of {budget}" if restart.counted else "not counted"
        what = policy.describe(restart.failure) if restart.failure.rank >= 0 else restart.failure.message
        replaced = "its pod is replaced" if restart.failure.rank >= 0 else "every rank's pod is replaced"
        events.append(Event("Warning", restart.failure.reason, f"{numbered}: {what}; {replaced}"))
    return events


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
