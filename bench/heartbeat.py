"""Failure detection: how fast a killed peer is suspected, what the heartbeat costs, how far one monitor scales.

    python -m bench heartbeat                        # all sections, about 3 minutes
    python -m bench heartbeat -- --kills 200 --load 2
    python -m bench heartbeat -- --only kill         # kill | cpu | throughput | gossip

Everything runs on 127.0.0.1 with real UDP, real processes and real SIGKILLs:
- kill: victims are forked from a helper process (so a respawn costs a fork, not an interpreter start), each
  a real HeartbeatMonitor; the observer, in this process, watches 8 at a time. Each victim is SIGKILLed at a
  random phase of the probe interval; the time to the observer's "suspected" event (stamped by its C thread on
  CLOCK_MONOTONIC, the clock of time.monotonic here) is compared with the configured timeout and with what
  users run today: torchrun drops a node after 15 s (keepalive 5 s x 3), NVIDIA resiliency-ext's in-process
  heartbeat timeout is 30 s. With --load N, N processes spin on the CPU meanwhile; any suspicion of a victim
  not yet killed is a false positive and is counted.
- cpu: the monitor's C thread (CPU time from /proc/self/task/TID/schedstat) with 1, 4, 16 peers (direct mode)
  and 1,024 (gossip, and direct for contrast), the peers simulated by one Python process speaking the same
  protocol (elastic/wire.py, hashlib's BLAKE2s): the same work done in Python, side by side.
- throughput: one monitor with 1,024 simulated peers, flooded with valid PINGs: how many it authenticates
  and answers per second, and its CPU time per datagram (the per-core limit is the inverse).
- gossip: 64 real monitors in this process, one stopped: time until every other suspects it, and datagrams
  each sends per interval (direct mode would send 2 x 63).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import secrets
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from bench.common import cpu_model
from SneppX_ALG import HeartbeatMonitor
from SneppX_ALG.elastic import heartbeat, wire

JOB = "bench"
LOCALHOST = int.from_bytes(socket.inet_aton("127.0.0.1"), "big")
ANCHORS = [("torchrun / TorchElastic (keepalive 5 s x 3)", 15.0), ("NVIDIA resiliency-ext in-process default", 30.0)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def thread_cpu_ns(tid: int, pid: str = "self") -> int:
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])


def monitor_thread_id(start: Any) -> int:
    """Starts a monitor (start()) and returns the kernel id of the C thread it made."""
    before = set(os.listdir("/proc/self/task"))
    start()
    time.sleep(0.05)
    python = {t.native_id for t in threading.enumerate()}
    new = [int(t) for t in set(os.listdir("/proc/self/task")) - before if int(t) not in python]
    assert len(new) == 1, new
    return new[0]


def free_addresses(count: int) -> list[str]:
    """count different 127.0.0.1 UDP addresses free right now."""
    held = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(count)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [f"127.0.0.1:{s.getsockname()[1]}" for s in held]
    finally:
        for s in held:
            s.close()


def helper(role: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "bench.heartbeat", "--role", role, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def tell(process: subprocess.Popen[str], line: str) -> None:
    assert process.stdin is not None
    process.stdin.write(line + "\n")
    process.stdin.flush()


def ask(process: subprocess.Popen[str], line: str | None = None) -> Any:
    """Sends line (if any) and returns the helper's next JSON reply."""
    assert process.stdout is not None
    if line is not None:
        tell(process, line)
    return json.loads(process.stdout.readline())


# ---- kill -> suspicion -----------------------------------------------------------------------------------


def kill_latency(kills: int, interval: float, timeout: float, load: int, key: bytes) -> None:
    victims = 8
    addresses = free_addresses(victims)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    server = helper("fork-server", key.hex(), str(interval), str(timeout))
    observer = HeartbeatMonitor(peers=addresses, key=key, job_id=JOB, bind="127.0.0.1:0", interval=interval,
                                timeout=timeout)
    observer.start()
    delays: list[float] = []
    false_positives = 0
    try:
        while len(delays) < kills:
            stream = observer.watch()
            pids = {a: ask(server, f"spawn {a} {observer.address}")["pid"] for a in addresses}
            healthy: set[str] = set()
            while healthy != set(addresses):
                event = stream.next(timeout=30)
                assert event is not None, "victims never came up"
                if event.kind == "healthy":
                    healthy.add(event.peer)
            killed: dict[str, float] = {}
            for a in random.sample(addresses, victims):
                time.sleep(random.uniform(0, interval))
                killed[a] = time.monotonic()
                os.kill(pids[a], signal.SIGKILL)
            suspected: set[str] = set()
            while suspected != set(addresses):
                event = stream.next(timeout=timeout + 30)
                assert event is not None, f"no suspicion of {set(addresses) - suspected}"
                if event.kind != "suspected":
                    continue
                if event.peer not in killed or event.time < killed[event.peer]:
                    false_positives += 1
                    continue
                suspected.add(event.peer)
                delays.append(event.time - killed[event.peer])
    finally:
        observer.stop()
        server.kill()
        for b in burners:
            b.kill()
    p50, p99 = percentile(delays, 50), percentile(delays, 99)
    print(f"\n### SIGKILL -> suspicion ({len(delays)} kills, interval {interval * 1e3:.0f} ms, timeout "
          f"{timeout * 1e3:.0f} ms, {load} CPU burners)\n")
    print("| | p50 | p99 | max | vs timeout (p99) |")
    print("|---|---:|---:|---:|---:|")
    print(f"| SneppX HeartbeatMonitor | {p50 * 1e3:.0f} ms | {p99 * 1e3:.0f} ms | {max(delays) * 1e3:.0f} ms | "
          f"{p99 / timeout:.2f}x |")
    for name, seconds in ANCHORS:
        print(f"| {name} | {seconds:.0f} s | | | {seconds / p99:.0f}x slower |")
    print(f"\nFalse suspicions of victims still alive: {false_positives}. Documented bound: suspected between "
          f"timeout - interval ({(timeout - interval) * 1e3:.0f} ms) and timeout after death, plus scheduling delay.")


def fork_server(key_hex: str, interval: str, timeout: str) -> None:
    """Forks victims on request; it has no threads of its own, so forking it is safe."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps killed victims
    for line in sys.stdin:
        _, bind, peer = line.split()
        pid = os.fork()
        if pid == 0:
            hb = HeartbeatMonitor(peers=[peer], key=bytes.fromhex(key_hex), job_id=JOB, bind=bind,
                                  interval=float(interval), timeout=float(timeout))
            hb.start()
            while True:
                signal.pause()
        print(json.dumps({"pid": pid}), flush=True)


# ---- simulated peers: the same protocol in Python ------------------------------------------------------------


class SimulatedPeers:
    """count UDP sockets on 127.0.0.1, each a peer of one monitor: answers its PINGs and sends PINGs."""

    def __init__(self, count: int, key: bytes):
        self.key = key
        self.sockets = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(count)]
        for s in self.sockets:
            s.bind(("127.0.0.1", 0))
            s.setblocking(False)
        self.ports = [s.getsockname()[1] for s in self.sockets]
        self.instance = random.getrandbits(63) | 1
        self.seq = time.time_ns()
        self.tag = heartbeat.job_tag(JOB)

    def ping(self, index: int, monitor: tuple[str, int]) -> bytes:
        self.seq += 1
        return wire.encode(wire.Datagram(wire.PING, self.tag, self.instance, 0, self.seq,
                                         time.monotonic_ns(), target=wire.member_id(LOCALHOST, monitor[1])), self.key)

    def answer(self, monitor: tuple[str, int], duration: float, pings_per_interval: int, interval: float) -> int:
        """Answers the monitor's PINGs and sends pings_per_interval PINGs each interval, for duration seconds."""
        selector = selectors.DefaultSelector()
        for i, s in enumerate(self.sockets):
            selector.register(s, selectors.EVENT_READ, i)
        handled, end, next_round = 0, time.monotonic() + duration, time.monotonic()
        while (now := time.monotonic()) < end:
            if now >= next_round:
                for i in random.sample(range(len(self.sockets)), pings_per_interval):
                    self.sockets[i].sendto(self.ping(i, monitor), monitor)
                next_round += interval
            for key, _ in selector.select(max(0.0, min(next_round, end) - now)):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                while True:
                    try:
                        raw = sock.recv(4096)
                    except BlockingIOError:
                        break
                    d = wire.decode(raw, self.key)
                    handled += 1
                    if d.type == wire.PING:
                        self.seq += 1
                        sock.sendto(wire.encode(wire.Datagram(wire.ACK, self.tag, self.instance, 0, self.seq,
                                                              time.monotonic_ns(), d.seq, d.send_time, d.target),
                                                self.key), monitor)
        return handled

    def blast(self, monitor: tuple[str, int], duration: float) -> int:
        """Valid PINGs from every socket in turn, as fast as this process can send (encoded beforehand)."""
        batch = [self.ping(i % len(self.sockets), monitor) for i in range(200_000)]
        sent, end = 0, time.monotonic() + duration
        while time.monotonic() < end and sent < len(batch):
            for _ in range(1000):
                self.sockets[sent % len(self.sockets)].sendto(batch[sent], monitor)
                sent += 1
        return sent


def peers_process(count: str, key_hex: str) -> None:
    peers = SimulatedPeers(int(count), bytes.fromhex(key_hex))
    print(json.dumps({"ports": peers.ports}), flush=True)
    order = json.loads(sys.stdin.readline())
    monitor = ("127.0.0.1", order["port"])
    cpu_before = time.process_time()
    if order["mode"] == "blast":
        done = peers.blast(monitor, order["duration"])
    else:
        done = peers.answer(monitor, order["duration"], order["pings_per_interval"], order["interval"])
    print(json.dumps({"datagrams": done, "cpu": time.process_time() - cpu_before}), flush=True)


def simulated(count: int, key: bytes) -> tuple[subprocess.Popen[str], list[str]]:
    process = helper("peers", str(count), key.hex())
    return process, [f"127.0.0.1:{p}" for p in ask(process)["ports"]]


# ---- CPU per peer --------------------------------------------------------------------------------------------


def cpu_cost(key: bytes, interval: float, seconds: float) -> None:
    print(f"\n### CPU of the heartbeat thread (interval {interval * 1e3:.0f} ms, {seconds:.0f} s each)\n")
    print("| peers | mode | datagrams/s (sent+received) | C thread CPU | per peer | C us/datagram | "
          "Python peer us/datagram | Python / C |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for count, direct_limit in ((1, 16), (4, 16), (16, 16), (1024, 16), (1024, 4096)):
        process, addresses = simulated(count, key)
        hb = HeartbeatMonitor(peers=addresses, key=key, job_id=JOB, bind="127.0.0.1:0", interval=interval,
                              timeout=max(1.0, 8 * interval), direct_limit=direct_limit)
        tid = monitor_thread_id(hb.start)
        pings = count if hb.mode == "direct" else 1  # gossip: about one member pings us per interval
        tell(process, json.dumps({"port": int(hb.address.rsplit(":", 1)[1]), "mode": "answer",
                                 "duration": seconds + 1, "pings_per_interval": pings, "interval": interval}))
        time.sleep(1)  # let it settle
        before, cpu0, t0 = hb.stats(), thread_cpu_ns(tid), time.monotonic()
        time.sleep(seconds)
        after, cpu1, wall = hb.stats(), thread_cpu_ns(tid), time.monotonic() - t0
        peer_report = ask(process)
        process.wait()
        healthy = len(hb.healthy_peers())
        hb.stop()
        moved = (after.sent - before.sent) + (after.received - before.received)
        c_us = (cpu1 - cpu0) / 1e3 / max(1, moved)
        py_us = peer_report["cpu"] * 1e6 / max(1, peer_report["datagrams"] * 2)  # each handled one is sent too
        print(f"| {count} | {hb.mode} | {moved / wall:,.0f} | {(cpu1 - cpu0) / 1e9 / wall * 100:.3f}% | "
              f"{(cpu1 - cpu0) / 1e9 / wall * 100 / count:.4f}% | {c_us:.1f} | {py_us:.1f} | "
              f"{py_us / c_us:.1f}x |" + ("" if healthy == count else f" ({healthy} of {count} healthy)"))


# ---- throughput ---------------------------------------------------------------------------------------------


def throughput(key: bytes, seconds: float) -> None:
    process, addresses = simulated(1024, key)
    hb = HeartbeatMonitor(peers=addresses, key=key, job_id=JOB, bind="127.0.0.1:0", interval=0.1, timeout=1.0)
    tid = monitor_thread_id(hb.start)
    before, cpu0, t0 = hb.stats(), thread_cpu_ns(tid), time.monotonic()
    sent = ask(process, json.dumps({"port": int(hb.address.rsplit(":", 1)[1]), "mode": "blast",
                                    "duration": seconds}))["datagrams"]
    time.sleep(0.2)
    after, cpu1, wall = hb.stats(), thread_cpu_ns(tid), time.monotonic() - t0
    process.wait()
    hb.stop()
    accepted = after.accepted - before.accepted
    received = after.received - before.received
    dropped = sum(after.drops.values()) - sum(before.drops.values())
    per = (cpu1 - cpu0) / 1e3 / max(1, received)
    print(f"\n### One monitor, 1,024 simulated peers ({hb.mode} mode), flooded with valid PINGs for {seconds:.0f} s\n")
    print("| offered (one Python sender) | received | accepted and answered | dropped by checks | lost in the "
          "socket buffer | C thread CPU | us per datagram | per-core limit |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {sent / wall:,.0f}/s | {received / wall:,.0f}/s | {accepted / wall:,.0f}/s | {dropped} | "
          f"{sent - received:,} | {(cpu1 - cpu0) / 1e9 / wall * 100:.0f}% | {per:.2f} | {1e6 / per:,.0f}/s |")
    print("\nEach accepted PING is authenticated (BLAKE2s-128), checked against its sender's replay window and "
          "answered with an authenticated ACK: one recvmmsg slot and one sendto per datagram.")


# ---- gossip ------------------------------------------------------------------------------------------------


def gossip(key: bytes, count: int, interval: float) -> None:
    addresses = free_addresses(count)
    members = [HeartbeatMonitor(peers=addresses, key=key, job_id=JOB, bind=a, interval=interval, timeout=1.0)
               for a in addresses]
    t0 = time.monotonic()
    for hb in members:
        hb.start()
    while not all(len(hb.healthy_peers()) == count - 1 for hb in members):
        time.sleep(0.05)
    converged = time.monotonic() - t0
    sent0, t1 = [hb.stats().sent for hb in members], time.monotonic()
    time.sleep(3)
    per_interval = statistics.mean((hb.stats().sent - s) for hb, s in zip(members, sent0, strict=True)) / (
        (time.monotonic() - t1) / interval)
    streams = [hb.watch() for hb in members[1:]]
    members[0].stop()
    stopped = time.monotonic()
    times = []
    for stream in streams:
        while (event := stream.next(timeout=30)) is not None:
            if event.peer == members[0].address and event.kind == "suspected":
                times.append(event.time - stopped)
                break
    time.sleep(2)
    false = sum(s.suspicions for hb in members[1:] for p, s in hb.status().items() if p != members[0].address)
    for hb in members:
        hb.stop()
    print(f"\n### Gossip (SWIM), {count} monitors in one process, interval {interval * 1e3:.0f} ms\n")
    print("| all healthy after start | datagrams sent per member per interval (direct mode: "
          f"{2 * (count - 1)}) | first suspicion | median | all {count - 1} suspect | false suspicions |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {converged:.2f} s | {per_interval:.2f} | {min(times) * 1e3:.0f} ms | "
          f"{statistics.median(times) * 1e3:.0f} ms | {max(times) * 1e3:.0f} ms | {false} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench heartbeat", description=__doc__.splitlines()[0])
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=["kill", "cpu", "throughput", "gossip"], nargs="+")
    parser.add_argument("--kills", type=int, default=96, help="SIGKILLs to time (default 96)")
    parser.add_argument("--load", type=int, default=0, help="CPU-spinning processes during the kills")
    parser.add_argument("--interval", type=float, default=heartbeat.DEFAULT_INTERVAL)
    parser.add_argument("--timeout", type=float, default=heartbeat.DEFAULT_TIMEOUT)
    parser.add_argument("--seconds", type=float, default=10, help="measurement window of cpu and throughput")
    args = parser.parse_args(argv)
    if args.role:
        role, *role_args = args.role
        if role == "fork-server":
            fork_server(*role_args)
        else:
            peers_process(*role_args)
        return
    logging.getLogger("SneppX_ALG").setLevel(logging.ERROR)  # the victims' suspicions are the point here
    key = secrets.token_bytes(32)
    only = set(args.only or ["kill", "cpu", "throughput", "gossip"])
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; load average {os.getloadavg()[0]:.1f}")
    if "kill" in only:
        kill_latency(args.kills, args.interval, args.timeout, args.load, key)
    if "cpu" in only:
        cpu_cost(key, args.interval, args.seconds)
    if "throughput" in only:
        throughput(key, args.seconds)
    if "gossip" in only:
        gossip(key, 64, args.interval)


if __name__ == "__main__":
    main()
