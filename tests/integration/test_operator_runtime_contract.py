"""The operator's rank environment, read by the runtime: what builders.build_pod puts in a pod must open
the store the job asked for, and nothing else.

A pod's env is taken from the manifest the operator would create and set in this process (Secret values,
which a kubelet would resolve, get the test server's dummy credentials); then the runtime parses
SNEPPX_CHECKPOINT_URI and the AWS_* variables exactly as it does in a pod, and saves a real step: to a
real directory standing in for the PVC mount, or to the moto S3 server on 127.0.0.1.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest

from SneppX_ALG import CheckpointCoordinator, ElasticTrainer, storage
from SneppX_ALG.elastic import pod
from sneppx_operator import builders

S3_SECRET_VALUES = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


def job_spec(checkpoint_storage: dict[str, Any]) -> dict[str, Any]:
    return {
        "template": {"spec": {"containers": [{"name": "trainer", "image": "example.org/t:1"}]}},
        "elastic": {"minNodes": 1, "maxNodes": 2},
        "checkpoint": {"storage": checkpoint_storage, "maxToKeep": 2},
    }


def rank_environment(job: str, namespace: str, spec: dict[str, Any]) -> dict[str, str]:
    """The trainer container's environment as a kubelet would hand it over."""
    pod = builders.build_pod(job, namespace, "uid-1", spec, rank=0, world_size=2, generation=1)
    env = {}
    for item in pod["spec"]["containers"][0]["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "fieldRef" in item["valueFrom"]:
            downward = {"status.podIP": "127.0.0.7", "spec.nodeName": "node-a"}
            env[item["name"]] = downward[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[item["name"]] = S3_SECRET_VALUES[item["valueFrom"]["secretKeyRef"]["key"]]
    return env


def save_one_step(env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> list[int]:
    """What the in-pod agent does with the env: open the store, save a step, list what is committed."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    state = {"w": np.arange(64, dtype=np.float32)}
    with CheckpointCoordinator(
        env["SNEPPX_CHECKPOINT_URI"],
        max_to_keep=int(env["SNEPPX_MAX_TO_KEEP"]),
        staging_dir=str(tmp_path / "staging"),
    ) as coordinator:
        coordinator.save(state, step=1)
        coordinator.wait()
        return coordinator.committed_steps()


def test_pvc_job_checkpoints_land_in_the_volume_the_pod_mounts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    mount = tmp_path / "var" / "lib" / "sneppx" / "checkpoints"  # the PVC, where a kubelet would mount it
    monkeypatch.setattr(builders, "CHECKPOINT_DIR", str(mount))
    spec = job_spec({"pvc": {"claimName": "ckpt"}})
    env = rank_environment("train", "team-a", spec)
    assert env["SNEPPX_CHECKPOINT_URI"] == f"file://{mount}/team-a/train"  # the job's own directory on the claim
    pod = builders.build_pod("train", "team-a", "uid-1", spec, 0, 2, 1)
    mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts[builders.VOLUME_CHECKPOINTS] == str(mount)

    assert save_one_step(env, monkeypatch, tmp_path) == [1]
    assert (mount / "team-a" / "train" / "step-000000001" / "manifest.json").is_file()


def test_jobs_sharing_a_claim_never_see_each_others_steps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    mount = tmp_path / "claim"
    monkeypatch.setattr(builders, "CHECKPOINT_DIR", str(mount))
    spec = job_spec({"pvc": {"claimName": "shared"}})
    first, second = rank_environment("train", "team-a", spec), rank_environment("eval", "team-a", spec)
    assert save_one_step(first, monkeypatch, tmp_path) == [1]
    other = storage.open_storage(second["SNEPPX_CHECKPOINT_URI"], staging_dir=str(tmp_path))
    assert other.committed_steps() == [], "a job on the same claim sees nothing of another's steps"
    assert save_one_step(second, monkeypatch, tmp_path) == [1]
    assert sorted(p.relative_to(mount).as_posix() for p in mount.glob("*/*/step-*")) == [
        "team-a/eval/step-000000001", "team-a/train/step-000000001"]


@pytest.mark.parametrize(
    ("prefix", "expected_keys"),
    [({}, "team-a/train/step-000000001/"), ({"prefix": "runs/llm"}, "runs/llm/step-000000001/")],
    ids=["default-prefix", "explicit-prefix"],
)
def test_s3_job_checkpoints_land_under_the_jobs_prefix(
    prefix: dict[str, str],
    expected_keys: str,
    s3_bucket: str,
    s3_env: Any,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: pathlib.Path,
) -> None:
    s3 = {"bucket": s3_bucket, "endpoint": s3_env.endpoint, "region": "us-east-1", **prefix}
    env = rank_environment("train", "team-a", job_spec({"s3": {**s3, "credentialsSecretRef": {"name": "c"}}}))
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the pod's own AWS_ENDPOINT_URL must be what reaches the server
    assert save_one_step(env, monkeypatch, tmp_path) == [1]
    keys = [o["Key"] for o in s3_env.client().list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert keys and all(key.startswith(expected_keys) for key in keys), keys


def test_jobs_sharing_a_bucket_without_a_prefix_never_see_each_others_steps(
    s3_bucket: str, s3_env: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    s3 = {"bucket": s3_bucket, "endpoint": s3_env.endpoint, "credentialsSecretRef": {"name": "c"}}
    first = rank_environment("train", "team-a", job_spec({"s3": s3}))
    second = rank_environment("train", "team-b", job_spec({"s3": s3}))
    assert first["SNEPPX_CHECKPOINT_URI"] != second["SNEPPX_CHECKPOINT_URI"]
    assert save_one_step(first, monkeypatch, tmp_path) == [1]
    other = storage.open_storage(
        second["SNEPPX_CHECKPOINT_URI"], s3_client=s3_env.client(), staging_dir=str(tmp_path)
    )
    assert other.committed_steps() == []


@pytest.mark.parametrize("uri", ["file://relative/path", "file://host/var/lib/x", "file://"])
def test_a_file_uri_needs_an_absolute_path(uri: str) -> None:
    with pytest.raises(ValueError, match="absolute path"):
        storage.open_storage(uri)


def test_the_jobs_rendezvous_times_reach_the_pods_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    """elastic.rendezvousTimeoutSeconds and joinTimeoutSeconds, written by the operator, are the times the agent
    in the pod runs its rendezvous with, over what the training script passed (the job spec wins)."""
    spec = job_spec({"pvc": {"claimName": "ckpt"}})
    spec["elastic"].update(rendezvousTimeoutSeconds=900, joinTimeoutSeconds=45)
    env = {**rank_environment("train", "team-a", spec), "SNEPPX_HEARTBEAT_KEY": "00" * 32}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    in_pod = pod.PodEnvironment.from_environ(env)
    assert in_pod is not None
    trainer = ElasticTrainer(train_fn=print, checkpoint_dir="/elsewhere", join_timeout=60, last_call=5)
    config = trainer._pod_agent_settings(in_pod).rendezvous
    assert (config.join_timeout, config.last_call) == (900.0, 45.0)
    assert (config.min_nodes, config.max_nodes) == (1, 2)
    del env["SNEPPX_RENDEZVOUS_TIMEOUT_SECONDS"], env["SNEPPX_LAST_CALL_SECONDS"]  # a pod of an older operator
    older = pod.PodEnvironment.from_environ(env)
    assert older is not None
    config = trainer._pod_agent_settings(older).rendezvous
    assert (config.join_timeout, config.last_call) == (60, 5)
