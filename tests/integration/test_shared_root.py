"""Several processes on one checkpoint root: a second coordinator (or a reader) must never destroy a save in
flight, leftovers are removed only once their writer is provably gone, and a commit checks its parts first.

Writers here are real processes (a child paused mid-save on a pipe, by a hook around the storage call or a
botocore event), on a local root and on the S3 test server; the second coordinator opens the same root while
the first is paused.
"""

from __future__ import annotations

import datetime
import inspect
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from SneppX_ALG import CheckpointCoordinator, errors, storage
from SneppX_ALG.coordinator import plan
from SneppX_ALG.storage import lease

MiB = 1 << 20


def state_for(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((64, 64)).astype(np.float32),
            "emb": rng.integers(0, 255, 12 * MiB, dtype=np.uint8)}


def assert_restores(root: str, step: int, **kwargs) -> None:
    reader = CheckpointCoordinator(root, read_only=True, **kwargs)
    got = {"w": np.zeros((64, 64), np.float32), "emb": None}
    info = reader.restore(got, step=step)
    want = state_for(step)
    assert info.step == step and info.training_state == {"step": step}
    assert got["w"].tobytes() == want["w"].tobytes() and got["emb"].tobytes() == want["emb"].tobytes()


WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from SneppX_ALG import CheckpointCoordinator, storage
    MiB = 1 << 20
    STATE_FOR
    root, endpoint, pause_at = sys.argv[1:4]
    paused = []

    def pause(*_, **__):
        if not paused:
            paused.append(True)
            print("paused", flush=True)
            sys.stdin.readline()

    client = None
    if endpoint:
        client = storage.make_s3_client(endpoint_url=endpoint)

        def on_call(params, **_):
            if params.get("PartNumber") == 2 or params.get("Key", "").endswith("/manifest.json"):
                pause()

        client.meta.events.register(f"before-parameter-build.s3.{pause_at}", on_call)
    else:
        finalize = storage.LocalStorage.finalize
        storage.LocalStorage.finalize = lambda self, *args: (pause(), finalize(self, *args))[1]
    coord = CheckpointCoordinator(root, s3_client=client, cleanup_on_start=False)
    if endpoint:
        coord.storage.part_bytes = 5 * MiB
    coord.save(state_for(2), step=2, training_state={"step": 2})
    coord.close()
    print("saved", flush=True)
""").replace("STATE_FOR", inspect.getsource(state_for))

SECOND = textwrap.dedent("""
    import sys
    from SneppX_ALG import CheckpointCoordinator, storage
    root, endpoint = sys.argv[1:3]
    client = storage.make_s3_client(endpoint_url=endpoint) if endpoint else None
    coord = CheckpointCoordinator(root, s3_client=client)
    print(coord.latest().step, flush=True)
""")


def start_paused_writer(root: str, endpoint: str = "", pause_at: str = "") -> subprocess.Popen[bytes]:
    writer = subprocess.Popen([sys.executable, "-c", WRITER, root, endpoint, pause_at], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    assert writer.stdout is not None
    assert writer.stdout.readline().strip() == b"paused", "the writer never paused"
    return writer


def resume(writer: subprocess.Popen[bytes]) -> bytes:
    out, _ = writer.communicate(b"go\n", timeout=300)
    return out


def open_second_coordinator(root: str, endpoint: str = "") -> int:
    """A second coordinator in its own process, with the default cleanup at start; returns its latest step."""
    done = subprocess.run([sys.executable, "-c", SECOND, root, endpoint], capture_output=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr.decode()
    return int(done.stdout)


# ---- a local root ------------------------------------------------------------------------------------------


def test_a_second_coordinator_on_a_local_root_leaves_a_save_in_flight_alone(tmp_path) -> None:
    root = str(tmp_path)
    with CheckpointCoordinator(root) as first:
        first.save(state_for(1), step=1, training_state={"step": 1})
    writer = start_paused_writer(root)  # its step 2 is written, not yet committed
    try:
        in_flight = [n for n in os.listdir(root) if n.startswith(".tmp-step-000000002-")]
        assert len(in_flight) == 1
        assert open_second_coordinator(root) == 1  # the step in flight is invisible ...
        assert os.listdir(tmp_path / in_flight[0]), "... and the second coordinator's cleanup left it alone"
    finally:
        out = resume(writer)
    assert writer.returncode == 0 and out.strip() == b"saved"
    assert_restores(root, 2)
    assert sorted(os.listdir(root)) == ["step-000000001", "step-000000002"]


def test_leftovers_of_a_writer_on_another_machine_stay_until_its_claim_expires(tmp_path) -> None:
    """A writer on another host sharing the root (NFS): its pid says nothing here, so only the age of its last
    sign of life (the directory's mtime, touched every expiry/10 by its writer) can tell it is gone."""
    elsewhere = lease.Owner("feedfacecafebeef", "0123456789ab", 4242, 99)
    tmp = tmp_path / f".tmp-step-000000003-{elsewhere.name()}"
    tmp.mkdir()
    (tmp / "shard-00000.snpx").write_bytes(b"being written")
    store = storage.LocalStorage(str(tmp_path))
    assert store.cleanup() == [] and tmp.exists()
    long_ago = time.time() - lease.LEASE_EXPIRY_S - 60
    os.utime(tmp, (long_ago, long_ago))
    assert store.cleanup() == [str(tmp)] and not tmp.exists()


def test_a_reader_never_cleans_up_and_never_saves(tmp_path) -> None:
    leftover = tmp_path / ".tmp-step-000000002-1-abcd"  # a crashed writer's, from before claims had owners
    leftover.mkdir()
    reader = CheckpointCoordinator(tmp_path, read_only=True)
    assert leftover.exists() and reader.latest() is None
    with pytest.raises(errors.ReadOnlyCoordinatorError):
        reader.save({"w": np.ones(2)}, step=1)
    with pytest.raises(ValueError, match="read_only"):
        CheckpointCoordinator(tmp_path, read_only=True, cleanup_on_start=True)
    CheckpointCoordinator(tmp_path)  # a writer does clean up
    assert not leftover.exists()


def test_a_local_commit_fails_when_a_part_was_removed_under_it(tmp_path, monkeypatch) -> None:
    """What a cleanup that wrongly judged this writer gone would do: remove the shard before the commit. The
    commit must fail, not rename a step without its shard into place."""
    finalize = storage.LocalStorage.finalize

    def remove_shard_then_finalize(self, pending, *args):
        os.unlink(os.path.join(pending.local_dir, "shard-00000.snpx"))
        return finalize(self, pending, *args)

    with CheckpointCoordinator(tmp_path) as coord:
        coord.save(state_for(1), step=1, training_state={"step": 1})
        coord.wait()
        monkeypatch.setattr(storage.LocalStorage, "finalize", remove_shard_then_finalize)
        coord.save(state_for(2), step=2, training_state={"step": 2})
        with pytest.raises(errors.StorageError, match="shard-00000.snpx is missing"):
            coord.wait()
        assert coord.committed_steps() == [1]
    assert_restores(str(tmp_path), 1)


# ---- an S3 root --------------------------------------------------------------------------------------------


# Paused mid multipart upload, or with the shard up and no manifest yet.
@pytest.mark.parametrize("pause_at", ["UploadPart", "PutObject"])
def test_a_second_process_starting_mid_upload_removes_nothing_of_it(s3_bucket, s3_env, pause_at) -> None:
    client = s3_env.client()
    root = f"s3://{s3_bucket}/shared"
    with CheckpointCoordinator(root, s3_client=client) as first:
        first.save(state_for(1), step=1, training_state={"step": 1})
    store = storage.S3Storage(root, client=client)
    writer = start_paused_writer(root, s3_env.endpoint, pause_at)
    try:
        before = sorted(o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"])
        uploads = store.incomplete_uploads()
        assert len(uploads) == (1 if pause_at == "UploadPart" else 0)
        assert open_second_coordinator(root, s3_env.endpoint) == 1
        assert store.incomplete_uploads() == uploads, "the second process aborted the upload in flight"
        assert sorted(o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"]) == before
    finally:
        out = resume(writer)
    assert writer.returncode == 0 and out.strip() == b"saved"
    assert_restores(root, 2, s3_client=client)
    assert store.incomplete_uploads() == []
    assert not [o for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"] if "/.lease-" in o["Key"]]


def test_s3_leftovers_of_a_writer_on_another_machine_stay_until_its_lease_expires(s3_bucket, s3_env) -> None:
    """Its lease object claims the step; age is the object's Last-Modified against the server's Date."""
    client = s3_env.client()
    root = f"s3://{s3_bucket}/far"
    store = storage.S3Storage(root, client=client)
    key = "far/step-000000005/shard-00000.snpx"
    client.put_object(Bucket=s3_bucket, Key=key, Body=b"being written")
    upload_id = client.create_multipart_upload(Bucket=s3_bucket, Key=key)["UploadId"]

    def put_lease(expiry_s: float) -> None:
        record = {"format": "sneppx.lease", "writer": "feedfacecafebeef", "host": "0123456789ab", "pid": 4242,
                  "pid_start": 99, "steps": [5], "expiry_s": expiry_s}
        body = json.dumps(record).encode()
        client.put_object(Bucket=s3_bucket, Key="far/.lease-feedfacecafebeef", Body=body)

    put_lease(600)
    assert store.cleanup() == []
    assert store.incomplete_uploads() == [(key, upload_id)]
    put_lease(1)  # the same writer, had it promised a sign of life every 0.1 s and then gone silent
    time.sleep(3)  # Last-Modified and Date have one-second resolution: three seconds is past 1 s for sure
    removed = store.cleanup()
    assert f"s3://{s3_bucket}/{key}" in removed and f"s3://{s3_bucket}/far/.lease-feedfacecafebeef" in removed
    assert store.incomplete_uploads() == []
    assert client.list_objects_v2(Bucket=s3_bucket).get("Contents", []) == []


def test_an_s3_commit_fails_when_a_part_vanished_before_the_marker(s3_bucket, s3_env) -> None:
    """What a cleanup that wrongly judged this writer gone would do: delete the shard object before the
    marker. The commit must fail, not put a marker over a step without its shard."""
    client = s3_env.client()
    root = f"s3://{s3_bucket}/gone"
    shard = "gone/step-000000002/shard-00000.snpx"

    def note_key(params, context, **_):
        context["test_key"] = params["Key"]

    def delete_shard(context, **_):  # after the manifest's PUT, before the parts check and the marker
        if context.get("test_key") == "gone/step-000000002/manifest.json":
            s3_env.client().delete_object(Bucket=s3_bucket, Key=shard)

    client.meta.events.register("before-parameter-build.s3.PutObject", note_key)
    client.meta.events.register("after-call.s3.PutObject", delete_shard)
    coord = CheckpointCoordinator(root, s3_client=client)
    coord.save(state_for(1), step=1, training_state={"step": 1})
    coord.wait()
    coord.save(state_for(2), step=2, training_state={"step": 2})
    with pytest.raises(errors.StorageError, match="gone before the commit"):
        coord.wait()
    assert coord.committed_steps() == [1]
    assert not [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"]
                if o["Key"].startswith("gone/step-000000002/")]
    assert_restores(root, 1, s3_client=client)


class FixedClock:
    """Stands in for the `datetime` module in coordinator.plan: every manifest gets the same creation time."""

    UTC = datetime.UTC

    class datetime:
        @staticmethod
        def now(tz: datetime.tzinfo | None = None) -> datetime.datetime:
            return datetime.datetime(2030, 1, 1, tzinfo=tz)


@pytest.mark.parametrize("decided_by", ["manifest.json", "COMMITTED"])
def test_two_writers_past_the_pre_check_race_and_exactly_one_commits(s3_bucket, s3_env, monkeypatch,
                                                                     decided_by) -> None:
    """Both writers of step 7 pass the "is it committed?" check and upload the shard, then a barrier in a
    botocore hook holds each at the PUT of `decided_by` until both are there: only If-None-Match decides.

    manifest.json: the first conditional PUT of a step, so the usual race. The training states differ, so the
    committed step shows who won; the tensors are the same, so whichever shard upload landed last, the
    winner's parts check passes. COMMITTED: the manifests are made identical (a fixed clock, the same training
    state), so each writer finds its own bytes at manifest.json and both reach the marker, whose record names
    the winner."""
    if decided_by == "COMMITTED":
        monkeypatch.setattr(plan, "datetime", FixedClock)
    root = f"s3://{s3_bucket}/race"
    barrier = threading.Barrier(2, timeout=120)
    coords = {}
    for name in ("a", "b"):
        client = s3_env.client()
        client.meta.events.register(
            "before-parameter-build.s3.PutObject",
            lambda params, **_: barrier.wait() if params["Key"].endswith("/" + decided_by) else None)
        coords[name] = CheckpointCoordinator(root, s3_client=client, cleanup_on_start=False)
    for name, coord in coords.items():
        state = {"writer": name} if decided_by == "manifest.json" else {"writer": "either"}
        coord.save(state_for(7), step=7, training_state=state)
    outcomes = {}
    for name, coord in coords.items():
        try:
            coord.wait()
            outcomes[name] = "committed"
        except errors.CheckpointExistsError:
            outcomes[name] = "lost"
    assert sorted(outcomes.values()) == ["committed", "lost"], outcomes
    winner = next(name for name, outcome in outcomes.items() if outcome == "committed")
    reader = CheckpointCoordinator(root, s3_client=s3_env.client(), read_only=True)
    assert reader.validate(7) == []
    got = {"w": None, "emb": None}
    info = reader.restore(got)
    assert got["emb"].tobytes() == state_for(7)["emb"].tobytes()
    if decided_by == "manifest.json":
        assert info.training_state == {"writer": winner}
    marker = s3_env.client().get_object(Bucket=s3_bucket, Key="race/step-000000007/COMMITTED")["Body"].read()
    assert json.loads(marker)["writer"] == coords[winner].storage.lease.writer
