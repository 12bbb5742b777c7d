"""One whole pass of the operator (handlers.reconcile_job) against a cluster model, killed between every two API
calls: whatever the crash point, a fresh operator (no memory, as after a restart) ends where an uninterrupted
one does, with every restart decided once and counted once.

The model stands in for the API server at the boundary of k8s.py (a unit test may fake a boundary); the same
property is checked against the real API server, with real SIGKILLs, in tests/k8s/test_operator_ha.py.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import hypothesis
import pytest
from hypothesis import strategies as st

from SneppX_ALG.contract import job_object
from sneppx_operator import handlers, k8s, reconcile

KEY = ("ns", "train")


class Crash(BaseException):
    """The operator process dies here (BaseException: nothing in the pass may catch it)."""


def _merge(target: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """RFC 7386, as the API server applies a merge patch."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


@dataclasses.dataclass
class Indexes:
    pods: dict[tuple[str, str], list[reconcile.ObservedPod]]
    nodes: dict[str, list[reconcile.ObservedNode]]
    rendezvous: dict[tuple[str, str], list[reconcile.ObservedObject]]


class Cluster:
    """Just enough of a cluster for the pass: the job (with resourceVersion preconditions on its status), its
    pods (a delete removes a pod at once), its rendezvous object, and a kubelet that starts pods."""

    def __init__(self, spec: Mapping[str, Any]):
        self.job: dict[str, Any] = {
            "metadata": {"name": "train", "namespace": "ns", "uid": "uid-1", "generation": 1, "resourceVersion": "1"},
            "spec": copy.deepcopy(dict(spec)),
            "status": {},
        }
        self.pods: dict[str, reconcile.ObservedPod] = {}
        self.rendezvous: reconcile.ObservedObject | None = None
        self.data: dict[str, str] = {}  # the rendezvous ConfigMap's
        self.uids = itertools.count(1)
        self.writes = 0
        self.reads = 0
        self.lists = 0
        self.created = 0
        self.crash_at: int | None = None

    def _write(self) -> None:
        self.writes += 1
        if self.crash_at is not None and self.writes == self.crash_at:
            raise Crash()

    # -- what k8s.py would do --

    def read_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        return copy.deepcopy(self.job)

    def list_pods(self, namespace: str, name: str) -> list[reconcile.ObservedPod]:
        self.lists += 1
        return list(self.pods.values())

    def patch_job_status(self, namespace: str, name: str, uid: str, version: str, patch: Mapping[str, Any]) -> str:
        if not patch:
            return version
        self._write()
        if version != self.job["metadata"]["resourceVersion"]:
            raise k8s.StatusConflict("moved on")
        _merge(self.job["status"], patch)
        self.job["metadata"]["resourceVersion"] = str(int(version) + 1)
        return self.job["metadata"]["resourceVersion"]

    def apply(self, namespace: str, actions: Sequence[reconcile.Action]) -> reconcile.Outcome:
        done: list[reconcile.Action] = []
        for action in actions:
            self._write()
            if isinstance(action, reconcile.Create) and action.kind == "Pod":
                labels = action.body["metadata"]["labels"]
                if action.name in self.pods:
                    continue
                self.created += 1
                self.pods[action.name] = reconcile.ObservedPod(
                    action.name, int(labels["sneppx.io/rank"]), int(labels["sneppx.io/membership-generation"]),
                    "Pending", False, False, "node-0", uid=f"pod-{next(self.uids)}", controller_uid="uid-1",
                )
            elif isinstance(action, reconcile.Create) and action.kind == "ConfigMap":
                self._set_control(action.body["data"])
            elif isinstance(action, reconcile.Delete) and action.kind == "Pod":
                pod = self.pods.get(action.name)
                if pod is None or pod.uid != action.uid:
                    continue
                del self.pods[action.name]
            elif isinstance(action, reconcile.PutRecords):
                self._set_control({job_object.data_key(k): job_object.encode_value(k, v)
                                   for k, v in action.records if v is not None})
            done.append(action)
        return reconcile.Outcome(tuple(done))

    def _set_control(self, data: Mapping[str, str]) -> None:
        self.data.update(data)
        self.rendezvous = reconcile.ObservedObject("cm-uid", "uid-1", job_object.read_view(self.data),
                                                   "train-rendezvous")

    # -- the world --

    def kubelet(self) -> None:
        """Pods that were created start and become ready."""
        for name, pod in self.pods.items():
            if pod.phase == "Pending":
                self.pods[name] = dataclasses.replace(pod, phase="Running", ready=True)

    def fail(self, rank: int, exit_code: int) -> None:
        name = f"train-{rank}"
        self.pods[name] = dataclasses.replace(self.pods[name], phase="Failed", ready=False, exit_code=exit_code)

    def indexes(self) -> Indexes:
        return Indexes({KEY: list(self.pods.values())}, {}, {KEY: [self.rendezvous]} if self.rendezvous else {})

    def outcome(self) -> dict[str, Any]:
        status = self.job["status"]
        return {
            "phase": status.get("phase"),
            "restartCount": status.get("restartCount"),
            "membershipGeneration": status.get("membershipGeneration"),
            "history": [(h["reason"], h.get("exitCode"), h["counted"], h.get("rank")) for h in
                        status.get("restartHistory") or []],
            "pods": sorted((p.name, p.phase, p.generation) for p in self.pods.values()),
            "pods_created": self.created,
        }


@pytest.fixture
def fake_api(monkeypatch: pytest.MonkeyPatch) -> list[Cluster]:
    """Routes k8s.py's calls to whichever Cluster the test appends."""
    clusters: list[Cluster] = []
    for name in ("read_job", "list_pods", "patch_job_status", "apply"):
        monkeypatch.setattr(k8s, name, lambda *a, _name=name, **kw: getattr(clusters[-1], _name)(*a, **kw))
    monkeypatch.setattr(k8s, "post_events", lambda *a, **kw: None)
    handlers.new_term()  # a new operator: it trusts no index yet
    return clusters


def _run(cluster: Cluster, passes: int = 12) -> None:
    """Passes until nothing changes (a fresh 'operator' each time: the pass keeps no memory)."""
    for _ in range(passes):
        before = cluster.writes
        try:
            handlers.reconcile_job(KEY, cluster.indexes())  # type: ignore[arg-type]
        except k8s.StatusConflict:
            pass
        cluster.kubelet()
        if cluster.writes == before:
            return
    raise AssertionError(f"no steady state after {passes} passes: {cluster.outcome()}")


def _spec(max_restarts: int, rules: list[Any] | None = None, min_nodes: int = 1, on_loss: str = "Pause") -> dict[str, Any]:
    return {
        "template": {"spec": {"containers": [{"name": "trainer", "image": "example.org/t:1"}]}},
        "elastic": {"minNodes": min_nodes, "maxNodes": 2},
        "quorum": {"actionOnLoss": on_loss},
        "checkpoint": {"storage": {"pvc": {"claimName": "ckpt"}}},
        "failurePolicy": {"maxRestarts": max_restarts, "rules": rules or [],
                          "restartDelay": {"initialSeconds": 0, "multiplier": 2, "maxSeconds": 0}},
    }


IGNORE_42 = [{"action": "Ignore", "onExitCodes": {"operator": "In", "values": [42]}}]
SCENARIOS = {
    "ignored exit 42 with maxRestarts 0": (_spec(0, IGNORE_42), 42),
    "a counted restart": (_spec(1), 1),
    "the budget runs out": (_spec(0), 1),
    "quorum lost, the group restarts": (_spec(1, min_nodes=2, on_loss="RestartGroup"), 1),
}


def _scenario(clusters: list[Cluster], spec: dict[str, Any], exit_code: int, crash_at: int | None) -> Cluster:
    cluster = Cluster(spec)
    clusters.append(cluster)
    _run(cluster)  # the job runs
    assert cluster.job["status"]["phase"] == "Running"
    cluster.fail(1, exit_code)
    cluster.writes = 0
    cluster.crash_at = crash_at
    try:
        _run(cluster)
    except Crash:
        cluster.crash_at = None  # a new operator process
        _run(cluster)
    return cluster


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_an_operator_killed_between_any_two_api_calls_ends_where_an_uninterrupted_one_does(
    fake_api: list[Cluster], name: str
) -> None:
    spec, exit_code = SCENARIOS[name]
    expected = _scenario(fake_api, spec, exit_code, None)
    calls = expected.writes
    assert calls >= 2, "the restart takes several API calls"
    expected_outcome = expected.outcome()
    if name.startswith("ignored"):
        assert expected_outcome["restartCount"] == 0 and expected_outcome["phase"] == "Running"
        assert expected_outcome["history"] == [("PodFailed", 42, False, 1)]
    for crash_at in range(1, calls + 1):
        got = _scenario(fake_api, spec, exit_code, crash_at)
        assert got.outcome() == expected_outcome, f"killed before API call {crash_at} of {calls}"


def test_no_write_leaves_a_replica_that_may_not_act(monkeypatch: pytest.MonkeyPatch) -> None:
    """k8s.py asks the fence (the leader election's check) before every write it sends."""
    from sneppx_operator import leader

    def refuse() -> None:
        raise leader.NotLeaderError("not the leader")

    def no_api(*_: Any, **__: Any) -> Any:
        raise AssertionError("a write reached the API client")

    monkeypatch.setattr(k8s, "_calls", no_api)
    monkeypatch.setattr(k8s, "_core", no_api)
    monkeypatch.setattr(k8s, "_read_meta", lambda *a: {"uid": "cm", "ownerReferences": [
        {"uid": "uid-1", "controller": True}]})
    monkeypatch.setattr(k8s, "read_job", lambda *a: {"metadata": {"uid": "uid-1", "finalizers": ["f"]}})
    monkeypatch.setattr(k8s.kubernetes.client, "CustomObjectsApi", no_api)
    k8s.set_fence(refuse)
    try:
        body = {"kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}}
        writes = [
            lambda: k8s.create(body),
            lambda: k8s.delete("ns", reconcile.Delete("Pod", "p", "uid-1", "pod-uid")),
            lambda: k8s.put_records("ns", reconcile.PutRecords("cm", "uid-1", (("job/control", None),))),
            lambda: k8s.delete_job("ns", reconcile.DeleteJob("train", "uid-1")),
            lambda: k8s.drop_finalizer("ns", reconcile.DropFinalizer("train", "uid-1", "f")),
            lambda: k8s.patch_job_status("ns", "train", "uid-1", "1", {"phase": "Running"}),
            lambda: k8s.post_events(reconcile.Job("train", "ns", "uid-1", 1, {}, {}),
                                    [reconcile.Event("Normal", "X", "y")]),
        ]
        for write in writes:
            with pytest.raises(leader.NotLeaderError):
                write()
    finally:
        k8s.set_fence(None)


def test_a_group_restart_is_shown_restarting_and_its_recovery_reaches_the_histogram(
    fake_api: list[Cluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38, defect 8: a RestartGroup restart showed phase Creating, so sneppx_job_recovery_seconds never
    observed its recovery."""
    import prometheus_client

    from sneppx_operator import metrics

    def observed() -> float:
        return prometheus_client.REGISTRY.get_sample_value("sneppx_job_recovery_seconds_count") or 0.0

    phases: list[str] = []
    record = metrics.record_pass

    def recording(namespace: str, job: str, status: Mapping[str, Any], *rest: Any) -> None:
        if status:
            phases.append(status["phase"])
        record(namespace, job, status, *rest)

    monkeypatch.setattr(metrics, "record_pass", recording)
    before = observed()
    cluster = _scenario(fake_api, *SCENARIOS["quorum lost, the group restarts"], None)
    assert cluster.job["status"]["membershipGeneration"] == 2 and cluster.job["status"]["phase"] == "Running"
    after_failure = phases[phases.index("Running") + 1:]
    assert after_failure and set(after_failure) == {"Restarting", "Running"}, phases
    assert observed() == before + 1


def _agents_minute(ranks: int, late: int) -> list[dict[str, str]]:
    """The rendezvous object's data after each write of one minute of a job of `ranks` agents (the
    rendezvous' own timings: lease_timeout 30 s, poll_max 1 s): every agent joins generation 1, the sealer
    renews its record every second until it seals at 5 s, rank 0 reports at 6 s; then node 0 renews `alive`
    and `late` agents waiting for the next generation renew their joins every lease_timeout / 4 (7.5 s); an
    agent reports a hung peer at 30 s."""
    data: dict[str, str] = {}
    states: list[dict[str, str]] = []

    def write(key: str, value: Any) -> None:
        data[job_object.data_key(key)] = value if isinstance(value, str) else job_object.encode_value(key, value)
        states.append(dict(data))

    for agent in range(ranks):
        write(f"rdzv/r/g000000001/join/agent-{agent:03d}", f'{{"incarnation": 1, "at": {agent}}}')
    for second in range(5):
        write("rdzv/r/g000000001/sealer", f'{{"renewed": {second}}}')
    write("rdzv/r/g000000001/membership", '{"members": "..."}')
    report = {"version": job_object.RECORD_VERSION, "kind": "report", "generation": 1, "world_size": ranks,
              "members": [f"train-{r}" for r in range(ranks)], "last_valid_checkpoint": None, "resumed_from": None,
              "reported_at": "2026-01-02T03:04:11Z"}
    write(job_object.REPORT_KEY, report)
    for tick in range(1, 8):  # 7.5 s .. 52.5 s
        write("rdzv/r/g000000001/alive", f'{{"renewed": {tick}}}')
        for agent in range(late):
            write(f"rdzv/r/g000000002/join/agent-{ranks + agent:03d}", f'{{"renewed": {tick}}}')
        if tick == 4:
            write(job_object.hung_key("train-7"), {
                "version": job_object.RECORD_VERSION, "kind": "hung", "pod": "train-7", "rank": 7, "generation": 1,
                "silent_seconds": 40.0,
                "reported_by": "train-0", "reported_at": "2026-01-02T03:04:35Z"})
    return states


def test_agent_record_renewals_do_not_make_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 38's suspicion, confirmed and fixed: every write of the agents to the rendezvous object poked the
    job's loop, and each poke is a pass with a GET of the job (the loop runs at most one pass per 0.2 s, so a
    64-rank job forming a generation made up to 300 passes a minute). Now only a change in what a pass reads
    (the report, hung reports, the control record, a record that doesn't parse) pokes: 64 ranks with 8 late
    joiners, a minute of their traffic, 3 pokes (its first sight, the report, the hung report) of 135 writes."""
    import asyncio

    pokes: list[tuple[str, str]] = []
    monkeypatch.setattr(handlers.LOOPS, "poke", pokes.append)
    meta = {"uid": "cm-uid", "ownerReferences": [{"uid": "uid-1", "controller": True}]}
    states = _agents_minute(ranks=64, late=8)

    async def deliver() -> None:
        for data in states:
            await handlers.rendezvous_changed(
                event={"type": "MODIFIED"}, namespace="ns", labels={"sneppx.io/job": "train"}, meta=meta,
                body={"data": data})

    asyncio.run(deliver())
    assert len(states) == 135
    last = reconcile.observe_rendezvous(meta, states[-1]).view
    assert last.report is not None and [h.pod for h in last.hung] == ["train-7"] and not last.problems
    assert pokes == [KEY] * 3, f"{len(pokes)} pokes for {len(states)} writes"


def test_a_steady_jobs_pass_costs_one_read_and_no_write(fake_api: list[Cluster]) -> None:
    """What each pass costs a running 64-rank job whose pods and records did not change: the GET of the job,
    nothing else. With the test above: about 6 resync passes a minute (resyncSeconds 10) plus one per change
    of what a pass reads, where every agent write was one."""
    cluster = Cluster({**_spec(0), "elastic": {"minNodes": 64, "maxNodes": 64}})
    fake_api.append(cluster)
    _run(cluster)
    assert cluster.job["status"]["phase"] == "Running" and len(cluster.pods) == 64
    reads, writes = cluster.reads, cluster.writes
    handlers.reconcile_job(KEY, cluster.indexes())  # type: ignore[arg-type]
    assert (cluster.reads - reads, cluster.writes - writes) == (1, 0)


def test_a_new_leader_whose_watch_lags_the_status_restarts_no_healthy_rank(fake_api: list[Cluster]) -> None:
    """Issue 38, defect 5: the previous leader replaced rank 1; the new leader's watch still shows neither the
    old pod (deleted) nor its replacement. Planning from that index counted a phantom PodDeleted and deleted
    the healthy replacement once the index caught up; the pass must list the pods fresh instead."""
    cluster = Cluster(_spec(5))
    fake_api.append(cluster)
    _run(cluster)
    cluster.fail(1, 1)
    _run(cluster)  # the previous leader: rank 1 replaced, the job running
    expected = cluster.outcome()
    assert expected["restartCount"] == 1 and expected["phase"] == "Running"
    lagging = cluster.indexes()
    lagging.pods[KEY] = [p for p in lagging.pods[KEY] if p.rank != 1]  # between the delete's and create's events
    handlers.new_term()  # this replica takes over
    listed = cluster.lists
    handlers.reconcile_job(KEY, lagging)  # type: ignore[arg-type]
    assert cluster.lists == listed + 1, "the pass asked the API server"
    _run(cluster)
    assert cluster.outcome() == expected


def test_an_index_that_caught_up_is_trusted_with_no_list_per_pass(fake_api: list[Cluster]) -> None:
    cluster = Cluster(_spec(5))
    fake_api.append(cluster)
    _run(cluster)
    first = cluster.lists
    assert first >= 1, "a new operator's first pass lists the pods"
    cluster.fail(1, 1)
    _run(cluster)
    assert cluster.lists == first, "an index that caught up with the list and agrees with the status is trusted"


def test_a_rendezvous_object_relabelled_to_the_job_is_never_read(fake_api: list[Cluster]) -> None:
    """Issue 38, defect 3: another job's agent relabels its own rendezvous object to this job, with a hang
    report about this job's healthy rank 1. The pass reads only the job's own object (its name, its controller),
    so nothing is restarted, and a job that finds only the foreign object still makes its own."""
    report = job_object.HungRank("train-1", 1, 1, "other-0", 600.0, "2030-01-01T00:00:00Z")
    foreign = reconcile.ObservedObject("cm-x", "uid-other", job_object.View(hung=(report,)), "other-rendezvous")
    cluster = Cluster(_spec(5))
    fake_api.append(cluster)
    indexes = cluster.indexes()
    indexes.rendezvous[KEY] = [foreign]
    handlers.reconcile_job(KEY, indexes)  # type: ignore[arg-type]
    assert cluster.rendezvous is not None, "the job made its own rendezvous object"
    _run(cluster)
    expected = cluster.outcome()
    indexes = cluster.indexes()
    indexes.rendezvous[KEY] = [foreign, *indexes.rendezvous[KEY]]  # listed first
    handlers.reconcile_job(KEY, indexes)  # type: ignore[arg-type]
    _run(cluster)
    assert cluster.outcome() == expected, "a foreign report restarted nothing"
    assert expected["restartCount"] in (0, None)


@hypothesis.settings(max_examples=150, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(st.lists(st.tuples(st.sampled_from(["pass", "fail", "takeover"]), st.integers(0, 7)),
                           max_size=40))
def test_passes_from_lagging_watch_indexes_count_each_real_failure_once(schedule: list[tuple[str, int]]) -> None:
    """Passes plan from a watch index that lags the cluster by a random number of changes (never going back for
    one replica; a takeover starts a new replica's index anywhere behind): each real failure is counted once, no
    phantom restart, no healthy pod deleted. The exact oracle: the failures the schedule injected."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _lagging_schedule(monkeypatch, schedule)


def _lagging_schedule(monkeypatch: pytest.MonkeyPatch, schedule: list[tuple[str, int]]) -> None:
    cluster = Cluster(_spec(100))
    handlers.new_term()
    for name in ("read_job", "list_pods", "patch_job_status", "apply"):
        monkeypatch.setattr(k8s, name, getattr(cluster, name))
    monkeypatch.setattr(k8s, "post_events", lambda *a, **kw: None)
    deleted_healthy: list[str] = []
    apply = cluster.apply

    def watched_apply(namespace: str, actions: Sequence[reconcile.Action]) -> reconcile.Outcome:
        for action in actions:
            pod = cluster.pods.get(action.name)
            deleting = isinstance(action, reconcile.Delete) and pod is not None and pod.uid == action.uid
            if deleting and pod is not None and pod.phase != "Failed":
                deleted_healthy.append(pod.name)
        return apply(namespace, actions)

    monkeypatch.setattr(k8s, "apply", watched_apply)
    _run(cluster)
    history = [dict(cluster.pods)]  # every state the pods were in, oldest first: what a watch replays
    seen = len(history) - 1
    failures = 0
    for what, arg in schedule:
        if what == "fail":
            running = sorted(n for n, p in cluster.pods.items() if p.phase == "Running")
            if running:
                cluster.fail(int(cluster.pods[running[arg % len(running)]].rank), 1)
                failures += 1
        elif what == "takeover":
            seen = max(0, len(history) - 1 - arg)  # the new replica's index: some changes behind
            handlers.new_term()
        else:
            seen = min(len(history) - 1, seen + arg % 3)  # the watch catches up by a few changes
            indexes = cluster.indexes()
            indexes.pods[KEY] = list(history[seen].values())
            try:
                handlers.reconcile_job(KEY, indexes)  # type: ignore[arg-type]
            except k8s.StatusConflict:
                pass
            cluster.kubelet()
        if history[-1] != cluster.pods:
            history.append(dict(cluster.pods))
    _run(cluster)
    assert deleted_healthy == []
    status = cluster.job["status"]
    assert (status.get("restartCount") or 0) == failures, status.get("restartHistory")
    assert all(h["reason"] == "PodFailed" for h in status.get("restartHistory") or [])
