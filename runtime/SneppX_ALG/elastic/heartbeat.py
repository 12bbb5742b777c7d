"""HeartbeatMonitor: which peers are alive, decided in C so that Python can't get in the way.

Recipe 2 of the cookbook:

    hb = HeartbeatMonitor(peers=["10.0.0.2:29500", "10.0.0.3:29500"])   # key, job and bind from the environment
    ft = FaultToleranceManager(heartbeat=hb, max_restarts=3)
    ft.wait_for_quorum()                                                 # starts the monitor if needed

Why this shape: the failure detector must keep answering and judging while the training thread holds the GIL
for seconds, so the socket, the probes, the MAC and the suspicion timers all live in one C thread per monitor
(native/src/heartbeat.c); this class resolves names, finds the key, and turns snapshots and events into Python
objects. Every datagram carries a keyed BLAKE2s-128 MAC (the key is the job's Secret: there is no
unauthenticated mode), a replay window per sender, the job and the membership generation. The wire format,
the two modes (direct for short peer lists, SWIM gossip above `direct_limit`) and their detection bounds are
in docs/ELASTIC.md, "Failure detection".

Environment (what the operator sets in every rank's pod, see operator/sneppx_operator/builders.py):
    SNEPPX_HEARTBEAT_KEY_FILE   a file holding the raw key bytes (the job's Secret, mounted)
    SNEPPX_HEARTBEAT_KEY        the key in hex (when no file is given)
    SNEPPX_HEARTBEAT_BIND       host:port to bind (default: port 29500 on 127.0.0.1 if every peer is a
                                loopback address, else on every interface)
    SNEPPX_JOB                  the job id carried in each datagram (default "sneppx")
    SNEPPX_GENERATION           the initial membership generation (default 0)

One concept, hence just over 500 lines: the monitor's Python face (its configuration, addresses, key and the
events and statistics the C thread reports); the detector itself is native/src/heartbeat.c.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import logging
import math
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Self

from SneppX_ALG import _native, errors, job_key
from SneppX_ALG.contract.env import (
    ENV_GENERATION,
    ENV_HEARTBEAT_BIND,
    ENV_JOB,
)

log = logging.getLogger(__name__)

DEFAULT_PORT = 29500
DEFAULT_JOB = "sneppx"
DEFAULT_INTERVAL = 0.1
DEFAULT_TIMEOUT = 0.8
DEFAULT_DIRECT_LIMIT = 16


def job_tag(job_id: str) -> bytes:
    """The 16 bytes that name the job in each datagram: BLAKE2s-128 of its id."""
    return hashlib.blake2s(job_id.encode(), digest_size=16).digest()


def split_address(text: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """("host", port) from "host:port", "host" or ":port" ("" for the host when only a port is given)."""
    text = text.strip()
    if text.startswith("[") or text.count(":") > 1:
        raise errors.HeartbeatConfigError(f"{text!r}: IPv6 addresses are not supported by the heartbeat yet")
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = text, str(default_port)
    try:
        port = int(port_text)
    except ValueError:
        raise errors.HeartbeatConfigError(f"{text!r}: the port is not a number") from None
    if not 0 <= port <= 65535:
        raise errors.HeartbeatConfigError(f"{text!r}: port {port} is out of range")
    return host, port


def resolve(host: str, port: int) -> int:
    """The IPv4 address of host, as an int (resolved once, when the monitor is made)."""
    try:
        return int(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise errors.HeartbeatConfigError(f"{host}:{port}: can't resolve {host!r} ({e.strerror})") from None
    return int(ipaddress.IPv4Address(infos[0][4][0]))


def _is_local(addr: int) -> bool:
    """True when this host owns addr (binding to it works)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((str(ipaddress.IPv4Address(addr)), 0))
            return True
        except OSError:
            return False


def _held_address(sock: socket.socket) -> tuple[int, int]:
    """(IPv4 as int, port) of a caller's socket given as sock=; HeartbeatConfigError unless it is an open,
    bound IPv4 UDP socket."""
    if not isinstance(sock, socket.socket):
        raise errors.HeartbeatConfigError(f"sock must be a socket.socket, not {type(sock).__name__}")
    if sock.fileno() < 0:
        raise errors.HeartbeatConfigError("sock is closed")
    if sock.family != socket.AF_INET or sock.type != socket.SOCK_DGRAM:
        raise errors.HeartbeatConfigError(f"sock must be an IPv4 UDP socket, not {sock.family!r}/"
                                          f"{sock.type!r}")
    host, port = sock.getsockname()
    if port == 0:
        raise errors.HeartbeatConfigError("sock is not bound: bind it (to port 0 for any free port) first")
    return int(ipaddress.IPv4Address(host)), port


# Held sockets (by the kernel's identity of the socket: st_dev, st_ino) -> the monitor using it now. Two
# monitors reading one socket at once would each take datagrams meant for the other.
_sockets_in_use: dict[tuple[int, int], weakref.ref[HeartbeatMonitor]] = {}
_sockets_lock = threading.Lock()


def _socket_identity(sock: socket.socket) -> tuple[int, int]:
    st = os.fstat(sock.fileno())
    return st.st_dev, st.st_ino


@dataclasses.dataclass(frozen=True)
class PeerStatus:
    """One peer as this monitor sees it. Durations are seconds before the snapshot; None: never."""

    peer: str
    state: str                 # "unknown" (not heard yet), "healthy", "suspected", "confirmed" (gossip mode)
    since: float               # in this state for
    last_seen: float | None    # last authentic datagram from it
    last_alive: float | None   # newest proof of life: the send time of a probe of ours it answered
    rtt: float | None          # smoothed round-trip time
    rtt_var: float | None
    probes_sent: int
    acks_received: int
    pings_received: int
    accepted: int
    suspicions: int            # times it became suspected
    restarts: int              # times its process (instance id) changed
    incarnation: int           # gossip mode: raised by the peer each time it refutes a suspicion

    @property
    def healthy(self) -> bool:
        return self.state == "healthy"

    @property
    def suspected(self) -> bool:
        """Suspected (or, in gossip mode, confirmed) to have failed."""
        return self.state in ("suspected", "confirmed")


@dataclasses.dataclass(frozen=True)
class MonitorStats:
    """Counters of a whole monitor since it was made."""

    mode: str                  # "direct" or "gossip"
    port: int
    instance: int              # this process's random id, as peers see it
    incarnation: int           # gossip mode: raised each time this monitor refuted a suspicion of itself
    generation: int
    sent: int
    send_errors: int           # datagrams the kernel refused to send (a full buffer): lost like any other
    received: int
    accepted: int
    relayed: int               # gossip mode: indirect probes answered for other members
    stalls: int                # times this monitor's own thread was not scheduled for over two intervals
    events: int                # membership events so far
    drops: dict[str, int]      # datagrams dropped, by reason (docs/ELASTIC.md)


@dataclasses.dataclass(frozen=True)
class MembershipEvent:
    """A change in a peer's state. kind: "healthy" (first heard, or back), "suspected", "confirmed" (gossip mode:
    the suspicion was not refuted in time) or "restarted" (its datagrams come from a new process). time is
    time.monotonic() seconds when the C thread decided; index counts events of this monitor from 1."""

    kind: str
    peer: str
    time: float
    generation: int
    index: int


class EventStream:
    """Membership events from the moment it was made, in order (see HeartbeatMonitor.watch)."""

    def __init__(self, monitor: HeartbeatMonitor, after: int):
        self._monitor = monitor
        self._after = after
        self._pending: list[MembershipEvent] = []
        self.lost = 0  # events that fell out of the monitor's ring before they were read

    def next(self, timeout: float | None = None) -> MembershipEvent | None:
        """The next event, waiting up to timeout seconds (None: until one comes or the monitor stops)."""
        if not self._pending:
            rows = self._monitor._native.wait_events(self._after, timeout)
            if rows:
                self.lost += rows[0]["index"] - self._after - 1
                self._after = rows[-1]["index"]
                self._pending = [self._monitor._event(row) for row in rows]
        return self._pending.pop(0) if self._pending else None

    def __iter__(self) -> Iterator[MembershipEvent]:
        while (event := self.next()) is not None:
            yield event


class HeartbeatMonitor:
    """Watches peers over authenticated UDP heartbeats; answers theirs.

    peers: "host:port" (or "host" for port 29500) of the other members; an entry that is this monitor's own
        address is dropped, so every member may be given the same full list. Names are resolved once, here.
    key: bytes or hex (default: SNEPPX_HEARTBEAT_KEY_FILE, then SNEPPX_HEARTBEAT_KEY); at least 16 bytes.
    job_id: default SNEPPX_JOB or "sneppx". bind: "host:port" (default SNEPPX_HEARTBEAT_BIND, see the module).
    interval: seconds between probe rounds. timeout: silence after which a peer is suspected (direct mode):
        a dead peer is suspected between timeout - interval and timeout after it died (plus scheduling delay).
    direct_limit: with more peers than this, the monitor switches to SWIM gossip (one probe per interval,
        `indirect_probes` helpers, suspicions piggybacked `retransmits` times and confirmed after
        `suspicion_timeout`), so its traffic stays constant as the job grows.
    generation: membership generation (default SNEPPX_GENERATION or 0); datagrams of older ones are dropped.
    first_contact_grace: seconds added to `timeout` for a peer never heard from: it is suspected only once
        timeout + first_contact_grace have passed since start() (both modes; once heard, `timeout` applies).
        Members that learn of a new membership up to a rendezvous poll apart pass that poll bound. 0 (the
        default): direct mode suspects it after `timeout`, gossip mode at its first unanswered probe.
    sock: an IPv4 UDP socket the caller has bound and keeps for its whole life (e.g. one per agent, for every
        generation's monitor): the monitor uses a duplicate of its descriptor and closes only that, so the
        socket stays open and bound after stop() and the next monitor can use it; one monitor at a time
        (HeartbeatConfigError while another that uses it has not stopped). `bind` must be None or agree with
        the socket's address (SNEPPX_HEARTBEAT_BIND is not read); `address` is the socket's.
    environ: where the SNEPPX_* variables are read (default os.environ).

    start() starts the C thread (FaultToleranceManager.wait_for_quorum() calls it when needed); stop() ends it
    and frees the port (not a held `sock`'s); a monitor is not restarted (make a new one). Use it as a context
    manager to stop it.
    """

    def __init__(self, peers: Sequence[str], *, key: bytes | str | None = None, job_id: str | None = None,
                 bind: str | None = None, interval: float = DEFAULT_INTERVAL, timeout: float = DEFAULT_TIMEOUT,
                 generation: int | None = None, direct_limit: int = DEFAULT_DIRECT_LIMIT,
                 probe_timeout: float | None = None, suspicion_timeout: float | None = None,
                 indirect_probes: int = 3, retransmits: int | None = None,
                 first_contact_grace: float = 0.0, sock: socket.socket | None = None,
                 environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        if isinstance(peers, str):
            raise errors.HeartbeatConfigError("peers must be a list of \"host:port\" strings, not one string")
        if not 0 < interval <= timeout:
            raise errors.HeartbeatConfigError(f"need 0 < interval <= timeout, got interval={interval} "
                                              f"timeout={timeout}")
        if not 0 <= first_contact_grace < math.inf:
            raise errors.HeartbeatConfigError(f"first_contact_grace must be >= 0 seconds, not "
                                              f"{first_contact_grace}")
        mac_key = job_key.load_key(key, env)
        self.job_id = job_id if job_id is not None else env.get(ENV_JOB) or DEFAULT_JOB
        resolved = [(text, *self._resolve_peer(text)) for text in peers]
        if sock is not None:
            bind_addr, bind_port = _held_address(sock)
            bind_host = str(ipaddress.IPv4Address(bind_addr))
            if bind is not None:
                host, port = split_address(bind)
                if (port and port != bind_port) or (host and resolve(host, port) != bind_addr):
                    raise errors.HeartbeatConfigError(f"bind={bind!r} disagrees with sock, bound to "
                                                      f"{bind_host}:{bind_port}")
        else:
            bind_host, bind_port = split_address(bind if bind is not None else env.get(ENV_HEARTBEAT_BIND, ""))
            if not bind_host:
                all_loopback = bool(resolved) and all(addr >> 24 == 127 for _, addr, _ in resolved)
                bind_host = "127.0.0.1" if all_loopback else "0.0.0.0"
            bind_addr = resolve(bind_host, bind_port)
        self._names: list[str] = []
        targets: list[tuple[int, int]] = []
        for text, addr, port in resolved:
            if bind_port and port == bind_port and (addr == bind_addr or (bind_addr == 0 and _is_local(addr))):
                continue  # ourselves
            if (addr, port) in targets:
                raise errors.HeartbeatConfigError(f"peer {text!r} is listed twice (as {self._names[targets.index((addr, port))]!r})")
            self._names.append(text)
            targets.append((addr, port))
        n = len(targets)
        scale = max(1.0, math.log10(n + 1))
        self.interval, self.timeout = interval, timeout
        self.probe_timeout = probe_timeout if probe_timeout is not None else 0.4 * interval
        self.suspicion_timeout = suspicion_timeout if suspicion_timeout is not None else 4 * scale * interval
        if generation is None:
            try:
                generation = int(env.get(ENV_GENERATION) or 0)
            except ValueError:
                raise errors.HeartbeatConfigError(f"{ENV_GENERATION}={env[ENV_GENERATION]!r} is not a number") from None
        self.first_contact_grace = first_contact_grace
        self._held: tuple[int, int] | None = None
        if sock is not None:
            self._hold(sock)
        try:
            self._native = _native.Heartbeat(
                bind_addr=bind_addr, bind_port=bind_port, peers=targets, key=mac_key,
                job_tag=job_tag(self.job_id), interval_ns=int(interval * 1e9), timeout_ns=int(timeout * 1e9),
                probe_timeout_ns=int(self.probe_timeout * 1e9),
                suspicion_ns=int(self.suspicion_timeout * 1e9), direct_limit=direct_limit,
                indirect_probes=indirect_probes,
                retransmits=retransmits if retransmits is not None else 4 * math.ceil(scale),
                generation=generation, first_contact_grace_ns=int(first_contact_grace * 1e9),
                sock_fd=sock.fileno() if sock is not None else -1)
        except BaseException:
            self._release()
            raise
        stats = self._native.stats()
        self.address = f"{bind_host}:{stats['port']}"
        self.mode: str = stats["mode"]
        self._lock = threading.Lock()
        self._state = "new"
        self._subscribers: list[Callable[[MembershipEvent], None]] = []
        self._dispatcher: threading.Thread | None = None

    def _hold(self, sock: socket.socket) -> None:
        identity = _socket_identity(sock)
        with _sockets_lock:
            ref = _sockets_in_use.get(identity)
            other = ref() if ref is not None else None
            if other is not None and other._state != "stopped":
                raise errors.HeartbeatConfigError(f"sock is in use by {other!r}: stop it first (one monitor "
                                                  "at a time per socket)")
            _sockets_in_use[identity] = weakref.ref(self)
            self._held = identity

    def _release(self) -> None:
        if self._held is None:
            return
        with _sockets_lock:
            ref = _sockets_in_use.get(self._held)
            if ref is not None and ref() in (self, None):
                del _sockets_in_use[self._held]
        self._held = None

    @staticmethod
    def _resolve_peer(text: str) -> tuple[int, int]:
        host, port = split_address(text)
        if not host or not port:
            raise errors.HeartbeatConfigError(f"peer {text!r}: need host:port")
        return resolve(host, port), port

    # -- running --

    @property
    def peers(self) -> list[str]:
        """The monitored peers, as given (without this monitor's own address)."""
        return list(self._names)

    @property
    def running(self) -> bool:
        return self._state == "running"

    def start(self) -> Self:
        """Starts the C thread (once; calling it again while running does nothing)."""
        with self._lock:
            if self._state == "stopped":
                raise errors.HeartbeatError("this HeartbeatMonitor was stopped; make a new one")
            if self._state == "new":
                stream = self.watch()  # before the thread starts: its first events come within microseconds
                self._native.start()
                self._state = "running"
                self._dispatcher = threading.Thread(target=self._dispatch, args=(stream,),
                                                    name=f"sneppx-heartbeat-events-{self.address}", daemon=True)
                self._dispatcher.start()
                log.info("heartbeat monitor on %s (%s mode) watching %d peers", self.address, self.mode,
                         len(self._names))
        return self

    def stop(self) -> None:
        """Stops the thread, frees the port (a held `sock` stays open and bound, free for the next monitor)
        and ends every EventStream; idempotent."""
        with self._lock:
            self._state = "stopped"
            self._native.stop()
            self._release()
            dispatcher, self._dispatcher = self._dispatcher, None
        if dispatcher is not None and dispatcher is not threading.current_thread():
            dispatcher.join()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- what it knows --

    def status(self) -> dict[str, PeerStatus]:
        """Every peer's state and counters, from one consistent snapshot."""
        now = time.monotonic_ns()

        def ago(t: int) -> float | None:
            return None if t < 0 else max(0.0, (now - t) / 1e9)

        def seconds(ns: int) -> float | None:
            return ns / 1e9 if ns else None

        return {name: PeerStatus(
            peer=name, state=row["state"], since=max(0.0, (now - row["state_since_ns"]) / 1e9),
            last_seen=ago(row["last_seen_ns"]), last_alive=ago(row["last_alive_ns"]), rtt=seconds(row["rtt_ns"]),
            rtt_var=seconds(row["rtt_var_ns"]) if row["rtt_ns"] else None, probes_sent=row["probes_sent"],
            acks_received=row["acks_received"], pings_received=row["pings_received"], accepted=row["accepted"],
            suspicions=row["suspicions"], restarts=row["restarts"], incarnation=row["incarnation"],
        ) for name, row in zip(self._names, self._native.peers(), strict=True)}

    def healthy_peers(self) -> list[str]:
        return [name for name, s in self.status().items() if s.state == "healthy"]

    def suspected_peers(self) -> list[str]:
        """Peers suspected (or, in gossip mode, confirmed) to have failed."""
        return [name for name, s in self.status().items() if s.suspected]

    def stats(self) -> MonitorStats:
        """Monitor-wide counters: datagrams sent, received, accepted, dropped by reason, stalls..."""
        return MonitorStats(**self._native.stats())

    def drops(self) -> dict[str, int]:
        """Datagrams dropped, by reason (truncated, bad_mac, replay, ... see docs/ELASTIC.md)."""
        return self.stats().drops

    @property
    def generation(self) -> int:
        return int(self._native.stats()["generation"])

    def set_generation(self, generation: int) -> None:
        """Stamps `generation` on every datagram from now on; older ones from peers are dropped. Generations
        only move forward (ValueError otherwise). Members should move within `timeout` of each other."""
        self._native.set_generation(generation)

    # -- events --

    def watch(self) -> EventStream:
        """A stream of the membership events that happen from now on (each stream sees all of them)."""
        return EventStream(self, int(self._native.stats()["events"]))

    def subscribe(self, callback: Callable[[MembershipEvent], None]) -> Callable[[], None]:
        """Calls callback(event) for every event, on the monitor's event thread (keep it short); returns a
        function that unsubscribes."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def _event(self, row: dict[str, int | str]) -> MembershipEvent:
        return MembershipEvent(kind=str(row["kind"]), peer=self._names[int(row["peer"])],
                               time=int(row["time_ns"]) / 1e9, generation=int(row["generation"]),
                               index=int(row["index"]))

    def _dispatch(self, stream: EventStream) -> None:
        for event in stream:
            if event.kind == "suspected" or event.kind == "confirmed":
                log.warning("heartbeat: peer %s %s (generation %d)", event.peer, event.kind, event.generation)
            else:
                log.info("heartbeat: peer %s %s", event.peer, event.kind)
            with self._lock:
                callbacks = list(self._subscribers)
            for callback in callbacks:
                try:
                    callback(event)
                except Exception:
                    log.exception("heartbeat event callback %r failed", callback)

    def __repr__(self) -> str:
        return f"HeartbeatMonitor({self.address}, {len(self._names)} peers, {self.mode}, {self._state})"
