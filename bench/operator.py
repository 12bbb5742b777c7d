"""Operator recovery: from a rank's process killed (or its node lost) to the job's pods replaced and Running.

    python -m bench operator                     # 10 kills and 5 node losses, about 2 minutes
    python -m bench operator -- --kills 20 --node-losses 0

On the test cluster of tests/k8s (a real kube-apiserver and etcd on 127.0.0.1) with the operator as a real
process (`python -m sneppx_operator`, default resync of 10 s: it reacts to watch events, not to the resync) and
the kubelet stand-in of tests/k8s/pod_runner.py running each rank as a local process:

- kill: rank 1's process is SIGKILLed; the clock stops when the job's status says Running with every rank
  ready again and a replacement pod (a new uid) for rank 1 is Running. That is the operator's share of "killed
  to training again": the agents' re-rendezvous and the resume from the checkpoint come on top (issue 14,
  part 2).
- node: rank 1's node is marked NotReady (its process dies with it, its pod can't finish terminating) with
  failurePolicy.terminatingPodTimeoutSeconds 0; the clock runs from the NotReady mark to the replacement
  Running. Kubernetes itself needs the node-monitor grace period (40 s) to mark the node NotReady at all, and
  then evicts its pods after the default 300 s toleration, and a pod stuck Terminating on a dead node is never
  removed without a force delete: those are the figures compared.

Side by side: the restart figures against Kubernetes' 40 s node-monitor grace period (the time before the
control plane even notices a lost node) and 340 s (grace plus the default eviction toleration).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "k8s"))

import k8s_cluster
import k8s_helpers
import kubernetes
import pod_runner

from bench import common

NODE_MONITOR_GRACE_S = 40.0
DEFAULT_EVICTION_S = 300.0
STANDIN = REPO / "tests" / "k8s" / "rank_standin.py"


def _job(name: str, terminating_timeout: int) -> dict[str, Any]:
    job = k8s_helpers.valid_job(name, max_nodes=2, min_nodes=1)
    job["spec"]["template"]["spec"]["containers"][0]["command"] = ["python", str(STANDIN)]
    job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 5
    job["spec"]["failurePolicy"] = {
        "maxRestarts": 1000,
        "restartDelay": {"initialSeconds": 0, "multiplier": 1, "maxSeconds": 0},
        "terminatingPodTimeoutSeconds": terminating_timeout,
    }
    return job


def _status(custom: kubernetes.client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any]:
    job = custom.get_namespaced_custom_object(k8s_helpers.GROUP, k8s_helpers.VERSION, namespace,
                                              k8s_helpers.PLURAL, name)
    return job.get("status") or {}


def _rank_pod(core: kubernetes.client.CoreV1Api, namespace: str, name: str) -> Any:
    try:
        return core.read_namespaced_pod(name, namespace)
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _recovered(core: Any, custom: Any, namespace: str, job: str, old_uid: str) -> bool:
    pod = _rank_pod(core, namespace, f"{job}-1")
    if pod is None or pod.metadata.uid == old_uid or pod.status.phase != "Running":
        return False
    status = _status(custom, namespace, job)
    return status.get("phase") == "Running" and status.get("readyNodes") == 2


def _measure(runner: pod_runner.PodRunner, api: Any, namespace: str, job: str, lose_node: bool) -> float:
    core, custom = kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api)
    k8s_helpers.wait_for(lambda: _recovered(core, custom, namespace, job, ""), "the job Running", 120)
    pod = core.read_namespaced_pod(f"{job}-1", namespace)
    node = pod.spec.node_name
    started = time.monotonic()
    if lose_node:
        runner.set_node_ready(node, False)
    else:
        runner.kill(f"{job}-1", signal.SIGKILL)
    k8s_helpers.wait_for(lambda: _recovered(core, custom, namespace, job, pod.metadata.uid), "the replacement", 120)
    took = time.monotonic() - started
    if lose_node:
        runner.set_node_ready(node, True)
    return took


def _summary(label: str, times: list[float]) -> None:
    if not times:
        return
    ordered = sorted(times)
    median, worst = statistics.median(ordered), ordered[-1]
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    print(f"{label:<34} n={len(times):<3} median {median:6.2f} s   p90 {p90:6.2f} s   max {worst:6.2f} s   "
          f"40 s grace / median {NODE_MONITOR_GRACE_S / median:5.1f}x   340 s / median "
          f"{(NODE_MONITOR_GRACE_S + DEFAULT_EVICTION_S) / median:6.1f}x", flush=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench operator")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--node-losses", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"machine: {common.cpu_model()}, {os.cpu_count()} CPUs; test cluster on 127.0.0.1", flush=True)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="sneppx-bench-operator-"))
    cluster = k8s_cluster.start_cluster(k8s_cluster.build_tools(), workdir / "k8s")
    operator: subprocess.Popen[bytes] | None = None
    try:
        api = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
        namespace = k8s_helpers.create_namespace(api, "bench-operator")
        env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig))
        env.pop("SNEPPX_RESYNC_SECONDS", None)  # the default (10 s): recovery must not hang on the resync
        with (workdir / "operator.log").open("wb") as log:
            operator = subprocess.Popen([sys.executable, "-m", "sneppx_operator", "--namespace", namespace,
                                         "--quiet"], env=env, stdout=log, stderr=subprocess.STDOUT)
        custom = kubernetes.client.CustomObjectsApi(api)
        nodes = ("bench-node-a", "bench-node-b", "bench-node-c")
        with pod_runner.PodRunner(api, cluster.server, cluster.ca.cert_pem, namespace, workdir, nodes) as runner:
            for name, timeout in (("kill", 300), ("node", 0)):
                custom.create_namespaced_custom_object(k8s_helpers.GROUP, k8s_helpers.VERSION, namespace,
                                                       k8s_helpers.PLURAL, _job(name, timeout))
            kills = [_measure(runner, api, namespace, "kill", False) for _ in range(args.kills)]
            losses = [_measure(runner, api, namespace, "node", True) for _ in range(args.node_losses)]
        print("what is timed: the event -> the job Running again with a new pod for the rank, both ranks ready")
        _summary("SIGKILL -> replaced and Running", kills)
        _summary("node NotReady -> replaced, Running", losses)
        print(f"Kubernetes alone: a lost node is noticed after {NODE_MONITOR_GRACE_S:.0f} s and its pods evicted "
              f"after {NODE_MONITOR_GRACE_S + DEFAULT_EVICTION_S:.0f} s; one stuck Terminating stays until someone "
              "force-deletes it.", flush=True)
    finally:
        if operator is not None:
            k8s_cluster.stop_process(operator)
        cluster.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
