"""A small training script for the ElasticTrainer's recovery tests (python recovery_script.py OUT CKPT): each
step allreduces a vector over the world and adds its mean, so after N steps the state is exactly N everywhere,
whatever the world size, the failures and the restores. Cheap enough to run a job of 4 nodes on 2 cores.

Knobs (environment, R_*): NODES, GPUS, LOCAL_NODES, STEPS, UNTIL_WORLD (train past STEPS until the world is
this big), EVERY (checkpoint interval), SLEEP (per step), MAX_RESTARTS, RESTART_DELAY, NODE_RESTART_DELAY,
JOIN_TIMEOUT, HANG_TIMEOUT (default 5 s), HEARTBEAT_TIMEOUT (2 s), LAST_CALL (10 s), RAISE ("" | "once": the
last rank raises at step 3 of the first generation | "always": it raises at every start). Peer-memory
snapshots: SNAPSHOT (snapshot_every, 0: off), REPLICAS, SNAPSHOT_LIMIT (bytes), FLIP_AT (at that step of the
first generation rank 0 flips a byte in every peer's copy it holds, and the last rank raises: its part
survives only in a corrupt copy, with REPLICAS=1), DIVERGE_AT (at that step of the first generation rank DIVERGE_RANK's (1)
replicated array drifts by one ulp: silent data corruption).
Rank 0 writes OUT/progress.json after each step, a line to OUT/restores.jsonl per generation (the step it
resumed from, where from, and the last step done before: steps redone = before - step) and OUT/final.json at
the end (the restart count the worker saw; the spread of w over the ranks); the launcher writes
OUT/result.json (generations, failures, events; or the error, its type and the history).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import elastic_script

from SneppX_ALG.coordinator import Shard


def knob(name: str, default: str) -> str:
    return os.environ.get(f"R_{name}", default)


M = 8  # elements of the sharded vector


def train_loop(ctx: Any) -> None:
    out = Path(knob("OUT", "."))
    steps, every, pause = int(knob("STEPS", "12")), int(knob("EVERY", "3")), float(knob("SLEEP", "0.05"))
    start, stop = M * ctx.rank // ctx.world_size, M * (ctx.rank + 1) // ctx.world_size
    state = {"w": np.zeros(4), "m": Shard(np.zeros(stop - start), (M,), (start,))}  # w replicated, m sharded
    info = ctx.restore(state)
    step = 0 if info is None else info.step
    if ctx.rank == 0:
        before = json.loads((out / "progress.json").read_text())["step"] if (out / "progress.json").exists() else 0
        with open(out / "restores.jsonl", "a") as f:
            f.write(json.dumps({"generation": ctx.generation, "step": step, "before": before, "source":
                                None if info is None else "memory" if info.location == "memory" else "storage"}) + "\n")
    fail = knob("RAISE", "")
    until_world = int(knob("UNTIL_WORLD", "0"))  # train on (past STEPS) until the world has this many ranks
    flip_at, diverge_at = int(knob("FLIP_AT", "-1")), int(knob("DIVERGE_AT", "-1"))
    diverge_rank = int(knob("DIVERGE_RANK", "1"))
    while step < steps or ctx.world_size < until_world:
        if ctx.rank == ctx.world_size - 1 and step == 3 and (fail == "always" or (fail == "once" and ctx.restarts == 0)):
            raise RuntimeError(f"planted failure at step {step}, generation {ctx.generation}")
        if step == flip_at and ctx.generation == 0:
            if ctx.rank == 0:  # a bad DIMM under the copies it keeps for its peers
                ctx._worker.snapshots.wait()
                for copy in ctx._worker.snapshots.held:
                    tensor = copy.meta["tensors"][0]  # its shard of m
                    copy.payload[tensor["at"] + tensor["nbytes"] // 2] ^= 0x01
            elif ctx.rank == ctx.world_size - 1:
                time.sleep(0.5)  # rank 0 flips first
                raise RuntimeError(f"planted failure at step {step} after a flipped byte")
        if step == diverge_at and ctx.generation == 0 and ctx.rank == diverge_rank:
            state["w"][0] = np.nextafter(state["w"][0], np.inf)  # a bad core: this rank's replica drifts
        contribution = np.ones(4)
        ctx.group.allreduce(contribution)
        state["w"] += contribution / ctx.world_size
        state["m"].data[:] += 1.0
        step += 1
        ctx.report(step)
        if ctx.rank == 0:
            elastic_script.write_json(out / "progress.json", {"step": step, "generation": ctx.generation,
                                                              "world_size": ctx.world_size, "pid": os.getpid()})
        if step % every == 0:
            ctx.save(state, step)
        time.sleep(pause)
    m_total = np.array([state["m"].data.sum()])
    ctx.group.allreduce(m_total)
    hi, lo = state["w"].copy(), state["w"].copy()
    ctx.group.allreduce(hi, op="max")
    ctx.group.allreduce(lo, op="min")
    if ctx.rank == 0:
        elastic_script.write_json(out / "final.json", {"world_size": ctx.world_size,
            "spread": float(np.max(hi - lo)), "m_total": float(m_total[0]),
            "step": step, "w": state["w"].tolist(), "generation": ctx.generation, "restarts": ctx.restarts,
            "restart_count_env": os.environ.get("TORCHELASTIC_RESTART_COUNT")})


def main() -> None:
    from SneppX_ALG import ElasticTrainer

    out, checkpoint_dir = Path(sys.argv[1]), sys.argv[2]
    out.mkdir(parents=True, exist_ok=True)
    os.environ["R_OUT"] = str(out)
    trainer = ElasticTrainer(
        train_fn=train_loop, checkpoint_dir=checkpoint_dir, max_restarts=int(knob("MAX_RESTARTS", "3")),
        restart_delay=float(knob("RESTART_DELAY", "0.1")), join_timeout=float(knob("JOIN_TIMEOUT", "120")),
        # Generous times unless a test sets them, for a loaded 2-core box running 4 nodes: hang_timeout 5, so a
        # worker starved of CPU is not taken for a hung one; heartbeat_timeout 2 (first contact: 2 + 1.5 s), so a
        # node that learns of its generation late is not taken for a dead one (CI saw node-0 suspect all three
        # peers at 0.8 s); last_call 10, so the last node to start, or to reach a boundary, is waited for rather
        # than left out. Each would be a failure or a generation the test did not plant. (A generation with every
        # node in seals at once.)
        last_call=float(knob("LAST_CALL", "10")), hang_timeout=float(knob("HANG_TIMEOUT", "5")),
        heartbeat_timeout=float(knob("HEARTBEAT_TIMEOUT", "2")),
        node_restart_delay=float(knob("NODE_RESTART_DELAY", "0.2")), events_dir=str(out / "events"),
        snapshot_every=int(knob("SNAPSHOT", "0")), snapshot_replicas=int(knob("REPLICAS", "1")),
        snapshot_memory_limit=int(knob("SNAPSHOT_LIMIT", "0")) or None)
    local_nodes = int(knob("LOCAL_NODES", "0")) or None  # 1: this launcher is one node of a bigger job
    elastic_script.report_run(out, lambda: trainer.run(num_nodes=int(knob("NODES", "1")),
                                                        num_gpus=int(knob("GPUS", "1")), local_nodes=local_nodes))


class Run(elastic_script.Run):
    """One run of this script as a child process (elastic_script.Run's drivers)."""

    SCRIPT = __file__
    KNOB_PREFIX = "R_"

    def restores(self) -> list[dict[str, Any]]:
        """Rank 0's line per generation: the step resumed from, its source, the last step done before."""
        lines = (self.out / "restores.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def events(self, agent_id: str) -> list[dict[str, Any]]:
        """The agent's events so far (every incarnation of it)."""
        try:
            lines = (self.out / "events" / f"{agent_id}.events.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]


if __name__ == "__main__":
    main()
