"""A randomized recovery harness with an exact oracle (the FoundationDB/Jepsen method, applied to training
recovery): a seed makes a schedule (a job configuration and a list of faults), the schedule is run against a
real ElasticTrainer job of chaos_script.py (real launcher, agents and workers, real signals, real files), and
the oracle judges what came of it. A failing schedule is shrunk to a minimal one by delta debugging over its
faults. docs/TESTING.md, "Recovery chaos", says how to read, reproduce and run it.

The schedule is a pure function of the seed; the interleaving is not (real processes on a loaded machine): a
fault fires when the run reaches its step, or as soon as the generation after the previous fault forms.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import random
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import chaos_script
import promises
from elastic_script import process_state

# Faults made from outside the job (signals, files) and in it (chaos_script's once-a-run knobs)
SIGNALS = ("kill_worker", "stop_worker", "kill_agent", "kill_node", "stop_node")
FLIPS = ("flip_checkpoint", "flip_base")
PLANTED = {"flip_held": "FLIP_HELD", "diverge": "DIVERGE", "raise": "RAISE"}
SETUP = ("kill_creator",)  # a shared-memory segment's creator killed in setup, a peer late (drawn apart)
STAGED = {"hold_copies": "HOLD_COPIES"}  # planted in the script too, by hand-made schedules only (promises.py)
IN_SCRIPT = {**PLANTED, **STAGED}
RECOVERY = -1  # a fault's `at`: as soon as the generation after the previous fault forms (during recovery)
TYPED_ENDS = ("ElasticRunError", "RestartBudgetExhaustedError")  # report_run's typed ends of a run
FINISH_TIMEOUT = 240.0
TRIGGER_TIMEOUT = 90.0


@dataclasses.dataclass(frozen=True)
class Config:
    """The job a schedule runs: world size nodes x gpus (1-4), snapshots, incremental saves, transport."""

    nodes: int
    gpus: int
    snapshot: int  # snapshot_every (0: off)
    replicas: int
    incremental: bool  # the state has a large array that never changes: later saves reference earlier steps
    backend: str  # "auto": shared memory between a node's workers, the ring between nodes; "tcp": the ring only
    steps: int
    every: int  # the durable checkpoint interval
    node_restart_delay: float  # short: a killed node is back at once; long: the world shrinks, then grows
    ranks_array: bool = False  # the state holds a replicated array shaped (world size at the start,)
    other_snapshot: bool = False  # each step also keeps another object with ctx.snapshot
    memory_limit: int = 0  # snapshot_memory_limit in bytes (0: the product's default), near what the layout needs
    hosts: bool = False  # each node a host of its own: backend "shm" runs the hierarchical path across nodes
    shm_fail: bool = False  # no shared-memory segment can be created (EFBIG): "auto" must use the ring instead
    places: str = ""  # "a,a,b": node-i's Kubernetes node (SNEPPX_NODE_NAME); "": each node its own

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus

    @property
    def most_steps(self) -> int:
        """Where a job whose killed nodes come back trains on to, at most, waiting to grow to its full size
        again (a node rejoins at a checkpoint boundary: after `steps` there may be none left)."""
        return 4 * self.steps if self.nodes > 1 and self.node_restart_delay < 60 else self.steps


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str  # one of SIGNALS, FLIPS or PLANTED
    at: int  # the step it fires at (RECOVERY: during the next recovery)
    node: int = 0
    local_rank: int = 0
    hold: float = 0.0  # stop_*: seconds stopped before SIGCONT

    def __str__(self) -> str:
        when = "during recovery" if self.at == RECOVERY else f"at step {self.at}"
        where = {"kill_worker": f" node-{self.node}/{self.local_rank}", "stop_worker":
                 f" node-{self.node}/{self.local_rank} for {self.hold}s", "kill_agent": f" node-{self.node}",
                 "kill_node": f" node-{self.node}", "stop_node": f" node-{self.node} for {self.hold}s",
                 "diverge": f" rank {self.node}", "raise": f" rank {self.node}",
                 "hold_copies": f" rank {self.node}"}.get(self.kind, "")
        return f"{self.kind}{where} {when}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    seed: int
    config: Config
    faults: tuple[Fault, ...]

    def to_json(self) -> str:
        return json.dumps({"seed": self.seed, "config": dataclasses.asdict(self.config),
                           "faults": [dataclasses.asdict(f) for f in self.faults]})

    @staticmethod
    def from_json(text: str) -> Schedule:
        raw = json.loads(text)
        return Schedule(raw["seed"], Config(**raw["config"]), tuple(Fault(**f) for f in raw["faults"]))

    def describe(self) -> str:
        c = self.config
        snapshots = f"every {c.snapshot} x{c.replicas}" if c.snapshot else "off"
        head = (f"seed {self.seed}: {c.nodes} node(s) x {c.gpus} worker(s), backend {c.backend}, snapshots "
                f"{snapshots}, incremental {'on' if c.incremental else 'off'}, {c.steps} steps, checkpoint every "
                f"{c.every}, nodes back after {c.node_restart_delay}s"
                + (f", a replicated array shaped ({c.world_size},)" if c.ranks_array else "")
                + (", ctx.snapshot of another object each step" if c.other_snapshot else "")
                + (f", snapshot_memory_limit {c.memory_limit} bytes" if c.memory_limit else "")
                + (", each node a host of its own" if c.hosts else "")
                + (", no shared-memory segment can be created" if c.shm_fail else "")
                + (f", nodes on Kubernetes nodes {c.places}" if c.places else ""))
        lines = [head]
        lines += [f"  {i}. {f}" for i, f in enumerate(self.faults, 1)] or ["  (no faults)"]
        return "\n".join(lines + [f"  replay: {self.to_json()}"])


# ---- the generator (pure) ----------------------------------------------------------------------------------


def generate(seed: int) -> Schedule:
    """The schedule of `seed`: the same on every machine and every call."""
    rng = random.Random(seed)
    nodes, gpus = rng.choice([(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (4, 1), (1, 4), (2, 1), (3, 1)])
    snapshot = rng.choice([0, 1]) if nodes > 1 else 0  # a snapshot's copies go to other nodes
    replicas = 2 if snapshot and nodes >= 3 and rng.random() < 0.4 else 1
    steps, every = 16, rng.choice([3, 4, 5])
    config = Config(nodes=nodes, gpus=gpus, snapshot=snapshot, replicas=replicas,
                    incremental=rng.random() < 0.5, backend=rng.choice(["auto", "auto", "tcp"]), steps=steps,
                    every=every, node_restart_delay=rng.choice([0.2, 4.0] if nodes == 1 else [0.2, 4.0, 60.0]))
    faults: list[Fault] = []
    planted: set[str] = set()
    for _ in range(rng.choice([1, 1, 2, 2, 3])):
        kinds = [*SIGNALS, *SIGNALS, *FLIPS, *(k for k in PLANTED if k not in planted)]
        if not snapshot:
            kinds = [k for k in kinds if k not in ("flip_held", "diverge")]  # nothing would check them
        kind = rng.choice(kinds)
        planted.add(kind)
        # a fault lands mid-step, at a checkpoint step (its save in flight), or while the last one recovers
        at = rng.choice([rng.randrange(2, steps - 2), every * rng.randrange(1, (steps - 2) // every + 1),
                         RECOVERY if faults else rng.randrange(2, steps - 2)])
        if kind in PLANTED and at == RECOVERY:
            at = rng.randrange(2, steps - 2)
        faults.append(Fault(kind=kind, at=at, node=rng.randrange(config.world_size if kind in PLANTED else nodes),
                            local_rank=rng.randrange(gpus), hold=rng.choice([0.5, 4.0])))
    # drawn apart, so adding it left every other choice of a seed as it was (campaigns before it stay valid)
    ranks_array = nodes > 1 and random.Random(f"{seed}/ranks_array").random() < 0.25
    other_snapshot = snapshot > 0 and random.Random(f"{seed}/other_snapshot").random() < 0.2
    config = resource_options(seed, dataclasses.replace(config, ranks_array=ranks_array,
                                                        other_snapshot=other_snapshot))
    return Schedule(seed, config, tuple(faults) + setup_faults(seed, config, len(faults)))


def resource_options(seed: int, config: Config) -> Config:
    """What the product holds and how it sets up its collectives, each drawn apart (the rest of a seed's schedule
    stays as it was): a memory limit near what the starting layout's snapshots need (below it, at it, or a
    little above: a shrink then doubles each survivor's shard), each node a host of its own with shared memory
    inside it (the hierarchical path), or a /dev/shm that refuses every segment."""
    draw = random.Random(f"{seed}/resources")
    if config.snapshot and config.incremental and draw.random() < 0.3:
        factor = draw.choice([0.8, 1.0, 1.25, 1.5, 3.0])
        config = dataclasses.replace(config, memory_limit=int(factor * snapshot_need(config)))
    if (config.nodes, config.gpus) == (2, 2) and draw.random() < 0.5:
        config = dataclasses.replace(config, backend="shm", hosts=True)
    if config.nodes == 1 and config.gpus > 1 and config.backend == "auto" and draw.random() < 0.3:
        config = dataclasses.replace(config, shm_fail=True)
    return config


def setup_faults(seed: int, config: Config, drawn: int) -> tuple[Fault, ...]:
    """Where a node's workers share memory, sometimes its segment's creator killed in setup, a peer late
    (`kill_creator`), drawn apart, as a schedule's last fault (it has at most 3)."""
    draw = random.Random(f"{seed}/setup")
    shared = config.hosts or (config.nodes == 1 and config.gpus > 1 and config.backend == "auto" and not config.shm_fail)
    if not shared or drawn >= 3 or draw.random() >= 0.3:
        return ()
    return (Fault("kill_creator", at=draw.randrange(2, config.steps - 2), node=draw.randrange(config.nodes)),)


SNAPSHOT_OVERHEAD = 256  # bytes of a snapshot besides its arrays (its slot for descriptions): about, measured


def snapshot_need(config: Config) -> int:
    """About what one rank's snapshots need at the starting world size (`memory.needed_bytes`: two of its own,
    two of each peer part it keeps, two in transit), from the script's layout: the memory limit is drawn near it."""
    world = config.world_size
    unique = 8 * (chaos_script.M + chaos_script.F * config.incremental) // world  # its shards
    state = unique + 8 * 4 + 8 * world * config.ranks_array + SNAPSHOT_OVERHEAD
    return (2 * (state + config.replicas * state) + 2 * state) * (1 + config.other_snapshot)


# ---- running a schedule ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    schedule: Schedule
    problems: list[str]  # the oracle's findings: empty means the run passed
    ended: str  # "recovered", or the typed error that ended it
    fired: list[str]
    seconds: float
    out: Path
    worlds: list[int]  # the world size of each generation that restored (it shrank, grew, or neither)

    @property
    def passed(self) -> bool:
        return not self.problems


def run(schedule: Schedule, workdir: Path) -> Outcome:
    """Runs `schedule` in `workdir` (made fresh: it must not exist) and judges it."""
    c = schedule.config
    workdir.mkdir(parents=True)
    knobs: dict[str, Any] = {"nodes": c.nodes, "gpus": c.gpus, "steps": c.steps, "every": c.every,
                             "until_world": c.world_size, "max_steps": c.most_steps,
                             "snapshot": c.snapshot, "replicas": c.replicas, "incremental": int(c.incremental),
                             "backend": c.backend, "node_restart_delay": c.node_restart_delay,
                             "ranks_array": int(c.ranks_array), "other_snapshot": int(c.other_snapshot),
                             "memory_limit": c.memory_limit, "hosts": int(c.hosts), "shm_fail": int(c.shm_fail),
                             "key": secrets.token_hex(32)}  # the job's key: its segments' names are judged
    knobs["places"] = c.places
    for fault in schedule.faults:
        if fault.kind in IN_SCRIPT:
            knobs[IN_SCRIPT[fault.kind]] = f"{fault.at}:{fault.node}"
    started = time.monotonic()
    job = chaos_script.Run(workdir / "out", str(workdir / "ckpts"), **knobs)
    fired: list[str] = []
    try:
        drive(job, schedule, workdir / "ckpts", fired)
        try:
            result = job.finish(FINISH_TIMEOUT)
        except AssertionError as e:
            result = {"error": "hang", "message": str(e)[:2000]}
    finally:
        if job.proc.poll() is None or job.processes():
            job.kill()
        else:
            job.log.close()
    problems = (judge(c, job.out, result) + judge_resources(c, job.out, result)
                + judge_segments(schedule, workdir / "ckpts", knobs["key"], fired, result)
                + promises.broken(schedule, job.out, fired))
    ended = "recovered" if "error" not in result else f"{result['error']}: {result.get('message', '')[:300]}"
    sizes = {r["generation"]: r["world_size"] for r in records(job.out / "restored")}
    return Outcome(schedule, problems, ended, fired, time.monotonic() - started, job.out,
                   [sizes[g] for g in sorted(sizes)])


def drive(job: chaos_script.Run, schedule: Schedule, checkpoints: Path, fired: list[str]) -> None:
    """Fires each signal and file fault in turn, when the run reaches it; a fault whose moment never comes (the
    run ended, or stopped at an earlier fault's typed error) is left out, and `fired` says so."""
    watch = Watch(job)
    try:
        fire_in_turn(job, schedule, checkpoints, fired, watch)
    finally:
        watch.stop()


def fire_in_turn(job: chaos_script.Run, schedule: Schedule, checkpoints: Path, fired: list[str],
                 watch: Watch) -> None:
    generation = 0
    for fault in schedule.faults:
        if fault.kind in IN_SCRIPT:
            fired.append(f"{fault} (planted in the script)")
            continue
        try:
            if fault.at == RECOVERY:
                wait_for_generation(job, generation + 1)
            else:
                job.wait_for(lambda p, at=fault.at: p["step"] >= at, timeout=TRIGGER_TIMEOUT)
        except AssertionError:
            fired.append(f"{fault}: not fired (the run never got there)")
            continue
        generation, step, began = latest_generation(job), job.progress()["step"], time.monotonic()
        what = fire(watch, fault, checkpoints)
        fired.append(f"{fault}: {what} (at step {step}, {time.monotonic() - began:.1f}s to fire)")


class Watch:
    """The run's agents and workers, looked up in /proc by a thread every few tenths of a second, so a fault
    fires on its step rather than a slow scan of /proc later (seconds, on a loaded machine)."""

    def __init__(self, job: chaos_script.Run):
        self.job = job
        self.pids: dict[tuple[str, str, str], int] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._scan, daemon=True)
        self.thread.start()

    def _scan(self) -> None:
        while not self.done.is_set():
            self.pids = {(role, agent, lr): pid for pid, role, agent, lr in self.job.processes()}
            self.done.wait(0.2)

    def pid(self, role: str, agent: str, local_rank: str = "", timeout: float = 20) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = self.pids.get((role, agent, local_rank))
            if pid is not None and process_state(pid) not in (None, "Z", "T"):
                return pid
            time.sleep(0.02)
        raise LookupError(f"no live {role} {agent}/{local_rank}")

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def fire(watch: Watch, fault: Fault, checkpoints: Path) -> str:
    agent = f"node-{fault.node}"
    try:
        if fault.kind == "kill_worker":
            os.kill(watch.pid("worker", agent, str(fault.local_rank)), signal.SIGKILL)
        elif fault.kind == "kill_agent":
            os.kill(watch.pid("agent", agent), signal.SIGKILL)
        elif fault.kind == "kill_node":
            os.killpg(watch.pid("agent", agent), signal.SIGKILL)
        elif fault.kind == "stop_worker":
            stop_for(stopping(watch, [watch.pid("worker", agent, str(fault.local_rank))]), fault.hold, group=False)
        elif fault.kind == "stop_node":
            stop_for(stopping(watch, [watch.pid("agent", agent)], agent), fault.hold, group=True)
        elif fault.kind == "kill_creator":
            return kill_creator(watch, agent, checkpoints)
        else:
            return flip_step(checkpoints, newest=fault.kind == "flip_checkpoint")
    except (LookupError, ProcessLookupError) as e:
        return f"no target ({e})"
    return "fired"


def kill_creator(watch: Watch, agent: str, checkpoints: Path) -> str:
    """Issue 37 defect 8's moment: SIGKILL the node's worker 0, so a new generation forms and its replacement
    creates the node's shared-memory segment; the moment the replacement publishes it, SIGSTOP the node's worker 1
    (a peer late to attach) and SIGKILL the creator, then SIGCONT the peer. The segment is named and the creator
    gone: a rank that opened it must unlink it (`judge_segments`)."""
    first = watch.pid("worker", agent, "0")
    before = published_segments(checkpoints)
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + TRIGGER_TIMEOUT
    creator = None
    while time.monotonic() < deadline:
        if creator is None and watch.pids.get(("worker", agent, "0"), first) != first:
            creator = watch.pids[("worker", agent, "0")]
        if creator is not None and (new := set(published_segments(checkpoints)) - set(before)):
            break
        time.sleep(0.001)
    else:
        return "no new segment was published"
    assert creator is not None
    try:
        peer = stopping(watch, [watch.pid("worker", agent, "1")])
        os.kill(peer, signal.SIGSTOP)
    except LookupError:
        peer = None
    try:
        os.kill(creator, signal.SIGKILL)
    finally:
        if peer is not None:
            time.sleep(0.5)
            os.kill(peer, signal.SIGCONT)
    return f"killed {first}, then {creator}, the creator of {min(new)[1][:16]}... of generation {min(new)[0]}"


def published_segments(checkpoints: Path) -> list[tuple[int, str]]:
    """(generation, nonce) of every shared-memory segment a run's ranks published (`collectives.shm`: the store
    holds each segment's nonce, under the generation's key, beside the checkpoints)."""
    found = []
    for path in (checkpoints / "_elastic" / "comm").rglob(".v*") if (checkpoints / "_elastic").exists() else []:
        parts = path.parts
        if "shm" not in parts or not ("segment" in parts or "host-segment" in parts):
            continue
        generation = next((int(p[4:]) for p in parts if p.startswith("gen-") and p[4:].isdigit()), None)
        try:
            value = json.loads(base64.b64decode(json.loads(path.read_text())["value"]))
        except (ValueError, KeyError, TypeError, OSError):
            continue  # being written
        if generation is not None and isinstance(value, dict) and "nonce" in value:
            found.append((generation, str(value["nonce"])))
    return sorted(set(found))


def judge_segments(schedule: Schedule, checkpoints: Path, key: str, fired: list[str],
                   result: dict[str, Any]) -> list[str]:
    """No shared-memory segment of this run is left in /dev/shm once every process has exited (issue 37 defect 8:
    a setup that fails unlinks it, on every rank that opened it). The names are the run's own (its key and the
    nonces its store holds): other runs on the machine are not counted. A run where a whole node or agent was
    killed, or that hung (the harness killed everything), may leave one no live rank ever opened: not judged."""
    from SneppX_ALG import job_key
    from SneppX_ALG.collectives.shm import shm_name

    everyone = ("kill_node", "kill_agent")
    if result.get("error") == "hang" or any(line.startswith(everyone) and ": fired" in line for line in fired):
        return []
    mac = job_key.load_key(key, {})
    left = [(g, name) for g, nonce in published_segments(checkpoints)
            if os.path.exists("/dev/shm" + (name := shm_name(mac, g, bytes.fromhex(nonce))))]
    for _, name in left:
        try:
            os.unlink("/dev/shm" + name)  # this run's: the machine keeps no leak of ours
        except FileNotFoundError:
            pass
    return [f"the shared-memory segment of generation {g} ({name}) was left in /dev/shm after every process "
            "exited" for g, name in left]


def stopping(watch: Watch, pids: list[int], agent: str = "") -> int:
    """Notes the processes a stop fault is about to stop (a node's: its agent and workers) in OUT/stopped.json, and
    when the first stop came: a stopped rank lives on, and may be blamed for what it did while stopped. Returns
    the first."""
    pids = pids + [pid for (role, a, _), pid in watch.pids.items() if agent and a == agent and role == "worker"]
    path = watch.job.out / "stopped.json"
    before = json.loads(path.read_text()) if path.exists() else {"pids": [], "first": time.time()}
    path.write_text(json.dumps({"pids": sorted(set(before["pids"]) | set(pids)), "first": before["first"]}))
    return pids[0]


def stop_for(pid: int, hold: float, *, group: bool) -> None:
    """SIGSTOP now, SIGCONT after `hold` seconds (from a thread: the next fault may fire meanwhile)."""
    send = os.killpg if group else os.kill
    send(pid, signal.SIGSTOP)

    def cont() -> None:
        time.sleep(hold)
        try:
            send(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    threading.Thread(target=cont, daemon=True).start()


def flip_step(checkpoints: Path, *, newest: bool) -> str:
    """Flips one byte in the middle of the biggest tensor's data in the newest committed step (or the oldest:
    the base that later incremental steps reference), as a bad disk would."""
    from SneppX_ALG.checkpoint import format as snpx

    steps = sorted(p for p in checkpoints.glob("step-*") if p.is_dir())
    if not steps:
        return "no committed step yet"
    target = steps[-1] if newest else steps[0]
    candidates = []
    for path in sorted(target.glob("shard-*.snpx")):
        with open(path, "rb") as f:
            header = snpx.decode_header(f.read(snpx.HEADER_SIZE))
            f.seek(header.table_offset)
            table = snpx.decode_table(f.read(header.table_length), header)
        candidates += [(entry.length, path, entry) for entry in table.tensors if entry.length]
    if not candidates:
        return f"no tensor data in {target.name}"
    _, victim, entry = max(candidates, key=lambda c: (c[0], str(c[1])))
    at = entry.offset + entry.length // 2
    with open(victim, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
        f.flush()
        os.fsync(f.fileno())
    return f"flipped byte {at} ({entry.name}) of {victim.relative_to(checkpoints)}"


def latest_generation(job: chaos_script.Run) -> int:
    newest = -1
    for path in (job.out / "events").glob("*.events.jsonl"):
        for line in path.read_text().splitlines():
            if '"generation"' in line:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("kind") == "generation":
                    newest = max(newest, int(event.get("generation", -1)))
    return newest


def wait_for_generation(job: chaos_script.Run, generation: int) -> None:
    deadline = time.monotonic() + TRIGGER_TIMEOUT
    while latest_generation(job) < generation:
        if job.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"generation {generation} never formed")
        time.sleep(0.005)


# ---- the oracle (pure over what the run left) -----------------------------------------------------------------


def judge(config: Config, out: Path, result: dict[str, Any]) -> list[str]:
    """What the run did wrong: every restore's claim must be true (the state it restored is the uninterrupted
    run's state at the step it names), and the run ends at the uninterrupted run's final state, or with a
    typed error that says why (never with wrong state)."""
    problems = []
    restores = records(out / "restored")
    origin = started_at(restores)

    def want(generation: int) -> list[dict[str, np.ndarray]]:
        return expected(config.most_steps, config.incremental, origin.get(generation, 0) if config.ranks_array else 0)

    for r in restores:
        if "error" in r:
            continue  # a restore that refused: the run's end says whether that ended it
        if not 0 <= r["step"] <= config.most_steps:
            problems.append(f"rank {r['rank']} of generation {r['generation']} claims step {r['step']}")
            continue
        truth = chaos_script.part(want(r["generation"])[r["step"]], r["rank"], r["world_size"])
        if (wrong := differences(r, truth, exact=True)):
            problems.append(f"false restore claim: generation {r['generation']} rank {r['rank']}/"
                            f"{r['world_size']} says step {r['step']} from {r['source']}, but {wrong}")
    by_generation: dict[int, set[int]] = {}
    for r in restores:
        if "step" in r:
            by_generation.setdefault(r["generation"], set()).add(r["step"])
    for generation, claimed in sorted(by_generation.items()):
        if len(claimed) > 1:
            problems.append(f"the ranks of generation {generation} restored different steps: {sorted(claimed)}")
    if "error" in result:
        if result["error"] not in TYPED_ENDS or not result.get("message"):
            problems.append(f"the run ended without a typed reason: {result['error']}: "
                            f"{result.get('message', '')[:500]}")
        return problems
    finals = records(out / "final")
    if not finals:
        return [*problems, "the run says it completed, but no rank recorded a final state"]
    last = max(r["generation"] for r in finals)
    ending = [r for r in finals if r["generation"] == last]
    world = ending[0]["world_size"]
    if sorted(r["rank"] for r in ending) != list(range(world)):
        problems.append(f"generation {last} completed with final states from ranks "
                        f"{sorted(r['rank'] for r in ending)} of {world}")
    resized = len({r["world_size"] for r in restores if "step" in r}) > 1
    for r in ending:
        if not config.steps <= r["step"] <= config.most_steps or r["step"] != ending[0]["step"]:
            problems.append(f"rank {r['rank']} ended at step {r['step']} (rank {ending[0]['rank']} at "
                            f"{ending[0]['step']}), not from {config.steps} to {config.most_steps}")
            continue
        truth = chaos_script.part(want(r["generation"])[r["step"]], r["rank"], r["world_size"])
        if (wrong := differences(r, truth, exact=not resized)):
            problems.append(f"wrong final state: rank {r['rank']}/{r['world_size']}: {wrong}")
    return problems


def judge_resources(config: Config, out: Path, result: dict[str, Any]) -> list[str]:
    """What the run held and whom it blamed, from the script's records and the agents' events: the memory bound
    holds in every step and every recovery (`judge_memory`), every lost peer a survivor names is one the harness
    killed (`judge_blame`), and a segment /dev/shm refuses costs "auto" nothing (`judge_setup`)."""
    return judge_memory(config, out) + judge_blame(out) + judge_setup(config, out, result)


def judge_memory(config: Config, out: Path) -> list[str]:
    """Every snapshot a rank kept fits snapshot_memory_limit by the documented bound of its actual sizes (over
    it, the product must refuse: SnapshotMemoryError), and a recovery sends rank 0 only what its new shards need
    (the boxes of its new state, a description per old rank's piece) and no more than fits beside what its
    snapshots held."""
    limit, problems, after = config.memory_limit, [], {}
    for r in records(out / "memory"):
        if r["after_restore"] is not None:
            after[(r["generation"], r["rank"])] = (r["after_restore"], r["world_size"])
        if limit and r["need"] > limit:
            problems.append(f"generation {r['generation']} rank {r['rank']}/{r['world_size']}: the snapshots it kept "
                            f"at step {r['at']} need {r['need']} bytes (2 x (its state + the parts it keeps) + 2 x the "
                            f"largest passing through), over snapshot_memory_limit {limit}, and nothing refused")
    for event in events(out):
        if event.get("kind") != "restored" or not event.get("received"):
            continue
        held, world = after.get((event["generation"], 0), (None, 0))
        if held is None:
            continue
        needs = recovery_need(config, world)
        if event["received"] > needs:
            problems.append(f"generation {event['generation']} rank 0/{world}: a recovery sent it "
                            f"{event['received']} bytes, where its new shards need {needs} at most")
        if limit and held + event["received"] > limit:
            problems.append(f"generation {event['generation']} rank 0: a recovery sent it {event['received']} "
                            f"bytes beside the {held} its snapshots held, over snapshot_memory_limit {limit}")
    return problems


PIECE_OVERHEAD = 512  # bytes of a recovery piece besides its boxes (its description and CRCs): at most, measured


def recovery_need(config: Config, world: int) -> int:
    """The most a recovery may send rank 0 of `world` ranks: its new state's bytes (the replicated arrays and its
    shards' boxes) and a piece's description from each old rank (at most the largest world, 4)."""
    shards = 8 * (chaos_script.M + chaos_script.F * config.incremental) // max(world, 1) + 16
    replicated = 8 * 4 + 8 * 4 * config.ranks_array
    return (shards + replicated) * (1 + config.other_snapshot) + 4 * PIECE_OVERHEAD


def judge_blame(out: Path) -> list[str]:
    """A survivor's PeerLostError names a rank that is gone: killed, exited, or stopped by the harness (alive
    again later, but lost while stopped). A named rank that met the failure itself (it recorded one) or trained
    on in a later generation, unstopped, was alive: the failure was blamed on a live rank. Once the harness has
    stopped a process, failures are not judged: the heartbeat then takes the stopped node for dead, its peers'
    agents abort them, and to the stopped ranks those peers left (by design, not the relay's error)."""
    path = out / "stopped.json"
    held = json.loads(path.read_text()) if path.exists() else {"pids": [], "first": float("inf")}
    stopped, first_stop = set(held["pids"]), held["first"]
    pids, lives = {}, {}
    for path, r in named_records(out / "restored"):
        pid = int(path.stem.rsplit("-p", 1)[1])
        pids[(r["generation"], r["rank"])] = pid
        lives.setdefault(pid, set()).add(r["generation"])
    lost = named_records(out / "lost")
    met = {(r["generation"], r["rank"]) for _, r in lost}
    problems = []
    for _, r in lost:
        g, peer = r["generation"], r["peer"]
        if r["error"] != "PeerLostError" or peer is None or pids.get((g, peer)) in stopped or r["time"] >= first_stop:
            continue
        pid = pids.get((g, peer))
        later = sorted(x for x in lives.get(pid, set()) if x > g)
        if (g, peer) in met or later:
            problems.append(f"generation {g} rank {r['rank']} blames rank {peer} for a lost peer, but rank {peer} "
                            + ("met the failure itself" if (g, peer) in met else f"trained on in generation {later[0]}")
                            + f": {r['message'][:300]}")
    return problems


def judge_setup(config: Config, out: Path, result: dict[str, Any]) -> list[str]:
    """A /dev/shm that refuses the segment (SHM_FAIL) is the ring for backend "auto": no generation fails for it.
    For backend "shm" it fails each generation as the collectives' failure, never as the user's code's ("train_fn
    raised": the worker replaced and the error taken for a bug in train_fn)."""
    if not config.shm_fail:
        return []
    failures = result.get("failures", []) + result.get("history", [])
    if config.backend == "shm":
        return [f"a segment /dev/shm refused was taken for train_fn's failure: {reason[:300]}"
                for f in failures if SETUP_FAILURE in (reason := json.dumps(f)) and "train_fn raised" in reason][:3]
    problems = [f"a segment /dev/shm refused failed a generation instead of the ring: {reason[:300]}"
                for f in failures if SETUP_FAILURE in (reason := json.dumps(f))][:3]
    return problems + [f"generation {r['generation']} rank {r['rank']} made a segment under SHM_FAIL: the fault "
                       "missed" for r in records(out / "restored") if r.get("backend") == "shm"][:1]


SETUP_FAILURE = "File too large"  # EFBIG, what a segment's creation meets under SHM_FAIL


def events(out: Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted((out / "events").glob("*.events.jsonl")) if (out / "events").exists() else []:
        for line in path.read_text().splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                continue  # a line an agent was killed while writing
    return found


def named_records(where: Path) -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for path in sorted(where.glob("*.json")) if where.exists() else []:
        try:
            found.append((path, json.loads(path.read_text())))
        except ValueError:
            continue
    return found


def started_at(restores: list[dict[str, Any]]) -> dict[int, int]:
    """For each generation, the world size the run last started from nothing at (a generation that restored
    nothing: no step was committed yet, or none survived): the shape the world-sized replicated array has
    there. A run may start over at any world size; what it must not do is change a restored array's shape."""
    fresh = {r["generation"]: r["world_size"] for r in restores if r.get("step") == 0 and r.get("source") is None}
    origin, size = {}, 0
    for generation in sorted({r["generation"] for r in restores}):
        size = fresh.get(generation, size)
        origin[generation] = size
    return origin


FLOAT_BOUND = 1e-12  # relative: the bound where the world size changed (the script's steps are exact anyway)


def differences(got: dict[str, Any], truth: dict[str, Any], *, exact: bool) -> str:
    wrong = []
    for name in ("w", "m", "r"):
        if name not in got and name not in truth:
            continue
        a, b = np.array(got.get(name, [])), np.array(truth.get(name, []))
        same = a.shape == b.shape and (np.array_equal(a, b) if exact else np.allclose(a, b, rtol=FLOAT_BOUND,
                                                                                     atol=0))
        if not same:
            wrong.append(f"{name} is {a.tolist()}, the uninterrupted run's is {b.tolist()}")
    if got.get("f") != truth.get("f"):
        wrong.append("f (the array that never changes) differs")
    return "; ".join(wrong)


_EXPECTED: dict[tuple[int, bool, int], list[dict[str, np.ndarray]]] = {}


def expected(steps: int, incremental: bool, ranks: int) -> list[dict[str, np.ndarray]]:
    """The uninterrupted run's state at every step, computed once per configuration in this process."""
    key = (steps, incremental, ranks)
    if key not in _EXPECTED:
        _EXPECTED[key] = chaos_script.reference(steps, incremental, ranks)
    return _EXPECTED[key]


def records(where: Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted(where.glob("*.json")) if where.exists() else []:
        try:
            found.append(json.loads(path.read_text()))
        except ValueError:
            continue  # a rank killed while writing it (write_json renames, so this is a stray temporary)
    return found


# ---- shrinking -----------------------------------------------------------------------------------------------


def shrink(schedule: Schedule, fails: Callable[[Schedule], bool], budget: int = 12) -> Schedule:
    """A minimal failing schedule (delta debugging, ddmin, over the fault list): no chunk of faults can be
    removed and still fail, within `budget` runs. `fails` runs a schedule and says whether it still fails.
    Real processes make a failure that depends on timing come and go: the result is minimal for the runs
    made, not a proof."""
    faults = list(schedule.faults)
    runs = 0

    def still_fails(candidate: list[Fault]) -> bool:
        nonlocal runs
        runs += 1
        return fails(dataclasses.replace(schedule, faults=tuple(candidate)))

    n = 2
    while len(faults) >= 2 and runs < budget:
        size = -(-len(faults) // n)
        chunks = [faults[i:i + size] for i in range(0, len(faults), size)]
        complements = [[f for f in faults if f not in chunk] for chunk in chunks] if n > 2 else []
        for candidate in [*chunks, *complements]:
            if runs >= budget:
                break
            if still_fails(candidate):
                faults, n = candidate, max(n - 1, 2) if candidate in complements else 2
                break
        else:
            if n >= len(faults):
                break
            n = min(len(faults), 2 * n)
    if len(faults) == 1 and runs < budget and still_fails([]):
        faults = []  # the configuration fails by itself
    return dataclasses.replace(schedule, faults=tuple(faults))


def report(outcome: Outcome) -> str:
    verdict = "PASS" if outcome.passed else "FAIL"
    lines = [f"{verdict} in {outcome.seconds:.0f}s, world sizes {outcome.worlds}, ended: {outcome.ended}",
             outcome.schedule.describe(), "  fired:", *(f"    {f}" for f in outcome.fired)]
    lines += [f"  problem: {p}" for p in outcome.problems]
    return "\n".join(lines)
