"""HeartbeatMonitor(sock=...): one UDP socket, held by the caller all its life, for monitor after monitor.

An agent that binds its heartbeat port anew at every generation can lose it to another socket in between
(HeartbeatSocketError). Holding one bound socket and handing it to each generation's monitor closes that gap:
the monitor works on a duplicate of the descriptor and closes only that, so the caller's socket stays open and
bound after stop() (nothing else can bind the port meanwhile) and the next monitor takes over.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from collections.abc import Callable, Iterator

import pytest
from heartbeat_peers import free_udp_ports

from SneppX_ALG import HeartbeatMonitor, errors

KEY = os.urandom(32)


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def held() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    yield sock
    sock.close()


def assert_port_taken(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as thief, pytest.raises(OSError) as caught:
        thief.bind(("127.0.0.1", port))
    assert caught.value.errno == errno.EADDRINUSE
    with pytest.raises(errors.HeartbeatSocketError, match="in use"):
        HeartbeatMonitor(peers=[], key=KEY, bind=f"127.0.0.1:{port}")


def test_monitors_in_turn_on_one_held_socket_detect_their_peer_and_leave_the_socket_bound(
        held: socket.socket) -> None:
    port = held.getsockname()[1]
    me = f"127.0.0.1:{port}"
    flags = fcntl.fcntl(held.fileno(), fcntl.F_GETFL)
    (peer_port,) = free_udp_ports(1)
    peer = HeartbeatMonitor(peers=[me], key=KEY, bind=f"127.0.0.1:{peer_port}", interval=0.05, timeout=30)
    peer.start()
    name = f"127.0.0.1:{peer_port}"
    def generation(n: int) -> None:
        hb = HeartbeatMonitor(peers=[name, me], key=KEY, sock=held, interval=0.05, timeout=30)
        assert hb.address == me and hb.peers == [name]  # its own address, from the socket, is dropped
        with hb:
            wait_until(lambda: hb.healthy_peers() == [name], f"monitor {n} to hear its peer")
            wait_until(lambda: peer.status()[me].restarts == n - 1 and peer.healthy_peers() == [me],
                       f"the peer to hear monitor {n}")
        assert not hb.running

    try:
        for n in (1, 2, 3):
            generation(n)
            # The caller's socket: still open, bound to the same address, its flags untouched...
            assert held.fileno() >= 0 and held.getsockname() == ("127.0.0.1", port)
            assert fcntl.fcntl(held.fileno(), fcntl.F_GETFL) == flags
            # ...so nobody can take the port between two monitors.
            assert_port_taken(port)
        # and it is a working socket: the peer's probes, unanswered now, queue up in it
        held.settimeout(30)
        raw, source = held.recvfrom(4096)
        assert source == ("127.0.0.1", peer_port) and raw[:4] == b"SXHB"
        assert peer.status()[me].restarts == 2  # three monitors, three instances, as the peer saw them
    finally:
        peer.stop()


def test_one_monitor_at_a_time_per_socket(held: socket.socket) -> None:
    first = HeartbeatMonitor(peers=[], key=KEY, sock=held)
    with pytest.raises(errors.HeartbeatConfigError, match="in use"):
        HeartbeatMonitor(peers=[], key=KEY, sock=held)
    first.start()
    with pytest.raises(errors.HeartbeatConfigError, match="in use"):
        HeartbeatMonitor(peers=[], key=KEY, sock=held)
    first.stop()
    second = HeartbeatMonitor(peers=[], key=KEY, sock=held)
    second.stop()


def test_a_held_socket_must_be_bound_ipv4_udp_and_agree_with_bind(held: socket.socket) -> None:
    port = held.getsockname()[1]
    HeartbeatMonitor(peers=[], key=KEY, sock=held, bind=f"127.0.0.1:{port}").stop()
    HeartbeatMonitor(peers=[], key=KEY, sock=held, bind=f":{port}").stop()
    with pytest.raises(errors.HeartbeatConfigError, match="disagrees"):
        HeartbeatMonitor(peers=[], key=KEY, sock=held, bind=f"127.0.0.1:{port - 1}")
    with pytest.raises(errors.HeartbeatConfigError, match="disagrees"):
        HeartbeatMonitor(peers=[], key=KEY, sock=held, bind=f"127.0.0.2:{port}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as unbound, \
            pytest.raises(errors.HeartbeatConfigError, match="not bound"):
        HeartbeatMonitor(peers=[], key=KEY, sock=unbound)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp, \
            pytest.raises(errors.HeartbeatConfigError, match="UDP"):
        tcp.bind(("127.0.0.1", 0))
        HeartbeatMonitor(peers=[], key=KEY, sock=tcp)
    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    closed.close()
    with pytest.raises(errors.HeartbeatConfigError, match="closed"):
        HeartbeatMonitor(peers=[], key=KEY, sock=closed)
