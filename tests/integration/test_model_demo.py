"""`make demo` end to end, on the tiny model: a real SIGKILL, a real second process, real files validated."""

from __future__ import annotations

import os
import subprocess
import sys

from SneppX_ALG import checkpoint, demo


def test_demo_kills_the_first_run_resumes_from_the_latest_checkpoint_and_matches_its_losses(tmp_path):
    out = tmp_path / "demo-output"
    done = subprocess.run(
        [sys.executable, "-m", "SneppX_ALG.demo", "--small", "--output", str(out), "--steps", "24", "--every", "6",
         "--crash-at", "15", "--batch-size", "8"],
        capture_output=True, text=True, timeout=300, check=False)
    text = " ".join((done.stdout + done.stderr).split())  # rich wraps lines at the console width
    assert done.returncode == 0, text
    assert "first process ended by signal 9" in text
    assert "training continued from step 12 with the same loss curve" in text
    assert "the 3 retrained steps have bitwise-identical losses" in text
    steps = [step for step, _ in demo.checkpoint_steps(str(out))]
    assert steps == [6, 12, 18, 24]
    assert all(checkpoint.validate_checkpoint(path)[0] for _, path in demo.checkpoint_steps(str(out)))
    first = demo.read_losses(os.path.join(out, "losses-first.jsonl"))
    resumed = demo.read_losses(os.path.join(out, "losses-resume.jsonl"))
    assert sorted(first) == list(range(1, 16)) and sorted(resumed) == list(range(13, 25))
    assert [first[s] for s in (13, 14, 15)] == [resumed[s] for s in (13, 14, 15)]


def test_demo_skips_a_damaged_latest_checkpoint(tmp_path):
    out = tmp_path / "ckpts"
    out.mkdir()
    for step in (5, 10):
        (out / demo.CHECKPOINT_NAME.format(step=step)).write_bytes(b"")
    assert demo.latest_valid_checkpoint(str(out)) is None
    args = demo.parse_args(["--small", "--output", str(out), "--steps", "12", "--every", "4", "--crash-at", "8"])
    trainer = demo.build_trainer(args)
    good = demo.save_checkpoint(trainer.model, str(out), 4)
    (out / demo.CHECKPOINT_NAME.format(step=8)).write_bytes(b"\x89SNPX\r\n\x1a truncated")
    assert demo.latest_valid_checkpoint(str(out)) == (4, good)
