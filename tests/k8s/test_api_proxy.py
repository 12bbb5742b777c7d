"""The fault-injecting API proxy (api_proxy.py) against the real kube-apiserver: logging, watches, killing
a process before its N-th write, partition and heal, pause and resume, the identity it authenticates as,
and a real `python -m sneppx_operator` (kopf) running through it."""

from __future__ import annotations

import http.client
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import api_proxy
import k8s_cluster
import k8s_helpers
import kubernetes
import pytest

pytestmark = pytest.mark.k8s

ADMIN, MASTERS = "sneppx-test-admin", ("system:masters",)
LABEL = {"api-proxy-test": "yes"}  # the ConfigMaps the watches see (not ones a controller may publish)


@pytest.fixture
def proxy(cluster: k8s_cluster.Cluster) -> Iterator[api_proxy.ApiProxy]:
    with api_proxy.ApiProxy(cluster, ADMIN, MASTERS) as running:
        yield running
        assert not running.errors, running.errors


def client_through(proxy: api_proxy.ApiProxy) -> kubernetes.client.ApiClient:
    return kubernetes.config.new_client_from_config(config_file=str(proxy.kubeconfig))


def raw_connection(proxy: api_proxy.ApiProxy) -> http.client.HTTPConnection:
    """A plain HTTP connection to the proxy: no client-side retries to blur what the proxy did."""
    host, port = proxy.url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port))


def configmaps(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/configmaps"


class WatchThread(threading.Thread):
    """Watches the labelled ConfigMaps through `client` into `names` (one connection, no re-watch)."""

    def __init__(self, client: kubernetes.client.ApiClient, namespace: str) -> None:
        super().__init__(daemon=True)
        self.core, self.namespace = kubernetes.client.CoreV1Api(client), namespace
        self.names: list[str] = []
        self.error: BaseException | None = None
        self.watch = kubernetes.watch.Watch()

    def run(self) -> None:
        try:
            # timeout_seconds: the server ends it in the end, and Watch.stream does not re-watch.
            for event in self.watch.stream(
                self.core.list_namespaced_config_map, self.namespace, label_selector="api-proxy-test=yes",
                timeout_seconds=300,
            ):
                self.names.append(event["object"].metadata.name)
        except Exception as exc:  # noqa: BLE001  (a cut connection ends the watch with an error)
            self.error = exc


def labelled(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": LABEL}}


def cm_exists(api: kubernetes.client.ApiClient, namespace: str, name: str) -> bool:
    return k8s_helpers.exists(kubernetes.client.CoreV1Api(api).read_namespaced_config_map, name, namespace)


def test_requests_and_a_watch_pass_through_and_are_logged(
    cluster: k8s_cluster.Cluster, api: kubernetes.client.ApiClient, namespace: str, proxy: api_proxy.ApiProxy
) -> None:
    core = kubernetes.client.CoreV1Api(client_through(proxy))
    core.list_namespaced_config_map(namespace, label_selector="a=b")
    core.create_namespaced_config_map(namespace, {**labelled("through"), "data": {"k": "v"}})

    watch = WatchThread(client_through(proxy), namespace)
    watch.start()
    proxy.wait_for_request(lambda r: r.is_watch and r.outcome == "forwarded")
    kubernetes.client.CoreV1Api(api).create_namespaced_config_map(namespace, labelled("direct"))
    k8s_helpers.wait_for(lambda: "direct" in watch.names, "the watch event through the proxy")
    assert sorted(watch.names) == ["direct", "through"]  # "through" may come as the watch's initial ADDED
    watch.watch.stop()

    # kubectl (Go's client) through it too.
    out = cluster.kubectl("get", "cm", "through", "-n", namespace, "-o", "name", kubeconfig=proxy.kubeconfig)
    assert out.stdout.strip() == "configmap/through"

    seen = [r for r in proxy.requests if r.path == configmaps(namespace)]
    assert [(r.method, r.is_watch) for r in seen[:3]] == [("GET", False), ("POST", False), ("GET", True)]
    listed, created, watched = seen[:3]
    assert listed.params["labelSelector"] == "a=b" and listed.body == b"" and not listed.is_write
    assert created.is_write and b'"through"' in created.body and created.body_size == len(created.body) > 0
    assert watched.is_watch and watched.params["timeoutSeconds"] == "300" and watched.outcome == "forwarded"
    assert all(r.outcome == "forwarded" for r in proxy.requests)
    assert proxy.writes() == [created]
    assert listed.time <= created.time <= watched.time and listed.seq < created.seq < watched.seq


CHILD = textwrap.dedent(
    """
    import sys, kubernetes
    kubernetes.config.load_kube_config(config_file=sys.argv[1])
    core = kubernetes.client.CoreV1Api()
    sys.stdin.readline()
    for name in ("first", "second", "third"):
        core.create_namespaced_config_map(sys.argv[2], {"metadata": {"name": name}})
        print("created", name, flush=True)
    """
)


def test_kill_before_write_holds_the_write_and_kills_the_writer_first(
    api: kubernetes.client.ApiClient, namespace: str, proxy: api_proxy.ApiProxy
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(proxy.kubeconfig), namespace],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        rule = proxy.kill_before_write(2, child, match=lambda r: r.path == configmaps(namespace))
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        held = rule.wait()
        assert child.wait(timeout=30) == -signal.SIGKILL
        assert child.stdout is not None and child.stdout.read() == "created first\n"
    finally:
        k8s_cluster.stop_process(child)
    assert held.method == "POST" and held.outcome == "held" and b'"second"' in held.body
    assert cm_exists(api, namespace, "first")
    assert not cm_exists(api, namespace, "second"), "the held write reached the API server"
    assert [(r.outcome, r.body.count(b'"second"')) for r in proxy.writes()] == [("forwarded", 0), ("held", 1)]


def test_partition_holds_everything_and_heal_delivers_none_of_it(
    api: kubernetes.client.ApiClient, namespace: str, proxy: api_proxy.ApiProxy
) -> None:
    direct = kubernetes.client.CoreV1Api(api)
    watch = WatchThread(client_through(proxy), namespace)
    watch.start()
    direct.create_namespaced_config_map(namespace, labelled("before"))
    k8s_helpers.wait_for(lambda: watch.names == ["before"], "the watch before the partition")

    proxy.partition()
    direct.create_namespaced_config_map(namespace, labelled("during"))
    k8s_helpers.wait_for(lambda: proxy.held_bytes > 0, "the watch event held at the proxy")

    # A new connection is accepted and its request read, but nothing is forwarded.
    answers: list[Any] = []

    def post() -> None:
        conn = raw_connection(proxy)
        try:
            conn.request("POST", configmaps(namespace), body=b'{"metadata": {"name": "cut-off"}}',
                         headers={"Content-Type": "application/json"})
            answers.append(conn.getresponse().status)
        except Exception as exc:  # noqa: BLE001  (heal closes the connection)
            answers.append(exc)

    writer = threading.Thread(target=post, daemon=True)
    writer.start()
    pending = proxy.wait_for_request(lambda r: r.method == "POST" and b"cut-off" in r.body)
    assert pending.outcome == "pending"
    assert watch.names == ["before"] and watch.is_alive() and writer.is_alive()

    proxy.heal()
    writer.join(timeout=30)
    assert not writer.is_alive()
    assert not cm_exists(api, namespace, "cut-off"), "a held request reached the API server after heal"
    assert len(answers) == 1 and isinstance(answers[0], (ConnectionError, http.client.HTTPException)), answers
    assert [r.outcome for r in proxy.requests if b"cut-off" in r.body] == ["dropped"]
    watch.join(timeout=30)
    assert watch.names == ["before"], "a held watch event was delivered after heal"
    assert not watch.is_alive(), "the watch connection outlived heal"
    assert cm_exists(api, namespace, "during")

    # Healed: new connections go through.
    core = kubernetes.client.CoreV1Api(client_through(proxy))
    assert core.read_namespaced_config_map("during", namespace).metadata.name == "during"
    assert proxy.open_connections <= 1


def test_pause_holds_and_resume_delivers(
    api: kubernetes.client.ApiClient, namespace: str, proxy: api_proxy.ApiProxy
) -> None:
    proxy.pause()
    answers: list[Any] = []

    def post() -> None:
        conn = raw_connection(proxy)
        conn.request("POST", configmaps(namespace), body=b'{"metadata": {"name": "late"}}',
                     headers={"Content-Type": "application/json"})
        answers.append(conn.getresponse().status)

    writer = threading.Thread(target=post, daemon=True)
    writer.start()
    assert proxy.wait_for_request(lambda r: b"late" in r.body).outcome == "pending"
    assert not cm_exists(api, namespace, "late")
    proxy.resume()
    writer.join(timeout=30)
    assert answers == [201]
    assert cm_exists(api, namespace, "late")


def test_a_chunked_request_body_is_forwarded_whole_and_logged_decoded(
    api: kubernetes.client.ApiClient, namespace: str, proxy: api_proxy.ApiProxy
) -> None:
    body = b'{"metadata": {"name": "chunked"}, "data": {"k": "v"}}'
    pieces = [body[i:i + 7] for i in range(0, len(body), 7)]
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece) for piece in pieces)
    conn = raw_connection(proxy)
    for _ in range(2):  # two requests on one keep-alive connection
        conn.putrequest("POST", configmaps(namespace))
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders(chunks + b"0\r\nX-Trailer: t\r\n\r\n")
        response = conn.getresponse()
        response.read()
    assert response.status == 409  # the second one: the same name again, so the first made it whole
    core = kubernetes.client.CoreV1Api(api)
    assert core.read_namespaced_config_map("chunked", namespace).data == {"k": "v"}
    first, second = proxy.writes()
    assert first.body == second.body == body and first.body_size == len(body) and first.conn == second.conn


def test_the_upstream_identity_is_the_one_given_and_rbac_applies(
    cluster: k8s_cluster.Cluster, api: kubernetes.client.ApiClient
) -> None:
    # A certificate's CN holds at most 64 characters: a short namespace, not the `namespace` fixture's.
    namespace = k8s_helpers.create_namespace(api, f"proxy-{secrets.token_hex(3)}")
    user = f"system:serviceaccount:{namespace}:proxied"
    groups = ("system:serviceaccounts", f"system:serviceaccounts:{namespace}")
    with api_proxy.ApiProxy(cluster, user, groups) as proxy:
        client = client_through(proxy)
        review = kubernetes.client.AuthenticationV1Api(client).create_self_subject_review({})
        assert review.status.user_info.username == user
        assert set(groups) <= set(review.status.user_info.groups)

        core = kubernetes.client.CoreV1Api(client)
        with pytest.raises(kubernetes.client.ApiException) as refused:
            core.create_namespaced_config_map(namespace, {"metadata": {"name": "denied"}})
        assert refused.value.status == 403 and user in refused.value.body
        assert proxy.writes()[-1].outcome == "forwarded"  # the API server refused it, not the proxy

        rbac = kubernetes.client.RbacAuthorizationV1Api(api)
        rbac.create_namespaced_role(namespace, {
            "metadata": {"name": "cm-writer"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]}],
        })
        rbac.create_namespaced_role_binding(namespace, {
            "metadata": {"name": "cm-writer"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cm-writer"},
            "subjects": [{"kind": "ServiceAccount", "name": "proxied", "namespace": namespace}],
        })
        k8s_helpers.wait_for(
            lambda: _creates(core, namespace, "allowed"), "the binding to reach the authorizer"
        )
        assert not proxy.errors, proxy.errors


def _creates(core: kubernetes.client.CoreV1Api, namespace: str, name: str) -> bool:
    try:
        core.create_namespaced_config_map(namespace, {"metadata": {"name": name}})
    except kubernetes.client.ApiException as exc:
        if exc.status == 403:
            return False
        raise
    return True


def test_an_operator_process_runs_through_the_proxy_and_dies_before_its_first_job_write(
    cluster: k8s_cluster.Cluster, api: kubernetes.client.ApiClient, namespace: str, proxy: api_proxy.ApiProxy
) -> None:
    env = dict(os.environ, KUBECONFIG=str(proxy.kubeconfig), SNEPPX_RESYNC_SECONDS="1")
    env.pop("KUBERNETES_SERVICE_HOST", None)  # kopf tries in-cluster login first
    log = cluster.workdir / f"operator-{namespace}.log"
    jobs = f"/apis/{k8s_helpers.GROUP}/{k8s_helpers.VERSION}/namespaces/{namespace}/{k8s_helpers.PLURAL}"
    with log.open("wb") as out:
        operator = subprocess.Popen(
            [sys.executable, "-m", "sneppx_operator", "--namespace", namespace],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        rule = proxy.kill_before_write(1, operator, match=lambda r: r.path.startswith(jobs))
        try:
            proxy.wait_for_request(lambda r: r.path == jobs and r.is_watch and r.outcome == "forwarded")
        except AssertionError:
            raise AssertionError(log.read_text()[-4000:]) from None
        created = k8s_helpers.custom(api).create_namespaced_custom_object(
            k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL, k8s_helpers.valid_job("ha")
        )
        held = rule.wait(timeout=90)
        assert operator.wait(timeout=30) == -signal.SIGKILL
    finally:
        k8s_cluster.stop_process(operator)
    assert held.path.startswith(f"{jobs}/ha") and held.outcome == "held", held
    job = k8s_helpers.custom(api).get_namespaced_custom_object(
        k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL, "ha"
    )
    assert job["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"], (
        "a write of the killed operator reached the job"
    )
    assert not job["metadata"].get("finalizers")
