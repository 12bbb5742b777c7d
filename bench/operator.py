"""Operator recovery: from a rank's process killed (or its node lost) to the job's pods replaced and Running, and
to the job training again.

    python -m bench operator                     # 10 + 5 + 2 x 5 kills, 5 takeovers, 5 on a real node
    python -m bench operator -- --kills 20 --node-losses 0 --trainings 10

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
- training: jobs that really train (tests/integration/elastic_script.py in operator mode: the reference
  Transformer, DataParallelTrainer, a checkpoint every 5 steps on the runner's shared volume; 2 pods of one worker
  each). Rank 1's pod's processes (its agent and worker) are SIGKILLed; the clock stops at the first training
  step rank 0 finishes in a later membership generation (the agents' own events, in rank 0's pod log: after the
  rendezvous and the restore from the last valid checkpoint), and again at the first step of a generation back at
  full size (the replacement pod joined). Two jobs: minNodes 1 (the survivor goes on alone, then grows back at a
  checkpoint boundary) and minNodes 2 (it must wait for the replacement pod).

- real node: the minNodes 1 training kills again on a real node (tests/node/real_node.py: kubelet, kube-proxy,
  kube-scheduler, containerd and runc, a CNI bridge), the operator installed by its Helm chart and the pods
  running the project's image; rank 1's container is SIGKILLed and the kubelet, not the stand-in, reports it.
  Needs root and the node's binaries (tests/tools/build.sh); it says why when it can't run.

- takeover: two operator replicas with leader election (the chart's timings: 15 s lease, 10 s renew deadline, 2 s
  retry). The leader is SIGKILLed together with rank 1's process; the clock stops when the other replica holds
  the Lease, and when it has replaced rank 1 (the job Running, both ranks ready). Then the leader is stopped with
  SIGTERM (a rolling update): it hands the Lease over before it exits.

Side by side: the restart figures against Kubernetes' 40 s node-monitor grace period (the time before the
control plane even notices a lost node) and 340 s (grace plus the default eviction toleration); the takeover
against its bound (lease duration + one retry period, 17 s) and kopf's peering, which freezes a successor for as
long as a dead replica's record lasts (60 s by default) instead of electing one.
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
from collections.abc import Callable
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
SCRIPT = REPO / "tests" / "integration" / "elastic_script.py"
CHECKPOINT_DIR = "/var/lib/sneppx/checkpoints"  # where the operator mounts the job's volume


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


def _training_job(name: str, min_nodes: int) -> dict[str, Any]:
    """Two pods training for as long as the bench runs; each job checkpoints to its own directory of the volume."""
    job = k8s_helpers.valid_job(name, max_nodes=2, min_nodes=min_nodes)
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["command"] = ["python", str(SCRIPT), f"{CHECKPOINT_DIR}/out", CHECKPOINT_DIR]
    # restart_delay 0: each kill is timed alike (the trainer's default, 1 s doubling per failure, would make
    # the n-th kill of one job wait 2^n s; the operator's restartDelay is 0 here too)
    knobs = {"STEPS": 10**7, "EVERY": 5, "SLEEP": 0.05, "RESTART_DELAY": 0, "MAX_RESTARTS": 1000}
    container["env"] = [{"name": f"E_{k}", "value": str(v)} for k, v in knobs.items()]
    job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 5
    job["spec"]["checkpoint"]["storage"]["pvc"]["subPath"] = name
    job["spec"]["failurePolicy"] = {"maxRestarts": 1000,
                                    "restartDelay": {"initialSeconds": 0, "multiplier": 1, "maxSeconds": 0}}
    return job


def _training_state(log: str) -> tuple[dict[int, int], list[dict[str, Any]]]:
    """Rank 0's agent's view: world size by membership generation, and its steps (the pod log's events)."""
    events = k8s_helpers.agent_events(log)
    sizes = {e["generation"]: e["world_size"] for e in events if e["kind"] == "generation"}
    return sizes, [e for e in events if e["kind"] == "step"]


def _measure_training(rank0_log: Callable[[], str], kill_rank1: Callable[[], None], job: str) -> tuple[float, float]:
    """(killed -> training again, killed -> training again at full size), in seconds."""
    def steady() -> tuple[int] | None:  # (the generation,) once 2 pods trained 10 steps in it (2 checkpoints)
        sizes, steps = _training_state(rank0_log())
        if not steps or sizes.get(steps[-1]["generation"]) != 2:
            return None
        newest = steps[-1]["generation"]
        return (newest,) if sum(s["generation"] == newest for s in steps) >= 10 else None

    (generation,) = k8s_helpers.wait_for(steady, "two pods training", 300)
    killed_at = time.time()
    kill_rank1()

    def first_step(full: bool) -> float | None:
        sizes, steps = _training_state(rank0_log())
        return next((s["t"] for s in steps if s["generation"] > generation and s["t"] > killed_at
                     and (not full or sizes.get(s["generation"]) == 2)), None)

    again = k8s_helpers.wait_for(lambda: first_step(False), "training again", 300)
    full = k8s_helpers.wait_for(lambda: first_step(True), "training again at full size", 300)
    print(f"  {job}: killed -> training {again - killed_at:.2f} s, at full size {full - killed_at:.2f} s", flush=True)
    return again - killed_at, full - killed_at


def _real_node_trainings(count: int, workdir: pathlib.Path) -> list[tuple[float, float]]:
    """The minNodes 1 kills again on a real node (tests/node/real_node.py: kubelet, containerd, runc, a CNI
    bridge), the operator installed by its chart and the pods running the project's image: rank 1's container
    is SIGKILLed (its PID 1; the kernel ends the rest of it), the kubelet reports the pod Failed, the operator
    replaces it. Needs root and the node's binaries (tests/tools/build.sh); says why when it can't run."""
    sys.path[:0] = [str(REPO / "tests" / "node"), str(REPO / "tests" / "image")]
    import container_image
    import node_jobs
    import real_node

    why = real_node.check_can_run()
    if why is not None:
        print(f"real node: not run ({why})", flush=True)
        return []
    tag = "localhost/sneppx:bench"
    (workdir / "buildah").mkdir()
    try:
        with (container_image.built_image(workdir / "buildah", tag) as image,
              real_node.running_node(k8s_cluster.build_tools(), workdir / "node") as node):
            archive = workdir / "image.tar"
            image.buildah("push", "--quiet", tag, f"docker-archive:{archive}:{tag}", timeout=600)
            node.import_image(archive)
            node_jobs.install_operator(node, tag)
            api = kubernetes.config.new_client_from_config(config_file=str(node.cluster.kubeconfig))
            namespace = k8s_helpers.create_namespace(api, "bench-real-node")
            node_jobs.checkpoint_volume(node, api, namespace)
            job = node_jobs.training_job(
                "elastic", tag, steps=10**7, every=5, sleep=0.05, restart_delay=0, max_restarts=1000,
                failure_policy={"maxRestarts": 1000, "restartDelay": {"initialSeconds": 0, "multiplier": 1,
                                                                        "maxSeconds": 0}})
            k8s_helpers.kubectl_apply(node.cluster, namespace, job, workdir)
            print("real node: the image built and imported, the chart installed, the job applied", flush=True)
            return [_measure_training(
                lambda: node_jobs.logs(node, namespace, "elastic-0"),
                lambda: os.kill(node_jobs.container_pid(node, api, namespace, "elastic-1"), signal.SIGKILL),
                "real node") for _ in range(count)]
    except container_image.Unavailable as reason:
        print(f"real node: not run ({reason})", flush=True)
        return []


def _status(custom: kubernetes.client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any]:
    job = custom.get_namespaced_custom_object(k8s_helpers.GROUP, k8s_helpers.VERSION, namespace,
                                              k8s_helpers.PLURAL, name)
    return job.get("status") or {}


def _recovered(core: Any, custom: Any, namespace: str, job: str, old_uid: str) -> bool:
    pod = k8s_helpers.read_or_none(core.read_namespaced_pod, f"{job}-1", namespace)
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


LEASE_S, RETRY_S, KOPF_PEERING_S = 15.0, 2.0, 60.0


def _operator(namespace: str, name: str, kubeconfig: pathlib.Path, log: pathlib.Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, KUBECONFIG=str(kubeconfig), POD_NAME=name)
    env.pop("SNEPPX_RESYNC_SECONDS", None)
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "sneppx_operator", "--namespace", namespace, "--quiet",
                                 "--leader-elect", "--leader-election-namespace", namespace,
                                 "--leader-election-id", "bench"], env=env, stdout=out, stderr=subprocess.STDOUT)


def _holder(api: Any, namespace: str) -> str:
    lease = k8s_helpers.read_or_none(kubernetes.client.CoordinationV1Api(api).read_namespaced_lease, "bench",
                                     namespace)
    return (lease.spec.holder_identity or "").split("_")[0] if lease is not None else ""


def _takeovers(runner: pod_runner.PodRunner, api: Any, namespace: str, kubeconfig: pathlib.Path,
               workdir: pathlib.Path, rounds: int) -> tuple[list[float], list[float], list[float]]:
    """(SIGKILL -> the other replica holds the Lease, SIGKILL -> rank 1 replaced by it, SIGTERM -> handed over)."""
    core, custom = kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api)
    replicas = {name: _operator(namespace, name, kubeconfig, workdir / f"{name}.log") for name in ("a", "b")}
    leases, recoveries, handovers = [], [], []
    try:
        for _ in range(rounds):
            for name, proc in replicas.items():  # the one killed last round comes back as a follower
                if proc.poll() is not None:
                    replicas[name] = _operator(namespace, name, kubeconfig, workdir / f"{name}.log")
            leader = k8s_helpers.wait_for(lambda: _holder(api, namespace), "a leader", 120)
            follower = "b" if leader == "a" else "a"
            k8s_helpers.wait_for(lambda: _recovered(core, custom, namespace, "ha", ""), "the job Running", 120)
            old_uid = core.read_namespaced_pod("ha-1", namespace).metadata.uid
            time.sleep(2 * RETRY_S)  # the follower has seen the Lease renewed since it started
            started = time.monotonic()
            replicas[leader].kill()
            runner.kill("ha-1", signal.SIGKILL)
            k8s_helpers.wait_for(lambda follower=follower: _holder(api, namespace) == follower, "the takeover", 120)
            leases.append(time.monotonic() - started)
            k8s_helpers.wait_for(lambda old_uid=old_uid: _recovered(core, custom, namespace, "ha", old_uid),
                                 "the replacement", 120)
            recoveries.append(time.monotonic() - started)
            replicas[leader].wait()
            replicas[leader] = _operator(namespace, leader, kubeconfig, workdir / f"{leader}.log")
            time.sleep(2 * RETRY_S)
            started = time.monotonic()
            replicas[follower].terminate()  # now the leader: a rolling update stops it
            k8s_helpers.wait_for(lambda leader=leader: _holder(api, namespace) == leader, "the handover", 120)
            handovers.append(time.monotonic() - started)
            replicas[follower].wait()
            print(f"  takeover {leases[-1]:.1f} s, rank replaced {recoveries[-1]:.1f} s, handover "
                  f"{handovers[-1]:.1f} s", flush=True)
    finally:
        for proc in replicas.values():
            k8s_cluster.stop_process(proc)
    return leases, recoveries, handovers


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
    parser.add_argument("--trainings", type=int, default=5, help="kills of a training job, for each of two jobs")
    parser.add_argument("--takeovers", type=int, default=5, help="leaders SIGKILLed (two replicas, leader election)")
    parser.add_argument("--real-node-trainings", type=int, default=5,
                        help="kills of a training job on a real node (kubelet, containerd; needs root)")
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
            for name in ("kill", "node"):  # their pods stop: the training jobs get the machine
                custom.delete_namespaced_custom_object(k8s_helpers.GROUP, k8s_helpers.VERSION, namespace,
                                                       k8s_helpers.PLURAL, name)
            trained: dict[str, list[tuple[float, float]]] = {}
            for name, min_nodes in (("elastic", 1), ("fixed", 2)):
                if args.trainings:
                    custom.create_namespaced_custom_object(k8s_helpers.GROUP, k8s_helpers.VERSION, namespace,
                                                           k8s_helpers.PLURAL, _training_job(name, min_nodes))
                    trained[name] = [_measure_training(lambda n=name: runner.log_of(f"{n}-0"),
                                                       lambda n=name: runner.kill(f"{n}-1", signal.SIGKILL), name)
                                     for _ in range(args.trainings)]
                    custom.delete_namespaced_custom_object(k8s_helpers.GROUP, k8s_helpers.VERSION, namespace,
                                                           k8s_helpers.PLURAL, name)
            takeover: tuple[list[float], list[float], list[float]] = ([], [], [])
            if args.takeovers:
                k8s_cluster.stop_process(operator)  # two elected replicas from here on
                custom.create_namespaced_custom_object(k8s_helpers.GROUP, k8s_helpers.VERSION, namespace,
                                                       k8s_helpers.PLURAL, _job("ha", 300))
                takeover = _takeovers(runner, api, namespace, cluster.kubeconfig, workdir, args.takeovers)
        print("what is timed: the event -> the job Running again with a new pod for the rank, both ranks ready")
        _summary("SIGKILL -> replaced and Running", kills)
        _summary("node NotReady -> replaced, Running", losses)
        if trained:
            print("what is timed: SIGKILL of rank 1's processes -> rank 0's first training step in a later generation")
            _summary("minNodes 1: killed -> training", [a for a, _ in trained["elastic"]])
            _summary("minNodes 1: killed -> full size", [f for _, f in trained["elastic"]])
            _summary("minNodes 2: killed -> training", [a for a, _ in trained["fixed"]])
        print(f"Kubernetes alone: a lost node is noticed after {NODE_MONITOR_GRACE_S:.0f} s and its pods evicted "
              f"after {NODE_MONITOR_GRACE_S + DEFAULT_EVICTION_S:.0f} s; one stuck Terminating stays until someone "
              "force-deletes it.", flush=True)
        for label, times in zip(("leader SIGKILLed -> Lease taken", "leader SIGKILLed -> rank replaced",
                                 "leader SIGTERMed -> handed over"), takeover):
            if times:
                ordered = sorted(times)
                median = statistics.median(ordered)
                print(f"{label:<34} n={len(times):<3} median {median:6.2f} s   max {ordered[-1]:6.2f} s   bound "
                      f"(lease + retry) {LEASE_S + RETRY_S:.0f} s   kopf peering freeze / median "
                      f"{KOPF_PEERING_S / median:5.1f}x", flush=True)
    finally:
        if operator is not None:
            k8s_cluster.stop_process(operator)
        cluster.stop()
    if args.real_node_trainings:  # after the test cluster: the real node listens elsewhere, but shares the CPUs
        real = _real_node_trainings(args.real_node_trainings, workdir)
        print("what is timed: SIGKILL of rank 1's container on a real node -> rank 0's first step in a later "
              "generation", flush=True)
        _summary("real kubelet: killed -> training", [a for a, _ in real])
        _summary("real kubelet: killed -> full size", [f for _, f in real])


if __name__ == "__main__":
    main(sys.argv[1:])
