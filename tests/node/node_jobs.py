"""Training jobs on the real node (real_node.py), for tests/node and `bench operator`: the reference model's
script (tests/integration/elastic_script.py) from a ConfigMap, checkpoints on a hostPath PersistentVolume bound
to the job's PVC, the project's image in containerd."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import k8s_helpers
import kubernetes
import real_node
import yaml
from k8s_helpers import wait_for

from sneppx_operator import builders

SCRIPT = pathlib.Path(__file__).parents[1] / "integration" / "elastic_script.py"
SCRIPT_DIR = "/opt/sneppx-test"  # the script, from a ConfigMap: the image holds the library, not the tests
OUT_DIR = "/opt/sneppx-out"  # the script's outputs (progress, parameters) when checkpoints go to S3: the PVC
EVERY = 3
STEPS = 60


def checkpoint_volume(node: real_node.Node, api: kubernetes.client.ApiClient, namespace: str) -> pathlib.Path:
    """A PersistentVolume on a directory of the node (hostPath), bound to the PVC "ckpt" in `namespace`, and the
    script's ConfigMap: the pods mount the claim (the restricted profile allows that, not hostPath itself).
    Returns the directory."""
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


def training_job(name: str, image: str, *, steps: int = STEPS, max_nodes: int = 2, min_nodes: int = 1,
                 failure_policy: dict[str, Any] | None = None, s3: dict[str, Any] | None = None,
                 **knobs: Any) -> dict[str, Any]:
    """A job of `image` training the script for `steps`; knobs are the script's E_* settings. Checkpoints go to
    the PVC "ckpt", or to `s3` (spec.checkpoint.storage.s3), the script's outputs still to the PVC's "out"."""
    job = k8s_helpers.valid_job(name, max_nodes=max_nodes, min_nodes=min_nodes)
    spec = job["spec"]
    pod_spec = spec["template"]["spec"]
    container = pod_spec["containers"][0]
    out = f"{builders.CHECKPOINT_DIR}/out" if s3 is None else f"{OUT_DIR}/out"
    container.update(image=image, imagePullPolicy="Never",
                     command=["python", f"{SCRIPT_DIR}/{SCRIPT.name}", out, builders.CHECKPOINT_DIR],
                     volumeMounts=[{"name": "script", "mountPath": SCRIPT_DIR, "readOnly": True}])
    settings = {"steps": steps, "every": EVERY, "sleep": 0.1, "restart_delay": 0.2, **knobs}
    container["env"] = [{"name": f"E_{k.upper()}", "value": str(v)} for k, v in settings.items()]
    pod_spec["volumes"] = [{"name": "script", "configMap": {"name": "train-script"}}]
    if s3 is not None:  # the job's checkpoints in the bucket; the claim only for what the test reads back
        spec["checkpoint"]["storage"] = {"s3": s3}
        pod_spec["volumes"].append({"name": "out", "persistentVolumeClaim": {"claimName": "ckpt"}})
        container["volumeMounts"].append({"name": "out", "mountPath": OUT_DIR})
    pod_spec["terminationGracePeriodSeconds"] = 5
    spec["failurePolicy"] = {"restartDelay": {"initialSeconds": 0, "multiplier": 2, "maxSeconds": 1},
                             **(failure_policy or {})}
    spec["checkpoint"]["maxToKeep"] = 3
    return job


def apply(node: real_node.Node, namespace: str, job: dict[str, Any], tmp: pathlib.Path) -> None:
    """`kubectl apply -f` of the job's manifest."""
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


def container_pid(node: real_node.Node, api: kubernetes.client.ApiClient, namespace: str, pod: str) -> int:
    """The host PID of the pod's first container's process (what the kubelet started), from containerd."""
    status = kubernetes.client.CoreV1Api(api).read_namespaced_pod(pod, namespace).status
    container_id = status.container_statuses[0].container_id.removeprefix("containerd://")
    for line in node.ctr("tasks", "list").splitlines()[1:]:
        task, pid, *_ = line.split()
        if task == container_id:
            return int(pid)
    raise AssertionError(f"no containerd task for {pod}'s container {container_id}")


def install_operator(node: real_node.Node, image: str, *extra: str) -> None:
    """`helm install` of the chart with `image` (already in containerd): the operator runs as pods."""
    repository, _, tag = image.rpartition(":")
    node.cluster.helm(
        "install", real_node.RELEASE, str(CHART), "--namespace", real_node.OPERATOR_NAMESPACE, "--create-namespace",
        "--set", f"image.repository={repository}", "--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never",
        *extra, "--wait", "--timeout", "180s", timeout=240,
    )


CHART = pathlib.Path(__file__).parents[2] / "charts" / "sneppx-operator"
