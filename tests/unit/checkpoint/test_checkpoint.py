"""CheckpointWriter / CheckpointReader / validate_checkpoint: round trips, atomic commit, typed errors."""

from __future__ import annotations

import array
import os
import pathlib
import threading

import numpy as np
import pytest

from SneppX_ALG import (
    CheckpointCoordinator,
    CheckpointReader,
    CheckpointWriter,
    _native,
    errors,
    storage,
    validate_checkpoint,
)
from SneppX_ALG.checkpoint import format

ALL_DTYPES = ["bool", "uint8", "int8", "uint16", "int16", "float16", "uint32", "int32", "float32", "uint64",
              "int64", "float64", "complex64", "complex128"]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 0, 4), (2, 3, 4, 5)])
def test_round_trip_is_bitwise_for_every_dtype_and_shape(tmp_path: pathlib.Path, dtype: str, shape: tuple) -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    value = data.view(dtype).reshape(shape) if dtype != "bool" else (data % 2).astype(bool).reshape(shape)
    path = tmp_path / "x.snpx"
    with CheckpointWriter(path) as w:
        w.write("t", value)
    with CheckpointReader(path) as r:
        got = r.read("t")
        assert got.dtype == value.dtype and got.shape == value.shape
        assert got.tobytes() == value.tobytes()


def test_metadata_config_and_names_round_trip(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.snpx"
    config = {"dim": 128, "layers": [1, 2], "name": "ünïcode", "nested": {"a": None, "b": 1.5}}
    with CheckpointWriter(path, metadata={"run": "a", "step": "10"}, config=config) as w:
        w.write("layer0.w", np.ones((2, 2), np.float32))
        w.write("ελληνικά/ü", np.zeros(3, np.int8))
    with CheckpointReader(path) as r:
        assert r.names() == ["layer0.w", "ελληνικά/ü"]
        assert r.metadata == {"run": "a", "step": "10"}
        assert r.config == config
        assert "layer0.w" in r and len(r) == 2
    assert validate_checkpoint(path) == (True, [])


def test_noncontiguous_bigendian_and_buffer_inputs(tmp_path: pathlib.Path) -> None:
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    big = np.arange(10, dtype=">i4")

    class DLPackOnly:  # a framework tensor that only speaks DLPack
        def __init__(self, a: np.ndarray):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    path = tmp_path / "in.snpx"
    with CheckpointWriter(path) as w:
        w.write("transposed", base.T)
        w.write("strided", base[:, ::2])
        w.write("bigendian", big)
        w.write("bytearray", bytearray(b"abc"))
        w.write("array.array", array.array("h", [1, -2, 3]))
        w.write("dlpack", DLPackOnly(np.arange(5, dtype=np.float32)))
    with CheckpointReader(path) as r:
        np.testing.assert_array_equal(r.read("transposed"), base.T)
        np.testing.assert_array_equal(r.read("strided"), base[:, ::2])
        np.testing.assert_array_equal(r.read("bigendian"), np.arange(10))
        assert r.read("bigendian").dtype == np.dtype("<i4")
        assert r.read("bytearray").tobytes() == b"abc"
        np.testing.assert_array_equal(r.read("array.array"), [1, -2, 3])
        np.testing.assert_array_equal(r.read("dlpack"), np.arange(5, dtype=np.float32))


def test_read_is_zero_copy_and_read_only(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "z.snpx"
    with CheckpointWriter(path) as w:
        w.write("a", np.arange(1000, dtype=np.float32))
    with CheckpointReader(path) as r:
        a = r.read("a")
        assert not a.flags.writeable and not a.flags.owndata
        with pytest.raises(ValueError):
            a[0] = 1
        entry = r.entry("a")
        assert entry.offset % format.ALIGN == 0
    np.testing.assert_array_equal(a, np.arange(1000, dtype=np.float32))  # still valid after close


def test_shard_metadata_round_trips(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "shard.snpx"
    with CheckpointWriter(path) as w:
        w.write("w", np.ones((2, 4)), global_shape=(8, 4), global_offset=(6, 0))
        with pytest.raises(ValueError, match="does not fit"):
            w.write("bad", np.ones((2, 4)), global_shape=(8, 4), global_offset=(7, 0))
    with CheckpointReader(path) as r:
        assert r.entry("w").global_shape == (8, 4) and r.entry("w").global_offset == (6, 0)


def test_exception_inside_with_leaves_no_file_and_keeps_the_old_one(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "keep.snpx"
    with CheckpointWriter(path, metadata={"v": "1"}) as w:
        w.write("a", np.zeros(4))
    with pytest.raises(RuntimeError), CheckpointWriter(path, metadata={"v": "2"}) as w:
        w.write("a", np.ones(4))
        raise RuntimeError("training crashed")
    with CheckpointReader(path) as r:
        assert r.metadata == {"v": "1"}
    assert sorted(os.listdir(tmp_path)) == ["keep.snpx"]  # no temporary left behind
    with pytest.raises(RuntimeError), CheckpointWriter(tmp_path / "new.snpx") as w:
        raise RuntimeError("boom")
    assert not (tmp_path / "new.snpx").exists()


@pytest.mark.parametrize("site,action,error", [
    ("fsync", "EIO", errors.DurabilityError),
    ("fsync", "ENOSPC", errors.DiskFullError),
    ("write", "ENOSPC", errors.DiskFullError),
    ("write", "EIO", errors.StorageError),
    ("rename", "EIO", errors.StorageError),
])
def test_failed_io_fails_the_write_and_keeps_the_previous_file(tmp_path: pathlib.Path, site: str, action: str,
                                                               error: type) -> None:
    path = tmp_path / "c.snpx"
    with CheckpointWriter(path, metadata={"v": "old"}) as w:
        w.write("a", np.zeros(4))
    _native.fault_arm(site, 1, action)
    try:
        with pytest.raises(error), CheckpointWriter(path, metadata={"v": "new"}) as w:
            w.write("a", np.ones(1 << 20))
    finally:
        _native.fault_arm("write", 0, "kill")  # disarm
    assert validate_checkpoint(path) == (True, [])
    with CheckpointReader(path) as r:
        assert r.metadata == {"v": "old"}
    assert sorted(os.listdir(tmp_path)) == ["c.snpx"]


def test_failed_directory_fsync_after_rename_is_reported(tmp_path: pathlib.Path) -> None:
    # The rename happened, so the new file is in place and whole; but its directory entry may not survive a
    # crash, and the caller must hear that rather than trust it.
    path = tmp_path / "d.snpx"
    _native.fault_arm("dirsync", 1, "EIO")
    try:
        with pytest.raises(errors.DurabilityError, match="fsync"), CheckpointWriter(path) as w:
            w.write("a", np.ones(10))
    finally:
        _native.fault_arm("write", 0, "kill")
    assert validate_checkpoint(path) == (True, [])


@pytest.mark.parametrize("direct", [True, False])
def test_direct_and_buffered_writes_give_the_same_file(tmp_path: pathlib.Path, direct: bool) -> None:
    data = np.random.default_rng(3).standard_normal(3_000_001)  # not a multiple of the block size
    with CheckpointWriter(tmp_path / "a.snpx", direct=direct, buffer_bytes=1 << 20) as w:
        w.write("a", data)
        w.write("b", np.arange(5))
    with CheckpointWriter(tmp_path / "ref.snpx", direct=False) as w:
        w.write("a", data)
        w.write("b", np.arange(5))
    assert (tmp_path / "a.snpx").read_bytes() == (tmp_path / "ref.snpx").read_bytes()
    probe = _native.NativeFile(str(tmp_path / "probe"), direct=direct)
    assert probe.is_direct == direct  # this disk takes O_DIRECT; buffered when asked
    probe.abort()
    assert not (tmp_path / "probe").exists()


def test_writer_rejects_bad_input_with_typed_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(errors.UnsupportedTensorError, match="JSON-safe"):
        CheckpointWriter(tmp_path / "a", config={"x": (1, 2)})
    with pytest.raises(errors.UnsupportedTensorError, match="JSON-safe"):
        CheckpointWriter(tmp_path / "a", config={"x": float("nan")})
    with pytest.raises(errors.UnsupportedTensorError, match="strings"):
        CheckpointWriter(tmp_path / "a", metadata={"step": 3})  # type: ignore[dict-item]
    with CheckpointWriter(tmp_path / "b.snpx") as w:
        w.write("a", np.zeros(1))
        with pytest.raises(errors.UnsupportedTensorError, match="already written"):
            w.write("a", np.zeros(1))
        with pytest.raises(errors.UnsupportedTensorError, match="can't be stored"):
            w.write("obj", np.array([object()]))
        with pytest.raises(errors.UnsupportedTensorError):
            w.write("str", "not a tensor")
        with pytest.raises(errors.CorruptTableError, match="non-empty"):
            w.write("", np.zeros(1))
    with pytest.raises(errors.CheckpointNotFoundError):
        CheckpointWriter(tmp_path / "missing-dir" / "x.snpx").open()


def test_reader_typed_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(errors.CheckpointNotFoundError):
        CheckpointReader(tmp_path / "nope.snpx")
    with pytest.raises(errors.CheckpointFormatError, match="directory"):
        CheckpointReader(tmp_path)
    path = tmp_path / "r.snpx"
    with CheckpointWriter(path) as w:
        w.write("a", np.zeros(3))
    with CheckpointReader(path) as r, pytest.raises(errors.TensorNotFoundError, match="no tensor named 'b'"):
        r.read("b")


def test_validate_never_raises_and_explains(tmp_path: pathlib.Path) -> None:
    assert validate_checkpoint(tmp_path / "missing")[1][0].endswith("file not found")
    (tmp_path / "empty").write_bytes(b"")
    assert "empty" in validate_checkpoint(tmp_path / "empty")[1][0]
    (tmp_path / "garbage").write_bytes(os.urandom(5000))
    assert not validate_checkpoint(tmp_path / "garbage")[0]
    assert not validate_checkpoint(tmp_path)[0]


def test_corrupt_tensor_is_reported_by_name_and_others_still_checked(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "c.snpx"
    with CheckpointWriter(path) as w:
        w.write("good", np.ones(100))
        w.write("bad", np.ones(100))
        w.write("worse", np.ones(100))
    with CheckpointReader(path) as r:
        bad, worse = r.entry("bad").offset, r.entry("worse").offset
    blob = bytearray(path.read_bytes())
    blob[bad + 5] ^= 0x10
    blob[worse] ^= 0x01
    path.write_bytes(blob)
    ok, problems = validate_checkpoint(path)
    assert not ok and len(problems) == 2
    assert "'bad'" in problems[0] and "'worse'" in problems[1]
    with CheckpointReader(path) as r:
        np.testing.assert_array_equal(r.read("good"), np.ones(100))
        with pytest.raises(errors.ChecksumMismatchError, match="'bad'"):
            r.read("bad")


def test_validate_checks_a_coordinator_step_directory(tmp_path: pathlib.Path) -> None:
    with CheckpointCoordinator(tmp_path / "root", max_to_keep=None) as coord:
        coord.save({"w": np.arange(1000, dtype=np.float32), "lr": 0.5}, step=7)
    step_dir = tmp_path / "root" / storage.step_name(7)
    assert validate_checkpoint(step_dir) == (True, [])  # a directory, validated as the coordinator does
    shard = next(step_dir.glob("*.snpx"))
    with CheckpointReader(shard) as r:
        offset = r.entry(r.names()[0]).offset
    blob = bytearray(shard.read_bytes())
    blob[offset + 3] ^= 0x04
    shard.write_bytes(blob)
    ok, problems = validate_checkpoint(step_dir)
    assert not ok and "CRC32C" in problems[0]
    (step_dir / storage.MANIFEST).unlink()
    ok, problems = validate_checkpoint(step_dir)
    assert not ok and "manifest.json is missing" in problems[0]


def test_a_failed_write_can_not_be_committed(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "half.snpx"
    writer = CheckpointWriter(path)
    writer.write("a", np.zeros(4))
    _native.fault_arm("write", 1, "EIO")
    try:
        with pytest.raises(errors.StorageError):
            writer.write("big", np.ones(4 << 20))  # fails after part of the tensor went into the staging buffer
    finally:
        _native.fault_arm("write", 0, "kill")
    with pytest.raises(errors.StorageError, match="earlier write"):
        writer.write("c", np.zeros(1))
    with pytest.raises(errors.StorageError, match="nothing was committed"):
        writer.commit()
    assert not path.exists() and os.listdir(tmp_path) == []


# ---- a writer is single-use; a reader owns its file until closed or collected ------------------------------


@pytest.mark.parametrize("finish", ["commit", "abort"])
def test_a_writer_is_single_use_after_commit_or_abort(tmp_path: pathlib.Path, finish: str) -> None:
    path = tmp_path / "w.snpx"
    with CheckpointWriter(path, metadata={"v": "old"}) as w:
        w.write("w", np.arange(66_000, dtype=np.float32))  # ~264 KB
    before = path.read_bytes()
    writer = CheckpointWriter(path, metadata={"v": "new"})
    writer.write("w", np.ones(10, np.float32))
    getattr(writer, finish)()
    after_finish = path.read_bytes()
    assert (after_finish == before) == (finish == "abort")
    with pytest.raises(errors.CheckpointClosedError, match="single-use"):
        writer.write("x", np.zeros(3))
    with pytest.raises(errors.CheckpointClosedError, match=finish):
        writer.commit()  # before the fix: a fresh temp file with the old table, renamed over `path`
    writer.abort()  # nothing to undo: a no-op, never an unlink of `path`
    assert path.read_bytes() == after_finish and validate_checkpoint(path) == (True, [])
    assert os.listdir(tmp_path) == ["w.snpx"]  # no temporary file either


@pytest.mark.parametrize("finish", ["commit", "abort"])
def test_leaving_with_after_an_explicit_commit_or_abort_does_nothing(tmp_path: pathlib.Path, finish: str) -> None:
    """The reported loss: a 266 KB valid file replaced by a 4 KB invalid one when `with` committed again."""
    path = tmp_path / "model.snpx"
    weights = np.random.default_rng(0).standard_normal(66_000).astype(np.float32)
    with CheckpointWriter(path, metadata={"v": "1"}) as w:
        w.write("w", weights)
    good = path.read_bytes()
    assert len(good) > 260_000
    with CheckpointWriter(path, metadata={"v": "2"}) as w:
        w.write("w", weights + 1)
        getattr(w, finish)()
    assert validate_checkpoint(path) == (True, [])
    with CheckpointReader(path) as r:
        assert r.metadata == {"v": "2" if finish == "commit" else "1"}
        np.testing.assert_array_equal(r.read("w"), weights + 1 if finish == "commit" else weights)
    assert os.path.getsize(path) == len(good)
    assert os.listdir(tmp_path) == ["model.snpx"]


def test_a_failed_commit_leaves_a_finished_writer(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "f.snpx"
    writer = CheckpointWriter(path)
    writer.write("a", np.zeros(4))
    _native.fault_arm("fsync", 1, "EIO")
    try:
        with pytest.raises(errors.DurabilityError):
            writer.commit()
    finally:
        _native.fault_arm("write", 0, "kill")
    with pytest.raises(errors.CheckpointClosedError, match="commit failed"):
        writer.commit()  # a retry would write the table over nothing
    assert os.listdir(tmp_path) == []


def test_a_reader_dropped_without_close_closes_its_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "r.snpx"
    with CheckpointWriter(path) as w:
        w.write("a", np.arange(100, dtype=np.int64))

    def open_on_file() -> int:  # this file's descriptors only: other tests' threads may close theirs meanwhile
        fds = os.listdir("/proc/self/fd")
        return sum(1 for fd in fds if os.path.realpath(f"/proc/self/fd/{fd}") == str(path.resolve()))

    for _ in range(50):
        reader = CheckpointReader(path)
        assert reader.names() == ["a"]
        del reader  # no close(): its finalizer closes the file
    assert open_on_file() == 0
    kept = CheckpointReader(path).read("a")  # the reader is gone at once, its array stays valid
    np.testing.assert_array_equal(kept, np.arange(100))
    del kept  # the mapping (and the descriptor Python's mmap keeps) goes with the last array
    assert open_on_file() == 0


def test_reading_after_close_is_a_typed_error_and_earlier_arrays_stay_valid(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "r.snpx"
    with CheckpointWriter(path) as w:
        w.write("a", np.arange(10, dtype=np.int32))
        w.write("b", np.ones(3))
    reader = CheckpointReader(path)
    a = reader.read("a")
    reader.close()
    reader.close()  # idempotent
    for use in (lambda: reader.read("b"), lambda: reader.raw("a"), lambda: reader.read("a"), reader.read_all,
                lambda: reader.padding_is_zero(reader.entry("b")), reader.fileno):
        with pytest.raises(errors.CheckpointClosedError, match="closed"):
            use()
    np.testing.assert_array_equal(a, np.arange(10))  # still mapped: it was handed out before close()
    assert reader.names() == ["a", "b"] and reader.metadata == {}  # the table was read at open


def test_a_fifo_is_refused_at_once_instead_of_waiting_for_a_writer(tmp_path: pathlib.Path) -> None:
    fifo = tmp_path / "pipe.snpx"
    os.mkfifo(fifo)
    outcome: list[object] = []
    thread = threading.Thread(target=lambda: outcome.append(validate_checkpoint(fifo)), daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():  # blocked in open(): let it go (a writer end that closes at once), then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail("validate_checkpoint waited for a writer on a FIFO")
    ok, problems = outcome[0]  # type: ignore[misc]
    assert not ok and "FIFO" in problems[0] and "not a checkpoint file" in problems[0]
    with pytest.raises(errors.CheckpointFormatError, match="FIFO"):
        CheckpointReader(fifo)


@pytest.mark.parametrize("metadata, config", [
    ({"note": "\ud800"}, None),
    ({"\udc80": "x"}, None),
    ({}, {"tokenizer": {"unk": "\udfff"}}),
    ({}, {"\ud800": 1}),
])
def test_text_that_utf8_cannot_store_is_refused_when_the_writer_is_made(tmp_path: pathlib.Path, metadata: dict,
                                                                        config: object) -> None:
    """A lone surrogate is a Python str but not Unicode text: refused up front, not at commit with an untyped
    UnicodeEncodeError after every tensor was written."""
    path = tmp_path / "s.snpx"
    with pytest.raises(errors.UnsupportedTensorError, match="not valid Unicode"), \
            CheckpointWriter(path, metadata=metadata, config=config) as w:
        w.write("a", np.zeros(1 << 16))
    assert os.listdir(tmp_path) == []
    with CheckpointWriter(path, metadata={"note": "emoji \U0001f600 and é"}, config={"s": "\U0001f600"}) as w:
        w.write("a", np.zeros(1))  # a surrogate *pair* in JSON is one real character: fine
    with CheckpointReader(path) as r:
        assert r.metadata == {"note": "emoji \U0001f600 and é"} and r.config == {"s": "\U0001f600"}
