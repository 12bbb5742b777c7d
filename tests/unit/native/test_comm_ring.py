"""The TCP ring of native/src/comm.c through its wrapper (`_native.Comm`), with the ranks as threads of this
process on socketpairs (cffi releases the GIL, so they really run at once), and the test itself playing a peer
where a peer must misbehave. Real processes and real signals are in tests/integration/test_collectives.py."""

from __future__ import annotations

import itertools
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from ranks_on_threads import NUMPY_OPS, inputs, run_ranks

from SneppX_ALG import _native, errors

HEADER = struct.Struct("<IBBHQQII")  # docs/ELASTIC.md, "Frames": magic, op, flags, reserved, generation, seq, step, length
OP_ALLREDUCE, OP_BROADCAST, OP_NOTICE = 1, 4, 0x7F
EPEER, EPROTO = 15, 18  # a notice's flags byte: the failure's status, negated (sneppx.h)


def make_ring(world: int, generation: int = 7, chunk_bytes: int = 0) -> list[_native.Comm]:
    links = [socket.socketpair() for _ in range(world)]  # link r carries rank r -> rank r+1
    comms = []
    for rank in range(world):
        if world == 1:
            comms.append(_native.Comm(0, 1, generation, chunk_bytes=chunk_bytes))
            continue
        send = links[rank][0].detach()
        recv = links[(rank - 1) % world][1].detach()
        comms.append(_native.Comm(rank, world, generation, send, recv, chunk_bytes))
    for a, b in links:
        a.close()
        b.close()
    return comms


@given(count=st.integers(0, 2**64 - 1), world=st.integers(1, 65536), data=st.data())
def test_shard_range_is_floor_of_count_times_rank_over_world(count: int, world: int, data: Any) -> None:
    rank = data.draw(st.integers(0, world - 1))
    assert _native.shard_range(count, world, rank) == (count * rank // world, count * (rank + 1) // world)


@pytest.mark.parametrize("world", range(1, 9))
def test_allreduce_matches_numpy_for_every_size_dtype_and_op(world: int) -> None:
    comms = make_ring(world, chunk_bytes=4096)  # small frames: many per step, so the pipelining is exercised
    cases = [(count, dtype, op) for count in (0, 1, 2, world - 1, world + 1, 1001, 100_003)
             for dtype in _native.REDUCE_DTYPES for op in ("sum", "max", "min")]
    buffers = {}
    for i, (count, dtype, _op) in enumerate(cases):
        buffers[i] = inputs(world, count, dtype, seed=1000 * world + i)
    outputs = {i: [b.copy() for b in buffers[i]] for i in buffers}

    def body(rank: int, comm: _native.Comm) -> None:
        for i, (count, dtype, op) in enumerate(cases):
            comm.allreduce(outputs[i][rank], count, dtype, op, 60)

    assert run_ranks(comms, body) == [None] * world
    for i, (count, dtype, op) in enumerate(cases):
        expected = NUMPY_OPS[op](np.stack(buffers[i]), axis=0) if count else np.zeros(0, dtype)
        for rank in range(world):
            # Every rank ends with the same bits; the sum is numpy's up to float rounding (another order).
            assert np.array_equal(outputs[i][rank], outputs[i][0]), (count, dtype, op, rank)
            if dtype.startswith("int") or op != "sum":
                assert np.array_equal(outputs[i][rank], expected), (count, dtype, op, rank)
            else:
                np.testing.assert_allclose(outputs[i][rank], expected, rtol=1e-5, atol=1e-5)
    for comm in comms:
        comm.close()


@pytest.mark.parametrize("world", [2, 3, 5])
def test_reduce_scatter_allgather_broadcast_and_barrier(world: int) -> None:
    comms = make_ring(world, chunk_bytes=64)
    count = 37
    data = inputs(world, count, "float64", seed=world)
    scattered = [d.copy() for d in data]
    gathered = [np.full(count, -1.0) for _ in range(world)]
    truth = np.arange(count, dtype=np.float64)
    for rank in range(world):
        start, stop = _native.shard_range(count, world, rank)
        gathered[rank][start:stop] = truth[start:stop]
    broadcasts = {root: [np.frombuffer(bytes([root]) * 300 if r == root else bytes(300), np.uint8).copy()
                         for r in range(world)] for root in range(world)}

    def body(rank: int, comm: _native.Comm) -> None:
        comm.reduce_scatter(scattered[rank], count, "float64", "sum", 60)
        comm.allgather(gathered[rank], count, "float64", 60)
        for root in range(world):
            comm.broadcast(broadcasts[root][rank], root, 60)
        comm.barrier(60)

    assert run_ranks(comms, body) == [None] * world
    total = np.sum(np.stack(data), axis=0)
    for rank in range(world):
        start, stop = _native.shard_range(count, world, rank)
        np.testing.assert_allclose(scattered[rank][start:stop], total[start:stop], rtol=1e-12)
        assert np.array_equal(gathered[rank], truth)
        for root in range(world):
            assert set(broadcasts[root][rank].tolist()) == {root}
    for comm in comms:
        comm.close()


# ---- the test plays rank 1 of a world of 2 ---------------------------------------------------------------------


class Peer:
    """Rank 0's comm, with the test holding the other ends: `frames_in` receives what rank 0 sends (the test is
    rank 1), `out` is where the test writes what rank 0 receives (the test is rank world - 1)."""

    def __init__(self, generation: int = 5, chunk_bytes: int = 1 << 20, world: int = 2):
        to_peer, self.frames_in = socket.socketpair()
        self.out, from_peer = socket.socketpair()
        self.comm = _native.Comm(0, world, generation, to_peer.detach(), from_peer.detach(), chunk_bytes)
        self.generation = generation

    def call_in_thread(self, fn: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
        raised: list[BaseException] = []

        def body() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001
                raised.append(e)

        thread = threading.Thread(target=body)
        thread.start()
        return thread, raised

    def close(self) -> None:
        self.comm.close()
        self.frames_in.close()
        self.out.close()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = sock.recv(n - len(data))
        assert more, "rank 0 closed the connection"
        data += more
    return data


def drain_to_end(sock: socket.socket) -> None:
    """Reads what rank 0 sent until the end of the stream (a timeout here means it never shut the socket)."""
    sock.settimeout(60)
    while sock.recv(1 << 16):
        pass


def test_frames_carry_the_documented_header() -> None:
    peer = Peer(generation=5)
    values = np.arange(4, dtype=np.float32)
    thread, raised = peer.call_in_thread(lambda: peer.comm.allreduce(values, 4, "float32", "sum", 60))
    header = HEADER.unpack(recv_exactly(peer.frames_in, HEADER.size))
    # step 0 of a ring allreduce: rank 0 sends segment r-1 = segment 1 = elements 2..3
    assert header == (_native.COMM_MAGIC, OP_ALLREDUCE, 0, 0, 5, 1, 0, 8)
    assert np.frombuffer(recv_exactly(peer.frames_in, 8), np.float32).tolist() == [2.0, 3.0]
    peer.out.sendall(HEADER.pack(_native.COMM_MAGIC, OP_ALLREDUCE, 0, 0, 5, 1, 0, 8))
    peer.out.sendall(np.array([10, 20], np.float32).tobytes())  # rank 1's elements 0..1
    # step 1 (allgather): rank 0 sends its reduced segment 0, then receives segment 1 reduced by rank 1
    assert HEADER.unpack(recv_exactly(peer.frames_in, HEADER.size)) == (
        _native.COMM_MAGIC, OP_ALLREDUCE, 0, 0, 5, 1, 1, 8)
    assert np.frombuffer(recv_exactly(peer.frames_in, 8), np.float32).tolist() == [10.0, 21.0]
    peer.out.sendall(HEADER.pack(_native.COMM_MAGIC, OP_ALLREDUCE, 0, 0, 5, 1, 1, 8))
    peer.out.sendall(np.array([7, 8], np.float32).tobytes())
    thread.join(60)
    assert not raised
    assert values.tolist() == [10.0, 21.0, 7.0, 8.0]
    peer.close()


@pytest.mark.parametrize(("header", "error"), [
    ((_native.COMM_MAGIC, OP_ALLREDUCE, 0, 0, 4, 1, 0, 8), errors.StaleGenerationError),   # generation 4, not 5
    ((0xDEADBEEF, OP_ALLREDUCE, 0, 0, 5, 1, 0, 8), errors.CommProtocolError),              # not the magic
    ((_native.COMM_MAGIC, OP_BROADCAST, 0, 0, 5, 1, 0, 8), errors.CommProtocolError),      # another collective
    ((_native.COMM_MAGIC, OP_ALLREDUCE, 0, 0, 5, 2, 0, 8), errors.CommProtocolError),      # another call
    ((_native.COMM_MAGIC, OP_ALLREDUCE, 0, 0, 5, 1, 0, 12), errors.CommProtocolError),     # another length
])
def test_a_bad_frame_fails_the_call_with_its_typed_error(header: tuple[int, ...], error: type[Exception]) -> None:
    peer = Peer(generation=5)
    values = np.zeros(4, np.float32)
    thread, raised = peer.call_in_thread(lambda: peer.comm.allreduce(values, 4, "float32", "sum", 60))
    peer.out.sendall(HEADER.pack(*header) + bytes(8))
    thread.join(60)
    assert len(raised) == 1 and isinstance(raised[0], error), raised
    assert raised[0].peer == 1 and raised[0].generation == 5
    # the failure shut the connection, so the neighbour learns at once, and the comm fails from now on
    drain_to_end(peer.frames_in)
    with pytest.raises(errors.CollectiveAbortedError):
        peer.comm.barrier(60)
    peer.close()


def test_peer_closing_mid_call_is_peer_lost() -> None:
    peer = Peer()
    values = np.zeros(1 << 20, np.float32)
    thread, raised = peer.call_in_thread(lambda: peer.comm.allreduce(values, values.size, "float32", "sum", 600))
    recv_exactly(peer.frames_in, HEADER.size)
    peer.out.close()
    peer.frames_in.close()
    thread.join(120)
    assert len(raised) == 1 and isinstance(raised[0], errors.PeerLostError), raised
    peer.comm.close()


def test_silent_peer_times_out() -> None:
    peer = Peer()
    with pytest.raises(errors.CollectiveTimeoutError):
        peer.comm.allreduce(np.zeros(8, np.float64), 8, "float64", "sum", 0.3)
    peer.close()


@pytest.mark.timeout(120)
def test_abort_from_another_thread_ends_a_call_at_once() -> None:
    """The call's own deadline is 10 minutes, past this test's timeout: only abort() can end it in time."""
    peer = Peer()
    thread, raised = peer.call_in_thread(lambda: peer.comm.barrier(600))
    threading.Timer(0.2, peer.comm.abort).start()
    thread.join(100)
    assert len(raised) == 1 and isinstance(raised[0], errors.CollectiveAbortedError), raised
    drain_to_end(peer.frames_in)  # the abort shut the socket: the neighbour sees it at once
    with pytest.raises(errors.CollectiveAbortedError):
        peer.comm.barrier(600)
    peer.close()


def test_arguments_are_checked_before_c() -> None:
    comm = make_ring(1)[0]
    with pytest.raises(ValueError, match="dtype"):
        comm.allreduce(np.zeros(4, np.float16), 4, "float16", "sum", 1)
    with pytest.raises(ValueError, match="do not fit"):
        comm.allreduce(np.zeros(4, np.float32), 5, "float32", "sum", 1)
    with pytest.raises(ValueError):
        comm.allreduce(np.zeros(4, np.float32), 4, "float32", "sum", 0)  # every call needs a deadline
    comm.close()
    with pytest.raises(errors.CollectiveAbortedError, match="closed"):
        comm.barrier(1)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_shift_sends_to_the_right_and_receives_from_the_left_whatever_each_sends(world: int) -> None:
    comms = make_ring(world, chunk_bytes=64)  # several frames a message
    sizes = [0 if r == 1 else 100 * r + 7 for r in range(world)]  # uneven, one rank sends nothing
    sent = [np.full(sizes[r], r + 1, np.uint8) for r in range(world)]
    got = [np.zeros(sizes[(r - 1) % world], np.uint8) for r in range(world)]

    def body(rank: int, comm: _native.Comm) -> None:
        comm.shift(sent[rank], got[rank], 60)
        comm.barrier(60)  # the ring stays in step after it

    assert run_ranks(comms, body) == [None] * world
    for rank in range(world):
        left = (rank - 1) % world
        assert np.array_equal(got[rank], np.full(sizes[left], left + 1, np.uint8))


# ---- who died: notices --------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["allreduce", "reduce_scatter", "allgather", "broadcast", "barrier", "shift"])
def test_every_survivor_names_the_rank_that_died_not_the_neighbour_that_told_it(call: str) -> None:
    """Rank 2 of 5 closes its sockets (as a killed process's close) while the others are in the middle of calls
    without end. Its neighbours see it go; ranks 0 and 4 only hear of it from them, and must name rank 2."""
    world, dead = 5, 2
    comms = make_ring(world, chunk_bytes=4096)  # many frames a call: the failure lands mid-frame
    data = [np.ones(1 << 16, np.float32) for _ in range(world)]
    into = [np.zeros(1 << 18, np.uint8) for _ in range(world)]
    calls = {"allreduce": lambda c, d, _: c.allreduce(d, d.size, "float32", "sum", 60),
             "reduce_scatter": lambda c, d, _: c.reduce_scatter(d, d.size, "float32", "max", 60),
             "allgather": lambda c, d, _: c.allgather(d, d.size, "float32", 60),
             "broadcast": lambda c, d, _: c.broadcast(d, 1, 60),
             "barrier": lambda c, d, _: c.barrier(60),
             "shift": lambda c, d, got: c.shift(d, got, 60)}

    def body(rank: int, comm: _native.Comm) -> None:
        for done in itertools.count():
            if rank == dead and done == 20:
                comm.close()
                return
            calls[call](comm, data[rank], into[rank])

    results = run_ranks(comms, body)
    assert results[dead] is None
    survivors = {rank: results[rank] for rank in range(world) if rank != dead}
    assert all(isinstance(e, errors.PeerLostError) and e.peer == dead for e in survivors.values()), survivors
    for comm in comms:
        comm.close()


def notice(peer: int, status: int = EPEER, generation: int = 5) -> bytes:
    return HEADER.pack(_native.COMM_MAGIC, OP_NOTICE, status, 0, generation, 1, peer & 0xFFFFFFFF, 0)


def read_notice(sock: socket.socket) -> tuple[int, ...]:
    """The notice at the end of what rank 0 sent on `sock`, whatever frames came before it."""
    drain = b""
    sock.settimeout(60)
    while more := sock.recv(1 << 16):
        drain += more
    return HEADER.unpack(drain[-HEADER.size:])


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_notice_from_either_neighbour_is_taken_and_passed_on_both_ways(side: str) -> None:
    """Rank 0 of 4; the test is rank 1 (right) and rank 3 (left). A notice that rank 2 is lost, from either side,
    ends rank 0's call with PeerLostError naming rank 2, and rank 0 tells both neighbours the same."""
    peer = Peer(generation=5, world=4, chunk_bytes=64)
    values = np.zeros(1 << 12, np.float32)
    thread, raised = peer.call_in_thread(lambda: peer.comm.allreduce(values, values.size, "float32", "sum", 60))
    recv_exactly(peer.frames_in, HEADER.size)  # rank 0 is in the call
    (peer.out if side == "left" else peer.frames_in).sendall(notice(2))
    thread.join(60)
    assert len(raised) == 1 and isinstance(raised[0], errors.PeerLostError) and raised[0].peer == 2, raised
    told = (_native.COMM_MAGIC, OP_NOTICE, EPEER, 0, 5)
    to_right, to_left = read_notice(peer.frames_in), read_notice(peer.out)
    assert to_right[:5] == told and to_right[6:] == (2, 0), to_right
    assert to_left[:5] == told and to_left[6:] == (2, 0), to_left
    peer.close()


@pytest.mark.parametrize(("bad", "error"), [
    (notice(4), errors.CommProtocolError),                 # no rank 4 in a world of 4
    (notice(2, status=99), errors.CommProtocolError),      # no such failure
    (notice(2, generation=4), errors.StaleGenerationError),
])
def test_a_notice_of_nothing_this_group_knows_blames_its_sender(bad: bytes, error: type[Exception]) -> None:
    peer = Peer(generation=5, world=4)
    values = np.zeros(8, np.float32)
    thread, raised = peer.call_in_thread(lambda: peer.comm.allreduce(values, values.size, "float32", "sum", 60))
    recv_exactly(peer.frames_in, HEADER.size)
    peer.out.sendall(bad)
    thread.join(60)
    assert len(raised) == 1 and isinstance(raised[0], error) and raised[0].peer == 3, raised
    peer.close()


# ---- relays: a failure of an enclosing group (the hierarchical path's rings), passed on with its blame ---------


RELAYED = [errors.PeerLostError, errors.CollectiveTimeoutError, errors.StaleGenerationError, errors.CommProtocolError]


@pytest.mark.parametrize("kind", RELAYED)
@pytest.mark.parametrize("outer", [None, 0, 9, 65535])
def test_a_relayed_failure_reaches_every_rank_with_the_outer_blame(kind: type[errors.CollectiveError],
                                                                   outer: int | None) -> None:
    """Rank 0 of 4, between calls, relays a failure its enclosing group blames on `outer`; ranks 1-3, in a
    barrier (ranks 1 and 3 next to it, rank 2 told by them), raise the same kind and report the same outer rank,
    not rank 0 (an abort, which the relay used to be, made them name rank 0)."""
    comms = make_ring(4)

    def body(rank: int, comm: _native.Comm) -> Any:
        if rank == 0:
            return comm.relay(kind("elsewhere", rank=0, generation=7), outer)
        comm.barrier(60)
        return None

    results = run_ranks(comms, body)
    assert results[0] is True
    assert all(isinstance(e, kind) and e.peer is None for e in results[1:]), results
    assert [c.failed_outer() for c in comms] == [outer] * 4
    assert not comms[0].relay(errors.CollectiveAbortedError("mine", rank=0, generation=7), 3)
    for comm in comms:
        comm.close()
