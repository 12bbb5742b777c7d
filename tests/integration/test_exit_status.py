"""A process whose save fails, with the error left uncaught, exits with status 1 and the error's traceback:
never a signal at interpreter exit. Exit statuses drive the operator's rules, so a crash there mis-classifies
the failure.

Why it needs its own processes: what broke was interpreter exit. The uncaught error's traceback holds the
coordinator, so at exit the coordinator, its copier and its staging buffers are freed by one cycle collection,
which runs finalizers in any order: the copier was often destroyed before its buffers, and each buffer's free
then read the freed copier (a host copier's buffer went to cudaFreeHost through a table never loaded: SIGSEGV).
Each case runs several times: what the freed memory held decided whether a run crashed (about half of the S3
runs did, every local one).
"""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from SneppX_ALG import CheckpointCoordinator

S3_RUNS = 8
LOCAL_RUNS = 4

# One failing save, left uncaught. argv: root, "sync" or "async", failure ("s3-read" or "local-write").
CHILD = r"""
import sys

import numpy as np

from SneppX_ALG import CheckpointCoordinator, _native

root, mode, failure = sys.argv[1:4]


def state(step):  # 6 MiB through 4 MiB of staging: two buffers, both in use
    return {"w": np.full((256, 64), step, np.float32), "emb": np.full(6 << 20, step, np.uint8), "n": step}


# device="cpu": the CUDA runtime is never loaded, as on an install without the `cuda` extra
coord = CheckpointCoordinator(root, max_to_keep=1, async_save=mode == "async", staging_bytes=4 << 20, device="cpu")
coord.save(state(1), step=1)
coord.wait()
if failure == "s3-read":  # the bucket is gone: the next save's reads of it fail
    store = coord.storage
    for item in store.client.list_objects_v2(Bucket=store.bucket).get("Contents", []):
        store.client.delete_object(Bucket=store.bucket, Key=item["Key"])
    store.client.delete_bucket(Bucket=store.bucket)
else:  # every write fails from here on
    _native.fault_arm("write", 1, "EIO", times=1_000_000)
coord.save(state(2), step=2)
coord.wait()  # async: raises the writer's error (sync: save() raised it already)
print("the failing save did not fail")
"""


# The mechanism alone: a copier and its buffers garbage in one cycle, collected together, in either order.
CYCLE = r"""
import gc
import sys

from SneppX_ALG import _native

for _ in range(100):
    copier = _native.Copier(-1)
    buffers = [copier.alloc(1 << 16) for _ in range(4)]
    cycle = [copier, buffers] if sys.argv[1] == "copier-first" else [buffers, copier]
    cycle.append(cycle)
    del copier, buffers, cycle
    gc.collect()
"""


def run_failing_save(root: str, mode: str, failure: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", CHILD, root, mode, failure],
                          capture_output=True, text=True, timeout=300, check=False)


def assert_exits_with_the_error(result: subprocess.CompletedProcess[str], error: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, f"exit status {result.returncode}, stderr:\n{result.stderr[-3000:]}"
    assert lines and lines[-1].startswith(f"SneppX_ALG.errors.{error}: "), result.stderr[-3000:]
    assert "Fatal Python error" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_failing_on_an_s3_read_error_exits_with_status_1(s3_env, mode: str) -> None:
    client = s3_env.client()
    for _ in range(S3_RUNS):
        bucket = f"exit-{uuid.uuid4().hex[:16]}"
        client.create_bucket(Bucket=bucket)
        assert_exits_with_the_error(run_failing_save(f"s3://{bucket}/run", mode, "s3-read"), "StorageError")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_failing_on_a_local_write_error_exits_with_status_1(tmp_path, mode: str) -> None:
    for run in range(LOCAL_RUNS):
        assert_exits_with_the_error(run_failing_save(str(tmp_path / f"root-{run}"), mode, "local-write"),
                                    "StorageError")


@pytest.mark.parametrize("order", ["copier-first", "buffers-first"])
def test_a_copier_and_its_buffers_collected_together_free_in_any_order(order: str) -> None:
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", CYCLE, order], capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0 and not result.stderr, f"exit status {result.returncode}:\n{result.stderr}"


# ---- a save still pending when the program ends ---------------------------------------------------------
# The program ends (the script's end, or an uncaught error) right after save(), without close(): the pending
# steps must still commit. They used to be finished only by the coordinator's weakref.finalize, an atexit
# callback, so after concurrent.futures had stopped its thread pools at interpreter exit: an S3 shard of more
# than one part (a multipart upload, its parts sent from a pool) failed with "cannot schedule new futures after
# interpreter shutdown", and the step was lost. To make "still pending at exit" certain rather than likely,
# step 1's commit waits in commit_fence until the interpreter has begun to exit (a threading exit hook of the
# child's own, registered last so it runs first), with step 2 queued behind it. A local root needs no pool; it
# is tested for the same outcome. argv: root, ending ("end" or "raise"), failure ("none", "s3-read" or
# "local-write": made by that exit hook, so that the pending saves fail while the program exits).
PENDING = r"""
import sys
import threading

import numpy as np

from SneppX_ALG import CheckpointCoordinator, _native

root, ending, failure = sys.argv[1:4]
exiting = threading.Event()


def state(step):  # 20 MiB: more than one 16 MiB upload part, so S3 gets a multipart upload
    return {"w": np.full((256, 64), step, np.float32), "emb": np.full(20 << 20, step, np.uint8), "n": step}


at_fence = threading.Event()


def fence():
    at_fence.set()
    exiting.wait(120)


coord = CheckpointCoordinator(root, max_to_keep=2, staging_bytes=64 << 20, device="cpu", commit_fence=fence)


def at_exit():  # runs once the program has ended, before the interpreter stops anything
    try:
        if failure == "s3-read":  # the bucket is gone: the pending saves fail
            at_fence.wait(120)  # the writer is idle (step 1 waits to commit): the bucket can be emptied
            store = coord.storage
            for item in store.client.list_objects_v2(Bucket=store.bucket).get("Contents", []):
                store.client.delete_object(Bucket=store.bucket, Key=item["Key"])
            store.client.delete_bucket(Bucket=store.bucket)
        elif failure == "local-write":  # every write fails from here on
            _native.fault_arm("write", 1, "EIO", times=1_000_000)
    finally:
        exiting.set()


threading._register_atexit(at_exit)
coord.save(state(1), step=1)
coord.save(state(2), step=2)
if ending == "raise":
    raise RuntimeError("the training loop failed after save()")
"""
LOST = "checkpoint save failed, and the program ended without close() or wait() to raise it: "


def run_pending_save(root: str, ending: str, failure: str = "none") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", PENDING, root, ending, failure],
                          capture_output=True, text=True, timeout=300, check=False)


def assert_ended_as_the_program(result: subprocess.CompletedProcess[str], ending: str) -> None:
    """The exit status is the program's own: 0, or 1 with the uncaught error's traceback."""
    tail = result.stderr[-3000:]
    assert "Fatal Python error" not in result.stderr and "Exception ignored" not in result.stderr, tail
    assert result.returncode == (0 if ending == "end" else 1), f"exit status {result.returncode}:\n{tail}"
    if ending == "raise":
        assert "RuntimeError: the training loop failed after save()" in result.stderr.splitlines(), tail


def assert_both_steps_committed(root: str, result: subprocess.CompletedProcess[str]) -> None:
    """Both steps are committed and validate (a fresh coordinator reads them), and no failure was logged."""
    reader = CheckpointCoordinator(root, read_only=True, device="cpu")
    assert reader.committed_steps() == [1, 2], result.stderr[-3000:]
    assert reader.validate(1) == [] and reader.validate(2) == []
    restored: dict = {}
    info = reader.restore(restored)
    assert info is not None and info.step == 2 and restored["n"] == 2 and int(restored["emb"][-1]) == 2
    assert "checkpoint" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("ending", ["end", "raise"])
def test_a_save_pending_at_exit_is_committed_on_s3(s3_env, ending: str) -> None:
    bucket = f"exit-{uuid.uuid4().hex[:16]}"
    s3_env.client().create_bucket(Bucket=bucket)
    result = run_pending_save(f"s3://{bucket}/run", ending)
    assert_ended_as_the_program(result, ending)
    assert_both_steps_committed(f"s3://{bucket}/run", result)


@pytest.mark.parametrize("ending", ["end", "raise"])
def test_a_save_pending_at_exit_is_committed_on_a_local_root(tmp_path, ending: str) -> None:
    result = run_pending_save(str(tmp_path / "root"), ending)
    assert_ended_as_the_program(result, ending)
    assert_both_steps_committed(str(tmp_path / "root"), result)


@pytest.mark.parametrize("ending", ["end", "raise"])
def test_a_save_failing_at_exit_on_s3_is_logged_and_keeps_the_exit_status(s3_env, ending: str) -> None:
    bucket = f"exit-{uuid.uuid4().hex[:16]}"
    s3_env.client().create_bucket(Bucket=bucket)
    result = run_pending_save(f"s3://{bucket}/run", ending, "s3-read")
    assert_ended_as_the_program(result, ending)
    assert LOST in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("ending", ["end", "raise"])
def test_a_save_failing_at_exit_on_a_local_root_is_logged_and_keeps_the_exit_status(tmp_path, ending: str) -> None:
    result = run_pending_save(str(tmp_path / "root"), ending, "local-write")
    assert_ended_as_the_program(result, ending)
    assert LOST in result.stderr, result.stderr[-3000:]
    reader = CheckpointCoordinator(str(tmp_path / "root"), read_only=True, device="cpu")
    assert 2 not in reader.committed_steps()
