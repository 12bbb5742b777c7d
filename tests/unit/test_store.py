"""The rendezvous store (elastic/store.py) and the job key the collectives authenticate with."""

from __future__ import annotations

import os
import threading

import pytest

from SneppX_ALG import errors
from SneppX_ALG.elastic import collectives, store


def test_set_then_get_across_store_objects(tmp_path: os.PathLike[str]) -> None:
    store.DirectoryStore(tmp_path).set("gen-3/comm/addr/0", b"127.0.0.1:1234")
    assert store.DirectoryStore(tmp_path).get("gen-3/comm/addr/0", timeout=1) == b"127.0.0.1:1234"


def test_keys_are_create_only(tmp_path: os.PathLike[str]) -> None:
    s = store.DirectoryStore(tmp_path)
    s.set("a/b", b"first")
    with pytest.raises(errors.StoreKeyExistsError):
        s.set("a/b", b"second")
    assert s.get("a/b", timeout=1) == b"first"
    assert [name for name in os.listdir(os.path.join(tmp_path, "a"))] == ["b"]  # no temporary left behind


def test_racing_writers_of_one_key_exactly_one_wins(tmp_path: os.PathLike[str]) -> None:
    s = store.DirectoryStore(tmp_path)
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
    s = store.DirectoryStore(tmp_path)
    threading.Timer(0.2, s.set, args=("late", b"here")).start()
    assert s.get("late", timeout=60) == b"here"


def test_get_times_out_naming_the_key(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(errors.StoreTimeoutError, match="never"):
        store.DirectoryStore(tmp_path).get("never", timeout=0.05)


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "..", ".hidden", "a//b", "a/", "sp ace", "x" * 513, "a/.b"])
def test_keys_that_could_leave_the_root_or_hide_are_refused(tmp_path: os.PathLike[str], key: str) -> None:
    s = store.DirectoryStore(tmp_path)
    with pytest.raises(ValueError, match="store key"):
        s.set(key, b"x")
    with pytest.raises(ValueError, match="store key"):
        s.get(key, timeout=0)


def test_values_are_bounded(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(ValueError, match="limit"):
        store.DirectoryStore(tmp_path).set("big", bytes(store.MAX_VALUE_BYTES + 1))


def test_generation_keys_are_namespaced() -> None:
    assert store.generation_key(4, "comm/addr/1") == "gen-4/comm/addr/1"
    assert store.generation_key(4, "x") != store.generation_key(5, "x")
    with pytest.raises(ValueError):
        store.generation_key(-1, "x")


# ---- the job key -------------------------------------------------------------------------------------------------


def test_job_key_comes_from_the_argument_the_key_file_or_hex(tmp_path: os.PathLike[str]) -> None:
    key_file = os.path.join(tmp_path, "heartbeat-key")
    with open(key_file, "wb") as f:
        f.write(b"\x00\xff" * 16)  # raw bytes, as the operator's Secret mounts them
    assert collectives.job_key(b"k" * 16, env={}) == b"k" * 16
    assert collectives.job_key(env={collectives.KEY_FILE_ENV: key_file}) == b"\x00\xff" * 16
    assert collectives.job_key(env={collectives.KEY_HEX_ENV: "ab" * 16}) == b"\xab" * 16
    # the file wins over hex, as the operator sets the file
    assert collectives.job_key(env={collectives.KEY_FILE_ENV: key_file, collectives.KEY_HEX_ENV: "ab" * 16}) == (
        b"\x00\xff" * 16)


def test_no_job_key_names_the_variables_to_set() -> None:
    with pytest.raises(errors.JobKeyError) as raised:
        collectives.job_key(env={})
    assert collectives.KEY_FILE_ENV in str(raised.value) and collectives.KEY_HEX_ENV in str(raised.value)


@pytest.mark.parametrize("env", [{collectives.KEY_HEX_ENV: "zz"}, {collectives.KEY_HEX_ENV: "ab" * 8 + "a"},
                                 {collectives.KEY_HEX_ENV: "ab" * 15}, {collectives.KEY_FILE_ENV: "/nonexistent/k"}])
def test_bad_job_keys_are_typed_errors(env: dict[str, str]) -> None:
    with pytest.raises(errors.JobKeyError):
        collectives.job_key(env=env)


def test_a_tcp_group_refuses_to_start_without_a_key(tmp_path: os.PathLike[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(collectives.KEY_FILE_ENV, raising=False)
    monkeypatch.delenv(collectives.KEY_HEX_ENV, raising=False)
    with pytest.raises(errors.JobKeyError):
        collectives.ProcessGroup(store.DirectoryStore(tmp_path), 0, 2)
