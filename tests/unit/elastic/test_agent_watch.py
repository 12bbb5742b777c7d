"""The agent's watch of a running generation names a failure by its cause. A worker whose train_fn raises sends
its error and exits at once: if the exit comes between the agent's read of the channels and its look at the
processes, the failure is still the error, not "exited with code 1" (seen under load in CI at 4 nodes)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from SneppX_ALG.contract import job_object
from SneppX_ALG.elastic import pod
from SneppX_ALG.elastic.agent import (
    AgentSettings,
    NodeAgent,
    OutOfMemory,
    WorkerProcess,
    WorkerState,
    heartbeat_reason,
)
from SneppX_ALG.elastic.heartbeat import PeerStatus
from SneppX_ALG.elastic.rendezvous import RendezvousConfig

# waits for the agent's word, then says its last words and exits, as a worker does when train_fn raises
WORKER = """
import json, os, socket
channel = socket.socket(fileno=int(os.environ["SNEPPX_CONTROL_FD"]))
channel.recv(1 << 16)
channel.sendall(json.dumps({"kind": "error", "generation": 0, "error": "RuntimeError: planted"}).encode() + b"\\n")
os._exit(1)
"""


def settings(root: Path, operator_mode: bool = False) -> AgentSettings:
    return AgentSettings(run_id="watch", agent_id="node-0", host="127.0.0.1", workers=1, elastic_root=str(root),
                         worker_command=[], worker_env={}, operator_mode=operator_mode,
                         rendezvous=RendezvousConfig(last_call=0.0, poll_max=0.05), poll_period=60.0)


def test_a_worker_that_reports_its_error_and_exits_between_two_looks_fails_with_its_error(tmp_path: Path) -> None:
    agent = NodeAgent(settings(tmp_path))
    try:
        membership = agent.rdzv.join()
        worker = WorkerProcess(0)
        worker.spawn([sys.executable, "-c", WORKER], {})
        worker.state = WorkerState.RUNNING
        agent.workers = [worker]
        read = agent._read_workers

        def read_then_the_worker_fails(m: Any, assign: Any) -> Any:
            outcome = read(m, assign)
            if outcome is None and worker.proc is not None and worker.proc.poll() is None:
                worker.send("go")
                worker.proc.wait(10)  # its error is in the channel, and it has exited, before the agent looks
            return outcome

        agent._read_workers = read_then_the_worker_fails  # type: ignore[method-assign]
        outcome = agent._watch(membership, None, {})
        assert outcome.kind == "failure" and "RuntimeError: planted" in outcome.reason, outcome
    finally:
        for w in getattr(agent, "workers", []):
            w.kill()
        agent.heartbeat_socket.close()


@pytest.mark.parametrize(("oom_kills", "expect_oom"), [((0, 1), True), ((0, 0), False), ((None, None), False)])
def test_a_worker_the_oom_killer_took_ends_the_pod_137_and_any_other_sigkill_is_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, oom_kills: tuple[int | None, int | None], expect_oom: bool,
) -> None:
    """A pod's agent whose worker dies of SIGKILL while the container's OOM count rose ends the pod (137,
    OutOfMemory); a SIGKILL from anyone else, or no counter to read, is an ordinary failure retried in the pod.
    The counter is the kernel's (pod.oom_kills, read in tests/node for real): faked here."""
    counts = iter(oom_kills)
    monkeypatch.setattr(pod, "oom_kills", lambda: next(counts))
    monkeypatch.delenv("SNEPPX_RENDEZVOUS_OBJECT", raising=False)  # the records stay in a directory
    agent = NodeAgent(settings(tmp_path, operator_mode=True))
    try:
        membership = agent.rdzv.join()
        worker = WorkerProcess(0)
        worker.spawn([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], {})
        worker.state = WorkerState.RUNNING
        agent.workers = [worker]
        if expect_oom:
            with pytest.raises(OutOfMemory, match="killed by SIGKILL: the kernel's OOM killer"):
                agent._watch(membership, None, {})
        else:
            outcome = agent._watch(membership, None, {})
            assert outcome.kind == "failure" and outcome.reason.endswith("was killed by SIGKILL"), outcome
    finally:
        for w in agent.workers:
            w.kill()
        agent.heartbeat_socket.close()


# says its words at once (each given as JSON in argv), marks that it did, and waits (on "abort": says the rest)
SPEAKER = """
import json, os, socket, sys
channel = socket.socket(fileno=int(os.environ["SNEPPX_CONTROL_FD"]))
now, on_abort, marker = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
channel.sendall(b"".join(json.dumps(m).encode() + b"\\n" for m in now))
open(marker, "w").close()
while channel.recv(1 << 16):
    channel.sendall(b"".join(json.dumps(m).encode() + b"\\n" for m in on_abort))
"""


def speakers(tmp_path: Path, words: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]) -> list[WorkerProcess]:
    """Workers that have said their first words (all of them in their channels) before this returns."""
    made = []
    for local_rank, (now, on_abort) in enumerate(words):
        marker = tmp_path / f"said-{local_rank}"
        w = WorkerProcess(local_rank)
        w.spawn([sys.executable, "-c", SPEAKER, json.dumps(now), json.dumps(on_abort), str(marker)], {})
        w.state, w.generation, w.rank = WorkerState.RUNNING, 0, local_rank
        made.append(w)
        while not marker.exists():  # the process' own word that it wrote them
            assert w.proc is not None and w.proc.poll() is None
            time.sleep(0.01)
    return made


FAILED = {"kind": "failed", "generation": 0, "error": "PeerLostError: rank 1 is gone"}
FATAL = {"kind": "fatal", "generation": 0, "error": "RollbackLimitError: planted"}
IDLE = {"kind": "idle", "generation": 0}


@pytest.mark.parametrize("fatal_rank", [0, 1])
def test_a_fatal_error_read_in_the_same_tick_as_the_failures_it_caused_ends_the_run(tmp_path: Path,
                                                                                    fatal_rank: int) -> None:
    """Suspicion 1 of issue 37, confirmed: a `failed` read first in a tick hid a `fatal` read in the same one
    (the generation was retried, and the fatal error lost)."""
    agent = NodeAgent(settings(tmp_path))
    try:
        membership = agent.rdzv.join()
        agent.workers = speakers(tmp_path, [([FATAL if r == fatal_rank else FAILED], []) for r in range(2)])
        outcome = agent._read_workers(membership, {})
        assert outcome is not None and outcome.kind == "fatal" and "RollbackLimitError: planted" in outcome.reason
    finally:
        for w in agent.workers:
            w.kill()
        agent.heartbeat_socket.close()


def test_a_fatal_error_that_comes_after_its_generation_ended_still_ends_the_run(tmp_path: Path) -> None:
    """...and a `fatal` that came while the generation was being aborted, or after it (read in the next one),
    was dropped as the old generation's last words."""
    agent = NodeAgent(settings(tmp_path))
    try:
        membership = agent.rdzv.join()
        agent.workers = speakers(tmp_path, [([FAILED], [IDLE]), ([], [FATAL, IDLE])])
        agent.s = dataclasses.replace(agent.s, abort_grace=30.0)
        assert agent._read_workers(membership, {}).kind == "failure"  # type: ignore[union-attr]
        agent._abort_workers(membership)
        assert agent.workers[1].fatal is not None and "RollbackLimitError: planted" in agent.workers[1].fatal
        later = dataclasses.replace(membership, generation=1)
        stale = agent._on_message(agent.workers[0], FATAL, later, {})
        assert stale is not None and stale.kind == "fatal"
    finally:
        for w in agent.workers:
            w.kill()
        agent.heartbeat_socket.close()


def test_the_oom_counter_is_read_from_cgroup_v2_or_v1(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "memory.events", tmp_path / "memory.oom_control"
    v2.write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n")
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert pod.oom_kills([str(v2), str(v1)]) == 2
    assert pod.oom_kills([str(tmp_path / "absent"), str(v1)]) == 5
    assert pod.oom_kills([str(tmp_path / "absent")]) is None


def peer(state: str, last_alive: float | None) -> PeerStatus:
    return PeerStatus(peer="", state=state, since=0.0, last_seen=last_alive, last_alive=last_alive, rtt=None,
                      rtt_var=None, probes_sent=0, acks_received=0, pings_received=0, accepted=0, suspicions=1,
                      restarts=0, incarnation=0)


def test_a_heartbeat_failure_tells_a_peer_that_fell_silent_from_one_never_heard_from() -> None:
    """A generation failed at its first contact (a peer that never started beating, or a loaded machine where it
    started late) reads differently from a peer lost mid-run: CI once saw node-0 suspect all three peers."""
    others = {"127.0.0.2:1": "node-1", "127.0.0.3:1": "node-2", "127.0.0.4:1": "node-3"}
    gone = {"127.0.0.2:1": peer("suspected", 0.93), "127.0.0.3:1": peer("suspected", None)}
    assert heartbeat_reason(gone, others, 0) == ("node node-1 fell silent on the heartbeat (last alive 0.9s ago); "
                                                   "node node-2 was never heard from on the heartbeat this generation")
    assert heartbeat_reason({"127.0.0.4:1": peer("confirmed", 2.0)}, others, 3) == (
        "node node-3 fell silent on the heartbeat (last alive 2.0s ago) (3 stalls of this monitor)")


def test_rank_0s_snapshot_placement_reaches_the_jobs_report_and_another_ranks_word_does_not(tmp_path: Path) -> None:
    agent = NodeAgent(settings(tmp_path))
    try:
        membership = agent.rdzv.join()  # node-0 alone: node rank 0, the agent that writes the job's report
        agent.link = pod.JobLink(agent.records, str(tmp_path / "ckpts"), "node-0")

        def said() -> tuple[int, ...] | None:
            stored = agent.records.read(job_object.REPORT_KEY)
            return None if stored is None else job_object.parse_report(stored.value).snapshot_unprotected

        placed = {"kind": "snapshot_placed", "generation": membership.generation, "replicas": 1, "unprotected": [0]}
        assert agent._on_message(WorkerProcess(0), {**placed, "rank": 1}, membership, {}) is None
        assert said() is None  # only rank 0 sees every rank's placement
        assert agent._on_message(WorkerProcess(0), {**placed, "rank": 0}, membership, {}) is None
        assert said() == (0,)
    finally:
        agent.heartbeat_socket.close()
        if agent.link is not None:
            agent.link.close()
