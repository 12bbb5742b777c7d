"""`python -m sneppx_operator` as a real process against the real API server, stopped with a real SIGTERM.

Kept apart from test_operator.py so the in-process operator there is gone and only this one acts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request

import k8s_cluster
import k8s_helpers
import kubernetes
import pytest

pytestmark = pytest.mark.k8s


def test_python_m_sneppx_operator_reconciles_hands_its_lease_over_on_sigterm_and_leaves_no_finalizer(
    cluster: k8s_cluster.Cluster, api: kubernetes.client.ApiClient, namespace: str
) -> None:
    env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig), SNEPPX_RESYNC_SECONDS="1")
    log = cluster.workdir / f"operator-{namespace}.log"
    metrics_port = k8s_cluster.free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sneppx_operator", "--namespace", namespace,
             "--metrics", f"127.0.0.1:{metrics_port}", "--leader-elect", "--leader-election-namespace", namespace],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
            k8s_helpers.GROUP,
            k8s_helpers.VERSION,
            namespace,
            k8s_helpers.PLURAL,
            k8s_helpers.valid_job("cli", max_nodes=2),
        )
        core = kubernetes.client.CoreV1Api(api)
        k8s_helpers.wait_for(
            lambda: len(core.list_namespaced_pod(namespace, label_selector="sneppx.io/job=cli").items) == 2,
            "pods from the operator process",
        )
        gauge = f'sneppx_job_world_size{{job="cli",namespace="{namespace}"}} 2.0'
        k8s_helpers.wait_for(
            lambda: gauge in urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode(),
            "the job's gauges on /metrics",
        )
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert "sneppx_operator_leader 1.0" in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
    finally:
        k8s_cluster.stop_process(proc)
    output = log.read_text()
    assert "Traceback" not in output, output[-4000:]
    job = kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object(
        k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL, "cli"
    )
    assert not job["metadata"].get("finalizers") and not job["metadata"].get("annotations"), (
        "the operator writes nothing on the job's metadata"
    )
    lease = kubernetes.client.CoordinationV1Api(api).read_namespaced_lease("sneppx-operator", namespace)
    assert lease.spec.holder_identity == "", "a stopping leader hands its Lease over"
    # No operator runs now: deleting the job must not wait for one, and the garbage collector takes its pods.
    kubernetes.client.CustomObjectsApi(api).delete_namespaced_custom_object(
        k8s_helpers.GROUP, k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL, "cli"
    )
    k8s_helpers.wait_for(lambda: not k8s_helpers.exists(
        kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object, k8s_helpers.GROUP,
        k8s_helpers.VERSION, namespace, k8s_helpers.PLURAL, "cli"), "the job deleted with no operator running", 10)
    k8s_helpers.wait_for(
        lambda: not core.list_namespaced_pod(namespace, label_selector="sneppx.io/job=cli").items, "its pods collected"
    )
