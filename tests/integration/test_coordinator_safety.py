"""What the checkpoint store must never do, on real files and real S3 servers (moto, versitygw) (issue 9).

Retention never deletes the newest step that validates; a coordinator that could only save steps it would
itself reject is refused; a restore to an older step starts a new timeline whose abandoned steps are fenced
off durably before the first new save commits; restore loads exactly the bytes it validated; a read error is
retried and raised, never taken for a bad step; set-aside steps are bounded by retention.
"""

from __future__ import annotations

import errno
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from test_signed_coordinator import forge_shard_keeping_crcs  # tests/integration is on sys.path

from SneppX_ALG import CheckpointCoordinator, _native, errors, storage
from SneppX_ALG.checkpoint import scan, signing, validate
from SneppX_ALG.coordinator import engine, steps, timeline

MiB = 1 << 20
SHARD = "shard-00000.snpx"


def state_for(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((64, 33)).astype(np.float32),
            "embed": rng.integers(0, 255, 3 * MiB, dtype=np.uint8).reshape(-1, 1024),
            "step": step}


def empty_state() -> dict:
    return {"w": None, "embed": None, "step": None}


def assert_is_state(got: dict, step: int) -> None:
    want = state_for(step)
    assert got["w"].tobytes() == want["w"].tobytes()
    assert got["embed"].tobytes() == want["embed"].tobytes()
    assert got["step"] == step


def small(step: int) -> dict:
    return {"w": np.full(16, step, dtype=np.int64)}


def step_dirs(root: pathlib.Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.fixture(autouse=True)
def _disarm_faults():
    yield
    _native.fault_arm("write", 0, "kill")  # countdown 0: disarmed


@pytest.fixture
def keys() -> tuple:
    private, public = signing.generate_keypair()
    other, other_public = signing.generate_keypair()
    return private, public, other, other_public


def flip_byte(path: pathlib.Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.fixture
def corrupting_disk(monkeypatch):
    """A disk that does not keep what was written: after `corrupt_from` (a step number), every step's shard
    gets a flipped data byte right after its commit point, before retention runs."""
    corrupt_from: list[int] = []
    finalize = storage.LocalStorage.finalize

    def finalize_then_rot(self, pending, manifest, signature, parts):
        final = finalize(self, pending, manifest, signature, parts)
        if corrupt_from and pending.step >= corrupt_from[0]:
            flip_byte(pathlib.Path(final) / SHARD, 4096 + 3)
        return final

    monkeypatch.setattr(storage.LocalStorage, "finalize", finalize_then_rot)
    return corrupt_from


# ---- item 1: retention keeps the newest valid step; a coordinator that can't save valid steps is refused ------


def test_a_signing_key_the_coordinator_does_not_trust_is_refused_at_construction(tmp_path, keys) -> None:
    private, public, _, other_public = keys
    with pytest.raises(errors.SigningKeyNotTrustedError, match="not among trusted_keys"):
        CheckpointCoordinator(tmp_path, signing_key=private, trusted_keys=[other_public])
    assert list(tmp_path.iterdir()) == []
    # after a key rotation both are trusted: fine
    CheckpointCoordinator(tmp_path, signing_key=private, trusted_keys=[public, other_public]).close()
    # a reader with trusted keys may read, but not save unsigned steps it would reject
    reader = CheckpointCoordinator(tmp_path, trusted_keys=[public])
    with pytest.raises(errors.SigningKeyNotTrustedError, match="no signing_key"):
        reader.save(small(1), step=1)
    reader.close()
    assert reader.committed_steps() == []


def test_retention_never_deletes_the_newest_step_that_validates(tmp_path, corrupting_disk) -> None:
    """Every new step rots on disk after its commit: the saves report it, and step 1 (the last valid one)
    survives max_to_keep=1, in this process and the next."""
    with CheckpointCoordinator(tmp_path, max_to_keep=1) as coord:
        coord.save(small(1), step=1)
        coord.wait()
        corrupting_disk.append(2)
        for step in (2, 3, 4):
            coord.save(small(step), step=step)
            with pytest.raises(errors.CommittedStepInvalidError, match=f"step {step} was committed but"):
                coord.wait()
        assert 1 in coord.committed_steps()
        assert coord.latest().step == 1
    corrupting_disk.clear()
    reader = CheckpointCoordinator(tmp_path)
    got = {"w": np.zeros(16, np.int64)}
    assert reader.restore(got).step == 1 and list(got["w"]) == [1] * 16
    # and once a valid step is committed again, retention may let the old one go
    with CheckpointCoordinator(tmp_path, max_to_keep=1) as coord:
        coord.save(small(5), step=5)
    assert CheckpointCoordinator(tmp_path).committed_steps() == [5]


def test_retention_reads_a_step_back_only_when_a_deletion_could_touch_the_newest_valid_one(
        tmp_path, monkeypatch) -> None:
    """The cost: with max_to_keep=k, about one validation per k saves (none when nothing is deleted)."""
    checked: list[int] = []
    check_step = validate.check_step
    monkeypatch.setattr(validate, "check_step", lambda local, step, keys=None, open_step=None: (
        checked.append(step), check_step(local, step, keys, open_step))[1])
    with CheckpointCoordinator(tmp_path, max_to_keep=None) as coord:
        for step in range(12):
            coord.save(small(step), step=step)
    assert checked == []
    with CheckpointCoordinator(tmp_path / "k3", max_to_keep=3) as coord:
        for step in range(12):
            coord.save(small(step), step=step)
    assert 1 <= len(checked) <= 12 // 3 + 1, checked
    assert CheckpointCoordinator(tmp_path / "k3").committed_steps() == [9, 10, 11]


def test_a_failed_save_with_max_to_keep_1_keeps_the_only_checkpoint(tmp_path) -> None:
    """Retention runs after the commit point: moved before it, a save that fails at its commit would
    leave no checkpoint at all (and a successful one would leave two)."""
    with CheckpointCoordinator(tmp_path, max_to_keep=1) as coord:
        coord.save(small(1), step=1)
        coord.wait()
        _native.fault_arm("rename", 3, "EIO")  # shard, manifest, then the commit rename of step 2
        coord.save(small(2), step=2)
        with pytest.raises(errors.StorageError):
            coord.wait()
        assert coord.committed_steps() == [1]
        assert coord.latest().step == 1
        coord.save(small(3), step=3)
        coord.wait()
        assert coord.committed_steps() == [3]
    assert step_dirs(tmp_path) == [storage.step_name(3)]


def test_staging_memory_changed_before_the_write_fails_the_save_and_commits_nothing(tmp_path, monkeypatch) -> None:
    """The writer's CRC of each piece is checked against the snapshot's: bytes that changed in staging
    between snapshot and write are never committed."""
    write_buffer = engine.Engine._write_buffer

    def flip_then_write(self, job, slot, pieces):
        if job.step == 2:
            view = self.pool.copier.view(self.pool.buffer(slot), self.pool.size)
            view[pieces[0].offset] ^= 0x01
            del view
        return write_buffer(self, job, slot, pieces)

    monkeypatch.setattr(engine.Engine, "_write_buffer", flip_then_write)
    with CheckpointCoordinator(tmp_path, max_to_keep=None) as coord:
        coord.save(small(1), step=1)
        coord.save(small(2), step=2)
        with pytest.raises(errors.ChecksumMismatchError, match="changed in staging memory"):
            coord.wait()
        assert coord.committed_steps() == [1]
    assert step_dirs(tmp_path) == [storage.step_name(1)]


# ---- item 6: a restore to an older step starts a new timeline ----------------------------------------------


def save_steps(root: str, numbers: list[int], **kwargs) -> None:
    with CheckpointCoordinator(root, max_to_keep=None, staging_bytes=2 * MiB, **kwargs) as coord:
        for step in numbers:
            coord.save(state_for(step), step=step)


def test_after_a_rollback_the_abandoned_steps_are_fenced_before_the_first_new_save_commits(tmp_path) -> None:
    save_steps(str(tmp_path), [1000, 2000, 3000, 4000])
    coord = CheckpointCoordinator(tmp_path, max_to_keep=3, staging_bytes=2 * MiB)
    got = empty_state()
    assert coord.restore(got, step=2000).step == 2000
    assert_is_state(got, 2000)
    assert coord.latest().step == 2000 and coord.committed_steps() == [1000, 2000]
    for step in (2100, 2200):
        coord.save(state_for(step), step=step)
    coord.wait()
    # the case: retention counted the abandoned 3000/4000 as the newest and deleted 2000
    assert coord.committed_steps() == [1000, 2000, 2100, 2200][-3:]
    names = step_dirs(tmp_path)
    assert [n for n in names if n.startswith("step-")] == [storage.step_name(s) for s in (2000, 2100, 2200)]
    assert sum(n.startswith(".abandoned-step-000003000-") for n in names) == 1
    assert sum(n.startswith(".abandoned-step-000004000-") for n in names) == 1
    assert timeline.FENCE_RECORD not in names  # the fence finished: nothing left to skip
    coord.close()
    # a restart in a new process resumes on the new timeline
    script = f"from SneppX_ALG import CheckpointCoordinator as C; print(C({str(tmp_path)!r}).latest().step)"
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "2200"
    # reusing a step number of the abandoned timeline just works
    with CheckpointCoordinator(tmp_path, max_to_keep=3, staging_bytes=2 * MiB) as again:
        assert again.restore(empty_state()).step == 2200
        again.save(state_for(3001), step=3000)
    got = empty_state()
    assert CheckpointCoordinator(tmp_path).restore(got).step == 3000
    assert got["embed"].tobytes() == state_for(3001)["embed"].tobytes()


def test_the_same_coordinator_saves_its_abandoned_step_numbers_again(tmp_path) -> None:
    with CheckpointCoordinator(tmp_path, max_to_keep=None) as coord:
        for step in (1, 2, 3):
            coord.save(small(step), step=step)
        got = {"w": np.zeros(16, np.int64)}
        assert coord.restore(got, step=1).step == 1 and got["w"][0] == 1
        coord.save(small(20), step=2)  # not "already saved by this coordinator": that step was abandoned
        coord.save(small(30), step=3)
    got = {"w": np.zeros(16, np.int64)}
    assert CheckpointCoordinator(tmp_path).restore(got).step == 3 and got["w"][0] == 30


def test_a_fence_cut_short_by_a_kill_still_hides_the_abandoned_steps_and_the_next_writer_finishes_it(
        tmp_path) -> None:
    save_steps(str(tmp_path), [1000, 2000, 3000, 4000])
    # renames: the restore's rollback record, then the first save's fence record, then its first set-aside
    # (4000), before the save writes anything (so nothing of a set-aside step can be overwritten by the new one)
    script = textwrap.dedent(f"""
        import numpy as np
        from SneppX_ALG import CheckpointCoordinator
        coord = CheckpointCoordinator({str(tmp_path)!r}, max_to_keep=None, async_save=False)
        coord.restore({{"w": None, "embed": None, "step": None}}, step=2000)
        coord.save({{"w": np.zeros(3)}}, step=2100)
        print("not killed")
    """)
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "SNEPPX_FAULT": "rename:3:kill"})
    assert result.returncode == -9, result.stderr + result.stdout
    names = step_dirs(tmp_path)
    assert timeline.FENCE_RECORD in names and storage.step_name(4000) in names  # cut before any move
    assert not [n for n in names if n.startswith(".tmp-step-000002100-")]
    CheckpointCoordinator(tmp_path).close()  # a start's cleanup: the dead writer's temporary directory only
    names = step_dirs(tmp_path)
    assert timeline.FENCE_RECORD in names and not [n for n in names if n.startswith(".tmp-")]
    reader = CheckpointCoordinator(tmp_path, read_only=True)
    assert reader.committed_steps() == [1000, 2000]
    got = empty_state()
    assert reader.latest().step == 2000 and reader.restore(got).step == 2000
    with CheckpointCoordinator(tmp_path, max_to_keep=None, staging_bytes=2 * MiB) as writer:
        writer.save(state_for(2100), step=2100)
    names = step_dirs(tmp_path)
    assert timeline.FENCE_RECORD not in names
    assert [n for n in names if n.startswith("step-")] == [storage.step_name(s) for s in (1000, 2000, 2100)]
    assert CheckpointCoordinator(tmp_path).latest().step == 2100


def test_restoring_the_newest_step_or_only_reading_fences_nothing(tmp_path) -> None:
    save_steps(str(tmp_path), [1, 2, 3])
    reader = CheckpointCoordinator(tmp_path)
    reader.restore(empty_state(), step=1)  # an evaluator looking at an old step, never saving
    reader.close()
    with CheckpointCoordinator(tmp_path, read_only=True) as evaluator:  # a reader's restore is not a rollback
        assert evaluator.restore(empty_state(), step=1).step == 1
        assert evaluator.latest().step == 3 and evaluator.committed_steps() == [1, 2, 3]
    with CheckpointCoordinator(tmp_path, max_to_keep=None, staging_bytes=2 * MiB) as coord:
        assert coord.restore(empty_state()).step == 3
        coord.save(state_for(4), step=4)
    assert CheckpointCoordinator(tmp_path).committed_steps() == [1, 2, 3, 4]
    assert not [n for n in step_dirs(tmp_path) if n.startswith(".")]


def test_a_corrupt_fence_record_is_a_typed_error_not_a_guess(tmp_path) -> None:
    save_steps(str(tmp_path), [1, 2])
    (tmp_path / timeline.FENCE_RECORD).write_bytes(b"{not json")
    with pytest.raises(errors.FenceRecordError):
        CheckpointCoordinator(tmp_path).latest()


# ---- item 15: set-aside steps are bounded by retention -----------------------------------------------------


def test_set_aside_steps_are_bounded_by_retention(tmp_path) -> None:
    save_steps(str(tmp_path), [1, 2, 3, 4, 5])
    for step in (3, 4, 5):
        flip_byte(tmp_path / storage.step_name(step) / SHARD, 4096 + 3)
    with CheckpointCoordinator(tmp_path, max_to_keep=2, staging_bytes=2 * MiB) as coord:
        assert coord.restore(empty_state()).step == 2
        assert [s.step for s in coord.skipped] == [5, 4, 3]
        coord.save(state_for(3), step=3)
    names = step_dirs(tmp_path)
    aside = [n for n in names if n.startswith(".")]
    assert len(aside) == 2 and all(n.startswith(".invalid-step-") for n in aside), names
    assert {storage.parse_set_aside_name(n) for n in aside} == {4, 5}  # the newest kept, for inspection
    assert [n for n in names if n.startswith("step-")] == [storage.step_name(2), storage.step_name(3)]


# ---- item 8: what restore loads is what it validated -----------------------------------------------------


def forge_keeping_crcs(shard: pathlib.Path, out: pathlib.Path) -> None:
    """A copy of `shard` with bytes of one tensor changed so that every CRC32C still holds."""
    out.write_bytes(shard.read_bytes())
    forge_shard_keeping_crcs(out, "w")


def test_a_shard_swapped_after_it_was_checked_is_not_what_restore_loads(tmp_path, keys, monkeypatch) -> None:
    """An attacker renames a forged shard (every CRC kept) over the verified one as soon as it was opened
    for checking: restore reads through the descriptor it checked, so it loads the signed bytes."""
    private, public, _, _ = keys
    save_steps(str(tmp_path / "root"), [1, 2], signing_key=private)
    shard = tmp_path / "root" / storage.step_name(2) / SHARD
    forged = tmp_path / "forged.snpx"
    forge_keeping_crcs(shard, forged)
    real_open = os.open
    swapped: list[str] = []

    def open_then_swap(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if os.fspath(path) == str(shard) and not swapped:
            os.rename(forged, shard)
            swapped.append(str(path))
        return fd

    monkeypatch.setattr(os, "open", open_then_swap)
    reader = CheckpointCoordinator(tmp_path / "root", trusted_keys=[public])
    got = empty_state()
    info = reader.restore(got)
    monkeypatch.setattr(os, "open", real_open)
    assert swapped, "the shard was never opened"
    assert info.step == 2
    assert_is_state(got, 2)
    # the swap did happen: the file on disk is the forgery now, which a fresh check rejects
    assert reader.validate(2)[0].startswith("DigestMismatchError:")


def test_a_shard_changed_in_place_while_it_loads_is_refused(tmp_path, keys, monkeypatch) -> None:
    """Bytes changed after the load started are hashed as they are read: the digest fails, nothing loads."""
    private, public, _, _ = keys
    save_steps(str(tmp_path), [1, 2], signing_key=private)
    shard = tmp_path / storage.step_name(2) / SHARD
    size = shard.stat().st_size
    read_at = _native.read_at
    changed: list[bool] = []

    def read_then_change(fd, buffer, offset, crc=0, *, path=None):
        value = read_at(fd, buffer, offset, crc, path=path)
        if path == str(shard) and offset == 0 and not changed:
            with open(shard, "r+b") as f:  # the last data bytes, not read yet
                forge_offset = size - 3 * 4096
                f.seek(forge_offset)
                f.write(b"\xff" * 8)
            changed.append(True)
        return value

    monkeypatch.setattr(scan._native, "read_at", read_then_change)
    reader = CheckpointCoordinator(tmp_path, trusted_keys=[public])
    got = empty_state()
    assert reader.restore(got).step == 1  # step 2 refused, rolled back past
    assert changed and [s.step for s in reader.skipped] == [2]
    assert reader.skipped[0].problems[0].startswith("DigestMismatchError:")
    assert_is_state(got, 1)


# ---- item 10: can't read now is not "bad" ------------------------------------------------------------------


def test_a_shard_that_is_a_fifo_is_refused_not_waited_on(tmp_path) -> None:
    """A named pipe where a shard should be: opening it for reading would wait forever for a writer.
    Checked in a child process, so a regression fails by its timeout instead of hanging the suite."""
    save_steps(str(tmp_path), [1, 2])
    shard = tmp_path / storage.step_name(2) / SHARD
    shard.unlink()
    os.mkfifo(shard)
    script = textwrap.dedent(f"""
        from SneppX_ALG import CheckpointCoordinator
        coord = CheckpointCoordinator({str(tmp_path)!r}, read_only=True)
        print(coord.latest().step, coord.skipped[0].problems[0])
    """)
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.startswith("1 ") and "FIFO" in out.stdout, out.stdout


@pytest.mark.parametrize("leaf", [storage.MANIFEST, storage.SIGNATURE])
def test_a_manifest_or_signature_that_is_a_fifo_or_a_link_is_refused_not_waited_on_or_followed(tmp_path,
                                                                                               leaf) -> None:
    """A named pipe (or a symbolic link) where a step's manifest or signature should be: every reader of a step's
    small files (latest(), validate_checkpoint, sneppx ls / verify) says the step is invalid. Checked in a child
    process, so a regression fails by its timeout instead of hanging the suite."""
    key, public = signing.generate_keypair()
    save_steps(str(tmp_path), [1, 2, 3], signing_key=key)
    fifo, link = (tmp_path / storage.step_name(step) / leaf for step in (2, 3))
    fifo.unlink()
    os.mkfifo(fifo)
    outside = tmp_path / "outside.json"
    outside.write_bytes(link.read_bytes())
    link.unlink()
    link.symlink_to(outside)
    public_pem = tmp_path / "public.pem"
    signing.save_public_key(public_pem, public)
    script = textwrap.dedent(f"""
        import json, subprocess, sys
        from SneppX_ALG import CheckpointCoordinator, validate_checkpoint, errors
        from SneppX_ALG.checkpoint import signing, verify
        trusted = [signing.load_public_key({str(public_pem)!r})]
        coord = CheckpointCoordinator({str(tmp_path)!r}, read_only=True, trusted_keys=trusted)
        print("latest", coord.latest().step, [s.step for s in coord.skipped])
        for step in (2, 3):
            ok, problems = validate_checkpoint({str(tmp_path)!r} + f"/step-{{step:09d}}", trusted)
            print("validate", step, ok, problems[0])
            try:
                verify.check_manifest({str(tmp_path)!r} + f"/step-{{step:09d}}", trusted)
                print("verify", step, "passed")
            except errors.SneppXError as e:
                print("verify", step, type(e).__name__)
        listing = subprocess.run([sys.executable, "-m", "SneppX_ALG.cli", "ls", {str(tmp_path)!r}, "--json",
                                  "--trusted-key", {str(public_pem)!r}],
                                 capture_output=True, text=True, timeout=60)
        print("ls", listing.returncode, sorted(r["step"] for r in json.loads(listing.stdout)["steps"] if r["valid"]))
    """)
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    assert "latest 1 [3, 2]" in out, out
    assert "validate 2 False CheckpointFormatError" in out and "FIFO" in out, out
    assert "validate 3 False CheckpointFormatError" in out and "symbolic link" in out, out
    assert "verify 2 CheckpointFormatError" in out and "verify 3 CheckpointFormatError" in out, out
    assert "ls 0 [1]" in out or "ls 1 [1]" in out, out


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(steps, "READ_BACKOFF_S", 0.001)


@pytest.mark.parametrize("code", ["EIO", "ESTALE", "EMFILE"])
def test_a_transient_read_error_is_retried_and_the_step_still_loads(tmp_path, fast_retries, code) -> None:
    save_steps(str(tmp_path), [1, 2])
    coord = CheckpointCoordinator(tmp_path)
    _native.fault_arm("read", 2, code, times=2)  # two failed reads, then the disk answers again
    assert coord.latest().step == 2 and coord.skipped == []
    _native.fault_arm("read", 5, code, times=3)
    got = empty_state()
    assert coord.restore(got).step == 2 and coord.skipped == []
    assert_is_state(got, 2)


@pytest.mark.parametrize("code", ["EIO", "ESTALE"])
def test_a_persistent_read_error_is_raised_typed_and_nothing_is_skipped(tmp_path, fast_retries, code) -> None:
    save_steps(str(tmp_path), [1, 2])
    coord = CheckpointCoordinator(tmp_path)
    _native.fault_arm("read", 1, code, times=10_000)
    with pytest.raises(errors.CheckpointUnreadableError) as info:
        coord.latest()
    assert info.value.step == 2 and info.value.errno == getattr(errno, code)
    with pytest.raises(errors.CheckpointUnreadableError):
        coord.restore(empty_state())
    with pytest.raises(errors.CheckpointUnreadableError):
        coord.validate(1)
    assert coord.skipped == []  # never rolled back past a step it could not read
    _native.fault_arm("read", 0, "kill")
    assert coord.latest().step == 2


def test_a_read_error_during_retention_deletes_nothing(tmp_path, fast_retries) -> None:
    with CheckpointCoordinator(tmp_path, max_to_keep=1) as coord:
        coord.save(small(1), step=1)
        coord.wait()
        _native.fault_arm("read", 1, "EIO", times=10_000)
        coord.save(small(2), step=2)  # committed; retention can't read it back, so keeps step 1
        coord.wait()
        _native.fault_arm("read", 0, "kill")
        assert coord.committed_steps() == [1, 2]
        coord.save(small(3), step=3)
    assert CheckpointCoordinator(tmp_path).committed_steps() == [3]


# ---- S3 (a real moto server over HTTP on 127.0.0.1) --------------------------------------------------------


def s3_names(client, bucket: str, prefix: str) -> set[str]:
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])]
    return {k[len(prefix) + 1:].partition("/")[0] for k in keys}


def test_rollback_fencing_and_set_aside_bounds_on_s3(s3_bucket, s3_env, tmp_path) -> None:
    client = s3_env.client()
    root = f"s3://{s3_bucket}/run"
    kwargs = {"s3_client": client, "staging_dir": str(tmp_path)}
    save_steps(root, [1000, 2000, 3000, 4000], **kwargs)
    coord = CheckpointCoordinator(root, max_to_keep=3, staging_bytes=2 * MiB, **kwargs)
    got = empty_state()
    assert coord.restore(got, step=2000).step == 2000
    assert_is_state(got, 2000)
    for step in (2100, 2200):
        coord.save(state_for(step), step=step)
    coord.close()
    assert coord.committed_steps() == [2000, 2100, 2200]
    names = s3_names(client, s3_bucket, "run")
    assert {storage.parse_set_aside_name(n) for n in names if n.startswith(".abandoned-")} == {3000, 4000}
    assert timeline.FENCE_RECORD not in names
    aside = next(n for n in names if n.startswith(".abandoned-step-000004000-"))
    kept = {o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix=f"run/{aside}/")["Contents"]}
    assert f"run/{aside}/{SHARD}" in kept and f"run/{aside}/manifest.json" in kept  # moved, kept for inspection

    fresh = CheckpointCoordinator(root, max_to_keep=1, staging_bytes=2 * MiB, **kwargs)
    assert fresh.latest().step == 2200
    fresh.save(state_for(3001), step=3000)  # a number of the abandoned timeline
    fresh.save(state_for(3100), step=3100)
    fresh.close()
    got = empty_state()
    assert CheckpointCoordinator(root, **kwargs).restore(got).step == 3100
    assert_is_state(got, 3100)
    names = s3_names(client, s3_bucket, "run")
    assert sorted(n for n in names if n.startswith("step-")) == [storage.step_name(3100)]
    # set-aside steps are bounded like committed ones: max_to_keep=1 keeps the newest (4000's)
    assert [storage.parse_set_aside_name(n) for n in names if n.startswith(".")] == [4000]


def test_an_invalid_committed_s3_step_is_set_aside_so_its_number_is_saved_again(s3_bucket, s3_env,
                                                                                  tmp_path) -> None:
    """No restore: a save finds its step committed but invalid. Setting it aside moves all of its objects,
    manifest.json included, out of the step's keys, so the new manifest (created with If-None-Match) and
    marker commit."""
    client = s3_env.client()
    root = f"s3://{s3_bucket}/inv"
    kwargs = {"s3_client": client, "staging_dir": str(tmp_path)}
    save_steps(root, [1, 2], **kwargs)
    key = f"inv/{storage.step_name(2)}/{SHARD}"
    body = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[4096 + 3] ^= 0x40
    client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    with CheckpointCoordinator(root, max_to_keep=None, staging_bytes=2 * MiB, **kwargs) as coord:
        coord.save(state_for(20), step=2)
    names = s3_names(client, s3_bucket, "inv")
    assert [storage.parse_set_aside_name(n) for n in names if n.startswith(".invalid-")] == [2]
    got = empty_state()
    assert CheckpointCoordinator(root, read_only=True, **kwargs).restore(got).step == 2
    assert got["embed"].tobytes() == state_for(20)["embed"].tobytes()


def test_s3_cleanup_leaves_the_fence_record_and_set_aside_steps_alone(s3_bucket, s3_env, tmp_path) -> None:
    """A fence cut short after its first move: the record and the set-aside step are not leftovers of a
    crashed save; a start's cleanup removes the crashed save's objects only, and the next writer finishes
    the fence."""
    client = s3_env.client()
    root = f"s3://{s3_bucket}/fc"
    kwargs = {"s3_client": client, "staging_dir": str(tmp_path)}
    save_steps(root, [1, 2, 3], **kwargs)
    store = storage.S3Storage(root, client=client, staging_dir=str(tmp_path))
    store.write_root_file(timeline.FENCE_RECORD, timeline.encode_fence(timeline.Fence(1, (2, 3))))
    store.set_aside(3, "abandoned")
    crashed = f"fc/{storage.step_name(9)}/{SHARD}"
    client.put_object(Bucket=s3_bucket, Key=crashed, Body=b"a crashed save's shard")
    assert f"s3://{s3_bucket}/{crashed}" in store.cleanup()
    names = s3_names(client, s3_bucket, "fc")
    assert timeline.FENCE_RECORD in names and storage.step_name(9) not in names
    assert [storage.parse_set_aside_name(n) for n in names if n.startswith(".abandoned-")] == [3]
    reader = CheckpointCoordinator(root, read_only=True, **kwargs)
    assert reader.committed_steps() == [1] and reader.latest().step == 1
    with CheckpointCoordinator(root, max_to_keep=None, staging_bytes=2 * MiB, **kwargs) as writer:
        writer.save(state_for(2), step=2)  # sets the old step 2 aside first, then commits its own
    names = s3_names(client, s3_bucket, "fc")
    assert timeline.FENCE_RECORD not in names
    assert sorted(storage.parse_set_aside_name(n) for n in names if n.startswith(".abandoned-")) == [2, 3]
    got = empty_state()
    assert CheckpointCoordinator(root, read_only=True, **kwargs).restore(got).step == 2
    assert_is_state(got, 2)


def test_a_set_aside_copy_cut_short_is_bounded_by_retention_not_left_behind(s3_bucket, s3_env,
                                                                           tmp_path) -> None:
    """Large objects are set aside by a multipart copy; a process killed mid-copy leaves an incomplete upload
    under the set-aside name. Cleanup leaves it (it can't tell it from a live copy); retention counts it as
    a set-aside step and aborts it once it is beyond max_to_keep."""
    client = s3_env.client()
    root = f"s3://{s3_bucket}/cut"
    kwargs = {"s3_client": client, "staging_dir": str(tmp_path)}
    save_steps(root, [1, 2], **kwargs)
    partial = f"cut/.abandoned-step-000000001-deadbeef/{SHARD}"
    upload = client.create_multipart_upload(Bucket=s3_bucket, Key=partial)["UploadId"]
    client.upload_part(Bucket=s3_bucket, Key=partial, UploadId=upload, PartNumber=1, Body=b"x" * (5 << 20))
    store = storage.S3Storage(root, client=client, staging_dir=str(tmp_path))
    store.set_aside(2, "invalid")
    assert [step for step, _ in store.set_aside_steps()] == [1, 2]
    store.cleanup()
    assert [u["Key"] for u in client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])] == [partial]
    with CheckpointCoordinator(root, max_to_keep=1, staging_bytes=2 * MiB, **kwargs) as coord:
        coord.save(state_for(3), step=3)
    assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert [step for step, _ in store.set_aside_steps()] == [2]


def test_a_read_error_on_an_s3_step_is_raised_not_skipped(s3_bucket, s3_env, tmp_path, fast_retries) -> None:
    client = s3_env.client()
    root = f"s3://{s3_bucket}/run"
    kwargs = {"s3_client": client, "staging_dir": str(tmp_path)}
    save_steps(root, [1, 2], **kwargs)
    coord = CheckpointCoordinator(root, **kwargs)
    _native.fault_arm("read", 1, "EIO", times=10_000)
    with pytest.raises(errors.CheckpointUnreadableError):
        coord.latest()
    assert coord.skipped == []
    _native.fault_arm("read", 0, "kill")
    assert coord.latest().step == 2
