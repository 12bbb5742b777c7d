"""A small training script for the worker's rules under a real ElasticTrainer (python worker_rules_script.py OUT
CKPT): the restart count a worker sees, the rollback rule of its restore, and a step committed already. Each step
allreduces ones and adds their mean, so after N steps the state is exactly N, whatever the world size.

Knobs (environment, W_*): NODES, GPUS, STEPS, EVERY (checkpoint interval), MAX_RESTARTS, SIZE (w's length),
SHARDED (1: the state holds a sharded array too, so that it is restored as a sharded state), MODE:
  plain      train from the newest checkpoint to STEPS;
  raise_once the last rank raises at the start of the first generation that has seen no failure (ctx.restarts 0);
  resave     right after its restore, save the restored step again (a step an earlier generation committed).
Rank 0 appends what each generation saw to OUT/seen.jsonl (generation, ctx.restarts, TORCHELASTIC_RESTART_COUNT)
and writes OUT/final.json at the end; the launcher writes OUT/result.json (generations, failures, events; or the
error, its type and message).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import elastic_script

SIZE = 2048  # float32: the data of a step's shard starts past its first 4 KiB (where a test flips a byte)


def knob(name: str, default: str) -> str:
    return os.environ.get(f"W_{name}", default)


def train_loop(ctx: Any) -> None:
    from SneppX_ALG.coordinator import Shard

    out = Path(knob("OUT", "."))
    steps, every, mode = int(knob("STEPS", "6")), int(knob("EVERY", "3")), knob("MODE", "plain")
    if ctx.rank == 0:
        with open(out / "seen.jsonl", "a") as f:
            f.write(json.dumps({"generation": ctx.generation, "restarts": ctx.restarts,
                                "env": os.environ.get("TORCHELASTIC_RESTART_COUNT")}) + "\n")
    if mode == "raise_once" and ctx.restarts == 0 and ctx.rank == ctx.world_size - 1:
        raise RuntimeError(f"planted failure, generation {ctx.generation}")
    state: dict[str, Any] = {"w": np.zeros(int(knob("SIZE", str(SIZE))), dtype=np.float32)}
    if knob("SHARDED", "0") == "1":  # a sharded state: its restore checks each replicated array's shape
        state["rank"] = Shard(np.full(1, ctx.rank), (ctx.world_size,), (ctx.rank,))
    info = ctx.restore(state)
    step = 0 if info is None else info.step
    if mode == "resave" and info is not None:
        ctx.save(state, step)
    while step < steps:
        contribution = np.ones_like(state["w"])
        ctx.group.allreduce(contribution)
        state["w"] += contribution / ctx.world_size
        step += 1
        ctx.report(step)
        if step % every == 0:
            ctx.save(state, step)
    if ctx.rank == 0:
        elastic_script.write_json(out / "final.json", {"step": step, "w": float(state["w"][0]),
                                                       "restored": None if info is None else info.step})


def main() -> None:
    from SneppX_ALG import ElasticTrainer

    out, checkpoint_dir = Path(sys.argv[1]), sys.argv[2]
    out.mkdir(parents=True, exist_ok=True)
    os.environ["W_OUT"] = str(out)
    trainer = ElasticTrainer(
        train_fn=train_loop, checkpoint_dir=checkpoint_dir, max_restarts=int(knob("MAX_RESTARTS", "2")),
        restart_delay=0.1, join_timeout=120, last_call=3, node_restart_delay=0.2, events_dir=str(out / "events"))
    elastic_script.report_run(out, lambda: trainer.run(num_nodes=int(knob("NODES", "1")),
                                                        num_gpus=int(knob("GPUS", "1"))))


class Run(elastic_script.Run):
    """One run of this script as a child process (elastic_script.Run's drivers)."""

    SCRIPT = __file__
    KNOB_PREFIX = "W_"

    def seen(self) -> list[dict[str, Any]]:
        lines = (self.out / "seen.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]


if __name__ == "__main__":
    main()
