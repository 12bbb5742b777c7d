"""Claims on steps in flight (storage/lease.py): who counts as still writing, and the writer's heartbeat."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from SneppX_ALG.storage import lease

EXPIRY = 600.0


def test_an_owner_round_trips_through_its_name() -> None:
    me = lease.Owner.me("0123456789abcdef")
    assert lease.Owner.from_name(me.name()) == me
    assert lease.Owner.from_name("ab-none-12-0") == lease.Owner("ab", "", 12, None)
    for bad in ("1-abcd", "", "w-h-p-0", "w-h-1", "w-h-1-2-3"):  # e.g. an older version's `<pid>-<hex>`
        assert lease.Owner.from_name(bad) is None


def test_another_machine_is_writing_until_its_claim_is_older_than_the_expiry() -> None:
    elsewhere = lease.Owner("w", "0000feedbeef", os.getpid(), None)  # a pid means nothing on another host
    assert lease.still_writing(elsewhere, 5, age_s=EXPIRY - 1, expiry_s=EXPIRY)
    assert not lease.still_writing(elsewhere, 5, age_s=EXPIRY, expiry_s=EXPIRY)


def test_a_process_on_this_host_is_writing_while_it_lives_and_its_claim_is_fresh() -> None:
    if not lease.this_host():
        pytest.skip("no /proc here: this host can't be told from another")
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        owner = lease.Owner("w", lease.this_host(), child.pid, lease.process_start(child.pid))
        assert lease.still_writing(owner, 5, age_s=0, expiry_s=EXPIRY)
        assert not lease.still_writing(owner, 5, age_s=EXPIRY, expiry_s=EXPIRY)  # alive but stalled
        reused = lease.Owner("w", lease.this_host(), child.pid, owner.pid_start + 1)  # type: ignore[operator]
        assert not lease.still_writing(reused, 5, age_s=0, expiry_s=EXPIRY), "a reused pid is not the writer"
    finally:
        child.communicate(b"")
    assert not lease.still_writing(owner, 5, age_s=0, expiry_s=EXPIRY), "a dead process writes nothing"


def test_this_process_knows_its_own_writers_whatever_a_claim_says() -> None:
    steps_published = []
    mine = lease.WriterLease(publish=lambda: steps_published.append(set(mine.steps)), refresh=lambda: None,
                             withdraw=lambda: steps_published.append(set()))
    owner = mine.owner()
    assert not lease.still_writing(owner, 5, age_s=0, expiry_s=EXPIRY)  # fresh, but nothing held
    mine.hold(5)
    assert lease.still_writing(owner, 5, age_s=0, expiry_s=EXPIRY)
    assert not lease.still_writing(owner, 6, age_s=0, expiry_s=EXPIRY)
    mine.release(5)
    assert not lease.still_writing(owner, 5, age_s=0, expiry_s=EXPIRY)  # e.g. a failed save's leftovers
    assert steps_published == [{5}, set()]


def test_the_heartbeat_refreshes_while_a_step_is_in_flight_and_stops_after() -> None:
    beats = threading.Semaphore(0)
    withdrawn = threading.Event()
    writer = lease.WriterLease(publish=lambda: None, refresh=beats.release, withdraw=withdrawn.set,
                               expiry_s=0.5)
    writer.hold(1)
    writer.hold(2)
    for _ in range(3):
        assert beats.acquire(timeout=30), "no refresh while steps are in flight"
    writer.release(1)
    assert not withdrawn.is_set()  # step 2 is still in flight
    writer.release(2)
    assert withdrawn.is_set()
    while beats.acquire(timeout=0.5):  # drain a beat that was under way; then none come
        pass
    assert not beats.acquire(timeout=1.0), "refreshed after every step was released"


def test_a_claim_that_cant_be_published_fails_the_hold_and_is_not_held() -> None:
    def fail() -> None:
        raise OSError("read-only file system")

    writer = lease.WriterLease(publish=fail, refresh=fail, withdraw=fail)
    with pytest.raises(OSError):
        writer.hold(3)
    assert writer.steps == set() and lease.held_here(writer.writer) == frozenset()
    writer.release(3)  # nothing held: nothing to do, no error
