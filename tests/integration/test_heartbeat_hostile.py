"""Hostile datagrams against a real monitor: none is accepted, each is counted under its reason, none stalls it.

The test holds the UDP socket of the monitor's one peer (127.0.0.1, a free port) and speaks the wire format
from elastic/wire.py, written from docs/ELASTIC.md with hashlib's BLAKE2s, independently of the C encoder: the
monitor's own datagrams must decode with it (the two implementations agree), and a few legitimate datagrams
must be accepted before the attack, so that "zero accepted" means the checks work, not that the test's
datagrams were wrong. Then: wrong key, captured datagrams replayed, delayed ones delivered out of order, its
own datagram reflected back, truncated, oversized, random bytes, a future version, another job, an old
generation, a stranger's socket, an ACK for no probe, impossible fields, and thousands of bit-flipped copies.
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from heartbeat_peers import free_udp_ports

from SneppX_ALG import HeartbeatMonitor
from SneppX_ALG.elastic import heartbeat, wire

KEY = os.urandom(32)
JOB = "job-under-attack"
LOCALHOST = int.from_bytes(socket.inet_aton("127.0.0.1"), "big")


@dataclasses.dataclass
class Setup:
    monitor: HeartbeatMonitor
    peer: socket.socket        # bound where the monitor expects its peer
    stranger: socket.socket    # not a peer
    my_id: int                 # the peer's member id
    monitor_id: int
    instance: int = 0x5EED
    seq: int = 10**15

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def datagram(self, kind: int, **fields: object) -> wire.Datagram:
        base = wire.Datagram(type=kind, job_tag=heartbeat.job_tag(JOB), instance=self.instance,
                             generation=self.monitor.generation, seq=self.next_seq(), send_time=time.monotonic_ns(),
                             target=self.monitor_id)
        return dataclasses.replace(base, **fields)  # type: ignore[arg-type]

    def send(self, raw: bytes, sock: socket.socket | None = None) -> None:
        (sock or self.peer).sendto(raw, ("127.0.0.1", self.monitor_id & 0xFFFF))

    def receive(self, kind: int, timeout: float = 10) -> tuple[wire.Datagram, bytes]:
        """The next datagram of this type from the monitor (its pings keep coming meanwhile)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.peer.settimeout(max(0.01, deadline - time.monotonic()))
            raw = self.peer.recv(4096)
            d = wire.decode(raw, KEY)
            if d.type == kind:
                return d, raw
        raise AssertionError(f"no datagram of type {kind} from the monitor within {timeout}s")


@pytest.fixture
def setup() -> Iterator[Setup]:
    peer_port, monitor_port = free_udp_ports(2)
    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer.bind(("127.0.0.1", peer_port))
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stranger.bind(("127.0.0.1", 0))
    monitor = HeartbeatMonitor(peers=[f"127.0.0.1:{peer_port}"], key=KEY, job_id=JOB,
                               bind=f"127.0.0.1:{monitor_port}", interval=0.05, timeout=30)
    monitor.start()
    yield Setup(monitor, peer, stranger, wire.member_id(LOCALHOST, peer_port),
                wire.member_id(LOCALHOST, monitor_port))
    monitor.stop()
    peer.close()
    stranger.close()


def wait_received(monitor: HeartbeatMonitor, count: int) -> heartbeat.MonitorStats:
    deadline = time.monotonic() + 20
    while (stats := monitor.stats()).received < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return stats


def test_monitor_speaks_the_documented_wire_format(setup: Setup) -> None:
    ping, _ = setup.receive(wire.PING)
    assert ping.job_tag == heartbeat.job_tag(JOB) and ping.target == setup.my_id and ping.instance != 0
    assert ping.version == 1 and ping.flags == 0 and ping.entries == ()
    setup.send(wire.encode(setup.datagram(wire.PING), KEY))
    ack, _ = setup.receive(wire.ACK)
    assert (ack.probe_seq, ack.target) == (setup.seq, setup.monitor_id)  # echoes our ping
    assert ack.seq > ping.seq and ack.instance == ping.instance


def test_hostile_datagrams_are_dropped_and_counted_by_reason(setup: Setup) -> None:
    hb = setup.monitor
    # Legitimate traffic first: an ACK for its probe makes the peer healthy; our PING gets an ACK.
    hb.set_generation(3)
    ping, captured_ping = setup.receive(wire.PING)
    while ping.generation != 3:  # pings sent before the change may still be queued
        ping, captured_ping = setup.receive(wire.PING)
    ack = wire.encode(setup.datagram(wire.ACK, probe_seq=ping.seq, probe_time=ping.send_time,
                                     target=ping.target), KEY)
    setup.send(ack)
    our_ping = wire.encode(setup.datagram(wire.PING), KEY)
    setup.send(our_ping)
    setup.receive(wire.ACK)
    delayed = [wire.encode(setup.datagram(wire.PING), KEY) for _ in range(2)]  # held back by "the network"
    setup.send(wire.encode(setup.datagram(wire.PING), KEY))                  # ...while a newer one gets through
    stats = wait_received(hb, 3)
    assert stats.accepted == 3 and hb.healthy_peers() == hb.peers

    valid = wire.encode(setup.datagram(wire.PING), KEY)  # never sent whole
    hostile: list[tuple[str, bytes, socket.socket | None]] = [
        ("bad_mac", wire.encode(setup.datagram(wire.PING), os.urandom(32)), None),
        ("bad_mac", valid[:-1] + bytes([valid[-1] ^ 1]), None),
        ("replay", ack, None),
        ("replay", our_ping, None),
        ("reordered", delayed[1], None),
        ("reordered", delayed[0], None),
        ("replay", delayed[1], None),
        ("replay", captured_ping, None),  # its own datagram, reflected back at it
        ("truncated", valid[:-1], None),
        ("truncated", valid[:wire.HEADER.size], None),
        ("truncated", valid[:3], None),
        ("oversized", valid + b"\0", None),
        ("oversized", valid + os.urandom(5000), None),
        ("bad_magic", b"\x00" + os.urandom(150), None),
        ("bad_magic", b"GET / HTTP/1.1\r\n\r\n", None),
        ("bad_version", wire.encode(setup.datagram(wire.PING, version=2), KEY), None),
        ("wrong_job", wire.encode(setup.datagram(wire.PING, job_tag=heartbeat.job_tag("other-job")), KEY), None),
        ("stale_generation", wire.encode(setup.datagram(wire.PING, generation=2), KEY), None),
        ("unknown_sender", wire.encode(setup.datagram(wire.PING), KEY), setup.stranger),
        ("unsolicited", wire.encode(setup.datagram(wire.ACK, probe_seq=12345, probe_time=1, target=ping.target),
                                    KEY), None),
        ("unsolicited", wire.encode(setup.datagram(wire.ACK, probe_seq=ping.seq, probe_time=ping.send_time,
                                                   target=setup.monitor_id + 1), KEY), None),
        ("unsolicited", wire.encode(setup.datagram(wire.PING, target=setup.monitor_id + 1), KEY), None),
        ("malformed", wire.encode(setup.datagram(7), KEY), None),
        ("malformed", wire.encode(setup.datagram(wire.PING, flags=wire.FLAG_RELAYED), KEY), None),
        ("malformed", wire.encode(setup.datagram(wire.PING_REQ), KEY), None),  # direct mode relays nothing
        ("malformed", wire.encode(setup.datagram(wire.PING, instance=0), KEY), None),
    ]
    before = hb.stats()
    for _, raw, sock in hostile:
        setup.send(raw, sock)
    after = wait_received(hb, before.received + len(hostile))
    assert after.accepted == before.accepted, "a hostile datagram was accepted"
    dropped = {r: after.drops[r] - before.drops[r] for r in after.drops}
    expected = Counter(reason for reason, _, _ in hostile)
    assert {r: n for r, n in dropped.items() if n} == dict(expected)


def test_bit_flipped_and_random_datagrams_never_get_in_or_stall_the_thread(setup: Setup) -> None:
    hb = setup.monitor
    rng = random.Random(7)
    before = hb.stats()
    count = 3000
    for i in range(count):
        raw = bytearray(wire.encode(setup.datagram(wire.PING), KEY))  # each would be accepted unharmed
        if i % 3 == 0:
            raw = bytearray(rng.randbytes(rng.randrange(0, 400)))
        else:
            for _ in range(rng.randrange(1, 4)):
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        setup.send(bytes(raw))
        if i % 200 == 0:
            time.sleep(0.005)  # let the monitor drain; a full socket buffer would drop, not test
    after = wait_received(hb, before.received + count)
    assert after.received - before.received == count
    assert after.accepted == before.accepted
    # still alive and answering
    setup.send(wire.encode(setup.datagram(wire.PING), KEY))
    ack, _ = setup.receive(wire.ACK)
    assert ack.probe_seq == setup.seq
