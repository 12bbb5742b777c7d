"""ProcessGroup between real processes on 127.0.0.1: results against numpy, real SIGKILL and SIGSTOP of a rank,
abort from a thread, and hostile connections during setup. The rank bodies live in collective_workers.py."""

from __future__ import annotations

import hmac
import json
import multiprocessing
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import collective_workers as workers
import numpy as np
import pytest
from directory_store import DirectoryStore

from SneppX_ALG import collectives, errors

if TYPE_CHECKING:
    from conftest import Ranks

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("world", range(1, 9))
def test_every_collective_matches_numpy(tmp_path: os.PathLike[str], ranks: Ranks, world: int) -> None:
    for rank in range(world):
        ranks.start(rank, workers.battery, str(tmp_path), rank, world, 24, ranks.results)
    reports = dict(ranks.get() for _ in range(world))
    assert reports == {rank: [] for rank in range(world)}


def start_until_ready(ranks: Ranks, tmp_path: os.PathLike[str], world: int, victim: int, op_timeout: float,
                      *args: str, per_host: int = 0) -> None:
    """Starts `world` ranks running a collective without end (collective_workers.collective_forever, with
    `args`: backend, op; with per_host, that many ranks per "host": SNEPPX_HOST_KEY) and returns once all are
    in it. The victim reports on a queue of its own: a queue's
    writers share a lock, which its feeder thread may still hold for a moment after the parent read its "ready";
    killed or stopped then, it would block every other report (seen once in CI: none for 300 s, {2: -9})."""
    victims_queue = multiprocessing.get_context("spawn").Queue()
    for rank in range(world):
        results = victims_queue if rank == victim else ranks.results
        host = [f"host-{rank // per_host}"] if per_host else []
        ranks.start(rank, workers.collective_forever, str(tmp_path), rank, world, op_timeout, results, *args, *host)
    assert sorted(ranks.get() for _ in range(world - 1)) == [("ready", r) for r in range(world) if r != victim]
    assert victims_queue.get(timeout=300) == ("ready", victim)


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "allgather", "broadcast", "barrier"])
def test_sigkill_of_a_rank_mid_call_fails_every_other_rank_naming_it(tmp_path: os.PathLike[str], ranks: Ranks,
                                                                    op: str) -> None:
    """The deadline is 5 minutes: PeerLostError (not a timeout) shows each survivor heard of the death itself, long
    before it. Ranks 0 and 1 are not the victim's neighbours: they hear of it from a neighbour's notice, and name
    the victim, not the neighbour that told them."""
    world, victim = 5, 2
    start_until_ready(ranks, tmp_path, world, victim, 300.0, "tcp", op)
    os.kill(ranks.processes[victim].pid, signal.SIGKILL)
    reports = sorted(ranks.get() for _ in range(world - 1))
    assert reports == [("failed", r, "PeerLostError", victim) for r in range(world) if r != victim]


def test_sigstop_of_a_rank_times_out_the_others(tmp_path: os.PathLike[str], ranks: Ranks) -> None:
    """A stopped rank keeps its connections open: only the deadline (3 s here) can end the others' wait. The
    first to time out tells the others, who fail with the same error at once."""
    world, victim = 3, 1
    start_until_ready(ranks, tmp_path, world, victim, 3.0)
    os.kill(ranks.processes[victim].pid, signal.SIGSTOP)
    try:
        reports = [ranks.get() for _ in range(world - 1)]
    finally:
        os.kill(ranks.processes[victim].pid, signal.SIGKILL)
    assert sorted(reports) == [("failed", r, "CollectiveTimeoutError", None) for r in range(world) if r != victim]


def test_abort_from_a_thread_ends_the_call_and_the_peer_learns_at_once(tmp_path: os.PathLike[str],
                                                                       ranks: Ranks) -> None:
    """Both calls have a 10-minute deadline, past this test's timeout: only the abort can end them in time."""
    peer_may_go = multiprocessing.get_context("spawn").Event()
    for rank in range(2):
        ranks.start(rank, workers.abort_while_peer_is_away, str(tmp_path), rank, peer_may_go, ranks.results)
    assert ranks.get()[:2] == (0, "CollectiveAbortedError")
    peer_may_go.set()
    assert ranks.get()[:2] == (1, "PeerLostError")


# ---- the same over shared memory (backend="shm": every rank on this host) -------------------------------------


@pytest.mark.parametrize(("hosts", "per_host"), [(2, 2), (2, 3), (3, 2)])
def test_hierarchical_collectives_over_hosts_match_numpy(tmp_path: os.PathLike[str], ranks: Ranks, hosts: int,
                                                         per_host: int) -> None:
    """Ranks with different SNEPPX_HOST_KEY count as different hosts: shared memory inside each, a ring per
    local index between them."""
    world = hosts * per_host
    for rank in range(world):
        ranks.start(rank, workers.battery, str(tmp_path), rank, world, 8, ranks.results, "auto",
                    f"host-{rank // per_host}")
    reports = dict(ranks.get() for _ in range(world))
    assert reports == {rank: [] for rank in range(world)}


@pytest.mark.parametrize("victim", [1, 3])
@pytest.mark.parametrize("op", ["allreduce", "broadcast", "barrier"])
def test_sigkill_of_a_rank_on_one_host_fails_every_rank_of_every_host(tmp_path: os.PathLike[str], ranks: Ranks,
                                                                      op: str, victim: int) -> None:
    """Rank 2 shares no group with the victim (hosts {0, 1} and {2, 3}; rings {0, 2} and {1, 3}): it learns
    because a rank that fails in one group fails its other group too, passing on whom the failure blames (the
    deadline, 30 s, would say CollectiveTimeoutError: every rank stays alive after its failure). Every survivor
    names the victim, whichever victim (before, a rank told by an aborted group named the rank that aborted it:
    a live one, 3 runs of 3)."""
    world = 4
    start_until_ready(ranks, tmp_path, world, victim, 30.0, "auto", op, per_host=2)
    os.kill(ranks.processes[victim].pid, signal.SIGKILL)
    reports = sorted(ranks.get() for _ in range(world - 1))
    assert reports == [("failed", r, "PeerLostError", victim) for r in range(world) if r != victim]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shared_memory_collectives_match_numpy(tmp_path: os.PathLike[str], ranks: Ranks, world: int) -> None:
    for rank in range(world):
        ranks.start(rank, workers.battery, str(tmp_path), rank, world, 12, ranks.results, "shm")
    reports = dict(ranks.get() for _ in range(world))
    assert reports == {rank: [] for rank in range(world)}


SHM_OPS = ["allreduce", "reduce_scatter", "allgather", "broadcast", "barrier"]


@pytest.mark.parametrize("op", SHM_OPS)
def test_sigkill_of_a_rank_over_shared_memory_names_it_on_every_survivor(tmp_path: os.PathLike[str],
                                                                        ranks: Ranks, op: str) -> None:
    """Shared memory closes nothing when a process dies: each survivor learns it from the victim's pidfd, or
    from the first survivor's record of it, and every one names the victim."""
    world, victim = 4, 2
    start_until_ready(ranks, tmp_path, world, victim, 300.0, "shm", op)
    os.kill(ranks.processes[victim].pid, signal.SIGKILL)
    reports = sorted(ranks.get() for _ in range(world - 1))
    assert reports == [("failed", r, "PeerLostError", victim) for r in range(world) if r != victim]


@pytest.mark.parametrize("op", SHM_OPS)
def test_sigstop_of_a_rank_over_shared_memory_times_out_the_others(tmp_path: os.PathLike[str], ranks: Ranks,
                                                                   op: str) -> None:
    world, victim = 3, 1
    start_until_ready(ranks, tmp_path, world, victim, 3.0, "shm", op)
    os.kill(ranks.processes[victim].pid, signal.SIGSTOP)
    try:
        reports = [ranks.get() for _ in range(world - 1)]
    finally:
        os.kill(ranks.processes[victim].pid, signal.SIGKILL)
    # the first to time out ends the rest at once, and every one names the stopped rank
    assert sorted(reports) == [("failed", r, "CollectiveTimeoutError", victim) for r in range(world) if r != victim]


def test_an_abort_over_shared_memory_ends_the_call_and_the_peer_learns_who_left(tmp_path: os.PathLike[str],
                                                                               ranks: Ranks) -> None:
    peer_may_go = multiprocessing.get_context("spawn").Event()
    for rank in range(2):
        ranks.start(rank, workers.abort_while_peer_is_away, str(tmp_path), rank, peer_may_go, ranks.results, "shm")
    assert ranks.get()[:2] == (0, "CollectiveAbortedError")
    peer_may_go.set()
    rank, kind, _, peer = ranks.get()
    assert (rank, kind, peer) == (1, "PeerLostError", 0)


# ---- setup that fails: nothing leaks, nobody waits out the deadline --------------------------------------------


def segment_path(store_dir: os.PathLike[str], nonce_hex: str) -> pathlib.Path:
    """Where the segment of generation 1 with this nonce lives while its name is linked."""
    return pathlib.Path("/dev/shm") / collectives.shm_name(workers.KEY, 1, bytes.fromhex(nonce_hex)).lstrip("/")


def test_a_segment_whose_creator_is_sigkilled_in_setup_is_unlinked_by_the_others(tmp_path: pathlib.Path,
                                                                                 ranks: Ranks) -> None:
    """World 3 over shared memory: rank 2 (played by this test) says where it runs and never comes; rank 0
    creates the segment and waits for it, and is SIGKILLed there. Rank 1, which opened the segment, sees rank 0
    die and fails at once naming it (not at its 30 s deadline), and unlinks the name: once every process has
    exited no 6 MB segment is left in /dev/shm (before, only the creator unlinked it)."""
    store = DirectoryStore(tmp_path)
    store.set(collectives.shm_key(1, "host/2"), json.dumps({"host": collectives.host_identity()}).encode())
    for rank in range(2):
        ranks.start(rank, workers.set_up_once, str(tmp_path), rank, 3, ranks.results, "shm", 30.0,
                    os.environ.get("SNEPPX_HOST_KEY", ""))
    outcome = json.loads(store.get(collectives.shm_key(1, "segment"), timeout=120))
    path = segment_path(tmp_path, outcome["nonce"])
    try:
        assert path.exists()
        os.kill(ranks.processes[0].pid, signal.SIGKILL)
        assert ranks.get() == (1, "PeerLostError", 0, [])
        ranks.processes[1].join(60)
        assert not path.exists(), "the segment leaked"
    finally:
        path.unlink(missing_ok=True)


def test_a_multi_host_setup_whose_store_fails_leaks_no_segment(tmp_path: pathlib.Path, ranks: Ranks) -> None:
    """2 hosts x 2 ranks; publishing a host's segment fails (the store refuses the key). The rank that created
    each segment is the only one that knows its name: it must unlink it before it raises (it did not, and the
    segment outlived every process)."""
    for rank in range(4):
        ranks.start(rank, workers.set_up_once, str(tmp_path), rank, 4, ranks.results, "auto", 5.0,
                    f"host-{rank // 2}", "host-segment")
    reports = {report[0]: report for report in (ranks.get() for _ in range(4))}
    for rank in range(4):
        ranks.processes[rank].join(60)
    creators = {rank: json.loads(reports[rank][3][0])["nonce"] for rank in (0, 2)}
    leaked = [rank for rank, nonce in creators.items() if segment_path(tmp_path, nonce).exists()]
    for nonce in creators.values():
        segment_path(tmp_path, nonce).unlink(missing_ok=True)
    assert [reports[rank][1] for rank in (0, 2)] == ["StoreError", "StoreError"], reports
    assert leaked == []


@pytest.mark.parametrize("refused", [(1,), (0, 1)])
@pytest.mark.parametrize("backend", ["auto", "shm"])
def test_a_host_whose_segment_is_refused_means_the_ring_or_one_typed_error_on_every_rank(
        tmp_path: pathlib.Path, ranks: Ranks, backend: str, refused: tuple[int, ...]) -> None:
    """2 hosts x 2 ranks (SNEPPX_HOST_KEY); on the `refused` hosts no rank may make a file over 1 MiB, so the
    host's segment fails with EFBIG. Every host publishes its outcome and every rank reads them all: "auto" goes
    on over the ring on every rank (a host whose segment was made unlinks it), "shm" fails on every rank with
    the single-host path's error, a collectives failure (the worker's "failed", not "train_fn raised"). Before,
    the refused host's creator raised StorageError ("File too large"), and the other host's ranks waited out
    their 60 s deadline in the ring between hosts (CollectiveTimeoutError)."""
    world = 4
    for rank in range(world):
        ranks.start(rank, workers.set_up_refused, str(tmp_path), rank, world, ranks.results, backend,
                    f"host-{rank // 2}", rank // 2 in refused)
    reports = {report[0]: report[1:] for report in (ranks.get() for _ in range(world))}
    for rank in range(world):
        ranks.processes[rank].join(60)
    store = DirectoryStore(tmp_path)
    published = [json.loads(store.get(collectives.shm_key(1, f"host-segment/{h}"), 0)) for h in (0, 1)]
    left = [h for h, record in enumerate(published) if "nonce" in record
            and segment_path(tmp_path, record["nonce"]).exists()]
    for record in published:
        if "nonce" in record:
            segment_path(tmp_path, record["nonce"]).unlink(missing_ok=True)
    if backend == "auto":
        assert reports == {rank: ("ok", "tcp", [10.0] * 4) for rank in range(world)}, reports
    else:
        creator = 2 * refused[0]  # the first host that failed: every rank names its segment's creator
        assert {rank: report[:2] for rank, report in reports.items()} == \
            {rank: ("CommProtocolError", creator) for rank in range(world)}, reports
        assert all("File too large" in report[2] and "backend 'shm'" in report[2] for report in reports.values())
    assert left == [], f"the segment of host(s) {left} outlived every rank"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a read-only /dev/shm needs a mount namespace (root)")
def test_a_read_only_dev_shm_means_the_ring_for_auto(tmp_path: pathlib.Path) -> None:
    """Two ranks in a mount namespace whose /dev/shm is a read-only tmpfs: rank 0 can't create the segment
    (EROFS), publishes that the group uses the ring, and both compute there (before, rank 0 raised without
    publishing anything, and rank 1 waited out its deadline)."""
    store_dir, world = tmp_path / "store", 2
    ranks_command = " & ".join(
        f"{sys.executable} {workers.__file__} {tmp_path / f'rank-{rank}.json'} {store_dir} {rank} {world} '' 127.0.0.1"
        for rank in range(world))
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           f"mount -t tmpfs -o ro,size=1m tmpfs /dev/shm || exit 1; {ranks_command} & wait"],
                          check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    reports = {rank: json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(world)}
    assert reports == {rank: [rank, []] for rank in range(world)}


def handshake_as(address: tuple[str, int], key: bytes, generation: int, rank: int, world: int,
                 *, answer_with: bytes | None = None) -> bytes:
    """Plays a client of the documented handshake against a listener; returns what the listener sent last
    (a verdict), or b"" when it closed the connection instead."""
    with socket.create_connection(address, timeout=60) as sock:
        hello = collectives.HELLO.pack(collectives.HELLO_MAGIC, collectives.PROTOCOL_VERSION, 0, generation, rank,
                                       world, 1 << 20, secrets.token_bytes(32))
        sock.sendall(hello)
        challenge = b""
        while len(challenge) < collectives.CHALLENGE_HEAD.size + collectives.MAC_BYTES:
            challenge += sock.recv(200)
        head = challenge[:collectives.CHALLENGE_HEAD.size]
        mac = answer_with or hmac.new(key, collectives.CLIENT_LABEL + hello + head, "sha256").digest()
        sock.sendall(collectives.RESPONSE.pack(collectives.RESPONSE_MAGIC, mac))
        return b"" if closed_by_peer(sock) else sock.recv(100)


def closed_by_peer(sock: socket.socket) -> bool:
    """True when the other end closed (FIN, or RST because our bytes went unread); False if data is waiting."""
    try:
        return sock.recv(100, socket.MSG_PEEK) == b""
    except ConnectionResetError:
        return True


def test_foreign_stale_and_garbage_connections_are_refused_and_the_group_forms(tmp_path: os.PathLike[str],
                                                                               ranks: Ranks) -> None:
    """Rank 0 of a world of 2 (generation 1) is started alone; while it waits for rank 1, this test connects to
    its listener with garbage, a wrong key, the right key from generation 0, and a connection that never speaks.
    Then rank 1 starts: the group forms and computes as if nothing had happened."""
    ranks.start(0, workers.allreduce_once, str(tmp_path), 0, 2, ranks.results)
    address = json.loads(DirectoryStore(tmp_path).get(collectives.address_key(1, 0), timeout=120))
    listener = (address["host"], address["port"])
    with socket.create_connection(listener, timeout=60) as garbage:
        garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64))
        assert closed_by_peer(garbage)
    assert handshake_as(listener, workers.KEY, 1, 1, 2, answer_with=secrets.token_bytes(32)) == b""
    stale = handshake_as(listener, workers.KEY, 0, 1, 2)
    assert collectives.VERDICT.unpack(stale) == (collectives.VERDICT_MAGIC, collectives.STALE_GENERATION)
    silent = socket.create_connection(listener, timeout=60)
    try:
        ranks.start(1, workers.allreduce_once, str(tmp_path), 1, 2, ranks.results)
        reports = {rank: (result, refused) for rank, result, refused in (ranks.get(), ranks.get())}
    finally:
        silent.close()
    assert reports[1] == ([3.0] * 8, {})
    assert reports[0] == ([3.0] * 8, {"not the protocol": 1, "wrong key": 1, "stale generation": 1, "late": 1})


def test_a_listener_without_the_key_is_not_trusted(tmp_path: os.PathLike[str]) -> None:
    """The challenge is mutual: a rank refuses to send its data to an address whose listener can't prove the key
    (here, a listener that answers with random bytes where the proof goes)."""
    with socket.socket() as impostor:
        impostor.bind(("127.0.0.1", 0))
        impostor.listen(1)
        host, port = impostor.getsockname()
        s = DirectoryStore(tmp_path)
        s.set(collectives.address_key(1, 1), json.dumps({"host": host, "port": port}).encode())

        def answer() -> None:
            conn, _ = impostor.accept()
            with conn:
                conn.recv(collectives.HELLO.size)
                conn.sendall(collectives.CHALLENGE_HEAD.pack(collectives.CHALLENGE_MAGIC, 1, 1, bytes(32))
                             + secrets.token_bytes(32))
                conn.recv(100)

        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(errors.CommAuthError, match="does not prove"):
            collectives.ProcessGroup(s, 0, 2, 1, key=workers.KEY, timeout=60, backend="tcp")


def test_an_abort_during_setup_ends_it_and_the_process_forms_the_next_group(tmp_path: os.PathLike[str],
                                                                           ranks: Ranks) -> None:
    """Rank 0 of a world of 2 waits for rank 1, which never comes, with a 10-minute deadline: only the abort (set
    from another thread, as the worker's control thread does when its agent ends the generation) can end the
    setup within this test's timeout. It raises what an aborted collective raises, its listener is closed, and
    the same process then forms the next group with a real peer."""
    aborted = threading.Event()
    outcome: list[BaseException | None] = []

    def set_up() -> None:
        try:
            workers.connect(str(tmp_path), 0, 2, timeout=600, aborted=aborted).close()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            outcome.append(e)

    setup = threading.Thread(target=set_up, daemon=True)
    setup.start()
    address = json.loads(DirectoryStore(tmp_path).get(collectives.address_key(1, 0), timeout=120))
    aborted.set()  # rank 0 is in setup: it published its address and waits for rank 1
    setup.join(120)
    assert not setup.is_alive() and len(outcome) == 1, "the abort did not end the setup"
    error = outcome[0]
    assert isinstance(error, errors.CollectiveAbortedError), repr(error)
    assert (error.rank, error.generation) == (0, 1) and "setup of generation 1" in str(error)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((address["host"], address["port"]), timeout=60).close()
    following = os.path.join(tmp_path, "next")
    ranks.start(1, workers.allreduce_once, following, 1, 2, ranks.results)
    with workers.connect(following, 0, 2, timeout=120) as group:
        data = np.full(8, 1.0)
        group.allreduce(data)
    assert data.tolist() == [3.0] * 8
    assert ranks.get()[:2] == (1, [3.0] * 8)


def test_an_abort_ends_an_nccl_rank_waiting_for_rank_0s_id(tmp_path: os.PathLike[str]) -> None:
    """Rank 1 of an NCCL group waits in the store for rank 0's unique id (which never comes) before NCCL is
    touched: the abort ends that wait too (no GPU needed to get this far)."""
    aborted = threading.Event()
    timer = threading.Timer(0.2, aborted.set)
    timer.start()
    try:
        with pytest.raises(errors.CollectiveAbortedError, match="setup of generation 3"):
            collectives.ProcessGroup(DirectoryStore(tmp_path), 1, 2, 3, backend="nccl", timeout=600,
                                     aborted=aborted)
    finally:
        timer.cancel()


# ---- two hosts for real: two network namespaces joined by a veth pair --------------------------------------------


@pytest.fixture
def two_hosts() -> Iterator[list[tuple[str, str]]]:
    """Two network namespaces joined by a veth pair, 10.77.<n>.1 and .2 (addresses inside namespaces this test
    creates; nothing leaves the machine); yields [(namespace, address)] for each "host", removes them after."""
    tag = f"sx{os.getpid() % 100000}"
    hosts = [(f"{tag}a", f"10.77.{os.getpid() % 250}.1"), (f"{tag}b", f"10.77.{os.getpid() % 250}.2")]
    commands = [["ip", "netns", "add", hosts[0][0]], ["ip", "netns", "add", hosts[1][0]],
                ["ip", "link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb"]]
    for (namespace, address), link in zip(hosts, (f"{tag}va", f"{tag}vb"), strict=True):
        commands += [["ip", "link", "set", link, "netns", namespace],
                     ["ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", link],
                     ["ip", "-n", namespace, "link", "set", link, "up"],
                     ["ip", "-n", namespace, "link", "set", "lo", "up"]]
    try:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True, timeout=60)
        yield hosts
    finally:
        for namespace, _ in hosts:  # the veth pair goes with them
            subprocess.run(["ip", "netns", "delete", namespace], check=False, capture_output=True, timeout=60)


@pytest.mark.skipif(os.geteuid() != 0, reason="creating network namespaces needs root")
def test_hierarchical_collectives_between_two_network_namespaces(tmp_path: pathlib.Path,
                                                                 two_hosts: list[tuple[str, str]]) -> None:
    """2 hosts x 2 ranks: shared memory inside each namespace, the rings between them over the veth pair (each
    rank listens on its namespace's address, which the other namespace reaches only through the veth)."""
    store_dir, world = tmp_path / "store", 4
    processes = []
    for rank in range(world):
        namespace, address = two_hosts[rank // 2]
        processes.append(subprocess.Popen(
            ["ip", "netns", "exec", namespace, sys.executable, workers.__file__, str(tmp_path / f"rank-{rank}.json"),
             str(store_dir), str(rank), str(world), namespace, address]))
    for p in processes:
        assert p.wait(timeout=600) == 0
    reports = {rank: json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(world)}
    assert reports == {rank: [rank, []] for rank in range(world)}
