"""Real S3 servers on 127.0.0.1 for the tests and the benchmarks: moto and the Versity S3 Gateway.

Why two: moto is an emulation written for tests; the Versity S3 Gateway (Apache-2.0, Go) is a real S3 server
that serves a directory (each top-level directory a bucket, each object a file) and that users deploy. A
behaviour of SneppX that holds on one of them only is a bug, so every S3 test runs on both (tests/conftest.py
parametrizes its S3 fixtures over KINDS), and `python -m bench async_save` measures uploads on both. Where the
two differ is listed in docs/TESTING.md.

Both get the same dummy credentials and are bound to 127.0.0.1 only. moto runs behind one lock
(tests/serialized_moto.py): on its own it checks a conditional write's condition and then writes, without a
lock, so two racing `If-None-Match: *` PUTs could both succeed where S3 and the gateway let exactly one win.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

KINDS = ("moto", "versitygw")
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
BUILD_SCRIPT = pathlib.Path(__file__).resolve().parent / "tools" / "build.sh"
SERIALIZED_MOTO = pathlib.Path(__file__).resolve().parent / "serialized_moto.py"
STOP_TIMEOUT_S = 10.0


class S3ServerError(RuntimeError):
    """A server could not be built or did not come up; the message carries the tail of its log."""


@dataclass
class S3Server:
    kind: str
    endpoint: str
    process: subprocess.Popen[bytes]
    log: pathlib.Path

    def client(self, **kwargs: Any) -> Any:
        """A boto3 client for this server (path-style, the dummy credentials, a region)."""
        from SneppX_ALG import storage

        return storage.make_s3_client(endpoint_url=self.endpoint, region=ENV["AWS_DEFAULT_REGION"], **kwargs)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def versitygw_binary() -> str:
    """The pinned gateway, built once by tests/tools/build.sh (cached by version). Never skips: a build
    failure raises with the build's log."""
    result = subprocess.run(["bash", str(BUILD_SCRIPT), "versitygw"], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise S3ServerError(f"tests/tools/build.sh versitygw failed ({result.returncode}):\n{result.stderr[-4000:]}")
    binary = os.path.join(result.stdout.strip().splitlines()[-1], "versitygw")
    if not os.access(binary, os.X_OK):
        raise S3ServerError(f"build.sh finished but {binary} is not executable")
    return binary


def start(kind: str, workdir: pathlib.Path, port: int | None = None, timeout: float = 60,
          host: str = "127.0.0.1") -> S3Server:
    """Starts a server of `kind` on `host` (127.0.0.1, or an address of a network this machine's tests made,
    such as tests/node's pod bridge; its data, if any, and its log under `workdir`) and waits until it answers."""
    port = port or free_port()
    address = f"{host}:{port}"
    if kind == "moto":
        command = [sys.executable, str(SERIALIZED_MOTO), "--port", str(port)]
        ready_path = "/moto-api/"
    elif kind == "versitygw":
        data = workdir / "versitygw-data"
        data.mkdir(parents=True, exist_ok=True)
        # --keep-alive: real S3 keeps connections open (the gateway closes each one by default).
        command = [versitygw_binary(), "--port", address, "--access", ENV["AWS_ACCESS_KEY_ID"],
                   "--secret", ENV["AWS_SECRET_ACCESS_KEY"], "--region", ENV["AWS_DEFAULT_REGION"],
                   "--health", "/health", "--keep-alive", "--quiet", "posix", str(data)]
        ready_path = "/health"
    else:
        raise ValueError(f"unknown S3 server kind {kind!r}; choose from {', '.join(KINDS)}")
    log = workdir / f"{kind}.log"
    with open(log, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **ENV})
    server = S3Server(kind, f"http://{address}", process, log)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise S3ServerError(f"{kind} exited with {process.returncode} before it answered:\n{_log_tail(log)}")
        try:
            with urllib.request.urlopen(server.endpoint + ready_path, timeout=2):
                return server
        except OSError:
            if time.monotonic() > deadline:
                stop(server)
                raise S3ServerError(f"{kind} did not answer on {server.endpoint} within {timeout}s:\n"
                                    f"{_log_tail(log)}") from None
            time.sleep(0.1)


def stop(server: S3Server) -> None:
    """SIGTERM, then SIGKILL if it has not exited in time."""
    process = server.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _log_tail(path: pathlib.Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError as e:
        return f"(no log: {e})"
