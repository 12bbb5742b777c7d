"""Heartbeat monitors in their own processes, for tests that kill, stop and starve them.

Run as a script, it is one member: a HeartbeatMonitor (key from SNEPPX_HEARTBEAT_KEY, as a pod gets it) that
prints one JSON line per membership event and answers commands on stdin: `status`, `gil SECONDS` (a pure-Python
loop that keeps the GIL for that long) and `quit`. Imported, `Member` starts and drives such a process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

HERE = os.path.abspath(__file__)


def free_udp_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports free on host right now, all different (the sockets are held together, then released)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Member:
    """One monitor process: its events as they come, commands answered, signals."""

    def __init__(self, bind: str, peers: list[str], *, key_hex: str, interval: float, timeout: float,
                 direct_limit: int = 16):
        env = {**os.environ, "SNEPPX_HEARTBEAT_KEY": key_hex, "PYTHONUNBUFFERED": "1"}
        env.pop("SNEPPX_HEARTBEAT_KEY_FILE", None)
        self.address = bind
        self.process = subprocess.Popen(
            [sys.executable, HERE, "--bind", bind, "--peers", ",".join(peers), "--interval", str(interval),
             "--timeout", str(timeout), "--direct-limit", str(direct_limit)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.events: list[dict[str, Any]] = []
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            with self._changed:
                if "event" in message:
                    self.events.append(message)
                    self._changed.notify_all()
                else:
                    self._replies.put(message)
        with self._changed:
            self._changed.notify_all()

    def reply(self, timeout: float = 60) -> dict[str, Any]:
        try:
            return self._replies.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.address} (pid {self.pid}) did not answer within {timeout}s") from None

    def command(self, line: str, timeout: float = 60) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self.reply(timeout)

    def wait_event(self, kind: str, peer: str, timeout: float, after: int = 0) -> dict[str, Any] | None:
        """The first event of this kind about peer among events[after:], waiting up to timeout seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for event in self.events[after:]:
                    if event["event"] == kind and event["peer"] == peer:
                        return event
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    return None
                self._changed.wait(left)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        self.process.wait(30)


def start_members(count: int, *, key_hex: str, interval: float, timeout: float,
                  direct_limit: int = 16) -> list[Member]:
    """`count` members on free loopback ports, each given the full list (its own address included), all
    having heard from every other member."""
    addresses = [f"127.0.0.1:{port}" for port in free_udp_ports(count)]
    members = [Member(a, addresses, key_hex=key_hex, interval=interval, timeout=timeout, direct_limit=direct_limit)
               for a in addresses]
    try:
        for m in members:
            assert "ready" in m.reply(timeout=120), f"{m.address} did not start"
        for m in members:
            for other in members:
                if other is not m and not m.wait_event("healthy", other.address, timeout=60):
                    raise AssertionError(f"{m.address} never heard {other.address}: {m.command('status')} "
                                         f"{other.command('status')}")
    except BaseException:
        for m in members:
            m.close()
        raise
    return members


# ---- the member process ------------------------------------------------------------------------------------


def _hold_the_gil(seconds: float) -> int:
    """A pure-Python loop that does not let other Python threads run for `seconds`."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 5)
    try:
        spins, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            spins += 1
        return spins
    finally:
        sys.setswitchinterval(before)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bind", required=True)
    parser.add_argument("--peers", required=True)
    parser.add_argument("--interval", type=float, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--direct-limit", type=int, default=16)
    args = parser.parse_args()
    from SneppX_ALG import HeartbeatMonitor

    lock = threading.Lock()

    def emit(message: dict[str, Any]) -> None:
        with lock:
            print(json.dumps(message), flush=True)

    hb = HeartbeatMonitor(peers=args.peers.split(","), bind=args.bind, interval=args.interval, timeout=args.timeout,
                          direct_limit=args.direct_limit)
    hb.subscribe(lambda e: emit({"event": e.kind, "peer": e.peer, "time": e.time}))
    hb.start()
    emit({"ready": hb.address, "pid": os.getpid()})
    for line in sys.stdin:
        words = line.split()
        if words == ["status"]:
            emit({"status": {p: dataclasses.asdict(s) for p, s in hb.status().items()}, "stats": dataclasses.asdict(hb.stats())})
        elif words[:1] == ["gil"]:
            emit({"gil_spins": _hold_the_gil(float(words[1]))})
        elif words == ["quit"]:
            break
    hb.stop()


if __name__ == "__main__":
    main()
