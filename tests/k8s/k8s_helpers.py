"""Small helpers shared by the tests against the real API server: a valid job, polling, kubelet stand-in."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import kubernetes
import kubernetes.config.kube_config
import yaml

GROUP, VERSION, PLURAL = "sneppx.io", "v1alpha1", "elastictrainingjobs"
TIMEOUT = 90.0  # how long a job test waits for a state (a failure bound only: loaded 2-core machines)
T = TypeVar("T")


RESTRICTED_NAMESPACE_LABELS = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
    "pod-security.kubernetes.io/warn": "restricted",
    "pod-security.kubernetes.io/warn-version": "latest",
}


def create_namespace(api: kubernetes.client.ApiClient, name: str) -> str:
    """A namespace that enforces (and warns on) the restricted Pod Security profile."""
    kubernetes.client.CoreV1Api(api).create_namespace(
        {"metadata": {"name": name, "labels": RESTRICTED_NAMESPACE_LABELS}}
    )
    return name


def valid_job(name: str = "job", max_nodes: int = 2, min_nodes: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ElasticTrainingJob",
        "metadata": {"name": name},
        "spec": {
            "template": {
                "spec": {
                    "containers": [{"name": "trainer", "image": "example.org/train:1", "command": ["python"]}]
                }
            },
            "elastic": {"minNodes": min_nodes, "maxNodes": max_nodes},
            "checkpoint": {"storage": {"pvc": {"claimName": "ckpt"}}},
        },
    }


def script_job(name: str, command: list[str], *, steps: int, every: int, max_nodes: int = 2, min_nodes: int = 1,
               failure_policy: dict[str, Any] | None = None, **knobs: Any) -> dict[str, Any]:
    """A job whose pods run tests/integration/elastic_script.py by `command`, its E_* knobs in the environment
    (steps, checkpoint interval, the rest as given), a 5 s grace period, fast restarts and 3 steps kept."""
    job = valid_job(name, max_nodes=max_nodes, min_nodes=min_nodes)
    spec = job["spec"]
    container = spec["template"]["spec"]["containers"][0]
    container["command"] = command
    settings = {"steps": steps, "every": every, "sleep": 0.1, "restart_delay": 0.2, **knobs}
    container["env"] = [{"name": f"E_{k.upper()}", "value": str(v)} for k, v in settings.items()]
    spec["template"]["spec"]["terminationGracePeriodSeconds"] = 5
    spec["failurePolicy"] = {"restartDelay": {"initialSeconds": 0, "multiplier": 2, "maxSeconds": 1},
                             **(failure_policy or {})}
    spec["checkpoint"]["maxToKeep"] = 3
    return job


def kubectl_apply(cluster: Any, namespace: str, job: dict[str, Any], tmp: pathlib.Path) -> None:
    """`kubectl apply -f` of the job's manifest, as a user would (`cluster`: a k8s_cluster.Cluster)."""
    manifest = tmp / f"{job['metadata']['name']}.yaml"
    manifest.write_text(yaml.safe_dump(job))
    cluster.kubectl("apply", "-n", namespace, "-f", str(manifest))


def wait_for(probe: Callable[[], T], what: str, timeout: float = 60.0) -> T:
    """Poll until probe() is truthy; fail with the last value seen. The timeout is a failure bound only."""
    deadline = time.monotonic() + timeout
    last: T = probe()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last seen: {last!r}")
        time.sleep(0.2)
        last = probe()
    return last


def mark_pod_ready(core: kubernetes.client.CoreV1Api, namespace: str, name: str) -> None:
    """Play kubelet: report the pod Running and Ready through the status subresource."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    core.patch_namespaced_pod_status(
        name,
        namespace,
        {
            "status": {
                "phase": "Running",
                "conditions": [
                    {"type": "Ready", "status": "True", "lastTransitionTime": now},
                ],
            }
        },
    )


@contextlib.contextmanager
def using_kubeconfig(path: pathlib.Path) -> Iterator[None]:
    """Point KUBECONFIG at `path` for code in this process (kopf's login, the operator's k8s.connect).

    The `kubernetes` package reads KUBECONFIG once, when it is imported, into a module default that
    kopf's login_via_client uses; tests start their cluster later, so that default is moved too.
    """
    module = kubernetes.config.kube_config
    previous_env, previous_default = os.environ.get("KUBECONFIG"), module.KUBE_CONFIG_DEFAULT_LOCATION
    os.environ["KUBECONFIG"] = module.KUBE_CONFIG_DEFAULT_LOCATION = str(path)
    try:
        yield
    finally:
        module.KUBE_CONFIG_DEFAULT_LOCATION = previous_default
        if previous_env is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous_env


def restricted_violations(pod_spec: dict[str, Any]) -> list[str]:
    """Where a pod spec breaks the restricted Pod Security profile (plus our read-only root rule).

    A readable list for rendered manifests; pods the cluster creates are also checked by the API
    server itself (test namespaces enforce the profile).
    """
    problems: list[str] = []
    pod_security = pod_spec.get("securityContext") or {}
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(host):
            problems.append(f"{host} is set")
    for volume in pod_spec.get("volumes") or []:
        if "hostPath" in volume:
            problems.append(f"volume {volume['name']} is a hostPath")
    for container in [*(pod_spec.get("initContainers") or []), *pod_spec.get("containers", [])]:
        name = container.get("name")
        security = container.get("securityContext") or {}
        if security.get("privileged"):
            problems.append(f"{name}: privileged")
        if security.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        capabilities = security.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            problems.append(f"{name}: capabilities do not drop ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds capabilities {capabilities['add']}")
        if security.get("runAsNonRoot", pod_security.get("runAsNonRoot")) is not True:
            problems.append(f"{name}: runAsNonRoot is not true")
        if security.get("runAsUser", pod_security.get("runAsUser")) == 0:
            problems.append(f"{name}: runs as user 0")
        seccomp = (security.get("seccompProfile") or pod_security.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: seccompProfile is {seccomp!r}")
        if security.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{name}: root filesystem is writable")
    return problems


# ---- jobs: create one, read its status, wait for a state -------------------------------------------------------


def read_or_none(call: Callable[..., T], *args: Any) -> T | None:
    """What a read call returns, or None when the object does not exist (404)."""
    try:
        return call(*args)
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def exists(call: Callable[..., Any], *args: Any) -> bool:
    return read_or_none(call, *args) is not None


def custom(api: kubernetes.client.ApiClient) -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(api)


def create(api: kubernetes.client.ApiClient, namespace: str, job: dict[str, Any]) -> None:
    custom(api).create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)


def status(api: kubernetes.client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    """The job's status ({} before the operator wrote one; {"gone": True} once the job is deleted)."""
    try:
        job = custom(api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return {"gone": True}
        raise
    return job.get("status") or {}


def wait_status(api: kubernetes.client.ApiClient, namespace: str, name: str, what: str, check: Any,
                timeout: float = TIMEOUT) -> dict[str, Any]:
    return wait_for(lambda: (s := status(api, namespace, name)) and check(s) and s, what, timeout)


def wait_running(api: kubernetes.client.ApiClient, namespace: str, name: str, count: int = 2) -> dict[str, Any]:
    return wait_status(api, namespace, name, f"phase Running with {count} ready",
                       lambda s: s.get("phase") == "Running" and s.get("readyNodes") == count)


def reason(s: dict[str, Any], type_: str = "Ready") -> str:
    return next((c.get("reason", "") for c in s.get("conditions") or [] if c["type"] == type_), "")


def running_pods(api: kubernetes.client.ApiClient, namespace: str, job: str) -> list[Any]:
    found = kubernetes.client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=f"sneppx.io/job={job}")
    return sorted((p for p in found.items if p.status.phase == "Running" and not p.metadata.deletion_timestamp),
                  key=lambda p: p.metadata.name)


def events(api: kubernetes.client.ApiClient, namespace: str, name: str) -> list[tuple[str, str]]:
    found = kubernetes.client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name},involvedObject.kind=ElasticTrainingJob")
    return [(e.reason, e.message) for e in found.items]


def delete_jobs(api: kubernetes.client.ApiClient, namespace: str) -> None:
    args = (GROUP, VERSION, namespace, PLURAL)
    for job in custom(api).list_namespaced_custom_object(*args)["items"]:
        custom(api).delete_namespaced_custom_object(*args, job["metadata"]["name"])
    wait_for(lambda: not custom(api).list_namespaced_custom_object(*args)["items"], "the jobs deleted", TIMEOUT)


def agent_events(log: str) -> list[dict[str, Any]]:
    """An ElasticTrainer agent's events in its pod's log (operator mode prints one JSON object per line; the
    lines its workers print are skipped)."""
    found = []
    for line in log.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "kind" in event and "agent" in event and "t" in event:
            found.append(event)
    return found
