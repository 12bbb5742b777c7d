"""The ElasticTrainer's small parts: the agent-worker control channel under bad input, the process-group address
store over compare-and-swap records, and run()'s refusals. The whole trainer runs in
tests/integration/test_elastic_trainer.py."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from SneppX_ALG import CheckpointCoordinator, ElasticTrainer, errors
from SneppX_ALG.collectives.store import RecordKeyStore
from SneppX_ALG.contract import job_object
from SneppX_ALG.contract.env import ENV_OBJECT, ENV_ROLE
from SneppX_ALG.elastic import control, pod, rendezvous
from SneppX_ALG.elastic.agent import AgentSettings, NodeAgent
from SneppX_ALG.records import kube, open_record_store


def pair() -> tuple[control.Channel, socket.socket]:
    mine, theirs = socket.socketpair()
    return control.Channel(mine), theirs


def test_messages_arrive_whole_however_the_bytes_are_split() -> None:
    channel, other = pair()
    other.sendall(b'{"kind": "beat"}\n{"kind": "progress", "st')
    assert channel.receive(1.0) == [{"kind": "beat"}]
    other.sendall(b'ep": 3}\n')
    assert channel.receive(1.0) == [{"kind": "progress", "step": 3}]
    assert channel.receive(0) == []  # nothing waiting: no block


def test_a_channel_whose_other_end_is_not_a_worker_is_closed() -> None:
    for garbage in (b"\x80\x00 not json\n", b"{" * (control.MAX_MESSAGE_BYTES + 10)):
        channel, other = pair()
        threading.Thread(target=other.sendall, args=(garbage,), daemon=True).start()
        with pytest.raises(control.ChannelClosed):
            for _ in range(100):
                channel.receive(1.0)
    channel, other = pair()
    other.sendall(b'[1, 2]\n{"no_kind": 1}\n')  # valid JSON that is not a message: ignored
    assert channel.receive(1.0) == []


def test_the_end_of_the_other_process_is_seen_at_once() -> None:
    channel, other = pair()
    other.close()
    with pytest.raises(control.ChannelClosed):
        channel.receive(5.0)
    with pytest.raises(control.ChannelClosed):
        channel.send("beat")


def test_record_key_store_is_create_only_and_waits_for_a_key(tmp_path: Path) -> None:
    records = open_record_store(str(tmp_path))
    store = RecordKeyStore(records, "comm/run-1/train")
    store.set("gen-0/addr-0", b"\x00\x01binary")
    assert store.get("gen-0/addr-0", 0) == b"\x00\x01binary"
    with pytest.raises(errors.StoreKeyExistsError):
        store.set("gen-0/addr-0", b"other")
    assert store.get("gen-0/addr-0", 0) == b"\x00\x01binary"
    late = threading.Timer(0.2, store.set, args=("gen-0/addr-1", b"late"))
    late.start()
    assert store.get("gen-0/addr-1", 10) == b"late"
    started = time.monotonic()
    with pytest.raises(errors.StoreTimeoutError):
        store.get("gen-0/never", 0.2)
    assert time.monotonic() - started >= 0.2
    with pytest.raises(ValueError):
        store.set("../escape", b"x")


def test_record_key_store_refuses_a_record_that_holds_no_value(tmp_path: Path) -> None:
    records = open_record_store(str(tmp_path))
    records.create("comm/run-1/train/gen-0/addr-0", {"value": "not base64 !"})
    with pytest.raises(errors.StoreError):
        RecordKeyStore(records, "comm/run-1/train").get("gen-0/addr-0", 0)


def train(ctx: object) -> None:
    pass


def test_run_refuses_what_it_cannot_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SNEPPX_HEARTBEAT_KEY", raising=False)
    monkeypatch.delenv("SNEPPX_HEARTBEAT_KEY_FILE", raising=False)
    job = ElasticTrainer(train_fn=train, checkpoint_dir=str(tmp_path), min_nodes=3)
    with pytest.raises(ValueError, match="min_nodes"):
        job.run(num_nodes=2, num_gpus=1)
    with pytest.raises(ValueError):
        ElasticTrainer(train_fn=train, checkpoint_dir=str(tmp_path)).run(num_nodes=0)
    with pytest.raises(TypeError):
        ElasticTrainer(train_fn="not a function", checkpoint_dir=str(tmp_path))  # type: ignore[arg-type]
    monkeypatch.setenv(ENV_ROLE, "sealer")
    with pytest.raises(errors.ElasticLaunchError, match="not a role"):
        ElasticTrainer(train_fn=train, checkpoint_dir=str(tmp_path)).run()
    monkeypatch.delenv(ENV_ROLE)
    with pytest.raises(errors.ElasticLaunchError, match="job key"):  # nodes on other machines need the key
        ElasticTrainer(train_fn=train, checkpoint_dir=str(tmp_path)).run(num_nodes=2, local_nodes=1)
    monkeypatch.setattr(sys, "orig_argv", [sys.executable])  # an interactive session: no script to re-run
    monkeypatch.setattr(sys, "argv", [""])
    with pytest.raises(errors.ElasticLaunchError, match="interactive"):
        ElasticTrainer(train_fn=train, checkpoint_dir=str(tmp_path)).run()


# ---- operator mode: the pod's environment and the agent's link to the job's object ------------------------------

POD_ENV = {"SNEPPX_RENDEZVOUS_OBJECT": "train-rendezvous", "SNEPPX_NAMESPACE": "team-a", "SNEPPX_JOB": "train",
           "SNEPPX_POD_NAME": "train-1", "SNEPPX_HOST": "127.0.0.7", "SNEPPX_PROCS_PER_NODE": "8",
           "SNEPPX_MIN_NODES": "2", "SNEPPX_MAX_NODES": "4", "SNEPPX_HANG_TIMEOUT_SECONDS": "90",
           "SNEPPX_CHECKPOINT_URI": "file:///var/lib/sneppx/checkpoints", "SNEPPX_MAX_TO_KEEP": "3",
           "SNEPPX_ROLLBACK_DEPTH": "1"}


def test_the_pods_environment_is_the_word_on_the_jobs_shape() -> None:
    assert pod.PodEnvironment.from_environ({}) is None  # standalone
    p = pod.PodEnvironment.from_environ(POD_ENV)
    assert p == pod.PodEnvironment(job="train", pod_name="train-1", host="127.0.0.7", procs_per_node=8, min_nodes=2,
                                   max_nodes=4, step_timeout=90.0, checkpoint_uri="file:///var/lib/sneppx/checkpoints",
                                   max_to_keep=3, rollback_depth=1)
    assert pod.PodEnvironment.from_environ({**POD_ENV, "SNEPPX_HANG_TIMEOUT_SECONDS": "0"}).step_timeout is None
    timed = pod.PodEnvironment.from_environ({**POD_ENV, "SNEPPX_RENDEZVOUS_TIMEOUT_SECONDS": "900",
                                             "SNEPPX_LAST_CALL_SECONDS": "0"})
    assert (timed.join_timeout, timed.last_call) == (900.0, 0.0)
    snapshots = pod.PodEnvironment.from_environ({**POD_ENV, "SNEPPX_SNAPSHOT_EVERY_N_STEPS": "1",
                                                 "SNEPPX_SNAPSHOT_REPLICAS": "2"})
    assert (snapshots.snapshot_every, snapshots.snapshot_replicas) == (1, 2)
    settings = ElasticTrainer(train_fn=print, checkpoint_dir="/elsewhere", snapshot_every=5)._worker_settings(
        "train", snapshots)
    assert (settings.snapshot_every, settings.snapshot_replicas) == (1, 2)  # the job spec wins
    for name, value, problem in [("SNEPPX_POD_NAME", "", "SNEPPX_POD_NAME is not"),
                                 ("SNEPPX_PROCS_PER_NODE", "eight", "not an integer"),
                                 ("SNEPPX_MAX_NODES", "0", "below 1"), ("SNEPPX_JOB", "../x", "not a Kubernetes name"),
                                 ("SNEPPX_SNAPSHOT_REPLICAS", "0", "below 1"),
                                 ("SNEPPX_RENDEZVOUS_TIMEOUT_SECONDS", "0", "below 1"),
                                 ("SNEPPX_LAST_CALL_SECONDS", "soon", "not an integer")]:
        with pytest.raises(errors.ElasticLaunchError, match=problem):
            pod.PodEnvironment.from_environ({**POD_ENV, name: value})


def test_one_function_says_where_the_rendezvous_records_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's ConfigMap in a pod (SNEPPX_RENDEZVOUS_OBJECT set), else beside the checkpoints; the process
    groups' addresses beside the checkpoints either way. The agent takes its records from there."""
    monkeypatch.setattr(kube.KubernetesRecordStore, "from_environment",
                        classmethod(lambda cls, environ: ("configmap", environ[ENV_OBJECT])))
    assert pod.rendezvous_store(str(tmp_path), POD_ENV) == ("configmap", "train-rendezvous")
    assert pod.rendezvous_store(str(tmp_path), {}).uri == str(tmp_path)
    assert pod.process_group_store(str(tmp_path)).uri == str(tmp_path)
    chosen = object()
    monkeypatch.setattr(pod, "rendezvous_store", lambda root: chosen)
    agent = NodeAgent(AgentSettings(run_id="where", agent_id="node-0", host="127.0.0.1", workers=1,
                                    elastic_root=str(tmp_path), worker_command=[], worker_env={},
                                    rendezvous=rendezvous.RendezvousConfig()))
    agent.heartbeat_socket.close()
    assert agent.records is chosen and agent.rdzv.store is chosen


def test_rank_0s_report_is_what_the_operator_reads_and_follows_the_newest_committed_step(tmp_path: Path) -> None:
    records = open_record_store(str(tmp_path / "object"))
    link = pod.JobLink(records, str(tmp_path / "ckpts"), "train-0")
    member = rendezvous.Member("train-0", "0" * 32, "127.0.0.7", "127.0.0.7:29500", 2, 0.0)
    other = rendezvous.Member("train-1", "1" * 32, "127.0.0.8", "127.0.0.8:29500", 2, 0.0)
    membership = rendezvous.Membership("train", 4, (member, other), "train-0")

    def view() -> job_object.Report:
        stored = records.read(job_object.REPORT_KEY)
        assert stored is not None
        data = {job_object.data_key(job_object.REPORT_KEY): job_object.encode_value(job_object.REPORT_KEY,
                                                                                    stored.value)}
        found = job_object.read_view(data)
        assert not found.problems and found.report is not None, found.problems
        return found.report

    link.report(membership, None, force=True)
    first = view()
    assert (first.generation, first.world_size, first.members) == (4, 4, ("train-0", "train-1"))
    assert first.last_valid_checkpoint is None and first.resumed_from is None
    with CheckpointCoordinator(str(tmp_path / "ckpts"), async_save=False, device="cpu") as saver:
        saver.save({"w": np.arange(4.0)}, step=12)
    link.report(membership, None)  # within the interval: not written again
    assert view() == first
    link.report(membership, 9, force=True)
    report = view()
    assert report.last_valid_checkpoint is not None and report.last_valid_checkpoint.step == 12
    assert report.last_valid_checkpoint.location == f"{tmp_path / 'ckpts'}/step-000000012"
    assert report.resumed_from is not None and report.resumed_from.step == 9
    assert report.resumed_from.location == f"{tmp_path / 'ckpts'}/step-000000009"
    link.report(membership, 14, "memory", force=True)  # restored from peer-memory snapshots
    assert view().resumed_from == job_object.CheckpointRef(14, "memory", view().resumed_from.time)
    link.close()


def test_rank_0s_word_on_unprotected_snapshots_goes_in_its_generations_report_and_no_later_one(
        tmp_path: Path) -> None:
    records = open_record_store(str(tmp_path / "object"))
    link = pod.JobLink(records, str(tmp_path / "ckpts"), "train-0")
    members = (rendezvous.Member("train-0", "0" * 32, "127.0.0.7", "127.0.0.7:29500", 2, 0.0),
               rendezvous.Member("train-1", "1" * 32, "127.0.0.8", "127.0.0.8:29500", 2, 0.0))
    fourth, fifth = (rendezvous.Membership("train", g, members, "train-0") for g in (4, 5))

    def unprotected() -> tuple[int, ...] | None:
        stored = records.read(job_object.REPORT_KEY)
        assert stored is not None
        return job_object.parse_report(stored.value).snapshot_unprotected

    link.report(fourth, None, force=True)
    assert unprotected() is None  # not placed yet: the report says nothing
    link.placed(fourth, [3, 1, 1, 4, True, "2", -1])  # only ranks of its world of 4, once each, in order
    link.report(fourth, None, force=True)
    assert unprotected() == (1, 3)
    link.placed(fourth, [])
    link.report(fourth, None, force=True)
    assert unprotected() == ()  # every part has its copies off its node
    link.placed(fourth, [0])
    link.report(fifth, None, force=True)
    assert unprotected() is None  # the next generation's ranks are others: it waits for its own placement
    link.close()


def test_the_operators_control_record_is_read_and_garbage_is_ignored(tmp_path: Path) -> None:
    records = open_record_store(str(tmp_path))
    link = pod.JobLink(records, str(tmp_path / "ckpts"), "train-0")
    assert link.control() is None
    control = job_object.Control(True, "quorum lost", 2, 3, 1, 60)
    records.create(job_object.CONTROL_KEY, job_object.control_to_json(control))
    assert link.control() == control
    pod.put(records, job_object.CONTROL_KEY, {"kind": "control", "paused": "yes"})
    assert link.control() is None
