"""The saves the power-loss sweep records, and what restoring after them must find.

Run as a script (`python scenario.py ROOT SIGNING_KEY_PEM|- STEP...`) it saves the steps the way a training
job does: one CheckpointCoordinator with max_to_keep=1, so committing a step deletes the one before. After
each step's wait() it logs the mark "saved STEP": from there on that step is acknowledged, and a crash must
not lose it. With SNEPPX_SCENARIO_RESUME=1 it is a job that restarted: it restores the newest step first, and
its saves are incremental (the frozen part of the state referenced, not written), so the step before is kept
for as long as the new one references it. Without, every save is full.
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Any

import numpy as np
import oplog

from SneppX_ALG import CheckpointCoordinator

MAX_TO_KEEP = 1
STAGING_BYTES = 64 << 10  # less than the state: the snapshot streams through several staging buffers


def state_for(step: int) -> dict[str, Any]:
    """About 130 KiB in several dtypes, different at every step (so a mix of two steps can't pass)."""
    rng = np.random.default_rng(step)
    return {"frozen": np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32),  # never changes
            "w": rng.standard_normal((96, 160)).astype(np.float32),
            "emb": rng.integers(0, 255, (40, 1024), dtype=np.uint8),
            "opt": {"m": rng.standard_normal(1000), "t": np.int64(step)}}


def training_state_for(step: int) -> dict[str, Any]:
    return {"step": step, "data_position": step * 32}


def save(root: pathlib.Path, steps: list[int], signing_key: Any = None, *, resume: bool = False) -> None:
    coord = CheckpointCoordinator(root, max_to_keep=MAX_TO_KEEP, staging_bytes=STAGING_BYTES, device="cpu",
                                  signing_key=signing_key, incremental=resume)
    with coord:
        if resume:
            coord.restore({})
        for step in steps:
            coord.save(state_for(step), step=step, training_state=training_state_for(step))
            coord.wait()
            oplog.mark(f"saved {step}")


def plant_leftovers(root: pathlib.Path, step: int) -> None:
    """What a crash before this run left: a half-written step and a half-deleted one (the next start's
    cleanup removes both, so the recorded run also covers a power cut during cleanup)."""
    partial = root / f".tmp-step-{step:09d}-4242-0badf00d"
    partial.mkdir()
    (partial / ".shard-00000.snpx.4242.0badf00d.tmp").write_bytes(b"SNPX" + bytes(8188))
    doomed = root / f".deleting-step-{step - 2:09d}-0badf00d"
    doomed.mkdir()
    (doomed / "manifest.json").write_bytes(b"{}")


def restore_problem(root: pathlib.Path, allowed: tuple[int, ...], marks: tuple[str, ...],
                    trusted_keys: Any = None, *, fresh_root: bool = False) -> tuple[int | None, str | None]:
    """What a job restarting on `root` finds: (the step restored, or None; what is wrong, or None).

    Right means: a fresh coordinator (cleanup on, as at a restart) restores one of `allowed` (or nothing, on
    a `fresh_root` that had no checkpoint before, until one was acknowledged), and none older than the newest
    step acknowledged in `marks`; latest() agrees; every array and the training state are
    bit-exact for that step; and no committed step fails validation (a `step-*` directory is whole by
    construction: an invalid one would be a broken commit that restore() silently rolls back past)."""
    acknowledged = max((int(m.split()[1]) for m in marks if m.startswith("saved ")), default=None)
    coord = CheckpointCoordinator(root, max_to_keep=MAX_TO_KEEP, device="cpu", trusted_keys=trusted_keys)
    with coord:
        latest = coord.latest()
        restored: dict[str, Any] = {}
        info = coord.restore(restored)
        committed = coord.committed_steps()
        invalid = sorted({(s.step, s.problems[0]) for s in coord.skipped})
    step = None if info is None else info.step
    if invalid:
        return step, f"committed steps fail validation: {invalid}"
    if info is None and (acknowledged is not None or not fresh_root):
        what = f"step {acknowledged} had been acknowledged (wait() returned)" if acknowledged is not None else (
            "the step before had been committed")
        return None, f"no checkpoint at all (committed steps: {committed}), but {what}"
    if info is None:
        return None, None
    if info.step not in allowed:
        return step, f"step {info.step} restored, expected one of {allowed}"
    if acknowledged is not None and info.step < acknowledged:
        return step, f"step {info.step} restored, but step {acknowledged} had been acknowledged (wait() returned)"
    if latest is None or latest.step != info.step:
        return step, f"latest() says {latest and latest.step}, restore() loaded {info.step}"
    wrong = differences(restored, state_for(info.step))
    if wrong:
        return step, f"step {info.step} restored with wrong contents: {wrong}"
    if info.training_state != training_state_for(info.step):
        return step, f"step {info.step} restored with training state {info.training_state}"
    return step, None


def differences(got: Any, want: Any, path: str = "") -> list[str]:
    """Where two state trees differ, bit for bit (dtype, shape and bytes of every array)."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{path or '.'}: keys {sorted(got) if isinstance(got, dict) else type(got)} != {sorted(want)}"]
        return [d for key in want for d in differences(got[key], want[key], f"{path}.{key}")]
    got_array, want_array = np.asarray(got), np.asarray(want)
    if got_array.dtype != want_array.dtype or got_array.shape != want_array.shape:
        return [f"{path}: {got_array.dtype}{got_array.shape} != {want_array.dtype}{want_array.shape}"]
    if got_array.tobytes() != want_array.tobytes():
        return [f"{path}: bytes differ"]
    return []


if __name__ == "__main__":
    save(pathlib.Path(sys.argv[1]), [int(a) for a in sys.argv[3:]], None if sys.argv[2] == "-" else sys.argv[2],
         resume=os.environ.get("SNEPPX_SCENARIO_RESUME") == "1")
