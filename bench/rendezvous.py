"""Rendezvous: how the time and the store requests for N agents to agree on one generation grow with N.

    python -m bench rendezvous [-- --sizes 8,32,128,256 --stores dir,moto,versitygw --naive-deadline 180]

For each store (a local directory; moto's S3 server and the Versity S3 Gateway on 127.0.0.1) and each N, in
the same run, N agents released together by a barrier:
- rendezvous: `Rendezvous.join()` with min_nodes = max_nodes = N (each agent creates its join record, the
  lowest id seals one membership, everyone reads it);
- naive CAS: what the issue warns against, all agents compare-and-swap one shared record (read it, add
  yourself, swap against the version read; on a conflict read again), then read it until all N are in;
  once retrying at once (N retries each: O(N^2) requests), once with exponential backoff and full jitter
  (5 ms doubling to a 1 s cap, as AWS advises for contended retries), what a careful user would write;
- floor: every agent creates one record of its own and reads one record, the least any store-based
  rendezvous can do (a write to say "I am here" and a read to learn the others).
Requests are counted at the record-store interface (one create, read, swap, keys or delete call is one
HTTP request on S3 for these sizes; on the directory it is one operation of several syscalls). Time is
from the release until the last agent knows the full membership.

Agents are threads of this process, not processes: 256 Python processes would measure interpreter and
boto3 start-up on this 2-core machine rather than the protocol, and request counts don't depend on it.
Threads share one boto3 client (thread-safe, one connection per thread). The S3 servers run in their own
processes; moto, itself in Python, is the bottleneck of its runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import pathlib
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from bench import common
from SneppX_ALG import errors
from SneppX_ALG.contract import record
from SneppX_ALG.elastic import rendezvous
from SneppX_ALG.records import LocalRecordStore, S3RecordStore
from tests import s3_servers


class CountingStore:
    """A record store that counts the calls made through it, by kind (thread-safe)."""

    def __init__(self, inner: record.RecordStore):
        self.inner = inner
        self.uri = inner.uri
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def _count(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    def create(self, key: str, value: Mapping[str, Any]) -> record.Record:
        self._count("create")
        return self.inner.create(key, value)

    def read(self, key: str) -> record.Record | None:
        self._count("read")
        return self.inner.read(key)

    def swap(self, key: str, value: Mapping[str, Any], version: str) -> record.Record:
        self._count("swap")
        return self.inner.swap(key, value, version)

    def keys(self, prefix: str = "", *, limit: int | None = None) -> list[str]:
        self._count("keys")
        return self.inner.keys(prefix, limit=limit)

    def delete(self, key: str) -> None:
        self._count("delete")
        self.inner.delete(key)


def run_agents(n: int, agent: Callable[[int], None], deadline_s: float) -> float | None:
    """Runs agent(i) on n threads released together; seconds until the last finished (None past the
    deadline: the agents are told to stop through the deadline they were given)."""
    start = threading.Barrier(n + 1)
    done: list[float] = []
    failures: list[BaseException] = []

    def one(i: int) -> None:
        start.wait()
        try:
            agent(i)
            done.append(time.perf_counter())
        except (errors.SneppXError, TimeoutError) as e:
            failures.append(e)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join(deadline_s + 60)
    if failures and not all(isinstance(f, TimeoutError) for f in failures):
        raise failures[0]
    return None if failures or len(done) < n else max(done) - began


def bench_rendezvous(store: CountingStore, run_id: str, n: int, deadline_s: float) -> float | None:
    config = rendezvous.RendezvousConfig(min_nodes=n, max_nodes=n, join_timeout=deadline_s)

    def agent(i: int) -> None:
        me = rendezvous.Rendezvous(store, run_id, agent_id=f"node-{i:04d}", host="127.0.0.1",
                                   heartbeat="127.0.0.1:29500", workers=1, config=config)
        if len(me.join().members) != n:
            raise errors.RendezvousError("a generation formed without every agent")

    return run_agents(n, agent, deadline_s)


def bench_naive(store: CountingStore, run_id: str, n: int, deadline_s: float, *, backoff: bool) -> float | None:
    """Everyone compare-and-swaps one shared record: read it, add yourself, swap; on a conflict read again,
    at once (`backoff=False`, the scheme the issue describes) or after an exponential backoff with full
    jitter (5 ms doubling to a 1 s cap, as AWS advises for contended retries). Then poll it, on the
    rendezvous' schedule, until all N are in."""
    key = f"naive/{run_id}/membership"
    poll = rendezvous.RendezvousConfig(min_nodes=n, max_nodes=n)

    def agent(i: int) -> None:
        me, deadline, rng = f"node-{i:04d}", time.monotonic() + deadline_s, random.Random(i)
        conflicts = 0
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError
            current = store.read(key)
            try:
                if current is None:
                    store.create(key, {"members": [me]})
                elif me not in current.value["members"]:
                    store.swap(key, {"members": [*current.value["members"], me]}, current.version)
                break
            except errors.RecordConflictError:
                conflicts += 1
                if backoff:
                    time.sleep(rng.uniform(0, min(1.0, 0.005 * 2 ** min(conflicts, 10))))
        interval = poll.poll_interval
        while True:
            current = store.read(key)
            if current is not None and len(current.value["members"]) == n:
                return
            if time.monotonic() > deadline:
                raise TimeoutError
            time.sleep(interval * rng.uniform(0.8, 1.2))
            interval = min(interval * 1.5, poll.poll_cap)

    return run_agents(n, agent, deadline_s)


def bench_floor(store: CountingStore, run_id: str, n: int, deadline_s: float) -> float | None:
    store.inner.create(f"floor/{run_id}/all", {"members": n})

    def agent(i: int) -> None:
        store.create(f"floor/{run_id}/join/node-{i:04d}", {"here": True})
        store.read(f"floor/{run_id}/all")

    return run_agents(n, agent, deadline_s)


@contextlib.contextmanager
def open_store(kind: str, workdir: str, max_connections: int) -> Iterator[Callable[[], CountingStore]]:
    """Fresh counting stores (one per measurement) on a directory or a test S3 server started for this."""
    if kind == "dir":
        yield lambda: CountingStore(LocalRecordStore(tempfile.mkdtemp(dir=workdir)))
        return
    server = s3_servers.start(kind, pathlib.Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=workdir)))
    try:
        client = server.client(max_connections=max_connections)
        client.create_bucket(Bucket="bench")
        yield lambda: CountingStore(S3RecordStore(f"s3://bench/{uuid.uuid4().hex[:8]}", client=client))
    finally:
        s3_servers.stop(server)


def seconds(value: float | None, deadline_s: float) -> str:
    return f"> {deadline_s:.0f} s" if value is None else f"{value:.2f} s"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench rendezvous")
    parser.add_argument("--sizes", default="8,32,128,256")
    parser.add_argument("--stores", default="dir,moto,versitygw")
    parser.add_argument("--naive-deadline", type=float, default=180.0,
                        help="seconds after which a naive run is stopped and reported as '>'")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    import os

    os.environ.update(s3_servers.ENV)  # the dummy credentials both S3 servers accept
    workdir = tempfile.mkdtemp(prefix="sneppx-bench-rdzv-")
    print(f"machine: {common.cpu_model()}, {os.cpu_count()} CPUs; agents are threads of one process\n")
    print("| store | N | rendezvous: time | requests (per agent) | naive CAS, immediate retry: time | requests "
          "(per agent) | naive CAS, backoff: time | requests (per agent) | floor: time | requests (per agent) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    schemes: list[tuple[str, Callable[..., float | None], float]] = [
        ("rendezvous", bench_rendezvous, 600.0),
        ("naive", functools.partial(bench_naive, backoff=False), args.naive_deadline),
        ("backoff", functools.partial(bench_naive, backoff=True), args.naive_deadline),
        ("floor", bench_floor, 600.0)]
    try:
        for kind in args.stores.split(","):
            with open_store(kind, workdir, 2 * max(sizes)) as fresh:  # agents + a sealer's readers
                for n in sizes:
                    cells = []
                    for name, bench, deadline in schemes:
                        store = fresh()
                        elapsed = bench(store, f"run-{n}", n, deadline)
                        total = sum(store.counts.values())
                        cells.append(f"{seconds(elapsed, deadline)} | {total} ({total / n:.1f})")
                        if name == "rendezvous":
                            detail = dict(store.counts)
                    print(f"| {kind} | {n} | {' | '.join(cells)} |", flush=True)
                    print(f"<!-- {kind} N={n} rendezvous requests by kind: {detail} -->", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
