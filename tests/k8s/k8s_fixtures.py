"""Fixtures for tests against the real kube-apiserver (see k8s_cluster.py and docs/TESTING.md).

A module, not a conftest, so tests/k8s and tests/image (the operator started from the built image) both
import the same fixtures through their conftest.py; they still share one cluster.

One cluster per test session (starting it takes seconds, building it the first time takes minutes);
one fresh namespace per test, labelled to enforce the restricted Pod Security profile so every pod
the operator creates is checked by the API server's own admission plugin.
"""

from __future__ import annotations

import os
import pathlib
import re
import secrets
from collections.abc import Iterator

import k8s_cluster
import k8s_helpers
import kopf.testing
import kubernetes
import pod_runner
import pytest

# The operator's periodic resync carries pod readiness into job status; short in tests so they finish fast.
# Set before anything imports sneppx_operator.handlers (its timer reads it at import).
os.environ.setdefault("SNEPPX_RESYNC_SECONDS", "1")


_RUNNING = pytest.StashKey[k8s_cluster.Cluster]()


@pytest.fixture(scope="session")
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[k8s_cluster.Cluster]:
    # Each conftest that imports this fixture registers its own copy; the session stash keeps it one cluster.
    running = request.config.stash.get(_RUNNING, None)
    if running is None:
        running = request.config.stash[_RUNNING] = _start_with_retries(
            k8s_cluster.build_tools(), tmp_path_factory
        )
        request.config.add_cleanup(running.stop)
    with k8s_helpers.using_kubeconfig(running.kubeconfig):
        yield running


@pytest.fixture(scope="session")
def api(cluster: k8s_cluster.Cluster) -> Iterator[kubernetes.client.ApiClient]:
    client = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def namespace(api: kubernetes.client.ApiClient, request: pytest.FixtureRequest) -> str:
    """A fresh namespace for one test, kept until the cluster goes at the end of the session: the namespace
    controller would delete it (5 s later at the earliest), but while Terminating it refuses the events and
    objects the module's operator may still write for what is left in it."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"t-{slug}-{secrets.token_hex(3)}"
    return k8s_helpers.create_namespace(api, name)


def _start_with_retries(
    bin_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> k8s_cluster.Cluster:
    """Free ports are picked before the processes bind them; another process may take one in between."""
    failures: list[k8s_cluster.ClusterStartError] = []
    while len(failures) < 3:
        try:
            return k8s_cluster.start_cluster(bin_dir, tmp_path_factory.mktemp("k8s"))
        except k8s_cluster.ClusterStartError as exc:
            failures.append(exc)
    raise failures[-1]


@pytest.fixture(scope="module")
def operator(cluster: k8s_cluster.Cluster) -> Iterator[kopf.testing.KopfRunner]:
    """The operator, in this process (kopf's test runner), for every namespace."""
    runner = kopf.testing.KopfRunner(
        ["run", "--standalone", "--all-namespaces", "--verbose", "-m", "sneppx_operator.handlers"], timeout=60
    )
    with runner:
        yield runner
    assert runner.exception is None, runner.output[-4000:]


@pytest.fixture
def pods(
    api: kubernetes.client.ApiClient, cluster: k8s_cluster.Cluster, namespace: str, tmp_path: pathlib.Path
) -> Iterator[pod_runner.PodRunner]:
    """The kubelet stand-in for the test's namespace, with three Nodes; the namespace's jobs are deleted after."""
    nodes = tuple(f"{namespace[-6:]}-node-{i}" for i in range(3))
    with pod_runner.PodRunner(api, cluster.server, cluster.ca.cert_pem, namespace, tmp_path, nodes) as runner:
        yield runner
        for node in nodes:  # so the jobs' pods can go
            runner.set_node_ready(node, True)
        k8s_helpers.delete_jobs(api, namespace)  # the operator stops looking after them before their pods stop
    assert not runner.errors, runner.errors[:5]
