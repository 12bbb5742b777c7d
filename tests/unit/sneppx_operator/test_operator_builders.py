"""Manifests the operator builds, checked without a cluster (the same pods also go through the real
API server's restricted Pod Security admission in tests/k8s/test_operator.py)."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest

from sneppx_operator import builders
from sneppx_operator.errors import JobSpecError


def spec(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "template": {
            "metadata": {"labels": {"team": "a"}, "annotations": {"note": "x"}},
            "spec": {"containers": [{"name": "trainer", "image": "example.org/t:1"}]},
        },
        "elastic": {"minNodes": 1, "maxNodes": 4, "procsPerNode": 8, "port": 29600},
        "checkpoint": {
            "storage": {"pvc": {"claimName": "ckpt", "subPath": "runs/a"}},
            "saveEveryNSteps": 50,
            "maxToKeep": 4,
            "validation": "Quick",
            "rollbackDepth": 1,
        },
    }
    base.update(overrides)
    return base


def pod(
    job_spec: dict[str, Any] | None = None, rank: int = 1, world: int = 4, generation: int = 3
) -> dict[str, Any]:
    return builders.build_pod("train", "ns", "uid-1", job_spec or spec(), rank, world, generation)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_pod_carries_the_rank_environment() -> None:
    env = env_of(pod()["spec"]["containers"][0])
    assert env["SNEPPX_JOB"] == "train" and env["SNEPPX_NAMESPACE"] == "ns"
    assert env["RANK"] == "1" and env["NODE_RANK"] == "1" and env["WORLD_SIZE"] == "4"
    assert env["SNEPPX_PROCS_PER_NODE"] == "8"
    assert env["SNEPPX_GENERATION"] == "3"
    assert env["MASTER_ADDR"] == "train-0.train.ns.svc"
    assert env["MASTER_PORT"] == "29600"
    assert env["SNEPPX_CHECKPOINT_URI"] == "file:///var/lib/sneppx/checkpoints"
    assert env["SNEPPX_SAVE_EVERY_N_STEPS"] == "50" and env["SNEPPX_MAX_TO_KEEP"] == "4"
    assert env["SNEPPX_CHECKPOINT_VALIDATION"] == "Quick" and env["SNEPPX_ROLLBACK_DEPTH"] == "1"
    assert env["SNEPPX_HEARTBEAT_KEY_FILE"] == "/var/run/sneppx/heartbeat/heartbeat-key"
    assert env["SNEPPX_SNAPSHOT_EVERY_N_STEPS"] == "0" and env["SNEPPX_SNAPSHOT_REPLICAS"] == "1"  # off by default
    node = next(e for e in pod()["spec"]["containers"][0]["env"] if e["name"] == "SNEPPX_NODE_NAME")
    assert node["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}  # copies go to other nodes


def test_pod_identity_owner_and_labels() -> None:
    built = pod()
    meta = built["metadata"]
    assert meta["name"] == "train-1" and meta["namespace"] == "ns"
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "sneppx.io/v1alpha1",
            "kind": "ElasticTrainingJob",
            "name": "train",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert meta["labels"] == {
        "team": "a",
        "sneppx.io/job": "train",
        "sneppx.io/rank": "1",
        "sneppx.io/membership-generation": "3",
        "app.kubernetes.io/managed-by": "sneppx-operator",
    }
    assert meta["annotations"] == {"note": "x"}
    assert built["spec"]["hostname"] == "train-1" and built["spec"]["subdomain"] == "train"
    assert built["spec"]["restartPolicy"] == "Never"
    assert built["spec"]["automountServiceAccountToken"] is False


def test_restricted_defaults_fill_what_the_template_leaves_unset() -> None:
    job = spec()
    job["template"]["spec"]["initContainers"] = [{"name": "init", "image": "x"}]
    built = pod(job)["spec"]
    assert built["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"},
                                        "fsGroup": builders.KEY_GROUP, "fsGroupChangePolicy": "OnRootMismatch"}
    for container in [*built["containers"], *built["initContainers"]]:
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        }


def test_choices_the_restricted_profile_allows_are_kept() -> None:
    job = spec()
    job["template"]["spec"]["securityContext"] = {
        "runAsUser": 1000,
        "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/train.json"},
        "seLinuxOptions": {"type": "container_t", "level": "s0:c1,c2"},
        "sysctls": [{"name": "net.ipv4.tcp_keepalive_time", "value": "60"}],
    }
    job["template"]["spec"]["containers"][0]["securityContext"] = {
        "capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["NET_RAW"]},
        "runAsGroup": 2000,
        "appArmorProfile": {"type": "RuntimeDefault"},
        "readOnlyRootFilesystem": False,
    }
    job["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": 8080}]
    built = pod(job)["spec"]
    assert built["securityContext"]["seccompProfile"]["type"] == "Localhost", "a Localhost profile is kept"
    assert built["securityContext"]["runAsUser"] == 1000 and built["securityContext"]["runAsNonRoot"] is True
    security = built["containers"][0]["securityContext"]
    assert security["capabilities"] == {"add": ["NET_BIND_SERVICE"], "drop": ["ALL", "NET_RAW"]}
    assert security["runAsGroup"] == 2000 and security["appArmorProfile"] == {"type": "RuntimeDefault"}
    assert security["readOnlyRootFilesystem"] is True, "the operator's read-only root is not negotiable"


FORBIDDEN = [
    ("hostPath", lambda t: t.update(volumes=[{"name": "d", "hostPath": {"path": "/"}}]), "'d' is a hostPath"),
    ("nfs", lambda t: t.update(volumes=[{"name": "d", "nfs": {"server": "x", "path": "/"}}]), "'d' is a nfs"),
    ("hostIPC", lambda t: t.update(hostIPC=True), "hostIPC is not allowed"),
    ("token", lambda t: t.update(automountServiceAccountToken=True), "automountServiceAccountToken: true"),
    (
        "pod-non-root-false",
        lambda t: t.update(securityContext={"runAsNonRoot": False}),
        "runAsNonRoot: false",
    ),
    (
        "pod-seccomp",
        lambda t: t.update(securityContext={"seccompProfile": {"type": "Unconfined"}}),
        "seccompProfile.type: 'Unconfined'",
    ),
    (
        "selinux-type",
        lambda t: t.update(securityContext={"seLinuxOptions": {"type": "spc_t"}}),
        "seLinuxOptions.type: 'spc_t'",
    ),
    (
        "selinux-user",
        lambda t: t.update(securityContext={"seLinuxOptions": {"user": "system_u"}}),
        "seLinuxOptions.user",
    ),
    (
        "sysctl",
        lambda t: t.update(securityContext={"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}),
        "'kernel.msgmax', not one of the safe sysctls",
    ),
    (
        "windows-host-process",
        lambda t: t.update(securityContext={"windowsOptions": {"hostProcess": True}}),
        "windowsOptions.hostProcess: true",
    ),
    ("privileged", lambda t: _trainer(t, privileged=True), "'trainer' sets securityContext.privileged: true"),
    (
        "escalation",
        lambda t: _trainer(t, allowPrivilegeEscalation=True),
        "'trainer' sets securityContext.allowPrivilegeEscalation: true",
    ),
    (
        "capability",
        lambda t: _trainer(t, capabilities={"add": ["NET_BIND_SERVICE", "SYS_ADMIN"]}),
        r"adds capabilities \['SYS_ADMIN'\]",
    ),
    ("container-non-root", lambda t: _trainer(t, runAsNonRoot=False), "'trainer' sets runAsNonRoot: false"),
    (
        "container-seccomp",
        lambda t: _trainer(t, seccompProfile={"type": "Unconfined"}),
        "'trainer' sets seccompProfile.type: 'Unconfined'",
    ),
    (
        "apparmor",
        lambda t: _trainer(t, appArmorProfile={"type": "Unconfined"}),
        "'trainer' sets appArmorProfile.type: 'Unconfined'",
    ),
    ("proc-mount", lambda t: _trainer(t, procMount="Unmasked"), "procMount: 'Unmasked'"),
    (
        "host-port",
        lambda t: t["containers"][0].update(ports=[{"containerPort": 80, "hostPort": 80}]),
        "'trainer' sets hostPort: 80",
    ),
    (
        "probe-host",
        lambda t: t["containers"][0].update(livenessProbe={"httpGet": {"host": "10.0.0.1", "port": 80}}),
        "livenessProbe.httpGet.host",
    ),
    (
        "init-privileged",
        lambda t: t.update(
            initContainers=[{"name": "init", "image": "x", "securityContext": {"privileged": True}}]
        ),
        "'init' sets securityContext.privileged: true",
    ),
]


def _trainer(template_spec: dict[str, Any], **security: Any) -> None:
    template_spec["containers"][0]["securityContext"] = security


@pytest.mark.parametrize(
    ("mutate", "message"), [(m, e) for _, m, e in FORBIDDEN], ids=[i for i, _, _ in FORBIDDEN]
)
def test_what_the_restricted_profile_forbids_is_refused_not_rewritten(mutate: Any, message: str) -> None:
    job = spec()
    mutate(job["template"]["spec"])
    with pytest.raises(JobSpecError, match=message) as refused:
        pod(job)
    assert "restricted Pod Security profile" in str(refused.value)


def test_an_unconfined_apparmor_annotation_is_refused() -> None:
    job = spec()
    job["template"]["metadata"]["annotations"] = {
        "container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"
    }
    with pytest.raises(JobSpecError, match="is 'unconfined'"):
        pod(job)
    job["template"]["metadata"]["annotations"]["container.apparmor.security.beta.kubernetes.io/trainer"] = (
        "localhost/train"
    )
    assert pod(job)["metadata"]["annotations"]


def test_every_violation_is_named_at_once() -> None:
    job = spec()
    job["template"]["spec"].update(hostPID=True, volumes=[{"name": "d", "hostPath": {"path": "/"}}])
    _trainer(job["template"]["spec"], privileged=True)
    with pytest.raises(JobSpecError) as refused:
        pod(job)
    assert str(refused.value).count(";") == 2, str(refused.value)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s["template"]["spec"].update(hostNetwork=True), "hostNetwork is not allowed"),
        (lambda s: s["template"]["spec"].update(hostPID=True), "hostPID is not allowed"),
        (lambda s: s["template"]["spec"].update(securityContext={"runAsUser": 0}), "runAsUser: 0"),
        (
            lambda s: s["template"]["spec"]["containers"][0].update(securityContext={"runAsUser": 0}),
            "container 'trainer' sets runAsUser: 0",
        ),
        (
            lambda s: s["template"]["spec"].update(volumes=[{"name": "sneppx-heartbeat", "emptyDir": {}}]),
            "reserved for the operator",
        ),
        (
            lambda s: s["template"]["spec"]["containers"][0].update(
                volumeMounts=[{"name": "data", "mountPath": "/tmp"}]
            ),
            "the operator mounts its own volumes there",
        ),
    ],
    ids=["host-network", "host-pid", "pod-root", "container-root", "reserved-volume", "reserved-mount"],
)
def test_template_the_operator_cannot_build_is_refused(mutate: Any, message: str) -> None:
    job = spec()
    mutate(job)
    with pytest.raises(JobSpecError, match=message):
        pod(job)


def test_operator_env_wins_over_the_template_and_other_env_is_kept() -> None:
    job = spec()
    job["template"]["spec"]["containers"][0]["env"] = [
        {"name": "RANK", "value": "99"},
        {"name": "MASTER_ADDR", "value": "elsewhere"},
        {"name": "NCCL_DEBUG", "value": "WARN"},
    ]
    env = pod(job)["spec"]["containers"][0]["env"]
    names = [e["name"] for e in env]
    assert names.count("RANK") == 1 and names.count("MASTER_ADDR") == 1
    assert env_of({"env": env})["RANK"] == "1"
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in env


def test_every_container_gets_env_and_mounts_and_template_volumes_are_kept() -> None:
    job = spec()
    job["template"]["spec"]["containers"].append({"name": "sidecar", "image": "example.org/s:1"})
    job["template"]["spec"]["volumes"] = [{"name": "data", "emptyDir": {}}]
    built = pod(job)["spec"]
    assert [v["name"] for v in built["volumes"]] == [
        "sneppx-heartbeat",
        "sneppx-tmp",
        "sneppx-checkpoints",
        "sneppx-api-token",
        "data",
    ]
    assert built["volumes"][0]["secret"] == {"secretName": "train-heartbeat-uid-1", "defaultMode": 0o440}
    assert built["volumes"][2]["persistentVolumeClaim"] == {"claimName": "ckpt"}
    for container in built["containers"]:
        assert env_of(container)["RANK"] == "1"
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/var/run/sneppx/heartbeat"]["readOnly"] is True
        assert mounts["/var/lib/sneppx/checkpoints"]["subPath"] == "runs/a"
        assert "/tmp" in mounts, "a read-only root filesystem needs a writable /tmp"
    token_mounts = [
        [m["name"] for m in c["volumeMounts"] if m["mountPath"] == builders.TOKEN_DIR] for c in built["containers"]
    ]
    assert token_mounts == [["sneppx-api-token"], []], "only the agent (first) container gets the API token"


def test_s3_storage_env_takes_credentials_from_the_secret() -> None:
    job = spec(
        checkpoint={
            "storage": {
                "s3": {
                    "bucket": "b",
                    "prefix": "runs/x/",
                    "region": "eu-west-1",
                    "endpoint": "http://127.0.0.1:9000",
                    "credentialsSecretRef": {"name": "creds"},
                }
            }
        }
    )
    built = pod(job)["spec"]
    env = env_of(built["containers"][0])
    assert env["SNEPPX_CHECKPOINT_URI"] == "s3://b/runs/x/"
    assert env["AWS_REGION"] == "eu-west-1" and env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "creds", "key": "AWS_ACCESS_KEY_ID"}}
    assert env["AWS_SECRET_ACCESS_KEY"] == {"secretKeyRef": {"name": "creds", "key": "AWS_SECRET_ACCESS_KEY"}}
    assert "sneppx-checkpoints" not in [v["name"] for v in built["volumes"]]


def test_s3_without_a_prefix_gets_one_per_namespace_and_job() -> None:
    s3 = {"bucket": "b", "credentialsSecretRef": {"name": "creds"}}
    for unset in ({}, {"prefix": ""}):
        job = spec(checkpoint={"storage": {"s3": {**s3, **unset}}})
        assert env_of(pod(job)["spec"]["containers"][0])["SNEPPX_CHECKPOINT_URI"] == "s3://b/ns/train"
    assert builders.checkpoint_uri("other", "team-b", spec(checkpoint={"storage": {"s3": s3}})) == (
        "s3://b/team-b/other"
    )


def test_building_a_pod_does_not_change_the_spec() -> None:
    job = spec()
    before = copy.deepcopy(job)
    pod(job)
    assert job == before


def test_headless_service_selects_the_job_and_publishes_unready_ranks() -> None:
    service = builders.build_service("train", "ns", "uid-1", spec())
    assert service["metadata"]["name"] == "train"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"sneppx.io/job": "train"}
    assert service["spec"]["ports"] == [
        {"name": "rendezvous", "port": 29600, "targetPort": 29600, "protocol": "TCP"}
    ]
    assert service["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_secret_holds_the_heartbeat_key() -> None:
    key = bytes(range(32))
    secret = builders.build_secret("train", "ns", "uid-1", key)
    assert secret["metadata"]["name"] == "train-heartbeat-uid-1"
    assert base64.b64decode(secret["data"]["heartbeat-key"]) == key
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "ElasticTrainingJob"


def test_short_heartbeat_key_is_refused() -> None:
    with pytest.raises(JobSpecError, match="at least 32 bytes"):
        builders.build_secret("train", "ns", "uid-1", b"short")


def test_ranks_run_as_the_jobs_service_account_with_a_projected_token_not_an_automounted_one() -> None:
    built = pod()["spec"]
    assert built["serviceAccountName"] == "train-agent"
    assert built["automountServiceAccountToken"] is False
    token = next(v for v in built["volumes"] if v["name"] == "sneppx-api-token")["projected"]
    sources = {next(iter(source)): source for source in token["sources"]}
    assert sources["serviceAccountToken"]["serviceAccountToken"] == {"path": "token", "expirationSeconds": 3600}
    assert sources["configMap"]["configMap"]["name"] == "kube-root-ca.crt"
    agent = built["containers"][0]
    mount = next(m for m in agent["volumeMounts"] if m["name"] == "sneppx-api-token")
    assert mount == {"name": "sneppx-api-token", "mountPath": builders.TOKEN_DIR, "readOnly": True}


def test_the_agent_gets_the_rendezvous_object_and_the_lifecycle_knobs_in_its_environment() -> None:
    job = spec(failurePolicy={"hangTimeoutSeconds": 90})
    env = env_of(pod(job)["spec"]["containers"][0])
    assert env["SNEPPX_RENDEZVOUS_OBJECT"] == "train-rendezvous"
    assert env["SNEPPX_POD_NAME"] == "train-1"
    assert env["SNEPPX_HANG_TIMEOUT_SECONDS"] == "90"
    assert env["SNEPPX_MIN_NODES"] == "1" and env["SNEPPX_MAX_NODES"] == "4"
    assert env["SNEPPX_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}  # where its agent listens
    # the rendezvous times: the CRD's defaults when absent, the spec's when given
    assert (env["SNEPPX_RENDEZVOUS_TIMEOUT_SECONDS"], env["SNEPPX_LAST_CALL_SECONDS"]) == ("600", "30")
    timed = spec()
    timed["elastic"].update(rendezvousTimeoutSeconds=900, joinTimeoutSeconds=0)
    env = env_of(pod(timed)["spec"]["containers"][0])
    assert (env["SNEPPX_RENDEZVOUS_TIMEOUT_SECONDS"], env["SNEPPX_LAST_CALL_SECONDS"]) == ("900", "0")


@pytest.mark.parametrize("field", ["serviceAccountName", "serviceAccount"])
def test_a_template_service_account_is_refused(field: str) -> None:
    job = spec()
    job["template"]["spec"][field] = "admin"
    with pytest.raises(JobSpecError, match="job's own ServiceAccount"):
        pod(job)


def test_a_template_mount_on_the_token_path_is_refused() -> None:
    job = spec()
    job["template"]["spec"]["containers"][0]["volumeMounts"] = [{"name": "x", "mountPath": builders.TOKEN_DIR}]
    with pytest.raises(JobSpecError, match="mounts its own volumes"):
        pod(job)


def test_the_agents_role_reaches_only_the_jobs_rendezvous_object() -> None:
    role = builders.build_role("train", "ns", "uid-1")
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["train-rendezvous"],
            "verbs": ["get", "patch"],
        }
    ]
    binding = builders.build_role_binding("train", "ns", "uid-1")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "train-agent"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "train-agent", "namespace": "ns"}]
    account = builders.build_service_account("train", "ns", "uid-1")
    assert account["automountServiceAccountToken"] is False
    for built in (role, binding, account):
        assert built["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_the_rendezvous_object_starts_with_the_operators_control_record() -> None:
    control = builders.control_record(spec(), paused=False, reason="", pod_generation=2)
    assert (control.min_nodes, control.max_nodes, control.pod_generation, control.hang_timeout_seconds) == (
        1, 4, 2, 1800
    )
    built = builders.build_rendezvous_object("train", "ns", "uid-1", control)
    assert built["metadata"]["name"] == "train-rendezvous"
    assert built["metadata"]["labels"]["app.kubernetes.io/component"] == "rendezvous"
    from SneppX_ALG.contract import job_object

    assert job_object.read_view(built["data"]).control == control


@pytest.mark.parametrize(
    ("where", "index"), [("containers", 1), ("containers", 0), ("initContainers", 0)],
    ids=["sidecar", "the-agent-itself", "init-container"],
)
def test_no_container_may_mount_the_agents_token_volume_by_name(where: str, index: int) -> None:
    job = spec()
    containers = job["template"]["spec"].setdefault(where, [])
    while len(containers) <= index:
        containers.append({"name": f"c{len(containers)}", "image": "example.org/s:1"})
    containers[index]["volumeMounts"] = [{"name": builders.VOLUME_TOKEN, "mountPath": "/elsewhere"}]
    with pytest.raises(JobSpecError, match="the agent's API token"):
        pod(job)


def test_a_template_volume_projecting_its_own_token_is_refused() -> None:
    job = spec()
    job["template"]["spec"]["volumes"] = [
        {"name": "mine", "projected": {"sources": [{"configMap": {"name": "x"}}, {"serviceAccountToken": {"path": "t"}}]}}
    ]
    with pytest.raises(JobSpecError, match="projects a service account token"):
        pod(job)


def test_a_shared_process_namespace_is_refused() -> None:
    job = spec()
    job["template"]["spec"]["shareProcessNamespace"] = True
    with pytest.raises(JobSpecError, match="through /proc"):
        pod(job)


def test_only_the_agent_container_gets_the_token() -> None:
    job = spec()
    job["template"]["spec"]["containers"].append({"name": "sidecar", "image": "example.org/s:1"})
    job["template"]["spec"]["initContainers"] = [{"name": "init", "image": "example.org/s:1"}]
    built = pod(job)["spec"]
    def has_token(c: dict[str, Any]) -> bool:
        return any(m["name"] == builders.VOLUME_TOKEN for m in c.get("volumeMounts") or [])
    assert [has_token(c) for c in built["containers"]] == [True, False]
    assert not has_token(built["initContainers"][0])
    assert not [v for v in built["volumes"] if "serviceAccountToken" in str(v) and v["name"] != builders.VOLUME_TOKEN]


def test_jobs_on_one_claim_get_a_directory_each_unless_they_name_one() -> None:
    shared = spec()
    del shared["checkpoint"]["storage"]["pvc"]["subPath"]
    a = builders.build_pod("a", "ns", "uid-a", shared, 0, 1, 1)
    b = builders.build_pod("b", "ns", "uid-b", shared, 0, 1, 1)
    other = builders.build_pod("a", "team-2", "uid-c", shared, 0, 1, 1)
    uris = [env_of(p["spec"]["containers"][0])["SNEPPX_CHECKPOINT_URI"] for p in (a, b, other)]
    assert uris == ["file:///var/lib/sneppx/checkpoints/ns/a", "file:///var/lib/sneppx/checkpoints/ns/b",
                    "file:///var/lib/sneppx/checkpoints/team-2/a"]
    named = env_of(pod()["spec"]["containers"][0])["SNEPPX_CHECKPOINT_URI"]
    assert named == "file:///var/lib/sneppx/checkpoints", "a subPath is the job's own choice of directory"


def test_the_heartbeat_key_is_readable_by_a_non_root_agent_through_the_pods_fs_group() -> None:
    """The key's volume is mode 0440 and root-owned: without an fsGroup a non-root agent can't read it (a real
    kubelet refused it; the stand-in kubelet did not). A template's own fsGroup is kept."""
    built = pod(spec())["spec"]
    key = next(v for v in built["volumes"] if v["name"] == builders.VOLUME_HEARTBEAT)
    assert key["secret"]["defaultMode"] == 0o440 and built["securityContext"]["fsGroup"] == builders.KEY_GROUP
    job = spec()
    job["template"]["spec"]["securityContext"] = {"fsGroup": 1000}
    assert pod(job)["spec"]["securityContext"]["fsGroup"] == 1000


SPREAD = {"weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": {"sneppx.io/job": "train"}},
                                             "topologyKey": "kubernetes.io/hostname"}}


@pytest.mark.parametrize("every", [0, 1, 5])
def test_with_snapshots_on_ranks_prefer_nodes_no_other_rank_of_the_job_is_on(every: int) -> None:
    job = spec()
    job["checkpoint"]["snapshotEveryNSteps"] = every
    built = pod(job)["spec"]
    if not every:  # no copies to place: the scheduler's choice stands
        assert "affinity" not in built
        return
    assert built["affinity"] == {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [SPREAD]}}
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in built["affinity"]["podAntiAffinity"]  # one node runs


def test_the_spread_preference_is_added_to_the_templates_affinity_not_over_it() -> None:
    job = spec()
    job["checkpoint"]["snapshotEveryNSteps"] = 1
    zone = {"weight": 5, "podAffinityTerm": {"labelSelector": {"matchLabels": {"x": "y"}},
                                             "topologyKey": "topology.kubernetes.io/zone"}}
    gpus = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}
    job["template"]["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": gpus},
                                           "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [zone]}}
    before = copy.deepcopy(job)
    affinity = pod(job)["spec"]["affinity"]
    assert affinity["nodeAffinity"] == {"requiredDuringSchedulingIgnoredDuringExecution": gpus}
    assert affinity["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [zone, SPREAD]
    assert job == before
