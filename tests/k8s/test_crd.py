"""The ElasticTrainingJob CRD as the real API server enforces it: schema bounds, enums, CEL messages,
immutable fields, defaults, and that every manifest in examples/ is accepted."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import k8s_cluster
import k8s_helpers
import kubernetes
import pytest
import yaml

pytestmark = pytest.mark.k8s

EXAMPLES = sorted((k8s_cluster.REPO / "examples").glob("*.yaml"))


def _set(path: str, value: object) -> Callable[[dict], None]:
    """A mutation that sets a dotted path (list indexes as numbers) in the job."""

    def mutate(job: dict) -> None:
        keys = [int(k) if k.isdigit() else k for k in path.split(".")]
        node = job
        for key in keys[:-1]:
            node = node[key] if isinstance(key, int) else node.setdefault(key, {})
        node[keys[-1]] = value

    return mutate


def _delete(path: str) -> Callable[[dict], None]:
    def mutate(job: dict) -> None:
        keys = path.split(".")
        node = job
        for key in keys[:-1]:
            node = node[key]
        del node[keys[-1]]

    return mutate


S3 = {"bucket": "bucket", "credentialsSecretRef": {"name": "creds"}}
CONTAINER = {"name": "c", "image": "example.org/x:1"}

# (test id, mutation, text the API server's error must contain)
INVALID = [
    (
        "min-greater-than-max",
        _set("spec.elastic", {"minNodes": 3, "maxNodes": 2}),
        "elastic.minNodes must be less than or equal to elastic.maxNodes",
    ),
    ("min-nodes-zero", _set("spec.elastic.minNodes", 0), "should be greater than or equal to 1"),
    ("max-nodes-over-limit", _set("spec.elastic.maxNodes", 5000), "should be less than or equal to 1024"),
    ("quorum-0", _set("spec.quorum", {"minHealthyPercent": 0}), "should be greater than or equal to 1"),
    ("quorum-101", _set("spec.quorum", {"minHealthyPercent": 101}), "should be less than or equal to 100"),
    (
        "sidecar-mounts-the-agents-token",
        _set("spec.template.spec.containers", [
            {"name": "trainer", "image": "example.org/t:1"},
            {"name": "sidecar", "image": "example.org/s:1",
             "volumeMounts": [{"name": "sneppx-api-token", "mountPath": "/elsewhere"}]},
        ]),
        "sneppx-api-token is the agent's API token",
    ),
    (
        "init-container-mounts-the-agents-token",
        _set("spec.template.spec.initContainers", [
            {"name": "init", "image": "example.org/s:1",
             "volumeMounts": [{"name": "sneppx-api-token", "mountPath": "/t"}]},
        ]),
        "sneppx-api-token is the agent's API token",
    ),
    (
        "template-projects-its-own-token",
        _set("spec.template.spec.volumes", [
            {"name": "mine", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}},
        ]),
        "a projected serviceAccountToken is not allowed",
    ),
    (
        "shared-process-namespace",
        _set("spec.template.spec.shareProcessNamespace", True),
        "shareProcessNamespace: true is not allowed",
    ),
    ("quorum-bad-action", _set("spec.quorum", {"actionOnLoss": "Explode"}), 'Unsupported value: "Explode"'),
    (
        "two-storages",
        _set("spec.checkpoint.storage.s3", S3),
        "checkpoint.storage needs exactly one of pvc or s3",
    ),
    ("no-storage", _set("spec.checkpoint.storage", {}), "checkpoint.storage needs exactly one of pvc or s3"),
    (
        "s3-without-secret",
        _set("spec.checkpoint.storage", {"s3": {"bucket": "bucket"}}),
        "spec.checkpoint.storage.s3.credentialsSecretRef: Required value",
    ),
    (
        "s3-bad-endpoint",
        _set("spec.checkpoint.storage", {"s3": {**S3, "endpoint": "ftp://example.org"}}),
        "checkpoint.storage.s3.endpoint must be an http:// or https:// URL",
    ),
    (
        "pvc-subpath-escapes",
        _set("spec.checkpoint.storage.pvc.subPath", "runs/../../etc"),
        "subPath must be relative and must not contain '..'",
    ),
    (
        "pvc-subpath-absolute",
        _set("spec.checkpoint.storage.pvc.subPath", "/etc"),
        "subPath must be relative and must not contain '..'",
    ),
    (
        "rollback-deeper-than-kept",
        _set("spec.checkpoint", {"storage": {"pvc": {"claimName": "c"}}, "maxToKeep": 2, "rollbackDepth": 2}),
        "checkpoint.rollbackDepth must be less than checkpoint.maxToKeep",
    ),
    ("bad-validation-enum", _set("spec.checkpoint.validation", "Paranoid"), 'Unsupported value: "Paranoid"'),
    (
        "restart-delay-inverted",
        _set("spec.failurePolicy", {"restartDelay": {"initialSeconds": 600, "maxSeconds": 60}}),
        "failurePolicy.restartDelay.initialSeconds must be less than or equal to maxSeconds",
    ),
    (
        "exit-code-zero-in",
        _set(
            "spec.failurePolicy",
            {"rules": [{"action": "Restart", "onExitCodes": {"operator": "In", "values": [0, 1]}}]},
        ),
        "exit code 0 means success",
    ),
    (
        "bad-rule-action",
        _set(
            "spec.failurePolicy",
            {"rules": [{"action": "Retry", "onExitCodes": {"operator": "In", "values": [1]}}]},
        ),
        'Unsupported value: "Retry"',
    ),
    (
        "exit-code-over-255",
        _set(
            "spec.failurePolicy",
            {"rules": [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [256]}}]},
        ),
        "should be less than or equal to 255",
    ),
    (
        "unbounded-image",
        _set("spec.template.spec.containers.0.image", "x" * 2000),
        "spec.template.spec.containers[0].image: Too long",
    ),
    (
        "unbounded-arg",
        _set("spec.template.spec.containers.0.args", ["y" * 5000]),
        "spec.template.spec.containers[0].args[0]: Too long",
    ),
    (
        "too-many-containers",
        _set("spec.template.spec.containers", [dict(CONTAINER, name=f"c{i}") for i in range(9)]),
        "spec.template.spec.containers: Too many",
    ),
    (
        "too-many-rules",
        _set(
            "spec.failurePolicy",
            {"rules": [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [1]}}] * 17},
        ),
        "spec.failurePolicy.rules: Too many",
    ),
    ("no-containers", _set("spec.template.spec.containers", []), "should have at least 1 items"),
    (
        "reserved-env",
        _set("spec.template.spec.containers.0.env", [{"name": "SNEPPX_RANK", "value": "0"}]),
        "env names starting with SNEPPX_ are set by the operator",
    ),
    ("missing-elastic", _delete("spec.elastic"), "spec.elastic: Required value"),
    # The restricted Pod Security profile, refused at apply time with the field's path.
    *[
        (f"restricted-{case}", _set(f"spec.template.spec.{path}", value), expected)
        for case, path, value, expected in [
            ("host-network", "hostNetwork", True, "spec.template.spec.hostNetwork: Invalid value"),
            ("host-pid", "hostPID", True, "hostPID is not allowed"),
            ("host-ipc", "hostIPC", True, "hostIPC is not allowed"),
            (
                "token",
                "automountServiceAccountToken",
                True,
                "automountServiceAccountToken: true is not allowed",
            ),
            (
                "host-path",
                "volumes",
                [{"name": "root", "hostPath": {"path": "/"}}],
                "spec.template.spec.volumes[0]: Invalid value: hostPath volumes are not allowed",
            ),
            ("pod-non-root", "securityContext", {"runAsNonRoot": False}, "runAsNonRoot must not be false"),
            ("pod-root", "securityContext", {"runAsUser": 0}, "runAsUser must not be 0"),
            (
                "pod-seccomp",
                "securityContext",
                {"seccompProfile": {"type": "Unconfined"}},
                "securityContext.seccompProfile.type: Invalid value",
            ),
            (
                "selinux-type",
                "securityContext",
                {"seLinuxOptions": {"type": "spc_t"}},
                "seLinuxOptions.type must be container_t",
            ),
            (
                "selinux-role",
                "securityContext",
                {"seLinuxOptions": {"role": "sysadm_r"}},
                "seLinuxOptions.role is not allowed",
            ),
            (
                "apparmor",
                "securityContext",
                {"appArmorProfile": {"type": "Unconfined"}},
                "appArmorProfile.type must be RuntimeDefault or Localhost",
            ),
            (
                "sysctl",
                "securityContext",
                {"sysctls": [{"name": "kernel.msgmax", "value": "65536"}]},
                "sysctl kernel.msgmax is not allowed",
            ),
            (
                "host-process",
                "securityContext",
                {"windowsOptions": {"hostProcess": True}},
                "windowsOptions.hostProcess is not allowed",
            ),
            (
                "privileged",
                "containers.0.securityContext",
                {"privileged": True},
                "containers[0].securityContext.privileged: Invalid value: true: privileged containers are not allowed",
            ),
            (
                "escalation",
                "containers.0.securityContext",
                {"allowPrivilegeEscalation": True},
                "allowPrivilegeEscalation must be false",
            ),
            (
                "capability",
                "containers.0.securityContext",
                {"capabilities": {"add": ["NET_BIND_SERVICE", "SYS_ADMIN"]}},
                "capabilities.add may only hold NET_BIND_SERVICE",
            ),
            (
                "proc-mount",
                "containers.0.securityContext",
                {"procMount": "Unmasked"},
                "procMount must be Default",
            ),
            (
                "container-root",
                "containers.0.securityContext",
                {"runAsUser": 0},
                "containers[0].securityContext.runAsUser: Invalid value",
            ),
            (
                "host-port",
                "containers.0.ports",
                [{"containerPort": 80, "hostPort": 80}],
                "containers[0].ports[0].hostPort: Invalid value: 80: hostPort is not allowed",
            ),
            (
                "init-privileged",
                "initContainers",
                [{"name": "init", "image": "x", "securityContext": {"privileged": True}}],
                "initContainers[0].securityContext.privileged: Invalid value",
            ),
        ]
    ],
    (
        "apparmor-annotation",
        _set(
            "spec.template.metadata",
            {"annotations": {"container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"}},
        ),
        "AppArmor annotations must be runtime/default or localhost/<profile>",
    ),
    ("name-too-long", _set("metadata.name", "a" * 51), "metadata.name must be at most 50 characters"),
    ("name-not-dns-label", _set("metadata.name", "my.job"), "metadata.name must be a DNS label"),
    ("name-starts-with-digit", _set("metadata.name", "1job"), "metadata.name must be a DNS label"),
]


def _create(api: kubernetes.client.ApiClient, namespace: str, body: dict, dry_run: bool = False) -> dict:
    custom = kubernetes.client.CustomObjectsApi(api)
    kwargs = {"dry_run": "All"} if dry_run else {}
    return custom.create_namespaced_custom_object(
        k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL, body, **kwargs
    )


def _rejection(call: Callable[[], object]) -> str:
    with pytest.raises(kubernetes.client.ApiException) as info:
        call()
    assert info.value.status == 422, f"expected 422 Invalid, got {info.value.status}: {info.value.body}"
    return json.loads(info.value.body)["message"]


def test_valid_job_is_accepted_and_defaulted(api: kubernetes.client.ApiClient, namespace: str) -> None:
    created = _create(api, namespace, k8s_helpers.valid_job())
    spec = created["spec"]
    assert spec["quorum"] == {"actionOnLoss": "Pause"}, "minNodes alone decides quorum unless a percent is set"
    assert spec["failurePolicy"]["maxRestarts"] == 3
    assert spec["failurePolicy"]["restartDelay"] == {"initialSeconds": 10, "multiplier": 2, "maxSeconds": 300}
    assert spec["elastic"]["procsPerNode"] == 1 and spec["elastic"]["port"] == 29500
    assert spec["checkpoint"]["validation"] == "Full" and spec["checkpoint"]["maxToKeep"] == 3
    assert spec["suspend"] is False


@pytest.mark.parametrize(
    ("mutate", "expected"), [(m, e) for _, m, e in INVALID], ids=[i for i, _, _ in INVALID]
)
def test_invalid_job_is_rejected_with_a_clear_message(
    api: kubernetes.client.ApiClient, namespace: str, mutate: Callable[[dict], None], expected: str
) -> None:
    job = k8s_helpers.valid_job()
    mutate(job)
    message = _rejection(lambda: _create(api, namespace, job, dry_run=True))
    assert expected in message, f"expected {expected!r} in the API server's message:\n{message}"


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        (
            {"spec": {"checkpoint": {"storage": {"pvc": {"claimName": "other"}}}}},
            "checkpoint.storage is immutable",
        ),
        ({"spec": {"elastic": {"procsPerNode": 8}}}, "elastic.procsPerNode is immutable"),
        ({"spec": {"elastic": {"port": 30000}}}, "elastic.port is immutable"),
    ],
    ids=["storage", "procs-per-node", "port"],
)
def test_immutable_fields_cannot_change_mid_run(
    api: kubernetes.client.ApiClient, namespace: str, patch: dict, expected: str
) -> None:
    _create(api, namespace, k8s_helpers.valid_job())
    custom = kubernetes.client.CustomObjectsApi(api)
    message = _rejection(
        lambda: custom.patch_namespaced_custom_object(
            k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL, "job", patch
        )
    )
    assert expected in message, message


def test_mutable_fields_can_change(api: kubernetes.client.ApiClient, namespace: str) -> None:
    _create(api, namespace, k8s_helpers.valid_job())
    custom = kubernetes.client.CustomObjectsApi(api)
    patched = custom.patch_namespaced_custom_object(
        k8s_helpers.GROUP,
        k8s_helpers.VERSION,
        namespace,
        k8s_helpers.PLURAL,
        "job",
        {"spec": {"suspend": True, "elastic": {"maxNodes": 4}, "checkpoint": {"maxToKeep": 5}}},
    )
    assert patched["spec"]["suspend"] is True
    assert patched["spec"]["elastic"]["maxNodes"] == 4
    assert patched["spec"]["checkpoint"]["maxToKeep"] == 5


def test_what_the_restricted_profile_allows_is_accepted(
    api: kubernetes.client.ApiClient, namespace: str
) -> None:
    job = k8s_helpers.valid_job()
    job["spec"]["template"]["metadata"] = {
        "annotations": {"container.apparmor.security.beta.kubernetes.io/trainer": "localhost/train"}
    }
    job["spec"]["template"]["spec"].update(
        automountServiceAccountToken=False,
        hostNetwork=False,
        securityContext={
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/train.json"},
            "seLinuxOptions": {"type": "container_t", "level": "s0:c1,c2"},
            "sysctls": [{"name": "net.ipv4.tcp_keepalive_time", "value": "60"}],
        },
        volumes=[{"name": "data", "emptyDir": {}}],
    )
    job["spec"]["template"]["spec"]["containers"][0].update(
        ports=[{"containerPort": 8080}],
        securityContext={
            "allowPrivilegeEscalation": False,
            "capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["ALL"]},
            "procMount": "Default",
        },
    )
    stored = _create(api, namespace, job)
    assert stored["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 1000, (
        "unlisted fields are kept"
    )


def test_unknown_fields_are_refused_by_strict_apply(cluster: k8s_cluster.Cluster, namespace: str) -> None:
    job = k8s_helpers.valid_job()
    job["spec"]["elastic"]["minNodez"] = 1
    result = cluster.kubectl(
        "apply", "--server-side", "-n", namespace, "-f", "-", input_text=yaml.safe_dump(job), check=False
    )
    assert result.returncode != 0
    assert ".spec.elastic.minNodez: field not declared in schema" in result.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_accepted(cluster: k8s_cluster.Cluster, namespace: str, example: pathlib.Path) -> None:
    result = cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", str(example))
    jobs = [
        doc for doc in yaml.safe_load_all(example.read_text()) if doc and doc["kind"] == "ElasticTrainingJob"
    ]
    assert jobs, f"{example.name} holds no ElasticTrainingJob"
    for job in jobs:
        name = job["metadata"]["name"]
        assert f"elastictrainingjob.sneppx.io/{name} serverside-applied" in result.stdout
        stored = json.loads(cluster.kubectl("get", "etj", name, "-n", namespace, "-o", "json").stdout)
        assert stored["spec"]["elastic"] == {**_elastic_defaults(), **job["spec"]["elastic"]}


def test_examples_directory_is_not_empty() -> None:
    assert len(EXAMPLES) >= 3


def _elastic_defaults() -> dict:
    return {"procsPerNode": 1, "port": 29500, "rendezvousTimeoutSeconds": 600, "joinTimeoutSeconds": 30}


def test_crd_is_established_with_short_name_and_printer_columns(cluster: k8s_cluster.Cluster) -> None:
    crd = json.loads(cluster.kubectl("get", "crd", "elastictrainingjobs.sneppx.io", "-o", "json").stdout)
    assert crd["spec"]["names"]["shortNames"] == ["etj"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Phase", "Ready", "Restarts", "Last-Valid-Step", "Age"]
    established = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert established["Established"] == "True" and established["NamesAccepted"] == "True"
