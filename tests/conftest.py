"""Shared test fixtures. Each section belongs to the area that needs it."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

# ---- S3: a real moto server process on 127.0.0.1, talked to over HTTP by boto3 ----------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def unused_port() -> int:
    """A 127.0.0.1 TCP port nothing listens on right now (for a process a test starts itself)."""
    return free_port()


@dataclass
class S3Server:
    endpoint: str
    process: subprocess.Popen[bytes]

    def client(self, **kwargs: Any) -> Any:
        """A boto3 client for this server (path-style, dummy credentials, a region)."""
        from SneppX_ALG import storage

        return storage.make_s3_client(endpoint_url=self.endpoint, region="us-east-1", **kwargs)


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def start_moto_server(port: int | None = None, timeout: float = 60) -> S3Server:
    """Starts `python -m moto.server` bound to 127.0.0.1 (never 0.0.0.0) and waits until it answers."""
    port = port or free_port()
    env = {**os.environ, **S3_ENV}
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"moto server exited with {process.returncode} before it answered")
        try:
            with urllib.request.urlopen(endpoint + "/moto-api/", timeout=2):
                return S3Server(endpoint, process)
        except OSError:
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"moto server did not answer on {endpoint} within {timeout}s") from None
            time.sleep(0.1)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = start_moto_server()
    try:
        yield server
    finally:
        stop_process(server.process)


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The usual AWS environment variables pointing boto3 at the test server."""
    for key, value in {**S3_ENV, "AWS_ENDPOINT_URL": s3_server.endpoint}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_server


@pytest.fixture
def s3_bucket(s3_env: S3Server) -> str:
    """A fresh, empty bucket on the test server."""
    name = f"test-{uuid.uuid4().hex[:16]}"
    s3_env.client().create_bucket(Bucket=name)
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
