"""Shared test fixtures. Each section belongs to the area that needs it."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import s3_servers
from s3_servers import S3Server, free_port

# ---- checkpoint writes: one write mode for the whole session -------------------------------------------------
# CheckpointWriter probes O_DIRECT against buffered writes on the first save to a filesystem
# (checkpoint/write_mode.py). A probe inside a test would write files the test doesn't expect and pass the fault
# hook's write sites, so the session pins the mode: O_DIRECT, the default before the probe existed, unless the
# run sets SNEPPX_WRITE_MODE itself (`SNEPPX_WRITE_MODE=buffered pytest ...` runs every test in the other mode;
# tests/unit/checkpoint/test_write_mode.py covers the probe). Set here, it reaches the processes tests start too.
os.environ.setdefault("SNEPPX_WRITE_MODE", "direct")


# ---- S3: real S3 servers on 127.0.0.1 (moto and the Versity S3 Gateway), talked to over HTTP by boto3 ------
# Every test that uses these fixtures runs once per server: test_x[moto], test_x[versitygw]. Each server
# starts once per session (pytest groups the tests by server).


@pytest.fixture
def unused_port() -> int:
    """A 127.0.0.1 TCP port nothing listens on right now (for a process a test starts itself)."""
    return free_port()


@pytest.fixture(scope="session", params=s3_servers.KINDS)
def s3_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = s3_servers.start(request.param, tmp_path_factory.mktemp(request.param))
    try:
        yield server
    finally:
        s3_servers.stop(server)


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The usual AWS environment variables pointing boto3 at the test server."""
    for key, value in {**s3_servers.ENV, "AWS_ENDPOINT_URL": s3_server.endpoint}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_server


@pytest.fixture(scope="session")
def s3_admin(s3_server: S3Server) -> Any:
    """One client per server for the fixtures' own calls: making a boto3 client costs 0.2-0.9 s on a loaded 2-core
    box, once per S3 test before. Tests make their own (several hook events on theirs)."""
    with pytest.MonkeyPatch.context() as env:  # the dummy credentials are read when the client is made
        for key, value in s3_servers.ENV.items():
            env.setenv(key, value)
        return s3_server.client()


@pytest.fixture
def s3_bucket(s3_env: S3Server, s3_admin: Any) -> str:
    """A fresh, empty bucket on the test server."""
    name = f"test-{uuid.uuid4().hex[:16]}"
    s3_admin.create_bucket(Bucket=name)
    return name


# ---- rank processes: the collectives and data-parallel tests ------------------------------------------------------

SPAWN = multiprocessing.get_context("spawn")


class Ranks:
    """Rank processes started with spawn (no forked threads or sockets), killed if a test leaves them behind."""

    def __init__(self) -> None:
        self.processes: dict[int, Any] = {}
        self.results: Any = SPAWN.Queue()

    def start(self, rank: int, target: Callable[..., None], *args: Any) -> None:
        process = SPAWN.Process(target=target, args=args, daemon=True)
        process.start()
        self.processes[rank] = process

    def get(self, timeout: float = 300) -> Any:
        try:
            return self.results.get(timeout=timeout)
        except queue.Empty:
            dead = {r: p.exitcode for r, p in self.processes.items() if not p.is_alive()}
            raise AssertionError(f"no report from the ranks within {timeout}s (exited: {dead})") from None

    def close(self) -> None:
        for process in self.processes.values():
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            process.join(30)


@pytest.fixture
def ranks() -> Iterator[Ranks]:
    started = Ranks()
    yield started
    started.close()
