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

# ---- parallel runs: which tests share a pytest-xdist worker ---------------------------------------------------
# `make test` runs the suite on several workers (`-n`; docs/TESTING.md, "Running tests in parallel"), each with
# its own session and module fixtures. Tests that share an expensive one stay together on one worker, so that it
# is made once: the image (a buildah build, minutes) and the real node that runs it; a module's module-scoped
# fixture (the k8s tier's in-process operator, the fuzz targets' build, the power-loss recordings, a reference
# training). The k8s tier goes by module even where a module has none, so that few workers start a cluster.
# Every other test goes to whichever worker is free. (xdist's own `--dist loadgroup` reads an `xdist_group` mark
# from a node-id suffix that pytest 9.2's node ids no longer carry: every test would go alone. So the groups are
# decided here, from the node id, by the scheduler below.)
SHARED_BY_PREFIX = {"tests/image/": "image-and-node", "tests/node/": "image-and-node"}
BY_MODULE = ("tests/k8s/", "tests/fuzz/", "tests/powerloss/", "tests/integration/test_data_parallel.py",
             "tests/integration/test_sharded_checkpoint.py")


def worker_group(nodeid: str) -> str | None:
    """The group whose tests run on one worker, one after another (None: the test goes on its own)."""
    for prefix, group in SHARED_BY_PREFIX.items():
        if nodeid.startswith(prefix):
            return group
    module = nodeid.split("::", 1)[0]
    return module if module.startswith(BY_MODULE) else None


def start_rank(nodeid: str) -> int:
    """Which tests a parallel run hands out first: the groups that wait longest (the image build and the real
    node, then the k8s modules' pods) start at once, and the short tests fill the workers around them."""
    group = worker_group(nodeid)
    if group in SHARED_BY_PREFIX.values():
        return 0
    return 1 if nodeid.startswith(("tests/k8s/",) + LONG_ALONE) else 2


# Long tests of their own, handed out with the k8s modules rather than last in collection order (at 15 min of 20,
# test_crash_kill's fork sweep ended a parallel run alone).
LONG_ALONE = ("tests/integration/test_crash_kill.py",)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: a venv without pytest-xdist still runs the suite serially
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's scheduler of whole scopes (all of one goes to one worker), a scope being worker_group()."""

        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid) or nodeid

    config.option.loadscopereorder = False  # hand scopes out in collection order, which start_rank sets
    return SharedFixtureScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker; every worker sorts alike. A serial run keeps its order.
        items.sort(key=lambda item: start_rank(item.nodeid))  # stable: within a rank, collection's order


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
