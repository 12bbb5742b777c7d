"""CheckpointCoordinator against real files: recipe 2, snapshots, bounded staging, errors, retention, rollback."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
import tracemalloc

import numpy as np
import pytest

from SneppX_ALG import (
    CheckpointCoordinator,
    Transformer,
    _native,
    coordinator,
    errors,
    storage,
    validate_checkpoint,
)

MiB = 1 << 20


def state_for(step: int, big: int = 2 * MiB) -> dict:
    rng = np.random.default_rng(step)
    return {
        "layer": {"w": rng.standard_normal((300, 257)).astype(np.float32), "b": rng.standard_normal(257)},
        "embed": rng.integers(0, 255, big, dtype=np.uint8).reshape(-1, 1024),
        "scalar": np.int64(step),
        "lr": 0.5 * step,
    }


def assert_same_tree(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, dict):
            assert_same_tree(got[key], value)
        elif isinstance(value, (np.ndarray, np.generic)):
            assert np.asarray(got[key]).dtype == np.asarray(value).dtype
            assert np.asarray(got[key]).tobytes() == np.asarray(value).tobytes(), key
        else:
            assert got[key] == value


def empty_like(tree: dict) -> dict:
    return {k: empty_like(v) if isinstance(v, dict) else (np.zeros_like(v) if isinstance(v, np.ndarray) else None)
            for k, v in tree.items()}


@pytest.fixture(autouse=True)
def _disarm_faults():
    yield
    _native.fault_arm("write", 0, "kill")  # countdown 0: disarmed


def test_recipe_2_runs_as_written_with_a_local_root(tmp_path) -> None:
    model = Transformer(vocab_size=1000, dim=128, num_heads=4, num_layers=2, ffn_dim=512, max_seq_len=64)
    coord = CheckpointCoordinator(
        checkpoint_root=str(tmp_path / "ckpts"),
        save_every_n_steps=1000,
        max_to_keep=5,
        async_save=True,                # background I/O thread
    )
    coord.save(model, step=1000)        # returns immediately
    coord.wait()
    assert coord.latest().step == 1000
    fresh = Transformer(vocab_size=1000, dim=128, num_heads=4, num_layers=2, ffn_dim=512, max_seq_len=64, seed=1)
    assert coord.restore(fresh).step == 1000
    for name, value in model.state_dict().items():
        assert fresh.state_dict()[name].tobytes() == value.tobytes(), name
    coord.close()


def test_save_snapshots_so_changes_after_it_returns_are_not_saved(tmp_path) -> None:
    state = state_for(1, big=8 * MiB)
    want = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in state.items()}
    want["layer"] = {k: v.copy() for k, v in state["layer"].items()}
    with CheckpointCoordinator(tmp_path, staging_bytes=64 * MiB) as coord:
        coord.save(state, step=1)
        state["embed"][:] = 0  # training goes on while the write is in flight
        state["layer"]["w"] *= -1
    got = empty_like(want)
    with CheckpointCoordinator(tmp_path) as coord:
        info = coord.restore(got)
    assert info.step == 1
    assert_same_tree(got, want)


def test_state_larger_than_staging_streams_through_bounded_buffers(tmp_path) -> None:
    state = state_for(2, big=6 * MiB)
    with CheckpointCoordinator(tmp_path, staging_bytes=1 * MiB) as coord:
        coord.save(state, step=2)
        coord.wait()
        assert 0 < coord.staging_allocated_bytes <= 1 * MiB
    manifest = json.loads((tmp_path / "step-000000002" / "manifest.json").read_bytes())
    embed = next(t for t in manifest["tensors"] if t["path"] == ["embed"])
    assert len(embed["chunks"]) >= 12, "a 6 MiB tensor must be split to pass through 512 KiB buffers"
    got = empty_like(state)
    with CheckpointCoordinator(tmp_path) as coord:
        coord.restore(got)
    assert_same_tree(got, state)


def test_training_state_travels_in_the_manifest_and_must_be_json(tmp_path) -> None:
    rng = np.random.default_rng(5)
    rng_state = rng.bit_generator.state
    with CheckpointCoordinator(tmp_path) as coord:
        coord.save({"w": np.ones(4)}, step=3, training_state={"data_position": 1234, "rng": rng_state})
        with pytest.raises(errors.UnsupportedTensorError, match="training_state must be JSON-safe"):
            coord.save({"w": np.ones(4)}, step=4, training_state={"bad": float("nan")})
        coord.wait()
        info = coord.latest()
    assert info.step == 3 and info.training_state["data_position"] == 1234
    restored = np.random.default_rng()
    restored.bit_generator.state = info.training_state["rng"]
    assert restored.random() == rng.random()
    assert coord.committed_steps() == [3], "a refused save leaves nothing behind"


def test_synchronous_mode_is_committed_when_save_returns(tmp_path) -> None:
    with CheckpointCoordinator(tmp_path, async_save=False) as coord:
        coord.save(state_for(9), step=9)
        assert coord.committed_steps() == [9]
        assert (tmp_path / "step-000000009" / "shard-00000.snpx").exists()


# Both write modes: buffered appends fail inside the write of a staged piece, where the kept error's frames once
# held a staging view with an array over it, which crashed the interpreter when collected.
@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_disk_full_in_the_background_is_raised_by_the_next_call_and_loses_nothing(tmp_path, monkeypatch,
                                                                                  mode: str) -> None:
    monkeypatch.setenv("SNEPPX_WRITE_MODE", mode)
    with CheckpointCoordinator(tmp_path) as coord:
        coord.save(state_for(1), step=1)
        coord.wait()
        _native.fault_arm("write", 1, "ENOSPC")
        coord.save(state_for(2), step=2)  # returns: the failure happens in the background
        with pytest.raises(errors.DiskFullError) as info:
            coord.wait()
        assert info.value.errno == errno.ENOSPC
        coord.wait()  # raised once, not forever
        assert coord.committed_steps() == [1]
        assert coord.latest().step == 1
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], "the failed step left files"
        coord.save(state_for(3), step=3)  # and the coordinator goes on working
    assert CheckpointCoordinator(tmp_path).latest().step == 3


@pytest.mark.parametrize("sites, countdown, expected", [
    ("fsync", 1, errors.DurabilityError),    # the shard file
    ("fsync", 2, errors.DurabilityError),    # the manifest
    ("dirsync", 1, errors.DurabilityError),  # the directory after the shard's rename
    ("rename", 2, errors.StorageError),      # the manifest's rename
    ("rename", 3, errors.StorageError),      # the commit rename itself
    ("dirsync", 3, errors.DurabilityError),  # the root directory after the commit rename
])
def test_a_failing_fsync_or_rename_fails_the_save_with_a_typed_error(tmp_path, sites, countdown, expected) -> None:
    with CheckpointCoordinator(tmp_path) as coord:
        coord.save(state_for(1), step=1)
        coord.wait()
        _native.fault_arm(sites, countdown, "EIO")
        coord.save(state_for(2), step=2)
        with pytest.raises(errors.StorageError) as info:
            coord.wait()
        assert isinstance(info.value, expected)
        assert info.value.errno == errno.EIO
        # A failed save is never visible, even when only the fsync after the commit rename failed.
        assert coord.committed_steps() == [1]
        assert coord.latest().step == 1
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], "the failed step left files"
    after = CheckpointCoordinator(tmp_path)
    assert after.committed_steps() == [1]
    got = empty_like(state_for(1))
    assert after.restore(got).step == 1
    assert_same_tree(got, state_for(1))


def test_background_errors_are_raised_by_the_next_save(tmp_path) -> None:
    coord = CheckpointCoordinator(tmp_path)
    _native.fault_arm("fsync", 1, "ENOSPC")
    coord.save(state_for(1), step=1)
    while coord.saving:  # let it fail without consuming the error (pytest-timeout bounds this)
        time.sleep(0.01)
    with pytest.raises(errors.DiskFullError):
        coord.save(state_for(2), step=2)
    coord.close()


def test_retention_keeps_max_to_keep_and_every_nth(tmp_path) -> None:
    with CheckpointCoordinator(tmp_path, save_every_n_steps=10, max_to_keep=2, keep_every_n_steps=30) as coord:
        for step in range(0, 100, 10):
            assert coord.should_save(step)
            coord.save({"w": np.full(10, step)}, step=step)
            assert not coord.should_save(step)
        coord.wait()
        assert coord.committed_steps() == [0, 30, 60, 80, 90]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_latest_skips_and_reports_a_corrupt_newest_checkpoint_and_restore_rolls_back(tmp_path) -> None:
    with CheckpointCoordinator(tmp_path, max_to_keep=None) as coord:
        for step in (1, 2):
            coord.save(state_for(step), step=step)
    shard = tmp_path / "step-000000002" / "shard-00000.snpx"
    with open(shard, "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0x40]))
    coord = CheckpointCoordinator(tmp_path, max_to_keep=1)
    assert coord.latest().step == 1
    assert [s.step for s in coord.skipped] == [2] and "CRC32C" in coord.skipped[0].problems[0]
    got = empty_like(state_for(1))
    assert coord.restore(got).step == 1
    assert_same_tree(got, state_for(1))
    with pytest.raises(errors.ManifestError, match="step 2 is not valid"):
        coord.restore(empty_like(state_for(2)), step=2)
    # Training replays step 2: the invalid copy is set aside, the new one commits, and retention
    # (max_to_keep=1) may now drop step 1 because a newer valid one exists.
    coord.save(state_for(2), step=2)
    coord.close()
    assert coord.committed_steps() == [2]
    assert CheckpointCoordinator(tmp_path).validate(2) == []
    assert any(p.startswith(".invalid-step-000000002") for p in os.listdir(tmp_path))


def test_a_valid_committed_step_is_never_overwritten(tmp_path) -> None:
    with CheckpointCoordinator(tmp_path) as coord:
        coord.save({"w": np.ones(3)}, step=5)
        with pytest.raises(errors.CheckpointExistsError):
            coord.save({"w": np.zeros(3)}, step=5)
    coord = CheckpointCoordinator(tmp_path)
    coord.save({"w": np.zeros(3)}, step=5)  # a new process doesn't know: the commit refuses
    with pytest.raises(errors.CheckpointExistsError):
        coord.wait()
    got = {"w": np.zeros(3)}
    coord.restore(got)
    assert list(got["w"]) == [1, 1, 1]


def test_a_step_without_manifest_or_with_a_lying_manifest_is_skipped(tmp_path) -> None:
    with CheckpointCoordinator(tmp_path, max_to_keep=None) as coord:
        for step in (1, 2, 3):
            coord.save({"w": np.full(4, step)}, step=step)
    os.unlink(tmp_path / "step-000000003" / "manifest.json")
    manifest = json.loads((tmp_path / "step-000000002" / "manifest.json").read_bytes())
    manifest["tensors"][0]["chunks"][0]["crc32c"] ^= 1
    (tmp_path / "step-000000002" / "manifest.json").write_text(json.dumps(manifest))
    coord = CheckpointCoordinator(tmp_path)
    assert coord.latest().step == 1
    assert {s.step for s in coord.skipped} == {2, 3}


def test_a_flipped_bit_in_the_training_state_of_an_unsigned_step_is_caught(tmp_path) -> None:
    """The manifest's checksum covers what no tensor CRC does: the training state (data position, epoch)."""
    with CheckpointCoordinator(tmp_path, max_to_keep=None) as coord:
        for step in (1, 2):
            coord.save({"w": np.full(4, step)}, step=step, training_state={"data_position": 123456 + step})
    path = tmp_path / "step-000000002" / "manifest.json"
    raw = bytearray(path.read_bytes())
    at = raw.index(b"123458") + 5
    raw[at] ^= 0x01  # "123458" -> "123459": still JSON, still a number, another data position
    path.write_bytes(bytes(raw))
    coord = CheckpointCoordinator(tmp_path)
    assert any("checksum mismatch" in p for p in coord.validate(2))
    info = coord.latest()
    assert info.step == 1 and info.training_state == {"data_position": 123457}
    assert [s.step for s in coord.skipped] == [2]
    ok, problems = validate_checkpoint(tmp_path / "step-000000002")
    assert not ok and "checksum mismatch" in problems[0]


def test_leftovers_of_an_interrupted_save_are_invisible_and_cleaned_at_start(tmp_path) -> None:
    with CheckpointCoordinator(tmp_path) as coord:
        coord.save({"w": np.ones(4)}, step=1)
    (tmp_path / ".tmp-step-000000002-1-abcd").mkdir()
    (tmp_path / ".tmp-step-000000002-1-abcd" / "shard-00000.snpx").write_bytes(b"partial")
    (tmp_path / ".deleting-step-000000000-ab").mkdir()
    assert storage.LocalStorage(str(tmp_path)).committed_steps() == [1]
    CheckpointCoordinator(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["step-000000001"]


def test_no_checkpoint_yet_is_none_not_an_error(tmp_path) -> None:
    coord = CheckpointCoordinator(tmp_path)
    assert coord.latest() is None
    assert coord.restore({"w": np.zeros(1)}) is None
    with pytest.raises(errors.CheckpointNotFoundError):
        coord.restore({"w": np.zeros(1)}, step=7)


def test_a_closed_coordinator_refuses_new_saves(tmp_path) -> None:
    coord = CheckpointCoordinator(tmp_path)
    coord.close()
    coord.close()  # idempotent
    with pytest.raises(errors.CoordinatorClosedError):
        coord.save({"w": np.ones(1)}, step=1)


def test_bad_arguments_are_refused_up_front(tmp_path) -> None:
    with pytest.raises(ValueError):
        CheckpointCoordinator(tmp_path, max_to_keep=-1)
    with pytest.raises(ValueError):
        CheckpointCoordinator(tmp_path, staging_bytes=10)
    with pytest.raises(ValueError, match="unsupported checkpoint root"):
        CheckpointCoordinator("gs://bucket/x")
    with CheckpointCoordinator(tmp_path) as coord:
        with pytest.raises(ValueError):
            coord.save({"w": np.ones(1)}, step=-1)
        with pytest.raises(errors.UnsupportedTensorError):
            coord.save(["not", "a", "state"], step=1)
    assert coordinator.CheckpointCoordinator(tmp_path).committed_steps() == []


@pytest.mark.parametrize("key, reason", [("emb\x00", "NUL"), ("emb\udc80", "not valid Unicode"),
                                         ("x" * 1025, "longer than 1024 bytes")])
def test_a_tensor_name_the_format_refuses_fails_the_save_that_passed_it(tmp_path, key, reason) -> None:
    """Checked in save() by the format's own rule, not first on the background thread, whose error used to
    surface as the failure of the next, correct save()."""
    with CheckpointCoordinator(tmp_path, max_to_keep=None) as coord:
        with pytest.raises(errors.UnsupportedTensorError, match=reason):
            coord.save({"ok": np.ones(4), key: np.ones(4)}, step=1)
        coord.save({"ok": np.ones(4)}, step=2)
        coord.wait()
        assert coord.committed_steps() == [2]
    restored: dict = {}
    with CheckpointCoordinator(tmp_path) as resumed:
        assert resumed.restore(restored).step == 2
    np.testing.assert_array_equal(restored["ok"], np.ones(4))


def test_saving_says_whether_a_save_is_still_in_flight(tmp_path) -> None:
    at_commit, go_on = threading.Event(), threading.Event()

    def held_commit() -> None:  # the writer thread, right before the commit point
        at_commit.set()
        assert go_on.wait(60)

    coord = CheckpointCoordinator(tmp_path, commit_fence=held_commit, device="cpu")
    assert not coord.saving
    coord.save(state_for(1), step=1)  # returns once staged: the write and the commit go on
    assert at_commit.wait(60)
    assert coord.saving
    go_on.set()
    coord.wait()
    assert not coord.saving and coord.committed_steps() == [1]
    coord.close()


def test_close_on_another_thread_waits_for_a_save_in_progress(tmp_path) -> None:
    """close() takes the save lock: a save that already started is written and committed, never submitted to
    a stopped writer (which left wait() hanging)."""
    in_save, go_on = threading.Event(), threading.Event()

    class SlowModel:
        def state_dict(self) -> dict:
            in_save.set()
            assert go_on.wait(60)
            return {"w": np.arange(16.0)}

        def load_state_dict(self, state: dict) -> None:
            self.loaded = state

    coord = CheckpointCoordinator(tmp_path)
    saver = threading.Thread(target=coord.save, args=(SlowModel(), 3))
    saver.start()
    assert in_save.wait(60)
    closer = threading.Thread(target=coord.close)
    closer.start()
    closer.join(0.5)  # room for a close() that doesn't wait for the lock to finish first
    go_on.set()
    saver.join(60)
    closer.join(60)
    assert not saver.is_alive() and not closer.is_alive()
    model = SlowModel()
    assert CheckpointCoordinator(tmp_path).restore(model).step == 3
    assert model.loaded["w"].tolist() == list(np.arange(16.0))


@pytest.mark.parametrize("make, most", [
    (lambda: np.arange(4 * MiB, dtype=np.float32).reshape(2048, 2048).T, 0.5),    # row blocks
    (lambda: np.arange(4 * MiB, dtype=">f4").reshape(2048, 2048)[:, ::-1], 0.5),  # big-endian, reversed
    (lambda: np.arange(8 * MiB, dtype=np.float32).reshape(4 * MiB, 2).T[:1], 1.5),  # one row: flat ranges
])
def test_a_non_contiguous_tensor_is_staged_without_a_full_copy_per_piece(tmp_path, make, most) -> None:
    """A 16 MiB non-contiguous tensor in 1 MiB pieces: a row block converts only its own rows, flat ranges
    share one converted copy of the tensor. Before, every piece converted the whole tensor (two copies alive
    at once at the peak, 16 full copies in all)."""
    tensor = make()
    assert not tensor.flags.c_contiguous
    with CheckpointCoordinator(tmp_path, staging_bytes=2 * MiB) as coord:
        tracemalloc.start()
        try:
            coord.save({"t": tensor}, step=1)
            coord.wait()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < most * tensor.nbytes
    got = {"t": np.zeros(tensor.shape, tensor.dtype.newbyteorder("<"))}
    CheckpointCoordinator(tmp_path).restore(got)
    assert np.array_equal(got["t"], tensor)


def test_a_commit_fence_that_refuses_keeps_the_step_from_committing(tmp_path) -> None:
    """The ElasticTrainer's fence: once a newer membership generation exists, the old one commits nothing."""
    over = False

    def fence() -> None:
        if over:
            raise errors.StaleGenerationError("generation 3 is over: generation 4 is sealed", generation=3)

    state = {"w": np.arange(1000, dtype=np.float32)}
    with CheckpointCoordinator(str(tmp_path), device="cpu", commit_fence=fence) as coord:
        coord.save(state, step=1)
        coord.wait()
        over = True
        coord.save(state, step=2)
        with pytest.raises(errors.StaleGenerationError):
            coord.wait()
        assert coord.committed_steps() == [1] and coord.latest().step == 1
