"""The real-node tier's fixtures: one real single-node cluster for the session (real_node.py) with the project's
image imported into its containerd, the operator installed on it by its Helm chart, and a fresh namespace per
test with the restricted Pod Security profile enforced."""

from __future__ import annotations

import pathlib
import re
import secrets
import sys
from collections.abc import Iterator

import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "k8s"), str(HERE.parent / "image")]

import container_image
import image_fixtures
import k8s_cluster
import k8s_helpers
import kubernetes
import node_jobs
import real_node
from image_fixtures import TAG, image  # noqa: F401  (pytest finds fixtures by name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if pathlib.Path(str(item.fspath)).is_relative_to(HERE):
            item.add_marker(pytest.mark.node)
            item.add_marker(image_fixtures.BUILD_TIMEOUT)  # the first one's setup builds the image, then the node


@pytest.fixture(scope="session")
def node(image: container_image.Image, tmp_path_factory: pytest.TempPathFactory) -> Iterator[real_node.Node]:  # noqa: F811
    """The real node, with the project's image in its containerd (pods run it with imagePullPolicy: Never)."""
    reason = real_node.check_can_run()
    if reason is not None:
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("node")
    with real_node.running_node(k8s_cluster.build_tools(), workdir) as running:
        archive = workdir / "sneppx-image.tar"
        image.buildah("push", "--quiet", TAG, f"docker-archive:{archive}:{TAG}", timeout=600)
        running.import_image(archive)
        archive.unlink()
        yield running


@pytest.fixture(scope="session")
def api(node: real_node.Node) -> Iterator[kubernetes.client.ApiClient]:
    client = kubernetes.config.new_client_from_config(config_file=str(node.cluster.kubeconfig))
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def operator(node: real_node.Node) -> Iterator[str]:
    """`helm install` of the chart with the built image: the operator runs as pods of its Deployment, under
    its ServiceAccount and the chart's RBAC. Yields the release name; `helm uninstall` at the end must leave
    nothing of it behind."""
    node_jobs.install_operator(node, TAG, "--set", "operator.resyncSeconds=2", "--set", "operator.logLevel=debug")
    yield real_node.RELEASE
    # test_helm_uninstall_leaves_nothing_of_the_release_behind uninstalls it already when it runs
    node.cluster.helm("uninstall", real_node.RELEASE, "--namespace", real_node.OPERATOR_NAMESPACE, "--wait",
                      "--timeout", "120s", "--ignore-not-found", timeout=180)


@pytest.fixture
def namespace(api: kubernetes.client.ApiClient, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace enforcing the restricted profile; its jobs are deleted after the test."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = k8s_helpers.create_namespace(api, f"n-{slug}-{secrets.token_hex(3)}")
    yield name
    k8s_helpers.delete_jobs(api, name)
