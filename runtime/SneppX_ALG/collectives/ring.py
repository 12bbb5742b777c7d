"""The TCP ring's setup: an authenticated handshake with each neighbour, driven by one selector loop
(`connect_ring`). The data path that follows is C (native/src/comm.c).

Setup of the TCP ring, per rank r of N in generation g:
1. listen on `host`, publish the address under `gen-g/comm/addr/r` in the store;
2. read rank r+1's address, connect to it (the socket this rank sends on), and accept rank r-1's connection (the
   one it receives on), both at once in one selector loop;
3. on each connection, a challenge-response with HMAC-SHA256 over both nonces, both ranks and the generation;
   the key never crosses the wire. A connection that is not the protocol, fails the challenge, or comes from
   another generation or an unexpected rank is closed and counted in `refused`; the group goes on forming.
Setup is abortable from its first step (`aborted=`): a generation that ends while a rank still waits for a peer
that will never come must not cost that rank its process (the agent kills a worker that does not stop soon).

Separate because it is a wire protocol of its own (the messages, their MACs, who may connect), with its own
attacks to resist (tests/unit/native/test_comm_ring.py); `ProcessGroup` connects every TCP ring through it, a whole
group's or one between the hosts of a shared-memory group.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import secrets
import selectors
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Generator

from SneppX_ALG import errors
from SneppX_ALG.collectives import store as store_lib

SETUP_POLL = 0.05  # setup's loops wake this often: to look for an address, to retry a connect, to see an abort
MAX_PENDING_HANDSHAKES = 64  # connections being vetted at once; beyond this the oldest is dropped

PROTOCOL_VERSION = 1
# Handshake messages, network byte order. HELLO: magic, version, reserved, generation, rank, world size, frame
# payload bytes, client nonce. CHALLENGE: magic, generation, rank, server nonce, then the server's MAC.
# RESPONSE: magic, the client's MAC. VERDICT: magic, one of the VERDICTS codes.
HELLO = struct.Struct("!4sHHQIII32s")
CHALLENGE_HEAD = struct.Struct("!4sQI32s")
MAC_BYTES = 32
RESPONSE = struct.Struct("!4s32s")
VERDICT = struct.Struct("!4sI")
HELLO_MAGIC, CHALLENGE_MAGIC, RESPONSE_MAGIC, VERDICT_MAGIC = b"SXH1", b"SXH2", b"SXH3", b"SXH4"
ACCEPTED, STALE_GENERATION, UNEXPECTED_RANK, CHUNK_MISMATCH = 0, 1, 2, 3
SERVER_LABEL = b"sneppx-comm-server\0"
CLIENT_LABEL = b"sneppx-comm-client\0"


def address_key(generation: int, rank: int) -> str:
    return store_lib.generation_key(generation, f"comm/addr/{rank}")


# ---- the handshake ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a rank asserts, and checks of its neighbours, on a connection."""

    key: bytes
    generation: int
    rank: int
    world_size: int
    chunk_bytes: int


class _Refused(Exception):
    """A connection to our listener that is not the left neighbour of this generation; `.reason` is counted."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), "sha256").digest()


def _send_small(sock: socket.socket, data: bytes) -> None:
    """Handshake messages are under 100 bytes: a fresh socket's buffer takes them whole, or the peer is bogus."""
    if sock.send(data) != len(data):
        raise ConnectionError("short send of a handshake message")


# Each side of the handshake is a generator: it yields how many bytes it needs next, is sent exactly those bytes,
# and returns when the connection is accepted (raising otherwise). One selector loop drives all of them.
Steps = Generator[int, bytes, None]


def _server_steps(sock: socket.socket, me: Identity) -> Steps:
    hello = yield HELLO.size
    magic, version, _, generation, rank, world_size, chunk_bytes, _nonce = HELLO.unpack(hello)
    if magic != HELLO_MAGIC or version != PROTOCOL_VERSION:
        raise _Refused("not the protocol")
    head = CHALLENGE_HEAD.pack(CHALLENGE_MAGIC, me.generation, me.rank, secrets.token_bytes(32))
    _send_small(sock, head + _mac(me.key, SERVER_LABEL, hello, head))
    magic, their_mac = RESPONSE.unpack((yield RESPONSE.size))
    if magic != RESPONSE_MAGIC or not hmac.compare_digest(their_mac, _mac(me.key, CLIENT_LABEL, hello, head)):
        raise _Refused("wrong key")
    # Authenticated from here on, so the peer may learn why it is turned away.
    left = (me.rank - 1) % me.world_size
    verdict, reason = ACCEPTED, ""
    if generation != me.generation:
        verdict, reason = STALE_GENERATION, "stale generation"
    elif rank != left or world_size != me.world_size:
        verdict, reason = UNEXPECTED_RANK, "unexpected rank"
    elif chunk_bytes != me.chunk_bytes:
        verdict, reason = CHUNK_MISMATCH, "frame size differs"
    _send_small(sock, VERDICT.pack(VERDICT_MAGIC, verdict))
    if verdict != ACCEPTED:
        raise _Refused(reason)


def _client_steps(sock: socket.socket, me: Identity, right: int) -> Steps:
    def fail(kind: type[errors.CollectiveError], why: str) -> errors.CollectiveError:
        return kind(f"setup of generation {me.generation}: rank {me.rank} -> rank {right}: {why}",
                    rank=me.rank, generation=me.generation, peer=right)

    hello = HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, 0, me.generation, me.rank, me.world_size, me.chunk_bytes,
                       secrets.token_bytes(32))
    _send_small(sock, hello)
    challenge = yield CHALLENGE_HEAD.size + MAC_BYTES
    head, their_mac = challenge[:CHALLENGE_HEAD.size], challenge[CHALLENGE_HEAD.size:]
    magic, generation, rank, _nonce = CHALLENGE_HEAD.unpack(head)
    if magic != CHALLENGE_MAGIC or not hmac.compare_digest(their_mac, _mac(me.key, SERVER_LABEL, hello, head)):
        raise fail(errors.CommAuthError, "the listener at its address does not prove it holds the job key")
    if generation != me.generation:
        raise fail(errors.StaleGenerationError, f"the listener belongs to generation {generation}")
    if rank != right:
        raise fail(errors.CommProtocolError, f"the listener is rank {rank}")
    _send_small(sock, RESPONSE.pack(RESPONSE_MAGIC, _mac(me.key, CLIENT_LABEL, hello, head)))
    magic, verdict = VERDICT.unpack((yield VERDICT.size))
    if magic != VERDICT_MAGIC or verdict != ACCEPTED:
        kind = errors.StaleGenerationError if verdict == STALE_GENERATION else errors.CommProtocolError
        why = {STALE_GENERATION: "it is in another generation", UNEXPECTED_RANK: "it expects another rank or world "
               "size", CHUNK_MISMATCH: "its frame size differs"}.get(verdict, "malformed verdict")
        raise fail(kind, f"refused: {why}")


class _Conversation:
    """Feeds one non-blocking socket's bytes to its handshake generator, exactly as many as it asks for."""

    def __init__(self, sock: socket.socket, steps: Steps):
        self.sock, self.steps = sock, steps
        self.buffer = bytearray()
        self.want = next(steps)

    def on_readable(self) -> bool:
        """Reads what is there; True once the handshake has succeeded. Raises what the generator raises."""
        data = self.sock.recv(self.want - len(self.buffer))
        if not data:
            raise ConnectionError("closed during the handshake")
        self.buffer += data
        if len(self.buffer) < self.want:
            return False
        message = bytes(self.buffer)
        self.buffer.clear()
        try:
            self.want = self.steps.send(message)
        except StopIteration:
            return True
        return False


def _address(store: store_lib.Store, generation: int, rank: int) -> tuple[str, int] | None:
    """A rank's published listener address, or None while it has not published one."""
    try:
        value = json.loads(store.get(address_key(generation, rank), timeout=0))
    except errors.StoreTimeoutError:
        return None
    return str(value["host"]), int(value["port"])


def _tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a barrier's frames must not wait for Nagle
    return sock


def check_setup_aborted(aborted: threading.Event | None, rank: int, generation: int) -> None:
    if aborted is not None and aborted.is_set():
        raise errors.CollectiveAbortedError(f"setup of generation {generation}: rank {rank} was aborted",
                                            rank=rank, generation=generation)


def connect_ring(listener: socket.socket, store: store_lib.Store, me: Identity, deadline: float,
                 refused: Counter[str], aborted: threading.Event | None = None,
                 ) -> tuple[socket.socket, socket.socket]:
    """(send socket to rank+1, receive socket from rank-1), both authenticated; see the module docstring.

    The listener is served from the start, also while rank+1's address is not yet in the store, so a connection
    never waits on anything but its own handshake. CollectiveAbortedError once `aborted` is set (seen within
    SETUP_POLL seconds), the sockets closed."""
    right, left = (me.rank + 1) % me.world_size, (me.rank - 1) % me.world_size
    right_address: tuple[str, int] | None = None
    lookup_at, lookup_every = 0.0, 0.01
    selector = selectors.DefaultSelector()
    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ)
    vetting: dict[socket.socket, _Conversation] = {}  # connections to our listener, oldest first
    outgoing: socket.socket | None = None  # our connection to the right neighbour, until it is accepted
    client: _Conversation | None = None
    send_sock: socket.socket | None = None
    recv_sock: socket.socket | None = None
    next_attempt = 0.0

    def drop(sock: socket.socket, reason: str) -> None:
        selector.unregister(sock)
        vetting.pop(sock).sock.close()
        refused[reason] += 1

    try:
        while send_sock is None or recv_sock is None:
            check_setup_aborted(aborted, me.rank, me.generation)
            now = time.monotonic()
            if now >= deadline:
                missing = [f"reach rank {right}" + ("" if right_address else " (it never published its address)")
                           ] if send_sock is None else []
                missing += [f"hear from rank {left}"] if recv_sock is None else []
                raise errors.CollectiveTimeoutError(
                    f"setup of generation {me.generation}: rank {me.rank} could not {' or '.join(missing)} in time"
                    f" (refused meanwhile: {dict(refused) or 'none'})", rank=me.rank, generation=me.generation)
            if right_address is None and now >= lookup_at:  # polled with backoff: a store may be remote
                right_address = _address(store, me.generation, right)
                lookup_at, lookup_every = now + lookup_every, min(lookup_every * 2, 0.25)
            if right_address is not None and send_sock is None and outgoing is None and now >= next_attempt:
                outgoing = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                outgoing.setblocking(False)
                outgoing.connect_ex(right_address)
                selector.register(outgoing, selectors.EVENT_WRITE)
            for selected, _ in selector.select(min(deadline - now, SETUP_POLL)):
                sock = selected.fileobj
                assert isinstance(sock, socket.socket)
                if sock is listener:
                    try:
                        conn, _ = listener.accept()
                    except BlockingIOError:
                        continue
                    conn.setblocking(False)
                    if len(vetting) >= MAX_PENDING_HANDSHAKES:  # a flood: the oldest goes
                        drop(next(iter(vetting)), "flood")
                    vetting[conn] = _Conversation(conn, _server_steps(conn, me))
                    selector.register(conn, selectors.EVENT_READ)
                elif sock is outgoing and client is None:  # the connect finished, or failed
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):  # nobody listening: try again soon
                        selector.unregister(sock)
                        sock.close()
                        outgoing, next_attempt = None, time.monotonic() + SETUP_POLL
                        continue
                    selector.modify(sock, selectors.EVENT_READ)
                    client = _Conversation(sock, _client_steps(sock, me, right))
                elif sock is outgoing:
                    assert client is not None
                    try:
                        accepted = client.on_readable()
                    except OSError as e:
                        raise errors.PeerLostError(
                            f"setup of generation {me.generation}: rank {me.rank} -> rank {right}: {e}",
                            rank=me.rank, generation=me.generation, peer=right) from None
                    if accepted:
                        selector.unregister(sock)
                        send_sock, outgoing = sock, None
                else:
                    try:
                        accepted = vetting[sock].on_readable()
                    except _Refused as e:
                        drop(sock, e.reason)
                        continue
                    except (OSError, struct.error):
                        drop(sock, "not the protocol")
                        continue
                    if accepted:  # the left neighbour is here: nobody else may join this ring
                        selector.unregister(sock)
                        recv_sock = vetting.pop(sock).sock
                        selector.unregister(listener)
                        for other in list(vetting):
                            drop(other, "late")
        return _tune(send_sock), _tune(recv_sock)
    except BaseException:
        for leftover in [*vetting, outgoing, send_sock, recv_sock]:
            if leftover is not None:
                leftover.close()
        raise
    finally:
        selector.close()
