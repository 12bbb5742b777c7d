"""The compare-and-swap records on a directory and on both real S3 servers: semantics, and writers racing.

Hostile files on a directory are in tests/unit/records/test_record_store.py; the rendezvous built on these records
is in test_rendezvous.py.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import pytest

from SneppX_ALG import errors, storage
from SneppX_ALG.contract import record
from SneppX_ALG.elastic import rendezvous
from SneppX_ALG.records import RecordStore, S3RecordStore, open_record_store


def race(writers: int, attempt: Any) -> list[Any]:
    """Runs `attempt(i)` on `writers` threads released together; returns what each returned (or raised)."""
    start = threading.Barrier(writers)

    def one(i: int) -> Any:
        start.wait()
        try:
            return attempt(i)
        except errors.RecordConflictError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(writers) as pool:
        return list(pool.map(one, range(writers)))


class Scenarios:
    @pytest.fixture
    def store(self) -> RecordStore:
        raise NotImplementedError

    def test_create_read_swap_keys_delete(self, store) -> None:
        created = store.create("rdzv/r/k", {"n": 1})
        assert store.read("rdzv/r/k") == created
        with pytest.raises(errors.RecordExistsError):
            store.create("rdzv/r/k", {"n": 2})
        swapped = store.swap("rdzv/r/k", {"n": 3}, created.version)
        assert store.read("rdzv/r/k") == swapped == record.Record("rdzv/r/k", {"n": 3}, swapped.version)
        with pytest.raises(errors.RecordConflictError):
            store.swap("rdzv/r/k", {"n": 4}, created.version)
        for key in ("rdzv/r/a", "rdzv/r/b/c", "rdzv/s/d"):
            store.create(key, {})
        assert store.keys("rdzv/r/") == ["rdzv/r/a", "rdzv/r/b/c", "rdzv/r/k"]
        assert store.keys("rdzv/r/", limit=2) == ["rdzv/r/a", "rdzv/r/b/c"]
        store.delete("rdzv/r/k")
        store.delete("rdzv/r/k")
        assert store.read("rdzv/r/k") is None and "rdzv/r/k" not in store.keys("rdzv/r/")
        with pytest.raises(errors.RecordConflictError):
            store.swap("rdzv/r/k", {"n": 5}, swapped.version)
        with pytest.raises(errors.RecordValueError):
            store.create("rdzv/../escape", {})
        with pytest.raises(errors.RecordValueError):
            store.create("rdzv/r/big", {"x": "y" * record.MAX_RECORD_BYTES})

    def test_writers_racing_to_create_a_key_have_exactly_one_winner(self, store) -> None:
        for round_ in range(20):
            outcomes = race(8, lambda i, key=f"race/{round_}": store.create(key, {"writer": i}))
            winners = [o for o in outcomes if isinstance(o, record.Record)]
            assert len(winners) == 1, outcomes
            assert all(isinstance(o, errors.RecordExistsError) for o in outcomes if o is not winners[0])
            assert store.read(f"race/{round_}") == winners[0]

    def test_writers_racing_to_swap_one_version_have_exactly_one_winner(self, store) -> None:
        current = store.create("counter", {"n": 0, "by": []})
        for n in range(1, 16):
            seen = current
            outcomes = race(6, lambda i, seen=seen: store.swap("counter", {"n": seen.value["n"] + 1,
                                                                           "by": [*seen.value["by"], i]},
                                                               seen.version))
            winners = [o for o in outcomes if isinstance(o, record.Record)]
            assert len(winners) == 1, outcomes
            current = winners[0]
            assert store.read("counter") == current and current.value["n"] == n
        assert len(current.value["by"]) == 15  # no update was lost

    def test_writers_incrementing_one_counter_with_retries_lose_no_increment(self, store) -> None:
        # Contention with progress: while one writer stalls (its write, its fsync), others move the record
        # on by several versions. A store that let the stalled write land below the newest version would
        # lose its increment.
        writers, increments = 24, 8
        store.create("counter", {"by": []})

        def increment(i: int) -> None:
            for n in range(increments):
                while True:
                    seen = store.read("counter")
                    assert seen is not None
                    try:
                        store.swap("counter", {"by": [*seen.value["by"], f"{i}.{n}"]}, seen.version)
                        break
                    except errors.RecordConflictError:
                        pass

        race(writers, increment)
        final = store.read("counter")
        assert final is not None
        assert sorted(final.value["by"]) == sorted(f"{i}.{n}" for i in range(writers) for n in range(increments))


class TestOnADirectory(Scenarios):
    @pytest.fixture
    def store(self, tmp_path) -> RecordStore:
        return open_record_store(str(tmp_path))


class TestOnS3(Scenarios):
    @pytest.fixture
    def store(self, s3_bucket: str, s3_env: Any) -> RecordStore:
        return S3RecordStore(f"s3://{s3_bucket}/job", client=s3_env.client(max_connections=16))

    def test_listings_page_past_a_thousand_keys_and_skip_what_is_not_a_record(self, store, s3_bucket,
                                                                             s3_env) -> None:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: store.create(f"many/k{i:04d}", {}), range(1003)))
        client = s3_env.client()
        for junk in ("many/has space", "many/.hidden", "many/bad~char", "many/caf\u00e9", "many/-dash"):
            client.put_object(Bucket=s3_bucket, Key=f"job/{junk}", Body=b"{}")
        client.put_object(Bucket=s3_bucket, Key="jobless/many/k", Body=b"{}")  # a sibling prefix, not ours
        keys = store.keys("many/")
        assert keys == [f"many/k{i:04d}" for i in range(1003)]
        assert store.keys("many/", limit=1001) == keys[:1001]

    def test_an_object_over_the_limit_is_refused_without_reading_it(self, store, s3_bucket, s3_env) -> None:
        s3_env.client().put_object(Bucket=s3_bucket, Key="job/big", Body=b" " * (record.MAX_RECORD_BYTES + 1))
        with pytest.raises(errors.RecordCorruptError, match="over"):
            store.read("big")

    def test_an_unreachable_store_is_a_transient_error_and_join_gives_up_at_its_timeout(self, unused_port,
                                                                                        s3_env) -> None:
        client = storage.make_s3_client(endpoint_url=f"http://127.0.0.1:{unused_port}", max_attempts=1,
                                        connect_timeout=1)
        store = S3RecordStore("s3://nobody/job", client=client)
        for call in (lambda: store.read("k"), lambda: store.create("k", {}), lambda: store.keys(),
                     lambda: store.swap("k", {}, '"etag"'), lambda: store.delete("k")):
            with pytest.raises(errors.RecordUnavailableError):
                call()
        agent = rendezvous.Rendezvous(store, "r", agent_id="a", host="h", heartbeat="h:1", workers=1,
                                      config=rendezvous.RendezvousConfig(join_timeout=1.0))
        with pytest.raises(errors.RendezvousTimeoutError, match="unavailable"):
            agent.join()
