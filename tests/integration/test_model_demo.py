"""`make demo` end to end, on the tiny model: a real SIGKILL, a real second process, real files validated."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from SneppX_ALG import demo


def run_demo(out, *extra: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "SneppX_ALG.demo", "--small", "--output", str(out), "--steps", "24", "--every", "6",
         "--crash-at", "15", "--batch-size", "8", *extra],
        capture_output=True, text=True, timeout=300, check=False)
    text = " ".join((done.stdout + done.stderr).split())  # rich wraps lines at the console width
    assert done.returncode == 0, text
    return text


def test_demo_kills_the_first_run_resumes_from_the_latest_checkpoint_and_matches_its_losses(tmp_path):
    out = tmp_path / "demo-output"
    text = run_demo(out)
    assert "first process ended by signal 9" in text
    assert "async checkpoint saved in" in text
    # The kill after step 15 may land while the step-12 save is still being written (this tiny model trains
    # three steps in milliseconds): then that save is lost, as it would be on a real node, and step 6 is latest.
    resumed_from = int(re.search(r"training continued from step (\d+) with the same loss curve", text).group(1))
    assert resumed_from in (6, 12)
    assert f"the {15 - resumed_from} retrained steps have bitwise-identical losses" in text
    args = demo.parse_args(["--small", "--output", str(out), "--steps", "24", "--every", "6", "--crash-at", "15"])
    checkpoints = demo.open_checkpoints(args)
    assert checkpoints.committed_steps() == [6, 12, 18, 24]
    assert all(checkpoints.validate(step) == [] for step in checkpoints.committed_steps())
    first = demo.read_losses(os.path.join(out, "losses-first.jsonl"))
    resumed = demo.read_losses(os.path.join(out, "losses-resume.jsonl"))
    assert sorted(first) == list(range(1, 16)) and sorted(resumed) == list(range(resumed_from + 1, 25))
    replayed = range(resumed_from + 1, 16)
    assert [first[s] for s in replayed] == [resumed[s] for s in replayed]


def test_demo_resumes_past_a_damaged_latest_checkpoint(tmp_path):
    out = tmp_path / "demo-output"
    args = demo.parse_args(["--small", "--output", str(out), "--steps", "12", "--every", "4", "--crash-at", "8"])
    trainer = demo.build_trainer(args)
    with demo.open_checkpoints(args) as checkpoints:
        for step in (4, 8):
            trainer.train(4)
            checkpoints.save(trainer.model, step=step)
    shard = os.path.join(checkpoints.storage.step_path(8), "shard-00000.snpx")
    blob = bytearray(open(shard, "rb").read())
    blob[5000] ^= 0x40
    open(shard, "wb").write(blob)
    checkpoints = demo.open_checkpoints(args)
    assert checkpoints.latest().step == 4
    assert [s.step for s in checkpoints.skipped] == [8] and "CRC32C" in checkpoints.skipped[0].problems[0]
