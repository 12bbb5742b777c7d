"""The operator's decisions, as pure functions: which objects to create or delete, which status to report."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sneppx_operator import reconcile

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
LATER = NOW + datetime.timedelta(minutes=5)
KEY = bytes(32)


def job(
    *,
    max_nodes: int = 2,
    min_nodes: int = 1,
    suspend: bool = False,
    min_healthy: int = 51,
    status: dict[str, Any] | None = None,
    generation: int = 1,
    volumes: list[Any] | None = None,
) -> reconcile.Job:
    pod_spec: dict[str, Any] = {"containers": [{"name": "trainer", "image": "example.org/t:1"}]}
    if volumes is not None:
        pod_spec["volumes"] = volumes
    return reconcile.Job(
        name="train",
        namespace="ns",
        uid="uid-1",
        generation=generation,
        status=status or {},
        spec={
            "template": {"spec": pod_spec},
            "elastic": {"minNodes": min_nodes, "maxNodes": max_nodes},
            "quorum": {"minHealthyPercent": min_healthy, "actionOnLoss": "Pause"},
            "checkpoint": {"storage": {"pvc": {"claimName": "ckpt"}}},
            "suspend": suspend,
        },
    )


def observed(
    rank: int, *, ready: bool = False, generation: int = 1, phase: str = "Running", terminating: bool = False
) -> reconcile.ObservedPod:
    return reconcile.ObservedPod(f"train-{rank}", rank, generation, phase, ready, terminating, f"node-{rank}")


def kinds(plan: reconcile.Plan) -> list[tuple[str, str, str]]:
    return [("create" if isinstance(a, reconcile.Create) else "delete", a.kind, a.name) for a in plan.actions]


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_new_job_creates_service_then_secret_then_one_pod_per_rank() -> None:
    plan = reconcile.plan(job(max_nodes=3), [], now=NOW, heartbeat_key=KEY)
    assert kinds(plan) == [
        ("create", "Service", "train"),
        ("create", "Secret", "train-heartbeat"),
        ("create", "Pod", "train-0"),
        ("create", "Pod", "train-1"),
        ("create", "Pod", "train-2"),
    ]
    status = plan.status
    assert status["phase"] == "Creating" and status["readyDesired"] == "0/3"
    assert status["membershipGeneration"] == 1 and status["worldSize"] == 3
    assert status["startTime"] == "2026-01-02T03:04:05Z"
    assert conditions(status)["Ready"]["reason"] == "CreatingPods"


def test_pods_present_but_not_ready_is_pending_and_does_nothing() -> None:
    plan = reconcile.plan(job(), [observed(0), observed(1)], now=NOW, heartbeat_key=KEY)
    assert plan.actions == ()
    assert plan.status["phase"] == "Pending"
    assert plan.status["quorum"] == {"healthyPercent": 0, "met": False}
    assert conditions(plan.status)["Ready"]["status"] == "False"


def test_all_ranks_ready_is_running_with_quorum() -> None:
    plan = reconcile.plan(
        job(), [observed(0, ready=True), observed(1, ready=True)], now=NOW, heartbeat_key=KEY
    )
    status = plan.status
    assert status["phase"] == "Running" and status["readyDesired"] == "2/2"
    assert status["quorum"] == {"healthyPercent": 100, "met": True}
    assert conditions(status)["Ready"] | {"lastTransitionTime": None} == {
        "type": "Ready",
        "status": "True",
        "observedGeneration": 1,
        "lastTransitionTime": None,
        "reason": "Running",
        "message": "2 of 2 nodes ready",
    }
    assert status["ranks"] == [
        {"rank": 0, "pod": "train-0", "phase": "Running", "ready": True, "node": "node-0"},
        {"rank": 1, "pod": "train-1", "phase": "Running", "ready": True, "node": "node-1"},
    ]


def test_quorum_is_strictly_more_than_half() -> None:
    assert reconcile.quorum(1, 2, 51) == (50, False)
    assert reconcile.quorum(2, 3, 51) == (66, True)
    assert reconcile.quorum(2, 4, 51) == (50, False)
    assert reconcile.quorum(3, 4, 75) == (75, True)
    assert reconcile.quorum(2, 3, 75) == (66, False)
    assert reconcile.quorum(0, 0, 51) == (0, False)


def test_running_needs_min_nodes_and_quorum() -> None:
    pods = [observed(0, ready=True), observed(1, ready=True), observed(2)]
    assert (
        reconcile.plan(job(max_nodes=3, min_nodes=2), pods, now=NOW, heartbeat_key=KEY).status["phase"]
        == "Running"
    )
    assert (
        reconcile.plan(job(max_nodes=3, min_nodes=3), pods, now=NOW, heartbeat_key=KEY).status["phase"]
        == "Pending"
    )
    assert (
        reconcile.plan(
            job(max_nodes=3, min_nodes=2, min_healthy=75), pods, now=NOW, heartbeat_key=KEY
        ).status["phase"]
        == "Pending"
    )


def test_suspend_deletes_every_pod_and_creates_nothing() -> None:
    plan = reconcile.plan(
        job(suspend=True), [observed(0, ready=True), observed(1)], now=NOW, heartbeat_key=KEY
    )
    assert kinds(plan) == [("delete", "Pod", "train-0"), ("delete", "Pod", "train-1")]
    status = plan.status
    assert status["phase"] == "Suspended" and status["readyDesired"] == "0/0"
    assert conditions(status)["Suspended"]["status"] == "True"
    assert "startTime" not in status, "a job created suspended has not started"


def test_stale_generations_and_ranks_above_the_size_are_deleted_and_missing_ranks_created() -> None:
    pods = [observed(0, ready=True), observed(1, generation=0), observed(5)]
    plan = reconcile.plan(job(max_nodes=2), pods, now=NOW, heartbeat_key=KEY)
    assert kinds(plan) == [
        ("delete", "Pod", "train-1"),
        ("delete", "Pod", "train-5"),
        ("create", "Service", "train"),
        ("create", "Secret", "train-heartbeat"),
        ("create", "Pod", "train-1"),
    ]


def test_terminating_pods_are_not_counted_or_deleted_again() -> None:
    plan = reconcile.plan(
        job(),
        [observed(0, ready=True), observed(1, ready=True, terminating=True)],
        now=NOW,
        heartbeat_key=KEY,
    )
    assert ("delete", "Pod", "train-1") not in kinds(plan)
    assert ("create", "Pod", "train-1") in kinds(plan)  # answered 409 until the old pod is gone
    assert plan.status["readyNodes"] == 1


def test_invalid_template_fails_the_job_without_touching_the_cluster_and_recovers_when_fixed() -> None:
    bad = job(volumes=[{"name": "sneppx-tmp", "emptyDir": {}}])
    plan = reconcile.plan(bad, [], now=NOW, heartbeat_key=KEY)
    assert plan.actions == ()
    assert plan.status["phase"] == "Failed"
    ready = conditions(plan.status)["Ready"]
    assert ready["reason"] == "InvalidSpec" and "sneppx-tmp" in ready["message"]
    assert "completionTime" not in plan.status
    fixed = reconcile.plan(job(status=plan.status, generation=2), [], now=LATER, heartbeat_key=KEY)
    assert ("create", "Pod", "train-0") in kinds(fixed)
    assert fixed.status["phase"] == "Creating"


def test_all_ranks_succeeded_completes_the_job_and_it_stays_done() -> None:
    pods = [observed(0, phase="Succeeded"), observed(1, phase="Succeeded")]
    plan = reconcile.plan(job(), pods, now=NOW, heartbeat_key=KEY)
    assert plan.actions == () and plan.status["phase"] == "Succeeded"
    assert plan.status["completionTime"] == "2026-01-02T03:04:05Z"
    assert conditions(plan.status)["Succeeded"]["status"] == "True"
    again = reconcile.plan(job(status=plan.status), [], now=LATER, heartbeat_key=KEY)
    assert again == reconcile.Plan((), {}), "a finished job's pods are not recreated"


def test_steady_state_needs_no_status_write_and_keeps_transition_times() -> None:
    pods = [observed(0, ready=True), observed(1, ready=True)]
    first = reconcile.plan(job(), pods, now=NOW, heartbeat_key=KEY)
    second = reconcile.plan(job(status=first.status), pods, now=LATER, heartbeat_key=KEY)
    assert second.actions == ()
    assert reconcile.status_patch(first.status, second.status) == {}


def test_condition_transition_time_moves_only_when_status_flips() -> None:
    running = reconcile.plan(
        job(), [observed(0, ready=True), observed(1, ready=True)], now=NOW, heartbeat_key=KEY
    )
    degraded = reconcile.plan(
        job(status=running.status), [observed(0, ready=True), observed(1)], now=LATER, heartbeat_key=KEY
    )
    before, after = conditions(running.status), conditions(degraded.status)
    assert (
        after["Ready"]["status"] == "False" and after["Ready"]["lastTransitionTime"] == "2026-01-02T03:09:05Z"
    )
    assert after["Suspended"]["lastTransitionTime"] == before["Suspended"]["lastTransitionTime"]
    patch = reconcile.status_patch(running.status, degraded.status)
    assert set(patch) == {"phase", "readyNodes", "readyDesired", "quorum", "conditions", "ranks"}


def test_restart_count_and_start_time_are_kept() -> None:
    plan = reconcile.plan(
        job(status={"restartCount": 4, "startTime": "2025-12-31T00:00:00Z"}),
        [observed(0), observed(1)],
        now=NOW,
        heartbeat_key=KEY,
    )
    assert plan.status["restartCount"] == 4 and plan.status["startTime"] == "2025-12-31T00:00:00Z"


def test_observe_pod_reads_rank_generation_readiness_and_deletion() -> None:
    meta = {
        "labels": {"sneppx.io/rank": "2", "sneppx.io/membership-generation": "7"},
        "deletionTimestamp": "2026-01-01T00:00:00Z",
    }
    status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    assert reconcile.observe_pod("p", meta, {"nodeName": "n1"}, status) == reconcile.ObservedPod(
        "p", 2, 7, "Running", True, True, "n1"
    )
    assert reconcile.observe_pod("p", {"labels": {"sneppx.io/rank": "x"}}, {}, {}) is None
    assert reconcile.observe_pod("p", {}, {}, {}) is None
    unready = reconcile.observe_pod("p", {"labels": meta["labels"]}, {}, {})
    assert (
        unready is not None and unready.phase == "Pending" and not unready.ready and not unready.terminating
    )


def test_cleanup_deletes_pods_service_and_secret() -> None:
    actions = reconcile.cleanup_actions("train", ["train-1", "train-0"])
    assert [(a.kind, a.name) for a in actions] == [
        ("Pod", "train-0"),
        ("Pod", "train-1"),
        ("Service", "train"),
        ("Secret", "train-heartbeat"),
    ]


def test_events_describe_what_was_done_and_phase_changes() -> None:
    plan = reconcile.plan(job(), [], now=NOW, heartbeat_key=KEY)
    events = reconcile.events_for(plan.actions, None, plan.status)
    assert events[0] == reconcile.Event(
        "Normal", "CreatedPods", "created pods for ranks [0, 1] (membership generation 1, world size 2)"
    )
    assert events[1].reason == "PhaseChanged" and events[1].message.startswith("New -> Creating")
    assert reconcile.events_for((), "Creating", plan.status) == [], "nothing done, no change: no events"

    suspended = reconcile.plan(job(suspend=True), [observed(0)], now=NOW, heartbeat_key=KEY)
    reasons = [e.reason for e in reconcile.events_for(suspended.actions, "Running", suspended.status)]
    assert reasons == ["Suspended", "PhaseChanged"]

    bad = reconcile.plan(job(volumes=[{"name": "sneppx-tmp"}]), [], now=NOW, heartbeat_key=KEY)
    warning = reconcile.events_for(bad.actions, None, bad.status)
    assert [(e.type, e.reason) for e in warning] == [("Warning", "InvalidSpec")]


def _apply(pods: list[reconcile.ObservedPod], plan: reconcile.Plan) -> list[reconcile.ObservedPod]:
    """What the cluster looks like after the plan's actions (new pods come up not ready)."""
    deleted = {a.name for a in plan.actions if isinstance(a, reconcile.Delete) and a.kind == "Pod"}
    kept = [p for p in pods if p.name not in deleted]
    created = [a.body for a in plan.actions if isinstance(a, reconcile.Create) and a.kind == "Pod"]
    names = {p.name for p in kept}
    for body in created:
        labels = body["metadata"]["labels"]
        if body["metadata"]["name"] not in names:  # a name still held by a terminating pod answers 409
            kept.append(
                reconcile.ObservedPod(
                    body["metadata"]["name"],
                    int(labels["sneppx.io/rank"]),
                    int(labels["sneppx.io/membership-generation"]),
                    "Pending",
                    False,
                    False,
                )
            )
    return kept


pods_strategy = st.lists(
    st.builds(
        observed,
        st.integers(0, 6),
        ready=st.booleans(),
        generation=st.integers(0, 2),
        phase=st.sampled_from(["Pending", "Running", "Failed"]),
        terminating=st.just(False),
    ),
    max_size=8,
    unique_by=lambda p: p.rank,
)


@settings(max_examples=200, deadline=None)
@given(pods=pods_strategy, max_nodes=st.integers(1, 5), suspend=st.booleans())
def test_one_plan_converges(pods: list[reconcile.ObservedPod], max_nodes: int, suspend: bool) -> None:
    """Whatever the cluster holds, carrying out one plan leaves nothing for the next plan to do."""
    spec_job = job(max_nodes=max_nodes, suspend=suspend)
    first = reconcile.plan(spec_job, pods, now=NOW, heartbeat_key=KEY)
    after = _apply(pods, first)
    second = reconcile.plan(
        dataclasses.replace(spec_job, status=first.status), after, now=LATER, heartbeat_key=KEY
    )
    assert second.actions == ()
    expected = 0 if suspend else max_nodes
    assert sorted(p.rank for p in after) == list(range(expected))
    assert all(p.generation == 1 for p in after)
