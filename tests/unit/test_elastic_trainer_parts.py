"""The ElasticTrainer's small parts: the agent-worker control channel under bad input, the process-group address
store over compare-and-swap records, and run()'s refusals. The whole trainer runs in
tests/integration/test_elastic_trainer.py."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from SneppX_ALG import ElasticTrainer, errors, storage
from SneppX_ALG.elastic import control, trainer
from SneppX_ALG.elastic.store import RecordKeyStore


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
    records = storage.open_record_store(str(tmp_path))
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
    records = storage.open_record_store(str(tmp_path))
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
    monkeypatch.setenv(trainer.ENV_ROLE, "sealer")
    with pytest.raises(errors.ElasticLaunchError, match="not a role"):
        ElasticTrainer(train_fn=train, checkpoint_dir=str(tmp_path)).run()
    monkeypatch.delenv(trainer.ENV_ROLE)
    with pytest.raises(errors.ElasticLaunchError, match="job key"):  # nodes on other machines need the key
        ElasticTrainer(train_fn=train, checkpoint_dir=str(tmp_path)).run(num_nodes=2, local_nodes=1)
    monkeypatch.setattr(sys, "orig_argv", [sys.executable])  # an interactive session: no script to re-run
    monkeypatch.setattr(sys, "argv", [""])
    with pytest.raises(errors.ElasticLaunchError, match="interactive"):
        ElasticTrainer(train_fn=train, checkpoint_dir=str(tmp_path)).run()
