"""Sharded checkpoints on real rank processes (127.0.0.1): data-parallel training saved by N ranks is restored by
M ranks (fewer, one, or more), reading only the blocks each rank needs, and training goes on exactly as if it had
never stopped. Ranks are SIGKILLed mid-save and fail their writes; nothing commits, the previous step restores."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import collective_workers as workers
import numpy as np
import pytest

from SneppX_ALG import CheckpointCoordinator, storage, validate_checkpoint
from SneppX_ALG.checkpoint import signing
from SneppX_ALG.model import data, training, transformer

if TYPE_CHECKING:
    from conftest import Ranks

pytestmark = pytest.mark.timeout(900)
SAVED_AT = 4  # the step the first run saves; every restore continues from there
CONTINUE = 3  # steps trained after a restore
B = workers.SHARDED_BLOCK_BYTES
# Bytes a restore may read beyond what its loader counts (rchar also counts the occasional small read that is
# not the checkpoint's: a /proc file, a socket): generous, and far below one rank's ~0.7 MB.
RCHAR_SLACK = 16 << 10


def launch(ranks: Ranks, store_dir: pathlib.Path, root: str, world: int, **kwargs: Any) -> dict[int, dict]:
    """Runs `world` rank processes of collective_workers.sharded_run; their reports by rank (none from a rank
    its `fault` kills)."""
    store_dir.mkdir()
    for rank in range(world):
        ranks.start(rank, _run, str(store_dir), root, rank, world, ranks.results, kwargs)
    killed = [r for r, fault in (kwargs.get("fault") or {}).items() if fault.endswith(":kill")]
    reports = dict(ranks.get() for _ in range(world - len(killed)))
    for process in ranks.processes.values():
        process.join(60)
    ranks.processes.clear()
    failed = {rank: report for rank, report in reports.items() if isinstance(report, str)}
    assert not failed, failed
    return reports


def _run(store_dir: str, root: str, rank: int, world: int, results: Any, kwargs: dict) -> None:
    workers.sharded_run(store_dir, root, rank, world, results, **kwargs)


@pytest.fixture(scope="module")
def uninterrupted() -> list[float]:
    """The losses of one process training SAVED_AT + CONTINUE steps without stopping (every world size matches
    it to float tolerance: tests/integration/test_data_parallel.py)."""
    model = transformer.Transformer(**workers.SHARDED_MODEL, seed=3)
    trainer = training.Trainer(model, data.SyntheticLanguage(**workers.SHARDED_DATA), **workers.TRAINING)
    return trainer.train(SAVED_AT + CONTINUE)


def save_run(ranks: Ranks, tmp_path: pathlib.Path, root: str, world: int) -> dict[int, dict]:
    reports = launch(ranks, tmp_path / f"store-save-{world}", root, world, restore=False, train_steps=SAVED_AT,
                     save_step=SAVED_AT)
    assert all("saved" in r for r in reports.values()), reports
    return reports


def assert_resumed_exactly(reports: dict[int, dict], uninterrupted: list[float]) -> None:
    for rank, report in reports.items():
        assert report["restored"] == SAVED_AT and report["step_after_restore"] == SAVED_AT, (rank, report)
        np.testing.assert_allclose(report["losses"], uninterrupted[SAVED_AT:], rtol=1e-5)


def assert_read_only_what_is_needed(reports: dict[int, dict], *, local: bool) -> None:
    """Each rank read every byte it needs and, beyond that, at most two partial checksum blocks per saved chunk
    it read only part of (each part here is one byte run: the moments are 1-D, the parameters whole); the
    kernel's count of bytes read agrees with the loader's."""
    for rank, report in reports.items():
        read = report["read"]
        assert read["needed"] <= read["data"] <= read["needed"] + 2 * B * read["cut"], (rank, read)
        if local:
            counted = read["data"] + read["metadata"]
            assert counted <= report["rchar"] <= counted + RCHAR_SLACK, (rank, read, report["rchar"])


@pytest.mark.parametrize("world", [3, 2, 1])
def test_a_step_saved_at_4_ranks_resumes_at_fewer_reading_only_what_each_rank_needs(
        tmp_path: pathlib.Path, ranks: Ranks, world: int, uninterrupted: list[float]) -> None:
    root = str(tmp_path / "ckpt")
    save_run(ranks, tmp_path, root, 4)
    step = pathlib.Path(root) / storage.step_name(SAVED_AT)
    manifest = json.loads((step / "manifest.json").read_bytes())
    assert manifest["world_size"] == 4 and manifest["generation"] == 1
    assert sorted(p.name for p in step.iterdir()) == ["manifest.json"] + [f"shard-{r:05d}.snpx" for r in range(4)]
    assert validate_checkpoint(step) == (True, [])
    reports = launch(ranks, tmp_path / "store-load", root, world, restore=True, train_steps=CONTINUE)
    assert_resumed_exactly(reports, uninterrupted)
    assert_read_only_what_is_needed(reports, local=True)
    exact = [r["read"]["data"] == r["read"]["needed"] for r in reports.values()]
    if world in (1, 2):  # each rank's boxes are whole saved chunks (1 and 2 divide 4): not a byte more is read
        assert all(exact)
    else:  # 3 ranks cut the saved chunks: the blocks at the cuts are read by the two ranks on either side
        assert not any(exact)


def test_a_step_saved_at_2_ranks_resumes_at_4(tmp_path: pathlib.Path, ranks: Ranks,
                                              uninterrupted: list[float]) -> None:
    root = str(tmp_path / "ckpt")
    save_run(ranks, tmp_path, root, 2)
    reports = launch(ranks, tmp_path / "store-load", root, 4, restore=True, train_steps=CONTINUE)
    assert_resumed_exactly(reports, uninterrupted)
    assert_read_only_what_is_needed(reports, local=True)


def test_an_incremental_step_of_2_ranks_resumes_at_3_through_its_references(
        tmp_path: pathlib.Path, ranks: Ranks, uninterrupted: list[float]) -> None:
    """Each rank saves the same state twice: the second step references every chunk of the first (both ranks'
    files), and 3 ranks resume from it, each reading its boxes from step SAVED_AT - 1's files."""
    root = str(tmp_path / "ckpt")
    reports = launch(ranks, tmp_path / "store-save", root, 2, restore=False, train_steps=SAVED_AT,
                     save_step=SAVED_AT - 1, save_again=SAVED_AT)
    assert all(r["saved_again"] == SAVED_AT for r in reports.values()), reports
    manifest = json.loads((pathlib.Path(root) / storage.step_name(SAVED_AT) / "manifest.json").read_bytes())
    assert manifest["version"] == 4 and manifest["uses"] == [SAVED_AT - 1]
    chunks = [c for t in manifest["tensors"] for c in t["chunks"]]
    assert all(c["from"] == [SAVED_AT - 1, f"shard-{c['shard']:05d}.snpx"] for c in chunks)
    assert validate_checkpoint(pathlib.Path(root) / storage.step_name(SAVED_AT)) == (True, [])
    reports = launch(ranks, tmp_path / "store-load", root, 3, restore=True, train_steps=CONTINUE)
    assert_resumed_exactly(reports, uninterrupted)
    assert_read_only_what_is_needed(reports, local=True)


def test_the_same_save_and_resharded_load_on_s3(s3_bucket: str, s3_env: Any, tmp_path: pathlib.Path,
                                                ranks: Ranks, uninterrupted: list[float]) -> None:
    root = f"s3://{s3_bucket}/job"
    save_run(ranks, tmp_path, root, 4)
    keys = sorted(o["Key"] for o in s3_env.client().list_objects_v2(Bucket=s3_bucket)["Contents"])
    step = f"job/{storage.step_name(SAVED_AT)}"
    assert keys == [f"{step}/COMMITTED", f"{step}/manifest.json"] + [f"{step}/shard-{r:05d}.snpx" for r in range(4)]
    reports = launch(ranks, tmp_path / "store-load", root, 3, restore=True, train_steps=CONTINUE, count_gets=True)
    assert_resumed_exactly(reports, uninterrupted)
    assert_read_only_what_is_needed(reports, local=False)
    for rank, report in reports.items():  # what came over HTTP: the loader's count, plus the commit marker
        read = report["read"]
        assert read["data"] + read["metadata"] <= report["s3_get_bytes"] <= read["data"] + read["metadata"] + 4096, (
            rank, read, report["s3_get_bytes"])


def step_names(root: str) -> list[str]:
    return sorted(os.listdir(root))


@pytest.mark.parametrize("victim", [2, 0])
def test_a_rank_killed_mid_save_commits_nothing_and_the_previous_step_restores(
        tmp_path: pathlib.Path, ranks: Ranks, victim: int, uninterrupted: list[float]) -> None:
    """The victim is SIGKILLed at its shard file's fsync (written, not yet durable), while the others wait in the
    barrier: they all fail the save, no step is committed, and what was written is removed (by rank 0 when it
    survives, else by the next start's cleanup: its owner is dead). A restart at 3 ranks resumes from the step
    before."""
    root = str(tmp_path / "ckpt")
    save_run(ranks, tmp_path, root, 4)
    reports = launch(ranks, tmp_path / "store-killed", root, 4, restore=True, train_steps=2,
                     save_step=SAVED_AT + 2, fault={victim: "fsync:1:kill"}, generation=2)
    assert sorted(reports) == sorted(set(range(4)) - {victim})
    assert all(r["save_error"][0] == "PeerLostError" for r in reports.values()), reports
    assert CheckpointCoordinator(root, read_only=True).committed_steps() == [SAVED_AT]
    reports = launch(ranks, tmp_path / "store-restart", root, 3, restore=True, train_steps=CONTINUE, generation=3)
    assert_resumed_exactly(reports, uninterrupted)
    assert step_names(root) == [storage.step_name(SAVED_AT)], "the killed save's directory is cleaned up"


def test_a_rank_whose_write_fails_fails_the_step_on_every_rank_and_the_next_save_commits(
        tmp_path: pathlib.Path, ranks: Ranks) -> None:
    root = str(tmp_path / "ckpt")
    reports = launch(ranks, tmp_path / "store", root, 3, restore=False, train_steps=1, save_step=1,
                     fault={1: "fsync:1:EIO"}, save_again=2)
    assert reports[1]["save_error"][0] == "DurabilityError", reports[1]  # its own error, where it happened
    for rank in (0, 2):
        name, message, failures = reports[rank]["save_error"]
        assert name == "ShardedCheckpointError" and list(failures) == [1] and "rank 1" in message, reports[rank]
    assert all(r["saved_again"] == 2 for r in reports.values()), reports
    coord = CheckpointCoordinator(root, read_only=True)
    assert coord.committed_steps() == [2] and coord.validate(2) == []
    assert not [n for n in step_names(root) if n.startswith(".")]


def test_a_corrupt_block_that_one_rank_reads_makes_every_rank_skip_the_step(
        tmp_path: pathlib.Path, ranks: Ranks, uninterrupted: list[float]) -> None:
    """A flipped byte in rank 1's shard of the newest step: the rank at 2 that reads it finds it, so both ranks
    roll back to the step before, and say why."""
    root = str(tmp_path / "ckpt")
    save_run(ranks, tmp_path, root, 4)
    launch(ranks, tmp_path / "store-second", root, 4, restore=True, train_steps=2, save_step=SAVED_AT + 2,
           generation=2)
    shard = pathlib.Path(root) / storage.step_name(SAVED_AT + 2) / "shard-00001.snpx"
    with open(shard, "r+b") as f:
        f.seek(4096 + 100)  # inside the first tensor rank 1 wrote
        byte = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([byte[0] ^ 0x10]))
    reports = launch(ranks, tmp_path / "store-load", root, 2, restore=True, train_steps=CONTINUE, generation=3)
    assert_resumed_exactly(reports, uninterrupted)
    for report in reports.values():
        [(step, problems)] = report["skipped"]
        assert step == SAVED_AT + 2 and any("ChecksumMismatchError" in p for p in problems), problems


def test_a_signed_step_of_2_ranks_verifies_whole_and_in_part_at_3_and_on_the_command_line(
        tmp_path: pathlib.Path, ranks: Ranks, uninterrupted: list[float]) -> None:
    """Each rank's shard file is covered by the one signature (its digest is in the signed manifest), and so is
    every block a resharded load reads (its BLAKE3 is there too): `sneppx verify` checks the whole step, a
    restore at 3 ranks with trusted_keys the parts it reads."""
    private, public = signing.generate_keypair()
    signing.save_private_key(tmp_path / "key.pem", private)
    signing.save_public_key(tmp_path / "key.pub", public)
    root = str(tmp_path / "ckpt")
    launch(ranks, tmp_path / "store-save", root, 2, restore=False, train_steps=SAVED_AT, save_step=SAVED_AT,
           coordinator_kwargs={"signing_key": str(tmp_path / "key.pem"), "trusted_keys": [str(tmp_path / "key.pub")]})
    step = pathlib.Path(root) / storage.step_name(SAVED_AT)
    manifest = json.loads((step / "manifest.json").read_bytes())
    assert sorted(manifest["files"]) == ["shard-00000.snpx", "shard-00001.snpx"]
    assert all("digests" in c for t in manifest["tensors"] for c in t["chunks"])
    sneppx = [sys.executable, "-m", "SneppX_ALG.cli"]
    for command in (["verify", str(step), "-k", str(tmp_path / "key.pub")], ["validate", str(step)]):
        result = subprocess.run(sneppx + command, capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
    reports = launch(ranks, tmp_path / "store-load", root, 3, restore=True, train_steps=CONTINUE,
                     coordinator_kwargs={"trusted_keys": [str(tmp_path / "key.pub")], "read_only": True})
    assert_resumed_exactly(reports, uninterrupted)
    assert_read_only_what_is_needed(reports, local=True)
    other = signing.generate_keypair()[1]
    signing.save_public_key(tmp_path / "other.pub", other)
    reports = launch(ranks, tmp_path / "store-untrusted", root, 3, restore=True, train_steps=0,
                     coordinator_kwargs={"trusted_keys": [str(tmp_path / "other.pub")], "read_only": True})
    for report in reports.values():  # a key the step was not signed with: no step to resume from
        assert report["restored"] is None and "UntrustedKeyError" in report["skipped"][0][1][0]
