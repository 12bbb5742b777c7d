"""The operator (kopf, in this process through KopfRunner) against the real API server.

The test namespace enforces the restricted Pod Security profile, so the API server's own admission
plugin rejects any pod the operator builds that isn't restricted. There is no kubelet: tests report pod
status themselves (k8s_helpers.mark_pod_ready) where a kubelet would.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import k8s_cluster
import k8s_helpers
import kopf.testing
import kubernetes
import pytest

pytestmark = pytest.mark.k8s

JOB_LABEL = "sneppx.io/job"


@pytest.fixture(scope="module")
def operator(cluster: k8s_cluster.Cluster) -> Iterator[kopf.testing.KopfRunner]:
    runner = kopf.testing.KopfRunner(
        ["run", "--standalone", "--all-namespaces", "--verbose", "-m", "sneppx_operator.handlers"],
        timeout=60,
    )
    with runner:
        yield runner
    assert runner.exception is None, runner.output[-4000:]
    assert runner.exit_code == 0, runner.output[-4000:]


def _custom(api: kubernetes.client.ApiClient) -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(api)


def _create_job(api: kubernetes.client.ApiClient, namespace: str, job: dict[str, Any]) -> dict[str, Any]:
    return _custom(api).create_namespaced_custom_object(
        k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL, job
    )


def _get_job(api: kubernetes.client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return _custom(api).get_namespaced_custom_object(
        k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL, name
    )


def _patch_job(api: kubernetes.client.ApiClient, namespace: str, name: str, patch: dict[str, Any]) -> None:
    _custom(api).patch_namespaced_custom_object(
        k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL, name, patch
    )


def _pods(api: kubernetes.client.ApiClient, namespace: str, job: str) -> list[Any]:
    pods = kubernetes.client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"{JOB_LABEL}={job}"
    )
    return sorted(pods.items, key=lambda p: p.metadata.name)


def _status_of(api: kubernetes.client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return _get_job(api, namespace, name).get("status") or {}


def _events(api: kubernetes.client.ApiClient, namespace: str, name: str) -> list[tuple[str, str, str]]:
    events = kubernetes.client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name},involvedObject.kind=ElasticTrainingJob"
    )
    return [(e.type, e.reason, e.message) for e in events.items]


def _exists(call: Any, *args: Any) -> bool:
    try:
        call(*args)
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def _env(container: Any) -> dict[str, str]:
    return {e.name: e.value for e in container.env if e.value is not None}


def test_new_job_gets_service_secret_and_restricted_pods(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner
) -> None:
    job = _create_job(api, namespace, k8s_helpers.valid_job("train", max_nodes=2))
    uid = job["metadata"]["uid"]
    pods = k8s_helpers.wait_for(
        lambda: (p := _pods(api, namespace, "train")) and len(p) == 2 and p, "2 rank pods"
    )
    core = kubernetes.client.CoreV1Api(api)

    service = core.read_namespaced_service("train", namespace)
    assert service.spec.cluster_ip == "None", "the Service must be headless"
    assert service.spec.selector == {JOB_LABEL: "train"}
    assert service.spec.publish_not_ready_addresses is True
    secret = core.read_namespaced_secret("train-heartbeat", namespace)
    assert len(base64.b64decode(secret.data["heartbeat-key"])) == 32
    for owned in (service, secret, *pods):
        refs = owned.metadata.owner_references
        assert [(r.kind, r.name, r.uid, r.controller) for r in refs] == [
            ("ElasticTrainingJob", "train", uid, True)
        ]

    for rank, pod in enumerate(pods):
        assert pod.metadata.name == f"train-{rank}"
        assert pod.spec.hostname == f"train-{rank}" and pod.spec.subdomain == "train"
        env = _env(pod.spec.containers[0])
        assert env["SNEPPX_JOB"] == "train"
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["SNEPPX_GENERATION"] == "1"
        assert env["MASTER_ADDR"] == f"train-0.train.{namespace}.svc"
        assert env["MASTER_PORT"] == "29500"
        assert env["SNEPPX_CHECKPOINT_URI"] == "file:///var/lib/sneppx/checkpoints"
        assert pod.spec.security_context.run_as_non_root is True
        assert pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
        security = pod.spec.containers[0].security_context
        assert security.allow_privilege_escalation is False
        assert security.capabilities.drop == ["ALL"]
        assert security.read_only_root_filesystem is True
        assert security.run_as_non_root is True
        claims = [v.persistent_volume_claim.claim_name for v in pod.spec.volumes if v.persistent_volume_claim]
        assert claims == ["ckpt"]

    stored = _get_job(api, namespace, "train")
    assert "sneppx.io/finalizer" in stored["metadata"]["finalizers"]
    events = k8s_helpers.wait_for(
        lambda: [e for e in _events(api, namespace, "train") if e[1] == "CreatedPods"], "a CreatedPods event"
    )
    assert "ranks [0, 1]" in events[0][2]


def test_status_and_printer_columns_fill_in(
    api: kubernetes.client.ApiClient,
    cluster: k8s_cluster.Cluster,
    namespace: str,
    operator: kopf.testing.KopfRunner,
) -> None:
    _create_job(api, namespace, k8s_helpers.valid_job("cols", max_nodes=2, min_nodes=2))
    k8s_helpers.wait_for(lambda: len(_pods(api, namespace, "cols")) == 2, "2 rank pods")
    status = k8s_helpers.wait_for(
        lambda: (s := _status_of(api, namespace, "cols")).get("phase") == "Pending" and s, "phase Pending"
    )
    assert status["readyDesired"] == "0/2"
    assert status["quorum"] == {"healthyPercent": 0, "met": False}

    core = kubernetes.client.CoreV1Api(api)
    for pod in _pods(api, namespace, "cols"):
        k8s_helpers.mark_pod_ready(core, namespace, pod.metadata.name)
    status = k8s_helpers.wait_for(
        lambda: (s := _status_of(api, namespace, "cols")).get("phase") == "Running" and s, "phase Running"
    )
    job = _get_job(api, namespace, "cols")
    assert status["observedGeneration"] == job["metadata"]["generation"]
    assert status["readyDesired"] == "2/2" and status["readyNodes"] == 2 and status["desiredNodes"] == 2
    assert status["membershipGeneration"] == 1 and status["worldSize"] == 2
    assert status["quorum"] == {"healthyPercent": 100, "met": True}
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "True" and conditions["Ready"]["reason"] == "Running"
    assert conditions["QuorumMet"]["status"] == "True"
    assert conditions["Suspended"]["status"] == "False"
    assert [r["rank"] for r in status["ranks"]] == [0, 1] and all(r["ready"] for r in status["ranks"])

    # The runtime reports the last valid checkpoint; the operator's status writes must keep it.
    _custom(api).patch_namespaced_custom_object_status(
        k8s_helpers.GROUP,
        k8s_helpers.VERSION,
        namespace,
        k8s_helpers.PLURAL,
        "cols",
        {"status": {"lastValidCheckpoint": {"step": 1200, "location": "file:///ckpt/step-000001200"}}},
    )
    table = k8s_helpers.wait_for(
        lambda: (out := cluster.kubectl("get", "etj", "-n", namespace).stdout) and "1200" in out and out,
        "kubectl get etj to show the step",
    )
    header, row = (line.split() for line in table.strip().splitlines())
    assert header == ["NAME", "PHASE", "READY", "RESTARTS", "LAST-VALID-STEP", "AGE"]
    assert row[:5] == ["cols", "Running", "2/2", "0", "1200"]


def test_suspend_deletes_pods_keeps_job_and_resume_recreates_them(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner
) -> None:
    _create_job(api, namespace, k8s_helpers.valid_job("pause", max_nodes=2))
    k8s_helpers.wait_for(lambda: len(_pods(api, namespace, "pause")) == 2, "2 rank pods")

    _patch_job(api, namespace, "pause", {"spec": {"suspend": True}})
    k8s_helpers.wait_for(lambda: not _pods(api, namespace, "pause"), "pods deleted on suspend")
    status = k8s_helpers.wait_for(
        lambda: (s := _status_of(api, namespace, "pause")).get("phase") == "Suspended" and s,
        "phase Suspended",
    )
    assert status["readyDesired"] == "0/0"
    assert {c["type"]: c["status"] for c in status["conditions"]}["Suspended"] == "True"
    core = kubernetes.client.CoreV1Api(api)
    assert _exists(core.read_namespaced_service, "pause", namespace), "suspend must keep the Service"
    assert _exists(core.read_namespaced_secret, "pause-heartbeat", namespace), "suspend must keep the Secret"
    k8s_helpers.wait_for(
        lambda: any(e[1] == "Suspended" for e in _events(api, namespace, "pause")), "a Suspended event"
    )

    _patch_job(api, namespace, "pause", {"spec": {"suspend": False}})
    k8s_helpers.wait_for(lambda: len(_pods(api, namespace, "pause")) == 2, "pods recreated on resume")


def test_scale_down_deletes_the_highest_ranks(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner
) -> None:
    _create_job(api, namespace, k8s_helpers.valid_job("shrink", max_nodes=3))
    k8s_helpers.wait_for(lambda: len(_pods(api, namespace, "shrink")) == 3, "3 rank pods")
    _patch_job(api, namespace, "shrink", {"spec": {"elastic": {"maxNodes": 2}}})
    names = k8s_helpers.wait_for(
        lambda: (n := [p.metadata.name for p in _pods(api, namespace, "shrink")]) and len(n) == 2 and n,
        "rank 2 deleted",
    )
    assert names == ["shrink-0", "shrink-1"]


def test_delete_removes_pods_service_and_secret(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner
) -> None:
    _create_job(api, namespace, k8s_helpers.valid_job("gone", max_nodes=2))
    k8s_helpers.wait_for(lambda: len(_pods(api, namespace, "gone")) == 2, "2 rank pods")
    core = kubernetes.client.CoreV1Api(api)
    k8s_helpers.wait_for(
        lambda: _exists(core.read_namespaced_secret, "gone-heartbeat", namespace), "the Secret"
    )

    _custom(api).delete_namespaced_custom_object(
        k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL, "gone"
    )
    k8s_helpers.wait_for(
        lambda: not _exists(_get_job, api, namespace, "gone"), "the job to go (finalizer released)"
    )
    assert _pods(api, namespace, "gone") == []
    assert not _exists(core.read_namespaced_service, "gone", namespace)
    assert not _exists(core.read_namespaced_secret, "gone-heartbeat", namespace)


def test_invalid_template_fails_the_job_with_a_warning_and_recovers_when_fixed(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner
) -> None:
    job = k8s_helpers.valid_job("bad", max_nodes=1)
    job["spec"]["template"]["spec"]["volumes"] = [{"name": "sneppx-tmp", "emptyDir": {}}]
    _create_job(api, namespace, job)
    status = k8s_helpers.wait_for(
        lambda: (s := _status_of(api, namespace, "bad")).get("phase") == "Failed" and s, "phase Failed"
    )
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert ready["reason"] == "InvalidSpec" and "reserved" in ready["message"]
    warnings = k8s_helpers.wait_for(
        lambda: [e for e in _events(api, namespace, "bad") if e[0] == "Warning" and e[1] == "InvalidSpec"],
        "an InvalidSpec warning event",
    )
    assert "sneppx-tmp" in warnings[0][2]
    assert _pods(api, namespace, "bad") == []

    _patch_job(api, namespace, "bad", {"spec": {"template": {"spec": {"volumes": []}}}})
    k8s_helpers.wait_for(lambda: len(_pods(api, namespace, "bad")) == 1, "the pod once the spec is fixed")
