"""The agent's watch of a running generation names a failure by its cause. A worker whose train_fn raises sends
its error and exits at once: if the exit comes between the agent's read of the channels and its look at the
processes, the failure is still the error, not "exited with code 1" (seen under load in CI at 4 nodes)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from SneppX_ALG.elastic.agent import AgentSettings, NodeAgent, WorkerProcess
from SneppX_ALG.elastic.rendezvous import RendezvousConfig

# waits for the agent's word, then says its last words and exits, as a worker does when train_fn raises
WORKER = """
import json, os, socket
channel = socket.socket(fileno=int(os.environ["SNEPPX_CONTROL_FD"]))
channel.recv(1 << 16)
channel.sendall(json.dumps({"kind": "error", "generation": 0, "error": "RuntimeError: planted"}).encode() + b"\\n")
os._exit(1)
"""


def test_a_worker_that_reports_its_error_and_exits_between_two_looks_fails_with_its_error(tmp_path: Path) -> None:
    settings = AgentSettings(run_id="watch", agent_id="node-0", host="127.0.0.1", workers=1,
                             elastic_root=str(tmp_path), worker_command=[], worker_env={},
                             rendezvous=RendezvousConfig(last_call=0.0, poll_max=0.05), poll_period=60.0)
    agent = NodeAgent(settings)
    try:
        membership = agent.rdzv.join()
        worker = WorkerProcess(0)
        worker.spawn([sys.executable, "-c", WORKER], {})
        worker.state = "running"
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
