"""Incremental steps at their edges, on real files (fsync, rename) and a real S3 server: a second restore, a gc
beside a trainer that rolled back, a re-save of an invalid step that a newer one references, a broken chain seen
on the read-back, verify over referenced blocks, a forged manifest on S3, oversized manifests, and what a kill
during a rollback leaves at the root (issue 39). Each test fails on the code before its fix (the commit that
added it names the planted bug).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from test_incremental import (  # tests/integration is on sys.path
    FROZEN_ROWS,
    assert_state,
    forge_behind_the_crc,
    manifest_of,
    restored,
    save_steps,
    state_for,
    step_dir,
)

from SneppX_ALG import CheckpointCoordinator, _native, errors, storage
from SneppX_ALG.checkpoint import file, signing, verify
from SneppX_ALG.coordinator import increments, timeline


@pytest.fixture(autouse=True)
def _disarm_faults():
    yield
    _native.fault_arm("write", 0, "kill")  # countdown 0: disarmed


def flip_byte(shard: pathlib.Path, entry: str, at: int = 0) -> None:
    """Flips one bit of an entry's bytes in an SNPX file (its CRC32C then fails)."""
    with file.CheckpointReader(str(shard), verify=False) as reader:
        where = reader.entry(entry).offset + at
    blob = bytearray(shard.read_bytes())
    blob[where] ^= 0x01
    shard.write_bytes(bytes(blob))


def entry_of(root: pathlib.Path, step: int, prefix: str, *, referenced: bool) -> str:
    """The first chunk of a tensor in a step's manifest, referenced or written by the step itself."""
    return next(c["entry"] for t in manifest_of(root, step)["tensors"] for c in t["chunks"]
                if c["entry"].startswith(prefix) and ("from" in c) == referenced)


# ---- defect 2: a second restore() keeps the fence of the first ---------------------------------------------


def test_a_second_restore_keeps_the_steps_the_first_abandoned_fenced(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    save_steps(str(root), [1, 2, 3, 4, 5, 6], incremental=False)
    with CheckpointCoordinator(str(root), async_save=False, device="cpu", max_to_keep=None) as c:
        got: dict[str, Any] = {}
        assert c.restore(got, step=4).step == 4
        again: dict[str, Any] = {}
        assert c.restore(again).step == 4  # steps 5 and 6 stay abandoned
        assert_state(again, 4)
        assert c.latest().step == 4 and c.committed_steps() == [1, 2, 3, 4]
        c.save(state_for(5), step=5)  # the number 5 is free again on the new timeline
        assert c.committed_steps() == [1, 2, 3, 4, 5]
    assert len([p for p in root.iterdir() if p.name.startswith(".abandoned-step-")]) == 2
    got_step, got, _ = restored(str(root))
    assert got_step == 5
    assert_state(got, 5)


# ---- defect 3: gc --apply beside a trainer that rolled back -------------------------------------------------


def gc(root: pathlib.Path, keep: int) -> str:
    """`sneppx gc --apply` in a process of its own, as an operator runs it beside a trainer; its output."""
    done = subprocess.run([sys.executable, "-m", "SneppX_ALG.cli", "gc", str(root), "--keep", str(keep), "--apply"],
                          check=True, capture_output=True, text=True, timeout=120)
    return done.stdout


def test_gc_beside_a_trainer_process_that_rolled_back_keeps_the_restored_steps_chain(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    save_steps(str(root), [1, 2, 3, 4, 5, 6], full_every=3)  # chains 1-3 and 4-6
    # The trainer: restores step 2 (its next save continues 2's chain: references 1 and 2), says so, and saves
    # step 7 only once told to, after the gc ran.
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
        from test_incremental import state_for
        from SneppX_ALG import CheckpointCoordinator
        with CheckpointCoordinator({str(root)!r}, async_save=False, device="cpu", max_to_keep=None,
                                   full_every=3) as c:
            print(c.restore({{}}, step=2).step, flush=True)
            sys.stdin.readline()
            c.save(state_for(7), step=7)
            print(c.latest().step, flush=True)
    """)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "2", trainer.stderr.read()
        assert (root / timeline.ROLLBACK_RECORD).exists()
        listed = subprocess.run([sys.executable, "-m", "SneppX_ALG.cli", "ls", str(root), "--quick", "--json"],
                                check=True, capture_output=True, text=True, timeout=120).stdout
        assert json.loads(listed)["rollback"] == 2 and json.loads(listed)["latest"] == 6  # readers see no rollback
        said = gc(root, keep=2)  # keeps the newest two (5, 6; 4 for their references), and 2 with its chain
        assert "step 2 is kept: a trainer restored it" in said
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
            storage.step_name(s) for s in (1, 2, 4, 5, 6)]
        out, err = trainer.communicate("go\n", timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == 0 and out.split() == ["7"], err
    assert manifest_of(root, 7)["version"] == 4 and set(manifest_of(root, 7)["uses"]) <= {1, 2}  # chain kept
    assert not (root / timeline.ROLLBACK_RECORD).exists()  # the first commit after the restore removed it
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        storage.step_name(s) for s in (1, 2, 7)]
    got_step, got, skipped = restored(str(root))
    assert got_step == 7 and not skipped
    assert_state(got, 7)


def test_a_writer_that_restores_and_closes_without_saving_leaves_no_rollback_record(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    save_steps(str(root), [1, 2, 3], full_every=3)
    with CheckpointCoordinator(str(root), device="cpu", max_to_keep=None) as c:
        assert c.restore({}, step=1).step == 1
        assert timeline.decode_fence((root / timeline.ROLLBACK_RECORD).read_bytes(), where="ROLLBACK") == (
            timeline.Fence(1, (2, 3)))
        assert c.restore({}, step=3).step == 3  # a second restore, of the newest: nothing is pending
        assert not (root / timeline.ROLLBACK_RECORD).exists()
        assert c.restore({}, step=1).step == 1
    assert not (root / timeline.ROLLBACK_RECORD).exists()
    assert "nothing to delete" in gc(root, keep=3)
    assert restored(str(root))[0] == 3


def test_a_rollback_record_a_dead_trainer_left_keeps_its_chain_until_a_writer_commits(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    save_steps(str(root), [1, 2, 3, 4, 5, 6], full_every=3)
    (root / timeline.ROLLBACK_RECORD).write_bytes(timeline.encode_fence(timeline.Fence(2, (3, 4, 5, 6))))
    assert "step 2 is kept" in gc(root, keep=2)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        storage.step_name(s) for s in (1, 2, 4, 5, 6)]
    assert restored(str(root))[0] == 6  # the rollback never took effect: nothing is hidden
    save_steps(str(root), [7], full_every=3)
    assert not (root / timeline.ROLLBACK_RECORD).exists()
    (root / timeline.ROLLBACK_RECORD).write_bytes(b"{not json")
    with pytest.raises(subprocess.CalledProcessError) as failed:
        gc(root, keep=1)
    assert "FenceRecordError" in failed.value.stderr or "fence record" in failed.value.stderr
    assert len([p for p in root.iterdir() if p.name.startswith("step-")]) == 6  # nothing deleted on a guess
    # Readers ignore the record, so `sneppx ls` lists the steps and names the damaged record (it listed nothing,
    # exit 2 with FenceRecordError, before: the review of 7 December).
    listed = subprocess.run([sys.executable, "-m", "SneppX_ALG.cli", "ls", str(root), "--quick", "--json"],
                            check=True, capture_output=True, text=True, timeout=120).stdout
    listing = json.loads(listed)
    assert listing["latest"] == 7 and listing["rollback"] is None
    assert timeline.ROLLBACK_RECORD in listing["rollback_problem"]


def test_on_s3_gc_beside_a_trainer_that_rolled_back_keeps_the_restored_steps_chain(
        s3_bucket: str, s3_env: Any, tmp_path: pathlib.Path) -> None:
    client = s3_env.client()
    root = f"s3://{s3_bucket}/job"
    settings = {"s3_client": client, "staging_dir": str(tmp_path), "device": "cpu", "full_every": 3}
    save_steps(root, [1, 2, 3, 4, 5, 6], **settings)

    def keys() -> set[str]:
        return {o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="job/").get("Contents", [])}

    with CheckpointCoordinator(root, async_save=False, max_to_keep=None, **settings) as trainer:
        assert trainer.restore({}, step=2).step == 2
        assert f"job/{timeline.ROLLBACK_RECORD}" in keys()
        with CheckpointCoordinator(root, **settings) as operator:  # what `sneppx gc --keep 2 --apply` runs
            plan = operator.retention_plan(max_to_keep=2)
            assert plan.restored == 2 and plan.delete == [3]
            operator.apply_retention(plan)
        trainer.save(state_for(7), step=7)
        assert trainer.committed_steps() == [1, 2, 7]
    assert f"job/{timeline.ROLLBACK_RECORD}" not in keys()
    assert s3_manifest_uses(client, s3_bucket, 7) <= {1, 2}
    got_step, got, skipped = restored(root, s3_client=client, staging_dir=str(tmp_path))
    assert got_step == 7 and not skipped
    assert_state(got, 7)


def s3_manifest_uses(client: Any, bucket: str, step: int) -> set[int]:
    raw = client.get_object(Bucket=bucket, Key=f"job/{storage.step_name(step)}/{storage.MANIFEST}")["Body"].read()
    return set(json.loads(raw)["uses"])


def test_a_save_whose_referenced_step_went_away_during_it_commits_nothing_and_the_next_is_whole(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    save_steps(str(root), [1, 2])
    with CheckpointCoordinator(str(root), async_save=False, device="cpu", max_to_keep=None) as c:
        assert c.restore({}).step == 2
        # A gc between the begin of the save (which checks the chain) and its commit: the begin saw step 1.
        monkeypatch.setattr(increments.Chain, "steps", lambda self: [])
        (step_dir(root, 1) / "shard-00000.snpx").unlink()
        with pytest.raises(errors.ReferencedStepGoneError, match="step 1"):
            c.save(state_for(3), step=3)
        assert c.committed_steps() == [1, 2]
        c.save(state_for(3), step=3)
        assert manifest_of(root, 3)["version"] == 3 and c.validate(3) == []


# ---- defect 7: re-saving an invalid step that a newer valid step references ---------------------------------


def test_resaving_an_invalid_step_that_a_valid_step_references_leaves_both_in_place(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    save_steps(str(root), [1, 2, 3])
    assert manifest_of(root, 3)["uses"] == [1, 2]  # 3 references the table half step 2 wrote
    flip_byte(step_dir(root, 2) / "shard-00000.snpx", entry_of(root, 2, "model/hot", referenced=False))
    with CheckpointCoordinator(str(root), async_save=False, device="cpu", max_to_keep=None) as c:
        assert c.validate(2) != [] and c.validate(3) == []
        with pytest.raises(errors.CheckpointExistsError, match="step.*3.*reference"):
            c.save(state_for(2), step=2)
        assert c.committed_steps() == [1, 2, 3] and c.validate(3) == []
    got_step, got, _ = restored(str(root))
    assert got_step == 3
    assert_state(got, 3)


# ---- a kill during a rollback: the fence record's temporary file --------------------------------------------


@pytest.mark.parametrize(("rename", "record"), [(1, timeline.ROLLBACK_RECORD), (2, timeline.FENCE_RECORD)])
def test_a_fence_record_write_cut_short_by_a_kill_leaves_no_temporary_file_after_the_next_start(
        tmp_path: pathlib.Path, rename: int, record: str) -> None:
    root = tmp_path / "root"
    save_steps(str(root), [1, 2, 3], incremental=False)
    script = textwrap.dedent(f"""
        import numpy as np
        from SneppX_ALG import CheckpointCoordinator
        coord = CheckpointCoordinator({str(root)!r}, max_to_keep=None, async_save=False, device="cpu")
        coord.restore({{}}, step=1)
        coord.save({{"w": np.zeros(3)}}, step=5)
        print("not killed")
    """)
    # the first rename is the restore's rollback record's, from its temporary name; the second the save's fence's
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "SNEPPX_FAULT": f"rename:{rename}:kill"})
    assert result.returncode == -9, result.stderr + result.stdout
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(record + ".")]
    assert leftovers and leftovers[0].endswith(".tmp"), leftovers
    CheckpointCoordinator(str(root), device="cpu").close()  # a start's cleanup
    assert not [p.name for p in root.iterdir() if p.name.startswith(timeline.FENCE_RECORD)]
    assert not [p.name for p in root.iterdir() if p.name.startswith(timeline.ROLLBACK_RECORD + ".")]
    assert restored(str(root))[0] == 3  # the rollback never happened: nothing was fenced


# ---- defect 1: verify checks every byte the step reads, wherever it lives -----------------------------------


def verify_cli(path: pathlib.Path, public_pem: pathlib.Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "SneppX_ALG.cli", "verify", str(path), "-k", str(public_pem)],
                          check=False, capture_output=True, text=True, timeout=120)


def test_verify_checks_the_blocks_a_step_references_in_earlier_steps(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    key, public = signing.generate_keypair()
    pem = tmp_path / "public.pem"
    signing.save_public_key(str(pem), public)
    save_steps(str(root), [1, 2], signing_key=key)
    assert manifest_of(root, 2)["uses"] == [1]
    assert verify.verify_checkpoint(step_dir(root, 2), [public]) == (True, [])
    assert verify_cli(step_dir(root, 2), pem).returncode == 0
    forge_behind_the_crc(step_dir(root, 1) / "shard-00000.snpx", "frozen@0", 256 << 10)  # a block 2 references
    ok, problems = verify.verify_checkpoint(step_dir(root, 2), [public])
    assert not ok and "DigestMismatchError" in problems[0] and "step 1" in problems[0], problems
    result = verify_cli(step_dir(root, 2), pem)
    assert result.returncode == 1 and "INVALID" in result.stdout, result.stdout
    storage.LocalStorage(str(root)).delete(1)  # the base step gone
    ok, problems = verify.verify_checkpoint(step_dir(root, 2), [public])
    assert not ok and "step 1 is gone" in problems[0], problems


# ---- defect 4: a read-back that finds the chain broken makes the next save full ----------------------------


def test_after_a_read_back_finds_a_referenced_block_rotted_the_next_save_is_full_and_valid(
        tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    with CheckpointCoordinator(str(root), async_save=False, device="cpu", max_to_keep=1, incremental=True) as c:
        c.save(state_for(1), step=1)
        c.save(state_for(2), step=2)
        flip_byte(step_dir(root, 1) / "shard-00000.snpx", "frozen@0")  # rots a block every save references
        with pytest.raises(errors.CommittedStepInvalidError, match="step 3"):
            c.save(state_for(3), step=3)  # the read-back of step 3 (max_to_keep=1: every save is read back)
        c.save(state_for(4), step=4)
        assert manifest_of(root, 4)["version"] == 3  # references nothing of the broken chain
        assert c.latest().step == 4
    got_step, got, _ = restored(str(root))
    assert got_step == 4
    assert_state(got, 4)


# ---- defect 5: a manifest readers would refuse never commits ------------------------------------------------


def test_a_large_state_is_cut_into_larger_blocks_and_pieces_that_chain_and_restore_bitwise(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    monkeypatch.setattr(increments, "MAX_PIECES", 2)  # the ~5 MiB state counts as large: 4 MiB blocks and pieces
    with CheckpointCoordinator(str(root), async_save=False, device="cpu", max_to_keep=None, incremental=True) as c:
        c.save(state_for(1), step=1)
        c.save(state_for(2), step=2)
        second = manifest_of(root, 2)
        assert second["block_bytes"] == 4 << 20 and second["uses"] == [1]
        assert all(len(chunk["blocks"]) == 8 for t in second["tensors"] for chunk in t["chunks"])  # one block each
        frozen = [c.get("from") for t in second["tensors"] if t["path"] == ["frozen"] for c in t["chunks"]]
        assert frozen and all(ref == [1, "shard-00000.snpx"] for ref in frozen)
        monkeypatch.undo()  # the state is small again: the blocks differ, so nothing of the chain is referenced
        c.save(state_for(3), step=3)
        assert manifest_of(root, 3)["block_bytes"] == 256 << 10 and manifest_of(root, 3)["version"] == 3
    for step in (1, 2, 3):
        got_step, got, skipped = restored(str(root), step)
        assert got_step == step and not skipped
        assert_state(got, step)


def test_a_manifest_larger_than_readers_accept_is_a_typed_error_before_anything_commits(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    save_steps(str(root), [1])
    size = len((step_dir(root, 1) / storage.MANIFEST).read_bytes())
    # The limit, as if the state were large enough to pass 256 MiB of manifest (readers check the same name).
    monkeypatch.setattr(storage, "MAX_MANIFEST_BYTES", size // 2)
    with CheckpointCoordinator(str(root), async_save=False, device="cpu", max_to_keep=None) as c:
        with pytest.raises(errors.ManifestTooLargeError, match="nothing was committed"):
            c.save(state_for(2), step=2)
        assert c.committed_steps() == [1]
    assert sorted(p.name for p in root.iterdir()) == [storage.step_name(1)]


# ---- defect 6: on S3, a forged manifest costs no request for another step's objects ------------------------


def requests_of(client: Any) -> list[tuple[str, str]]:
    """(operation, key or prefix) of every request the client sends from now on."""
    seen: list[tuple[str, str]] = []
    client.meta.events.register("provide-client-params.s3", lambda params, model, **_: seen.append(
        (model.name, str(params.get("Key") or params.get("Prefix") or ""))))
    return seen


def test_on_s3_a_forged_manifest_is_refused_before_any_other_step_is_read(
        s3_bucket: str, s3_env: Any, tmp_path: pathlib.Path) -> None:
    client = s3_env.client()
    root = f"s3://{s3_bucket}/job"
    key, public = signing.generate_keypair()
    settings = {"s3_client": client, "staging_dir": str(tmp_path), "device": "cpu"}
    with CheckpointCoordinator(root, async_save=False, max_to_keep=None, incremental=True, signing_key=key,
                               **settings) as c:
        for step in (1, 2, 3):
            c.save(state_for(step), step=step)
    manifest_key = "job/step-000000003/manifest.json"
    genuine = client.get_object(Bucket=s3_bucket, Key=manifest_key)["Body"].read()
    assert b'"uses":[1,2]' in genuine
    forgeries = {"unsigned": genuine.replace(b'"training_state":null', b'"training_state":1'), "not json": b"{"}
    for why, forged in forgeries.items():
        client.put_object(Bucket=s3_bucket, Key=manifest_key, Body=forged)
        with CheckpointCoordinator(root, read_only=True, trusted_keys=[public], **settings) as reader:
            seen = requests_of(client)
            problems = reader.validate(3)
        assert problems and "Signature" in problems[0], (why, problems)
        others = [r for r in seen if "step-000000001" in r[1] or "step-000000002" in r[1]]
        assert not others, (why, others)
        assert len(seen) <= 8, (why, seen)  # marker, listing, manifest, signature, shard
    client.put_object(Bucket=s3_bucket, Key=manifest_key, Body=genuine)
    with CheckpointCoordinator(root, read_only=True, trusted_keys=[public], **settings) as reader:
        assert reader.validate(3) == []
        got: dict[str, Any] = {}
        assert reader.restore(got).step == 3
    assert_state(got, 3)
    frozen = state_for(3)["frozen"]
    assert got["frozen"][FROZEN_ROWS - 1].tobytes() == frozen[FROZEN_ROWS - 1].tobytes()
