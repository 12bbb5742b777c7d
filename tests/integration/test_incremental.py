"""Incremental steps on real files and a real S3 server: a save writes only the pieces that changed and references
the rest in the step that holds them; every guarantee of a full step still holds (docs/FORMAT.md, "Incremental
steps").

Each rule has a test here that fails when the rule is broken: a chain longer than full_every (the manifests'
versions and `chain`), a retention that ignores references (the kept steps stop validating), a reference to a
block that changed (its CRC32C; in a signed step, changed behind its CRC32C: its BLAKE3) or is gone (the step is
invalid, never wrong).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import pytest

from SneppX_ALG import CheckpointCoordinator, _native, errors, storage, validate_checkpoint
from SneppX_ALG.checkpoint import file, signing
from SneppX_ALG.coordinator import Shard

FROZEN_ROWS = 2048  # 2048 rows of 1 KiB: 2 MiB that never change (a frozen embedding), two 1 MiB pieces
TABLE_ROWS = 2048  # a sparse table: odd steps touch a row in its first half (piece), even steps in its second


def state_for(step: int) -> dict[str, Any]:
    """About 5 MiB: the frozen rows, a hot layer that changes every step, and the sparse table, each of whose two
    halves changes every other step. Step s's state holds the table rows of every step up to s."""
    frozen = np.random.default_rng(0).standard_normal((FROZEN_ROWS, 256)).astype(np.float32)
    hot = np.random.default_rng(1000 + step).standard_normal((256, 1024)).astype(np.float32)
    table = np.zeros((TABLE_ROWS, 256), np.float32)
    for s in range(1, step + 1):
        table[(s % 2) * (TABLE_ROWS // 2) + s] += s
    return {"frozen": frozen, "model": {"hot": hot, "table": table}, "t": np.int64(step)}


def step_dir(root: pathlib.Path, step: int) -> pathlib.Path:
    return root / storage.step_name(step)


def manifest_of(root: pathlib.Path, step: int) -> dict[str, Any]:
    return json.loads((step_dir(root, step) / storage.MANIFEST).read_bytes())


def stored_bytes(root: pathlib.Path, step: int) -> int:
    return sum(p.stat().st_size for p in step_dir(root, step).glob("shard-*.snpx"))


def restored(root: str, step: int | None = None, **kwargs: Any) -> tuple[int | None, dict[str, Any], list]:
    """(the step restored, its state, what was skipped) by a read-only coordinator (no fence: a look)."""
    got: dict[str, Any] = {}
    with CheckpointCoordinator(root, read_only=True, device="cpu", **kwargs) as c:
        info = c.restore(got, step)
        return (None if info is None else info.step), got, list(c.skipped)


def assert_state(got: dict[str, Any], step: int) -> None:
    want = state_for(step)
    assert got["frozen"].tobytes() == want["frozen"].tobytes()
    assert got["model"]["hot"].tobytes() == want["model"]["hot"].tobytes()
    assert got["model"]["table"].tobytes() == want["model"]["table"].tobytes()
    assert int(got["t"]) == step


def save_steps(root: str, steps: list[int], **kwargs: Any) -> None:
    settings = {"async_save": False, "device": "cpu", "max_to_keep": None, "incremental": True, **kwargs}
    with CheckpointCoordinator(root, **settings) as c:
        for step in steps:
            c.save(state_for(step), step=step)


def test_a_chain_writes_what_changed_is_full_every_n_saves_and_every_step_restores_bitwise(
        tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    save_steps(str(root), list(range(1, 8)), full_every=3)
    manifests = {s: manifest_of(root, s) for s in range(1, 8)}
    # Saves 1, 4 and 7 are full (version 3, nothing referenced); the two after each reference the chain.
    assert [manifests[s]["version"] for s in range(1, 8)] == [3, 4, 4, 3, 4, 4, 3]
    assert [manifests[s].get("chain", 0) for s in range(1, 8)] == [0, 1, 2, 0, 1, 2, 0]
    assert manifests[2]["uses"] == [1] and manifests[3]["uses"] == [1, 2]  # the table's even half is in 2
    assert manifests[6]["uses"] == [4, 5]
    for step in (2, 3, 5, 6):
        assert stored_bytes(root, step) < 0.7 * stored_bytes(root, 1), step  # the frozen half is not written again
    for step in range(1, 8):
        assert validate_checkpoint(step_dir(root, step)) == (True, []), step
        got_step, got, skipped = restored(str(root), step)
        assert got_step == step and not skipped
        assert_state(got, step)


def test_a_piece_changed_by_one_bit_is_written_and_the_unchanged_ones_are_neither_copied_nor_hashed(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshot compares each host piece with what the staging buffer still holds from the last save, byte
    for byte: the last bit of a 1 MiB piece is enough to write it, and the pieces that are equal cost no hash."""
    root = tmp_path / "root"
    weights = np.random.default_rng(3).standard_normal((4, 1 << 18)).astype(np.float32)  # four 1 MiB pieces
    hashed: list[int] = []
    real_digest = signing.block_digest
    monkeypatch.setattr(signing, "block_digest", lambda data: hashed.append(len(data)) or real_digest(data))
    with CheckpointCoordinator(str(root), async_save=False, device="cpu", max_to_keep=None, incremental=True) as c:
        c.save({"w": weights}, step=1)
        assert sum(hashed) == weights.nbytes  # a full save hashes everything, for the saves after it
        hashed.clear()
        weights[2].view(np.uint8)[-1] ^= 0x01  # the last bit of the third piece
        c.save({"w": weights}, step=2)
        assert sum(hashed) == 1 << 20  # the changed piece alone
    chunks = manifest_of(root, 2)["tensors"][0]["chunks"]
    assert [c.get("from") for c in chunks] == [[1, "shard-00000.snpx"]] * 2 + [None] + [[1, "shard-00000.snpx"]]
    got_step, got, _ = restored(str(root))
    assert got_step == 2 and got["w"].tobytes() == weights.tobytes()


def test_a_save_after_a_failed_one_never_references_what_the_failed_one_staged(tmp_path: pathlib.Path) -> None:
    """A failed save overwrote the staging buffers with bytes no committed step holds: the next save can't take
    them for the chain's (it hashes and compares with the chain's step instead)."""
    root = tmp_path / "root"
    weights = np.random.default_rng(4).standard_normal((4, 1 << 18)).astype(np.float32)
    try:
        with CheckpointCoordinator(str(root), device="cpu", max_to_keep=None, incremental=True) as c:
            c.save({"w": weights}, step=1)
            c.wait()
            weights[1] += 1.0
            _native.fault_arm("write", 1, "ENOSPC")
            c.save({"w": weights}, step=2)
            with pytest.raises(errors.DiskFullError):
                c.wait()
            c.save({"w": weights}, step=3)  # the same bytes the failed save staged
            c.wait()
    finally:
        _native.fault_arm("write", 0, "kill")  # disarmed
    assert [c.get("from") for c in manifest_of(root, 3)["tensors"][0]["chunks"]] == [
        [1, "shard-00000.snpx"], None, [1, "shard-00000.snpx"], [1, "shard-00000.snpx"]]
    got_step, got, _ = restored(str(root))
    assert got_step == 3 and got["w"].tobytes() == weights.tobytes()


def test_back_to_back_async_saves_each_restore_their_own_state(tmp_path: pathlib.Path) -> None:
    """Saves that overlap (the next snapshot takes a staging buffer before the last save committed): each step
    is the state it was saved with."""
    root = tmp_path / "root"
    weights = np.random.default_rng(5).standard_normal((8, 1 << 18)).astype(np.float32)
    want = {}
    with CheckpointCoordinator(str(root), device="cpu", max_to_keep=None, incremental=True, full_every=100,
                               staging_bytes=8 << 20) as c:
        for step in range(1, 13):
            weights[step % 8] += step  # one piece changes per save, some twice in a row of overlapping saves
            c.save({"w": weights}, step=step)
            want[step] = weights.copy()
    for step, state in want.items():
        got_step, got, _ = restored(str(root), step)
        assert got_step == step and got["w"].tobytes() == state.tobytes(), step


def test_retention_keeps_every_step_a_kept_step_references_and_deletes_it_after(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    with CheckpointCoordinator(str(root), async_save=False, device="cpu", max_to_keep=1, incremental=True,
                               full_every=3) as c:
        for step in range(1, 7):
            c.save(state_for(step), step=step)
            committed = c.committed_steps()
            for kept in committed:  # whatever retention left is whole
                assert c.validate(kept) == [], (step, kept, committed)
            if step in (2, 3):
                assert committed == list(range(1, step + 1)), committed  # the chain of the newest, pinned
            if step == 4:  # a full save: nothing references the chain before it any more
                assert committed == [4], committed
    got_step, got, _ = restored(str(root))
    assert got_step == 6
    assert_state(got, 6)


def forge_behind_the_crc(path: pathlib.Path, entry_name: str, block_bytes: int) -> None:
    """Changes the first block of an entry in an SNPX file and repairs its CRC32C in the last 4 bytes of the block
    (CRC is affine over GF(2): 32 bit flips span every difference), so the file and every CRC in it still check."""
    with file.CheckpointReader(str(path), verify=False) as reader:
        entry = reader.entry(entry_name)
    blob = bytearray(path.read_bytes())
    start, length = entry.offset, min(block_bytes, entry.length)
    block = bytes(blob[start:start + length])
    target = _native.crc32c(block)
    changed = bytearray(block)
    changed[0] ^= 0x5A
    window = length - 4

    def crc_with(bits: int) -> int:
        trial = bytearray(changed)
        trial[window:window + 4] = (int.from_bytes(changed[window:window + 4], "little") ^ bits).to_bytes(4, "little")
        return _native.crc32c(bytes(trial))

    base = crc_with(0)
    rows = [(crc_with(1 << i) ^ base, 1 << i) for i in range(32)]  # effect of each bit flip, and the flip
    want, solution = base ^ target, 0
    for bit in range(31, -1, -1):  # Gaussian elimination over GF(2)
        pivot = next((r for r in rows if r[0] >> bit & 1), None)
        if pivot is None:
            continue
        rows = [(e ^ pivot[0], f ^ pivot[1]) if e >> bit & 1 and (e, f) != pivot else (e, f) for e, f in rows]
        rows.remove(pivot)
        if want >> bit & 1:
            want ^= pivot[0]
            solution ^= pivot[1]
    assert want == 0
    forged = bytearray(changed)
    forged[window:window + 4] = (int.from_bytes(changed[window:window + 4], "little") ^ solution).to_bytes(4, "little")
    assert _native.crc32c(bytes(forged)) == target and bytes(forged) != block
    blob[start:start + length] = forged
    path.write_bytes(bytes(blob))


def test_a_referenced_block_that_changed_makes_the_step_invalid_never_wrong(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    save_steps(str(root), [1, 2], checksum_block_bytes=64 << 10)
    reference = next(c["from"] for t in manifest_of(root, 2)["tensors"] for c in t["chunks"]
                     if c["entry"].startswith("frozen"))
    assert reference == [1, "shard-00000.snpx"]
    shard = step_dir(root, 1) / "shard-00000.snpx"
    with file.CheckpointReader(str(shard), verify=False) as reader:
        at = reader.entry("frozen@1").offset + 70000  # in the second block of a piece step 2 references
    blob = bytearray(shard.read_bytes())
    blob[at] ^= 0x01
    shard.write_bytes(bytes(blob))
    ok, problems = validate_checkpoint(step_dir(root, 2))
    assert not ok and "references shard-00000.snpx of step 1" in problems[0] and "CRC32C" in problems[0], problems
    got_step, _, skipped = restored(str(root))
    assert got_step is None and [s.step for s in skipped] == [2, 1]  # never step 2 with step 1's changed bytes
    resharded: dict[str, Any] = {"frozen": Shard(np.zeros((FROZEN_ROWS // 2, 256), np.float32), (FROZEN_ROWS, 256),
                                                 (FROZEN_ROWS // 2, 0))}
    with (CheckpointCoordinator(str(root), read_only=True, device="cpu") as c,  # the ranged reader says the same
          pytest.raises(errors.ManifestError, match="not valid")):
        c.restore(resharded, 2)


def test_a_step_whose_referenced_file_is_gone_is_invalid_and_restore_rolls_back_past_it(
        tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    save_steps(str(root), [1, 2, 3])
    (step_dir(root, 1) / "shard-00000.snpx").unlink()  # what a retention that ignored references would leave
    for step in (2, 3):
        ok, problems = validate_checkpoint(step_dir(root, step))
        assert not ok and "step 1" in problems[0], problems
    got_step, _, skipped = restored(str(root))
    assert got_step is None and [s.step for s in skipped] == [3, 2, 1]


def test_a_signed_chain_verifies_and_its_references_are_covered_by_the_signature(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    key, public = signing.generate_keypair()
    trusted = [public]
    save_steps(str(root), [1, 2], signing_key=key)
    assert manifest_of(root, 2)["uses"] == [1]
    assert validate_checkpoint(step_dir(root, 2), trusted) == (True, [])
    got_step, got, skipped = restored(str(root), trusted_keys=trusted)
    assert got_step == 2 and not skipped
    assert_state(got, 2)
    forge_behind_the_crc(step_dir(root, 1) / "shard-00000.snpx", "frozen@0", 256 << 10)
    ok, problems = validate_checkpoint(step_dir(root, 2), trusted)
    assert not ok and "DigestMismatchError" in problems[0], problems
    got_step, _, skipped = restored(str(root), trusted_keys=trusted)
    assert got_step is None and [s.step for s in skipped] == [2, 1]  # step 1's file digest fails too


def test_a_rollback_over_a_chain_keeps_what_the_restored_step_references_and_continues_from_it(
        tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    save_steps(str(root), [1, 2, 3, 4, 5])
    with CheckpointCoordinator(str(root), async_save=False, device="cpu", max_to_keep=2) as c:
        got: dict[str, Any] = {}
        assert c.restore(got, 3).step == 3  # steps 4 and 5 are fenced off at the next commit
        assert_state(got, 3)
        c.save(state_for(6), step=6)  # continues the chain of the restored step: references 3 and what 3 does
        # Retention keeps 2 steps (3 and 6) and what they reference: 6 the frozen rows in 1; 3 those and 2's.
        assert c.committed_steps() == [1, 2, 3, 6]
        assert manifest_of(root, 6)["uses"] == [1]
        for step in c.committed_steps():
            assert c.validate(step) == [], step
    aside = sorted(p.name for p in root.iterdir() if p.name.startswith(".abandoned"))
    assert len(aside) == 2, aside
    got_step, got, _ = restored(str(root))
    assert got_step == 6
    assert_state(got, 6)


def test_the_same_chain_on_s3_references_across_step_prefixes(s3_bucket: str, s3_env: Any,
                                                               tmp_path: pathlib.Path) -> None:
    root = f"s3://{s3_bucket}/job"
    with CheckpointCoordinator(root, async_save=False, device="cpu", max_to_keep=1, incremental=True,
                               staging_dir=str(tmp_path)) as c:
        for step in (1, 2, 3):
            c.save(state_for(step), step=step)
        assert c.committed_steps() == [1, 2, 3]  # 3 references 1 and 2: retention keeps them
        for step in (1, 2, 3):
            assert c.validate(step) == [], step  # a whole read: the referenced files are fetched beside the step
    keys = {o["Key"] for o in s3_env.client().list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert "job/step-000000001/shard-00000.snpx" in keys
    got_step, got, _ = restored(root, staging_dir=str(tmp_path))
    assert got_step == 3
    assert_state(got, 3)
    half: dict[str, Any] = {"frozen": Shard(np.zeros((FROZEN_ROWS // 2, 256), np.float32), (FROZEN_ROWS, 256), (FROZEN_ROWS // 2, 0)),
            "model": {"hot": np.zeros((256, 1024), np.float32), "table": np.zeros((TABLE_ROWS, 256), np.float32)},
            "t": np.zeros((), np.int64)}
    with CheckpointCoordinator(root, read_only=True, device="cpu", staging_dir=str(tmp_path)) as c:
        info = c.restore(half)  # ranged GETs, the frozen rows from step 1's object
    assert info.step == 3 and half["frozen"].data.tobytes() == state_for(3)["frozen"][FROZEN_ROWS // 2:].tobytes()
