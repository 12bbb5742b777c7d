"""Gossip mode (SWIM) with real monitors: 24 of them in this process on free 127.0.0.1 ports, each with its own
C thread and socket, switched to gossip by direct_limit=4. A stopped member (its socket closed: silence, as
after a crash) must be suspected by every other within the deterministic bound of docs/ELASTIC.md (every member
probes every other at least once per round of N-1 intervals, then one interval for the probe to fail), while
each member sends a bounded number of datagrams per interval whatever N is; the survivors end healthy in
everyone's view, refuting any suspicion a slow moment caused.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
from heartbeat_peers import free_udp_ports

from SneppX_ALG import HeartbeatMonitor

N = 24
INTERVAL = 0.1
SCHEDULING_MARGIN = 2.0  # docs/ELASTIC.md
KEY = os.urandom(32)


@pytest.fixture
def members() -> Iterator[list[HeartbeatMonitor]]:
    addresses = [f"127.0.0.1:{p}" for p in free_udp_ports(N)]
    monitors = [HeartbeatMonitor(peers=addresses, key=KEY, bind=a, interval=INTERVAL, timeout=1.0, direct_limit=4)
                for a in addresses]
    for hb in monitors:
        hb.start()
    yield monitors
    for hb in monitors:
        hb.stop()


def wait_until(predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_gossip_detects_a_dead_member_everywhere_with_bounded_traffic(members: list[HeartbeatMonitor]) -> None:
    assert {hb.mode for hb in members} == {"gossip"}
    assert wait_until(lambda: all(len(hb.healthy_peers()) == N - 1 for hb in members), 60), \
        [len(hb.healthy_peers()) for hb in members]

    sent_before = [hb.stats().sent for hb in members]
    started = time.monotonic()
    time.sleep(2.0)
    rounds = (time.monotonic() - started) / INTERVAL
    per_interval = [(hb.stats().sent - s) / rounds for hb, s in zip(members, sent_before, strict=True)]
    # one probe, about one answer, a few relays and indirect probes: far below direct mode's 2(N-1)
    assert sum(per_interval) / N < 6, per_interval

    victim, survivors = members[0], members[1:]
    streams = [hb.watch() for hb in survivors]
    victim.stop()
    stopped = time.monotonic()
    bound = N * INTERVAL + SCHEDULING_MARGIN
    for hb, stream in zip(survivors, streams, strict=True):
        while True:
            event = stream.next(timeout=max(0.0, stopped + bound + 10 - time.monotonic()))
            assert event is not None, f"{hb.address} never suspected {victim.address}"
            if event.peer == victim.address and event.kind in ("suspected", "confirmed"):
                assert event.time - stopped <= bound, (event.time - stopped, bound)
                break
    # gossip confirms the death everywhere; the living end healthy in every view
    assert wait_until(lambda: all(hb.status()[victim.address].state == "confirmed" for hb in survivors), 30)
    assert wait_until(lambda: all(len(hb.healthy_peers()) == N - 2 for hb in survivors), 30), \
        [hb.suspected_peers() for hb in survivors]
    assert [hb.drops() for hb in survivors if any(hb.drops().values())] == []


def test_a_member_unreachable_directly_is_kept_alive_by_indirect_probes() -> None:
    """The target drops the origin's pings (the origin is not in its list: a one-way partition); members in
    between probe it for the origin (PING_REQ) and relay its answer, so the origin keeps it healthy. Without
    indirect probes every direct probe of the target ends in a suspicion; with them, a loaded machine may
    miss a relay now and then (SWIM's answer to that is the refutation), but most probes are answered."""
    interval = 0.2  # a relay has 120 ms after the direct probe's timeout: a busy 2-core CI machine is slow
    addresses = [f"127.0.0.1:{p}" for p in free_udp_ports(6)]
    origin, target = addresses[0], addresses[1]
    monitors = [HeartbeatMonitor(peers=[p for p in addresses if not (a == target and p == origin)], key=KEY,
                                 bind=a, interval=interval, timeout=2.0, direct_limit=2) for a in addresses]
    try:
        for hb in monitors:
            hb.start()
        time.sleep(40 * interval)  # the origin probes the target directly about every 5 intervals
        view = monitors[0].status()[target]
        assert view.state == "healthy" and view.acks_received == 0, view
        assert view.probes_sent >= 4 and view.suspicions <= view.probes_sent // 4, view
        assert sum(hb.stats().relayed for hb in monitors[2:]) > 0
        assert monitors[1].drops()["unknown_sender"] > 0  # it really never answered the origin itself
    finally:
        for hb in monitors:
            hb.stop()
