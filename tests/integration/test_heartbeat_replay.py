"""Replays across a peer's restart: a captured datagram of a peer's previous process is dropped as a replay.

A monitor keeps one replay window per peer, for the process (instance) it last heard from there. When that
peer restarts, the window moves to the new process; what an attacker on the path captured from the old one
must not move it back, nor count as another restart, however fresh the probe it echoes (docs/ELASTIC.md,
"What a receiver checks": an instance other than the current one restarts the window only with an ACK to a
probe sent after that window began).

First test: real monitor processes (heartbeat_peers.Member). The monitor under test watches 127.0.0.1:P, where
a relay (the "path") forwards its datagrams to the peer's monitor and the peer's ACKs back, keeping a copy of
each.
The peer's monitor binds every interface, so it answers pings addressed to the relay's name. The peer is
SIGKILLed and restarted on the same port; then the relay replays ACKs captured from the first process.

Second test: a forged peer (elastic/wire.py) whose second process counts from below the first (its wall clock
stepped back), the case the "fresh probe" rule exists for: it is accepted once it answers a probe, and then
the first process's datagrams, higher numbered, are still replays.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from heartbeat_peers import Member, free_udp_ports

from SneppX_ALG import HeartbeatMonitor
from SneppX_ALG.elastic import heartbeat, wire

JOB = "replay-test"
LOCALHOST = int.from_bytes(socket.inet_aton("127.0.0.1"), "big")


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Relay:
    """A UDP socket on 127.0.0.1 that the monitor under test knows as its peer: forwards the monitor's
    datagrams to the peer's real monitor, and that peer's ACKs back (its PINGs, addressed to the relay's name,
    are not forwarded), keeping every ACK it forwarded: what an attacker on the path would capture."""

    def __init__(self, key: bytes, monitor_port: int, peer_port: int):
        self.key = key
        self.monitor = ("127.0.0.1", monitor_port)
        self.peer = ("127.0.0.1", peer_port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.port: int = self.sock.getsockname()[1]
        self.acks: list[tuple[wire.Datagram, bytes]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                raw, source = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            if source == self.monitor:
                self.sock.sendto(raw, self.peer)
                continue
            d = wire.decode(raw, self.key)
            if d.type == wire.ACK:
                with self._lock:
                    self.acks.append((d, raw))
                self.sock.sendto(raw, self.monitor)

    def acks_of(self, instance: int) -> list[bytes]:
        with self._lock:
            return [raw for d, raw in self.acks if d.instance == instance]

    def instances(self) -> list[int]:
        with self._lock:
            return list(dict.fromkeys(d.instance for d, _ in self.acks))

    def replay(self, raw: bytes) -> None:
        self.sock.sendto(raw, self.monitor)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def test_acks_captured_from_a_restarted_peers_old_process_are_replays() -> None:
    key_hex = secrets.token_hex(32)
    key = bytes.fromhex(key_hex)
    monitor_port, peer_port = free_udp_ports(2)
    relay = Relay(key, monitor_port, peer_port)
    peer_name = f"127.0.0.1:{relay.port}"
    hb = HeartbeatMonitor(peers=[peer_name], key=key, bind=f"127.0.0.1:{monitor_port}", interval=0.05,
                          timeout=60)
    restarted: list[heartbeat.MembershipEvent] = []
    hb.subscribe(lambda e: restarted.append(e) if e.kind == "restarted" else None)
    members: list[Member] = []

    def start_peer() -> Member:
        member = Member(f"0.0.0.0:{peer_port}", [peer_name], key_hex=key_hex, interval=0.05, timeout=60)
        members.append(member)
        assert "ready" in member.reply(timeout=120), "the peer's monitor did not start"
        return member

    try:
        hb.start()
        first = start_peer()
        wait_until(lambda: len(relay.instances()) == 1 and len(relay.acks_of(relay.instances()[0])) >= 3,
                   "3 ACKs from the peer's first process")
        wait_until(lambda: hb.status()[peer_name].state == "healthy", "the first process to be healthy")
        old = relay.instances()[0]
        first.signal(signal.SIGKILL)
        first.process.wait(30)

        start_peer()  # the same port: a restart
        wait_until(lambda: len(relay.instances()) == 2 and len(relay.acks_of(relay.instances()[1])) >= 3,
                   "3 ACKs from the peer's second process")
        wait_until(lambda: hb.status()[peer_name].restarts == 1 and hb.status()[peer_name].acks_received >= 6,
                   "the monitor to accept the second process")

        captured = relay.acks_of(old)[:3]
        before = hb.stats()
        for raw in captured:  # each echoes a probe the monitor really sent in this run
            relay.replay(raw)
        wait_until(lambda: hb.drops()["replay"] >= before.drops["replay"] + len(captured)
                   or hb.status()[peer_name].restarts != 1, "the replays to be handled")
        acks = hb.status()[peer_name].acks_received
        wait_until(lambda: hb.status()[peer_name].acks_received >= acks + 5, "more ACKs of the new process")

        after = hb.stats()
        status = hb.status()[peer_name]
        assert after.drops["replay"] - before.drops["replay"] == len(captured)
        assert status.restarts == 1, f"a replay of the old process was taken for a restart: {status}"
        assert status.state == "healthy" and status.suspicions == 0
        assert len(restarted) == 1
    finally:
        hb.stop()
        for m in members:
            m.close()
        relay.close()


@dataclasses.dataclass
class ForgedPeer:
    """The monitor's one peer, spoken for by the test with wire.py (as in test_heartbeat_hostile.py)."""

    monitor: HeartbeatMonitor
    sock: socket.socket
    key: bytes
    my_id: int
    monitor_id: int

    def receive_ping(self, timeout: float = 10) -> wire.Datagram:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            d = wire.decode(self.sock.recv(4096), self.key)
            if d.type == wire.PING:
                return d
        raise AssertionError("no PING from the monitor")

    def ack(self, instance: int, seq: int) -> bytes:
        """An ACK from process `instance` to the newest ping of the monitor, as datagram number seq."""
        ping = self.receive_ping()
        return wire.encode(wire.Datagram(
            type=wire.ACK, job_tag=heartbeat.job_tag(JOB), instance=instance,
            generation=self.monitor.generation, seq=seq, send_time=time.monotonic_ns(), probe_seq=ping.seq,
            probe_time=ping.send_time, target=ping.target), self.key)

    def ping(self, instance: int, seq: int) -> bytes:
        return wire.encode(wire.Datagram(
            type=wire.PING, job_tag=heartbeat.job_tag(JOB), instance=instance,
            generation=self.monitor.generation, seq=seq, send_time=time.monotonic_ns(),
            target=self.monitor_id), self.key)

    def send(self, raw: bytes) -> heartbeat.MonitorStats:
        """Sends raw and returns the monitor's counters once it has read it."""
        received = self.monitor.stats().received
        self.sock.sendto(raw, ("127.0.0.1", self.monitor_id & 0xFFFF))
        wait_until(lambda: self.monitor.stats().received > received, "the monitor to read the datagram")
        return self.monitor.stats()


@pytest.fixture
def forged() -> Iterator[ForgedPeer]:
    key = os.urandom(32)
    peer_port, monitor_port = free_udp_ports(2)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", peer_port))
    hb = HeartbeatMonitor(peers=[f"127.0.0.1:{peer_port}"], key=key, job_id=JOB,
                          bind=f"127.0.0.1:{monitor_port}", interval=0.2, timeout=60)
    hb.start()
    yield ForgedPeer(hb, sock, key, wire.member_id(LOCALHOST, peer_port),
                     wire.member_id(LOCALHOST, monitor_port))
    hb.stop()
    sock.close()


def test_a_restart_counting_from_below_is_accepted_with_a_fresh_ack_and_the_old_process_stays_replayed(
        forged: ForgedPeer) -> None:
    hb, name = forged.monitor, forged.monitor.peers[0]
    old, new = 0x01D1, 0x2E21
    old_seq, new_seq = 2 * 10**18, 10**18  # the new process's wall clock stepped back
    old_ack = forged.ack(old, old_seq + 1)
    assert forged.send(old_ack).accepted == 1
    old_ping = forged.ping(old, old_seq + 2)
    assert forged.send(old_ping).accepted == 2
    assert hb.status()[name].state == "healthy"
    # An ACK of a process the monitor never heard from (one between the two), that the attacker kept back.
    withheld = forged.ack(0x3A1E, old_seq + 10)

    # The new process: its ping proves nothing fresh and is below the window; its ACK to a new probe does.
    replays = forged.send(forged.ping(new, new_seq + 1)).drops["replay"]
    stats = forged.send(forged.ack(new, new_seq + 2))
    assert stats.accepted == 3 and hb.status()[name].restarts == 1

    # The old process's datagrams, numbered above the new window, replayed: still replays; and so is the ACK
    # kept back, though its process is new to the monitor: the probe it echoes is older than the window.
    forged.send(old_ack)
    forged.send(old_ping)
    stats = forged.send(withheld)
    assert stats.drops["replay"] - replays == 3 and stats.accepted == 3
    assert hb.status()[name].restarts == 1

    # ...and the new process goes on as before.
    stats = forged.send(forged.ack(new, new_seq + 3))
    assert stats.accepted == 4
    status = hb.status()[name]
    assert status.state == "healthy" and status.restarts == 1
