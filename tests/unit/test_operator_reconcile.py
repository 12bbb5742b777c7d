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
    rank: int,
    *,
    ready: bool = False,
    generation: int = 1,
    phase: str = "Running",
    terminating: bool = False,
    controller: str | None = "uid-1",
    exit_code: int | None = None,
    reason: str | None = None,
) -> reconcile.ObservedPod:
    return reconcile.ObservedPod(
        f"train-{rank}",
        rank,
        generation,
        phase,
        ready,
        terminating,
        f"node-{rank}",
        uid=f"pod-uid-{rank}",
        controller_uid=controller,
        exit_code=exit_code,
        reason=reason,
    )


def kinds(plan: reconcile.Plan) -> list[tuple[str, str, str]]:
    return [("create" if isinstance(a, reconcile.Create) else "delete", a.kind, a.name) for a in plan.actions]


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_new_job_creates_service_then_secret_then_one_pod_per_rank() -> None:
    plan = reconcile.plan(job(max_nodes=3), [], now=NOW, heartbeat_key=KEY)
    assert kinds(plan) == [
        ("create", "Service", "train"),
        ("create", "Secret", "train-heartbeat-uid-1"),
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
        ("create", "Secret", "train-heartbeat-uid-1"),
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
    actions = reconcile.cleanup_actions("train", "uid-1", [observed(1), observed(0)])
    assert [(a.kind, a.name) for a in actions] == [
        ("Pod", "train-0"),
        ("Pod", "train-1"),
        ("Service", "train"),
        ("Secret", "train-heartbeat-uid-1"),
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
                    controller_uid=reconcile.controller_uid(body["metadata"]),
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


# ---- ownership: only what the job controls ------------------------------------------------------------------


def test_pods_the_job_does_not_control_are_neither_counted_nor_deleted() -> None:
    foreign = [observed(0, ready=True, controller="someone-else"), observed(1, ready=True, controller=None)]
    plan = reconcile.plan(job(), foreign, now=NOW, heartbeat_key=KEY)
    assert not [a for a in plan.actions if isinstance(a, reconcile.Delete)], (
        "someone else's pods are left alone"
    )
    assert ("create", "Pod", "train-0") in kinds(plan), "the job's own rank 0 is still missing"
    assert plan.status["readyNodes"] == 0 and plan.status["ranks"] == []


def test_deletes_carry_the_owner_and_the_observed_uid() -> None:
    plan = reconcile.plan(job(max_nodes=1), [observed(0), observed(1)], now=NOW, heartbeat_key=KEY)
    assert plan.actions == (reconcile.Delete("Pod", "train-1", "uid-1", "pod-uid-1"),)


def test_cleanup_leaves_pods_of_other_controllers_alone() -> None:
    actions = reconcile.cleanup_actions("train", "uid-1", [observed(0), observed(1, controller="other")])
    assert actions == (
        reconcile.Delete("Pod", "train-0", "uid-1", "pod-uid-0"),
        reconcile.Delete("Service", "train", "uid-1"),
        reconcile.Delete("Secret", "train-heartbeat-uid-1", "uid-1"),
    )


def test_controller_uid_is_the_controlling_owner_reference() -> None:
    refs = [{"uid": "a", "controller": False}, {"uid": "b", "controller": True}]
    assert reconcile.controller_uid({"ownerReferences": refs}) == "b"
    assert reconcile.controller_uid({"ownerReferences": [{"uid": "a"}]}) is None
    assert reconcile.controller_uid({}) is None


def test_a_name_held_by_someone_else_is_reported_once_and_retried() -> None:
    plan = reconcile.plan(job(), [], now=NOW, heartbeat_key=KEY)
    service = plan.actions[0]
    clash = reconcile.Refusal(service, 409, "name in use", name_in_use=True)
    settled = reconcile.settle(job(), plan, reconcile.Outcome((), clash), now=NOW)
    failure = conditions(settled.status)["ResourceFailure"]
    assert failure["status"] == "True" and failure["reason"] == "NameInUse"
    assert (
        'Service "train" already exists and is not controlled by this job (it has no controller)'
        in (failure["message"])
    )
    assert [(e.type, e.reason) for e in settled.events] == [
        ("Normal", "PhaseChanged"),
        ("Warning", "NameInUse"),
    ]
    assert settled.error == failure["message"] and settled.retryable

    again = reconcile.plan(job(status=settled.status), [], now=LATER, heartbeat_key=KEY)
    retried = reconcile.settle(job(status=settled.status), again, reconcile.Outcome((), clash), now=LATER)
    assert retried.events == [], "a retry that meets the same clash posts nothing new"
    assert reconcile.status_patch(settled.status, retried.status) == {}, "and writes nothing new"

    cleared = reconcile.settle(job(status=settled.status), again, reconcile.Outcome(again.actions), now=LATER)
    assert "ResourceFailure" not in conditions(cleared.status) and cleared.error is None


def test_holder_of_a_clashing_name_is_named() -> None:
    plan = reconcile.plan(job(), [], now=NOW, heartbeat_key=KEY)
    refusal = reconcile.Refusal(
        plan.actions[2], 409, "", name_in_use=True, holder="StatefulSet train (uid x)"
    )
    assert "its controller is StatefulSet train (uid x)" in reconcile.describe_refusal(refusal)


# ---- API errors reach status and events -------------------------------------------------------------------


def test_a_forbidden_create_is_a_retryable_failure_with_the_api_servers_message() -> None:
    plan = reconcile.plan(job(), [], now=NOW, heartbeat_key=KEY)
    quota = 'pods "train-1" is forbidden: exceeded quota: q, requested: pods=1, used: pods=1, limited: pods=1'
    done = plan.actions[:3]
    settled = reconcile.settle(
        job(), plan, reconcile.Outcome(done, reconcile.Refusal(plan.actions[3], 403, quota)), now=NOW
    )
    failure = conditions(settled.status)["ResourceFailure"]
    assert failure["reason"] == "FailedCreate" and "exceeded quota" in failure["message"]
    assert failure["message"].startswith('the API server refused to create Pod "train-1" (403)')
    assert settled.retryable and settled.status["phase"] == "Creating"
    assert ("Warning", "FailedCreate") in [(e.type, e.reason) for e in settled.events]
    assert ("Normal", "CreatedPods") in [(e.type, e.reason) for e in settled.events], "rank 0 was created"


def test_a_pod_the_api_server_calls_invalid_fails_the_job_until_the_spec_is_edited() -> None:
    plan = reconcile.plan(job(), [], now=NOW, heartbeat_key=KEY)
    invalid = 'Pod "train-0" is invalid: spec.containers[0].name: Invalid value: "Bad_Name"'
    settled = reconcile.settle(
        job(),
        plan,
        reconcile.Outcome(plan.actions[:2], reconcile.Refusal(plan.actions[2], 422, invalid)),
        now=NOW,
    )
    assert settled.status["phase"] == "Failed" and not settled.retryable
    ready = conditions(settled.status)["Ready"]
    assert ready["reason"] == "InvalidSpec" and "Bad_Name" in ready["message"]
    assert conditions(settled.status)["Failed"]["reason"] == "InvalidSpec"
    assert "completionTime" not in settled.status, "an invalid spec can still be fixed"
    assert [(e.type, e.reason) for e in settled.events] == [("Warning", "InvalidSpec")]

    same_spec = reconcile.plan(job(status=settled.status), [], now=LATER, heartbeat_key=KEY)
    assert same_spec.actions == (), "the same spec is not sent again"
    assert (
        same_spec.status["phase"] == "Failed"
        and "Bad_Name" in conditions(same_spec.status)["Ready"]["message"]
    )
    edited = reconcile.plan(job(status=settled.status, generation=2), [], now=LATER, heartbeat_key=KEY)
    assert ("create", "Pod", "train-0") in kinds(edited)


# ---- membership generations and world size ----------------------------------------------------------------


def test_changing_max_nodes_starts_a_new_generation_and_replaces_every_rank() -> None:
    first = reconcile.plan(job(max_nodes=2), [], now=NOW, heartbeat_key=KEY)
    running = [observed(0, ready=True), observed(1, ready=True)]
    grown = reconcile.plan(job(max_nodes=3, status=first.status), running, now=LATER, heartbeat_key=KEY)
    assert grown.status["membershipGeneration"] == 2 and grown.status["worldSize"] == 3
    assert [k for k in kinds(grown) if k[0] == "delete"] == [
        ("delete", "Pod", "train-0"),
        ("delete", "Pod", "train-1"),
    ]
    created = [a.body for a in grown.actions if isinstance(a, reconcile.Create) and a.kind == "Pod"]
    assert [_pod_env(body)["WORLD_SIZE"] for body in created] == ["3", "3", "3"]
    assert {_pod_env(body)["SNEPPX_GENERATION"] for body in created} == {"2"}
    events = reconcile.events_for((), first.status["phase"], grown.status, first.status)
    assert events[0] == reconcile.Event(
        "Normal",
        "MembershipChanged",
        "membership generation 2 starts with world size 3 (was 2); ranks of generation 1 are replaced",
    )


def test_an_unchanged_size_keeps_the_generation() -> None:
    first = reconcile.plan(job(max_nodes=2), [], now=NOW, heartbeat_key=KEY)
    again = reconcile.plan(job(max_nodes=2, status=first.status), [observed(0)], now=LATER, heartbeat_key=KEY)
    assert again.status["membershipGeneration"] == 1
    assert kinds(again)[-1] == ("create", "Pod", "train-1"), "a lost rank comes back in the same generation"


def _pod_env(body: Any) -> dict[str, str]:
    return {e["name"]: e["value"] for e in body["spec"]["containers"][0]["env"] if "value" in e}


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 4), st.booleans()), min_size=1, max_size=6))
def test_one_generation_never_has_two_world_sizes(sizes: list[tuple[int, bool]]) -> None:
    """Whatever maxNodes and suspend edits happen, every pod ever created under one membership generation
    carries the same WORLD_SIZE, and the pods present always belong to the current generation."""
    status: dict[str, Any] = {}
    pods: list[reconcile.ObservedPod] = []
    world_of: dict[str, str] = {}
    for max_nodes, suspend in sizes:
        spec_job = job(max_nodes=max_nodes, suspend=suspend, status=status)
        step = reconcile.plan(spec_job, pods, now=NOW, heartbeat_key=KEY)
        for action in step.actions:
            if isinstance(action, reconcile.Create) and action.kind == "Pod":
                env = _pod_env(action.body)
                assert world_of.setdefault(env["SNEPPX_GENERATION"], env["WORLD_SIZE"]) == env["WORLD_SIZE"]
        pods, status = _apply(pods, step), step.status
        assert all(p.generation == status["membershipGeneration"] for p in pods)
        assert len(pods) == (0 if suspend else max_nodes)


# ---- finished generations -------------------------------------------------------------------------------------


def test_all_ranks_failed_fails_the_job_with_their_exit_codes_and_it_stays_failed() -> None:
    pods = [
        observed(0, phase="Failed", exit_code=1, reason="Error"),
        observed(1, phase="Failed", exit_code=137, reason="OOMKilled"),
    ]
    plan = reconcile.plan(job(), pods, now=NOW, heartbeat_key=KEY)
    assert plan.actions == () and plan.status["phase"] == "Failed"
    failed = conditions(plan.status)["Failed"]
    assert failed["reason"] == "RanksFailed" and conditions(plan.status)["Ready"]["reason"] == "RanksFailed"
    assert (
        "ranks [0, 1] failed (rank 0: exit code 1, Error; rank 1: exit code 137, OOMKilled)"
        in failed["message"]
    )
    assert plan.status["completionTime"] == "2026-01-02T03:04:05Z"
    assert plan.status["ranks"][1] == {
        "rank": 1,
        "pod": "train-1",
        "phase": "Failed",
        "ready": False,
        "node": "node-1",
        "exitCode": 137,
        "reason": "OOMKilled",
    }
    warning = reconcile.events_for(plan.actions, "Running", plan.status)
    assert [(e.type, e.reason) for e in warning] == [("Warning", "RanksFailed")]
    assert reconcile.plan(job(status=plan.status), pods, now=LATER, heartbeat_key=KEY) == reconcile.Plan(
        (), {}
    )


def test_a_generation_that_ends_with_one_failure_has_failed() -> None:
    pods = [observed(0, phase="Succeeded", exit_code=0), observed(1, phase="Failed", exit_code=2)]
    plan = reconcile.plan(job(), pods, now=NOW, heartbeat_key=KEY)
    assert (
        plan.status["phase"] == "Failed"
        and "ranks [1] failed (rank 1: exit code 2)" in (conditions(plan.status)["Failed"]["message"])
    )


def test_a_failed_rank_while_others_still_run_is_not_the_end() -> None:
    plan = reconcile.plan(
        job(), [observed(0, ready=True), observed(1, phase="Failed")], now=NOW, heartbeat_key=KEY
    )
    assert plan.status["phase"] == "Pending" and plan.actions == ()


def test_observe_pod_reads_controller_exit_code_and_reason() -> None:
    meta = {
        "uid": "p1",
        "labels": {"sneppx.io/rank": "0", "sneppx.io/membership-generation": "1"},
        "ownerReferences": [{"uid": "uid-1", "controller": True}],
    }
    spec = {"containers": [{"name": "trainer"}, {"name": "sidecar"}]}
    status = {
        "phase": "Failed",
        "containerStatuses": [
            {"name": "sidecar", "state": {"terminated": {"exitCode": 0}}},
            {"name": "trainer", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}},
        ],
    }
    pod = reconcile.observe_pod("train-0", meta, spec, status)
    assert pod is not None
    assert (pod.uid, pod.controller_uid, pod.exit_code, pod.reason) == ("p1", "uid-1", 137, "OOMKilled")
    evicted = reconcile.observe_pod("train-0", meta, spec, {"phase": "Failed", "reason": "Evicted"})
    assert evicted is not None and evicted.exit_code is None and evicted.reason == "Evicted"
