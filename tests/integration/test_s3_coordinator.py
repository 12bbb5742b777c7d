"""CheckpointCoordinator on S3: real server processes on 127.0.0.1 (moto and the Versity S3 Gateway; every
test runs on both), boto3 over HTTP, no mocking."""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import threading

import numpy as np
import pytest

from SneppX_ALG import CheckpointCoordinator, Transformer, _native, errors, storage
from SneppX_ALG.checkpoint import signing

MiB = 1 << 20


def state_for(step: int, big: int = 2 * MiB) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((128, 64)).astype(np.float32),
            "emb": rng.integers(0, 255, big, dtype=np.uint8), "n": step}


def keys(client, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", []))


def test_recipe_2_runs_as_written_with_an_s3_root(s3_bucket, s3_env, tmp_path) -> None:
    model = Transformer(vocab_size=1000, dim=128, num_heads=4, num_layers=2, ffn_dim=512, max_seq_len=64)
    coord = CheckpointCoordinator(
        checkpoint_root=f"s3://{s3_bucket}/ckpts",
        save_every_n_steps=1000,
        max_to_keep=5,
        async_save=True,                # background I/O thread
    )
    coord.save(model, step=1000)        # returns immediately
    coord.wait()
    assert keys(s3_env.client(), s3_bucket) == ["ckpts/step-000001000/COMMITTED", "ckpts/step-000001000/manifest.json",
                                                "ckpts/step-000001000/shard-00000.snpx"]
    fresh = Transformer(vocab_size=1000, dim=128, num_heads=4, num_layers=2, ffn_dim=512, max_seq_len=64, seed=3)
    info = coord.restore(fresh)
    assert info.step == 1000 and info.location == f"s3://{s3_bucket}/ckpts/step-000001000"
    for name, value in model.state_dict().items():
        assert fresh.state_dict()[name].tobytes() == value.tobytes(), name
    coord.close()


def test_multipart_shards_round_trip_bitwise_and_retention_deletes_marker_first(s3_bucket, s3_env) -> None:
    client = s3_env.client()
    store = storage.S3Storage(f"s3://{s3_bucket}/run", client=client, part_bytes=5 * MiB, threads=4)
    with CheckpointCoordinator(f"s3://{s3_bucket}/run", max_to_keep=2, s3_client=client,
                               staging_bytes=4 * MiB) as coord:
        coord._storage.part_bytes = 5 * MiB  # several parts per shard
        for step in (1, 2, 3):
            coord.save(state_for(step, big=12 * MiB), step=step, training_state={"pos": step})
        coord.wait()
        assert coord.committed_steps() == [2, 3]
        assert not store.incomplete_uploads()
        got = {"w": np.zeros((128, 64), np.float32), "emb": None, "n": None}
        info = coord.restore(got)
    want = state_for(3, big=12 * MiB)
    assert info.step == 3 and info.training_state == {"pos": 3} and got["n"] == 3
    assert got["w"].tobytes() == want["w"].tobytes() and got["emb"].tobytes() == want["emb"].tobytes()
    assert not [k for k in keys(client, s3_bucket) if "step-000000001" in k]


@pytest.mark.parametrize("signed", [False, True])
def test_a_shard_streams_to_s3_as_it_is_written_with_no_local_file(s3_bucket, s3_env, tmp_path,
                                                                   signed: bool) -> None:
    """Unsigned steps: every part of the shard goes up from memory while the writer runs (the step's local
    staging directory never holds the shard), the first part (with the header, written last) at the end.
    Signed steps still stage a file: the manifest's digest of the shard is a read-back of it."""
    client = s3_env.client()
    staged: list[bool] = []  # at each UploadPart: was there a shard file in a local staging directory?
    staging = tmp_path / "staging"
    staging.mkdir()

    def look(**_) -> None:
        staged.append(any(p.name.startswith("shard-") for p in staging.rglob("*")))

    client.meta.events.register("before-call.s3.UploadPart", look)
    private, public = signing.generate_keypair()
    coord = CheckpointCoordinator(f"s3://{s3_bucket}/st", s3_client=client, staging_bytes=4 * MiB,
                                  signing_key=private if signed else None,
                                  trusted_keys=[public] if signed else None)
    coord._storage.part_bytes, coord._storage.staging_dir = 5 * MiB, str(staging)
    want = state_for(1, big=23 * MiB)
    coord.save(want, step=1)
    coord.wait()
    assert len(staged) >= 5 and all(staged) == signed and any(staged) == signed
    etag = client.head_object(Bucket=s3_bucket, Key="st/step-000000001/shard-00000.snpx")["ETag"]
    assert etag.strip('"').endswith("-5"), f"expected a 5-part object, got ETag {etag}"
    got = {"w": np.zeros((128, 64), np.float32), "emb": None, "n": None}
    assert coord.restore(got).step == 1
    assert got["emb"].tobytes() == want["emb"].tobytes() and got["w"].tobytes() == want["w"].tobytes()
    assert storage.S3Storage(f"s3://{s3_bucket}/st", client=client).incomplete_uploads() == []
    coord.close()


def test_a_shard_key_already_taken_is_not_streamed_over(s3_bucket, s3_env, tmp_path) -> None:
    """An object at the shard's key (here what a crash left) is replaced only once the shard is whole (upload()):
    the writer stages a file instead of streaming, and the step commits as before."""
    client = s3_env.client()
    client.put_object(Bucket=s3_bucket, Key="lo/step-000000001/shard-00000.snpx", Body=b"partial")
    staging = tmp_path / "staging"
    staging.mkdir()
    staged: list[bool] = []
    client.meta.events.register("before-call.s3.UploadPart",
                                lambda **_: staged.append(any(staging.rglob("shard-*"))))
    coord = CheckpointCoordinator(f"s3://{s3_bucket}/lo", s3_client=client, cleanup_on_start=False,
                                  staging_bytes=4 * MiB)
    coord._storage.part_bytes, coord._storage.staging_dir = 5 * MiB, str(staging)
    want = state_for(1, big=12 * MiB)
    coord.save(want, step=1)
    coord.wait()
    assert staged and all(staged)
    got = {"w": np.zeros((128, 64), np.float32), "emb": None, "n": None}
    assert coord.restore(got).step == 1 and got["emb"].tobytes() == want["emb"].tobytes()
    coord.close()


def test_a_streamed_upload_changes_only_bytes_not_sent_yet(s3_bucket, s3_env) -> None:
    """The sink holds the first part back (the header is patched there last); an uploaded part can't change."""
    store = storage.S3Storage(f"s3://{s3_bucket}/sink", client=s3_env.client(), part_bytes=5 * MiB)
    pending = store.begin(1)
    sink = store.shard_sink(pending, "shard-00000.snpx")
    assert sink is not None
    data = np.random.default_rng(0).integers(0, 255, 17 * MiB, dtype=np.uint8)
    assert sink.append(data) == _native.crc32c(data)
    sink.pwrite(b"HEAD", 0)  # part 1: held back
    sink.pwrite(b"tail", 16 * MiB)  # part 4: being filled
    with pytest.raises(errors.StorageError, match="uploaded already"):
        sink.pwrite(b"x", 6 * MiB)  # part 2: sent
    sink.finish()
    body = s3_env.client().get_object(Bucket=s3_bucket, Key=sink.key)["Body"].read()
    want = bytearray(data.tobytes())
    want[0:4], want[16 * MiB:16 * MiB + 4] = b"HEAD", b"tail"
    assert body == bytes(want) and sink.result == (len(want), sink.result[1])
    store.abort(pending)  # takes back the finished object: it was never committed
    assert keys(s3_env.client(), s3_bucket) == [] and store.incomplete_uploads() == []


def test_a_streamed_shard_is_the_rank_s_upload_and_is_not_deleted_once_another_writer_owns_the_step(
        s3_bucket, s3_env) -> None:
    """upload() reports a streamed shard's finished object as this rank's part (what finalize checks), and
    abort() takes it back; but after a finalize that lost the step to another writer (its manifest first), the
    abort that follows (the coordinator's, for the failed step) deletes nothing: the keys may be that writer's."""
    client = s3_env.client()
    store = storage.S3Storage(f"s3://{s3_bucket}/own", client=client, part_bytes=5 * MiB)
    shard = "shard-00000.snpx"
    data = np.random.default_rng(1).integers(0, 255, 6 * MiB, dtype=np.uint8)
    for step in (1, 2):
        pending = store.begin(step)
        sink = store.shard_sink(pending, shard)
        assert sink is not None
        sink.append(data)
        sink.finish()
        parts = store.upload(pending, [shard])
        assert parts == {shard: sink.result} and pending.uploaded == {sink.key: sink.result}
        if step == 1:
            store.abort(pending)
            assert keys(client, s3_bucket) == []
            continue
        client.put_object(Bucket=s3_bucket, Key="own/step-000000002/manifest.json", Body=b"another writer's")
        with pytest.raises(errors.CheckpointExistsError, match="another writer"):
            store.finalize(pending, json.dumps({"shards": [shard]}).encode(), None, parts)
        store.abort(pending)
        assert keys(client, s3_bucket) == ["own/step-000000002/manifest.json", f"own/step-000000002/{shard}"]
    assert store.incomplete_uploads() == []


def test_a_marker_is_written_once_even_by_two_writers(s3_bucket, s3_env) -> None:
    client = s3_env.client()
    first = CheckpointCoordinator(f"s3://{s3_bucket}/r", s3_client=client)
    second = CheckpointCoordinator(f"s3://{s3_bucket}/r", s3_client=client, cleanup_on_start=False)
    first.save({"w": np.ones(4)}, step=7)
    first.wait()
    second.save({"w": np.zeros(4)}, step=7)
    with pytest.raises(errors.CheckpointExistsError):
        second.wait()
    got = {"w": np.zeros(4)}
    first.restore(got)
    assert list(got["w"]) == [1, 1, 1, 1]


def test_writers_racing_to_commit_one_step_have_exactly_one_winner(s3_bucket, s3_env) -> None:
    """Sixteen writers PUT one step's marker at the same moment: the server's If-None-Match check is the
    commit point, so exactly one commits and every other one gets CheckpointExistsError."""
    store = storage.S3Storage(f"s3://{s3_bucket}/many", client=s3_env.client(max_connections=16))
    marker = store.key(storage.step_name(1), storage.COMMITTED)
    start = threading.Barrier(16)

    def commit(writer: int) -> str:
        start.wait()
        try:
            store.put(marker, b"writer %d" % writer, if_none_match=True)
            return "committed"
        except errors.CheckpointExistsError:
            return "lost"

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(commit, range(16)))
    assert sorted(outcomes) == ["committed"] + ["lost"] * 15
    winner = outcomes.index("committed")
    assert s3_env.client().get_object(Bucket=s3_bucket, Key=marker)["Body"].read() == b"writer %d" % winner


def test_uncommitted_steps_and_incomplete_uploads_are_invisible_then_cleaned_at_start(s3_bucket, s3_env) -> None:
    client = s3_env.client()
    with CheckpointCoordinator(f"s3://{s3_bucket}/p", s3_client=client) as coord:
        coord.save(state_for(1), step=1)
    # What a crashed writer leaves: a shard without a marker, and a multipart upload never completed.
    client.put_object(Bucket=s3_bucket, Key="p/step-000000002/shard-00000.snpx", Body=b"partial")
    client.put_object(Bucket=s3_bucket, Key="p/step-000000002/manifest.json", Body=b"{}")
    client.create_multipart_upload(Bucket=s3_bucket, Key="p/step-000000003/shard-00000.snpx")
    store = storage.S3Storage(f"s3://{s3_bucket}/p", client=client)
    assert store.committed_steps() == [1]
    assert len(store.incomplete_uploads()) == 1
    coord = CheckpointCoordinator(f"s3://{s3_bucket}/p", s3_client=client)
    assert store.incomplete_uploads() == []
    assert [k for k in keys(client, s3_bucket) if not k.startswith("p/step-000000001/")] == []
    assert coord.latest().step == 1


def test_cleanup_skips_an_upload_that_ended_after_it_was_listed(s3_bucket, s3_env, monkeypatch) -> None:
    # Seen under load: a killed writer's own abort lands between cleanup's listing and its abort, and the
    # server answers NoSuchUpload. That upload is gone, which is what cleanup wanted: not an error.
    client = s3_env.client()
    key = "g/step-000000004/shard-00000.snpx"
    upload_id = client.create_multipart_upload(Bucket=s3_bucket, Key=key)["UploadId"]
    store = storage.S3Storage(f"s3://{s3_bucket}/g", client=client)
    listed = store.incomplete_uploads()
    assert listed == [(key, upload_id)]
    client.abort_multipart_upload(Bucket=s3_bucket, Key=key, UploadId=upload_id)
    monkeypatch.setattr(store, "incomplete_uploads", lambda: listed)  # the listing taken before the abort
    assert store.cleanup() == []


def test_a_corrupt_s3_checkpoint_is_skipped_by_latest(s3_bucket, s3_env) -> None:
    client = s3_env.client()
    with CheckpointCoordinator(f"s3://{s3_bucket}/c", s3_client=client, max_to_keep=None) as coord:
        coord.save(state_for(1), step=1)
        coord.save(state_for(2), step=2)
    key = "c/step-000000002/shard-00000.snpx"
    body = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[5000] ^= 1
    client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    coord = CheckpointCoordinator(f"s3://{s3_bucket}/c", s3_client=client)
    assert coord.latest().step == 1
    assert [s.step for s in coord.skipped] == [2]


def test_an_unreachable_endpoint_is_a_storage_error_raised_on_the_next_call(tmp_path, s3_bucket, s3_env) -> None:
    client = s3_env.client()
    coord = CheckpointCoordinator(f"s3://{s3_bucket}/u", s3_client=client)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]  # nothing listens there once the socket is closed
    coord._storage.client = storage.make_s3_client(endpoint_url=f"http://127.0.0.1:{closed_port}",
                                                   max_attempts=1, connect_timeout=1)
    coord.save(state_for(1), step=1)
    with pytest.raises(errors.StorageError, match="S3"):
        coord.wait()
    assert storage.S3Storage(f"s3://{s3_bucket}/u", client=client).committed_steps() == []


def test_a_writer_that_loses_the_marker_race_deletes_none_of_the_step(s3_bucket, s3_env, monkeypatch) -> None:
    """Two writers of one step: the second passed its "is it committed?" check before the first wrote the
    marker, uploaded its files over the same keys, and lost the If-None-Match race. It must not delete
    those keys: they are the committed step's now."""
    client = s3_env.client()
    first = CheckpointCoordinator(f"s3://{s3_bucket}/race", s3_client=client)
    second = CheckpointCoordinator(f"s3://{s3_bucket}/race", s3_client=client, cleanup_on_start=False)
    first.save(state_for(7), step=7)
    first.wait()
    monkeypatch.setattr(second.storage, "_exists", lambda key: False)  # its check ran before the marker
    second.save(state_for(7), step=7)
    with pytest.raises(errors.CheckpointExistsError):
        second.wait()
    assert [k.rsplit("/", 1)[1] for k in keys(client, s3_bucket)] == ["COMMITTED", "manifest.json",
                                                                    "shard-00000.snpx"]
    reader = CheckpointCoordinator(f"s3://{s3_bucket}/race", s3_client=client)
    assert reader.validate(7) == [] and reader.latest().step == 7


def test_only_the_files_a_manifest_names_are_fetched(s3_bucket, s3_env) -> None:
    """Objects under a step's prefix that the manifest doesn't name (a "folder" key ending in "/" and a key in
    it, a nested key, a stray file) are neither fetched nor an error: a key can't choose a local path."""
    client = s3_env.client()
    root = f"s3://{s3_bucket}/odd"
    with CheckpointCoordinator(root, s3_client=client) as coord:
        coord.save(state_for(1), step=1)
    for key in ("odd/step-000000001/folder/", "odd/step-000000001/folder/in-folder.bin",
                "odd/step-000000001/nested/shard-00000.snpx", "odd/step-000000001/stray.bin"):
        # A folder key is empty, as consoles make them (the gateway refuses data in a key ending in "/").
        client.put_object(Bucket=s3_bucket, Key=key, Body=b"" if key.endswith("/") else b"not part of the step")
    coord = CheckpointCoordinator(root, s3_client=client)
    with coord.storage.open_step(1) as local:
        assert sorted(os.listdir(local)) == ["manifest.json", "shard-00000.snpx"]
    got = {"w": None, "emb": None, "n": None}
    assert coord.restore(got).step == 1
    assert got["emb"].tobytes() == state_for(1)["emb"].tobytes()
    coord.storage.delete(1)  # the odd keys go with the step
    assert [k for k in keys(client, s3_bucket) if k.startswith("odd/")] == []


def test_a_start_leaves_the_uploads_of_a_sibling_root_alone(s3_bucket, s3_env) -> None:
    """Roots exp1 and exp10 share a string prefix, not a folder: cleanup at exp1's start must not abort an
    upload exp10's writer has in flight."""
    client = s3_env.client()
    key = "exp10/step-000000001/shard-00000.snpx"
    upload_id = client.create_multipart_upload(Bucket=s3_bucket, Key=key)["UploadId"]
    CheckpointCoordinator(f"s3://{s3_bucket}/exp1", s3_client=client).close()
    assert storage.S3Storage(f"s3://{s3_bucket}/exp10", client=client).incomplete_uploads() == [(key, upload_id)]


def test_a_part_that_does_not_match_its_crc32c_is_refused_and_nothing_is_committed(s3_bucket, s3_env) -> None:
    """Each part goes up with the CRC32C of the bytes read for it; bytes that change after that (here: on
    the way out, before signing) are refused by the server, the upload is aborted and the step not
    committed."""
    if s3_env.kind == "moto":
        pytest.skip("moto does not check the CRC32C sent with a part (docs/TESTING.md)")
    client = s3_env.client()

    def corrupt_second_part(request, **_) -> None:
        if "partNumber=2" in request.url:
            raw = request.body  # a file-like over bytes, or the part buffer itself (streamed uploads)
            body = bytearray(raw.getvalue() if hasattr(raw, "getvalue") else raw)
            body[100] ^= 1
            request.data = bytes(body)

    client.meta.events.register("before-sign.s3.UploadPart", corrupt_second_part)
    coord = CheckpointCoordinator(f"s3://{s3_bucket}/crc", s3_client=client)
    coord._storage.part_bytes = 5 * MiB
    coord.save(state_for(1, big=12 * MiB), step=1)
    with pytest.raises(errors.StorageError, match="BadDigest"):
        coord.wait()
    store = storage.S3Storage(f"s3://{s3_bucket}/crc", client=client)
    assert store.committed_steps() == [] and store.incomplete_uploads() == []
    assert [k for k in keys(client, s3_bucket) if k.startswith("crc/")] == []



# ---- a root owns only its own keys ---------------------------------------------------------------------------


def uploads(client, bucket: str) -> list[str]:
    return sorted(u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def test_cleanup_retention_and_deletes_stay_inside_the_prefix(s3_bucket, s3_env) -> None:
    """Root `jobs/a` next to a job `jobs/ab` (and keys that merely start with `jobs/a`): every listing is of
    `jobs/a/`, so nothing of theirs is cleaned up, aborted or deleted."""
    client = s3_env.client()
    theirs = ["jobs/ab/step-000000001/COMMITTED", "jobs/ab/step-000000001/manifest.json",
              "jobs/ab/step-000000001/shard-00000.snpx", "jobs/ab/step-000000002/shard-00000.snpx",
              "jobs/a-b/step-000000003/manifest.json", "jobs/a.lease-feedfacecafebeef",
              "jobs/astep-000000001/x"]
    for key in theirs:
        client.put_object(Bucket=s3_bucket, Key=key, Body=b"another job's")
    client.create_multipart_upload(Bucket=s3_bucket, Key="jobs/ab/step-000000004/shard-00000.snpx")
    with CheckpointCoordinator(f"s3://{s3_bucket}/jobs/a", s3_client=client, max_to_keep=1) as coord:
        for step in (1, 2, 3):  # retention deletes 1 and 2
            coord.save(state_for(step), step=step)
        coord.wait()
        coord.storage.delete(3)
        coord.save(state_for(4), step=4)
        coord.wait()
        coord.storage.cleanup()
        assert coord.committed_steps() == [4]
    assert [k for k in keys(client, s3_bucket) if not k.startswith("jobs/a/")] == sorted(theirs)
    assert uploads(client, s3_bucket) == ["jobs/ab/step-000000004/shard-00000.snpx"]


def test_a_bucket_root_owns_only_the_step_keys_at_the_top_of_the_bucket(s3_bucket, s3_env) -> None:
    client = s3_env.client()
    theirs = ["jobs/x/step-000000001/shard-00000.snpx", "notes.txt", "step-000000001-not-a-step/x"]
    for key in theirs:
        client.put_object(Bucket=s3_bucket, Key=key, Body=b"not this root's")
    for key in ("jobs/x/step-000000002/shard-00000.snpx", "big-upload.bin"):
        client.create_multipart_upload(Bucket=s3_bucket, Key=key)
    client.create_multipart_upload(Bucket=s3_bucket, Key="step-000000009/shard-00000.snpx")  # a crashed save
    with CheckpointCoordinator(f"s3://{s3_bucket}", s3_client=client, max_to_keep=1) as coord:
        for step in (1, 2):
            coord.save(state_for(step), step=step)
        coord.wait()
        assert coord.committed_steps() == [2]
        assert coord.latest().location == f"s3://{s3_bucket}/step-000000002"
    assert [k for k in keys(client, s3_bucket) if not k.startswith("step-000000002/")] == sorted(theirs)
    assert uploads(client, s3_bucket) == ["big-upload.bin", "jobs/x/step-000000002/shard-00000.snpx"]


# ---- the commit marker: ambiguous answers, and what it vouches for -------------------------------------------


def on_marker_put(client, event: str, handler) -> None:
    """Calls handler(**kwargs) for the PUT of a COMMITTED marker only (`event`: a PutObject botocore event)."""
    client.meta.events.register("before-parameter-build.s3.PutObject",
                                lambda params, context, **_: context.update(test_key=params["Key"]))
    client.meta.events.register(event, lambda context, **kw: handler(context=context, **kw)
                                if context.get("test_key", "").endswith("/COMMITTED") else None)


def test_a_marker_put_whose_answer_is_lost_after_the_server_applied_it_is_a_commit(s3_bucket, s3_env) -> None:
    """The response to the marker's PUT never arrives (the connection closes after the server applied it):
    the writer reads the marker back, finds its own, and the save succeeds with nothing deleted."""
    import botocore.exceptions

    client = s3_env.client()
    lost = []

    def lose_the_answer(**_) -> None:
        if not lost:
            lost.append(True)
            raise botocore.exceptions.ConnectionClosedError(endpoint_url=s3_env.endpoint)

    on_marker_put(client, "after-call.s3.PutObject", lose_the_answer)
    with CheckpointCoordinator(f"s3://{s3_bucket}/lost", s3_client=client) as coord:
        coord.save(state_for(1), step=1)
        coord.wait()
        assert lost and coord.committed_steps() == [1] and coord.validate(1) == []


def test_a_marker_put_retried_after_the_server_applied_it_is_a_commit_not_a_lost_race(s3_bucket,
                                                                                      s3_env) -> None:
    """botocore retries a PUT whose answer it didn't get; the retry meets the writer's own marker (412). The
    writer reads it back: its own, so committed, not `CheckpointExistsError`."""
    client = s3_env.client()
    retried = []

    def retry_the_first_attempt(request_dict, attempts, **_):
        if request_dict["url"].endswith("/COMMITTED") and attempts == 1:
            retried.append(True)
            return 0  # "retry now", as when the answer was lost after the request went out
        return None

    client.meta.events.register_first("needs-retry.s3.PutObject", retry_the_first_attempt)
    with CheckpointCoordinator(f"s3://{s3_bucket}/retried", s3_client=client) as coord:
        coord.save(state_for(1), step=1)
        coord.wait()
        assert retried and coord.committed_steps() == [1] and coord.validate(1) == []


def test_a_marker_put_that_never_reached_the_server_deletes_the_parts(s3_bucket, s3_env) -> None:
    import botocore.exceptions

    client = s3_env.client()
    root = f"s3://{s3_bucket}/never"
    with CheckpointCoordinator(root, s3_client=client) as coord:
        coord.save(state_for(1), step=1)
    coord = CheckpointCoordinator(root, s3_client=client)

    def refuse(request, **_):
        if request.method == "PUT" and request.url.endswith("/step-000000002/COMMITTED"):
            raise botocore.exceptions.ConnectionClosedError(endpoint_url=s3_env.endpoint)

    client.meta.events.register("before-send.s3.PutObject", refuse)
    coord.save(state_for(2), step=2)
    with pytest.raises(errors.StorageError) as info:
        coord.wait()
    assert not isinstance(info.value, errors.CommitUnknownError)
    assert [k for k in keys(client, s3_bucket) if "step-000000002" in k] == []  # provably absent: cleaned
    assert coord.latest().step == 1


def test_a_commit_whose_outcome_cant_be_learned_deletes_nothing(s3_bucket, s3_env) -> None:
    """The marker's PUT was applied but its answer lost, and reading the marker back fails too: the save
    raises CommitUnknownError and keeps every part, so the step the server did commit is whole."""
    import botocore.exceptions

    client = s3_env.client()
    root = f"s3://{s3_bucket}/unknown"

    def lose_the_answer(**_) -> None:
        raise botocore.exceptions.ConnectionClosedError(endpoint_url=s3_env.endpoint)

    def unreachable(request, **_):
        if request.url.endswith("/COMMITTED"):
            raise botocore.exceptions.ConnectionClosedError(endpoint_url=s3_env.endpoint)

    on_marker_put(client, "after-call.s3.PutObject", lose_the_answer)
    client.meta.events.register("before-send.s3.GetObject", unreachable)
    coord = CheckpointCoordinator(root, s3_client=client)
    coord.save(state_for(1), step=1)
    with pytest.raises(errors.CommitUnknownError):
        coord.wait()
    reader = CheckpointCoordinator(root, s3_client=s3_env.client(), read_only=True)
    assert reader.committed_steps() == [1] and reader.validate(1) == []


def test_a_manifest_replaced_after_the_commit_fails_against_the_marker(s3_bucket, s3_env) -> None:
    """The marker records the manifest's size and CRC32C. A manifest replaced by another well-formed one, its
    checksum made again (what a late second writer or a careless copy would leave), no longer matches it."""
    from SneppX_ALG.checkpoint import manifest as manifest_codec

    client = s3_env.client()
    root = f"s3://{s3_bucket}/m"
    with CheckpointCoordinator(root, s3_client=client, max_to_keep=None) as coord:
        for step in (1, 2):
            coord.save(state_for(step), step=step, training_state={"pos": step})
    key = "m/step-000000002/manifest.json"
    manifest = json.loads(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    manifest["training_state"] = {"pos": 999}
    client.put_object(Bucket=s3_bucket, Key=key, Body=manifest_codec.encode_manifest(manifest))
    marker = json.loads(client.get_object(Bucket=s3_bucket, Key="m/step-000000002/COMMITTED")["Body"].read())
    assert marker["format"] == "sneppx.commit" and marker["step"] == 2
    assert set(marker["manifest"]) == {"size", "crc32c"}
    reader = CheckpointCoordinator(root, s3_client=client, read_only=True)
    assert reader.latest().training_state == {"pos": 1}
    assert [s.step for s in reader.skipped] == [2] and "COMMITTED" in reader.skipped[0].problems[0]
