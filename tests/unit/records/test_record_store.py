"""The local compare-and-swap record store on real files: semantics, key and value limits, hostile files.

The same semantics on S3 and races between writers are in tests/integration/test_records.py.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from SneppX_ALG import errors
from SneppX_ALG.contract import record
from SneppX_ALG.records import LocalRecordStore, local, open_record_store


@pytest.fixture
def store(tmp_path) -> LocalRecordStore:
    return LocalRecordStore(str(tmp_path / "root"))


def versions(store: LocalRecordStore, key: str) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(store.root, key)) if n.startswith(".v"))


def test_create_read_swap_delete(store) -> None:
    created = store.create("a/b", {"x": 1})
    assert created == store.read("a/b") == record.Record("a/b", {"x": 1}, "1")
    with pytest.raises(errors.RecordExistsError):
        store.create("a/b", {"x": 2})
    swapped = store.swap("a/b", {"x": 3}, created.version)
    assert store.read("a/b") == swapped and swapped.version != created.version
    with pytest.raises(errors.RecordConflictError):
        store.swap("a/b", {"x": 4}, created.version)  # stale
    store.delete("a/b")
    store.delete("a/b")  # absent is fine
    assert store.read("a/b") is None and store.keys() == []
    with pytest.raises(errors.RecordConflictError):
        store.swap("a/b", {"x": 5}, swapped.version)  # deleted since
    again = store.create("a/b", {"x": 6})
    with pytest.raises(errors.RecordConflictError):
        store.swap("a/b", {"x": 7}, swapped.version)  # a version from before the delete never matches again
    assert store.swap("a/b", {"x": 8}, again.version).value == {"x": 8}


def test_a_swap_can_not_create_a_record(store) -> None:
    with pytest.raises(errors.RecordConflictError):
        store.swap("never", {"x": 1}, "1")
    assert store.read("never") is None
    for bad in ("", "x", "-1", "1.0", "\u0661", "9" * 19):
        with pytest.raises(errors.RecordValueError):
            store.swap("never", {"x": 1}, bad)


def test_keys_are_sorted_limited_and_only_live_records(store) -> None:
    for key in ("b/2", "a/1", "b/1/deeper", "c"):
        store.create(key, {})
    store.create("gone", {})
    store.delete("gone")
    os.makedirs(os.path.join(store.root, "b", "not-a-record"))  # a directory with no version in it
    assert store.keys() == ["a/1", "b/1/deeper", "b/2", "c"]
    assert store.keys("b/") == ["b/1/deeper", "b/2"]
    assert store.keys("b/", limit=1) == ["b/1/deeper"]
    assert store.keys("nothing/") == []


def test_superseded_versions_keep_their_names_until_the_retention_has_passed(store) -> None:
    current = store.create("k", {"n": 0})
    for n in range(1, 6):
        current = store.swap("k", {"n": n}, current.version)
    assert len(versions(store, "k")) == 6  # all within the retention: no name can be taken twice
    with pytest.raises(errors.RecordConflictError):
        store.swap("k", {"n": 99}, "2")  # a writer that stalled since version 2: its successor's name is taken
    old = os.stat(os.path.join(store.root, "k", ".v000000006")).st_mtime - local.RETENTION_S - 1
    for name in versions(store, "k")[:4]:
        os.utime(os.path.join(store.root, "k", name), (old, old))  # versions 1-4 superseded long ago
    current = store.swap("k", {"n": 6}, current.version)
    assert versions(store, "k") == [".v000000005", ".v000000006", ".v000000007"]
    assert store.read("k") == current and current.value == {"n": 6}


def test_a_link_whose_reply_was_lost_still_counts_as_ours(store, monkeypatch) -> None:
    # NFS: the client retransmits a LINK whose reply was lost; the retry fails with EEXIST although the
    # first one made our link. The temporary file's link count (2) tells.
    real_link = os.link

    def link_then_lose_the_reply(src: str, dst: str, **kwargs: Any) -> None:
        real_link(src, dst, **kwargs)
        raise FileExistsError(17, "File exists")

    monkeypatch.setattr(os, "link", link_then_lose_the_reply)
    assert store.create("k", {"x": 1}).version == "1"
    monkeypatch.undo()
    assert store.read("k") == record.Record("k", {"x": 1}, "1")


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/", "../x", "a/../b", ".hidden", "a/.v000000001", "a b",
                                 "x" * 254, "/".join(["a"] * 600), "caf\u00e9", "a\x00b", "a\\b"])
def test_a_key_outside_the_plain_segments_is_refused(store, key: str) -> None:
    with pytest.raises(errors.RecordValueError):
        store.create(key, {})
    with pytest.raises(errors.RecordValueError):
        store.read(key)


@pytest.mark.parametrize("prefix", ["a", "/a/", "../", "a//"])
def test_a_listing_prefix_is_empty_or_a_key_and_a_slash(store, prefix: str) -> None:
    with pytest.raises(errors.RecordValueError):
        store.keys(prefix)


@pytest.mark.parametrize("value", [[1, 2], "text", {"x": float("nan")}, {"x": {1, 2}}, {1: object()},
                                   {"x": "y" * record.MAX_RECORD_BYTES}])
def test_a_value_that_is_not_a_bounded_json_object_is_refused(store, value: Any) -> None:
    with pytest.raises(errors.RecordValueError):
        store.create("k", value)
    assert store.read("k") is None


def plant(store: LocalRecordStore, key: str) -> str:
    os.makedirs(os.path.join(store.root, key), exist_ok=True)
    return os.path.join(store.root, key, ".v000000001")


@pytest.mark.parametrize("content", [b"\xff\xfe", b"[1]", b"{\"a\": 1, \"a\": 2}", b"{\"a\": NaN}",
                                     b"{" * 50_000, b"{\"x\": \"" + b"y" * record.MAX_RECORD_BYTES + b"\"}"])
def test_garbage_in_a_version_file_is_a_typed_error(store, content: bytes) -> None:
    with open(plant(store, "k"), "wb") as f:
        f.write(content)
    with pytest.raises(errors.RecordCorruptError):
        store.read("k")


def test_files_that_are_not_regular_files_are_refused_without_blocking(store, tmp_path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text('{"secret": 1}')
    os.symlink(outside, plant(store, "link"))
    os.mkfifo(plant(store, "fifo"))  # opening it to read would block forever without O_NONBLOCK
    os.mkdir(plant(store, "dir"))
    for key in ("link", "fifo", "dir"):
        with pytest.raises(errors.RecordCorruptError, match="not a regular file"):
            store.read(key)


def test_a_symlinked_key_directory_is_refused_for_reads_and_writes(store, tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.makedirs(os.path.join(store.root, "rdzv"))
    os.symlink(elsewhere, os.path.join(store.root, "rdzv", "run"))
    with pytest.raises(errors.RecordCorruptError, match="symlink"):
        store.create("rdzv/run/k", {})
    with pytest.raises(errors.RecordCorruptError, match="symlink"):
        store.read("rdzv/run/k")
    assert os.listdir(elsewhere) == [] and store.keys() == []


def test_a_file_where_a_key_directory_should_be_is_a_typed_error(store) -> None:
    os.makedirs(store.root, exist_ok=True)
    with open(os.path.join(store.root, "k"), "w") as f:
        f.write("{}")
    with pytest.raises(errors.RecordCorruptError, match="is a file"):
        store.read("k")


def test_the_root_may_be_reached_through_a_symlink(tmp_path) -> None:
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "alias")
    store = open_record_store(f"file://{tmp_path / 'alias'}")
    store.create("a/b", {"x": 1})
    assert LocalRecordStore(str(tmp_path / "real")).read("a/b") == record.Record("a/b", {"x": 1}, "1")
