"""CheckpointCoordinator on S3: real server processes on 127.0.0.1 (moto and the Versity S3 Gateway; every
test runs on both), boto3 over HTTP, no mocking."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import threading

import numpy as np
import pytest

from SneppX_ALG import CheckpointCoordinator, Transformer, errors, storage

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
            store._put(marker, b"writer %d" % writer, if_none_match=True)
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
            body = bytearray(request.body.getvalue())
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
