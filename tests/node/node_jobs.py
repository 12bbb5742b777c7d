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
from k8s_helpers import wait_for

from sneppx_operator import builders

SCRIPT = pathlib.Path(__file__).parents[1] / "integration" / "elastic_script.py"
CHART = pathlib.Path(__file__).parents[2] / "charts" / "sneppx-operator"
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


def training_job(name: str, image: str, *, steps: int = STEPS, s3: dict[str, Any] | None = None,
                 **settings: Any) -> dict[str, Any]:
    """A job of `image` training the script for `steps` (settings: k8s_helpers.script_job's). Checkpoints go to
    the PVC "ckpt", or to `s3` (spec.checkpoint.storage.s3), the script's outputs still to the PVC's "out"."""
    out = f"{builders.CHECKPOINT_DIR}/out" if s3 is None else f"{OUT_DIR}/out"
    command = ["python", f"{SCRIPT_DIR}/{SCRIPT.name}", out, builders.CHECKPOINT_DIR]
    job = k8s_helpers.script_job(name, command, steps=steps, every=EVERY, **settings)
    pod_spec = job["spec"]["template"]["spec"]
    container = pod_spec["containers"][0]
    container.update(image=image, imagePullPolicy="Never",
                     volumeMounts=[{"name": "script", "mountPath": SCRIPT_DIR, "readOnly": True}])
    pod_spec["volumes"] = [{"name": "script", "configMap": {"name": "train-script"}}]
    if s3 is not None:  # the job's checkpoints in the bucket; the claim only for what the test reads back
        job["spec"]["checkpoint"]["storage"] = {"s3": s3}
        pod_spec["volumes"].append({"name": "out", "persistentVolumeClaim": {"claimName": "ckpt"}})
        container["volumeMounts"].append({"name": "out", "mountPath": OUT_DIR})
    return job


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
