"""An ElasticTrainer run watched and struck from outside: its agents' event files read as they are written, the
recovery from a kill read out of them, and its agents and workers found (and a node killed) by the variables the
launcher sets in their environment.

Why a module of its own: `python -m bench elastic` watches and strikes runs the same way (tests too), without the
demo's scenes or its display.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

from SneppX_ALG.contract.env import ENV_AGENT_ID, ENV_LOCAL_RANK, ENV_ROLE, ENV_RUN_ID


class EventLog:
    """An ElasticTrainer run's events, read as its agents append them (`<agent>.events.jsonl` in one directory).
    `poll()` returns the complete lines written since the last call; `events` holds them all."""

    def __init__(self, directory: str):
        self.directory = directory
        self.events: list[dict[str, Any]] = []
        self._read: dict[str, int] = {}  # bytes consumed per file

    def poll(self) -> list[dict[str, Any]]:
        new = []
        for name in sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else []:
            if not name.endswith(".events.jsonl"):
                continue
            with open(os.path.join(self.directory, name), "rb") as f:
                f.seek(self._read.get(name, 0))
                chunk = f.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]  # a line being written is read next time
            self._read[name] = self._read.get(name, 0) + len(complete)
            new += [json.loads(line) for line in complete.splitlines() if line.strip()]
        new.sort(key=lambda e: e["t"])
        self.events += new
        return new


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One failure as the events tell it: seconds from the kill to each step of the recovery, and the steps
    redone (rank 0's newest step before the kill minus the step the next generation restored)."""

    detected: float  # the first failure an agent recorded
    sealed: float  # the next generation's membership
    resumed: float  # rank 0 finished the next generation's first step
    world_size: int  # of that generation
    lost_steps: int
    reason: str  # what the first agent to notice saw
    source: str = "storage"  # where the next generation restored from: "memory" (peer-memory snapshots) or storage
    why: str = ""  # why storage, when snapshots were on


def recovery_after(events: Sequence[dict[str, Any]], killed_at: float) -> Recovery | None:
    """The recovery from a kill at `killed_at` (time.time()), or None while it is not over (or never began)."""
    def first(kind: str, **match: Any) -> dict[str, Any] | None:
        return next((e for e in events if e["kind"] == kind and e["t"] >= killed_at
                     and all(e.get(k) == v for k, v in match.items())), None)

    before = [e for e in events if e["t"] < killed_at]
    generation = max((e["generation"] for e in before if e["kind"] == "generation"), default=-1)
    failure = first("failure")
    sealed = next((e for e in events if e["kind"] == "generation" and e["t"] >= killed_at
                   and e["generation"] > generation), None)
    if failure is None or sealed is None:
        return None
    restored = first("restored", generation=sealed["generation"])
    resumed = first("step", generation=sealed["generation"])
    if restored is None or resumed is None:
        return None
    last_step = max((e["step"] for e in before if e["kind"] == "step"), default=0)
    return Recovery(detected=failure["t"] - killed_at, sealed=sealed["t"] - killed_at,
                    resumed=resumed["t"] - killed_at, world_size=sealed["world_size"],
                    lost_steps=last_step - (restored["step"] or 0), reason=failure["reason"],
                    source=restored.get("source", "storage"), why=restored.get("why", ""))


def run_processes(run_id: str) -> list[tuple[int, str, str, str]]:
    """(pid, role, agent id, local rank) of the live agents and workers of run `run_id` on this machine, found
    by the variables the launcher and the agents set in their environment."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                raw = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue  # gone, or not ours
        env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        if env.get(ENV_RUN_ID.encode()) != run_id.encode() or ENV_ROLE.encode() not in env or state == b"Z":
            continue
        found.append((int(entry), env[ENV_ROLE.encode()].decode(), env.get(ENV_AGENT_ID.encode(), b"").decode(),
                      env.get(ENV_LOCAL_RANK.encode(), b"").decode()))
    return sorted(found)


def kill_node(run_id: str, agent_id: str, sig: int = signal.SIGKILL) -> float:
    """Signals a whole node: its agent's process group (the launcher starts each agent in a session of its
    own), which holds the agent and its workers. Returns the time.time() of the signal, taken just before it:
    a peer can notice a SIGKILL within microseconds, before a clock read after the kill."""
    agent_pid = next(pid for pid, role, agent, _ in run_processes(run_id) if role == "agent" and agent == agent_id)
    sent_at = time.time()
    os.killpg(agent_pid, sig)
    return sent_at
