"""The operator (kopf, in this process through KopfRunner) against the real API server.

The test namespace enforces the restricted Pod Security profile, so the API server's own admission
plugin rejects any pod the operator builds that isn't restricted. There is no kubelet here: tests report pod
status themselves (k8s_helpers.mark_pod_ready) where a kubelet would (test_lifecycle.py runs pods for real).
"""

from __future__ import annotations

import base64
import json
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


def _delete_job_and_wait(api: kubernetes.client.ApiClient, namespace: str, name: str) -> None:
    _custom(api).delete_namespaced_custom_object(
        k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL, name
    )
    k8s_helpers.wait_for(
        lambda: not k8s_helpers.exists(_get_job, api, namespace, name), "the job to go (finalizer released)"
    )


def _secret_name(job: dict[str, Any]) -> str:
    """The heartbeat Secret's name carries the job's uid (no one else's Secret can be taken for it)."""
    return f"{job['metadata']['name']}-heartbeat-{job['metadata']['uid'][:8]}"


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
    secret = core.read_namespaced_secret(_secret_name(job), namespace)
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
        assert env["SNEPPX_CHECKPOINT_URI"] == f"file:///var/lib/sneppx/checkpoints/{namespace}/train"
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
    assert not stored["metadata"].get("finalizers"), "the operator puts no finalizer on a job"
    events = k8s_helpers.wait_for(
        lambda: [e for e in _events(api, namespace, "train") if e[1] == "CreatedPods"], "a CreatedPods event"
    )
    assert "ranks 0-1" in events[0][2]


def test_status_and_printer_columns_fill_in(
    api: kubernetes.client.ApiClient,
    cluster: k8s_cluster.Cluster,
    namespace: str,
    operator: kopf.testing.KopfRunner,
) -> None:
    _create_job(api, namespace, k8s_helpers.valid_job("cols", max_nodes=2, min_nodes=2))
    k8s_helpers.wait_for(lambda: len(_pods(api, namespace, "cols")) == 2, "2 rank pods")
    status = _wait_for_phase(api, namespace, "cols", "Pending")
    assert status["readyDesired"] == "0/2"
    assert status["quorum"] == {"healthyPercent": 0, "met": False}

    core = kubernetes.client.CoreV1Api(api)
    for pod in _pods(api, namespace, "cols"):
        k8s_helpers.mark_pod_ready(core, namespace, pod.metadata.name)
    status = _wait_for_phase(api, namespace, "cols", "Running")
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

    # Rank 0 reports the last valid checkpoint through the job's rendezvous object; the operator puts it in status.
    report = {
        "version": 1, "kind": "report", "generation": 0, "world_size": 2, "members": ["cols-0", "cols-1"],
        "last_valid_checkpoint": {"step": 1200, "location": "file:///ckpt/step-000001200",
                                  "time": "2026-01-02T03:04:05Z"},
        "resumed_from": None, "reported_at": "2026-01-02T03:04:06Z",
    }
    core.patch_namespaced_config_map("cols-rendezvous", namespace, {"data": {"job.report": json.dumps(report)}})
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
    job = _create_job(api, namespace, k8s_helpers.valid_job("pause", max_nodes=2))
    k8s_helpers.wait_for(lambda: len(_pods(api, namespace, "pause")) == 2, "2 rank pods")

    _patch_job(api, namespace, "pause", {"spec": {"suspend": True}})
    k8s_helpers.wait_for(lambda: not _pods(api, namespace, "pause"), "pods deleted on suspend")
    status = _wait_for_phase(api, namespace, "pause", "Suspended")
    assert status["readyDesired"] == "0/0"
    assert {c["type"]: c["status"] for c in status["conditions"]}["Suspended"] == "True"
    core = kubernetes.client.CoreV1Api(api)
    assert k8s_helpers.exists(core.read_namespaced_service, "pause", namespace), "suspend must keep the Service"
    assert k8s_helpers.exists(core.read_namespaced_secret, _secret_name(job), namespace), "suspend must keep the Secret"
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
    first = {p.metadata.labels["sneppx.io/membership-generation"] for p in _pods(api, namespace, "shrink")}
    _patch_job(api, namespace, "shrink", {"spec": {"elastic": {"maxNodes": 2}}})

    def resized() -> list[str] | None:
        # a resize is a new pod generation (another WORLD_SIZE): every pod is replaced, so pods are judged once
        # the next generation's are all there, not at the first moment two pods exist
        pods = _pods(api, namespace, "shrink")
        generations = {p.metadata.labels["sneppx.io/membership-generation"] for p in pods}
        return [p.metadata.name for p in pods] if len(pods) == 2 and not generations & first else None

    assert k8s_helpers.wait_for(resized, "ranks 0-1 of the next generation, rank 2 gone") == ["shrink-0", "shrink-1"]


def test_a_deleted_jobs_objects_are_garbage_collected(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner
) -> None:
    job = _create_job(api, namespace, k8s_helpers.valid_job("gone", max_nodes=2))
    k8s_helpers.wait_for(lambda: len(_pods(api, namespace, "gone")) == 2, "2 rank pods")
    core = kubernetes.client.CoreV1Api(api)
    k8s_helpers.wait_for(
        lambda: k8s_helpers.exists(core.read_namespaced_secret, _secret_name(job), namespace), "the Secret"
    )

    assert not _get_job(api, namespace, "gone")["metadata"].get("finalizers"), "nothing holds a deletion up"

    _delete_job_and_wait(api, namespace, "gone")
    # The garbage collector (kube-controller-manager) removes what the job owned, by its owner references.
    rbac = kubernetes.client.RbacAuthorizationV1Api(api)
    for what, read, name in (
        ("pods", lambda: _pods(api, namespace, "gone"), None),
        ("Service", core.read_namespaced_service, "gone"),
        ("Secret", core.read_namespaced_secret, _secret_name(job)),
        ("rendezvous ConfigMap", core.read_namespaced_config_map, "gone-rendezvous"),
        ("ServiceAccount", core.read_namespaced_service_account, "gone-agent"),
        ("Role", rbac.read_namespaced_role, "gone-agent"),
        ("RoleBinding", rbac.read_namespaced_role_binding, "gone-agent"),
    ):
        if name is None:
            k8s_helpers.wait_for(lambda read=read: read() == [], f"the {what} collected")
        else:
            k8s_helpers.wait_for(lambda read=read, name=name: not k8s_helpers.exists(read, name, namespace),
                                 f"the {what} collected")


def test_a_finalizer_an_older_operator_left_is_taken_off_and_no_other(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner
) -> None:
    job = k8s_helpers.valid_job("legacy", max_nodes=1)
    job["metadata"]["finalizers"] = ["example.org/keep", "sneppx.io/finalizer"]
    _create_job(api, namespace, job)
    k8s_helpers.wait_for(
        lambda: _get_job(api, namespace, "legacy")["metadata"].get("finalizers") == ["example.org/keep"],
        "the legacy finalizer taken off",
    )
    _patch_job(api, namespace, "legacy", {"metadata": {"finalizers": None}})
    _delete_job_and_wait(api, namespace, "legacy")


def test_invalid_template_fails_the_job_with_a_warning_and_recovers_when_fixed(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner
) -> None:
    job = k8s_helpers.valid_job("bad", max_nodes=1)
    job["spec"]["template"]["spec"]["volumes"] = [{"name": "sneppx-tmp", "emptyDir": {}}]
    _create_job(api, namespace, job)
    status = _wait_for_phase(api, namespace, "bad", "Failed")
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


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def _wait_for_phase(
    api: kubernetes.client.ApiClient, namespace: str, name: str, phase: str
) -> dict[str, Any]:
    return k8s_helpers.wait_for(
        lambda: (s := _status_of(api, namespace, name)).get("phase") == phase and s, f"phase {phase}"
    )


def _wait_for_resource_failure(
    api: kubernetes.client.ApiClient, namespace: str, name: str, reason: str, detail: str = ""
) -> dict[str, Any]:
    """The job's ResourceFailure condition once it has `reason` and `detail` in its message."""

    def probe() -> dict[str, Any]:
        failure = _condition(_status_of(api, namespace, name), "ResourceFailure")
        return failure if failure.get("reason") == reason and detail in failure.get("message", "") else {}

    return k8s_helpers.wait_for(probe, f"a ResourceFailure condition with reason {reason}")


def _wait_for_warning(api: kubernetes.client.ApiClient, namespace: str, name: str, reason: str) -> None:
    k8s_helpers.wait_for(
        lambda: [e for e in _events(api, namespace, name) if e[:2] == ("Warning", reason)],
        f"a {reason} warning event",
    )


def _restricted_pod(name: str, labels: dict[str, str], owner: dict[str, Any]) -> dict[str, Any]:
    """Someone else's pod that passes the namespace's restricted Pod Security admission."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels, "ownerReferences": [owner]},
        "spec": {
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "db",
                    "image": "example.org/db:1",
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                }
            ],
        },
    }


def _someone_else(core: kubernetes.client.CoreV1Api, namespace: str) -> dict[str, Any]:
    """A controller ownerReference to an object that isn't the job (a ConfigMap stands in for any owner)."""
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "someone-else"}})
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "someone-else",
        "uid": owner.metadata.uid,
        "controller": True,
    }


def test_objects_someone_else_owns_survive_a_job_of_the_same_name(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner
) -> None:
    core = kubernetes.client.CoreV1Api(api)
    owner = _someone_else(core, namespace)
    service = core.create_namespaced_service(
        namespace, {"metadata": {"name": "postgres"}, "spec": {"ports": [{"port": 5432}]}}
    )
    secret = core.create_namespaced_secret(
        namespace,
        {"metadata": {"name": "postgres-heartbeat", "ownerReferences": [owner]}, "data": {"k": "dg=="}},
    )
    # A look-alike: the job's labels, someone else's controller. It must be neither counted nor deleted.
    labels = {JOB_LABEL: "postgres", "sneppx.io/rank": "0", "sneppx.io/membership-generation": "1"}
    pod = core.create_namespaced_pod(namespace, _restricted_pod("postgres-0", labels, owner))

    _create_job(api, namespace, k8s_helpers.valid_job("postgres", max_nodes=1))
    failure = _wait_for_resource_failure(api, namespace, "postgres", "NameInUse")
    assert failure["status"] == "True"
    assert (
        'Service "postgres" already exists and is not controlled by this job (it has no controller)'
        in (failure["message"])
    )
    _wait_for_warning(api, namespace, "postgres", "NameInUse")
    assert _status_of(api, namespace, "postgres")["readyNodes"] == 0, "the look-alike pod is not a rank"

    _delete_job_and_wait(api, namespace, "postgres")
    assert core.read_namespaced_service("postgres", namespace).metadata.uid == service.metadata.uid
    assert core.read_namespaced_secret("postgres-heartbeat", namespace).metadata.uid == secret.metadata.uid
    assert core.read_namespaced_pod("postgres-0", namespace).metadata.uid == pod.metadata.uid


def test_a_pod_name_someone_else_holds_is_reported_with_its_controller(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner
) -> None:
    core = kubernetes.client.CoreV1Api(api)
    owner = _someone_else(core, namespace)
    pod = core.create_namespaced_pod(namespace, _restricted_pod("db-0", {"app": "db"}, owner))
    job = _create_job(api, namespace, k8s_helpers.valid_job("db", max_nodes=1))
    failure = _wait_for_resource_failure(api, namespace, "db", "NameInUse")
    assert failure["message"].startswith('Pod "db-0" already exists and is not controlled by this job')
    assert f"its controller is ConfigMap someone-else (uid {owner['uid']})" in failure["message"]

    _delete_job_and_wait(api, namespace, "db")
    # the job's own objects go with it (the garbage collector follows their owner references, a moment later) ...
    k8s_helpers.wait_for(lambda: not k8s_helpers.exists(core.read_namespaced_service, "db", namespace),
                         "the job's own Service to go")
    k8s_helpers.wait_for(lambda: not k8s_helpers.exists(core.read_namespaced_secret, _secret_name(job), namespace),
                         "the job's Secret to go")
    # ... and the pod someone else controls stays
    assert core.read_namespaced_pod("db-0", namespace).metadata.uid == pod.metadata.uid


def test_a_quota_refusal_reaches_status_and_events_and_clears_when_the_quota_allows(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner
) -> None:
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespaced_resource_quota(
        namespace, {"metadata": {"name": "pods"}, "spec": {"hard": {"pods": "1"}}}
    )
    # No controller-manager here: play the quota controller and publish the quota's status once.
    core.patch_namespaced_resource_quota_status(
        "pods", namespace, {"status": {"hard": {"pods": "1"}, "used": {"pods": "0"}}}
    )
    _create_job(api, namespace, k8s_helpers.valid_job("quota", max_nodes=2))
    failure = _wait_for_resource_failure(api, namespace, "quota", "FailedCreate")
    assert failure["message"].startswith('the API server refused to create Pod "quota-1" (403)')
    assert "exceeded quota: pods" in failure["message"]
    _wait_for_warning(api, namespace, "quota", "FailedCreate")
    assert [p.metadata.name for p in _pods(api, namespace, "quota")] == ["quota-0"]

    core.patch_namespaced_resource_quota("pods", namespace, {"spec": {"hard": {"pods": "2"}}})
    core.patch_namespaced_resource_quota_status("pods", namespace, {"status": {"hard": {"pods": "2"}}})
    k8s_helpers.wait_for(lambda: len(_pods(api, namespace, "quota")) == 2, "rank 1 once the quota allows it")
    k8s_helpers.wait_for(
        lambda: not _condition(_status_of(api, namespace, "quota"), "ResourceFailure"),
        "the condition to clear",
    )


def test_a_pod_the_api_server_rejects_fails_the_job_until_the_spec_is_fixed(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner
) -> None:
    job = k8s_helpers.valid_job("rejected", max_nodes=1)
    job["spec"]["template"]["spec"]["containers"][0]["name"] = (
        "Not_A_DNS_Label"  # the CRD can't tell; Pods can
    )
    _create_job(api, namespace, job)
    status = _wait_for_phase(api, namespace, "rejected", "Failed")
    ready = _condition(status, "Ready")
    assert ready["reason"] == "InvalidSpec"
    assert ready["message"].startswith('the API server refused to create Pod "rejected-0" (422)')
    assert "Not_A_DNS_Label" in ready["message"]
    _wait_for_warning(api, namespace, "rejected", "InvalidSpec")
    fixed = [{"name": "trainer", "image": "example.org/train:1"}]
    _patch_job(api, namespace, "rejected", {"spec": {"template": {"spec": {"containers": fixed}}}})
    k8s_helpers.wait_for(
        lambda: len(_pods(api, namespace, "rejected")) == 1, "the pod once the spec is fixed"
    )


def test_a_new_size_is_a_new_membership_generation_with_one_world_size(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner
) -> None:
    _create_job(api, namespace, k8s_helpers.valid_job("grow", max_nodes=2))
    k8s_helpers.wait_for(lambda: len(_pods(api, namespace, "grow")) == 2, "2 rank pods")
    _patch_job(api, namespace, "grow", {"spec": {"elastic": {"maxNodes": 3}}})

    def membership() -> list[tuple[str, str]]:
        return [
            (_env(p.spec.containers[0])["SNEPPX_GENERATION"], _env(p.spec.containers[0])["WORLD_SIZE"])
            for p in _pods(api, namespace, "grow")
        ]

    assert k8s_helpers.wait_for(
        lambda: (m := membership()) == [("2", "3")] * 3 and m, "generation 2 of size 3"
    )
    status = k8s_helpers.wait_for(
        lambda: (s := _status_of(api, namespace, "grow")).get("membershipGeneration") == 2 and s, "status"
    )
    assert status["worldSize"] == 3
    k8s_helpers.wait_for(
        lambda: [e for e in _events(api, namespace, "grow") if e[1] == "MembershipChanged"],
        "a MembershipChanged event",
    )


def test_a_rank_that_failed_with_no_restart_budget_fails_the_job_with_its_exit_code_and_stops_the_rest(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner
) -> None:
    job = k8s_helpers.valid_job("crash", max_nodes=2)
    job["spec"]["failurePolicy"] = {"maxRestarts": 0}
    _create_job(api, namespace, job)
    pods = k8s_helpers.wait_for(lambda: (p := _pods(api, namespace, "crash")) and len(p) == 2 and p, "2 pods")
    core = kubernetes.client.CoreV1Api(api)
    core.patch_namespaced_pod_status(  # play kubelet: rank 0's training container was OOM-killed
        pods[0].metadata.name,
        namespace,
        {
            "status": {
                "phase": "Failed",
                "containerStatuses": [
                    {
                        "name": "trainer",
                        "image": "example.org/train:1",
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
                    }
                ],
            }
        },
    )
    status = _wait_for_phase(api, namespace, "crash", "Failed")
    failed = _condition(status, "Failed")
    assert failed["reason"] == "RestartBudgetExhausted"
    assert failed["message"] == (
        "rank 0 (pod crash-0) failed (OOMKilled) with exit code 137; the restart budget "
        "(failurePolicy.maxRestarts 0) is used up, so the job has failed"
    )
    assert (status["ranks"][0]["rank"], status["ranks"][0].get("exitCode")) == (0, 137)
    assert status.get("completionTime")
    _wait_for_warning(api, namespace, "crash", "RestartBudgetExhausted")
    k8s_helpers.wait_for(
        lambda: [p.metadata.name for p in _pods(api, namespace, "crash")] == ["crash-0"],
        "rank 1 stopped; the failed pod kept for its logs",
    )


def test_test_namespaces_enforce_the_restricted_profile(
    api: kubernetes.client.ApiClient, namespace: str
) -> None:
    """The oracle the operator's pods are checked by: the API server's own PodSecurity admission."""
    bare = {"metadata": {"name": "bare"}, "spec": {"containers": [{"name": "c", "image": "example.org/x:1"}]}}
    with pytest.raises(kubernetes.client.ApiException) as refused:
        kubernetes.client.CoreV1Api(api).create_namespaced_pod(namespace, bare)
    assert refused.value.status == 403
    assert 'violates PodSecurity "restricted:latest"' in json.loads(refused.value.body)["message"]


def test_choices_the_restricted_profile_allows_pass_pod_security_admission(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner
) -> None:
    job = k8s_helpers.valid_job("choices", max_nodes=1)
    job["spec"]["template"]["spec"]["securityContext"] = {
        "runAsUser": 1000,
        "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/train.json"},
        "seLinuxOptions": {"type": "container_t"},
        "sysctls": [{"name": "net.ipv4.tcp_keepalive_time", "value": "60"}],
    }
    job["spec"]["template"]["spec"]["containers"][0]["securityContext"] = {
        "capabilities": {"add": ["NET_BIND_SERVICE"]}
    }
    _create_job(api, namespace, job)
    pod = k8s_helpers.wait_for(lambda: (p := _pods(api, namespace, "choices")) and p[0], "the pod")
    assert pod.spec.security_context.seccomp_profile.type == "Localhost"
    assert pod.spec.containers[0].security_context.capabilities.add == ["NET_BIND_SERVICE"]


def test_what_only_the_operator_can_check_fails_the_job_with_its_message(
    api: kubernetes.client.ApiClient, namespace: str, operator: kopf.testing.KopfRunner
) -> None:
    job = k8s_helpers.valid_job("nfs", max_nodes=1)
    job["spec"]["template"]["spec"]["volumes"] = [
        {"name": "data", "nfs": {"server": "127.0.0.1", "path": "/"}}
    ]
    _create_job(api, namespace, job)  # the CRD can't list every volume type; the builder can
    status = _wait_for_phase(api, namespace, "nfs", "Failed")
    ready = _condition(status, "Ready")
    assert ready["reason"] == "InvalidSpec" and "volume 'data' is a nfs volume" in ready["message"]
    assert _pods(api, namespace, "nfs") == []
