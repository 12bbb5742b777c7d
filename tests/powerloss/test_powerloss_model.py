"""The persistence model itself (crashfs.py), on small hand-written op logs: what it lets a power cut keep or lose.

Each test is one rule of the model (docs/TESTING.md, "Power loss") and checks the full set of crash
states it allows at the end of the log, so a model that were too kind (missing states) or too harsh (states
POSIX rules out) fails here before it could make the sweep pass or fail for the wrong reason.
"""

from __future__ import annotations

import dataclasses
import os

import crashfs
import pytest
from oplog import Op, RecordingError

WRITE = os.O_WRONLY
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY


def op(kind: str, **fields: object) -> Op:
    return Op(-1, kind, **fields)  # type: ignore[arg-type]


def states(initial: crashfs.Tree, *ops: Op, crash_point: int | None = None) -> set[frozenset]:
    """Every crash state the model allows after the ops (or at `crash_point`)."""
    replay = crashfs.Replay(initial, [dataclasses.replace(o, index=i) for i, o in enumerate(ops)])
    point = len(ops) if crash_point is None else crash_point
    unsynced = replay.split(point)[1]
    return {frozenset(replay.state(point, outcomes).items()) for _, outcomes in crashfs.every_state(replay, unsynced)}


def tree(**files: bytes | None) -> frozenset:
    return frozenset({name.replace("__", "/"): contents for name, contents in files.items()}.items())


def test_a_write_is_kept_only_once_its_file_is_fsynced() -> None:
    ops = [op("open", fd=3, flags=WRITE, path="f"), op("write", fd=3, offset=0, data=b"new!")]
    assert states({"f": b"old"}, *ops) == {tree(f=b"old"), tree(f=b"new!"), tree(f=bytes(4))}
    assert states({"f": b"old"}, *ops, op("fsync", fd=3)) == {tree(f=b"new!")}


def test_an_append_may_keep_its_size_and_lose_its_data() -> None:
    ops = [op("open", fd=3, flags=WRITE, path="f"), op("write", fd=3, offset=3, data=b"more")]
    assert tree(f=b"abc" + bytes(4)) in states({"f": b"abc"}, *ops)


def test_a_torn_write_keeps_the_whole_blocks_of_its_first_half() -> None:
    data = bytes(range(256)) * 64  # 16 KiB
    ops = [op("open", fd=3, flags=CREATE, path="f"), op("write", fd=3, offset=0, data=data),
           op("open", fd=4, flags=DIRECTORY, path=""), op("fsync", fd=4)]
    assert states({}, *ops) == {tree(f=b""), tree(f=data), tree(f=bytes(len(data))), tree(f=data[:8192])}
    every_block = crashfs.Replay({}, [dataclasses.replace(o, index=i) for i, o in enumerate(ops)], every_tear=True)
    assert [e.tears for e in every_block.effects if e.kind == "data"] == [(4096, 8192, 12288)]


def test_fsync_through_another_fd_reaches_the_same_file() -> None:
    ops = [op("open", fd=3, flags=WRITE, path="f"), op("open", fd=4, flags=os.O_RDONLY, path="f"),
           op("write", fd=3, offset=0, data=b"new"), op("close", fd=3), op("fsync", fd=4)]
    assert states({"f": b"old"}, *ops) == {tree(f=b"new")}


def test_fsync_of_a_new_file_does_not_keep_its_name() -> None:
    ops = [op("open", fd=3, flags=CREATE, path="f"), op("write", fd=3, offset=0, data=b"x"), op("fsync", fd=3)]
    assert states({}, *ops) == {tree(), tree(f=b"x")}
    directory_synced = [*ops, op("open", fd=4, flags=DIRECTORY, path=""), op("fsync", fd=4)]
    assert states({}, *directory_synced) == {tree(f=b"x")}


def test_a_rename_may_persist_while_the_renamed_files_data_is_lost() -> None:
    """The classic: write a temp file, rename it over the real name, fsync the directory, forget the file."""
    ops = [op("open", fd=3, flags=CREATE, path="f.tmp"), op("write", fd=3, offset=0, data=b"new"),
           op("close", fd=3), op("rename", path="f.tmp", path2="f"),
           op("open", fd=4, flags=DIRECTORY, path=""), op("fsync", fd=4)]
    assert states({"f": b"old"}, *ops) == {tree(f=b""), tree(f=b"new"), tree(f=bytes(3))}
    file_synced = [*ops[:2], op("fsync", fd=3), *ops[2:]]
    assert states({"f": b"old"}, *file_synced) == {tree(f=b"new")}


def test_a_rename_is_lost_or_kept_whole_until_its_directory_is_fsynced() -> None:
    ops = [op("rename", path="a", path2="b")]
    assert states({"a": b"1"}, *ops) == {tree(a=b"1"), tree(b=b"1")}
    assert states({"a": b"1"}, *ops, op("open", fd=3, flags=DIRECTORY, path=""), op("fsync", fd=3)) == {tree(b=b"1")}


def test_a_rename_across_directories_needs_both_fsynced() -> None:
    initial: crashfs.Tree = {"a": None, "b": None, "a/f": b"1"}
    ops = [op("rename", path="a/f", path2="b/f"), op("open", fd=3, flags=DIRECTORY, path="b"), op("fsync", fd=3)]
    assert states(initial, *ops) == {tree(a=None, b=None, a__f=b"1"), tree(a=None, b=None, b__f=b"1")}
    both = [*ops, op("open", fd=4, flags=DIRECTORY, path="a"), op("fsync", fd=4)]
    assert states(initial, *both) == {tree(a=None, b=None, b__f=b"1")}


def test_an_entry_in_a_new_directory_is_lost_with_the_directory() -> None:
    ops = [op("mkdir", path="d"), op("open", fd=3, flags=CREATE, path="d/f"), op("write", fd=3, offset=0, data=b"x"),
           op("fsync", fd=3), op("open", fd=4, flags=DIRECTORY, path="d"), op("fsync", fd=4)]
    assert states({}, *ops) == {tree(), tree(d=None, d__f=b"x")}


def test_ops_that_are_not_durable_persist_independently_of_their_order() -> None:
    ops = [op("mkdir", path="a"), op("mkdir", path="b"), op("unlink", path="c")]
    assert len(states({"c": b""}, *ops)) == 8


def test_sync_file_range_is_no_barrier_and_sync_is_one_for_everything() -> None:
    ops = [op("open", fd=3, flags=CREATE, path="f"), op("write", fd=3, offset=0, data=b"x"),
           op("syncrange", fd=3, offset=0, length=1, flags=7)]
    assert len(states({}, *ops)) == 4  # no name; a name with b"", b"x" or b"\0"
    assert states({}, *ops, op("sync")) == {tree(f=b"x")}


def test_a_crash_point_sees_only_the_ops_before_it() -> None:
    ops = [op("mkdir", path="d"), op("open", fd=3, flags=DIRECTORY, path=""), op("fsync", fd=3)]
    assert states({}, *ops, crash_point=2) == {tree(), tree(d=None)}
    assert states({}, *ops, crash_point=3) == {tree(d=None)}


@pytest.mark.parametrize("bad", [
    op("write", fd=9, offset=0, data=b"x"),            # an fd whose open was not recorded
    op("open", fd=3, flags=WRITE, path="missing"),     # a path the model doesn't have
    op("rmdir", path="d"),                             # a directory that is not empty
])
def test_a_log_the_model_cannot_follow_is_refused(bad: Op) -> None:
    with pytest.raises(RecordingError):
        crashfs.Replay({"d": None, "d/f": b""}, [dataclasses.replace(bad, index=0)])
