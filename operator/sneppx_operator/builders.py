"""Pure manifest builders: an ElasticTrainingJob in, plain Kubernetes manifests (dicts) out.

Kept free of I/O so every manifest can be checked by unit tests without a cluster, and so what the
operator creates is decided in one place. Nothing here talks to the API (that is k8s.py).

The environment each rank's containers get (the contract with the in-pod runtime):

    SNEPPX_JOB, SNEPPX_NAMESPACE        the job
    RANK, WORLD_SIZE                    this node's rank and the number of nodes (pods) in the generation;
                                        the in-pod agent derives per-process ranks from SNEPPX_PROCS_PER_NODE
                                        like torchrun does (NODE_RANK is RANK)
    NODE_RANK, SNEPPX_PROCS_PER_NODE
    SNEPPX_GENERATION                   membership generation; ranks of older generations must stop
    MASTER_ADDR, MASTER_PORT            rank 0's stable DNS name through the headless Service
    SNEPPX_HEARTBEAT_KEY_FILE           the per-job HMAC key for heartbeats (a mounted Secret)
    SNEPPX_CHECKPOINT_URI               file:///var/lib/sneppx/checkpoints/<namespace>/<job> (on the PVC), or
                                        the mount itself when the job gives a subPath; s3://bucket/<prefix>,
                                        s3://bucket/<namespace>/<job> without one
    SNEPPX_SAVE_EVERY_N_STEPS, SNEPPX_MAX_TO_KEEP, SNEPPX_CHECKPOINT_VALIDATION, SNEPPX_ROLLBACK_DEPTH
    SNEPPX_RENDEZVOUS_OBJECT            the job's rendezvous ConfigMap (contract/job_object.py); its records
                                        carry what may change under running pods (pause, node bounds)
    SNEPPX_POD_NAME                     the agent's id in the rendezvous
    SNEPPX_HOST                         the pod's IP (downward API): where its agent and workers listen
    SNEPPX_MIN_NODES, SNEPPX_MAX_NODES  the node bounds when the pod was made
    SNEPPX_HANG_TIMEOUT_SECONDS         after this long without a step, agents report a peer hung (0: never)
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL   (S3 storage only)

Each job also gets its own ServiceAccount, Role and RoleBinding: the role allows get and patch on the job's
rendezvous ConfigMap (by resourceNames), the two verbs the agents' record store calls, and nothing else. Rank
pods run as that account, and only the first container (the agent) gets its token, through a projected volume
at the standard path (so the Kubernetes client's in-cluster configuration finds it); a template that would give
a token to any other container (by mounting the operator's token volume or projecting a token of its own) is
refused.

One concept, hence just over 500 lines: the Kubernetes objects of a job, built from its spec (pure).
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping
from typing import Any

from SneppX_ALG.contract import job_object
from SneppX_ALG.contract.env import (
    ENV_CHECKPOINT_URI,
    ENV_GENERATION,
    ENV_HANG_TIMEOUT,
    ENV_HEARTBEAT_KEY_FILE,
    ENV_HOST,
    ENV_JOB,
    ENV_LAST_CALL,
    ENV_MAX_NODES,
    ENV_MAX_TO_KEEP,
    ENV_MIN_NODES,
    ENV_NAMESPACE,
    ENV_NODE_NAME,
    ENV_OBJECT,
    ENV_POD_NAME,
    ENV_PROCS_PER_NODE,
    ENV_RENDEZVOUS_TIMEOUT,
    ENV_ROLLBACK_DEPTH,
    ENV_SAVE_EVERY,
    ENV_SNAPSHOT_EVERY,
    ENV_SNAPSHOT_REPLICAS,
    ENV_VALIDATION,
)
from sneppx_operator import defaults, restricted
from sneppx_operator.errors import JobSpecError

GROUP = "sneppx.io"
VERSION = "v1alpha1"
PLURAL = "elastictrainingjobs"
KIND = "ElasticTrainingJob"
API_VERSION = f"{GROUP}/{VERSION}"

LABEL_JOB = "sneppx.io/job"
LABEL_RANK = "sneppx.io/rank"
LABEL_GENERATION = "sneppx.io/membership-generation"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
COMPONENT_RENDEZVOUS = "rendezvous"
MANAGED_BY = "sneppx-operator"

HEARTBEAT_KEY = "heartbeat-key"
HEARTBEAT_DIR = "/var/run/sneppx/heartbeat"
CHECKPOINT_DIR = "/var/lib/sneppx/checkpoints"
KEY_GROUP = 65532  # the pods' fsGroup unless the template sets one (the image's group): may read the heartbeat key
TMP_DIR = "/tmp"
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"  # where in-cluster clients look for it
TOKEN_EXPIRATION_SECONDS = 3600  # the kubelet renews a projected token at 80% of its life
# The operator's own volumes; a template that uses these names is refused rather than silently changed.
VOLUME_HEARTBEAT = "sneppx-heartbeat"
VOLUME_CHECKPOINTS = "sneppx-checkpoints"
VOLUME_TMP = "sneppx-tmp"
VOLUME_TOKEN = "sneppx-api-token"
RESERVED_VOLUMES = frozenset({VOLUME_HEARTBEAT, VOLUME_CHECKPOINTS, VOLUME_TMP, VOLUME_TOKEN})
# The agent's only permissions: its job's rendezvous object, read and compare-and-swap (a merge patch carrying
# the resourceVersion it read: records/kube.py).
AGENT_VERBS = ("get", "patch")
# Env the operator owns; template values for these names are replaced (SNEPPX_* is refused by the CRD).
OPERATOR_ENV_NAMES = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_REGION",
        "AWS_ENDPOINT_URL",
    }
)


def service_name(job_name: str) -> str:
    return job_name


def secret_name(job_name: str, job_uid: str) -> str:
    """The heartbeat Secret's name carries the job's uid, so no one else's Secret can be taken for it: the
    operator may not read Secrets (least privilege), so it can't check a Secret's owner the way it checks
    a Service's or a Pod's."""
    return f"{job_name}-heartbeat-{job_uid[:8]}"


def agent_name(job_name: str) -> str:
    """The job's ServiceAccount, Role and RoleBinding (one name for the three)."""
    return f"{job_name}-agent"


def pod_name(job_name: str, rank: int) -> str:
    return f"{job_name}-{rank}"


def master_addr(job_name: str, namespace: str) -> str:
    """Rank 0's DNS name: <hostname>.<headless service>.<namespace>.svc, stable across pod restarts."""
    return f"{pod_name(job_name, 0)}.{service_name(job_name)}.{namespace}.svc"


def job_labels(job_name: str) -> dict[str, str]:
    return {LABEL_JOB: job_name, LABEL_MANAGED_BY: MANAGED_BY}


def owner_reference(job_name: str, job_uid: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job_name,
        "uid": job_uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(
    name: str, namespace: str, job_name: str, job_uid: str, labels: Mapping[str, str] | None = None
) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": {**(labels or {}), **job_labels(job_name)},
        "ownerReferences": [owner_reference(job_name, job_uid)],
    }


def build_service(job_name: str, namespace: str, job_uid: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The headless Service that gives each rank a stable DNS name (pods set hostname + subdomain).

    publishNotReadyAddresses: ranks must find rank 0 during rendezvous, before any of them is Ready.
    """
    port = int(defaults.field(spec["elastic"], "elastic.port"))
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(service_name(job_name), namespace, job_name, job_uid),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: job_name},
            "ports": [{"name": "rendezvous", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


def build_secret(job_name: str, namespace: str, job_uid: str, heartbeat_key: bytes) -> dict[str, Any]:
    """The job's heartbeat HMAC key. The caller supplies the random bytes so this stays pure."""
    if len(heartbeat_key) < 32:
        raise JobSpecError(f"heartbeat key must be at least 32 bytes, got {len(heartbeat_key)}")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(secret_name(job_name, job_uid), namespace, job_name, job_uid),
        "data": {HEARTBEAT_KEY: base64.b64encode(heartbeat_key).decode("ascii")},
    }


def control_record(spec: Mapping[str, Any], *, paused: bool, reason: str, pod_generation: int) -> job_object.Control:
    """What the operator tells the agents through the rendezvous object (job_object.CONTROL_KEY)."""
    elastic, policy = spec["elastic"], spec.get("failurePolicy") or {}
    return job_object.Control(
        paused=paused,
        reason=reason,
        min_nodes=int(elastic["minNodes"]),
        max_nodes=int(elastic["maxNodes"]),
        pod_generation=pod_generation,
        hang_timeout_seconds=int(defaults.field(policy, "failurePolicy.hangTimeoutSeconds")),
    )


def build_rendezvous_object(
    job_name: str, namespace: str, job_uid: str, control: job_object.Control
) -> dict[str, Any]:
    """The job's rendezvous ConfigMap (contract/job_object.py), created with the operator's control record; the
    agents add the rest by compare-and-swap."""
    labels = {LABEL_COMPONENT: COMPONENT_RENDEZVOUS}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job_object.object_name(job_name), namespace, job_name, job_uid, labels),
        "data": {
            job_object.data_key(job_object.CONTROL_KEY): job_object.encode_value(
                job_object.CONTROL_KEY, job_object.control_to_json(control)
            )
        },
    }


def build_service_account(job_name: str, namespace: str, job_uid: str) -> dict[str, Any]:
    """The account the job's agents run as. No token is mounted for it unless a pod asks for one by volume
    (the rank pods' agent container does; nothing else should)."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(agent_name(job_name), namespace, job_name, job_uid),
        "automountServiceAccountToken": False,
    }


def build_role(job_name: str, namespace: str, job_uid: str) -> dict[str, Any]:
    """get and patch on the job's rendezvous ConfigMap, by name, and nothing else (no list, no create: RBAC
    can't limit those by name)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(agent_name(job_name), namespace, job_name, job_uid),
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [job_object.object_name(job_name)],
                "verbs": list(AGENT_VERBS),
            }
        ],
    }


def build_role_binding(job_name: str, namespace: str, job_uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(agent_name(job_name), namespace, job_name, job_uid),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": agent_name(job_name)},
        "subjects": [{"kind": "ServiceAccount", "name": agent_name(job_name), "namespace": namespace}],
    }


def spec_problem(spec: Mapping[str, Any]) -> str | None:
    """What is wrong with a spec that the CRD's CEL rules (x-kubernetes-validations) would have refused, or None.

    The API server checks these before the operator sees a spec, but only where it evaluates CEL (Kubernetes 1.25
    and later, by default), and an object stored before a rule existed is never checked again: the operator
    checks what its own plans rely on, and fails such a job with reason InvalidSpec instead of crashing on it."""
    elastic, checkpoint = spec.get("elastic") or {}, spec.get("checkpoint") or {}
    storage = checkpoint.get("storage") or {}
    if ("pvc" in storage) == ("s3" in storage):
        return "checkpoint.storage needs exactly one of pvc or s3"
    sub_path = (storage.get("pvc") or {}).get("subPath") or ""
    if sub_path.startswith("/") or ".." in sub_path.split("/"):
        return "checkpoint.storage.pvc.subPath must be relative and must not contain '..'"
    if defaults.field(checkpoint, "checkpoint.rollbackDepth") >= defaults.field(checkpoint, "checkpoint.maxToKeep"):
        return "checkpoint.rollbackDepth must be less than checkpoint.maxToKeep"
    if elastic.get("minNodes", 1) > elastic.get("maxNodes", 1):
        return "elastic.minNodes must not exceed elastic.maxNodes"
    delay = (spec.get("failurePolicy") or {}).get("restartDelay") or {}
    initial = defaults.field(delay, "failurePolicy.restartDelay.initialSeconds")
    if initial > defaults.field(delay, "failurePolicy.restartDelay.maxSeconds"):
        return "failurePolicy.restartDelay.initialSeconds must not exceed maxSeconds"
    for rule in (spec.get("failurePolicy") or {}).get("rules") or []:
        codes = rule.get("onExitCodes") or {}
        if codes.get("operator") != "NotIn" and 0 in (codes.get("values") or []):
            return "failurePolicy.rules: onExitCodes with operator In must not list 0 (a success)"
    return None


def checkpoint_uri(job_name: str, namespace: str, spec: Mapping[str, Any]) -> str:
    """Where the ranks keep checkpoints. Unless the job names its own place (an S3 prefix, a PVC subPath)
    each job gets its own, <namespace>/<job>, in the bucket or on the claim: jobs sharing a bucket or a claim
    must never see (or retire) each other's steps."""
    storage = spec["checkpoint"]["storage"]
    if "s3" in storage:
        s3 = storage["s3"]
        prefix = s3.get("prefix") or f"{namespace}/{job_name}"
        return f"s3://{s3['bucket']}/{prefix}"
    if storage["pvc"].get("subPath"):
        return f"file://{CHECKPOINT_DIR}"
    return f"file://{CHECKPOINT_DIR}/{namespace}/{job_name}"


def _env(name: str, value: object) -> dict[str, Any]:
    return {"name": name, "value": str(value)}


def rank_env(
    job_name: str, namespace: str, spec: Mapping[str, Any], rank: int, world_size: int, generation: int
) -> list[dict[str, Any]]:
    elastic, checkpoint = spec["elastic"], spec["checkpoint"]
    policy = spec.get("failurePolicy") or {}
    env = [
        _env(ENV_JOB, job_name),
        _env(ENV_NAMESPACE, namespace),
        _env(ENV_POD_NAME, pod_name(job_name, rank)),
        {"name": ENV_HOST, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        _env("RANK", rank),
        _env("NODE_RANK", rank),
        _env("WORLD_SIZE", world_size),
        _env(ENV_PROCS_PER_NODE, defaults.field(elastic, "elastic.procsPerNode")),
        _env(ENV_GENERATION, generation),
        _env("MASTER_ADDR", master_addr(job_name, namespace)),
        _env("MASTER_PORT", defaults.field(elastic, "elastic.port")),
        _env(ENV_HEARTBEAT_KEY_FILE, f"{HEARTBEAT_DIR}/{HEARTBEAT_KEY}"),
        _env(ENV_CHECKPOINT_URI, checkpoint_uri(job_name, namespace, spec)),
        _env(ENV_SAVE_EVERY, defaults.field(checkpoint, "checkpoint.saveEveryNSteps")),
        _env(ENV_MAX_TO_KEEP, defaults.field(checkpoint, "checkpoint.maxToKeep")),
        _env(ENV_VALIDATION, defaults.field(checkpoint, "checkpoint.validation")),
        _env(ENV_ROLLBACK_DEPTH, defaults.field(checkpoint, "checkpoint.rollbackDepth")),
        _env(ENV_SNAPSHOT_EVERY, defaults.field(checkpoint, "checkpoint.snapshotEveryNSteps")),
        _env(ENV_SNAPSHOT_REPLICAS, defaults.field(checkpoint, "checkpoint.snapshotReplicas")),
        {"name": ENV_NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        _env(ENV_OBJECT, job_object.object_name(job_name)),
        _env(ENV_MIN_NODES, elastic["minNodes"]),
        _env(ENV_MAX_NODES, elastic["maxNodes"]),
        _env(ENV_RENDEZVOUS_TIMEOUT, defaults.field(elastic, "elastic.rendezvousTimeoutSeconds")),
        _env(ENV_LAST_CALL, defaults.field(elastic, "elastic.joinTimeoutSeconds")),
        _env(ENV_HANG_TIMEOUT, defaults.field(policy, "failurePolicy.hangTimeoutSeconds")),
    ]
    s3 = checkpoint["storage"].get("s3")
    if s3 is not None:
        secret = s3["credentialsSecretRef"]["name"]
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
        if s3.get("region"):
            env.append(_env("AWS_REGION", s3["region"]))
        if s3.get("endpoint"):
            env.append(_env("AWS_ENDPOINT_URL", s3["endpoint"]))
    return env


def _volumes(
    job_name: str, job_uid: str, spec: Mapping[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, container mounts) the operator adds: heartbeat key, a writable /tmp, checkpoints."""
    volumes: list[dict[str, Any]] = [
        {
            "name": VOLUME_HEARTBEAT,
            "secret": {"secretName": secret_name(job_name, job_uid), "defaultMode": 0o440},
        },
        # readOnlyRootFilesystem leaves no writable scratch space otherwise.
        {"name": VOLUME_TMP, "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": VOLUME_HEARTBEAT, "mountPath": HEARTBEAT_DIR, "readOnly": True},
        {"name": VOLUME_TMP, "mountPath": TMP_DIR},
    ]
    pvc = spec["checkpoint"]["storage"].get("pvc")
    if pvc is not None:
        volumes.append({"name": VOLUME_CHECKPOINTS, "persistentVolumeClaim": {"claimName": pvc["claimName"]}})
        mount = {"name": VOLUME_CHECKPOINTS, "mountPath": CHECKPOINT_DIR}
        if pvc.get("subPath"):
            mount["subPath"] = pvc["subPath"]
        mounts.append(mount)
    return volumes, mounts


def _check_template(pod_spec: Mapping[str, Any]) -> None:
    """Refuse templates that use the names and paths of the operator's own volumes."""
    taken = {volume.get("name") for volume in pod_spec.get("volumes") or []} & RESERVED_VOLUMES
    if taken:
        raise JobSpecError(
            f"spec.template.spec.volumes uses {sorted(taken)}: these names are reserved for the operator's own volumes"
        )
    account = pod_spec.get("serviceAccountName") or pod_spec.get("serviceAccount")
    if account:
        raise JobSpecError(
            f"spec.template.spec.serviceAccountName is {account!r}: ranks run as the job's own ServiceAccount, "
            "which may touch only the job's rendezvous object (leave it unset)"
        )
    if pod_spec.get("shareProcessNamespace"):
        raise JobSpecError(
            "spec.template.spec.shareProcessNamespace is true: a sidecar could then read the agent's API token "
            "through /proc (leave it unset)"
        )
    for volume in pod_spec.get("volumes") or []:
        sources = (volume.get("projected") or {}).get("sources") or []
        if any("serviceAccountToken" in (source or {}) for source in sources):
            raise JobSpecError(
                f"volume {volume.get('name')!r} projects a service account token: only the agent gets one, from "
                "the operator (sidecars must not act as the job's agent)"
            )
    reserved_paths = {HEARTBEAT_DIR, CHECKPOINT_DIR, TMP_DIR, TOKEN_DIR}
    for container in [*(pod_spec.get("initContainers") or []), *pod_spec["containers"]]:
        mounts = container.get("volumeMounts") or []
        clash = {m.get("mountPath") for m in mounts} & reserved_paths
        if clash:
            raise JobSpecError(
                f"container {container.get('name')!r} mounts {sorted(clash)}: the operator mounts its own volumes there"
            )
        if any(m.get("name") == VOLUME_TOKEN for m in mounts):
            raise JobSpecError(
                f"container {container.get('name')!r} mounts {VOLUME_TOKEN!r}, the agent's API token: only the "
                "first container gets it, from the operator (sidecars must not act as the job's agent)"
            )


def _token_volume() -> dict[str, Any]:
    """What automountServiceAccountToken would mount, as an explicit projected volume: a token that expires
    and is bound to the pod, the cluster's CA and the namespace."""
    return {
        "name": VOLUME_TOKEN,
        "projected": {
            "defaultMode": 0o444,
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": TOKEN_EXPIRATION_SECONDS}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {
                    "downwardAPI": {
                        "items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]
                    }
                },
            ],
        },
    }


SPREAD_WEIGHT = 100  # the most a preferred term may weigh: node spread before the scheduler's other preferences


def _spread_ranks(job_name: str, affinity: Mapping[str, Any] | None) -> dict[str, Any]:
    """The template's affinity plus a preference (not a rule: a cluster of one node still runs the job) for a node
    no other rank of the job is on. Peer-memory snapshots keep each rank's copies on other nodes: ranks sharing
    a node leave fewer places for them, and a node alone with all ranks leaves none (the agents report it)."""
    spread = {"weight": SPREAD_WEIGHT, "podAffinityTerm": {"labelSelector": {"matchLabels": {LABEL_JOB: job_name}},
                                                           "topologyKey": "kubernetes.io/hostname"}}
    merged = copy.deepcopy(dict(affinity or {}))
    anti = merged.setdefault("podAntiAffinity", {})
    anti["preferredDuringSchedulingIgnoredDuringExecution"] = [
        *(anti.get("preferredDuringSchedulingIgnoredDuringExecution") or []), spread]
    return merged


def build_pod(
    job_name: str,
    namespace: str,
    job_uid: str,
    spec: Mapping[str, Any],
    rank: int,
    world_size: int,
    generation: int,
) -> dict[str, Any]:
    """One rank's pod: the user's template plus rank env, operator volumes and the restricted profile's
    defaults. Raises JobSpecError when the result would break the profile (restricted.check).

    restartPolicy is Never because restarts are the operator's decision (a group restart with backoff
    and a budget), not the kubelet's.
    """
    template = spec["template"]
    pod_spec = copy.deepcopy(dict(template["spec"]))
    _check_template(pod_spec)
    template_meta = template.get("metadata") or {}
    annotations = dict(template_meta.get("annotations") or {})
    labels = {**(template_meta.get("labels") or {}), LABEL_RANK: str(rank), LABEL_GENERATION: str(generation)}
    metadata = _metadata(pod_name(job_name, rank), namespace, job_name, job_uid, labels)
    if annotations:
        metadata["annotations"] = annotations

    volumes, mounts = _volumes(job_name, job_uid, spec)
    env = rank_env(job_name, namespace, spec, rank, world_size, generation)
    env_names = {item["name"] for item in env}

    def with_rank_env(container: Mapping[str, Any]) -> dict[str, Any]:
        built = restricted.with_container_defaults(container)
        kept = [item for item in built.get("env") or [] if item["name"] not in env_names | OPERATOR_ENV_NAMES]
        built["env"] = [*env, *kept]
        built["volumeMounts"] = [*mounts, *(built.get("volumeMounts") or [])]
        return built

    pod_spec["containers"] = [with_rank_env(c) for c in pod_spec["containers"]]
    # Only the agent (the first container) talks to the API server, so only it gets the token.
    agent = pod_spec["containers"][0]
    agent["volumeMounts"] = [
        {"name": VOLUME_TOKEN, "mountPath": TOKEN_DIR, "readOnly": True},
        *agent["volumeMounts"],
    ]
    if pod_spec.get("initContainers"):
        pod_spec["initContainers"] = [
            restricted.with_container_defaults(c) for c in pod_spec["initContainers"]
        ]
    pod_spec["volumes"] = [*volumes, _token_volume(), *(pod_spec.get("volumes") or [])]
    pod_spec["securityContext"] = restricted.with_pod_defaults(pod_spec.get("securityContext"))
    # The heartbeat key is mode 0440, owned by root: the kubelet gives it the pod's fsGroup, which every container
    # process holds as a supplementary group, so a non-root agent can read it (and no one else on the node).
    # OnRootMismatch: a checkpoint volume already owned so is not walked again at every pod start.
    pod_spec["securityContext"].setdefault("fsGroup", KEY_GROUP)
    pod_spec["securityContext"].setdefault("fsGroupChangePolicy", "OnRootMismatch")
    if defaults.field(spec["checkpoint"], "checkpoint.snapshotEveryNSteps"):
        pod_spec["affinity"] = _spread_ranks(job_name, pod_spec.get("affinity"))
    pod_spec["hostname"] = pod_name(job_name, rank)
    pod_spec["subdomain"] = service_name(job_name)
    pod_spec["restartPolicy"] = "Never"
    pod_spec["serviceAccountName"] = agent_name(job_name)
    # The token goes to the agent container alone, by the projected volume above; automounting would give
    # it to every container (restricted.check refuses a template that asks for it).
    pod_spec.setdefault("automountServiceAccountToken", False)
    restricted.check(pod_spec, annotations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}
