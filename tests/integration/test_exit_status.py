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
