"""Generations formed by independent launchers, as on several machines: `agents` launchers of
recovery_script.py, one node each (`local_nodes=1`), one run id, one checkpoint directory and one job key, started
at random moments up to `spread` seconds apart. Nothing is killed, so every heartbeat suspicion is false, and
every generation should hold every agent that was a member of the one before (a generation only grows) until the
last one holds them all. Used by tests/integration/test_elastic_formation.py (one run) and `bench elastic`
(`--formations N`: the rate per 100 generations formed)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).with_name("recovery_script.py")


@dataclasses.dataclass
class Formation:
    generations: dict[int, tuple[str, ...]]  # generation -> its members, as the agents logged them
    suspicions: list[dict[str, Any]]  # failure events that blamed the heartbeat (all false: nothing was killed)
    failures: list[dict[str, Any]]  # every failure event
    codes: dict[str, int]  # agent -> its launcher's exit code
    final_world: int | None

    @property
    def shrank(self) -> list[int]:
        """Generations that left out a member of the generation before."""
        order = sorted(self.generations)
        return [g for before, g in itertools.pairwise(order)
                if not set(self.generations[before]) <= set(self.generations[g])]


def run_formation(workdir: Path, agents: int = 8, spread: float = 10.0, steps: int = 30, seed: int | None = None,
                  timeout: float = 300.0, python: str = sys.executable, env: dict[str, str] | None = None) -> Formation:
    rng = random.Random(seed)
    run_id = f"formation-{secrets.token_hex(4)}"
    base = {**(env if env is not None else os.environ), "SNEPPX_RUN_ID": run_id,
            "SNEPPX_HEARTBEAT_KEY": secrets.token_hex(32), "R_NODES": str(agents), "R_LOCAL_NODES": "1",
            "R_STEPS": str(steps), "R_UNTIL_WORLD": str(agents), "R_EVERY": "3", "R_SLEEP": "0.05"}
    starts = sorted(rng.uniform(0, spread) for _ in range(agents))
    starts = [s - starts[0] for s in starts]  # the first starts at once
    procs: dict[str, subprocess.Popen[bytes]] = {}
    began = time.monotonic()
    try:
        for i, at in enumerate(starts):
            time.sleep(max(0.0, began + at - time.monotonic()))
            agent, out = f"node-{i}", workdir / f"node-{i}"
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "log.txt", "wb") as log:
                procs[agent] = subprocess.Popen([python, str(SCRIPT), str(out), str(workdir / "ckpts")],
                                                env={**base, "SNEPPX_AGENT_ID": agent}, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = began + timeout
        codes = {agent: proc.wait(max(1.0, deadline - time.monotonic())) for agent, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    events = []
    for agent in procs:
        try:
            events += json.loads((workdir / agent / "result.json").read_text()).get("events", [])
        except (FileNotFoundError, ValueError):
            pass
    generations = {e["generation"]: tuple(e["members"]) for e in events if e["kind"] == "generation"}
    failures = [e for e in events if e["kind"] == "failure"]
    finals = [json.loads(f.read_text()) for f in workdir.glob("node-*/final.json")]
    return Formation(generations, [f for f in failures if "heartbeat" in f["reason"]], failures, codes,
                     finals[0]["world_size"] if finals else None)
