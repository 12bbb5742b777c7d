"""The operator's lifecycle against the real API server, with pods that really run (tests/k8s/pod_runner.py).

Each rank is a real process (tests/k8s/rank_standin.py) that authenticates as its job's ServiceAccount with a
token from the TokenRequest API; failures are real: a SIGKILL, an exit code, a node whose processes die and
whose pods stay Terminating. The operator runs in this process (kopf.testing.KopfRunner), the test namespace
enforces the restricted Pod Security profile.
"""

from __future__ import annotations

import json
import pathlib
import signal
import time
from typing import Any

import k8s_cluster
import k8s_helpers
import kopf.testing
import kubernetes
import pod_runner
import pytest
import yaml
from k8s_helpers import create, events, reason, running_pods, wait_running, wait_status

from SneppX_ALG.contract import job_object

pytestmark = pytest.mark.k8s

STANDIN = str(pathlib.Path(__file__).with_name("rank_standin.py"))
TIMEOUT = k8s_helpers.TIMEOUT


def standin_job(name: str, *args: str, max_nodes: int = 2, min_nodes: int = 1, **spec: Any) -> dict[str, Any]:
    job = k8s_helpers.valid_job(name, max_nodes=max_nodes, min_nodes=min_nodes)
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["command"] = ["python", STANDIN, *args]
    job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 5
    policy = {"restartDelay": {"initialSeconds": 0, "multiplier": 2, "maxSeconds": 1}}
    policy.update(spec.pop("failurePolicy", {}))
    job["spec"]["failurePolicy"] = policy
    job["spec"].update(spec)
    return job


def test_a_sigkilled_rank_is_replaced_and_restarts_shows_one(
    api: kubernetes.client.ApiClient, cluster: k8s_cluster.Cluster, namespace: str,
    operator: kopf.testing.KopfRunner, pods: pod_runner.PodRunner,
) -> None:
    create(api, namespace, standin_job("kill", "--report-step", "1200", max_nodes=2))
    wait_running(api, namespace, "kill")
    old = {p.metadata.name: p.metadata.uid for p in running_pods(api, namespace, "kill")}
    pods.kill("kill-1", signal.SIGKILL)
    after = wait_status(api, namespace, "kill", "the replacement Running",
                        lambda s: s.get("restartCount") == 1 and s.get("phase") == "Running" and s.get("readyNodes") == 2)
    (entry,) = after["restartHistory"]
    assert (entry["reason"], entry["rank"], entry["exitCode"], entry["podUid"]) == (
        "PodFailed", 1, 137, old["kill-1"])
    new = {p.metadata.name: p.metadata.uid for p in running_pods(api, namespace, "kill")}
    assert new["kill-0"] == old["kill-0"], "the survivor keeps running"
    assert new["kill-1"] != old["kill-1"]
    table = k8s_helpers.wait_for(
        lambda: (out := cluster.kubectl("get", "etj", "kill", "-n", namespace).stdout) and "1200" in out and out,
        "kubectl get etj to show the last valid step", TIMEOUT)
    header, row = (line.split() for line in table.strip().splitlines())
    assert header[:5] == ["NAME", "PHASE", "READY", "RESTARTS", "LAST-VALID-STEP"]
    assert row[:5] == ["kill", "Running", "2/2", "1", "1200"]
    assert any(r == "PodFailed" and "restart 1 of 3" in m for r, m in events(api, namespace, "kill"))


def test_a_pod_stuck_terminating_on_a_not_ready_node_is_force_deleted_after_the_window_and_replaced(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner,
    pods: pod_runner.PodRunner,
) -> None:
    create(api, namespace, standin_job("node", max_nodes=2, failurePolicy={"terminatingPodTimeoutSeconds": 3}))
    wait_running(api, namespace, "node")
    lost = running_pods(api, namespace, "node")[1]
    pods.set_node_ready(lost.spec.node_name, False)
    core = kubernetes.client.CoreV1Api(api)
    k8s_helpers.wait_for(lambda: core.read_namespaced_pod(lost.metadata.name, namespace).metadata.deletion_timestamp,
                         "the operator to delete the pod on the NotReady node", TIMEOUT)
    after = wait_status(api, namespace, "node", "the replacement Running on another node",
                        lambda s: s.get("phase") == "Running" and s.get("readyNodes") == 2 and s.get("restartCount"))
    assert [h["reason"] for h in after["restartHistory"]] == ["NodeNotReady"]
    replacement = running_pods(api, namespace, "node")[1]
    assert replacement.metadata.uid != lost.metadata.uid and replacement.spec.node_name != lost.spec.node_name
    assert any(r == "ForceDeletedPods" for r, _ in events(api, namespace, "node"))


def test_an_exit_code_rule_fail_job_fails_the_job_and_stops_the_other_rank(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner,
    pods: pod_runner.PodRunner,
) -> None:
    rules = [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [3]}}]
    create(api, namespace, standin_job("rule", "--exit-code", "3", "--rank", "1", "--after", "2",
                                       failurePolicy={"rules": rules}))
    failed = wait_status(api, namespace, "rule", "phase Failed", lambda s: s.get("phase") == "Failed")
    assert reason(failed, "Failed") == "ExitCodeRule"
    assert "exit code 3, and failurePolicy.rules[0] (FailJob on exit codes In [3]) ends the job" in next(
        c["message"] for c in failed["conditions"] if c["type"] == "Failed")
    assert failed.get("restartCount", 0) == 0
    k8s_helpers.wait_for(lambda: "SIGTERM" in pods.log_of("rule-0"), "rank 0 stopped with SIGTERM", TIMEOUT)


def test_max_restarts_exhausted_fails_the_job_with_the_reason(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner,
    pods: pod_runner.PodRunner,
) -> None:
    create(api, namespace, standin_job("budget", "--exit-code", "1", "--rank", "1", "--after", "1",
                                       failurePolicy={"maxRestarts": 1}))
    failed = wait_status(api, namespace, "budget", "phase Failed", lambda s: s.get("phase") == "Failed")
    assert reason(failed, "Failed") == "RestartBudgetExhausted"
    message = next(c["message"] for c in failed["conditions"] if c["type"] == "Failed")
    assert "rank 1 (pod budget-1) failed (Error) with exit code 1" in message
    assert "failurePolicy.maxRestarts 1" in message
    assert failed["restartCount"] == 1 and [h["exitCode"] for h in failed["restartHistory"]] == [1]


def test_quorum_lost_with_pause_tells_the_ranks_to_pause_and_resumes_when_the_node_returns(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner,
    pods: pod_runner.PodRunner,
) -> None:
    create(api, namespace, standin_job("quorum", max_nodes=2, min_nodes=2,  # the agents can't go on alone
                                       failurePolicy={"terminatingPodTimeoutSeconds": 3600}))
    wait_running(api, namespace, "quorum")
    lost = running_pods(api, namespace, "quorum")[1]
    pods.set_node_ready(lost.spec.node_name, False)
    paused = wait_status(api, namespace, "quorum", "phase Paused", lambda s: s.get("phase") == "Paused")
    assert reason(paused) == "QuorumLost" and paused["quorum"] == {"healthyPercent": 50, "met": False}
    core = kubernetes.client.CoreV1Api(api)
    # The pass writes its decision (the status) before it acts on it (the control record): wait for the act.
    k8s_helpers.wait_for(lambda: json.loads(core.read_namespaced_config_map(
        "quorum-rendezvous", namespace).data["job.control"])["paused"] is True, "the control record paused", TIMEOUT)
    k8s_helpers.wait_for(lambda: "PAUSED" in pods.log_of("quorum-0"), "rank 0 to see the pause", TIMEOUT)
    assert any(r == "QuorumLost" for r, _ in events(api, namespace, "quorum"))

    pods.set_node_ready(lost.spec.node_name, True)  # its kubelet finishes the deletion; a replacement comes
    wait_running(api, namespace, "quorum")
    k8s_helpers.wait_for(lambda: "RESUMED" in pods.log_of("quorum-0"), "rank 0 to resume", TIMEOUT)
    assert any(r == "QuorumRestored" for r, _ in events(api, namespace, "quorum"))


def test_max_nodes_raised_at_run_time_grows_the_world_at_the_next_generation(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner,
    pods: pod_runner.PodRunner,
) -> None:
    create(api, namespace, standin_job("grow", "--report-step", "10", max_nodes=2))
    wait_running(api, namespace, "grow")
    k8s_helpers.custom(api).patch_namespaced_custom_object(k8s_helpers.GROUP, k8s_helpers.VERSION, namespace,
                                                k8s_helpers.PLURAL, "grow", {"spec": {"elastic": {"maxNodes": 3}}})
    grown = wait_status(api, namespace, "grow", "generation 2 running with 3 ranks",
                        lambda s: s.get("membershipGeneration") == 2 and s.get("readyNodes") == 3
                        and (s.get("rendezvous") or {}).get("worldSize") == 3)
    assert grown["worldSize"] == 3
    envs = [{e.name: e.value for e in p.spec.containers[0].env} for p in running_pods(api, namespace, "grow")]
    assert [(e["SNEPPX_GENERATION"], e["WORLD_SIZE"], e["SNEPPX_MAX_NODES"]) for e in envs] == [("2", "3", "3")] * 3
    assert grown.get("restartCount", 0) == 0, "a resize is not a restart"


def test_a_hung_rank_reported_by_an_agent_is_deleted_with_reason_hang(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner,
    pods: pod_runner.PodRunner,
) -> None:
    create(api, namespace, standin_job("hang", "--report-hung", "hang-1", "--after", "2", max_nodes=2))
    after = wait_status(api, namespace, "hang", "a Hang restart", lambda s: s.get("restartCount") == 1)
    assert [(h["reason"], h["rank"]) for h in after["restartHistory"]] == [("Hang", 1)]
    assert "was absent from its job's generations for 0s (reported by hang-0)" in after["restartHistory"][0]["message"]
    core = kubernetes.client.CoreV1Api(api)
    k8s_helpers.wait_for(
        lambda: "job.hung.hang-1" not in (core.read_namespaced_config_map("hang-rendezvous", namespace).data or {}),
        "the hang report removed", TIMEOUT)
    wait_running(api, namespace, "hang")


def test_the_active_deadline_fails_the_job_and_the_ttl_deletes_it(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner,
    pods: pod_runner.PodRunner,
) -> None:
    create(api, namespace, standin_job("deadline", max_nodes=1, activeDeadlineSeconds=4, ttlSecondsAfterFinished=3))
    failed = wait_status(api, namespace, "deadline", "phase Failed", lambda s: s.get("phase") == "Failed")
    assert reason(failed, "Failed") == "DeadlineExceeded"
    wait_status(api, namespace, "deadline", "the job deleted by its TTL", lambda s: s.get("gone"))


def test_the_agents_token_reaches_its_jobs_rendezvous_object_and_nothing_else(
    api: kubernetes.client.ApiClient, cluster: k8s_cluster.Cluster, namespace: str,
    operator: kopf.testing.KopfRunner, tmp_path: pathlib.Path,
) -> None:
    create(api, namespace, standin_job("mine", max_nodes=1))
    create(api, namespace, standin_job("theirs", max_nodes=1))
    core = kubernetes.client.CoreV1Api(api)
    for job in ("mine", "theirs"):
        k8s_helpers.wait_for(lambda j=job: k8s_helpers.exists(core.read_namespaced_config_map, f"{j}-rendezvous", namespace),
                             f"{job}'s rendezvous object", TIMEOUT)
    k8s_helpers.wait_for(
        lambda: k8s_helpers.exists(kubernetes.client.RbacAuthorizationV1Api(api).read_namespaced_role_binding, "mine-agent",
                        namespace), "the agent's RoleBinding", TIMEOUT)
    pod = k8s_helpers.wait_for(lambda: k8s_helpers.read_or_none(core.read_namespaced_pod, "mine-0", namespace), "mine's pod", TIMEOUT)
    request = {"spec": {"expirationSeconds": 600, "boundObjectRef": {
        "apiVersion": "v1", "kind": "Pod", "name": "mine-0", "uid": pod.metadata.uid}}}
    token = core.create_namespaced_service_account_token("mine-agent", namespace, request).status.token
    config = tmp_path / "agent.kubeconfig"
    config.write_text(yaml.safe_dump(pod_runner.kubeconfig(cluster.server, cluster.ca.cert_pem, token)))
    agent_api = kubernetes.config.new_client_from_config(config_file=str(config))
    try:
        agent = kubernetes.client.CoreV1Api(agent_api)
        own = agent.read_namespaced_config_map("mine-rendezvous", namespace)
        assert job_object.data_key(job_object.CONTROL_KEY) in own.data
        agent.patch_namespaced_config_map("mine-rendezvous", namespace, {"data": {"probe": "1"}})
        for call, args in [
            (agent.read_namespaced_config_map, ("theirs-rendezvous", namespace)),
            (agent.patch_namespaced_config_map, ("theirs-rendezvous", namespace, {"data": {"probe": "1"}})),
            (agent.list_namespaced_secret, (namespace,)),
            (agent.read_namespaced_secret, (f"mine-heartbeat-{_uid(api, namespace, 'mine')[:8]}", namespace)),
            (agent.list_namespaced_config_map, (namespace,)),
            (agent.list_namespaced_pod, (namespace,)),
            (agent.delete_namespaced_config_map, ("mine-rendezvous", namespace)),
        ]:
            with pytest.raises(kubernetes.client.ApiException) as refused:
                call(*args)
            assert refused.value.status == 403, (call.__name__, refused.value.status)
        # Issue 38's suspicion, two live copies of one rank: a pod on a partitioned node is force-deleted and
        # replaced under the same name, and its agent runs on. Its token is bound to the deleted pod (its uid):
        # from the deletion on, the API server refuses it, so the stale copy can't read or write the rendezvous
        # its replacement joins (and the runtime's fence refuses it too: a new incarnation under the same agent
        # id ends the generation it was in, tests/integration/test_rendezvous.py).
        core.delete_namespaced_pod("mine-0", namespace, grace_period_seconds=0)
        k8s_helpers.wait_for(lambda: _refused(agent.read_namespaced_config_map, "mine-rendezvous", namespace) == 401,
                             "the deleted pod's token refused", TIMEOUT)
    finally:
        agent_api.close()
    account = core.read_namespaced_service_account("mine-agent", namespace)
    assert account.automount_service_account_token is False


def _refused(call: Any, *args: Any) -> int | None:
    """The HTTP status the API server refuses the call with; None when it answers."""
    try:
        call(*args)
    except kubernetes.client.ApiException as exc:
        return int(exc.status)
    return None


def _uid(api: kubernetes.client.ApiClient, namespace: str, name: str) -> str:
    return str(k8s_helpers.custom(api).get_namespaced_custom_object(k8s_helpers.GROUP, k8s_helpers.VERSION, namespace,
                                                         k8s_helpers.PLURAL, name)["metadata"]["uid"])


def test_a_drained_rank_with_restart_group_and_min_nodes_equal_to_max_nodes_is_not_counted(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner,
    pods: pod_runner.PodRunner,
) -> None:
    """Issue 38, defect 4: `kubectl drain` (cordon, then the Eviction API) of one rank's node with minNodes =
    maxNodes, actionOnLoss RestartGroup and maxRestarts 0 is one uncounted QuorumLost group restart, and the job
    runs on (it failed: the group restart was always counted)."""
    create(api, namespace, standin_job("drain", max_nodes=2, min_nodes=2, quorum={"actionOnLoss": "RestartGroup"},
                                       failurePolicy={"maxRestarts": 0}))
    wait_running(api, namespace, "drain")
    victim = running_pods(api, namespace, "drain")[1]
    core = kubernetes.client.CoreV1Api(api)
    node = victim.spec.node_name
    core.patch_node(node, {"spec": {"unschedulable": True}})
    try:
        core.create_namespaced_pod_eviction(victim.metadata.name, namespace, kubernetes.client.V1Eviction(
            metadata=kubernetes.client.V1ObjectMeta(name=victim.metadata.name, namespace=namespace)))
        after = wait_status(api, namespace, "drain", "the next pod generation running",
                            lambda s: s.get("membershipGeneration") == 2 and s.get("phase") == "Running"
                            and s.get("readyNodes") == 2)
    finally:
        core.patch_node(node, {"spec": {"unschedulable": False}})
    assert after.get("restartCount", 0) == 0
    assert [(h["reason"], h["counted"]) for h in after["restartHistory"]] == [("QuorumLost", False)]


def test_a_job_deleted_in_the_foreground_gets_no_replacement_and_no_count(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner,
    pods: pod_runner.PodRunner,
) -> None:
    """Issue 38, defect 7: under foreground deletion the garbage collector deletes the pods while the job still
    exists; the operator must neither count those deletions (maxRestarts 0 would fail the job) nor replace them.
    A finalizer of the test's own holds the job after the collector is done, so what the operator did stays."""
    create(api, namespace, standin_job("fg", max_nodes=2, failurePolicy={"maxRestarts": 0}))
    wait_running(api, namespace, "fg")
    jobs = k8s_helpers.custom(api)
    args = (k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL)
    hold = "test.sneppx.io/hold"
    jobs.patch_namespaced_custom_object(*args, "fg", {"metadata": {"finalizers": [hold]}})
    core = kubernetes.client.CoreV1Api(api)
    try:
        jobs.delete_namespaced_custom_object(*args, "fg", body=kubernetes.client.V1DeleteOptions(
            propagation_policy="Foreground"))
        k8s_helpers.wait_for(
            lambda: jobs.get_namespaced_custom_object(*args, "fg")["metadata"].get("finalizers") == [hold],
            "the garbage collector done with the job's dependents", TIMEOUT)
        time.sleep(3)  # several resyncs (1 s here) and the pods' DELETED events: a wrong pass would show now
        assert core.list_namespaced_pod(namespace, label_selector="sneppx.io/job=fg").items == []
        status = jobs.get_namespaced_custom_object(*args, "fg").get("status") or {}
        assert status.get("restartCount", 0) == 0 and not status.get("restartHistory"), status
        assert status.get("phase") == "Running", "nothing written for a job being deleted"
    finally:
        jobs.patch_namespaced_custom_object(*args, "fg", {"metadata": {"finalizers": []}})
