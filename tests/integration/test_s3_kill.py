"""S3 crash consistency: the server dies mid-upload, and the saving client dies mid-upload.

On both test servers (moto and the Versity S3 Gateway), "the server" the client talks to is a TCP forwarder
process in front of the real one that SIGKILLs itself after a chosen number of uploaded bytes: from the
client's side that is a server killed mid-upload, while the real server keeps the half-done multipart upload,
so we can check that no checkpoint was committed and that the next coordinator start aborts the orphaned
upload. The gateway keeps what it was sent on disk, so it is also killed for real (SIGKILL) and restarted
over its directory; moto keeps everything in memory and would come back empty. The client-side test
SIGKILLs a saving process at seeded random times.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import s3_servers

from SneppX_ALG import CheckpointCoordinator, errors, storage

MiB = 1 << 20

PROXY = textwrap.dedent("""
    import os, signal, socket, sys, threading
    listen_port, target_port, die_after = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", listen_port))
    server.listen(64)
    lock = threading.Lock()
    sent = [0]
    def pump(src, dst, upstream):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if upstream and die_after:
                    with lock:
                        sent[0] += len(data)
                        if sent[0] >= die_after:
                            os.kill(os.getpid(), signal.SIGKILL)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
    print("ready", flush=True)
    while True:
        client, _ = server.accept()
        upstream = socket.create_connection(("127.0.0.1", target_port))
        threading.Thread(target=pump, args=(client, upstream, True), daemon=True).start()
        threading.Thread(target=pump, args=(upstream, client, False), daemon=True).start()
""")


def stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


def start_proxy(port: int, target: str, die_after: int) -> subprocess.Popen[bytes]:
    target_port = int(target.rsplit(":", 1)[1])
    process = subprocess.Popen([sys.executable, "-c", PROXY, str(port), str(target_port), str(die_after)],
                               stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline().strip() == b"ready"
    return process


def state_for(step: int) -> dict:
    """New at every step but for 4 MiB that never change: a coordinator's saves after its first reference them
    in the earlier step's prefix (incremental steps, killed mid-upload too)."""
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((256, 256)).astype(np.float32),
            "emb": rng.integers(0, 255, 24 * MiB, dtype=np.uint8),
            "frozen": np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)}


def assert_restores(coord: CheckpointCoordinator, step: int) -> None:
    got = {"w": np.zeros((256, 256), np.float32), "emb": None}
    info = coord.restore(got)
    assert info is not None and info.step == step
    want = state_for(step)
    assert got["w"].tobytes() == want["w"].tobytes() and got["emb"].tobytes() == want["emb"].tobytes()
    assert got["frozen"].tobytes() == want["frozen"].tobytes()


@pytest.mark.parametrize("die_after", [64 << 10, 6 * MiB, 17 * MiB, 24 * MiB])
def test_server_killed_mid_upload_commits_nothing_and_leaves_no_orphan_after_restart(
        s3_bucket, s3_env, unused_port: int, die_after: int) -> None:
    direct = s3_env.client()
    root = f"s3://{s3_bucket}/k"
    with CheckpointCoordinator(root, s3_client=direct) as coord:
        coord.save(state_for(1), step=1)

    port = unused_port
    proxy = start_proxy(port, s3_env.endpoint, die_after)
    via_proxy = storage.make_s3_client(endpoint_url=f"http://127.0.0.1:{port}", max_attempts=1,
                                       connect_timeout=2, read_timeout=20)
    try:
        coord = CheckpointCoordinator(root, s3_client=via_proxy, cleanup_on_start=False)
        coord._storage.part_bytes = 5 * MiB
        coord.save(state_for(2), step=2)
        with pytest.raises(errors.StorageError, match="S3"):
            coord.wait()
        assert proxy.wait(30) == -signal.SIGKILL, "the server must have died mid-upload"
    finally:
        stop_process(proxy)

    store = storage.S3Storage(root, client=direct)
    assert store.committed_steps() == [1], "a step was committed although its upload was cut"
    # The server comes back (a new process on the same port); the next start cleans up.
    proxy = start_proxy(port, s3_env.endpoint, 0)
    try:
        coord = CheckpointCoordinator(root, s3_client=via_proxy)
        assert store.incomplete_uploads() == []
        assert [k for k in (o["Key"] for o in direct.list_objects_v2(Bucket=s3_bucket)["Contents"])
                if "step-000000002" in k] == []
        assert_restores(coord, 1)
        coord.save(state_for(2), step=2)  # and saving works again
        coord.wait()
        assert_restores(coord, 2)
        manifest = direct.get_object(Bucket=s3_bucket, Key=f"k/{storage.step_name(2)}/{storage.MANIFEST}")["Body"].read()
        assert json.loads(manifest)["uses"] == [1]  # an incremental step: it references the frozen part in 1
        coord.close()
    finally:
        stop_process(proxy)


def test_the_gateway_killed_mid_upload_and_restarted_over_its_data_commits_nothing(tmp_path, monkeypatch) -> None:
    for key, value in s3_servers.ENV.items():
        monkeypatch.setenv(key, value)
    port = s3_servers.free_port()
    server = s3_servers.start("versitygw", tmp_path, port=port)
    try:
        client = server.client(max_attempts=1, connect_timeout=2, read_timeout=20)
        client.create_bucket(Bucket="killed")
        root = "s3://killed/k"
        with CheckpointCoordinator(root, s3_client=client) as coord:
            coord.save(state_for(1), step=1)

        acknowledged: list[int] = []

        def kill_server_after_two_parts(**_) -> None:
            acknowledged.append(1)
            if len(acknowledged) == 2:
                os.kill(server.process.pid, signal.SIGKILL)

        client.meta.events.register("after-call.s3.UploadPart", kill_server_after_two_parts)
        coord = CheckpointCoordinator(root, s3_client=client, cleanup_on_start=False)
        coord._storage.part_bytes = 5 * MiB  # five parts
        coord.save(state_for(2), step=2)
        with pytest.raises(errors.StorageError, match="S3"):
            coord.wait()
        assert server.process.wait(30) == -signal.SIGKILL

        server = s3_servers.start("versitygw", tmp_path, port=port)  # the same directory, the same port
        direct = server.client()
        store = storage.S3Storage(root, client=direct)
        assert store.committed_steps() == [1], "a step was committed although the server died mid-upload"
        assert len(store.incomplete_uploads()) == 1, "the orphaned upload should have survived the crash"
        coord = CheckpointCoordinator(root, s3_client=direct)
        assert store.incomplete_uploads() == []
        assert [o["Key"] for o in direct.list_objects_v2(Bucket="killed")["Contents"]
                if "step-000000002" in o["Key"]] == []
        assert_restores(coord, 1)
        coord.save(state_for(2), step=2)
        coord.wait()
        assert_restores(coord, 2)
        coord.close()
    finally:
        s3_servers.stop(server)


CLIENT = textwrap.dedent("""
    import sys
    import numpy as np
    MiB = 1 << 20
    STATE_FOR
    from SneppX_ALG import CheckpointCoordinator, storage
    client = storage.make_s3_client(endpoint_url=sys.argv[2])
    coord = CheckpointCoordinator(sys.argv[1], s3_client=client, max_to_keep=2)
    coord._storage.part_bytes = 5 << 20
    first = int(sys.argv[4])
    print("ready", flush=True)
    step = first
    while True:  # saves until it is killed, so the kill lands in a save however fast this machine is
        coord.save(state_for(step), step=step)
        step += 1
""")


def test_client_killed_mid_upload_at_random_times(s3_bucket, s3_env) -> None:
    direct = s3_env.client()
    root = f"s3://{s3_bucket}/ck"
    store = storage.S3Storage(root, client=direct)
    env = {**os.environ}
    rng = random.Random(7)
    newest = 0
    for run in range(8):
        script = CLIENT.replace("STATE_FOR", inspect.getsource(state_for))
        first = 1 + 10_000 * run  # above every step an earlier run could have reached
        process = subprocess.Popen([sys.executable, "-c", script, root, s3_env.endpoint, "", str(first)],
                                   stdout=subprocess.PIPE, env=env)
        assert process.stdout is not None and process.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.05, 1.5))
        process.send_signal(signal.SIGKILL)
        assert process.wait() == -signal.SIGKILL, "the saving client failed before it was killed"
        coord = CheckpointCoordinator(root, s3_client=direct, max_to_keep=2)
        assert store.incomplete_uploads() == [], "an orphaned multipart upload survived the next start"
        steps = coord.committed_steps()
        for s in steps:
            assert coord.validate(s) == []
        if steps:
            assert max(steps) >= newest
            newest = max(steps)
            assert_restores(coord, newest)
        coord.close()
