"""A worker whose generation ends while it still builds its process group (a peer never came) keeps its process:
the agent's `abort` ends the setup, the worker reports the generation failed and waits for the next one, as it
does when an abort ends a collective. A real worker process (tests/integration/worker_host.py) on a real control
channel, this test in the agent's place; real sockets and records."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from SneppX_ALG import collectives
from SneppX_ALG.collectives import store as store_lib
from SneppX_ALG.contract.env import ENV_CONTROL_FD
from SneppX_ALG.elastic import control, rendezvous
from SneppX_ALG.records import open_record_store

pytestmark = pytest.mark.timeout(300)

RUN = "run-abort"
HOST = Path(__file__).with_name("worker_host.py")


def member(agent_id: str) -> rendezvous.Member:
    return rendezvous.Member(agent_id, secrets.token_hex(16), "127.0.0.1", "127.0.0.1:29500", 1, time.time())


class Agent:
    """This test as the node agent of one worker process."""

    def __init__(self, tmp_path: Path):
        self.elastic_root = str(tmp_path / "records")
        mine, theirs = socket.socketpair()
        env = {**os.environ, ENV_CONTROL_FD: str(theirs.fileno()), "SNEPPX_HEARTBEAT_KEY": secrets.token_hex(32)}
        self.proc = subprocess.Popen([sys.executable, str(HOST), str(tmp_path / "ckpts"), self.elastic_root, RUN],
                                     pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.channel = control.Channel(mine)

    def assign(self, membership: rendezvous.Membership) -> None:
        self.channel.send("assign", membership=rendezvous.membership_to_json(membership), agent_id="node-0",
                          local_rank=0, restarts=0)

    def wait_for(self, kind: str, timeout: float = 120) -> list[dict[str, Any]]:
        """The worker's messages (beats left out) up to and including the first of `kind`."""
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for message in self.channel.receive(1.0):
                if message["kind"] != "beat":
                    seen.append(message)
                if message["kind"] == kind:
                    return seen
        raise AssertionError(f"no {kind!r} from the worker within {timeout}s; it said {seen}")


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    a = Agent(tmp_path)
    yield a
    if a.proc.poll() is None:
        a.proc.kill()
    a.proc.wait()
    a.channel.close()


def test_an_abort_during_group_setup_ends_the_generation_and_the_worker_keeps_its_process(agent: Agent) -> None:
    agent.wait_for("idle")
    pair = rendezvous.Membership(RUN, 0, (member("node-0"), member("node-1")), "node-0")  # node-1 never comes
    agent.assign(pair)
    # rank 0 is in setup once its address is published: it waits there for rank 1, up to 10 minutes
    train = store_lib.RecordKeyStore(open_record_store(agent.elastic_root), f"comm/{RUN}/{pair.instance}/train")
    train.get(collectives.address_key(0, 0), timeout=120)
    agent.channel.send("abort")
    said = agent.wait_for("idle")
    failed = [m for m in said if m["kind"] == "failed"]
    assert failed and failed[0]["generation"] == 0 and "CollectiveAbortedError" in failed[0]["error"], said
    assert "error" not in {m["kind"] for m in said} and agent.proc.poll() is None  # not replaced: the same process
    # ... which trains the next generation (here a world of one)
    agent.assign(rendezvous.Membership(RUN, 1, (member("node-0"),), "node-0"))
    assert [m["kind"] for m in agent.wait_for("idle")][-2:] == ["done", "idle"]
    agent.channel.send("exit")
    assert agent.proc.wait(60) == 0
