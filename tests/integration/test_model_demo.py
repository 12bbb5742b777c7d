"""`make demo` end to end, on the tiny model: real SIGKILLs, real processes, real files validated.

Scene 1 (`--scene resume`): one process killed, a second one resumes. Scene 2 (`--scene elastic`): an
ElasticTrainer of 2 node agents x 2 workers loses node-1 to a SIGKILL, goes on at world size 2 and grows back to 4.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from pathlib import Path

from SneppX_ALG import coordinator, demo


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
    text = run_demo(out, "--scene", "resume")
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
    blob = bytearray(pathlib.Path(shard).read_bytes())
    blob[5000] ^= 0x40
    pathlib.Path(shard).write_bytes(blob)
    checkpoints = demo.open_checkpoints(args)
    assert checkpoints.latest().step == 4
    assert [s.step for s in checkpoints.skipped] == [8] and "CRC32C" in checkpoints.skipped[0].problems[0]


def processes_with_environment(needle: str) -> list[int]:
    """Live processes whose environment mentions `needle` (what the elastic run's agents and workers inherit)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            raw = Path(f"/proc/{entry}/environ").read_bytes() if entry.isdigit() else b""
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] if raw else "Z"
        except OSError:
            continue
        if needle.encode() in raw and state != "Z" and int(entry) != os.getpid():
            found.append(int(entry))
    return found


def test_demo_elastic_scene_loses_a_node_goes_on_at_world_size_2_and_grows_back_to_4(tmp_path):
    out = tmp_path / "demo-output"
    # 300 steps of at least 50 ms: node-1 is killed after step 24 and comes back 1 s later, ~13 s before the end.
    text = run_demo(out, "--scene", "elastic", "--elastic-steps", "300", "--elastic-every", "6", "--kill-at", "24",
                    "--node-restart-delay", "1")
    assert "SIGKILL to node-1" in text and "node-0 detected a failure" in text, text
    assert "world sizes, generation by generation: 4 -> 2 -> 4" in text, text
    assert "the run survived the loss of a node" in text and "FAILED" not in text, text
    assert re.search(r"failure detected \│ \d+\.\d\d s", text), text  # the figures table was printed
    # The story, from the agents' own event files rather than the demo's words:
    events = sorted((json.loads(line) for f in (out / "elastic-events").glob("*.events.jsonl")
                     for line in f.read_text().splitlines()), key=lambda e: e["t"])
    sizes = {e["generation"]: e["world_size"] for e in events if e["kind"] == "generation"}
    assert [sizes[g] for g in sorted(sizes)] == [4, 2, 4], sizes
    assert any("node-1" in e["reason"] or "peer lost" in e["reason"] for e in events if e["kind"] == "failure")
    restored = [e for e in events if e["kind"] == "restored"]
    assert [e["generation"] for e in restored] == [0, 1, 2] and restored[0]["step"] is None
    assert [e["source"] for e in restored] == ["storage", "memory", "memory"], restored  # peer-memory snapshots
    before_kill = max(e["step"] for e in events if e["kind"] == "step" and e["generation"] == 0)
    assert before_kill - restored[1]["step"] <= 2, restored  # not the 6 a checkpoint interval may cost
    assert restored[2]["step"] % 6 == 0, restored  # node-1 joined at a checkpoint boundary
    assert re.search(r"[01] steps redone \(restored from peer memory\)", text), text
    assert max(e["step"] for e in events if e["kind"] == "step") == 300
    # Every committed checkpoint validates, checked here independently of the demo's table; the last is step 300.
    checkpoints = coordinator.CheckpointCoordinator(str(out / "elastic-ckpts"))
    steps = checkpoints.committed_steps()
    assert steps and steps[-1] == 300, steps
    assert all(checkpoints.validate(step) == [] for step in steps)
    assert processes_with_environment(str(out / "elastic-events")) == []  # no agent or worker left behind
