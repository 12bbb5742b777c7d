"""first_contact_grace: a peer never heard from is suspected only timeout + first_contact_grace after start.

The members of a new generation learn of it up to one rendezvous poll apart and each starts its monitor then,
so a peer whose monitor starts a little later than ours must not be suspected for it (docs/ELASTIC.md,
"Failure detection"). Real monitors on free 127.0.0.1 ports, in both modes (gossip with direct_limit=1). The
late peer starts well after `timeout` and well before `timeout + grace`; without the grace it would be
suspected first. Nothing here asserts a duration: only which events came, and in which order.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
from heartbeat_peers import free_udp_ports

from SneppX_ALG import HeartbeatMonitor
from SneppX_ALG.elastic.heartbeat import MembershipEvent

KEY = os.urandom(32)
INTERVAL = 0.05
TIMEOUT = 0.3
GRACE = 4.0
LATE = 1.0  # the late peer's monitor starts this long after ours: after TIMEOUT, long before TIMEOUT + GRACE
DIRECT_LIMIT = {"direct": 16, "gossip": 1}


class Recorder:
    """Every event of a monitor from its start, in order."""

    def __init__(self, hb: HeartbeatMonitor):
        self.events: list[MembershipEvent] = []
        self._changed = threading.Condition()
        hb.subscribe(self._add)

    def _add(self, event: MembershipEvent) -> None:
        with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    def wait(self, predicate: Callable[[MembershipEvent], bool], what: str,
             timeout: float = 60) -> MembershipEvent:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for event in self.events:
                    if predicate(event):
                        return event
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no event: {what}; events: {self.events}")
                self._changed.wait(left)

    def kinds(self, peer: str) -> list[str]:
        with self._changed:
            return [e.kind for e in self.events if e.peer == peer]


def failed(peer: str) -> Callable[[MembershipEvent], bool]:
    return lambda e: e.peer == peer and e.kind in ("suspected", "confirmed")


def monitor(bind: str, peers: list[str], mode: str, grace: float) -> HeartbeatMonitor:
    return HeartbeatMonitor(peers=[p for p in peers if p != bind], key=KEY, bind=bind, interval=INTERVAL,
                            timeout=TIMEOUT, direct_limit=DIRECT_LIMIT[mode], first_contact_grace=grace)


@pytest.mark.parametrize("mode", ["direct", "gossip"])
def test_a_peer_starting_within_the_grace_is_not_suspected_and_one_that_never_starts_is(mode: str) -> None:
    me, late, missing = (f"127.0.0.1:{p}" for p in free_udp_ports(3))
    everyone = [me, late, missing]
    hb = monitor(me, everyone, mode, GRACE)
    assert hb.mode == mode and hb.first_contact_grace == GRACE
    seen = Recorder(hb)
    late_hb = monitor(late, everyone, mode, GRACE)
    try:
        hb.start()
        time.sleep(LATE)  # how late the peer is; the assertions below don't depend on it being exact
        late_hb.start()
        seen.wait(lambda e: e.peer == late and e.kind == "healthy", "the late peer healthy")
        late_hb.stop()  # once heard, the ordinary timeout applies: suspected before the missing one
        seen.wait(failed(late), "the late peer suspected after it stopped")
        seen.wait(failed(missing), "the missing peer suspected")
        assert seen.kinds(late)[:2] == ["healthy", "suspected"], seen.events
        first_failures = [e.peer for e in seen.events if e.kind in ("suspected", "confirmed")]
        assert first_failures[0] == late, seen.events
        assert seen.kinds(missing)[0] == "suspected" and "healthy" not in seen.kinds(missing)
    finally:
        hb.stop()
        late_hb.stop()


@pytest.mark.parametrize("mode", ["direct", "gossip"])
def test_without_grace_a_late_peer_is_suspected_first_as_before(mode: str) -> None:
    me, late, missing = (f"127.0.0.1:{p}" for p in free_udp_ports(3))
    everyone = [me, late, missing]
    hb = monitor(me, everyone, mode, 0.0)
    assert hb.first_contact_grace == 0.0
    seen = Recorder(hb)
    late_hb = monitor(late, everyone, mode, 0.0)
    try:
        hb.start()
        seen.wait(failed(late), "the late peer suspected before it started")
        seen.wait(failed(missing), "the missing peer suspected")
        late_hb.start()
        seen.wait(lambda e: e.peer == late and e.kind == "healthy", "the late peer healthy once started")
        kinds = seen.kinds(late)
        assert kinds[0] == "suspected" and kinds[-1] == "healthy", seen.events
        assert hb.status()[late].state == "healthy" and hb.status()[late].suspicions >= 1
    finally:
        hb.stop()
        late_hb.stop()
