"""The test cluster's kube-controller-manager (k8s_cluster.py): its garbage collector deletes what a deleted
owner owned, and its namespace controller empties a deleted namespace and lets it go.

The operator relies on the first to remove a job's pods, Service, Secret, ConfigMap, ServiceAccount, Role and
RoleBinding once the job is deleted (owner references, no finalizer of its own), so the job case below owns
one of each, its pod really running under the kubelet stand-in. No operator runs in this module: what goes,
the garbage collector deleted.
"""

from __future__ import annotations

import pathlib
from typing import Any

import k8s_helpers
import kubernetes
import pod_runner
import pytest

pytestmark = pytest.mark.k8s


def _owned_by(owner: Any, api_version: str, kind: str) -> dict[str, Any]:
    """A controller reference that blocks the owner's foreground deletion until the dependent is gone."""
    metadata = owner["metadata"] if isinstance(owner, dict) else owner.metadata.to_dict()
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": metadata["name"],
        "uid": metadata["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _gone(read: Any, *args: Any) -> bool:
    return not k8s_helpers.exists(read, *args)


@pytest.mark.parametrize("propagation", ["Background", "Foreground"])
def test_a_configmap_owned_by_a_deleted_configmap_is_collected(
    api: kubernetes.client.ApiClient, namespace: str, propagation: str
) -> None:
    core = kubernetes.client.CoreV1Api(api)
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    reference = _owned_by(owner, "v1", "ConfigMap")
    dependent = {"metadata": {"name": "dependent", "ownerReferences": [reference]}}
    core.create_namespaced_config_map(namespace, dependent)
    bystander = core.create_namespaced_config_map(namespace, {"metadata": {"name": "bystander"}})
    assert k8s_helpers.exists(core.read_namespaced_config_map, "dependent", namespace)

    core.delete_namespaced_config_map("owner", namespace, propagation_policy=propagation)

    if propagation == "Foreground":
        # The owner waits, with the foregroundDeletion finalizer, until the collector has deleted its blocking
        # dependent; then the collector lifts the finalizer. So once the owner is gone, the dependent is too.
        k8s_helpers.wait_for(
            lambda: _gone(core.read_namespaced_config_map, "owner", namespace),
            "the owner deleted in the foreground",
        )
        assert _gone(core.read_namespaced_config_map, "dependent", namespace)
    else:
        assert _gone(core.read_namespaced_config_map, "owner", namespace)
        k8s_helpers.wait_for(
            lambda: _gone(core.read_namespaced_config_map, "dependent", namespace), "the dependent collected"
        )
    assert core.read_namespaced_config_map("bystander", namespace).metadata.uid == bystander.metadata.uid


def _sleeping_pod(name: str, reference: dict[str, Any]) -> dict[str, Any]:
    """A pod the namespace's restricted Pod Security admission accepts; the kubelet stand-in runs it (in a
    directory of its own, which it makes for the pod's first volume)."""
    return {
        "metadata": {"name": name, "ownerReferences": [reference]},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "trainer",
                    "image": "example.org/train:1",
                    "command": ["python", "-c", "import time; time.sleep(3600)"],
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                }
            ],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
        },
    }


def test_what_a_deleted_job_owned_is_collected(
    api: kubernetes.client.ApiClient, namespace: str, pods: pod_runner.PodRunner
) -> None:
    core, rbac = kubernetes.client.CoreV1Api(api), kubernetes.client.RbacAuthorizationV1Api(api)
    custom = k8s_helpers.custom(api)
    job_args = (k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL)
    k8s_helpers.create(api, namespace, k8s_helpers.valid_job("owner"))
    job = custom.get_namespaced_custom_object(*job_args, "owner")
    reference = _owned_by(job, f"{k8s_helpers.GROUP}/{k8s_helpers.VERSION}", "ElasticTrainingJob")

    def meta(name: str) -> dict[str, Any]:
        return {"name": name, "ownerReferences": [reference]}

    core.create_namespaced_pod(namespace, _sleeping_pod("owner-0", reference))
    core.create_namespaced_config_map(namespace, {"metadata": meta("owner-config"), "data": {"k": "v"}})
    core.create_namespaced_secret(namespace, {"metadata": meta("owner-secret"), "data": {"k": "dg=="}})
    core.create_namespaced_service(
        namespace, {"metadata": meta("owner"), "spec": {"clusterIP": "None", "ports": [{"port": 29400}]}}
    )
    core.create_namespaced_service_account(namespace, {"metadata": meta("owner-agent")})
    rules = [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}]
    rbac.create_namespaced_role(namespace, {"metadata": meta("owner-agent"), "rules": rules})
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": meta("owner-agent"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "owner-agent"},
            "subjects": [{"kind": "ServiceAccount", "name": "owner-agent", "namespace": namespace}],
        },
    )
    reads = {
        "Pod": (core.read_namespaced_pod, "owner-0"),
        "ConfigMap": (core.read_namespaced_config_map, "owner-config"),
        "Secret": (core.read_namespaced_secret, "owner-secret"),
        "Service": (core.read_namespaced_service, "owner"),
        "ServiceAccount": (core.read_namespaced_service_account, "owner-agent"),
        "Role": (rbac.read_namespaced_role, "owner-agent"),
        "RoleBinding": (rbac.read_namespaced_role_binding, "owner-agent"),
    }
    pid = k8s_helpers.wait_for(lambda: pods.pid("owner-0"), "the pod's process started")
    k8s_helpers.wait_for(
        lambda: core.read_namespaced_pod("owner-0", namespace).status.phase == "Running", "the pod Running"
    )
    assert all(k8s_helpers.exists(read, name, namespace) for read, name in reads.values())

    custom.delete_namespaced_custom_object(*job_args, "owner")

    def left() -> list[str]:
        return [kind for kind, (read, name) in reads.items() if k8s_helpers.exists(read, name, namespace)]

    try:
        k8s_helpers.wait_for(lambda: not left(), "everything the job owned deleted", k8s_helpers.TIMEOUT)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still there: {left()}") from None
    # The pod went the way a kubelet ends one: its process was stopped before the pod object was removed.
    assert pods.pid("owner-0") is None
    assert not pathlib.Path(f"/proc/{pid}").exists()
    assert _gone(custom.get_namespaced_custom_object, *job_args, "owner")


def test_a_deleted_namespace_is_emptied_and_goes_away(
    api: kubernetes.client.ApiClient, namespace: str
) -> None:
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "settings"}, "data": {"k": "v"}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "credentials"}, "data": {"k": "dg=="}})
    k8s_helpers.create(api, namespace, k8s_helpers.valid_job("left-behind"))

    core.delete_namespace(namespace)

    k8s_helpers.wait_for(
        lambda: _gone(core.read_namespace, namespace),
        "the namespace deleted, not left Terminating",
        k8s_helpers.TIMEOUT,
    )
    jobs = k8s_helpers.custom(api).list_cluster_custom_object(
        k8s_helpers.GROUP, k8s_helpers.VERSION, k8s_helpers.PLURAL
    )
    assert not [j for j in jobs["items"] if j["metadata"]["namespace"] == namespace]
