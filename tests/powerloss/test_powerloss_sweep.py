"""Power loss at every point of a real save: whatever the disk keeps, a restart restores the old or the new step.

A root holds step 7 (and leftovers of an earlier crash); a CheckpointCoordinator with max_to_keep=1, in its
own process under the recording shim, saves step 8, so committing 8 deletes 7. In the "resumed" recording the
process restores 7 first and saves 8 as an incremental step that references 7's frozen tensor: retention must
keep 7 then, at every crash point, or 8 would be left with references to nothing. For every crash point of the
recorded log, every on-disk state the persistence model allows (crashfs.py; docs/TESTING.md, "Power loss")
is written into a fresh directory and a fresh coordinator restores from it: it must get step 7 or step
8, bit-exact, never a mix, never nothing, and never 7 once wait() had returned for 8.

The planted bugs below are the ones a SIGKILL harness can't see (the page cache survives a kill): a commit
whose directory is not fsynced, a shard renamed into place before its data is fsynced, and a save acknowledged
before its commit is durable. Each is planted in the recorded log (the fsync taken out, the mark moved), which
is exactly the log the buggy code would have written, and the sweep must fail on it.

SNEPPX_POWERLOSS=full widens it: four saves in a row (8 to 11, each deleting the one before), writes that may
tear at every 4 KiB block instead of only halfway, and every state up to 65536 per crash point (pairs and 256
random states beyond that, instead of single ops).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import crashfs
import oplog
import pytest
import scenario
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from SneppX_ALG import storage

FULL = os.environ.get("SNEPPX_POWERLOSS") == "full"
OLD = 7
NEW = (8, 9, 10, 11) if FULL else (8,)
EXHAUSTIVE_UP_TO = 1 << 16 if FULL else 4096


@dataclasses.dataclass
class Recording:
    initial: crashfs.Tree
    ops: list[oplog.Op]
    after: crashfs.Tree
    trusted_keys: Any
    write_mode: str
    resumed: bool = False

    def replay(self, ops: list[oplog.Op] | None = None, *, every_tear: bool = FULL) -> crashfs.Replay:
        return crashfs.Replay(self.initial, self.ops if ops is None else ops, every_tear=every_tear)


@pytest.fixture(scope="module")
def record_saves(recorder_shim: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(signed, write mode, resumed) -> Recording: step OLD committed (plus leftovers), then the NEW steps saved
    by another process under the shim, its shards written in that mode (SNEPPX_WRITE_MODE), after restoring OLD
    when `resumed` (incremental saves). Each kind is recorded once per module."""
    recordings: dict[tuple[bool, str, bool], Recording] = {}

    def record(signed: bool, mode: str, resumed: bool = False) -> Recording:
        if (signed, mode, resumed) not in recordings:
            recordings[signed, mode, resumed] = _record(recorder_shim, tmp_path_factory.mktemp("powerloss"), signed,
                                                        mode, resumed)
        return recordings[signed, mode, resumed]

    return record


def _record(shim: pathlib.Path, folder: pathlib.Path, signed: bool, mode: str, resumed: bool) -> Recording:
    root = folder / "root"
    key = key_file = trusted = None
    if signed:
        key = ed25519.Ed25519PrivateKey.generate()
        key_file = folder / "signing.pem"
        key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        trusted = key.public_key()
    scenario.save(root, [OLD], key, resume=resumed)  # resumed: saved incremental, so its blocks carry BLAKE3s
    scenario.plant_leftovers(root, NEW[0])
    initial = crashfs.read_tree(root)
    argv = [sys.executable, scenario.__file__, str(root), str(key_file or "-"), *map(str, NEW)]
    env = {"SNEPPX_WRITE_MODE": mode, "SNEPPX_SCENARIO_RESUME": "1" if resumed else "0"}
    ops = oplog.record(shim, root, argv, workdir=folder, env=env)
    return Recording(initial, ops, crashfs.read_tree(root), trusted, mode, resumed)


# Shards are written with O_DIRECT or buffered with write-behind, whichever measured faster on the filesystem
# (checkpoint/write_mode.py): both are swept. Signing changes what is written, not how, so once is enough.
# "resumed": an incremental save, after a restore, whose retention must keep the step it references.
@pytest.fixture(params=["unsigned-direct", "signed-direct", "unsigned-buffered", "unsigned-direct-resumed"])
def recording(request: pytest.FixtureRequest, record_saves: Any) -> Recording:
    signed, mode, *resumed = request.param.split("-")
    return record_saves(signed == "signed", mode, bool(resumed))


@pytest.fixture(autouse=True)
def quiet_restores() -> Iterator[None]:
    """Thousands of restores of broken states: the coordinator's warnings would bury a failure's message."""
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def run_sweep(recording: Recording, replay: crashfs.Replay, workdir: pathlib.Path, *,
              exhaustive_up_to: int = EXHAUSTIVE_UP_TO) -> tuple[crashfs.SweepResult, Counter[int | None]]:
    restored: Counter[int | None] = Counter()

    def check(state: pathlib.Path, marks: tuple[str, ...]) -> str | None:
        step, problem = scenario.restore_problem(state, (OLD, *NEW), marks, recording.trusted_keys)
        restored[step] += 1
        return problem

    result = crashfs.sweep(replay, check, workdir, exhaustive_up_to=exhaustive_up_to, wide=FULL)
    print(f"power-loss sweep: {result.summary()}; restored steps {dict(restored)}")
    return result, restored


def test_replaying_the_recorded_save_rebuilds_the_tree_it_left(recording: Recording) -> None:
    replay = recording.replay()
    assert replay.final() == recording.after, "the recording missed something the save did"
    kept = {storage.step_name(OLD)} if recording.resumed else set()  # referenced by the new step: kept
    assert {storage.step_name(NEW[-1])} | kept == {p for p in recording.after if "/" not in p}, "the save did not finish"
    if recording.resumed:
        manifest = json.loads(recording.after[f"{storage.step_name(NEW[-1])}/{storage.MANIFEST}"])
        assert manifest["uses"] == [OLD], "the resumed save did not reference the step it restored"
    if recording.write_mode == "direct":
        assert replay.direct_writes and replay.buffered_writes, "shards go through O_DIRECT, the manifest buffered"
    else:
        assert replay.buffered_writes and not replay.direct_writes, "every write buffered"


def test_every_power_loss_state_restores_the_old_or_the_new_step(recording: Recording,
                                                                 tmp_path: pathlib.Path) -> None:
    result, restored = run_sweep(recording, recording.replay(), tmp_path)
    if result.findings:
        pytest.fail(result.message(), pytrace=False)
    assert restored[OLD] and restored[NEW[-1]], f"a sweep that never restores both steps tests nothing: {restored}"
    assert result.exhaustive_points == result.crash_points or FULL, (
        "every crash point of this save used to be swept exhaustively; the save now leaves more ops unsynced "
        f"at once ({result.summary()}): raise EXHAUSTIVE_UP_TO or accept the bounded states")


def test_the_first_save_into_a_root_that_does_not_exist_yet_survives_power_loss(recorder_shim: pathlib.Path,
                                                                                  tmp_path: pathlib.Path) -> None:
    """The coordinator creates its root (and a parent of it): once the first step is acknowledged, a power cut
    must not take the new directories, and the checkpoint in them, away."""
    volume = tmp_path / "volume"
    volume.mkdir()
    root = volume / "checkpoints" / "run-1"
    ops = oplog.record(recorder_shim, volume, [sys.executable, scenario.__file__, str(root), "-", "1"],
                       workdir=tmp_path)
    replay = crashfs.Replay({}, ops, every_tear=FULL)
    assert replay.final() == crashfs.read_tree(volume)

    def check(state: pathlib.Path, marks: tuple[str, ...]) -> str | None:
        return scenario.restore_problem(state / "checkpoints" / "run-1", (1,), marks, fresh_root=True)[1]

    result = crashfs.sweep(replay, check, tmp_path, exhaustive_up_to=EXHAUSTIVE_UP_TO, wide=FULL)
    print(f"power-loss sweep of a first save: {result.summary()}")
    if result.findings:
        pytest.fail(result.message(), pytrace=False)


# ---- planted bugs: each is a log the buggy code would have written, and the sweep must refuse it ----------


def renumbered(ops: list[oplog.Op]) -> list[oplog.Op]:
    return [dataclasses.replace(op, index=i) for i, op in enumerate(ops)]


def commit_rename(ops: list[oplog.Op]) -> int:
    return next(op.index for op in ops if op.kind == "rename" and op.path2 == storage.step_name(NEW[0]))


def without_the_commits_directory_fsync(recording: Recording) -> list[oplog.Op]:
    """LocalStorage.finalize() with os.rename instead of rename_durable: the root is not fsynced after the commit."""
    rename = commit_rename(recording.ops)
    fsync = next(op.index for op in recording.ops[rename:] if op.kind == "fsync")
    return renumbered(recording.ops[:fsync] + recording.ops[fsync + 1:])


def without_the_shards_fsync(recording: Recording) -> list[oplog.Op]:
    """The native writer's finish() without its fsync: the shard is renamed into the step with its data in
    the page cache only."""
    labels = recording.replay().labels
    fsync = next(op.index for op in recording.ops if op.kind == "fsync" and ".shard-" in labels[op.index])
    return renumbered(recording.ops[:fsync] + recording.ops[fsync + 1:])


def acknowledged_before_the_commit_is_durable(recording: Recording) -> list[oplog.Op]:
    """wait() returning as soon as the step is renamed into place, before the root is fsynced."""
    mark = next(op.index for op in recording.ops if op.kind == "mark")
    ops = recording.ops[:mark] + recording.ops[mark + 1:]
    rename = commit_rename(ops)
    return renumbered(ops[:rename + 1] + [recording.ops[mark]] + ops[rename + 1:])


@pytest.mark.parametrize("exhaustive_up_to", [EXHAUSTIVE_UP_TO, 0], ids=["every-state", "bounded-states"])
@pytest.mark.parametrize("plant", [without_the_commits_directory_fsync, without_the_shards_fsync,
                                   acknowledged_before_the_commit_is_durable])
@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_the_sweep_catches_a_planted_durability_bug(record_saves: Any, tmp_path: pathlib.Path, plant: Any,
                                                    exhaustive_up_to: int, mode: str) -> None:
    recording = record_saves(False, mode)  # the signed save differs only by one more file written the same way
    # the plants are caught with the default model: widening it would only multiply the states that fail
    result, _ = run_sweep(recording, recording.replay(plant(recording), every_tear=False), tmp_path,
                          exhaustive_up_to=exhaustive_up_to)
    assert result.findings, f"the sweep missed the planted bug ({plant.__name__}): {result.summary()}"
    message = result.message()
    print(message)
    assert "crash after op" in message and "restore found:" in message
