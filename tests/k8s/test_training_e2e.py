"""Training that really runs under the real API server: an ElasticTrainingJob applied with kubectl, whose pods run
recipe 3's script (tests/integration/elastic_script.py: the reference Transformer, DataParallelTrainer, sharded
checkpoints) in operator mode, each pod's agent rendezvousing through the job's ConfigMap as the job's
ServiceAccount. Failures are real signals to real processes (tests/k8s/pod_runner.py plays kubelet); the checkpoints
are in the runner's shared "PVC" directory.

Every job must end at the parameters of the same training run uninterrupted in one process: a restore that lost or
repeated a step, or restored the wrong data position, would not. No timing is asserted.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import time
from typing import Any

import k8s_cluster
import k8s_helpers
import kopf.testing
import kubernetes
import pod_runner
import pytest
from k8s_helpers import wait_status

from SneppX_ALG.contract import job_object
from sneppx_operator import builders

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "integration"))
from elastic_script import assert_params_match

pytestmark = pytest.mark.k8s

SCRIPT = str(pathlib.Path(__file__).parents[1] / "integration" / "elastic_script.py")
EVERY = 3  # checkpoint interval (steps)
STEPS = 90  # enough that the job is still training when each test's failure or resize has taken effect
FINISH_TIMEOUT = 300.0  # a failure bound only: four processes train on a loaded 2-core machine


def training_job(name: str, *, steps: int, **settings: Any) -> dict[str, Any]:
    """A job whose pods run elastic_script.py: rank 0 writes its progress and final parameters to `out/` on the
    job's volume (`output(pods)` here)."""
    command = ["python", SCRIPT, f"{builders.CHECKPOINT_DIR}/out", builders.CHECKPOINT_DIR]
    return k8s_helpers.script_job(name, command, steps=steps, every=EVERY, **settings)


def output(pods: pod_runner.PodRunner) -> pathlib.Path:
    """Where the pods' `<volume>/out` is on this machine (rank 0's script makes it)."""
    return pods.checkpoints / "out"


def progress(out: pathlib.Path) -> dict[str, Any]:
    try:
        return json.loads((out / "progress.json").read_text())  # type: ignore[no-any-return]
    except (FileNotFoundError, ValueError):
        return {"step": 0, "generation": -1, "world_size": 0}


def agent_events(pods: pod_runner.PodRunner, pod: str) -> list[dict[str, Any]]:
    return k8s_helpers.agent_events(pods.log_of(pod))


def wait_finished(api: kubernetes.client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return wait_status(api, namespace, name, "the job Succeeded or Failed",
                       lambda s: s.get("phase") in ("Succeeded", "Failed"), FINISH_TIMEOUT)


@pytest.mark.parametrize("min_nodes", [1, 2])
def test_a_sigkilled_rank_is_replaced_and_training_resumes_from_the_last_valid_checkpoint(
    api: kubernetes.client.ApiClient, cluster: k8s_cluster.Cluster, namespace: str,
    operator: kopf.testing.KopfRunner, pods: pod_runner.PodRunner, tmp_path: pathlib.Path, min_nodes: int,
) -> None:
    out, steps = output(pods), STEPS
    # The replacement waits 3 s: the survivor settles in under 2 heartbeat timeouts (1.6 s), so with min_nodes 1 it
    # goes on alone first. With no delay a quick replacement (same agent id) may join that generation: also right.
    delay = {"restartDelay": {"initialSeconds": 3, "multiplier": 1, "maxSeconds": 3}}
    job = training_job("train", steps=steps, min_nodes=min_nodes, failure_policy=delay)
    k8s_helpers.kubectl_apply(cluster, namespace, job, tmp_path)
    k8s_helpers.wait_for(lambda: progress(out)["step"] >= 3 * EVERY and progress(out)["world_size"] == 2,
                         "two pods training together past a few checkpoints", FINISH_TIMEOUT)
    pods.kill("train-1", signal.SIGKILL)  # the agent and its worker: the whole rank

    done = wait_finished(api, namespace, "train")
    logs = {pod: pods.log_of(pod)[-4000:] for pod in ("train-0", "train-1")}
    assert done["phase"] == "Succeeded", (done, logs)
    assert done["restartCount"] == 1
    assert [(h["reason"], h["rank"], h["exitCode"]) for h in done["restartHistory"]] == [("PodFailed", 1, 137)]
    assert done["lastValidCheckpoint"]["step"] == steps  # the final save, reported by rank 0's agent
    assert done["lastValidCheckpoint"]["location"].endswith(f"/step-{steps:09d}")

    survivor = agent_events(pods, "train-0")
    failure = next(e for e in survivor if e["kind"] == "failure")
    before = max(e["step"] for e in survivor if e["kind"] == "step" and e["t"] <= failure["t"])
    resumed = next(e for e in survivor if e["kind"] == "restored" and e["t"] > failure["t"])
    assert resumed["step"] is not None and before - resumed["step"] <= 2 * EVERY, (before, resumed)
    sizes = [e["world_size"] for e in survivor if e["kind"] == "generation"]
    if min_nodes == 1:  # the survivor went on alone (and grew back if the replacement joined before the end)
        assert sizes[0] == 2 and sizes[1] == 1, sizes
    else:  # it waited for the replacement
        assert set(sizes) == {2} and len(sizes) >= 2, sizes
        assert json.loads((out / "final.json").read_text())["world_size"] == 2
    exits = [e["code"] for e in agent_events(pods, "train-1") if e["kind"] == "exit"]
    assert exits == [0], logs["train-1"]  # the killed agent left no exit; its replacement's run completed

    table = cluster.kubectl("get", "etj", "train", "-n", namespace).stdout
    header, row = (line.split() for line in table.strip().splitlines())
    assert header[:5] == ["NAME", "PHASE", "READY", "RESTARTS", "LAST-VALID-STEP"]
    assert (row[0], row[1], row[3], row[4]) == ("train", "Succeeded", "1", str(steps)), table
    assert_params_match(out, steps)


def test_with_peer_memory_snapshots_a_sigkilled_rank_costs_no_steps_and_resumed_from_says_memory(
    api: kubernetes.client.ApiClient, cluster: k8s_cluster.Cluster, namespace: str,
    operator: kopf.testing.KopfRunner, pods: pod_runner.PodRunner, tmp_path: pathlib.Path,
) -> None:
    out, steps = output(pods), STEPS
    job = training_job("snap", steps=steps, min_nodes=1)
    job["spec"]["checkpoint"]["snapshotEveryNSteps"] = 1  # the job spec turns them on; the script is unchanged
    k8s_helpers.kubectl_apply(cluster, namespace, job, tmp_path)
    k8s_helpers.wait_for(lambda: progress(out)["step"] >= 3 * EVERY + 1 and progress(out)["world_size"] == 2,
                         "two pods training together past a checkpoint", FINISH_TIMEOUT)
    pods.kill("snap-1", signal.SIGKILL)
    resumed_from = wait_status(api, namespace, "snap", "resumedFrom in memory",
                               lambda s: s.get("resumedFrom", {}).get("location") == "memory", FINISH_TIMEOUT)
    resumed_from = resumed_from["resumedFrom"]

    done = wait_finished(api, namespace, "snap")
    assert done["phase"] == "Succeeded", (done, {p: pods.log_of(p)[-3000:] for p in ("snap-0", "snap-1")})
    survivor = agent_events(pods, "snap-0")
    failure = next(e for e in survivor if e["kind"] == "failure")
    before = max(e["step"] for e in survivor if e["kind"] == "step" and e["t"] <= failure["t"])
    restored = next(e for e in survivor if e["kind"] == "restored" and e["t"] > failure["t"])
    assert restored["source"] == "memory" and before - restored["step"] <= 1, (before, restored)
    assert resumed_from["step"] >= restored["step"]
    assert_params_match(out, steps)


def test_max_nodes_raised_at_run_time_grows_the_world_at_the_next_generation(
    api: kubernetes.client.ApiClient, cluster: k8s_cluster.Cluster, namespace: str,
    operator: kopf.testing.KopfRunner, pods: pod_runner.PodRunner, tmp_path: pathlib.Path,
) -> None:
    out, steps = output(pods), STEPS
    k8s_helpers.kubectl_apply(cluster, namespace, training_job("grow", steps=steps, max_nodes=2), tmp_path)
    k8s_helpers.wait_for(lambda: progress(out)["step"] >= 2 * EVERY and progress(out)["world_size"] == 2,
                         "two pods training together", FINISH_TIMEOUT)
    cluster.kubectl("patch", "etj", "grow", "-n", namespace, "--type=merge", "-p",
                    json.dumps({"spec": {"elastic": {"maxNodes": 3}}}))
    grown = k8s_helpers.wait_for(lambda: progress(out)["world_size"] == 3 and progress(out),
                                 "three pods training together", FINISH_TIMEOUT)
    done = wait_finished(api, namespace, "grow")
    assert done["phase"] == "Succeeded", (done, {p: pods.log_of(p)[-3000:] for p in ("grow-0", "grow-1", "grow-2")})
    assert done.get("restartCount", 0) == 0, "a resize is not a restart"
    ended = [e for e in agent_events(pods, "grow-0") if e["kind"] == "exit"]
    # the old pod went at the resize (its agent used to train on when the SIGTERM landed in a ConfigMap call)
    assert ended[0]["code"] == 143 and "SIGTERM" in ended[0]["reason"], (ended, pods.log_of("grow-0")[-4000:])
    assert done["rendezvous"]["worldSize"] == 3 and done["rendezvous"]["generation"] >= grown["generation"]
    assert json.loads((out / "final.json").read_text())["world_size"] == 3
    assert_params_match(out, steps)


def test_quorum_lost_with_pause_stops_training_until_the_node_returns(
    api: kubernetes.client.ApiClient, cluster: k8s_cluster.Cluster, namespace: str,
    operator: kopf.testing.KopfRunner, pods: pod_runner.PodRunner, tmp_path: pathlib.Path,
) -> None:
    out, steps = output(pods), STEPS
    # minNodes 1 would let the survivor train on alone: the job asks for every node (minHealthyPercent 100), and
    # quorum.actionOnLoss defaults to Pause; the lost node's pod stays Terminating until the node returns
    job = training_job("pause", steps=steps, failure_policy={"terminatingPodTimeoutSeconds": 3600})
    job["spec"]["quorum"] = {"minHealthyPercent": 100}
    k8s_helpers.kubectl_apply(cluster, namespace, job, tmp_path)
    k8s_helpers.wait_for(lambda: progress(out)["step"] >= 2 * EVERY and progress(out)["world_size"] == 2,
                         "two pods training together", FINISH_TIMEOUT)
    lost = k8s_helpers.running_pods(api, namespace, "pause")[1]
    pods.set_node_ready(lost.spec.node_name, False)  # its processes die with it
    wait_status(api, namespace, "pause", "phase Paused", lambda s: s.get("phase") == "Paused")
    k8s_helpers.wait_for(lambda: any(e["kind"] == "paused" for e in agent_events(pods, "pause-0")),
                         "the survivor's agent to pause its worker", FINISH_TIMEOUT)
    time.sleep(3)  # paused for a while: unpaused, the survivor would train some 20 steps meanwhile
    paused_at_step = progress(out)["step"]
    pods.set_node_ready(lost.spec.node_name, True)  # its kubelet finishes the deletion; a replacement comes

    done = wait_finished(api, namespace, "pause")
    assert done["phase"] == "Succeeded", (done, {p: pods.log_of(p)[-3000:] for p in ("pause-0", "pause-1")})
    survivor = agent_events(pods, "pause-0")
    paused = next(e for e in survivor if e["kind"] == "paused")
    resumed = next(e for e in survivor if e["kind"] == "resumed")
    assert paused["t"] < resumed["t"]
    during = [e for e in survivor if e["kind"] == "step" and paused["t"] < e["t"] < resumed["t"]]
    # The step in flight, and progress the worker sent before the pause reached it that the agent records after its
    # paused event (it writes that event, then drains its workers' messages; the control record's GET between
    # them takes a step or two under load: 2 seen here). Unpaused, the survivor trains some 20 steps in those 3 s.
    assert len(during) <= 3, during
    assert paused_at_step < steps and done["restartCount"] == 1
    assert_params_match(out, steps)


def process_group(pgid: int) -> dict[int, str]:
    """The processes of a process group (a pod's: its agent and the agent's workers) and their states (R, S, T...)."""
    found = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid:
            found[int(entry.name)] = fields[0]
    return found


def wedge_rank_1(api: kubernetes.client.ApiClient, namespace: str, pods: pod_runner.PodRunner,
                 name: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """SIGSTOPs the whole pod of the job's rank 1 (its agent and its worker) once both pods train together, so
    that it stays Running and Ready and nothing but an agent's `job/hung/<pod>` report can get it replaced; waits
    for rank 0's agent to report it (or to exit: then the returned reports are empty) and for the job's end.
    Returns (the survivor's `hung_reported` events, the job's final status)."""
    out, wedged, survivor = output(pods), f"{name}-1", f"{name}-0"
    k8s_helpers.wait_for(lambda: progress(out)["step"] >= 3 * EVERY and progress(out)["world_size"] == 2,
                         "two pods training together past a few checkpoints", FINISH_TIMEOUT)
    stopped = pods.pid(wedged)
    assert stopped is not None
    try:
        assert len(process_group(stopped)) >= 2, process_group(stopped)  # the agent and its worker
        pods.kill(wedged, signal.SIGSTOP)  # wedged: alive, Running and Ready, doing nothing
        k8s_helpers.wait_for(lambda: set(process_group(stopped).values()) == {"T"}, "the whole pod stopped")
        assert [p.metadata.name for p in k8s_helpers.running_pods(api, namespace, name)] == [survivor, wedged]

        seen = k8s_helpers.wait_for(  # (or the survivor to finish training without it, or give up: no report)
            lambda: [e for e in agent_events(pods, survivor) if e["kind"] in ("hung_reported", "exit")],
            f"the survivor's agent to report {wedged} hung", FINISH_TIMEOUT)
        reported = [e for e in seen if e["kind"] == "hung_reported"]
        assert reported, (seen, pods.log_of(survivor)[-4000:])
        return reported, wait_finished(api, namespace, name)
    finally:
        if pods.pid(wedged) == stopped:  # the test failed before the operator replaced it
            for sig in (signal.SIGKILL, signal.SIGCONT):
                os.killpg(stopped, sig)


def wedged_and_replaced_once(api: kubernetes.client.ApiClient, namespace: str, pods: pod_runner.PodRunner,
                             job: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """`wedge_rank_1`, then what both wedged-rank tests require of the job: Succeeded after exactly one counted
    Hang restart of rank 1. Returns the hang reports and the two pods' log tails."""
    reported, done = wedge_rank_1(api, namespace, pods, job)
    logs = {pod: pods.log_of(pod)[-4000:] for pod in (f"{job}-0", f"{job}-1")}
    assert done["phase"] == "Succeeded", (done, logs)
    assert [(h["reason"], h["rank"]) for h in done["restartHistory"]] == [("Hang", 1)], (done["restartHistory"], logs)
    assert done["restartCount"] == 1
    return reported, logs


def test_a_rank_whose_agent_is_wedged_is_reported_hung_by_the_other_agent_and_replaced(
    api: kubernetes.client.ApiClient, cluster: k8s_cluster.Cluster, namespace: str,
    operator: kopf.testing.KopfRunner, pods: pod_runner.PodRunner, tmp_path: pathlib.Path,
) -> None:
    """The real agents, no stand-in: rank 1's whole pod is SIGSTOPped (`wedge_rank_1`). The survivor trains on
    alone, reports it once it has been out of the generations for hangTimeoutSeconds, the operator replaces the
    pod (restart reason Hang), and the replacement joins and training finishes at full size."""
    # Slower steps, not more of them (float noise grows with the steps): the survivor must still be training when
    # the replacement joins, some hangTimeoutSeconds and a pod start after the stop.
    out, steps, hang = output(pods), 120, 10
    job = training_job("hung", steps=steps, sleep=0.3, failure_policy={"hangTimeoutSeconds": hang})
    job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 1  # a stopped agent never ends at SIGTERM
    k8s_helpers.kubectl_apply(cluster, namespace, job, tmp_path)
    reported, logs = wedged_and_replaced_once(api, namespace, pods, "hung")

    survivor = agent_events(pods, "hung-0")
    first = reported[0]
    assert (first["pod"], first["rank"]) == ("hung-1", 1), reported
    assert first["silent_seconds"] >= hang
    assert any("hung-1" in e["reason"] for e in survivor if e["kind"] == "failure")  # silent on the heartbeat
    sizes = [(e["generation"], e["world_size"]) for e in survivor if e["kind"] == "generation"]
    alone = next(g for g, size in sizes if size == 1)
    assert first["last_generation"] < alone <= first["generation"], (sizes, first)  # it reported while alone
    assert sizes[0][1] == 2 and sizes[-1][1] == 2, sizes  # and grew back when the replacement joined
    assert all(e["pod"] == "hung-1" for e in survivor if e["kind"] == "hung_reported")
    assert json.loads((out / "final.json").read_text())["world_size"] == 2
    exits = [e["code"] for e in agent_events(pods, "hung-1") if e["kind"] == "exit"]
    assert exits == [0], logs["hung-1"]  # the stopped agent left no exit (SIGKILLed); its replacement completed
    data = kubernetes.client.CoreV1Api(api).read_namespaced_config_map(
        job_object.object_name("hung"), namespace).data or {}
    assert not [k for k in data if (job_object.record_key(k) or "").startswith(job_object.HUNG_PREFIX)], data
    assert_params_match(out, steps)


def test_a_wedged_rank_that_no_generation_can_form_without_is_reported_while_forming_and_replaced_once(
    api: kubernetes.client.ApiClient, cluster: k8s_cluster.Cluster, namespace: str,
    operator: kopf.testing.KopfRunner, pods: pod_runner.PodRunner, tmp_path: pathlib.Path,
) -> None:
    """Issue 38, defect 10: minNodes = maxNodes = 2 and rank 1's whole pod SIGSTOPped. No generation can form
    without it, so no generation runs and no rank 0 of one could report it; the survivor, sealing the next
    generation alone, reports it after the hang timeout capped at half rendezvousTimeoutSeconds, well before its
    own join timeout. The operator replaces that one pod (one counted Hang restart), the replacement joins, and
    the job succeeds at full size, the survivor never having given up."""
    out, steps, hang, rendezvous_timeout = output(pods), 120, 10, 120
    job = training_job("stall", steps=steps, sleep=0.3, min_nodes=2, failure_policy={"hangTimeoutSeconds": hang})
    job["spec"]["elastic"]["rendezvousTimeoutSeconds"] = rendezvous_timeout
    job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 1  # a stopped agent never ends at SIGTERM
    k8s_helpers.kubectl_apply(cluster, namespace, job, tmp_path)
    reported, logs = wedged_and_replaced_once(api, namespace, pods, "stall")

    first = reported[0]
    assert (first["pod"], first["rank"], first.get("forming")) == ("stall-1", 1, True), reported
    assert first["generation"] == first["last_generation"] + 1  # reported while the next one formed
    assert first["silent_seconds"] >= min(hang, rendezvous_timeout / 2)
    survivor = agent_events(pods, "stall-0")
    assert [e["code"] for e in survivor if e["kind"] == "exit"] == [0], logs["stall-0"]  # it never timed out
    sizes = [e["world_size"] for e in survivor if e["kind"] == "generation"]
    assert len(sizes) >= 2 and set(sizes) == {2}, sizes  # never alone: it waited for the replacement
    assert json.loads((out / "final.json").read_text())["world_size"] == 2
    exits = [e["code"] for e in agent_events(pods, "stall-1") if e["kind"] == "exit"]
    assert exits == [0], logs["stall-1"]  # the stopped agent left no exit (SIGKILLed); its replacement completed
    data = kubernetes.client.CoreV1Api(api).read_namespaced_config_map(
        job_object.object_name("stall"), namespace).data or {}
    assert not [k for k in data if (job_object.record_key(k) or "").startswith(job_object.HUNG_PREFIX)], data
    assert_params_match(out, steps)
