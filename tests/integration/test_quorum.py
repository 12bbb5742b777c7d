"""Quorum over real heartbeats: monitors on free 127.0.0.1 ports in this process, each with its own C thread and
socket; members that are "down" are simply never started (their ports stay silent)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
from heartbeat_peers import free_udp_ports

from SneppX_ALG import FaultToleranceManager, HeartbeatMonitor, errors

KEY = os.urandom(32)


@pytest.fixture
def cluster() -> Iterator[list[HeartbeatMonitor]]:
    made: list[HeartbeatMonitor] = []

    def make(size: int) -> list[HeartbeatMonitor]:
        addresses = [f"127.0.0.1:{p}" for p in free_udp_ports(size)]
        made.extend(HeartbeatMonitor(peers=addresses, key=KEY, bind=a, interval=0.05, timeout=1.0)
                    for a in addresses)
        return made[-size:]

    yield make  # type: ignore[misc]
    for hb in made:
        hb.stop()


def test_three_of_five_healthy_is_a_quorum(cluster) -> None:
    me, up1, up2, _down1, _down2 = cluster(5)
    up1.start()
    up2.start()
    healthy = FaultToleranceManager(heartbeat=me).wait_for_quorum(timeout=30)
    assert sorted(healthy) == sorted([me.address, up1.address, up2.address])
    assert me.running  # wait_for_quorum started it


def test_two_of_four_times_out_naming_the_missing(cluster) -> None:
    me, up, down1, down2 = cluster(4)
    up.start()
    ft = FaultToleranceManager(heartbeat=me)
    started = time.monotonic()
    with pytest.raises(errors.QuorumTimeoutError) as caught:
        ft.wait_for_quorum(timeout=2.0)
    assert time.monotonic() - started >= 2.0
    assert sorted(caught.value.missing) == sorted([down1.address, down2.address])
    assert sorted(caught.value.healthy) == sorted([me.address, up.address]) and caught.value.needed == 3
    assert down1.address in str(caught.value) and down2.address in str(caught.value)
    # one more member comes up: the same manager now has its quorum
    down1.start()
    assert len(ft.wait_for_quorum(timeout=30)) == 3


def test_quorum_follows_membership_events(cluster) -> None:
    me, a, b = cluster(3)
    for hb in (me, a, b):
        hb.start()
    ft = FaultToleranceManager(heartbeat=me)
    ft.wait_for_quorum(timeout=30)
    stream = me.watch()
    a.stop()
    b.stop()
    seen = set()
    while len(seen) < 2:
        event = stream.next(timeout=30)
        assert event is not None, "no suspicion after both peers stopped"
        if event.kind == "suspected":
            seen.add(event.peer)
    assert seen == {a.address, b.address} and not ft.is_quorum_met()
    assert ft.status()["quorum"] is False
