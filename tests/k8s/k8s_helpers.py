"""Small helpers shared by the tests against the real API server: a valid job, polling, kubelet stand-in."""

from __future__ import annotations

import contextlib
import os
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import kubernetes
import kubernetes.config.kube_config

GROUP, VERSION, PLURAL = "sneppx.io", "v1alpha1", "elastictrainingjobs"
T = TypeVar("T")


def valid_job(name: str = "job", max_nodes: int = 2, min_nodes: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ElasticTrainingJob",
        "metadata": {"name": name},
        "spec": {
            "template": {
                "spec": {"containers": [{"name": "trainer", "image": "example.org/train:1", "command": ["python"]}]}
            },
            "elastic": {"minNodes": min_nodes, "maxNodes": max_nodes},
            "checkpoint": {"storage": {"pvc": {"claimName": "ckpt"}}},
        },
    }


def wait_for(probe: Callable[[], T], what: str, timeout: float = 60.0) -> T:
    """Poll until probe() is truthy; fail with the last value seen. The timeout is a failure bound only."""
    deadline = time.monotonic() + timeout
    last: T = probe()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last seen: {last!r}")
        time.sleep(0.2)
        last = probe()
    return last


def mark_pod_ready(core: kubernetes.client.CoreV1Api, namespace: str, name: str) -> None:
    """Play kubelet: report the pod Running and Ready through the status subresource."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    core.patch_namespaced_pod_status(
        name, namespace,
        {"status": {"phase": "Running", "conditions": [
            {"type": "Ready", "status": "True", "lastTransitionTime": now},
        ]}},
    )


@contextlib.contextmanager
def using_kubeconfig(path: pathlib.Path) -> Iterator[None]:
    """Point KUBECONFIG at `path` for code in this process (kopf's login, the operator's k8s.connect).

    The `kubernetes` package reads KUBECONFIG once, when it is imported, into a module default that
    kopf's login_via_client uses; tests start their cluster later, so that default is moved too.
    """
    module = kubernetes.config.kube_config
    previous_env, previous_default = os.environ.get("KUBECONFIG"), module.KUBE_CONFIG_DEFAULT_LOCATION
    os.environ["KUBECONFIG"] = module.KUBE_CONFIG_DEFAULT_LOCATION = str(path)
    try:
        yield
    finally:
        module.KUBE_CONFIG_DEFAULT_LOCATION = previous_default
        if previous_env is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous_env
