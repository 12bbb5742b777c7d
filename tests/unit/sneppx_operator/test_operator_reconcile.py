"""The operator's decisions, as pure functions: which objects to create or delete, which status to report."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from SneppX_ALG.contract import job_object
from sneppx_operator import builders, policy, reconcile

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
    max_restarts: int | None = None,
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
            "quorum": {"actionOnLoss": "Pause", **({"minHealthyPercent": min_healthy} if min_healthy else {})},
            "checkpoint": {"storage": {"pvc": {"claimName": "ckpt"}}},
            "suspend": suspend,
            **({} if max_restarts is None else {"failurePolicy": {"maxRestarts": max_restarts}}),
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


MATCHING: Any = object()


def plan_of(
    job: reconcile.Job,
    pods: list[reconcile.ObservedPod],
    *,
    now: datetime.datetime,
    heartbeat_key: bytes,
    nodes: dict[str, reconcile.ObservedNode] | None = None,
    rendezvous: Any = MATCHING,
) -> reconcile.Plan:
    """reconcile.plan with, by default, a rendezvous object that already holds the control record the plan
    wants (so only tests about the rendezvous object see actions on it)."""
    if rendezvous is MATCHING:
        generation = reconcile.next_membership(job.spec, job.status).generation
        control = builders.control_record(job.spec, paused=False, reason="", pod_generation=generation)
        rendezvous = reconcile.ObservedObject("cm-uid", job.uid, job_object.View(control=control))
    return reconcile.plan(job, pods, now=now, heartbeat_key=heartbeat_key, nodes=nodes, rendezvous=rendezvous)


AGENT_OBJECTS = [
    ("create", "ServiceAccount", "train-agent"),
    ("create", "Role", "train-agent"),
    ("create", "RoleBinding", "train-agent"),
]


def kinds(plan: reconcile.Plan) -> list[tuple[str, str, str]]:
    verbs = {reconcile.Create: "create", reconcile.PutRecords: "put", reconcile.DeleteJob: "delete"}
    return [(verbs.get(type(a), "delete"), a.kind, a.name) for a in plan.actions]


def pod_actions(plan: reconcile.Plan) -> tuple[reconcile.Action, ...]:
    """The plan's actions on pods (with two nodes, one rank down also loses quorum: the control record
    then says "paused", which tests about restarts leave aside)."""
    return tuple(a for a in plan.actions if a.kind == "Pod")


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_new_job_creates_service_then_secret_then_one_pod_per_rank() -> None:
    plan = plan_of(job(max_nodes=3), [], now=NOW, heartbeat_key=KEY)
    assert kinds(plan) == [
        ("create", "Service", "train"),
        ("create", "Secret", "train-heartbeat-uid-1"),
        *AGENT_OBJECTS,
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
    plan = plan_of(job(), [observed(0), observed(1)], now=NOW, heartbeat_key=KEY)
    assert plan.actions == ()
    assert plan.status["phase"] == "Pending"
    assert plan.status["quorum"] == {"healthyPercent": 0, "met": False}
    assert conditions(plan.status)["Ready"]["status"] == "False"


def test_all_ranks_ready_is_running_with_quorum() -> None:
    plan = plan_of(
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
        {"rank": 0, "pod": "train-0", "phase": "Running", "ready": True, "uid": "pod-uid-0", "node": "node-0"},
        {"rank": 1, "pod": "train-1", "phase": "Running", "ready": True, "uid": "pod-uid-1", "node": "node-1"},
    ]


def test_quorum_is_min_nodes_and_the_optional_percent_at_every_edge() -> None:
    alone = policy.QuorumRule(min_nodes=1, min_healthy_percent=0, action_on_loss="Pause")
    assert alone.judge(1, 2) == (50, True), "minNodes 1: the survivor alone trains on"
    assert alone.judge(1, 4) == (25, True) and alone.judge(0, 4) == (0, False)
    exact = policy.QuorumRule(min_nodes=2, min_healthy_percent=0, action_on_loss="Pause")
    assert exact.judge(2, 2) == (100, True) and exact.judge(1, 2) == (50, False), "minNodes = maxNodes: all"
    percent = policy.QuorumRule(min_nodes=1, min_healthy_percent=75, action_on_loss="Pause")
    assert percent.judge(2, 4) == (50, False) and percent.judge(3, 4) == (75, True)
    assert percent.needed(3) == 3 and percent.needed(4) == 3, "a percent of the desired nodes, rounded up"
    assert alone.judge(0, 0) == (0, False), "nothing desired (suspended, scaled to 0): nothing met"
    assert policy.quorum_rule(job(min_nodes=2, min_healthy=0).spec) == policy.QuorumRule(2, 0, "Pause")


def test_running_needs_min_nodes_and_quorum() -> None:
    pods = [observed(0, ready=True), observed(1, ready=True), observed(2)]
    assert (
        plan_of(job(max_nodes=3, min_nodes=2), pods, now=NOW, heartbeat_key=KEY).status["phase"]
        == "Running"
    )
    assert (
        plan_of(job(max_nodes=3, min_nodes=3), pods, now=NOW, heartbeat_key=KEY).status["phase"]
        == "Pending"
    )
    assert (
        plan_of(
            job(max_nodes=3, min_nodes=2, min_healthy=75), pods, now=NOW, heartbeat_key=KEY
        ).status["phase"]
        == "Pending"
    )


def test_suspend_deletes_every_pod_and_creates_nothing() -> None:
    plan = plan_of(
        job(suspend=True), [observed(0, ready=True), observed(1)], now=NOW, heartbeat_key=KEY
    )
    assert kinds(plan) == [("delete", "Pod", "train-0"), ("delete", "Pod", "train-1")]
    status = plan.status
    assert status["phase"] == "Suspended" and status["readyDesired"] == "0/0"
    assert conditions(status)["Suspended"]["status"] == "True"
    assert "startTime" not in status, "a job created suspended has not started"


def test_stale_generations_and_ranks_above_the_size_are_deleted_and_missing_ranks_created() -> None:
    pods = [observed(0, ready=True), observed(1, generation=0), observed(5)]
    plan = plan_of(job(max_nodes=2), pods, now=NOW, heartbeat_key=KEY)
    assert kinds(plan) == [
        ("delete", "Pod", "train-1"),
        ("delete", "Pod", "train-5"),
    ], "rank 1's replacement waits until the old generation's pod has released the name"
    assert plan.status["phase"] == "Creating"


def test_terminating_pods_are_not_counted_or_deleted_again() -> None:
    plan = plan_of(
        job(),
        [observed(0, ready=True), observed(1, ready=True, terminating=True)],
        now=NOW,
        heartbeat_key=KEY,
    )
    assert kinds(plan) == [], "not deleted again, and no replacement while the name is held"
    assert plan.status["readyNodes"] == 1


def test_invalid_template_fails_the_job_without_touching_the_cluster_and_recovers_when_fixed() -> None:
    bad = job(volumes=[{"name": "sneppx-tmp", "emptyDir": {}}])
    plan = plan_of(bad, [], now=NOW, heartbeat_key=KEY)
    assert plan.actions == ()
    assert plan.status["phase"] == "Failed"
    ready = conditions(plan.status)["Ready"]
    assert ready["reason"] == "InvalidSpec" and "sneppx-tmp" in ready["message"]
    assert "completionTime" not in plan.status
    fixed = plan_of(job(status=plan.status, generation=2), [], now=LATER, heartbeat_key=KEY)
    assert ("create", "Pod", "train-0") in kinds(fixed)
    assert fixed.status["phase"] == "Creating"


def test_all_ranks_succeeded_completes_the_job_and_it_stays_done() -> None:
    pods = [observed(0, phase="Succeeded"), observed(1, phase="Succeeded")]
    plan = plan_of(job(), pods, now=NOW, heartbeat_key=KEY)
    assert plan.actions == () and plan.status["phase"] == "Succeeded"
    assert plan.status["completionTime"] == "2026-01-02T03:04:05Z"
    assert conditions(plan.status)["Succeeded"]["status"] == "True"
    again = plan_of(job(status=plan.status), [], now=LATER, heartbeat_key=KEY)
    assert again == reconcile.Plan((), {}), "a finished job's pods are not recreated"


def test_steady_state_needs_no_status_write_and_keeps_transition_times() -> None:
    pods = [observed(0, ready=True), observed(1, ready=True)]
    first = plan_of(job(), pods, now=NOW, heartbeat_key=KEY)
    second = plan_of(job(status=first.status), pods, now=LATER, heartbeat_key=KEY)
    assert second.actions == ()
    assert reconcile.status_patch(first.status, second.status) == {}


def test_condition_transition_time_moves_only_when_status_flips() -> None:
    running = plan_of(
        job(), [observed(0, ready=True), observed(1, ready=True)], now=NOW, heartbeat_key=KEY
    )
    degraded = plan_of(
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
    plan = plan_of(
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
        "p", 2, 7, "Running", True, True, "n1", deleted_at=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    )
    assert reconcile.observe_pod("p", {"labels": {"sneppx.io/rank": "x"}}, {}, {}) is None
    assert reconcile.observe_pod("p", {}, {}, {}) is None
    unready = reconcile.observe_pod("p", {"labels": meta["labels"]}, {}, {})
    assert (
        unready is not None and unready.phase == "Pending" and not unready.ready and not unready.terminating
    )


def test_a_finalizer_of_an_older_operator_is_taken_off_and_none_is_added() -> None:
    legacy = dataclasses.replace(job(), finalizers=("example.org/keep", reconcile.LEGACY_FINALIZER))
    plan = plan_of(legacy, RUNNING, now=NOW, heartbeat_key=KEY)
    assert plan.actions[0] == reconcile.DropFinalizer("train", "uid-1", reconcile.LEGACY_FINALIZER)
    assert not [a for a in plan_of(job(), RUNNING, now=NOW, heartbeat_key=KEY).actions
                if isinstance(a, reconcile.DropFinalizer)]
    done = plan_of(job(), [observed(0, phase="Succeeded"), observed(1, phase="Succeeded")], now=NOW, heartbeat_key=KEY)
    finished = dataclasses.replace(legacy, status=done.status)
    assert plan_of(finished, [], now=NOW, heartbeat_key=KEY).actions == (
        reconcile.DropFinalizer("train", "uid-1", reconcile.LEGACY_FINALIZER),
    ), "a finished job loses it too"


def test_events_describe_what_was_done_and_phase_changes() -> None:
    plan = plan_of(job(), [], now=NOW, heartbeat_key=KEY)
    events = reconcile.events_for(plan.actions, None, plan.status)
    assert events[0] == reconcile.Event(
        "Normal", "CreatedPods", "created pods for ranks 0-1 (membership generation 1, world size 2)"
    )
    assert events[1].reason == "PhaseChanged" and events[1].message.startswith("New -> Creating")
    assert reconcile.events_for((), "Creating", plan.status) == [], "nothing done, no change: no events"

    suspended = plan_of(job(suspend=True), [observed(0)], now=NOW, heartbeat_key=KEY)
    reasons = [e.reason for e in reconcile.events_for(suspended.actions, "Running", suspended.status)]
    assert reasons == ["Suspended", "PhaseChanged"]

    bad = plan_of(job(volumes=[{"name": "sneppx-tmp"}]), [], now=NOW, heartbeat_key=KEY)
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
        phase=st.sampled_from(["Pending", "Running"]),
        terminating=st.just(False),
    ),
    max_size=8,
    unique_by=lambda p: p.rank,
)


@settings(max_examples=200, deadline=None)
@given(pods=pods_strategy, max_nodes=st.integers(1, 5), suspend=st.booleans())
def test_one_plan_converges(pods: list[reconcile.ObservedPod], max_nodes: int, suspend: bool) -> None:
    """Whatever the cluster holds, carrying out two plans (the second once deleted pods have released their
    names) leaves nothing for the next plan to do."""
    spec_job = job(max_nodes=max_nodes, suspend=suspend)
    first = plan_of(spec_job, pods, now=NOW, heartbeat_key=KEY)
    after = _apply(pods, first)
    second = plan_of(dataclasses.replace(spec_job, status=first.status), after, now=LATER, heartbeat_key=KEY)
    after = _apply(after, second)
    third = plan_of(dataclasses.replace(spec_job, status=second.status), after, now=LATER, heartbeat_key=KEY)
    assert kinds(third) == []
    expected = 0 if suspend else max_nodes
    assert sorted(p.rank for p in after) == list(range(expected))
    assert all(p.generation == 1 for p in after)


# ---- ownership: only what the job controls ------------------------------------------------------------------


def test_pods_the_job_does_not_control_are_neither_counted_nor_deleted() -> None:
    foreign = [observed(0, ready=True, controller="someone-else"), observed(1, ready=True, controller=None)]
    plan = plan_of(job(), foreign, now=NOW, heartbeat_key=KEY)
    assert not [a for a in plan.actions if isinstance(a, reconcile.Delete)], (
        "someone else's pods are left alone"
    )
    assert ("create", "Pod", "train-0") in kinds(plan), "the job's own rank 0 is still missing"
    assert plan.status["readyNodes"] == 0
    assert [(r["rank"], r["phase"], "uid" in r) for r in plan.status["ranks"]] == [(0, "Pending", False), (1, "Pending", False)]


def test_deletes_carry_the_owner_and_the_observed_uid() -> None:
    plan = plan_of(job(max_nodes=1), [observed(0), observed(1)], now=NOW, heartbeat_key=KEY)
    assert plan.actions == (reconcile.Delete("Pod", "train-1", "uid-1", "pod-uid-1"),)


def test_controller_uid_is_the_controlling_owner_reference() -> None:
    refs = [{"uid": "a", "controller": False}, {"uid": "b", "controller": True}]
    assert reconcile.controller_uid({"ownerReferences": refs}) == "b"
    assert reconcile.controller_uid({"ownerReferences": [{"uid": "a"}]}) is None
    assert reconcile.controller_uid({}) is None


def test_a_name_held_by_someone_else_is_reported_once_and_retried() -> None:
    plan = plan_of(job(), [], now=NOW, heartbeat_key=KEY)
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

    again = plan_of(job(status=settled.status), [], now=LATER, heartbeat_key=KEY)
    retried = reconcile.settle(job(status=settled.status), again, reconcile.Outcome((), clash), now=LATER)
    assert retried.events == [], "a retry that meets the same clash posts nothing new"
    assert reconcile.status_patch(settled.status, retried.status) == {}, "and writes nothing new"

    cleared = reconcile.settle(job(status=settled.status), again, reconcile.Outcome(again.actions), now=LATER)
    assert "ResourceFailure" not in conditions(cleared.status) and cleared.error is None


def test_holder_of_a_clashing_name_is_named() -> None:
    plan = plan_of(job(), [], now=NOW, heartbeat_key=KEY)
    refusal = reconcile.Refusal(
        plan.actions[2], 409, "", name_in_use=True, holder="StatefulSet train (uid x)"
    )
    assert "its controller is StatefulSet train (uid x)" in reconcile.describe_refusal(refusal)


# ---- API errors reach status and events -------------------------------------------------------------------


def test_a_forbidden_create_is_a_retryable_failure_with_the_api_servers_message() -> None:
    plan = plan_of(job(), [], now=NOW, heartbeat_key=KEY)
    quota = 'pods "train-1" is forbidden: exceeded quota: q, requested: pods=1, used: pods=1, limited: pods=1'
    first_pod = next(i for i, a in enumerate(plan.actions) if isinstance(a, reconcile.Create) and a.kind == "Pod")
    done = plan.actions[: first_pod + 1]
    settled = reconcile.settle(
        job(), plan, reconcile.Outcome(done, reconcile.Refusal(plan.actions[first_pod + 1], 403, quota)), now=NOW
    )
    failure = conditions(settled.status)["ResourceFailure"]
    assert failure["reason"] == "FailedCreate" and "exceeded quota" in failure["message"]
    assert failure["message"].startswith('the API server refused to create Pod "train-1" (403)')
    assert settled.retryable and settled.status["phase"] == "Creating"
    assert ("Warning", "FailedCreate") in [(e.type, e.reason) for e in settled.events]
    assert ("Normal", "CreatedPods") in [(e.type, e.reason) for e in settled.events], "rank 0 was created"


def test_a_pod_the_api_server_calls_invalid_fails_the_job_until_the_spec_is_edited() -> None:
    plan = plan_of(job(), [], now=NOW, heartbeat_key=KEY)
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

    same_spec = plan_of(job(status=settled.status), [], now=LATER, heartbeat_key=KEY)
    assert same_spec.actions == (), "the same spec is not sent again"
    assert (
        same_spec.status["phase"] == "Failed"
        and "Bad_Name" in conditions(same_spec.status)["Ready"]["message"]
    )
    edited = plan_of(job(status=settled.status, generation=2), [], now=LATER, heartbeat_key=KEY)
    assert ("create", "Pod", "train-0") in kinds(edited)


# ---- membership generations and world size ----------------------------------------------------------------


def test_changing_max_nodes_starts_a_new_generation_and_replaces_every_rank() -> None:
    first = plan_of(job(max_nodes=2), [], now=NOW, heartbeat_key=KEY)
    running = [observed(0, ready=True), observed(1, ready=True)]
    grown = plan_of(job(max_nodes=3, status=first.status), running, now=LATER, heartbeat_key=KEY)
    assert grown.status["membershipGeneration"] == 2 and grown.status["worldSize"] == 3
    assert [k for k in kinds(grown) if k[0] == "delete"] == [
        ("delete", "Pod", "train-0"),
        ("delete", "Pod", "train-1"),
    ]
    assert grown.status["phase"] == "Creating"
    assert [k for k in kinds(grown) if k[1] == "Pod" and k[0] == "create"] == [("create", "Pod", "train-2")]
    freed = plan_of(job(max_nodes=3, status=grown.status), [], now=LATER, heartbeat_key=KEY)
    created = [a.body for a in (*grown.actions, *freed.actions) if isinstance(a, reconcile.Create) and a.kind == "Pod"]
    assert sorted({_pod_env(body)["RANK"] for body in created}) == ["0", "1", "2"]
    assert {_pod_env(body)["WORLD_SIZE"] for body in created} == {"3"}
    assert {_pod_env(body)["SNEPPX_GENERATION"] for body in created} == {"2"}
    events = reconcile.events_for((), first.status["phase"], grown.status, first.status)
    assert events[0] == reconcile.Event(
        "Normal",
        "MembershipChanged",
        "membership generation 2 starts with world size 3 (was 2); ranks of generation 1 are replaced",
    )


def test_an_unchanged_size_keeps_the_generation() -> None:
    first = plan_of(job(max_nodes=2), [], now=NOW, heartbeat_key=KEY)
    again = plan_of(job(max_nodes=2, status=first.status), [observed(0)], now=LATER, heartbeat_key=KEY)
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
        step = plan_of(spec_job, pods, now=NOW, heartbeat_key=KEY)
        for action in step.actions:
            if isinstance(action, reconcile.Create) and action.kind == "Pod":
                env = _pod_env(action.body)
                assert world_of.setdefault(env["SNEPPX_GENERATION"], env["WORLD_SIZE"]) == env["WORLD_SIZE"]
        pods, status = _apply(pods, step), step.status
        step = plan_of(job(max_nodes=max_nodes, suspend=suspend, status=status), pods, now=NOW, heartbeat_key=KEY)
        for action in step.actions:
            if isinstance(action, reconcile.Create) and action.kind == "Pod":
                env = _pod_env(action.body)
                assert world_of.setdefault(env["SNEPPX_GENERATION"], env["WORLD_SIZE"]) == env["WORLD_SIZE"]
        pods, status = _apply(pods, step), step.status
        assert all(p.generation == status["membershipGeneration"] for p in pods)
        assert len(pods) == (0 if suspend else max_nodes)


# ---- finished generations -------------------------------------------------------------------------------------


def test_a_failed_generation_with_no_restart_budget_fails_with_every_exit_code_and_stops() -> None:
    pods = [
        observed(0, phase="Failed", exit_code=1, reason="Error"),
        observed(1, phase="Failed", exit_code=137, reason="OOMKilled"),
    ]
    plan = plan_of(job(max_restarts=0), pods, now=NOW, heartbeat_key=KEY)
    assert kinds(plan) == [] and plan.status["phase"] == "Failed" and plan.restarts == ()
    failed = conditions(plan.status)["Failed"]
    assert failed["reason"] == "RestartBudgetExhausted" and conditions(plan.status)["Ready"]["reason"] == failed["reason"]
    assert "rank 0 (pod train-0) failed (Error) with exit code 1; rank 1 (pod train-1) failed (OOMKilled)" in (
        failed["message"]
    )
    assert "failurePolicy.maxRestarts 0" in failed["message"]
    assert plan.status["completionTime"] == "2026-01-02T03:04:05Z"
    assert plan.status["ranks"][1] | {"uid": None} == {
        "rank": 1, "pod": "train-1", "phase": "Failed", "ready": False, "node": "node-1", "exitCode": 137,
        "reason": "OOMKilled", "uid": None,
    }
    warning = reconcile.events_for(plan.actions, "Running", plan.status)
    assert [(e.type, e.reason) for e in warning] == [("Warning", "RestartBudgetExhausted")]
    assert plan_of(job(status=plan.status), pods, now=LATER, heartbeat_key=KEY) == reconcile.Plan((), {})


def test_a_failed_generation_with_budget_left_restarts_its_ranks() -> None:
    pods = [observed(0, phase="Succeeded", exit_code=0), observed(1, phase="Failed", exit_code=2)]
    plan = plan_of(job(), pods, now=NOW, heartbeat_key=KEY)
    assert kinds(plan) == [("delete", "Pod", "train-1")]
    assert plan.status["phase"] == "Restarting"
    assert [(r.failure.rank, r.failure.exit_code, r.counted) for r in plan.restarts] == [(1, 2, True)]


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


# ---- the lifecycle: restarts, rules, budget, backoff -------------------------------------------------------


def lifecycle_job(status: dict[str, Any] | None = None, **policy: Any) -> reconcile.Job:
    base = job(status=status)
    spec = dict(base.spec)
    spec["failurePolicy"] = {"maxRestarts": 3, "restartDelay": {"initialSeconds": 10, "multiplier": 2,
                             "maxSeconds": 300}, "terminatingPodTimeoutSeconds": 60, **policy}
    return dataclasses.replace(base, spec=spec)


def settle_all(j: reconcile.Job, plan: reconcile.Plan, now: datetime.datetime = NOW) -> reconcile.Settled:
    """settle() as if every action took effect."""
    return reconcile.settle(j, plan, reconcile.Outcome(plan.actions), now=now)


RUNNING = [observed(0, ready=True), observed(1, ready=True)]


def running_status() -> dict[str, Any]:
    return plan_of(lifecycle_job(), RUNNING, now=NOW, heartbeat_key=KEY).status


def test_a_failed_rank_is_deleted_counted_once_and_replaced_after_the_restart_delay() -> None:
    status = running_status()
    failed = [observed(0, ready=True), observed(1, phase="Failed", exit_code=137, reason="Error")]
    plan = plan_of(lifecycle_job(status), failed, now=NOW, heartbeat_key=KEY)
    assert pod_actions(plan) == (reconcile.Delete("Pod", "train-1", "uid-1", "pod-uid-1"),)
    settled = settle_all(lifecycle_job(status), plan)
    assert settled.status["restartCount"] == 1 and settled.status["phase"] == "Paused", "1 of 2 is no quorum"
    (entry,) = settled.status["restartHistory"]
    assert entry == {
        "time": "2026-01-02T03:04:05Z", "reason": "PodFailed",
        "message": "rank 1 (pod train-1) failed (Error) with exit code 137",
        "membershipGeneration": 1, "counted": True, "rank": 1, "exitCode": 137, "podUid": "pod-uid-1",
    }
    assert ("Warning", "PodFailed") in [(e.type, e.reason) for e in settled.events]
    assert any("restart 1 of 3" in e.message for e in settled.events)

    # The same failed pod seen again (the delete hasn't reached the watch yet): not counted again.
    again = plan_of(lifecycle_job(settled.status), failed, now=NOW, heartbeat_key=KEY)
    assert settle_all(lifecycle_job(settled.status), again).status["restartCount"] == 1
    # Gone: the replacement waits for the restart delay (10 s for the first restart), then comes.
    gone = [observed(0, ready=True)]
    waiting = plan_of(lifecycle_job(settled.status), gone, now=NOW + datetime.timedelta(seconds=4), heartbeat_key=KEY)
    assert pod_actions(waiting) == () and waiting.wake_after == 6.0
    later = NOW + datetime.timedelta(seconds=10)
    replaced = plan_of(lifecycle_job(settled.status), gone, now=later, heartbeat_key=KEY)
    created = [a.body for a in replaced.actions if isinstance(a, reconcile.Create) and a.kind == "Pod"]
    assert [_pod_env(b)["RANK"] for b in created] == ["1"]
    assert _pod_env(created[0])["WORLD_SIZE"] == "2" and _pod_env(created[0])["SNEPPX_GENERATION"] == "1"
    assert settle_all(lifecycle_job(settled.status), replaced, later).status["restartCount"] == 1


def test_a_restart_counts_when_decided_and_a_refused_delete_is_sent_again_never_counted_again() -> None:
    status = running_status()
    failed = [observed(0, ready=True), observed(1, phase="Failed", exit_code=1)]
    plan = plan_of(lifecycle_job(status), failed, now=NOW, heartbeat_key=KEY)
    assert plan.status["restartCount"] == 1, "the decision is in the status written before the delete is sent"
    refused = reconcile.Outcome((), reconcile.Refusal(plan.actions[0], 403, "forbidden"))
    settled = reconcile.settle(lifecycle_job(status), plan, refused, now=NOW)
    assert settled.status["restartCount"] == 1 and settled.retryable
    assert conditions(settled.status)["ResourceFailure"]["reason"] == "FailedDelete"
    again = plan_of(lifecycle_job(settled.status), failed, now=LATER, heartbeat_key=KEY)
    assert pod_actions(again) == (reconcile.Delete("Pod", "train-1", "uid-1", "pod-uid-1"),)
    assert again.restarts == () and again.status["restartCount"] == 1


def test_a_pod_deleted_by_someone_else_is_a_counted_restart_once() -> None:
    status = running_status()
    plan = plan_of(lifecycle_job(status), [observed(0, ready=True)], now=NOW, heartbeat_key=KEY)
    settled = settle_all(lifecycle_job(status), plan)
    assert [(h["reason"], h["podUid"]) for h in settled.status["restartHistory"]] == [("PodDeleted", "pod-uid-1")]
    again = plan_of(lifecycle_job(settled.status), [observed(0, ready=True)], now=LATER, heartbeat_key=KEY)
    assert again.restarts == () and ("create", "Pod", "train-1") in kinds(again)


def _disrupted(rank: int, cause: str, **status: Any) -> reconcile.ObservedPod | None:
    """A pod as the API server shows it once the cluster took it away: a DisruptionTarget condition."""
    meta = {"name": f"train-{rank}", "uid": f"pod-uid-{rank}",
            "labels": {builders.LABEL_RANK: str(rank), builders.LABEL_GENERATION: "1"},
            "ownerReferences": [{"controller": True, "uid": "uid-1"}]}
    if not status:  # the Eviction API: the condition, then the delete
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    conditions = [{"type": "DisruptionTarget", "status": "True", "reason": cause}]
    return reconcile.observe_pod(meta["name"], meta, {"nodeName": "node-1", "containers": [{"name": "t"}]},
                                 {"phase": "Running", "conditions": conditions, **status})


def test_a_drained_pod_restarts_uncounted_and_the_history_says_it_was_evicted() -> None:
    """`kubectl drain` evicts through the Eviction API: the pod gets DisruptionTarget (EvictionByEvictionAPI),
    then a deletionTimestamp. A node's maintenance is no failure of the job: recorded, not counted."""
    status = running_status()
    evicted = _disrupted(1, "EvictionByEvictionAPI")
    assert evicted is not None and evicted.terminating and evicted.disruption == "EvictionByEvictionAPI"
    plan = plan_of(lifecycle_job(status), [observed(0, ready=True), evicted], now=NOW, heartbeat_key=KEY)
    settled = settle_all(lifecycle_job(status), plan)
    [entry] = settled.status["restartHistory"]
    assert (entry["reason"], entry["counted"], entry["podUid"]) == ("Evicted", False, "pod-uid-1")
    assert "EvictionByEvictionAPI" in entry["message"] and "not counted" in entry["message"]
    assert settled.status["restartCount"] == 0
    # still acted on once, with the pod gone as with it terminating
    gone = plan_of(lifecycle_job(settled.status), [observed(0, ready=True)], now=LATER, heartbeat_key=KEY)
    assert gone.restarts == () and ("create", "Pod", "train-1") in kinds(gone)


def test_a_kubelet_eviction_for_node_pressure_counts() -> None:
    """The kubelet evicts for memory or disk pressure, often the job's own doing: that restart counts."""
    status = running_status()
    evicted = _disrupted(1, "TerminationByKubelet", phase="Failed", reason="Evicted")
    assert evicted is not None and (evicted.phase, evicted.reason) == ("Failed", "Evicted")
    plan = plan_of(lifecycle_job(status), [observed(0, ready=True), evicted], now=NOW, heartbeat_key=KEY)
    [entry] = settle_all(lifecycle_job(status), plan).status["restartHistory"]
    assert (entry["reason"], entry["counted"]) == ("Evicted", True)
    assert plan.status["restartCount"] == 1


def test_the_restart_delay_grows_by_the_multiplier_up_to_the_cap() -> None:
    spec = lifecycle_job().spec
    assert [policy.restart_delay_seconds(spec, n) for n in (1, 2, 3, 5, 9)] == [10, 20, 40, 160, 300]


@pytest.mark.parametrize(
    ("rules", "code", "action"),
    [
        ([{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [3, 4]}}], 4, "FailJob"),
        ([{"action": "Ignore", "onExitCodes": {"operator": "In", "values": [143]}}], 143, "Ignore"),
        ([{"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [1, 137]}}], 137, "Restart"),
        ([{"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [1, 137]}}], 2, "FailJob"),
        ([{"action": "Ignore", "onExitCodes": {"operator": "In", "values": [2]}},
          {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [2]}}], 2, "Ignore"),
    ],
)
def test_the_first_matching_exit_code_rule_decides(rules: list[Any], code: int, action: str) -> None:
    failure = policy.RankLoss(1, "train-1", policy.POD_FAILED, "failed", code)
    assert policy.verdict({"failurePolicy": {"rules": rules}}, failure).action == action


def test_a_fail_job_rule_fails_the_job_and_stops_the_other_ranks() -> None:
    rules = [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [3]}}]
    pods = [observed(0, ready=True), observed(1, phase="Failed", exit_code=3)]
    plan = plan_of(lifecycle_job(running_status(), rules=rules), pods, now=NOW, heartbeat_key=KEY)
    assert kinds(plan) == [("delete", "Pod", "train-0")] and plan.restarts == ()
    failed = conditions(plan.status)["Failed"]
    assert failed["reason"] == "ExitCodeRule"
    assert failed["message"] == (
        "rank 1 (pod train-1) failed with exit code 3, and failurePolicy.rules[0] (FailJob on exit codes In [3]) "
        "ends the job"
    )


def test_an_ignore_rule_restarts_without_counting() -> None:
    rules = [{"action": "Ignore", "onExitCodes": {"operator": "In", "values": [143]}}]
    j = lifecycle_job(running_status(), rules=rules)
    plan = plan_of(j, [observed(0, ready=True), observed(1, phase="Failed", exit_code=143)], now=NOW, heartbeat_key=KEY)
    settled = settle_all(j, plan)
    assert settled.status["restartCount"] == 0
    assert settled.status["restartHistory"][0]["counted"] is False
    assert "not counted: failurePolicy.rules[0]" in settled.status["restartHistory"][0]["message"]


def test_the_restart_past_the_budget_fails_the_job_with_the_reason() -> None:
    status = {**running_status(), "restartCount": 3}
    pods = [observed(0, ready=True), observed(1, phase="Failed", exit_code=137)]
    plan = plan_of(lifecycle_job(status), pods, now=NOW, heartbeat_key=KEY)
    assert plan.status["phase"] == "Failed" and kinds(plan) == [("delete", "Pod", "train-0")]
    message = conditions(plan.status)["Failed"]["message"]
    assert conditions(plan.status)["Failed"]["reason"] == "RestartBudgetExhausted"
    assert "rank 1 (pod train-1) failed with exit code 137" in message and "maxRestarts 3" in message


# ---- nodes, stuck pods, hangs --------------------------------------------------------------------------------


def node(name: str, ready: bool, since: datetime.datetime = NOW) -> reconcile.ObservedNode:
    return reconcile.ObservedNode(name, ready, since)


def test_a_pod_on_a_not_ready_node_is_restarted_and_force_deleted_after_the_window() -> None:
    status = running_status()
    nodes = {"node-1": node("node-1", False)}
    plan = plan_of(lifecycle_job(status), RUNNING, now=NOW, heartbeat_key=KEY, nodes=nodes)
    assert pod_actions(plan) == (reconcile.Delete("Pod", "train-1", "uid-1", "pod-uid-1"),)
    assert plan.restarts[0].failure.reason == "NodeNotReady"
    settled = settle_all(lifecycle_job(status), plan)
    stuck = [observed(0, ready=True), dataclasses.replace(
        observed(1, ready=True, terminating=True), deleted_at=NOW + datetime.timedelta(seconds=30))]
    early = plan_of(lifecycle_job(settled.status), stuck, now=NOW + datetime.timedelta(seconds=20),
                    heartbeat_key=KEY, nodes=nodes)
    assert pod_actions(early) == () and early.wake_after == 40.0, "the window runs from when the node went NotReady"
    due = NOW + datetime.timedelta(seconds=60)
    forced = plan_of(lifecycle_job(settled.status), stuck, now=due, heartbeat_key=KEY, nodes=nodes)
    assert pod_actions(forced) == (reconcile.Delete("Pod", "train-1", "uid-1", "pod-uid-1", force=True),)
    assert settle_all(lifecycle_job(settled.status), forced, due).status["restartCount"] == 1, "not counted again"


def test_a_pod_stuck_terminating_on_a_ready_node_is_force_deleted_after_its_grace_and_the_window() -> None:
    stuck = dataclasses.replace(observed(1, terminating=True), deleted_at=NOW)
    j = lifecycle_job(running_status())
    assert pod_actions(plan_of(j, [observed(0, ready=True), stuck], now=NOW + datetime.timedelta(seconds=59),
                               heartbeat_key=KEY)) == ()
    forced = plan_of(j, [observed(0, ready=True), stuck], now=NOW + datetime.timedelta(seconds=60), heartbeat_key=KEY)
    assert reconcile.Delete("Pod", "train-1", "uid-1", "pod-uid-1", force=True) in forced.actions


def hung_view(pod: str, reported_at: str = "2026-01-02T03:04:05Z") -> reconcile.ObservedObject:
    control = builders.control_record(lifecycle_job().spec, paused=False, reason="", pod_generation=1)
    hung = job_object.HungRank(pod, 1, 4, "train-0", 1801.0, reported_at)
    return reconcile.ObservedObject("cm-uid", "uid-1", job_object.View(control=control, hung=(hung,)))


def test_a_hung_rank_reported_by_an_agent_is_deleted_with_reason_hang_and_the_report_removed() -> None:
    created = dataclasses.replace(observed(1, ready=True), created_at=NOW - datetime.timedelta(hours=1))
    pods = [observed(0, ready=True), created]
    plan = plan_of(lifecycle_job(running_status()), pods, now=NOW, heartbeat_key=KEY, rendezvous=hung_view("train-1"))
    assert plan.actions[0] == reconcile.Delete("Pod", "train-1", "uid-1", "pod-uid-1")
    (put,) = plan.actions[1:]
    assert isinstance(put, reconcile.PutRecords) and dict(put.records)["job/hung/train-1"] is None
    assert plan.restarts[0].failure.reason == "Hang"
    assert "absent from its job's generations for 1801s (reported by train-0)" in plan.restarts[0].failure.message


def test_a_hang_report_older_than_the_pod_is_removed_without_a_restart() -> None:
    fresh = dataclasses.replace(observed(1, ready=True), created_at=NOW + datetime.timedelta(seconds=5))
    plan = plan_of(lifecycle_job(running_status()), [observed(0, ready=True), fresh], now=NOW, heartbeat_key=KEY,
                   rendezvous=hung_view("train-1"))
    assert plan.actions == (reconcile.PutRecords("train-rendezvous", "uid-1", (("job/hung/train-1", None),)),)
    assert plan.restarts == ()


def test_a_hang_report_about_a_pod_the_view_has_not_seen_start_stays_until_a_pass_sees_it() -> None:
    """Seed 630 of the operator simulation: a pass whose pod view lagged the hung pod's start (not there yet, or
    still Pending) removed the report unread, and the wedged pod was never replaced."""
    created = NOW - datetime.timedelta(hours=1)
    status = plan_of(lifecycle_job(), [observed(0, ready=True)], now=NOW, heartbeat_key=KEY).status  # 1 created
    for lagging in ([observed(0, ready=True)],
                    [observed(0, ready=True), dataclasses.replace(observed(1, phase="Pending"), created_at=created)]):
        plan = plan_of(lifecycle_job(status), lagging, now=NOW, heartbeat_key=KEY, rendezvous=hung_view("train-1"))
        removed = [a for a in plan.actions
                   if isinstance(a, reconcile.PutRecords) and "job/hung/train-1" in dict(a.records)]
        assert removed == [] and plan.restarts == (), f"report removed or acted on from {lagging}"
    running = [observed(0, ready=True), dataclasses.replace(observed(1, ready=True), created_at=created)]
    plan = plan_of(lifecycle_job(status), running, now=NOW, heartbeat_key=KEY, rendezvous=hung_view("train-1"))
    assert [r.failure.reason for r in plan.restarts] == ["Hang"]


def test_a_hang_report_whose_silence_began_before_the_pod_started_does_not_replace_it() -> None:
    """A replacement pod is created (restart delay), then Pending for minutes (scheduling, an image pull); the
    agent sealing the next generation reports its name after stalled_report_after (here hangTimeout 60 s): the
    silence began after the pod's creation, but before its trainer started, so the report is not about it. On
    the pod's creation alone the report was kept while it was Pending and the pod replaced as Hang the moment it
    ran (a counted restart; the next replacement met the same, until maxRestarts)."""
    created, started = NOW - datetime.timedelta(seconds=300), NOW + datetime.timedelta(seconds=5)
    report = job_object.HungRank("train-1", 1, 4, "train-0", 60.0, "2026-01-02T03:04:05Z")  # silent since NOW-60
    control = builders.control_record(lifecycle_job().spec, paused=False, reason="", pod_generation=1)
    view = reconcile.ObservedObject("cm-uid", "uid-1", job_object.View(control=control, hung=(report,)))
    meta = {"labels": {"sneppx.io/rank": "1", "sneppx.io/membership-generation": "1"}, "uid": "pod-uid-1",
            "creationTimestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ")}
    status = {"phase": "Running", "containerStatuses": [
        {"name": "trainer", "state": {"running": {"startedAt": started.strftime("%Y-%m-%dT%H:%M:%SZ")}}}]}
    pod = reconcile.observe_pod("train-1", meta, {"containers": [{"name": "trainer"}]}, status)
    assert pod is not None
    pod = dataclasses.replace(pod, controller_uid="uid-1", node="node-1")
    plan = plan_of(lifecycle_job(running_status()), [observed(0, ready=True), pod], now=started, heartbeat_key=KEY,
                   rendezvous=view)
    assert plan.restarts == ()
    assert not any(isinstance(a, reconcile.Delete) for a in plan.actions)
    (put,) = [a for a in plan.actions if isinstance(a, reconcile.PutRecords)]
    assert dict(put.records)["job/hung/train-1"] is None  # not about this pod: it goes


# ---- quorum ----------------------------------------------------------------------------------------------------


def quorum_job(action: str, status: dict[str, Any] | None = None) -> reconcile.Job:
    j = lifecycle_job(status)
    return dataclasses.replace(j, spec={**j.spec, "quorum": {"minHealthyPercent": 51, "actionOnLoss": action}})


def test_losing_quorum_with_pause_pauses_the_agents_and_resumes_when_it_returns() -> None:
    status = plan_of(quorum_job("Pause"), RUNNING, now=NOW, heartbeat_key=KEY).status
    lost = [observed(0, ready=True), observed(1, ready=False)]
    paused = plan_of(quorum_job("Pause", status), lost, now=NOW, heartbeat_key=KEY)
    assert paused.status["phase"] == "Paused"
    assert conditions(paused.status)["Ready"]["reason"] == "QuorumLost"
    (put,) = [a for a in paused.actions if isinstance(a, reconcile.PutRecords)]
    control = dict(put.records)["job/control"]
    assert control is not None and control["paused"] is True and "quorum needs 2" in control["reason"]
    assert [e.reason for e in paused.events] == ["QuorumLost"]
    still = plan_of(quorum_job("Pause", paused.status), lost, now=LATER, heartbeat_key=KEY)
    assert still.status["phase"] == "Paused" and still.events == ()
    back = plan_of(quorum_job("Pause", paused.status), RUNNING, now=LATER, heartbeat_key=KEY)
    assert back.status["phase"] == "Running" and [e.reason for e in back.events] == ["QuorumRestored"]


def test_losing_quorum_with_restart_group_starts_a_new_generation_counted_once() -> None:
    status = plan_of(quorum_job("RestartGroup"), RUNNING, now=NOW, heartbeat_key=KEY).status
    lost = [observed(0, ready=True), observed(1, phase="Failed", exit_code=1)]
    plan = plan_of(quorum_job("RestartGroup", status), lost, now=NOW, heartbeat_key=KEY)
    assert plan.status["membershipGeneration"] == 2
    assert [k for k in kinds(plan) if k[1] == "Pod"] == [("delete", "Pod", "train-0"), ("delete", "Pod", "train-1")]
    settled = settle_all(quorum_job("RestartGroup", status), plan)
    assert settled.status["restartCount"] == 1
    assert [h["reason"] for h in settled.status["restartHistory"]] == ["QuorumLost"]


def test_losing_quorum_with_fail_fails_the_job() -> None:
    status = plan_of(quorum_job("Fail"), RUNNING, now=NOW, heartbeat_key=KEY).status
    plan = plan_of(quorum_job("Fail", status), [observed(0, ready=True), observed(1)], now=NOW, heartbeat_key=KEY)
    assert plan.status["phase"] == "Failed" and conditions(plan.status)["Failed"]["reason"] == "QuorumLost"


def test_a_job_still_starting_has_not_lost_quorum() -> None:
    plan = plan_of(quorum_job("Fail"), [observed(0, ready=True), observed(1)], now=NOW, heartbeat_key=KEY)
    assert plan.status["phase"] == "Pending"


# ---- deadline, TTL, the agents' report, scaling -------------------------------------------------------------


def test_the_active_deadline_fails_the_job_and_is_woken_for() -> None:
    j = lifecycle_job(running_status())
    j = dataclasses.replace(j, spec={**j.spec, "activeDeadlineSeconds": 600})
    before = plan_of(j, RUNNING, now=NOW + datetime.timedelta(seconds=100), heartbeat_key=KEY)
    assert before.status["phase"] == "Running" and before.wake_after == 500.0
    after = plan_of(j, RUNNING, now=NOW + datetime.timedelta(seconds=600), heartbeat_key=KEY)
    assert conditions(after.status)["Failed"]["reason"] == "DeadlineExceeded"
    assert kinds(after) == [("delete", "Pod", "train-0"), ("delete", "Pod", "train-1")]


def test_a_finished_job_is_deleted_when_its_ttl_runs_out() -> None:
    done = plan_of(job(), [observed(0, phase="Succeeded"), observed(1, phase="Succeeded")], now=NOW, heartbeat_key=KEY)
    j = dataclasses.replace(job(status=done.status), spec={**job().spec, "ttlSecondsAfterFinished": 30})
    assert plan_of(j, [], now=NOW + datetime.timedelta(seconds=10), heartbeat_key=KEY).wake_after == 20.0
    expired = plan_of(j, [], now=NOW + datetime.timedelta(seconds=30), heartbeat_key=KEY)
    assert expired.actions == (reconcile.DeleteJob("train", "uid-1"),)


def report_view(resumed: int | None, last: int = 1200) -> reconcile.ObservedObject:
    control = builders.control_record(job().spec, paused=False, reason="", pod_generation=1)
    ref = job_object.CheckpointRef
    report = job_object.Report(
        5, 2, ("train-0", "train-1"), ref(last, f"file:///c/step-{last}", "2026-01-02T03:00:00Z"),
        None if resumed is None else ref(resumed, f"file:///c/step-{resumed}", "2026-01-02T02:00:00Z"),
        "2026-01-02T03:04:00Z",
    )
    return reconcile.ObservedObject("cm-uid", "uid-1", job_object.View(control=control, report=report))


def test_rank_zeros_report_fills_the_status_and_a_rollback_is_an_event() -> None:
    plan = plan_of(job(), RUNNING, now=NOW, heartbeat_key=KEY, rendezvous=report_view(None))
    assert plan.status["lastValidCheckpoint"] == {"step": 1200, "location": "file:///c/step-1200",
                                                  "time": "2026-01-02T03:00:00Z"}
    assert plan.status["rendezvous"] == {"generation": 5, "worldSize": 2, "members": ["train-0", "train-1"],
                                         "reportedAt": "2026-01-02T03:04:00Z"}
    rolled = plan_of(job(status=plan.status), RUNNING, now=NOW, heartbeat_key=KEY, rendezvous=report_view(800, 800))
    assert [(e.type, e.reason) for e in rolled.events] == [("Warning", "RolledBack")]
    assert "rolled back past step 1200" in rolled.events[0].message
    kept = plan_of(job(status=plan.status), RUNNING, now=NOW, heartbeat_key=KEY)
    assert kept.status["lastValidCheckpoint"]["step"] == 1200, "kept when no report is there"


def test_a_min_nodes_edit_reaches_the_agents_at_the_next_generation_without_new_pods() -> None:
    status = running_status()
    edited = job(status=status, min_nodes=2)
    plan = plan_of(edited, RUNNING, now=NOW, heartbeat_key=KEY, rendezvous=reconcile.ObservedObject(
        "cm-uid", "uid-1", job_object.View(control=builders.control_record(
            job().spec, paused=False, reason="", pod_generation=1))))
    assert plan.status["membershipGeneration"] == 1
    (put,) = plan.actions
    assert isinstance(put, reconcile.PutRecords) and dict(put.records)["job/control"]["min_nodes"] == 2


def test_the_rendezvous_object_is_created_when_missing_and_someone_elses_is_not_written() -> None:
    created = plan_of(job(), RUNNING, now=NOW, heartbeat_key=KEY, rendezvous=None)
    assert kinds(created) == [("create", "ConfigMap", "train-rendezvous")]
    foreign = reconcile.ObservedObject("cm", "someone-else", job_object.View())
    assert kinds(plan_of(job(), RUNNING, now=NOW, heartbeat_key=KEY, rendezvous=foreign)) == []


NO_REPORT: Any = object()


@pytest.mark.parametrize("snapshots_on", [False, True])
@pytest.mark.parametrize("before", [None, "True", "False"])
@pytest.mark.parametrize("ranks", [NO_REPORT, None, (), (1,), (0, 1)])
def test_snapshots_protected_says_which_ranks_lack_copies_off_their_node(
        snapshots_on: bool, before: str | None, ranks: Any) -> None:
    # every combination of snapshots on/off, the condition before, and what rank 0's report says
    old = [] if before is None else [{"type": "SnapshotsProtected", "status": before, "observedGeneration": 1,
                                      "lastTransitionTime": "2026-01-01T00:00:00Z", "reason": "Before",
                                      "message": "as it was"}]
    j = job(status={**running_status(), "conditions": old})
    if snapshots_on:
        j = _with(j, checkpoint={"snapshotEveryNSteps": 10})
    view = report_view(None)
    if ranks is not NO_REPORT:
        assert view.view.report is not None
        view = dataclasses.replace(view, view=dataclasses.replace(view.view, report=dataclasses.replace(
            view.view.report, snapshot_unprotected=ranks)))
    got = [c for c in plan_of(j, RUNNING, now=NOW, heartbeat_key=KEY,
                              rendezvous=view if ranks is not NO_REPORT else None).status["conditions"]
           if c["type"] == "SnapshotsProtected"]
    if not snapshots_on:
        assert got == []
    elif ranks is NO_REPORT or ranks is None:  # nothing said: as it was
        assert got == old
    else:
        (c,) = got
        assert (c["status"], c["reason"]) == (("False", "CopiesOnSameNode") if ranks else ("True", "CopiesOffNode"))
        assert (c["lastTransitionTime"] == "2026-01-01T00:00:00Z") == (before == c["status"])
        if ranks:
            assert f"rank{'s' if len(ranks) > 1 else ''} {'0-1' if len(ranks) > 1 else '1'} have" in c["message"]


# ---- jobs failed, paused, re-run or stalled when they should not be ---------------------------------------


def _with(j: reconcile.Job, **spec: Any) -> reconcile.Job:
    merged = dict(j.spec)
    for key, value in spec.items():
        merged[key] = {**(merged.get(key) or {}), **value} if isinstance(value, dict) else value
    return dataclasses.replace(j, spec=merged)


def _ready_all(n: int, generation: int = 1) -> list[reconcile.ObservedPod]:
    return [observed(r, ready=True, generation=generation) for r in range(n)]


@pytest.mark.parametrize("action", ["Fail", "RestartGroup", "Pause"])
def test_a_resize_is_a_new_generation_not_a_quorum_loss(action: str) -> None:
    base = _with(lifecycle_job(maxRestarts=0), quorum={"actionOnLoss": action})
    running = plan_of(base, RUNNING, now=NOW, heartbeat_key=KEY).status
    assert conditions(running)["QuorumMet"]["status"] == "True"
    grown = _with(dataclasses.replace(base, status=running), elastic={"minNodes": 1, "maxNodes": 3})
    plan = plan_of(grown, RUNNING, now=LATER, heartbeat_key=KEY)
    assert plan.status["membershipGeneration"] == 2 and plan.status["phase"] == "Creating"
    assert plan.restarts == () and plan.status["restartCount"] == 0, "a resize is not a restart"
    assert "Failed" not in conditions(plan.status)
    assert not [e for e in plan.events if e.reason == "QuorumLost"]
    # The new generation's pods come up one by one: still no loss, until it has had quorum once.
    starting = plan_of(dataclasses.replace(grown, status=plan.status), [observed(0, generation=2)], now=LATER,
                       heartbeat_key=KEY)
    assert starting.status["phase"] in ("Creating", "Pending") and starting.restarts == ()
    up = plan_of(dataclasses.replace(grown, status=starting.status), _ready_all(3, 2), now=LATER, heartbeat_key=KEY)
    assert up.status["phase"] == "Running"
    lost = [observed(0, ready=True, generation=2), observed(1, generation=2), observed(2, generation=2)]
    strict = _with(dataclasses.replace(grown, status=up.status), elastic={"minNodes": 3, "maxNodes": 3})
    after = plan_of(strict, lost, now=LATER, heartbeat_key=KEY)
    assert after.status["phase"] != "Running" and (
        after.status["phase"] == "Paused" or after.status["membershipGeneration"] == 3
        or after.status["phase"] == "Failed"
    ), "once the new generation had quorum, losing it is a loss again"


def test_min_nodes_one_keeps_the_survivor_training() -> None:
    alone = job(min_nodes=1, max_nodes=2, min_healthy=0)
    running = plan_of(alone, RUNNING, now=NOW, heartbeat_key=KEY).status
    failed = [observed(0, ready=True), observed(1, phase="Failed", exit_code=1)]
    plan = plan_of(job(min_nodes=1, max_nodes=2, min_healthy=0, status=running), failed, now=NOW, heartbeat_key=KEY)
    assert plan.status["phase"] == "Restarting" and plan.status["quorum"]["met"] is True
    assert not [a for a in plan.actions if isinstance(a, reconcile.PutRecords)], "the control record stays unpaused"


def test_min_nodes_equal_to_max_nodes_pauses_on_any_loss() -> None:
    exact = job(min_nodes=2, max_nodes=2, min_healthy=0)
    running = plan_of(exact, RUNNING, now=NOW, heartbeat_key=KEY).status
    lost = [observed(0, ready=True), observed(1)]
    plan = plan_of(job(min_nodes=2, max_nodes=2, min_healthy=0, status=running), lost, now=NOW, heartbeat_key=KEY)
    assert plan.status["phase"] == "Paused"
    assert "quorum needs 2" in conditions(plan.status)["Ready"]["message"]


def test_suspend_and_resume_are_no_quorum_loss() -> None:
    failing = _with(job(min_nodes=2, max_nodes=2, min_healthy=0), quorum={"actionOnLoss": "Fail"})
    running = plan_of(failing, RUNNING, now=NOW, heartbeat_key=KEY).status
    suspended = plan_of(_with(dataclasses.replace(failing, status=running), suspend=True), RUNNING, now=NOW,
                        heartbeat_key=KEY)
    assert suspended.status["phase"] == "Suspended"
    resumed = plan_of(dataclasses.replace(failing, status=suspended.status), [], now=LATER, heartbeat_key=KEY)
    assert resumed.status["phase"] == "Creating" and resumed.status["membershipGeneration"] == 3


def test_a_finished_rank_whose_pod_is_deleted_is_not_run_again() -> None:
    j = lifecycle_job()
    first = plan_of(j, [observed(0, phase="Succeeded", exit_code=0), observed(1, ready=True)], now=NOW,
                    heartbeat_key=KEY)
    assert first.status["ranks"][0]["phase"] == "Succeeded"
    gone = plan_of(lifecycle_job(first.status), [observed(1, ready=True)], now=LATER, heartbeat_key=KEY)
    assert gone.restarts == () and ("create", "Pod", "train-0") not in kinds(gone)
    assert gone.status["ranks"][0]["phase"] == "Succeeded" and gone.status["restartCount"] == 0
    done = plan_of(lifecycle_job(gone.status), [observed(1, phase="Succeeded", exit_code=0)], now=LATER,
                   heartbeat_key=KEY)
    assert done.status["phase"] == "Succeeded"


def test_suspended_time_does_not_count_against_the_active_deadline() -> None:
    deadline = _with(lifecycle_job(), activeDeadlineSeconds=1200)
    running = plan_of(deadline, RUNNING, now=NOW, heartbeat_key=KEY).status
    ten_minutes = NOW + datetime.timedelta(minutes=10)
    suspended = plan_of(_with(dataclasses.replace(deadline, status=running), suspend=True), RUNNING,
                        now=ten_minutes, heartbeat_key=KEY).status
    three_hours = ten_minutes + datetime.timedelta(hours=3)
    resumed = plan_of(dataclasses.replace(deadline, status=suspended), [], now=three_hours, heartbeat_key=KEY)
    assert resumed.status["phase"] != "Failed"
    assert resumed.status["suspendedSeconds"] == 3 * 3600
    assert resumed.wake_after == 600.0, "10 of its 20 minutes are left"
    later = plan_of(dataclasses.replace(deadline, status=resumed.status), RUNNING,
                    now=three_hours + datetime.timedelta(minutes=10), heartbeat_key=KEY)
    assert conditions(later.status)["Failed"]["reason"] == "DeadlineExceeded"
    assert "not counting 10800s suspended" in conditions(later.status)["Failed"]["message"]


def test_forty_failures_at_once_count_forty_whatever_the_history_keeps() -> None:
    size = 40
    j = _with(lifecycle_job(maxRestarts=45), elastic={"minNodes": 1, "maxNodes": size})
    running = plan_of(j, _ready_all(size), now=NOW, heartbeat_key=KEY).status
    failed = [observed(r, phase="Failed", exit_code=1) for r in range(size)]
    first = plan_of(dataclasses.replace(j, status=running), failed, now=NOW, heartbeat_key=KEY)
    assert first.status["restartCount"] == size and len(first.status["restartHistory"]) == reconcile.MAX_HISTORY
    seen_again = plan_of(dataclasses.replace(j, status=first.status), failed, now=NOW, heartbeat_key=KEY)
    assert seen_again.status["restartCount"] == size and seen_again.restarts == ()
    gone = plan_of(dataclasses.replace(j, status=seen_again.status), [], now=LATER, heartbeat_key=KEY)
    assert gone.status["restartCount"] == size and gone.restarts == ()
    assert len(pod_actions(gone)) == size, "every rank is replaced, once"


def test_counting_starts_from_the_status_and_history_carries_across_passes() -> None:
    history = [{"time": "2026-01-01T00:00:00Z", "reason": "PodFailed", "counted": True, "podUid": f"old-{i}"}
               for i in range(3)]
    status = {**running_status(), "restartCount": 5, "restartHistory": history}
    failed = [observed(0, ready=True), observed(1, phase="Failed", exit_code=9)]
    plan = plan_of(lifecycle_job(status, maxRestarts=10), failed, now=NOW, heartbeat_key=KEY)
    assert plan.status["restartCount"] == 6
    assert [h.get("podUid") for h in plan.status["restartHistory"]] == ["old-0", "old-1", "old-2", "pod-uid-1"]
    again = plan_of(lifecycle_job(plan.status, maxRestarts=10), failed, now=LATER, heartbeat_key=KEY)
    assert again.status["restartCount"] == 6 and again.status["restartHistory"] == plan.status["restartHistory"]
    assert any("restart 6 of 10" in e.message for e in plan.events)


def test_a_dead_trainer_beside_a_live_sidecar_is_a_failed_rank() -> None:
    meta = {"uid": "p1", "labels": {"sneppx.io/rank": "1", "sneppx.io/membership-generation": "1"},
            "ownerReferences": [{"uid": "uid-1", "controller": True}]}
    spec = {"containers": [{"name": "trainer"}, {"name": "sidecar"}], "nodeName": "node-1"}
    status = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "False"}],
        "containerStatuses": [
            {"name": "trainer", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}},
            {"name": "sidecar", "state": {"running": {}}},
        ],
    }
    pod = reconcile.observe_pod("train-1", meta, spec, status)
    assert pod is not None and (pod.phase, pod.exit_code) == ("Failed", 1)
    plan = plan_of(lifecycle_job(running_status()), [observed(0, ready=True), pod], now=NOW, heartbeat_key=KEY)
    assert pod_actions(plan) == (reconcile.Delete("Pod", "train-1", "uid-1", "p1"),)
    assert plan.restarts[0].failure.exit_code == 1
    done = dict(status, containerStatuses=[
        {"name": "trainer", "state": {"terminated": {"exitCode": 0}}}, {"name": "sidecar", "state": {"running": {}}}])
    finished = reconcile.observe_pod("train-1", meta, spec, done)
    assert finished is not None and finished.phase == "Succeeded", "the rank is its trainer"
    evicted = reconcile.observe_pod("train-1", meta, spec, {
        "phase": "Failed", "reason": "Evicted",
        "containerStatuses": [{"name": "trainer", "state": {"terminated": {"exitCode": 137, "reason": "Error"}}}]})
    assert evicted is not None and evicted.reason == "Evicted"


def test_ignored_exits_are_paced_by_the_restart_delay_too() -> None:
    rules = [{"action": "Ignore", "onExitCodes": {"operator": "In", "values": [42]}}]
    status = running_status()
    now = NOW
    waits = []
    for attempt in range(4):  # crash, wait, replaced, crash again...
        pod = f"pod-{attempt}"
        up = [observed(0, ready=True), dataclasses.replace(observed(1, ready=True), uid=pod)]
        status = plan_of(lifecycle_job(status, rules=rules), up, now=now, heartbeat_key=KEY).status
        crashed = [observed(0, ready=True), dataclasses.replace(observed(1, phase="Failed", exit_code=42), uid=pod)]
        plan = plan_of(lifecycle_job(status, rules=rules), crashed, now=now, heartbeat_key=KEY)
        assert plan.status["restartCount"] == 0 and len(plan.restarts) == 1
        gone = plan_of(lifecycle_job(plan.status, rules=rules), [observed(0, ready=True)], now=now, heartbeat_key=KEY)
        assert not [a for a in gone.actions if isinstance(a, reconcile.Create) and a.kind == "Pod"]
        waits.append(gone.wake_after)
        now = now + datetime.timedelta(seconds=gone.wake_after or 0)
        replaced = plan_of(lifecycle_job(gone.status, rules=rules), [observed(0, ready=True)], now=now,
                           heartbeat_key=KEY)
        assert [a for a in replaced.actions if isinstance(a, reconcile.Create) and a.kind == "Pod"]
        status = replaced.status
    assert waits == [10.0, 20.0, 40.0, 80.0], "exponential, like a kubelet's CrashLoopBackOff"
    assert status["restartStreak"] == 4


def test_the_backoff_starts_again_after_the_job_ran_healthy_long_enough() -> None:
    j = lifecycle_job()  # maxSeconds 300: reset after 600 s Ready
    status = {**plan_of(j, RUNNING, now=NOW, heartbeat_key=KEY).status, "restartStreak": 5}
    failed = [observed(0, ready=True), observed(1, phase="Failed", exit_code=1)]
    soon = plan_of(lifecycle_job(status), failed, now=NOW + datetime.timedelta(seconds=599), heartbeat_key=KEY)
    assert soon.status["restartStreak"] == 6
    later = plan_of(lifecycle_job(status), failed, now=NOW + datetime.timedelta(seconds=600), heartbeat_key=KEY)
    assert later.status["restartStreak"] == 1


# ---- status that must fit and must be writable -----------------------------------------------------------


def test_a_thousand_ranks_failing_at_once_make_a_bounded_status() -> None:
    size = 1024
    j = _with(lifecycle_job(maxRestarts=0), elastic={"minNodes": 1, "maxNodes": size})
    running = plan_of(j, _ready_all(size), now=NOW, heartbeat_key=KEY).status
    failed = [observed(r, phase="Failed", exit_code=137, reason="OOMKilled") for r in range(size)]
    plan = plan_of(dataclasses.replace(j, status=running), failed, now=NOW, heartbeat_key=KEY)
    message = conditions(plan.status)["Failed"]["message"]
    assert plan.status["phase"] == "Failed" and len(message) <= reconcile.MAX_MESSAGE_CHARS
    assert "and 1016 more (ranks 8-1023)" in message
    for c in plan.status["conditions"]:
        assert len(c["message"]) <= 32768
    restarting = plan_of(_with(dataclasses.replace(j, status=running), failurePolicy={"maxRestarts": 5000},
                               ), [*failed[:400], *_ready_all(size)[400:]], now=NOW, heartbeat_key=KEY)
    assert conditions(restarting.status)["Ready"]["message"] == "replacing the pods of ranks 0-399"


def test_describe_ranks_is_bounded() -> None:
    assert reconcile.describe_ranks([3, 1, 2, 7, 9, 10]) == "1-3, 7, 9-10"
    assert reconcile.describe_ranks(range(0, 100, 2), limit=3) == "0, 2, 4, and 47 more"


def test_the_status_patch_removes_what_is_gone_with_nulls_at_any_depth() -> None:
    before = {"rendezvous": {"generation": 3, "problems": ["job/report: bad"]}, "completionTime": "t", "phase": "A"}
    after = {"rendezvous": {"generation": 3}, "phase": "A"}
    assert reconcile.status_patch(before, after) == {"rendezvous": {"problems": None}, "completionTime": None}
    assert reconcile.status_patch(after, after) == {}


def test_rendezvous_problems_are_cleared_once_the_record_is_fixed() -> None:
    control = builders.control_record(job().spec, paused=False, reason="", pod_generation=1)
    broken = reconcile.ObservedObject("cm", "uid-1", job_object.View(control=control, problems=("job/report: x",)))
    first = plan_of(job(), RUNNING, now=NOW, heartbeat_key=KEY, rendezvous=broken)
    assert first.status["rendezvous"]["problems"] == ["job/report: x"]
    fixed = plan_of(job(status=first.status), RUNNING, now=LATER, heartbeat_key=KEY)
    assert reconcile.status_patch(first.status, fixed.status) == {"rendezvous": None}, "nothing else was in it"
    reported = plan_of(job(status=first.status), RUNNING, now=LATER, heartbeat_key=KEY,
                       rendezvous=report_view(None))
    assert reconcile.status_patch(first.status, reported.status)["rendezvous"]["problems"] is None
