"""SneppX on a real node, as a user meets it: the operator installed by `helm install`, a job applied with
`kubectl apply` whose pods run the project's image under a real kubelet and containerd, and the faults a real
cluster produces. Every training job must end at the parameters of the same training uninterrupted in one
process (tests/integration/elastic_script.py), resumed from its last valid checkpoint after each fault, with the
job's status telling what happened. No timing is asserted; timeouts are failure bounds on a loaded 2-core machine.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import sys
import threading
import time
from typing import Any

import k8s_helpers
import kubernetes
import node_jobs
import pod_runner
import pytest
import real_node
import urllib3
from image_fixtures import TAG
from k8s_helpers import wait_for, wait_status
from node_jobs import EVERY, STEPS, checkpoint_volume, container_pid, logs, progress

from SneppX_ALG import storage
from sneppx_operator import builders

sys.path[:0] = [str(pathlib.Path(__file__).parents[1] / "integration"), str(pathlib.Path(__file__).parents[1])]
import s3_servers
from elastic_script import assert_params_match

FINISH_TIMEOUT = 600.0


def training_job(name: str, **settings: Any) -> dict[str, Any]:
    return node_jobs.training_job(name, TAG, **settings)


def wait_finished(api: kubernetes.client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return wait_status(api, namespace, name, "the job Succeeded or Failed",
                       lambda s: s.get("phase") in ("Succeeded", "Failed"), FINISH_TIMEOUT)


def job_pods(api: kubernetes.client.ApiClient, namespace: str, job: str = "train") -> dict[str, str]:
    """{pod name: uid} of the job's pods now."""
    pods = kubernetes.client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=f"{builders.LABEL_JOB}={job}")
    return {p.metadata.name: p.metadata.uid for p in pods.items}


class PodWatch:
    """Every version of the namespace's pods the API server sends on a watch: a pod's last status (its
    container's exit code) comes and goes between two polls when the pod is deleted."""

    def __init__(self, node: real_node.Node, namespace: str):
        self._client = kubernetes.config.new_client_from_config(config_file=str(node.cluster.kubeconfig))
        self._watch = kubernetes.watch.Watch()
        self.seen: list[Any] = []
        self._thread = threading.Thread(target=self._run, args=(namespace,), daemon=True)
        self._thread.start()

    def _run(self, namespace: str) -> None:
        core = kubernetes.client.CoreV1Api(self._client)
        stream = self._watch.stream(core.list_namespaced_pod, namespace, timeout_seconds=int(FINISH_TIMEOUT))
        with contextlib.suppress(urllib3.exceptions.ProtocolError):  # stop() closed the connection under it
            for event in stream:
                self.seen.append(event["object"])

    def ends(self, uid: str) -> set[tuple[int, str]]:
        """(exit code, reason) of the pod's first container once terminated, as the kubelet reported it."""
        found = set()
        for pod in self.seen:
            for container in (pod.status.container_statuses or [])[:1] if pod.metadata.uid == uid else []:
                if container.state.terminated is not None:
                    found.add((container.state.terminated.exit_code, container.state.terminated.reason))
        return found

    def stop(self) -> None:
        self._watch.stop()
        self._thread.join(10)
        self._client.close()


def delete_rank_1_while_training(
    node: real_node.Node, api: kubernetes.client.ApiClient, namespace: str, job: dict[str, Any], out: pathlib.Path,
    tmp_path: pathlib.Path,
) -> tuple[dict[str, Any], set[tuple[int, str]]]:
    """Apply the job, `kubectl delete pod` rank 1 once both ranks train, wait for the job to end. Returns its
    status and how the deleted pod's container ended (exit code, reason), as a watch saw it."""
    watch = PodWatch(node, namespace)
    try:
        k8s_helpers.kubectl_apply(node.cluster, namespace, job, tmp_path)
        two_ranks_training(out)
        victim = job_pods(api, namespace)["train-1"]
        node.cluster.kubectl("delete", "pod", "train-1", "-n", namespace, "--wait=false")
        return wait_finished(api, namespace, "train"), watch.ends(victim)
    finally:
        watch.stop()


def history(status: dict[str, Any]) -> list[tuple[str, int, bool]]:
    return sorted((h["reason"], h.get("rank", -1), h["counted"]) for h in status.get("restartHistory") or [])


def two_ranks_training(out: pathlib.Path) -> None:
    wait_for(lambda: progress(out)["step"] >= 3 * EVERY and progress(out)["world_size"] == 2,
             "two pods training together past a few checkpoints", FINISH_TIMEOUT)


# ---- the tests -------------------------------------------------------------------------------------------------


def test_helm_install_runs_the_operator_as_pods_of_the_image_with_one_leader(
    node: real_node.Node, api: kubernetes.client.ApiClient, operator: str,
) -> None:
    core = kubernetes.client.CoreV1Api(api)
    pods = core.list_namespaced_pod(real_node.OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/name=sneppx-operator").items
    assert len(pods) == 2, [p.metadata.name for p in pods]  # the chart's default: two replicas
    for pod in pods:
        assert pod.status.phase == "Running", pod.status
        assert pod.spec.containers[0].image == TAG
        assert pod.spec.service_account_name.startswith(real_node.RELEASE)
        assert pod.status.container_statuses[0].ready
    lease = wait_for(lambda: k8s_helpers.read_or_none(
        kubernetes.client.CoordinationV1Api(api).read_namespaced_lease, "sneppx-sneppx-operator", real_node.OPERATOR_NAMESPACE),
        "the leader's Lease", 120)
    holder = wait_for(lambda: kubernetes.client.CoordinationV1Api(api).read_namespaced_lease(
        lease.metadata.name, real_node.OPERATOR_NAMESPACE).spec.holder_identity, "a Lease holder", 120)
    assert any(holder.startswith(p.metadata.name) for p in pods), (holder, [p.metadata.name for p in pods])


def test_a_sigkilled_container_fails_its_pod_and_the_operator_replaces_it(
    node: real_node.Node, api: kubernetes.client.ApiClient, operator: str, namespace: str, tmp_path: pathlib.Path,
) -> None:
    """restartPolicy is Never (restarts are the operator's: a group restart with backoff and a budget), so the
    kubelet does not restart the container: the pod fails with the container's exit code, and the operator
    replaces it; training resumes from the last valid checkpoint and ends at the uninterrupted run's parameters."""
    out = checkpoint_volume(node, api, namespace) / "out"
    k8s_helpers.kubectl_apply(node.cluster, namespace, training_job("train"), tmp_path)
    two_ranks_training(out)
    victim = kubernetes.client.CoreV1Api(api).read_namespaced_pod("train-1", namespace)
    before, killed_at = progress(out)["step"], time.time()
    os.kill(container_pid(node, api, namespace, "train-1"), signal.SIGKILL)

    done = wait_finished(api, namespace, "train")
    assert done["phase"] == "Succeeded", (done, logs(node, namespace, "train-0")[-4000:])
    assert [(h["reason"], h["rank"], h["exitCode"]) for h in done["restartHistory"]] == [("PodFailed", 1, 137)]
    assert done["restartCount"] == 1
    assert done["lastValidCheckpoint"]["step"] == STEPS
    replacement = kubernetes.client.CoreV1Api(api).read_namespaced_pod("train-1", namespace)
    assert replacement.metadata.uid != victim.metadata.uid  # a new pod, not a kubelet restart of the old one
    assert replacement.status.container_statuses[0].restart_count == 0

    # the survivor's agent saw the loss; rank 0 of the next generation (whichever pod holds it) restored
    events = {pod: k8s_helpers.agent_events(logs(node, namespace, pod)) for pod in ("train-0", "train-1")}
    assert any(e["kind"] == "failure" and e["t"] >= killed_at for e in events["train-0"]), events["train-0"][-20:]
    restored = [e for pod in events for e in events[pod] if e["kind"] == "restored" and e["t"] > killed_at]
    assert restored and all(e["step"] is not None and before - e["step"] <= 2 * EVERY for e in restored), (
        before, restored)

    table = node.cluster.kubectl("get", "etj", "train", "-n", namespace).stdout
    header, row = (line.split() for line in table.strip().splitlines())
    assert header[:5] == ["NAME", "PHASE", "READY", "RESTARTS", "LAST-VALID-STEP"]
    assert (row[0], row[1], row[3], row[4]) == ("train", "Succeeded", "1", str(STEPS)), table
    described = node.cluster.kubectl("describe", "etj", "train", "-n", namespace).stdout
    assert "train-1" in described and "137" in described, described[-3000:]
    assert_params_match(out, STEPS)


def test_snapshots_of_pods_on_one_node_keep_no_copies_of_each_other_so_a_lost_rank_resumes_from_storage(
    node: real_node.Node, api: kubernetes.client.ApiClient, operator: str, namespace: str, tmp_path: pathlib.Path,
) -> None:
    """Peer-memory snapshots place each rank's copy on another Kubernetes node, named by the kubelet through the
    downward API (spec.nodeName). On one node there is none: a rank killed here takes its only snapshot with it,
    and the job resumes from its newest checkpoint, saying why."""
    out = checkpoint_volume(node, api, namespace) / "out"
    job = training_job("train")
    job["spec"]["checkpoint"]["snapshotEveryNSteps"] = 1
    k8s_helpers.kubectl_apply(node.cluster, namespace, job, tmp_path)
    two_ranks_training(out)
    killed_at = time.time()
    os.kill(container_pid(node, api, namespace, "train-1"), signal.SIGKILL)

    done = wait_finished(api, namespace, "train")
    assert done["phase"] == "Succeeded", (done, logs(node, namespace, "train-0")[-4000:])
    events = {pod: k8s_helpers.agent_events(logs(node, namespace, pod)) for pod in ("train-0", "train-1")}
    restored = [e for pod in events for e in events[pod] if e["kind"] == "restored" and e["t"] > killed_at]
    assert restored and restored[0]["source"] == "storage", restored
    assert "lost the part of rank(s) 1" in restored[0]["why"], restored[0]
    # (when the replacement joins at a checkpoint, the one-rank generation's snapshot is whole: that restore
    # may come from memory, so the final resumedFrom says nothing about the kill)
    assert_params_match(out, STEPS)


def test_a_deleted_pod_is_replaced_and_training_resumes(
    node: real_node.Node, api: kubernetes.client.ApiClient, operator: str, namespace: str, tmp_path: pathlib.Path,
) -> None:
    """`kubectl delete pod`: the kubelet stops the container with SIGTERM to its PID 1, the agent, which stops its
    worker and exits 143; the operator, which did not delete the pod, replaces it and counts a PodDeleted restart."""
    out = checkpoint_volume(node, api, namespace) / "out"
    done, ends = delete_rank_1_while_training(node, api, namespace, training_job("train"), out, tmp_path)
    assert done["phase"] == "Succeeded", (done, logs(node, namespace, "train-0")[-4000:])
    assert {code for code, _ in ends} == {143}, ends
    assert [(h["reason"], h["rank"]) for h in done["restartHistory"]] == [("PodDeleted", 1)], done["restartHistory"]
    assert done["restartCount"] == 1
    assert_params_match(out, STEPS)


def test_a_job_checkpointing_to_s3_resumes_from_the_bucket_after_a_sigkilled_container(
    node: real_node.Node, api: kubernetes.client.ApiClient, operator: str, namespace: str, tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checkpoints in an S3 bucket (the Versity S3 Gateway, a real S3 server, listening on the pod bridge's
    address so the pods reach it and nothing else does), credentials from a Secret: a container SIGKILLed, the
    replacement resumes from the last step committed in the bucket."""
    for key, value in s3_servers.ENV.items():  # the test's own client: the pods get theirs from the Secret
        monkeypatch.setenv(key, value)
    server = s3_servers.start("versitygw", tmp_path / "s3", host=real_node.NODE_IP)
    try:
        server.client().create_bucket(Bucket="ckpt")
        kubernetes.client.CoreV1Api(api).create_namespaced_secret(namespace, {
            "metadata": {"name": "s3-credentials"},
            "stringData": {k: s3_servers.ENV[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}})
        out = checkpoint_volume(node, api, namespace) / "out"
        s3 = {"bucket": "ckpt", "prefix": "train", "endpoint": server.endpoint,
              "region": s3_servers.ENV["AWS_DEFAULT_REGION"], "credentialsSecretRef": {"name": "s3-credentials"}}
        k8s_helpers.kubectl_apply(node.cluster, namespace, training_job("train", s3=s3), tmp_path)
        two_ranks_training(out)
        os.kill(container_pid(node, api, namespace, "train-1"), signal.SIGKILL)
        done = wait_finished(api, namespace, "train")
        assert done["phase"] == "Succeeded", (done, logs(node, namespace, "train-0")[-4000:])
        assert [(h["reason"], h["rank"], h["exitCode"]) for h in done["restartHistory"]] == [("PodFailed", 1, 137)]
        assert done["lastValidCheckpoint"]["step"] == STEPS
        keys = [o["Key"] for o in server.client().list_objects_v2(Bucket="ckpt", Prefix="train/")["Contents"]]
        assert any(key.startswith(f"train/{storage.step_name(STEPS)}/") for key in keys), keys  # in the bucket
        assert not [p for p in out.parent.iterdir() if p.name != "out"], list(out.parent.iterdir())
        assert_params_match(out, STEPS)
    finally:
        s3_servers.stop(server)


def test_a_drain_evicts_the_ranks_without_spending_the_budget_and_training_resumes_after_uncordon(
    node: real_node.Node, api: kubernetes.client.ApiClient, operator: str, namespace: str, tmp_path: pathlib.Path,
) -> None:
    """`kubectl drain` cordons the node and evicts through the Eviction API; the API server marks each pod
    DisruptionTarget (EvictionByEvictionAPI). The operator records the evictions, uncounted (maxRestarts 1 here:
    two counted would fail the job), and its replacements wait unschedulable on the cordoned node until
    `kubectl uncordon`. The drain takes only this job's pods: on a one-node cluster the operator has nowhere
    else to go."""
    out = checkpoint_volume(node, api, namespace) / "out"
    job = training_job("train", failure_policy={"maxRestarts": 1})
    k8s_helpers.kubectl_apply(node.cluster, namespace, job, tmp_path)
    two_ranks_training(out)
    drained = job_pods(api, namespace)
    core = kubernetes.client.CoreV1Api(api)

    def unschedulable_replacements() -> bool:
        pods = core.list_namespaced_pod(namespace, label_selector=f"{builders.LABEL_JOB}=train").items
        fresh = [p for p in pods if p.metadata.uid not in drained.values()]
        return len(fresh) == 2 and all(any(c.type == "PodScheduled" and c.reason == "Unschedulable"
                                           for c in p.status.conditions or []) for p in fresh)

    try:
        node.cluster.kubectl("drain", real_node.NODE_NAME, "--pod-selector", f"{builders.LABEL_JOB}=train",
                             "--delete-emptydir-data", "--timeout=180s", timeout=240)
        wait_for(unschedulable_replacements, "both replacements Pending, unschedulable on the cordoned node", 180)
        evicted = k8s_helpers.status(api, namespace, "train")
        assert history(evicted) == [("Evicted", 0, False), ("Evicted", 1, False)], evicted.get("restartHistory")
    finally:
        node.cluster.kubectl("uncordon", real_node.NODE_NAME)

    done = wait_finished(api, namespace, "train")
    assert done["phase"] == "Succeeded", (done, logs(node, namespace, "train-0")[-4000:])
    assert history(done) == [("Evicted", 0, False), ("Evicted", 1, False)], done["restartHistory"]
    # the drain, named by the pod's own DisruptionTarget or by its cordoned node (a gone pod is judged by its node
    # first, so the same drain reads the same whichever moment a pass saw it: docs/OPERATOR.md, "Guarantees")
    assert all("EvictionByEvictionAPI" in h["message"] or "NodeCordoned" in h["message"]
               for h in done["restartHistory"]), done["restartHistory"]
    assert done["restartCount"] == 0
    assert_params_match(out, STEPS)


def test_a_container_that_ignores_sigterm_is_killed_after_its_grace_period_and_replaced(
    node: real_node.Node, api: kubernetes.client.ApiClient, operator: str, namespace: str, tmp_path: pathlib.Path,
) -> None:
    """The trainer's container runs under a shell, its PID 1, that ignores SIGTERM (the trap says so; PID 1 of a
    namespace gets no signal it has no handler for anyway), so the trainer never sees it. A deleted pod then lives
    out terminationGracePeriodSeconds and the kubelet SIGKILLs it: exit 137, where a container that heeds
    SIGTERM ends 143 (test_a_deleted_pod_is_replaced_and_training_resumes). The replacement waits for the
    name; training resumes."""
    job = training_job("train")
    container = job["spec"]["template"]["spec"]["containers"][0]
    # not `exec`, and a command after the trainer's: the shell stays PID 1 (dash runs a last command in place)
    container["command"] = ["sh", "-c", "trap '' TERM; " + " ".join(container["command"]) + "; exit $?"]
    out = checkpoint_volume(node, api, namespace) / "out"
    done, ends = delete_rank_1_while_training(node, api, namespace, job, out, tmp_path)
    assert done["phase"] == "Succeeded", (done, logs(node, namespace, "train-0")[-4000:])
    assert {code for code, _ in ends} == {137}, ends
    assert history(done) == [("PodDeleted", 1, True)], done["restartHistory"]
    assert_params_match(out, STEPS)


def test_an_oom_killed_worker_fails_its_pod_137_oomkilled_and_training_resumes(
    node: real_node.Node, api: kubernetes.client.ApiClient, operator: str, namespace: str, tmp_path: pathlib.Path,
) -> None:
    """Rank 1 takes memory past its container's limit once; the kernel's OOM killer ends that worker. The agent
    ends the pod 137 (as cgroup v2's group kill would; this machine is cgroup v1, where only the worker dies),
    containerd reports OOMKilled, and the operator records both and replaces the pod."""
    job = training_job("train", oom_at_step=STEPS // 2 + 1)  # well after both ranks train together
    job["spec"]["template"]["spec"]["containers"][0]["resources"] = {
        "requests": {"memory": "768Mi"}, "limits": {"memory": "768Mi"}}
    out = checkpoint_volume(node, api, namespace) / "out"
    k8s_helpers.kubectl_apply(node.cluster, namespace, job, tmp_path)

    done = wait_finished(api, namespace, "train")
    assert done["phase"] == "Succeeded", (done, logs(node, namespace, "train-0")[-4000:])
    assert (out / "oom-once").exists(), "the planted allocation never ran"
    restarts = done.get("restartHistory") or []
    assert len(restarts) == 1, done  # none: the worker was restarted inside the pod, and nothing said OOMKilled
    entry = restarts[0]
    assert (entry["reason"], entry["exitCode"], entry["counted"]) == ("PodFailed", 137, True), entry
    assert "OOMKilled" in entry["message"], entry
    assert_params_match(out, STEPS)


def test_a_silent_kubelet_makes_the_node_not_ready_and_its_stuck_pods_are_force_deleted(
    node: real_node.Node, api: kubernetes.client.ApiClient, operator: str, namespace: str, tmp_path: pathlib.Path,
) -> None:
    """The kubelet stopped (its containers go on running): past the node-monitor grace (20 s here) the node
    controller marks the node NotReady (Unknown); the operator restarts both ranks (NodeNotReady) and deletes
    their pods, which stay Terminating with no kubelet to end them, until failurePolicy.terminatingPodTimeoutSeconds
    and a force-delete. The kubelet back, it kills the orphaned containers, the replacements run, training
    resumes."""
    steps = 200  # the old containers run on without their kubelet: they must not finish meanwhile
    out = checkpoint_volume(node, api, namespace) / "out"
    job = training_job("train", steps=steps, sleep=0.2, failure_policy={"terminatingPodTimeoutSeconds": 5})
    k8s_helpers.kubectl_apply(node.cluster, namespace, job, tmp_path)
    two_ranks_training(out)
    silenced = job_pods(api, namespace)
    core = kubernetes.client.CoreV1Api(api)

    def not_ready() -> bool:
        conditions = core.read_node(real_node.NODE_NAME).status.conditions or []
        return any(c.type == "Ready" and c.status != "True" for c in conditions)

    node.stop_kubelet()
    try:
        wait_for(not_ready, "the node NotReady", 120)
        wait_for(lambda: not set(job_pods(api, namespace).values()) & set(silenced.values()),
                 "the silenced node's pods force-deleted", 180)
    finally:
        node.start_kubelet()

    done = wait_finished(api, namespace, "train")
    assert done["phase"] == "Succeeded", (done, logs(node, namespace, "train-0")[-4000:])
    assert history(done) == [("NodeNotReady", 0, True), ("NodeNotReady", 1, True)], done["restartHistory"]
    described = node.cluster.kubectl("describe", "etj", "train", "-n", namespace).stdout
    assert "force-deleted" in described, described[-3000:]
    assert_params_match(out, steps)


def comparable(status: dict[str, Any]) -> dict[str, Any]:
    """What a person reads of a finished job: phase, the restarts (why, which rank, exit code, counted), the
    last valid step and each rank's end."""
    return {"phase": status["phase"], "restartCount": status["restartCount"],
            "restartHistory": [(h["reason"], h.get("rank"), h.get("exitCode"), h["counted"])
                               for h in status.get("restartHistory") or []],
            "lastValidStep": (status.get("lastValidCheckpoint") or {}).get("step"),
            "ranks": sorted((r["rank"], r.get("phase")) for r in status.get("ranks") or [])}


@pytest.mark.parametrize("fault", ["SIGKILL", "kubectl delete pod"])
def test_the_stand_in_kubelet_and_the_real_one_agree_on_a_fault(
    node: real_node.Node, api: kubernetes.client.ApiClient, operator: str, namespace: str, tmp_path: pathlib.Path,
    fault: str,
) -> None:
    """tests/k8s's fast tests run pods under pod_runner, a kubelet stand-in. The same job and the same fault under
    the real kubelet and under the stand-in (its Nodes in this same cluster, its pods kept from the real
    scheduler by a schedulerName of their own) must end in the same status: where they differ, one is wrong."""
    seen: dict[str, dict[str, Any]] = {}
    stand_in_namespace = k8s_helpers.create_namespace(api, f"{namespace[:50]}-si")
    stand_in_nodes = (f"{stand_in_namespace[-6:]}-a", f"{stand_in_namespace[-6:]}-b")
    runner = pod_runner.PodRunner(api, node.cluster.server, node.cluster.ca.cert_pem, stand_in_namespace,
                                  tmp_path / "stand-in", stand_in_nodes)
    try:
        with runner:
            for kubelet, ns in (("real", namespace), ("stand-in", stand_in_namespace)):
                host_dir = checkpoint_volume(node, api, ns)
                out = (host_dir if kubelet == "real" else runner.checkpoints) / "out"
                job = training_job("train")
                if kubelet == "stand-in":
                    job["spec"]["template"]["spec"]["schedulerName"] = "sneppx-pod-runner"
                k8s_helpers.kubectl_apply(node.cluster, ns, job, tmp_path)
                two_ranks_training(out)
                if fault == "SIGKILL" and kubelet == "real":  # PID 1: the kernel ends the rest of its namespace
                    os.kill(container_pid(node, api, ns, "train-1"), signal.SIGKILL)
                elif fault == "SIGKILL":
                    runner.kill("train-1")  # its process group
                else:
                    node.cluster.kubectl("delete", "pod", "train-1", "-n", ns, "--wait=false")
                done = wait_finished(api, ns, "train")
                assert done["phase"] == "Succeeded", (kubelet, done)
                assert_params_match(out, STEPS)
                seen[kubelet] = comparable(done)
            k8s_helpers.delete_jobs(api, stand_in_namespace)  # while the stand-in still ends its pods
    finally:
        core = kubernetes.client.CoreV1Api(api)
        for name in stand_in_nodes:
            k8s_helpers.read_or_none(core.delete_node, name)
        core.delete_namespace(stand_in_namespace)
        assert not runner.errors, runner.errors
    assert seen["real"] == seen["stand-in"], seen


def test_helm_uninstall_leaves_nothing_of_the_release_behind(
    node: real_node.Node, api: kubernetes.client.ApiClient, operator: str,
) -> None:
    """Last in this module: it uninstalls the session's release (the fixture's own uninstall then does nothing)."""
    node.cluster.helm("uninstall", operator, "--namespace", real_node.OPERATOR_NAMESPACE, "--wait",
                      "--timeout", "120s", timeout=180)
    selector = f"app.kubernetes.io/instance={operator}"
    kinds = "deployments,replicasets,services,serviceaccounts,roles,rolebindings,configmaps,leases"  # pods: below

    def left() -> str:
        return node.cluster.kubectl("get", kinds, "-n", real_node.OPERATOR_NAMESPACE, "-l", selector, "-o",
                                    "name").stdout.strip()

    # the ReplicaSets and the Lease the replicas made (owned by the Deployment) go with the garbage collector,
    # after the Deployment: waited for, not raced
    try:
        wait_for(lambda: not left(), "nothing of the release left in its namespace", 60)
    except AssertionError as e:
        raise AssertionError(f"{e}: {left()}") from None
    cluster_wide = node.cluster.kubectl("get", "clusterroles,clusterrolebindings", "-l", selector, "-o", "name").stdout
    assert not cluster_wide.strip(), cluster_wide
    core = kubernetes.client.CoreV1Api(api)  # and no deletion is wedged: the operator's pods stop and go
    wait_for(lambda: not core.list_namespaced_pod(real_node.OPERATOR_NAMESPACE).items, "the operator's pods gone", 120)
    crds = node.cluster.kubectl("get", "crd", "-o", "name").stdout
    assert "elastictrainingjobs.sneppx.io" in crds  # Helm keeps CRDs (and the jobs in them) on uninstall
