"""The training script of the recovery chaos harness (python chaos_script.py OUT CKPT), launched and read back
with elastic_script.Run like the recovery tests' recovery_script.py.

Its state is small and every step of it is a pure function of the step before (`advance`), the same at every
world size: `w` (replicated) grows by the mean of an allreduce of ones, `m` (sharded) mixes in `w`, `f`
(sharded, never changed: what makes the coordinator's incremental saves reference earlier steps) is there when
C_INCREMENTAL is 1. So the uninterrupted run's state at any step is `reference(step)` computed in one process,
and any rank's part of it is a slice (`part`).

Every rank writes what it restored (the step and the source it claims, and its arrays' values) to
OUT/restored/, and its final state to OUT/final/, for the oracle (chaos_harness.judge) to check. Faults the
harness cannot make from outside are planted here, each once a run (a marker file in OUT): C_DIVERGE=STEP:RANK
(that rank's replica of w drifts by 2**-20 at that step), C_FLIP_HELD=STEP (from that step on, in that
generation, rank 0 flips a byte in every copy of a peer's snapshot it holds), C_RAISE=STEP:RANK (train_fn
raises), C_HOLD_COPIES=STEP:RANK (that rank's copies of STEP never leave: its node dies with them in flight).
C_PLACES=a,a,b names the Kubernetes node of each node's workers (SNEPPX_NODE_NAME): copies are placed by it.
The job's shape: NODES, GPUS, STEPS, EVERY, SLEEP, BACKEND, SNAPSHOT, REPLICAS, INCREMENTAL,
RANKS_ARRAY (a replicated array shaped by the world size), OTHER_SNAPSHOT (ctx.snapshot of another object shaped
like the state, each step), UNTIL_WORLD and MAX_STEPS (train past STEPS, up to MAX_STEPS, until the world has
UNTIL_WORLD ranks again), MAX_RESTARTS, NODE_RESTART_DELAY, and the product's timing tunables (2 s / 10 s / 5 s,
as recovery_script.py chose for a loaded 2-core box).

What the product holds and blames, for the harness's resource checks (`resources` below): MEMORY_LIMIT (the
trainer's snapshot_memory_limit; every rank records in OUT/memory/ the bytes its keeper holds after restore and
at most during the steps), HOSTS=1 (each node a host of its own, SNEPPX_HOST_KEY: backend "shm" then runs the
hierarchical path, shared memory in a node and the ring between), SHM_FAIL=1 (no worker may make a file over
1 MiB, RLIMIT_FSIZE: every shared-memory segment's creation fails with EFBIG, as on a /dev/shm it may not use),
COLLECTIVE_TIMEOUT, KEY (the job key, hex: the harness names the run's segments with it); and every collective failure a rank meets in train_fn goes to OUT/lost/ with the rank it
blames.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "integration"))

import elastic_script

M = 8  # elements of the sharded `m`
F = 2048  # elements of the frozen `f` (16 KiB: most of a save's bytes, so incremental saves stay on)


def knob(name: str, default: str) -> str:
    return os.environ.get(f"C_{name}", default)


def initial(incremental: bool, ranks: int = 0) -> dict[str, np.ndarray]:
    """Step 0. `ranks`: the world size a job of C_RANKS_ARRAY=1 started at, the shape of its replicated `r` (a
    count per rank, as a user might keep): a restore at another world size must refuse it, not reshape it."""
    state = {"w": np.zeros(4), "m": np.zeros(M)}
    if incremental:
        state["f"] = np.sin(np.arange(F, dtype=np.float64))
    if ranks:
        state["r"] = np.zeros(ranks)
    return state


def advance(w: np.ndarray, m: np.ndarray, start: int, total: np.ndarray) -> None:
    """One step, in place: `total` is the allreduce of ones over the world (the world size, in every element).
    Elementwise and exact in binary floating point at every world size, so a run at any world size matches the
    uninterrupted one bitwise; `m` depends on `w` so a wrong collective shows in both."""
    w += total / total[0]
    m *= 0.75
    m += w[0] + 0.5 * np.arange(start, start + len(m))


def reference(steps: int, incremental: bool, ranks: int = 0) -> list[dict[str, np.ndarray]]:
    """The uninterrupted run: its whole state after each step 0..steps, computed in one process."""
    state = initial(incremental, ranks)
    states = [{k: v.copy() for k, v in state.items()}]
    for _ in range(steps):
        advance(state["w"], state["m"], 0, np.ones(4))
        if ranks:
            state["r"] += 1
        states.append({k: v.copy() for k, v in state.items()})
    return states


def bounds(rank: int, world_size: int, n: int) -> tuple[int, int]:
    return n * rank // world_size, n * (rank + 1) // world_size


def part(state: dict[str, np.ndarray], rank: int, world_size: int) -> dict[str, Any]:
    """What one rank holds of a whole state, as the script records it."""
    m0, m1 = bounds(rank, world_size, M)
    got: dict[str, Any] = {"w": state["w"].tolist(), "m": state["m"][m0:m1].tolist(), "m_start": m0}
    if "f" in state:
        f0, f1 = bounds(rank, world_size, F)
        got["f"] = hashlib.sha256(np.ascontiguousarray(state["f"][f0:f1]).tobytes()).hexdigest()
    if "r" in state:
        got["r"] = state["r"].tolist()
    return got


def once(out: Path, name: str) -> bool:
    """True the first time a run asks (the marker is in OUT, which every process of the run shares)."""
    try:
        with open(out / f"once-{name}", "x") as f:
            f.write(str(os.getpid()))
        return True
    except FileExistsError:
        return False


def planted(spec: str) -> tuple[int, int]:
    step, _, rank = spec.partition(":")
    return int(step), int(rank or 0)


def train_loop(ctx: Any) -> None:
    from SneppX_ALG.coordinator import Shard

    out = Path(knob("OUT", "."))
    place_as_kubernetes_node(ctx)
    steps, every, pause = int(knob("STEPS", "20")), int(knob("EVERY", "4")), float(knob("SLEEP", "0.2"))
    incremental = knob("INCREMENTAL", "0") == "1"
    whole = initial(incremental, ctx.world_size if knob("RANKS_ARRAY", "0") == "1" else 0)
    m0, m1 = bounds(ctx.rank, ctx.world_size, M)
    state: dict[str, Any] = {"w": whole["w"], "m": Shard(whole["m"][m0:m1].copy(), (M,), (m0,))}
    if incremental:
        f0, f1 = bounds(ctx.rank, ctx.world_size, F)
        state["f"] = Shard(whole["f"][f0:f1].copy(), (F,), (f0,))
    if "r" in whole:
        state["r"] = whole["r"]
    try:
        info = ctx.restore(state)
    except Exception as e:
        record(out / "restored", ctx, {"error": f"{type(e).__name__}: {e}"})
        raise
    step = 0 if info is None else info.step
    mine = {"w": state["w"], "m": np.zeros(M), "f": np.zeros(F), **({"r": state["r"]} if "r" in state else {})}
    mine["m"][m0:m1] = state["m"].data
    if incremental:
        mine["f"][f0:f1] = state["f"].data
    else:
        del mine["f"]
    record(out / "restored", ctx, {"step": step, "source": None if info is None else info.location,
                                   "backend": ctx.group.backend, **part(mine, ctx.rank, ctx.world_size)})
    held_bytes(out, ctx, None)
    diverge, flip, fail = knob("DIVERGE", ""), knob("FLIP_HELD", ""), knob("RAISE", "")
    flipped: set[Any] | None = None
    other = knob("OTHER_SNAPSHOT", "0") == "1"
    until_world, most = int(knob("UNTIL_WORLD", "0")), int(knob("MAX_STEPS", "0"))
    hold = knob("HOLD_COPIES", "")
    if hold and planted(hold)[1] == ctx.rank % ctx.world_size and ctx._worker.snapshots is not None:
        hold_copies(ctx._worker.snapshots, planted(hold)[0], out)
    while step < steps or (ctx.world_size < until_world and step < most):  # on until nodes that died are back
        if fail and planted(fail) == (step, ctx.rank % ctx.world_size) and once(out, "raise"):
            raise RuntimeError(f"planted failure at step {step}, generation {ctx.generation}")
        if flip and planted(flip)[0] == step and ctx.rank == 0 and ctx._worker.snapshots is not None \
                and once(out, "flip-held"):
            flipped = set()  # from here on in this generation, a bad DIMM under the copies rank 0 keeps
        if flipped is not None:
            ctx._worker.snapshots.wait()
            for copy in ctx._worker.snapshots.held:
                if (copy.key, copy.source) not in flipped:
                    flipped.add((copy.key, copy.source))
                    tensor = copy.meta["tensors"][0]
                    copy.payload[tensor["at"] + tensor["nbytes"] // 2] ^= 0x01
        if diverge and planted(diverge) == (step, ctx.rank % ctx.world_size) and once(out, "diverge"):
            # a bad core: this rank's replica drifts by 2**-20 (one ulp, at 7, would round away at 8)
            state["w"][0] += 2.0 ** -20
        total = np.ones(4)
        ctx.group.allreduce(total)
        advance(state["w"], state["m"].data, m0, total)
        if "r" in state:
            state["r"] += 1
        step += 1
        if other:  # state not given to restore() (an average of the parameters, shaped like them), kept with
            ctx.snapshot({"w": state["w"] * 0.5, "m": Shard(state["m"].data * 0.5, (M,), (m0,))}, step)  # snapshot
        ctx.report(step)
        held_bytes(out, ctx, step)
        if ctx.rank == 0:
            elastic_script.write_json(out / "progress.json", {"step": step, "generation": ctx.generation,
                                                              "world_size": ctx.world_size, "pid": os.getpid()})
        if step % every == 0:
            ctx.save(state, step)
        time.sleep(pause)
    mine["w"], mine["m"][m0:m1] = state["w"], state["m"].data
    if "r" in state:
        mine["r"] = state["r"]
    record(out / "final", ctx, {"step": step, **part(mine, ctx.rank, ctx.world_size)})


_HELD: dict[int, dict[str, Any]] = {}  # this process's record of its generation's keeper, by generation


def held_bytes(out: Path, ctx: Any, step: int | None) -> None:
    """What this rank's snapshot keeper holds, written to OUT/memory/ as it grows: right after restore (`step`
    None: what a recovery adds to) its bytes, and at every step the most its newest snapshots need by the
    documented bound (docs/ELASTIC.md: 2 x (its state + the parts it keeps) + 2 x the largest part passing
    through it), from their actual sizes, against snapshot_memory_limit."""
    keeper = ctx._worker.snapshots
    if keeper is None:
        return
    own, held = list(keeper.own), list(keeper.held)
    newest: dict[Any, int] = {}
    for copy in sorted(held, key=lambda c: c.key):
        newest[copy.source] = len(copy.payload)
    need = 2 * ((len(own[-1].payload) if own else 0) + sum(newest.values())) + 2 * max(newest.values(), default=0)
    if step is None:
        _HELD[ctx.generation] = {"limit": int(knob("MEMORY_LIMIT", "0")), "world_size": ctx.world_size,
                                 "after_restore": sum(len(c.payload) for c in own + held), "need": 0, "at": None}
    fields = _HELD.setdefault(ctx.generation, {"limit": int(knob("MEMORY_LIMIT", "0")), "after_restore": None,
                                                "world_size": ctx.world_size, "need": 0, "at": None})
    if step is None or (step is not None and need > fields["need"]):
        if step is not None:
            fields.update(need=need, at=step)
        record(out / "memory", ctx, fields)


def recording_blame(train_fn: Any) -> Any:
    """train_fn, recording each collective failure it meets with the rank that failure blames (`peer`) in
    OUT/lost/, for the harness to check against the ranks it killed or stopped."""
    from SneppX_ALG import errors

    def run(ctx: Any) -> None:
        try:
            train_fn(ctx)
        except errors.CollectiveError as e:
            record(Path(knob("OUT", ".")) / "lost", ctx, {"error": type(e).__name__, "peer": e.peer,
                                                           "message": str(e)[:500]})
            raise

    return run


def place_as_kubernetes_node(ctx: Any) -> None:
    """C_PLACES=a,a,b: node-i's workers say they run on Kubernetes node `a`, `a`, `b` (SNEPPX_NODE_NAME, as the
    operator sets it), so that a snapshot's copies are placed by those names: harness nodes sharing one are pods
    on one Kubernetes node (issue 37, defect 4)."""
    places = [p for p in knob("PLACES", "").split(",") if p]
    if places:  # the launcher names node i's agent node-i
        os.environ["SNEPPX_NODE_NAME"] = places[int(str(ctx._assignment.agent_id).rpartition("-")[2])]


def hold_copies(keeper: Any, step: int, out: Path) -> None:
    """C_HOLD_COPIES=STEP:RANK: that rank's snapshot of STEP is taken and compared, but its copies never leave
    (its background thread waits in the first shift until the process dies): a node lost with its copies in
    flight, deterministically. Once a run (the marker says when it began to hold)."""
    send = keeper._send_to_peers

    def held(wire: Any, group: Any, sizes: Any, holders: Any) -> None:
        if keeper.own and keeper.own[-1].meta["step"] == step and once(out, "hold-copies"):
            threading.Event().wait()  # until the harness kills this node
        send(wire, group, sizes, holders)

    keeper._send_to_peers = held


def record(where: Path, ctx: Any, fields: dict[str, Any]) -> None:
    where.mkdir(exist_ok=True)
    elastic_script.write_json(where / f"g{ctx.generation}-r{ctx.rank}-p{os.getpid()}.json", {
        "generation": ctx.generation, "rank": ctx.rank, "world_size": ctx.world_size, "time": time.time(),
        **fields})


def main() -> None:
    from SneppX_ALG import ElasticTrainer

    out, checkpoint_dir = Path(sys.argv[1]), sys.argv[2]
    out.mkdir(parents=True, exist_ok=True)
    os.environ["C_OUT"] = str(out)  # the agents and workers run this script again: they inherit it
    resources()
    trainer = ElasticTrainer(
        train_fn=recording_blame(train_loop), checkpoint_dir=checkpoint_dir, max_restarts=int(knob("MAX_RESTARTS", "8")),
        restart_delay=0.1, join_timeout=120, last_call=float(knob("LAST_CALL", "10")),
        hang_timeout=float(knob("HANG_TIMEOUT", "5")), heartbeat_timeout=float(knob("HEARTBEAT_TIMEOUT", "2")),
        node_restart_delay=float(knob("NODE_RESTART_DELAY", "0.2")), events_dir=str(out / "events"),
        backend=knob("BACKEND", "auto"), snapshot_every=int(knob("SNAPSHOT", "0")),  # type: ignore[arg-type]
        snapshot_replicas=int(knob("REPLICAS", "1")), snapshot_memory_limit=int(knob("MEMORY_LIMIT", "0")) or None,
        collective_timeout=float(knob("COLLECTIVE_TIMEOUT", "300")))
    elastic_script.report_run(out, lambda: trainer.run(num_nodes=int(knob("NODES", "1")),
                                                        num_gpus=int(knob("GPUS", "1"))))


SHM_FAIL_BYTES = 1 << 20  # a worker's largest file under SHM_FAIL: a segment is 2 x world x 1 MiB, a shard KiBs


def resources() -> None:
    """HOSTS and SHM_FAIL, in each agent and worker as it starts (before any group is set up)."""
    import resource

    from SneppX_ALG.contract.env import ENV_AGENT_ID, ENV_HEARTBEAT_KEY, ENV_HOST_KEY, ENV_ROLE

    if knob("KEY", "") and not os.environ.get(ENV_HEARTBEAT_KEY):
        os.environ[ENV_HEARTBEAT_KEY] = knob("KEY", "")  # the job's key, the harness's: it names the run's segments

    if knob("HOSTS", "0") == "1" and os.environ.get(ENV_AGENT_ID):
        os.environ[ENV_HOST_KEY] = os.environ[ENV_AGENT_ID]  # its workers inherit it: one host per node
    if knob("SHM_FAIL", "0") == "1" and os.environ.get(ENV_ROLE) == "worker":
        resource.setrlimit(resource.RLIMIT_FSIZE, (SHM_FAIL_BYTES, SHM_FAIL_BYTES))  # CPython ignores SIGXFSZ


class Run(elastic_script.Run):
    """One run of this script as a child process."""

    SCRIPT = __file__
    KNOB_PREFIX = "C_"


if __name__ == "__main__":
    main()
