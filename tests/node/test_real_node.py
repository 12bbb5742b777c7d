"""SneppX on a real node, as a user meets it: the operator installed by `helm install`, a job applied with
`kubectl apply` whose pods run the project's image under a real kubelet and containerd, and the faults a real
cluster produces. Every training job must end at the parameters of the same training uninterrupted in one
process (tests/integration/elastic_script.py), resumed from its last valid checkpoint after each fault, with the
job's status telling what happened. No timing is asserted; timeouts are failure bounds on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import time
from typing import Any

import k8s_helpers
import kubernetes
import real_node
import yaml
from image_fixtures import TAG
from k8s_helpers import wait_for, wait_status

from sneppx_operator import builders

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "integration"))
from elastic_script import assert_params_match

SCRIPT = pathlib.Path(__file__).parents[1] / "integration" / "elastic_script.py"
SCRIPT_DIR = "/opt/sneppx-test"  # the script, from a ConfigMap: the image holds the library, not the tests
EVERY = 3
STEPS = 60
FINISH_TIMEOUT = 600.0


# ---- a job on the node ---------------------------------------------------------------------------------------


def checkpoint_volume(node: real_node.Node, api: kubernetes.client.ApiClient, namespace: str) -> pathlib.Path:
    """A PersistentVolume on a directory of the node (hostPath), bound to the PVC "ckpt" in `namespace`: the
    pods mount the claim (the restricted profile allows that, not hostPath itself). Returns the directory."""
    directory = node.workdir / "volumes" / namespace
    directory.mkdir(parents=True)
    directory.chmod(0o777)  # the pods run as a non-root user; hostPath has no fsGroup
    core = kubernetes.client.CoreV1Api(api)
    core.create_persistent_volume({
        "metadata": {"name": f"{namespace}-ckpt"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(directory), "type": "Directory"},
                 "claimRef": {"namespace": namespace, "name": "ckpt"}},
    })
    core.create_namespaced_persistent_volume_claim(namespace, {
        "metadata": {"name": "ckpt"},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": f"{namespace}-ckpt",
                 "resources": {"requests": {"storage": "1Gi"}}},
    })
    wait_for(lambda: core.read_namespaced_persistent_volume_claim("ckpt", namespace).status.phase == "Bound",
             "the PVC bound to its volume", 120)
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "train-script"},
                                                  "data": {SCRIPT.name: SCRIPT.read_text()}})
    return directory


def training_job(name: str, *, steps: int = STEPS, max_nodes: int = 2, min_nodes: int = 1,
                 failure_policy: dict[str, Any] | None = None, **knobs: Any) -> dict[str, Any]:
    job = k8s_helpers.valid_job(name, max_nodes=max_nodes, min_nodes=min_nodes)
    spec = job["spec"]
    pod_spec = spec["template"]["spec"]
    container = pod_spec["containers"][0]
    container.update(image=TAG, imagePullPolicy="Never",
                     command=["python", f"{SCRIPT_DIR}/{SCRIPT.name}", f"{builders.CHECKPOINT_DIR}/out",
                              builders.CHECKPOINT_DIR],
                     volumeMounts=[{"name": "script", "mountPath": SCRIPT_DIR, "readOnly": True}])
    settings = {"steps": steps, "every": EVERY, "sleep": 0.1, "restart_delay": 0.2, **knobs}
    container["env"] = [{"name": f"E_{k.upper()}", "value": str(v)} for k, v in settings.items()]
    pod_spec["volumes"] = [{"name": "script", "configMap": {"name": "train-script"}}]
    pod_spec["terminationGracePeriodSeconds"] = 5
    spec["failurePolicy"] = {"restartDelay": {"initialSeconds": 0, "multiplier": 2, "maxSeconds": 1},
                             **(failure_policy or {})}
    spec["checkpoint"]["maxToKeep"] = 3
    return job


def apply(node: real_node.Node, namespace: str, job: dict[str, Any], tmp: pathlib.Path) -> None:
    manifest = tmp / f"{job['metadata']['name']}.yaml"
    manifest.write_text(yaml.safe_dump(job))
    node.cluster.kubectl("apply", "-n", namespace, "-f", str(manifest))


def progress(out: pathlib.Path) -> dict[str, Any]:
    try:
        return json.loads((out / "progress.json").read_text())  # type: ignore[no-any-return]
    except (FileNotFoundError, ValueError):
        return {"step": 0, "generation": -1, "world_size": 0}


def logs(node: real_node.Node, namespace: str, pod: str, previous: bool = False) -> str:
    """The pod's log through the API server and the kubelet, as `kubectl logs` shows it."""
    result = node.cluster.kubectl("logs", "-n", namespace, pod, *(["--previous"] if previous else []), check=False)
    return result.stdout if result.returncode == 0 else f"(no log: {result.stderr.strip()})"


def wait_finished(api: kubernetes.client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return wait_status(api, namespace, name, "the job Succeeded or Failed",
                       lambda s: s.get("phase") in ("Succeeded", "Failed"), FINISH_TIMEOUT)


def container_pid(node: real_node.Node, api: kubernetes.client.ApiClient, namespace: str, pod: str) -> int:
    """The host PID of the pod's first container's process (what the kubelet started), from containerd."""
    status = kubernetes.client.CoreV1Api(api).read_namespaced_pod(pod, namespace).status
    container_id = status.container_statuses[0].container_id.removeprefix("containerd://")
    for line in node.ctr("tasks", "list").splitlines()[1:]:
        task, pid, *_ = line.split()
        if task == container_id:
            return int(pid)
    raise AssertionError(f"no containerd task for {pod}'s container {container_id}")


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
    apply(node, namespace, training_job("train"), tmp_path)
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


def test_a_deleted_pod_is_replaced_and_training_resumes(
    node: real_node.Node, api: kubernetes.client.ApiClient, operator: str, namespace: str, tmp_path: pathlib.Path,
) -> None:
    """`kubectl delete pod`: the kubelet stops the container (SIGTERM, which the launcher passes to its agent),
    and the operator, which did not delete it, replaces the pod and counts a PodDeleted restart."""
    out = checkpoint_volume(node, api, namespace) / "out"
    apply(node, namespace, training_job("train"), tmp_path)
    two_ranks_training(out)
    node.cluster.kubectl("delete", "pod", "train-1", "-n", namespace, "--wait=false")

    done = wait_finished(api, namespace, "train")
    assert done["phase"] == "Succeeded", (done, logs(node, namespace, "train-0")[-4000:])
    assert [(h["reason"], h["rank"]) for h in done["restartHistory"]] == [("PodDeleted", 1)], done["restartHistory"]
    assert done["restartCount"] == 1
    assert_params_match(out, STEPS)


def test_helm_uninstall_leaves_nothing_of_the_release_behind(
    node: real_node.Node, api: kubernetes.client.ApiClient, operator: str,
) -> None:
    """Last in this module: it uninstalls the session's release (the fixture's own uninstall then does nothing)."""
    node.cluster.helm("uninstall", operator, "--namespace", real_node.OPERATOR_NAMESPACE, "--wait",
                      "--timeout", "120s", timeout=180)
    selector = f"app.kubernetes.io/instance={operator}"
    kinds = "deployments,replicasets,services,serviceaccounts,roles,rolebindings,configmaps"  # pods: below
    left = node.cluster.kubectl("get", kinds, "-n", real_node.OPERATOR_NAMESPACE, "-l", selector, "-o", "name").stdout
    assert not left.strip(), left
    cluster_wide = node.cluster.kubectl("get", "clusterroles,clusterrolebindings", "-l", selector, "-o", "name").stdout
    assert not cluster_wide.strip(), cluster_wide
    core = kubernetes.client.CoreV1Api(api)  # and no deletion is wedged: the operator's pods stop and go
    wait_for(lambda: not core.list_namespaced_pod(real_node.OPERATOR_NAMESPACE).items, "the operator's pods gone", 120)
    crds = node.cluster.kubectl("get", "crd", "-o", "name").stdout
    assert "elastictrainingjobs.sneppx.io" in crds  # Helm keeps CRDs (and the jobs in them) on uninstall
