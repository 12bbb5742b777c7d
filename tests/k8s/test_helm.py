"""The Helm chart: lint, schema, least-privilege RBAC, restricted pods, and installs into the real API server.

The last test runs the operator with exactly the chart's RBAC: a client certificate whose CN is the
chart's ServiceAccount user name is held by RBAC to what that ServiceAccount may do.
"""

from __future__ import annotations

import json
import pathlib
import re
import secrets
import shutil
from typing import Any

import k8s_cluster
import k8s_helpers
import kopf.testing
import kubernetes
import pytest
import yaml

pytestmark = pytest.mark.k8s

CHART = k8s_cluster.REPO / "charts" / "sneppx-operator"
NAMESPACED_MODE = ("--set", "watchNamespaces={team-a,team-b}")


def render(
    cluster: k8s_cluster.Cluster, *args: str, namespace: str = "sneppx-system"
) -> list[dict[str, Any]]:
    out = cluster.helm("template", "rel", str(CHART), "--namespace", namespace, *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def of_kind(docs: list[dict[str, Any]], *kinds: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] in kinds]


def test_chart_crds_are_byte_identical_to_top_level_crds() -> None:
    top = {p.name: p.read_bytes() for p in (k8s_cluster.REPO / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert top, "no CRDs in crds/"
    assert chart == top, (
        "charts/sneppx-operator/crds/ must be a copy of crds/ (cp crds/*.yaml charts/sneppx-operator/crds/)"
    )


def test_helm_lint_is_clean(cluster: k8s_cluster.Cluster) -> None:
    for extra in ((), NAMESPACED_MODE):
        result = cluster.helm("lint", "--strict", str(CHART), *extra)
        assert "0 chart(s) failed" in result.stdout
        assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout


def _schema_paths(schema: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    paths: dict[str, dict[str, Any]] = {}
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        paths[path] = sub
        paths.update(_schema_paths(sub, f"{path}."))
    return paths


def _value_paths(values: dict[str, Any], prefix: str = "") -> set[str]:
    paths: set[str] = set()
    for key, value in values.items():
        paths.add(f"{prefix}{key}")
        if isinstance(value, dict) and key not in {"requests", "limits"}:
            paths |= _value_paths(value, f"{prefix}{key}.")
    return paths


def test_every_value_is_documented_and_typed() -> None:
    values_text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(values_text)
    schema = json.loads((CHART / "values.schema.json").read_text())
    in_schema = _schema_paths(schema)
    assert _value_paths(values) <= set(in_schema), "every value needs a schema entry"
    for path, sub in in_schema.items():
        assert sub.get("description"), f"values.schema.json: {path} has no description"
        if sub.get("type") == "object" and "properties" in sub:
            assert sub.get("additionalProperties") is False, f"{path} must refuse unknown keys"
    assert schema["additionalProperties"] is False
    # In values.yaml every key line follows a comment line (after blank lines) that documents it.
    lines = values_text.splitlines()
    for number, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z][\w-]*:", line):
            previous = next(l for l in reversed(lines[:number]) if l.strip())
            assert previous.strip().startswith("#"), (
                f"values.yaml line {number + 1} is undocumented: {line!r}"
            )


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("replicas=2", "additional properties 'replicas' not allowed"),
        ("replicaCount=0", "/replicaCount"),
        ("leaderElection.leaseDurationSeconds=1", "/leaderElection/leaseDurationSeconds"),
        ("image.tagg=1", "additional properties 'tagg' not allowed"),
        ("runAsUser=0", "/runAsUser"),
        ("operator.logLevel=loud", "/operator/logLevel"),
        ("watchNamespaces={Bad_Name}", "/watchNamespaces/0"),
    ],
)
def test_values_schema_refuses_mistakes(cluster: k8s_cluster.Cluster, setting: str, expected: str) -> None:
    result = cluster.helm("template", "rel", str(CHART), "--set", setting, check=False)
    assert result.returncode != 0
    assert expected in result.stderr, result.stderr


@pytest.mark.parametrize("mode", [(), NAMESPACED_MODE], ids=["all-namespaces", "watch-namespaces"])
def test_rendered_rbac_is_least_privilege(cluster: k8s_cluster.Cluster, mode: tuple[str, ...]) -> None:
    docs = render(cluster, *mode)
    roles = of_kind(docs, "ClusterRole", "Role")
    assert roles
    for role in roles:
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(field, []), f"wildcard {field} in {role['kind']} {rule}"
            assert not set(rule["verbs"]) & {"escalate", "bind", "impersonate"}, rule
            if "secrets" in rule["resources"]:
                assert not set(rule["verbs"]) & {"list", "watch", "get"}, (
                    f"Secrets must not be readable: {rule}"
                )
    if mode:
        namespaced = {(r["metadata"]["namespace"], r["kind"]) for r in of_kind(docs, "Role", "RoleBinding")}
        assert namespaced == {
            ("team-a", "Role"),
            ("team-a", "RoleBinding"),
            ("team-b", "Role"),
            ("team-b", "RoleBinding"),
            ("sneppx-system", "Role"),  # the leader election's Lease
            ("sneppx-system", "RoleBinding"),
        }
        cluster_rules = of_kind(docs, "ClusterRole")[0]["rules"]
        assert all(set(r["verbs"]) <= {"list", "watch"} for r in cluster_rules), "namespaced mode reads only"
        args = of_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--namespace=team-a" in args and "--namespace=team-b" in args


# ---- RBAC: exactly the calls the code makes -----------------------------------------------------------------

OPERATOR_DIR = k8s_cluster.REPO / "operator" / "sneppx_operator"
VERBS = {"read": "get", "get": "get", "create": "create", "replace": "update", "patch": "patch", "delete": "delete",
         "list": "list"}
RESOURCES = {  # the client's method suffix -> (API group, resource)
    "lease": ("coordination.k8s.io", "leases"),
    "deployment": ("apps", "deployments"),
    "pod": ("", "pods"),
    "event": ("", "events"),
    "config_map": ("", "configmaps"),
    "custom_object": ("sneppx.io", "elastictrainingjobs"),
    "custom_object_status": ("sneppx.io", "elastictrainingjobs/status"),
}
KINDS = {"Pod": ("", "pods"), "Service": ("", "services"), "Secret": ("", "secrets"), "ConfigMap": ("", "configmaps"),
         "ServiceAccount": ("", "serviceaccounts"), "Role": ("rbac.authorization.k8s.io", "roles"),
         "RoleBinding": ("rbac.authorization.k8s.io", "rolebindings")}
WATCHED = {"pods": ("", "pods"), "configmaps": ("", "configmaps"), "nodes": ("", "nodes"),
           "RESOURCE": ("sneppx.io", "elastictrainingjobs")}
# Granted though no line of ours calls it, each for a reason outside our code:
NOT_CALLED = {
    ("sneppx.io", "elastictrainingjobs/finalizers", "update"),  # blockOwnerDeletion on owned objects needs it
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),  # kopf's discovery of the resource
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    ("", "namespaces", "list"),  # kopf, only when watching a list of namespaces (which may be globs)
    ("", "namespaces", "watch"),
}


def calls_in_code() -> set[tuple[str, str, str]]:
    """(group, resource, verb) of every Kubernetes API call the operator's code makes: the client methods named
    in k8s.py and leader.py, k8s.KINDS_BY_VERB (the per-kind create/read/delete table) and the resources
    handlers.py watches through kopf (list + watch)."""
    import ast

    from sneppx_operator import k8s

    used: set[tuple[str, str, str]] = set()
    for name in ("k8s.py", "leader.py"):
        for node in ast.walk(ast.parse((OPERATOR_DIR / name).read_text())):
            if isinstance(node, ast.Attribute) and "_namespaced_" in node.attr:
                verb, _, suffix = node.attr.partition("_namespaced_")
                group, resource = RESOURCES[suffix]
                used.add((group, resource, VERBS[verb]))
    for verb, kinds in k8s.KINDS_BY_VERB.items():
        used |= {(*KINDS[kind], VERBS[verb]) for kind in kinds}
    for node in ast.walk(ast.parse((OPERATOR_DIR / "handlers.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("index", "event") and node.args:
            first = node.args[0]
            key = first.value if isinstance(first, ast.Constant) else getattr(first.value, "id", "")
            used |= {(*WATCHED[key], "list"), (*WATCHED[key], "watch")}
    return used


def granted(docs: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    out: set[tuple[str, str, str]] = set()
    for role in of_kind(docs, "ClusterRole", "Role"):
        for rule in role["rules"]:
            out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return out


@pytest.mark.parametrize("mode", [(), NAMESPACED_MODE], ids=["all-namespaces", "watch-namespaces"])
def test_the_charts_rules_are_exactly_the_calls_the_code_makes(cluster: k8s_cluster.Cluster, mode: tuple[str, ...]) -> None:
    rules, used = granted(render(cluster, *mode)), calls_in_code()
    assert used - rules == set(), "calls the chart does not allow"
    unused = rules - used - NOT_CALLED
    assert unused == set(), "verbs the chart grants that no code calls"
    assert not (rules & {("", "configmaps", "update"), ("", "configmaps", "delete"), ("", "secrets", "delete")})


@pytest.mark.parametrize("mode", [(), NAMESPACED_MODE], ids=["all-namespaces", "watch-namespaces"])
def test_rendered_deployment_runs_two_restricted_replicas_that_elect_a_leader(
    cluster: k8s_cluster.Cluster, mode: tuple[str, ...]
) -> None:
    docs = render(cluster, *mode)
    (deployment,) = of_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}
    }
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--leader-elect" in args and "--leader-election-id=rel-sneppx-operator" in args
    assert {"--lease-duration=15", "--renew-deadline=10", "--retry-period=2"} <= set(args)
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    spread = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = spread["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname", "replicas prefer different nodes"
    (lease_role,) = [r for r in of_kind(docs, "Role") if r["metadata"]["name"] == "rel-sneppx-operator-leader-election"]
    assert lease_role["metadata"]["namespace"] == "sneppx-system"
    workloads = of_kind(docs, "Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob", "Pod")
    for workload in workloads:
        pod_spec = workload["spec"]["template"]["spec"] if workload["kind"] != "Pod" else workload["spec"]
        assert k8s_helpers.restricted_violations(pod_spec) == [], workload["metadata"]["name"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "sneppx_operator"]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "rel-sneppx-operator"


def test_helm_template_passes_a_server_side_dry_run_without_warnings(
    cluster: k8s_cluster.Cluster, namespace: str
) -> None:
    manifests = cluster.helm("template", "rel", str(CHART), "--namespace", namespace, "--include-crds").stdout
    result = cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", "-n", namespace, "-f", "-", input_text=manifests
    )
    for applied in (
        "deployment.apps/rel-sneppx-operator",
        "clusterrole.rbac.authorization.k8s.io/rel-sneppx-operator",
        "serviceaccount/rel-sneppx-operator",
        "customresourcedefinition.apiextensions.k8s.io/elastictrainingjobs.sneppx.io",
    ):
        assert f"{applied} serverside-applied (server dry run)" in result.stdout, result.stdout
    # The namespace warns on the restricted profile, so a non-restricted pod template would print a warning.
    assert "Warning" not in result.stderr, result.stderr


def test_operator_pod_passes_restricted_admission(
    cluster: k8s_cluster.Cluster, api: kubernetes.client.ApiClient, namespace: str
) -> None:
    (deployment,) = of_kind(render(cluster, namespace=namespace), "Deployment")
    template = deployment["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "operator-probe",
            "namespace": namespace,
            "labels": template["metadata"]["labels"],
        },
        "spec": template["spec"],
    }
    created = kubernetes.client.CoreV1Api(api).create_namespaced_pod(namespace, pod, dry_run="All")
    assert created.metadata.name == "operator-probe"

    pod["spec"] = {**template["spec"], "securityContext": {}}
    pod["spec"]["containers"] = [{**template["spec"]["containers"][0], "securityContext": {}}]
    with pytest.raises(kubernetes.client.ApiException) as refused:
        kubernetes.client.CoreV1Api(api).create_namespaced_pod(namespace, pod, dry_run="All")
    assert refused.value.status == 403 and "violates PodSecurity" in refused.value.body, (
        "the namespace must really enforce the restricted profile for the check above to mean anything"
    )


def test_helm_install_into_the_test_apiserver(cluster: k8s_cluster.Cluster, namespace: str) -> None:
    release = f"sx{secrets.token_hex(3)}"
    result = cluster.helm("install", release, str(CHART), "--namespace", namespace)
    assert "STATUS: deployed" in result.stdout
    assert "kubectl apply -f examples/minimal-pvc.yaml" in result.stdout, "NOTES.txt must tell the next step"
    status = json.loads(cluster.helm("status", release, "--namespace", namespace, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    deployment = json.loads(
        cluster.kubectl(
            "get", "deployment", f"{release}-sneppx-operator", "-n", namespace, "-o", "json"
        ).stdout
    )
    assert deployment["spec"]["replicas"] == 2
    cluster.kubectl("get", "serviceaccount", f"{release}-sneppx-operator", "-n", namespace)
    cluster.kubectl("get", "clusterrole", f"{release}-sneppx-operator")
    cluster.helm("uninstall", release, "--namespace", namespace)
    gone = cluster.kubectl("get", "clusterrole", f"{release}-sneppx-operator", check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr


@pytest.mark.parametrize("watch_namespace", [False, True], ids=["all-namespaces", "watch-namespaces"])
def test_operator_works_with_exactly_the_charts_rbac(
    cluster: k8s_cluster.Cluster,
    api: kubernetes.client.ApiClient,
    tmp_path: pathlib.Path,
    watch_namespace: bool,
) -> None:
    # Short names: the user name system:serviceaccount:NS:NAME goes in a certificate CN (64 bytes at most).
    namespace = k8s_helpers.create_namespace(api, f"rbac-{secrets.token_hex(3)}")
    release = f"sx{secrets.token_hex(3)}"
    scope = ["--namespace", namespace] if watch_namespace else ["--all-namespaces"]
    values = ["--set", f"watchNamespaces={{{namespace}}}"] if watch_namespace else []
    cluster.helm("install", release, str(CHART), "--namespace", namespace, *values)
    account = f"{release}-sneppx-operator"
    user = f"system:serviceaccount:{namespace}:{account}"

    def can(*args: str) -> bool:
        out = cluster.kubectl("auth", "can-i", *args, f"--as={user}", check=False).stdout.strip()
        return out == "yes"

    assert can("create", "pods", "-n", namespace) and can(
        "watch", "elastictrainingjobs.sneppx.io", "-n", namespace
    )
    assert can("create", "pods", "-n", "default") is not watch_namespace, (
        "namespaced mode stays in its namespaces"
    )
    assert not can("list", "secrets", "-A") and not can("get", "secrets", "-n", namespace)
    assert not can("create", "deployments", "-n", namespace) and not can("delete", "nodes")

    kubeconfig = cluster.write_kubeconfig(
        tmp_path / "operator.kubeconfig",
        user,
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}"),
    )
    custom = kubernetes.client.CustomObjectsApi(api)
    core = kubernetes.client.CoreV1Api(api)
    from sneppx_operator import handlers, k8s

    handlers.ELECTION = election_of(cluster, release, namespace, 4, 3, 0.5)  # the Lease as the chart's replicas make it
    try:
        with k8s_helpers.using_kubeconfig(kubeconfig):
            runner = kopf.testing.KopfRunner(
                ["run", "--standalone", *scope, "-m", "sneppx_operator.handlers"], timeout=60
            )
            with runner:
                custom.create_namespaced_custom_object(
                    k8s_helpers.GROUP,
                    k8s_helpers.VERSION,
                    namespace,
                    k8s_helpers.PLURAL,
                    k8s_helpers.valid_job("rbac", max_nodes=2),
                )
                k8s_helpers.wait_for(
                    lambda: (
                        len(core.list_namespaced_pod(namespace, label_selector="sneppx.io/job=rbac").items) == 2
                    ),
                    "pods created under the chart's RBAC",
                )
                k8s_helpers.wait_for(
                    lambda: (
                        (
                            custom.get_namespaced_custom_object(
                                k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL, "rbac"
                            ).get("status")
                            or {}
                        ).get("phase")
                        == "Pending"
                    ),
                    "status written under the chart's RBAC",
                )
    finally:  # the operator's cleanup leaves its fence refusing every write: what follows in this process writes
        handlers.ELECTION = None
        k8s.set_fence(None)
    assert runner.exception is None and runner.exit_code == 0
    assert "Forbidden" not in runner.output and "forbidden" not in runner.output, runner.output[-4000:]
    # helm uninstall with a job left: nothing of the release stays, and the job is deleted at once, with no
    # operator to wait for; the garbage collector takes its pods.
    cluster.helm("uninstall", release, "--namespace", namespace)
    left = cluster.kubectl("get", "deployment,serviceaccount,role,rolebinding", "-n", namespace,
                           "-l", f"app.kubernetes.io/instance={release}", "-o", "name").stdout.strip()
    assert left == "", left
    assert cluster.kubectl("get", "clusterrole", account, check=False).returncode != 0
    leases = kubernetes.client.CoordinationV1Api(api)
    k8s_helpers.wait_for(lambda: not k8s_helpers.exists(leases.read_namespaced_lease, account, namespace),
                         "the replicas' Lease deleted with the release")
    custom.delete_namespaced_custom_object(k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL,
                                           "rbac")
    k8s_helpers.wait_for(
        lambda: not k8s_helpers.exists(custom.get_namespaced_custom_object, k8s_helpers.GROUP, k8s_helpers.VERSION,
                                       namespace, k8s_helpers.PLURAL, "rbac"), "the job gone without an operator", 10)
    k8s_helpers.wait_for(
        lambda: not core.list_namespaced_pod(namespace, label_selector="sneppx.io/job=rbac").items,
        "its pods collected",
    )


def election_of(
    cluster: k8s_cluster.Cluster, release: str, namespace: str, *timings: float
) -> Any:
    """handlers.Election as `python -m sneppx_operator` builds it from the chart's Deployment's arguments."""
    from sneppx_operator import __main__ as entry
    from sneppx_operator import handlers

    out = cluster.helm("template", release, str(CHART), "--namespace", namespace).stdout
    (deployment,) = of_kind([d for d in yaml.safe_load_all(out) if d], "Deployment")
    args = entry.parse_args(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    return handlers.Election(namespace, args.leader_election_id, *timings, dict(args.lease_label),
                             args.lease_owner_deployment)


def test_helm_upgrade_needs_no_hand_step_whoever_made_the_lease(
    cluster: k8s_cluster.Cluster, api: kubernetes.client.ApiClient, tmp_path: pathlib.Path
) -> None:
    """Issue 38, defect 1: a release of a chart without the Lease, whose replicas made it, could not be upgraded
    to a chart that makes it (Helm won't adopt an object without its ownership metadata), and the replicas
    re-made a deleted Lease within seconds. The Lease is no chart object now: the replicas make it, owned by
    the operator's Deployment, and every upgrade, and the uninstall, takes it as it comes."""
    from sneppx_operator import leader

    namespace = k8s_helpers.create_namespace(api, f"up-{secrets.token_hex(3)}")
    release = f"up{secrets.token_hex(3)}"
    earlier = tmp_path / "earlier"
    shutil.copytree(CHART, earlier)
    (earlier / "templates" / "lease.yaml").unlink(missing_ok=True)
    cluster.helm("install", release, str(earlier), "--namespace", namespace)
    election = election_of(cluster, release, namespace, 2, 1.5, 0.5)
    timings = {"lease_duration": 2, "renew_deadline": 1.5, "retry_period": 0.5, "api_client": api}
    old_replica = leader.Elector(namespace, election.name, **timings)  # no labels, no owner
    replica = leader.Elector(namespace, election.name, labels=election.labels,
                             owner_deployment=election.owner_deployment, **timings)
    leases = kubernetes.client.CoordinationV1Api(api)
    for maker in (old_replica, replica):  # the earlier release's replicas made it; then a deleted one re-made
        k8s_helpers.wait_for(maker.try_acquire_or_renew, "a replica makes the Lease")
        upgrade = cluster.helm("upgrade", release, str(CHART), "--namespace", namespace, check=False)
        assert upgrade.returncode == 0, upgrade.stderr
        assert k8s_helpers.exists(leases.read_namespaced_lease, election.name, namespace), "an upgrade keeps it"
        leases.delete_namespaced_lease(election.name, namespace)
    k8s_helpers.wait_for(replica.try_acquire_or_renew, "the replica makes the Lease")
    lease = leases.read_namespaced_lease(election.name, namespace)
    assert lease.metadata.labels["app.kubernetes.io/instance"] == release
    assert [(o.kind, o.name) for o in lease.metadata.owner_references] == [("Deployment", election.name)]
    cluster.helm("uninstall", release, "--namespace", namespace)
    k8s_helpers.wait_for(lambda: not k8s_helpers.exists(leases.read_namespaced_lease, election.name, namespace),
                         "the Lease deleted with the release")
