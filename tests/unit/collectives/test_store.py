"""The collectives' store (collectives/store.py), and the job key a process group authenticates with."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest
from directory_store import DirectoryStore

from SneppX_ALG import collectives, errors
from SneppX_ALG.collectives import store
from SneppX_ALG.contract.env import ENV_HEARTBEAT_KEY, ENV_HEARTBEAT_KEY_FILE


def test_set_then_get_across_store_objects(tmp_path: os.PathLike[str]) -> None:
    DirectoryStore(tmp_path).set("gen-3/comm/addr/0", b"127.0.0.1:1234")
    assert DirectoryStore(tmp_path).get("gen-3/comm/addr/0", timeout=1) == b"127.0.0.1:1234"


def test_keys_are_create_only(tmp_path: os.PathLike[str]) -> None:
    s = DirectoryStore(tmp_path)
    s.set("a/b", b"first")
    with pytest.raises(errors.StoreKeyExistsError):
        s.set("a/b", b"second")
    assert s.get("a/b", timeout=1) == b"first"
    assert [name for name in os.listdir(os.path.join(tmp_path, "a"))] == ["b"]  # no temporary left behind


def test_racing_writers_of_one_key_exactly_one_wins(tmp_path: os.PathLike[str]) -> None:
    s = DirectoryStore(tmp_path)
    outcomes: list[str] = []

    def write(i: int) -> None:
        try:
            s.set("race", str(i).encode())
            outcomes.append("won")
        except errors.StoreKeyExistsError:
            outcomes.append("lost")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["lost"] * 15 + ["won"]
    assert int(s.get("race", timeout=1)) in range(16)


def test_get_waits_for_a_later_set(tmp_path: os.PathLike[str]) -> None:
    s = DirectoryStore(tmp_path)
    threading.Timer(0.2, s.set, args=("late", b"here")).start()
    assert s.get("late", timeout=60) == b"here"


def test_get_times_out_naming_the_key(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(errors.StoreTimeoutError, match="never"):
        DirectoryStore(tmp_path).get("never", timeout=0.05)


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "..", ".hidden", "a//b", "a/", "sp ace", "x" * 513, "a/.b"])
def test_keys_that_could_leave_the_root_or_hide_are_refused(tmp_path: os.PathLike[str], key: str) -> None:
    s = DirectoryStore(tmp_path)
    with pytest.raises(ValueError, match="store key"):
        s.set(key, b"x")
    with pytest.raises(ValueError, match="store key"):
        s.get(key, timeout=0)


def test_values_are_bounded(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(ValueError, match="limit"):
        DirectoryStore(tmp_path).set("big", bytes(store.MAX_VALUE_BYTES + 1))


def test_generation_keys_are_namespaced() -> None:
    assert store.generation_key(4, "comm/addr/1") == "gen-4/comm/addr/1"
    assert store.generation_key(4, "x") != store.generation_key(5, "x")
    with pytest.raises(ValueError):
        store.generation_key(-1, "x")


# ---- the job key: the heartbeat's (job_key.load_key, tested in test_heartbeat_config.py), read the same way by a group


def test_a_tcp_group_refuses_to_start_without_a_key(tmp_path: os.PathLike[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_HEARTBEAT_KEY_FILE, raising=False)
    monkeypatch.delenv(ENV_HEARTBEAT_KEY, raising=False)
    with pytest.raises(errors.HeartbeatKeyError) as raised:
        collectives.ProcessGroup(DirectoryStore(tmp_path), 0, 2)
    assert ENV_HEARTBEAT_KEY_FILE in str(raised.value) and ENV_HEARTBEAT_KEY in str(raised.value)


def test_a_group_reads_the_key_file_the_operator_mounts(tmp_path: os.PathLike[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = os.path.join(tmp_path, "heartbeat-key")
    with open(key_file, "wb") as f:
        f.write(bytes(range(32)))  # raw bytes, as the job's Secret holds them
    monkeypatch.setenv(ENV_HEARTBEAT_KEY_FILE, key_file)
    rendezvous = DirectoryStore(os.path.join(tmp_path, "rdzv"))
    sums: list[float] = []

    def rank_main(rank: int) -> None:
        with collectives.ProcessGroup(rendezvous, rank, 2, timeout=60) as group:
            sums.append(float(group.allreduce(np.ones(3))[0]))

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sums == [2.0, 2.0]


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_two_groups_of_one_generation_share_a_store_by_name(tmp_path: Any, backend: str) -> None:
    shared = DirectoryStore(tmp_path)

    def both(rank: int) -> list[float]:
        kwargs = {"backend": backend, "key": b"k" * 32, "timeout": 30}
        with collectives.ProcessGroup(shared, rank, 2, 4, **kwargs) as train, \
                collectives.ProcessGroup(shared, rank, 2, 4, name="ckpt", **kwargs) as ckpt:
            a, b = np.full(3, rank + 1.0), np.full(3, 10.0 * (rank + 1))
            train.allreduce(a)
            ckpt.allreduce(b)
            return [*a, *b]

    results: list[Any] = [None, None]
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, both(r))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [[3.0] * 3 + [30.0] * 3] * 2
    # without a name the second group's keys are the first's: create-only, so it is refused
    with pytest.raises(errors.StoreKeyExistsError):
        collectives.ProcessGroup(shared, 0, 2, 4, backend=backend, key=b"k" * 32, timeout=30)
    with pytest.raises(ValueError, match="store key"):
        collectives.ProcessGroup(shared, 0, 2, 4, backend=backend, key=b"k" * 32, timeout=30, name="../x")
