"""`make demo`: training that survives losing its process, then a node, on a run a person can watch.

Why it exists: it shows the promise SneppX makes. Scene 1: a first process trains the recipe-1 Transformer with a
progress bar, saving a checkpoint every K steps through the asynchronous CheckpointCoordinator (save() returns
after a memory copy; a background thread writes and commits), and is then killed with SIGKILL (a node failure, so
the steps since the last checkpoint are lost; the demo lets its saves commit first so that the story is the same
on a busy machine: a kill during a save is the kill harness's job, tests/integration/test_crash_kill.py). A new
process resumes from the latest valid checkpoint and retrains the lost steps; their losses match the first run's
exactly, because parameters, optimizer moments, data position and RNG state all came back bitwise. Finally every
committed checkpoint is validated.

Scene 2: an ElasticTrainer runs 2 nodes x 2 workers (processes on this machine) training the same model
data-parallel with sharded optimizer state. Node-1 (its agent and its workers) is SIGKILLed mid-run; the survivors
re-form at world size 2, restore the newest checkpoint resharded and go on; the launcher brings node-1 back, it
joins at the next checkpoint and the world grows back to 4. A live display shows generations, world size, loss
and the measured detect and resume times (read from the agents' event files, as `python -m bench elastic` does);
then every committed checkpoint is validated.

    python -m SneppX_ALG.demo [--output demo-output] [--scene all|resume|elastic] [--small]
        [--steps 125] [--every 25] [--crash-at 85]                                            (scene 1)
        [--elastic-steps 200] [--elastic-every 10] [--kill-at 40] [--node-restart-delay 3]    (scene 2)

The orchestrator (`main`) runs the training as child processes of itself (`--phase first|resume|elastic`), with
one BLAS thread unless OPENBLAS_NUM_THREADS says otherwise.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from SneppX_ALG import coordinator, errors
from SneppX_ALG.contract.env import ENV_AGENT_ID, ENV_LOCAL_RANK, ENV_ROLE, ENV_RUN_ID
from SneppX_ALG.elastic import trainer as elastic_trainer
from SneppX_ALG.elastic import worker
from SneppX_ALG.model import data, data_parallel, training
from SneppX_ALG.model import transformer as model_lib

# The recipe-1 model, and a tiny one for quick runs (tests).
MODEL_SIZES: dict[str, dict[str, int]] = {
    "recipe": {"vocab_size": 1000, "dim": 128, "num_heads": 4, "num_layers": 2, "ffn_dim": 512, "max_seq_len": 64},
    "small": {"vocab_size": 64, "dim": 32, "num_heads": 4, "num_layers": 2, "ffn_dim": 64, "max_seq_len": 16},
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m SneppX_ALG.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="demo-output", help="directory for checkpoints and loss logs")
    parser.add_argument("--steps", type=int, default=125, help="total training steps")
    parser.add_argument("--every", type=int, default=25, help="checkpoint every K steps")
    parser.add_argument("--crash-at", type=int, default=85, help="the first process is killed after this step")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--small", action="store_true", help="a tiny model (seconds; for tests)")
    parser.add_argument("--scene", choices=("all", "resume", "elastic"), default="all",
                        help="resume: scene 1 only; elastic: scene 2 only")
    scene2 = parser.add_argument_group("scene 2 (elastic training)")
    scene2.add_argument("--elastic-steps", type=int, default=200, help="total training steps")
    scene2.add_argument("--elastic-every", type=int, default=10, help="checkpoint every K steps")
    scene2.add_argument("--kill-at", type=int, default=45, help="node-1 is killed after this step")
    scene2.add_argument("--snapshot-every", type=int, default=1,
                        help="peer-memory snapshot every N steps (0: none; recovery then redoes the steps since "
                             "the last checkpoint)")
    scene2.add_argument("--node-restart-delay", type=float, default=3.0,
                        help="seconds before the killed node comes back (the shrunken world runs meanwhile)")
    scene2.add_argument("--min-step-time", type=float, default=0.05,
                        help="seconds a step takes at least, so that a person can follow the run")
    scene2.add_argument("--max-restarts", type=int, default=3, help="failures the run survives")
    parser.add_argument("--phase", choices=("first", "resume", "elastic"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < args.every <= args.crash_at < args.steps:
        parser.error("need 0 < --every <= --crash-at < --steps (a checkpoint before the crash, steps after it)")
    if not 0 < args.elastic_every <= args.kill_at < args.elastic_steps:
        parser.error("need 0 < --elastic-every <= --kill-at < --elastic-steps")
    return args


# --- the pieces each training process uses ---------------------------------------------------------------------


def build_trainer(args: argparse.Namespace) -> training.Trainer:
    """The same model, data and optimizer settings in every process: only checkpoints carry state across."""
    sizes = MODEL_SIZES["small" if args.small else "recipe"]
    model = model_lib.Transformer(**sizes, seed=0)
    language = data.SyntheticLanguage(vocab_size=sizes["vocab_size"], seq_len=sizes["max_seq_len"],
                                          num_sequences=2048, seed=0)
    return training.Trainer(model, language, batch_size=args.batch_size, lr=args.lr, warmup_steps=10, seed=0)


def open_checkpoints(args: argparse.Namespace) -> coordinator.CheckpointCoordinator:
    """The demo's one checkpoint store: async saves every K steps into <output>/ckpts, leftovers cleaned."""
    return coordinator.CheckpointCoordinator(os.path.join(args.output, "ckpts"), save_every_n_steps=args.every,
                                             max_to_keep=5, async_save=True)


def read_losses(path: str) -> dict[int, float]:
    losses = {}
    with open(path, encoding="utf-8") as log:
        for line in log:
            if line.strip():
                record = json.loads(line)
                losses[int(record["step"])] = float(record["loss"])
    return losses


def run_phase(args: argparse.Namespace) -> int:
    """One training process: `first` from scratch until it is killed, `resume` from a checkpoint to the end."""
    from rich.console import Console

    console = Console()
    trainer = build_trainer(args)
    checkpoints = open_checkpoints(args)
    if args.phase == "resume":
        info = checkpoints.restore(trainer.model)
        if info is None:
            raise SystemExit("no valid checkpoint to resume from")
        console.print(f"[bold]resumed[/] from {info.location}: step {trainer.step}, optimizer, data position "
                      f"(epoch {trainer.stream.epoch}, batch {trainer.stream.cursor // trainer.stream.batch_size})"
                      " and RNG restored")
    stop_at = args.crash_at if args.phase == "first" else args.steps
    log_path = os.path.join(args.output, f"losses-{args.phase}.jsonl")
    with open(log_path, "w", encoding="utf-8") as log, training.ProgressBar(
            args.steps, start_step=trainer.step, description=f"{args.phase} run", console=console) as bar:
        def on_step(result: training.StepResult) -> None:
            bar(result)
            log.write(json.dumps({"step": result.step, "loss": result.loss}) + "\n")
            log.flush()
            if checkpoints.should_save(result.step):
                began = time.perf_counter()
                checkpoints.save(trainer.model, step=result.step)
                bar.log(f"step {result.step}: loss {result.loss:.4f}, async checkpoint saved in "
                        f"{(time.perf_counter() - began) * 1e3:.1f} ms (training goes on while it is written)")

        trainer.train(stop_at - trainer.step, on_step=on_step)
    if args.phase == "resume":
        checkpoints.close()  # waits for the last save to commit
    if args.phase == "first":
        # Without this, on a loaded machine every async save could still be in flight at the kill, and there would
        # be nothing to resume from; the crash tests cover that case, the demo shows a resume.
        checkpoints.wait()
        console.print(f"[bold red]step {trainer.step}: simulating a node failure (SIGKILL); the steps since the "
                      "last checkpoint are lost[/]")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return 0


# --- the orchestrator ------------------------------------------------------------------------------------------


def child_command(args: argparse.Namespace, phase: str) -> list[str]:
    """This module again, as one phase of the demo, with the orchestrator's settings."""
    return [sys.executable, "-m", "SneppX_ALG.demo", "--phase", phase, "--output", args.output,
            "--steps", str(args.steps), "--every", str(args.every), "--crash-at", str(args.crash_at),
            "--elastic-steps", str(args.elastic_steps), "--elastic-every", str(args.elastic_every),
            "--kill-at", str(args.kill_at), "--node-restart-delay", repr(args.node_restart_delay),
            "--min-step-time", repr(args.min_step_time), "--max-restarts", str(args.max_restarts),
            "--snapshot-every", str(args.snapshot_every),
            "--batch-size", str(args.batch_size), "--lr", repr(args.lr), *(["--small"] if args.small else [])]


def child_environment(**extra: str) -> dict[str, str]:
    # One BLAS thread unless the user chose: this model's matmuls are small, and on a busy 2-core machine
    # OpenBLAS's second thread spin-waits for a core (measured: 42 s instead of 75 s for the whole demo).
    env = {**os.environ, **extra}
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def _child(args: argparse.Namespace, phase: str) -> subprocess.CompletedProcess[Any]:
    return subprocess.run(child_command(args, phase), env=child_environment(), check=False)


def crash_and_resume_scene(args: argparse.Namespace, console: Any) -> bool:
    """Scene 1: one process trains and is SIGKILLed, a new one resumes with the same losses; True if it did."""
    from rich.table import Table

    shutil.rmtree(os.path.join(args.output, "ckpts"), ignore_errors=True)  # a previous demo's steps
    trainer = build_trainer(args)
    config = trainer.model.config
    console.rule("SneppX demo, scene 1: train, crash, resume, validate")
    console.print(f"model: {trainer.model!r}, {trainer.model.num_params:,} parameters")
    console.print(f"data: a generated language of {config.vocab_size} tokens; uniform guessing costs "
                  f"{math.log(config.vocab_size):.2f} nats/token, the grammar's floor is "
                  f"{data.SyntheticLanguage().loss_floor:.2f}")
    console.print(f"plan: {args.steps} steps, a checkpoint every {args.every}, the first process is killed after "
                  f"step {args.crash_at}\n")
    del trainer

    started = time.perf_counter()
    first = _child(args, "first")
    console.print(f"first process ended by signal {-first.returncode}" if first.returncode < 0
                  else f"first process exited with status {first.returncode}")
    latest = open_checkpoints(args).latest()  # also cleans what the killed save left behind
    if first.returncode != -signal.SIGKILL or latest is None:
        console.print("[bold red]FAILED[/]: the first run should die by SIGKILL after writing a checkpoint")
        return False
    resume_step = latest.step
    console.print(f"\nlatest valid checkpoint: {latest.location} (step {resume_step}); starting a new process\n")
    second = _child(args, "resume")
    if second.returncode != 0:
        console.print(f"[bold red]FAILED[/]: the resumed run exited with status {second.returncode}")
        return False

    first_losses = read_losses(os.path.join(args.output, "losses-first.jsonl"))
    resumed_losses = read_losses(os.path.join(args.output, "losses-resume.jsonl"))
    replayed = sorted(set(first_losses) & set(resumed_losses))
    table = Table(title=f"steps retrained after the crash (lost since the step-{resume_step} checkpoint)")
    for column in ("step", "loss, first process", "loss, resumed process", "same"):
        table.add_column(column, justify="right")
    same = [first_losses[s] == resumed_losses[s] for s in replayed]
    for step, equal in zip(replayed, same):
        table.add_row(str(step), repr(first_losses[step]), repr(resumed_losses[step]), "yes" if equal else "NO")
    console.print(table)
    continued = min(resumed_losses) == resume_step + 1 and bool(replayed) and all(same)
    curve = [first_losses[s] for s in sorted(first_losses) if s <= resume_step] + \
        [resumed_losses[s] for s in sorted(resumed_losses)]
    if continued:
        console.print(f"[bold green]training continued from step {resume_step} with the same loss curve[/]: "
                      f"the {len(replayed)} retrained steps have bitwise-identical losses")
    else:
        console.print(f"[bold red]FAILED[/]: the resumed run did not continue from step {resume_step} identically")
    console.print(f"loss: {curve[0]:.3f} at step 1 -> {curve[-1]:.3f} at step {len(curve)} "
                  f"(floor {data.SyntheticLanguage().loss_floor:.3f}); both processes took "
                  f"{time.perf_counter() - started:.1f} s\n")
    return validate_checkpoints(open_checkpoints(args), console) and continued


def validate_checkpoints(checkpoints: coordinator.CheckpointCoordinator, console: Any) -> bool:
    """Prints a table of every committed step of `checkpoints` (a local root), validated; True if all are valid."""
    from rich.table import Table

    results = Table(title="every committed checkpoint, validated byte by byte")
    for column in ("step", "location", "size", "valid", "errors"):
        results.add_column(column)
    all_valid = True
    for step in checkpoints.committed_steps():
        problems = checkpoints.validate(step)
        all_valid &= not problems
        location = checkpoints.storage.step_path(step)  # the demo's roots are local
        size = sum(os.path.getsize(os.path.join(location, f)) for f in os.listdir(location))
        shown = os.path.relpath(location) if not os.path.relpath(location).startswith("..") else location
        results.add_row(str(step), shown, f"{size / 2**20:.1f} MiB", "yes" if not problems else "NO",
                        "; ".join(problems))
    console.print(results)
    return all_valid


# --- scene 2: elastic training ---------------------------------------------------------------------------------
#
# `main` starts `--phase elastic` as a child: it calls ElasticTrainer.run(), whose launcher runs that same command
# line again for each node agent and worker, so `--phase elastic` leads straight to run(). The agents append their
# events (generations, failures, restores, rank 0's steps) as JSON lines to <output>/elastic-events/; the
# orchestrator reads them for its display and its figures (so does `python -m bench elastic`), and kills a node.

NODES, WORKERS_PER_NODE = 2, 2
KILLED_NODE = "node-1"


def elastic_paths(args: argparse.Namespace) -> tuple[str, str]:
    """Scene 2's checkpoint root (which also holds the run's rendezvous records) and its events directory."""
    return os.path.join(args.output, "elastic-ckpts"), os.path.join(args.output, "elastic-events")


def elastic_train_loop(args: argparse.Namespace, ctx: worker.TrainContext) -> None:
    """Scene 2's train_fn, run by every rank of each generation: the reference model, data-parallel over
    ctx.group, resumed from the newest valid checkpoint (resharded for this world size), saved every K steps."""
    sizes = MODEL_SIZES["small" if args.small else "recipe"]
    model = model_lib.Transformer(**sizes, seed=0)
    language = data.SyntheticLanguage(vocab_size=sizes["vocab_size"], seq_len=sizes["max_seq_len"],
                                      num_sequences=2048, seed=0)
    trainer = data_parallel.DataParallelTrainer(model, language, ctx.group, batch_size=args.batch_size, lr=args.lr,
                                                warmup_steps=10, seed=0)
    ctx.restore(trainer)
    while trainer.step < args.elastic_steps:
        began = time.monotonic()
        result = trainer.train_step()
        ctx.report(result.step, loss=result.loss)
        if result.step % args.elastic_every == 0 or result.step == args.elastic_steps:
            ctx.save(trainer, result.step)
        time.sleep(max(0.0, args.min_step_time - (time.monotonic() - began)))


def run_elastic_phase(args: argparse.Namespace) -> int:
    """The child of scene 2 (and, run again by the launcher, each of its node agents and workers)."""
    checkpoint_dir, events_dir = elastic_paths(args)
    trainer = elastic_trainer.ElasticTrainer(
        functools.partial(elastic_train_loop, args), checkpoint_dir, max_restarts=args.max_restarts,
        restart_delay=0.0,  # re-form at once: the demo shows the mechanism's own times, not a backoff
        join_timeout=120, node_restart_delay=args.node_restart_delay, events_dir=events_dir,
        snapshot_every=args.snapshot_every)
    try:
        trainer.run(num_nodes=NODES, num_gpus=WORKERS_PER_NODE)
    except errors.SneppXError as e:
        print(f"the elastic run failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


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


class RunDisplay:
    """Scene 2's live view of a run's events: a line for each generation, failure, join and restore, and a
    progress bar with the step, loss, world size and generation (rank 0's)."""

    def __init__(self, console: Any, args: argparse.Namespace):
        from rich import progress

        self.every = args.elastic_every
        self.world: dict[int, int] = {}  # generation -> world size
        self.step = 0
        self.killed_at: float | None = None
        self._said: set[tuple[str, int]] = set()  # (kind, generation) already shown
        self.bar = progress.Progress(
            progress.TextColumn("[bold]elastic run"), progress.BarColumn(),
            progress.TextColumn("step {task.completed:>4.0f}/{task.total:.0f}"),
            progress.TextColumn("loss {task.fields[loss]:.4f}"),
            progress.TextColumn("world size {task.fields[world]}"),
            progress.TextColumn("generation {task.fields[generation]}"), progress.TimeElapsedColumn(),
            console=console, transient=False)
        self._task = self.bar.add_task("", total=args.elastic_steps, loss=float("nan"), world="-", generation="-")

    def say(self, message: str) -> None:
        self.bar.console.print(message)

    def _since_kill(self, event: dict[str, Any]) -> str:
        return "" if self.killed_at is None else f", {event['t'] - self.killed_at:.2f} s after the kill"

    def show(self, e: dict[str, Any]) -> None:
        kind = e["kind"]
        generation = e.get("generation", max(self.world, default=-1))  # a failure ends the newest generation
        first_time = (kind, generation) not in self._said
        self._said.add((kind, generation))
        world = self.world.get(generation, "?")
        if kind == "generation" and first_time:
            self.world[generation] = e["world_size"]
            self.say(f"[bold]generation {generation}[/]: world size {e['world_size']}, nodes "
                     f"{', '.join(e['members'])} (sealed{self._since_kill(e)})")
        elif kind == "failure" and first_time:  # an agent may record several for one incident
            self.say(f"[bold red]{e['agent']} detected a failure[/]{self._since_kill(e)}: {e['reason'][:160]}")
        elif kind == "join_pending" and first_time:
            self.say(f"{', '.join(e['waiting'])} is back and asks to join: the ranks stop at the next checkpoint "
                     f"(every {self.every} steps)")
        elif kind == "restored" and first_time and generation > 0:
            rolled = f", rolled back past {[r['step'] for r in e['rolled_back']]}" if e["rolled_back"] else ""
            where = ("from peer memory" if e.get("source") == "memory"
                     else f"from storage{f' ({why})' if (why := e.get('why')) else ''}")
            self.say(f"generation {generation} restored step {e['step']} {where}, resharded for world size "
                     f"{world}{rolled}")
        elif kind == "step":
            if first_time and generation > 0:
                self.say(f"[bold green]training again[/] at world size {world}{self._since_kill(e)}")
            self.step = e["step"]
            self.bar.update(self._task, completed=e["step"], world=world, generation=generation)
            if "loss" in e["metrics"]:  # ctx.save reports the step again, without metrics
                self.bar.update(self._task, loss=e["metrics"]["loss"])


def elastic_scene(args: argparse.Namespace, console: Any) -> bool:
    """Scene 2: 2 nodes x 2 workers train; node-1 is SIGKILLed; the survivors go on at world size 2; node-1 comes
    back and the world grows to 4 again; every checkpoint is validated. True if all of that happened."""
    checkpoint_dir, events_dir = elastic_paths(args)
    for path in (checkpoint_dir, events_dir):
        shutil.rmtree(path, ignore_errors=True)  # a previous demo's
    console.rule("SneppX demo, scene 2: elastic training loses a node, shrinks, and grows back")
    console.print(f"plan: ElasticTrainer, {NODES} nodes x {WORKERS_PER_NODE} workers (processes on this machine), "
                  f"data-parallel with sharded optimizer state, {args.elastic_steps} steps, a checkpoint every "
                  f"{args.elastic_every}"
                  + (f", a peer-memory snapshot every {args.snapshot_every}" if args.snapshot_every else "") +
                  f"; {KILLED_NODE} (its agent and its workers) is SIGKILLed after step "
                  f"{args.kill_at} and comes back {args.node_restart_delay:g} s later\n")
    run_id = f"demo-{secrets.token_hex(4)}"
    log_path = os.path.join(args.output, "elastic-run.log")
    with open(log_path, "wb") as log_file:
        child = subprocess.Popen(child_command(args, "elastic"), stdout=log_file, stderr=subprocess.STDOUT,
                                 env=child_environment(SNEPPX_RUN_ID=run_id), start_new_session=True)
    log = EventLog(events_dir)
    display = RunDisplay(console, args)
    deadline = time.monotonic() + 600
    with display.bar:
        while child.poll() is None and time.monotonic() < deadline:
            for e in log.poll():
                display.show(e)
            if display.killed_at is None and display.step >= args.kill_at:
                # half a step later: after that step's snapshot reached its peers, before the next one's (a
                # failure while a snapshot is in flight redoes that step: `python -m bench elastic` times
                # failures at random moments)
                time.sleep(args.min_step_time / 2)
                display.killed_at = kill_node(run_id, KILLED_NODE)
                display.say(f"[bold red]step {display.step}: SIGKILL to {KILLED_NODE}[/] (its agent and its "
                            f"{WORKERS_PER_NODE} workers: a node failure)")
            near = display.killed_at is None and display.step >= args.kill_at - 2
            time.sleep(0.005 if near else 0.05)  # the step to kill at is seen within a few ms
        if child.poll() is None:  # past the deadline: end the run (the story check below fails)
            for pid in [child.pid] + [pid for pid, role, *_ in run_processes(run_id) if role == "agent"]:
                os.killpg(pid, signal.SIGKILL)
        child.wait()
        for e in log.poll():
            display.show(e)
    story = print_elastic_story(args, display, log.events, child.returncode, log_path, console)
    return validate_checkpoints(coordinator.CheckpointCoordinator(checkpoint_dir), console) and story


def print_elastic_story(args: argparse.Namespace, display: RunDisplay, events: list[dict[str, Any]],
                        returncode: int, log_path: str, console: Any) -> bool:
    """The figures of scene 2's node loss, and whether the story happened: 4 ranks, then 2 after the kill,
    then 4 again, and a run that finished."""
    from rich.table import Table

    full = NODES * WORKERS_PER_NODE
    sizes = [display.world[g] for g in sorted(display.world)]
    killed_at = display.killed_at
    recovery = None if killed_at is None else recovery_after(events, killed_at)
    if killed_at is None or recovery is None:
        console.print(f"[bold red]FAILED[/]: {KILLED_NODE} was not killed, or the run did not recover (exit "
                      f"status {returncode}); its log is {log_path}")
        return False
    regrown = next((e for e in events if e["kind"] == "step" and e["t"] > killed_at + recovery.resumed
                    and display.world.get(e["generation"]) == full), None)  # the first step at 4 again
    figures = Table(title=f"{KILLED_NODE} SIGKILLed: seconds after the kill")
    for column in ("", "measured", "goal"):
        figures.add_column(column, justify="right")
    figures.add_row("failure detected", f"{recovery.detected:.2f} s", "under 1 s")
    figures.add_row(f"generation at world size {recovery.world_size} sealed", f"{recovery.sealed:.2f} s", "")
    figures.add_row("training again (its first step)", f"{recovery.resumed:.2f} s", "under 5 s")
    if recovery.source == "memory":
        figures.add_row("steps redone", f"{recovery.lost_steps} (restored from peer memory)", "0 (at most 1)")
    else:
        figures.add_row("steps redone (since the last checkpoint)", f"{recovery.lost_steps} (restored from storage)",
                        f"at most {2 * args.elastic_every}")
    if regrown is not None:
        figures.add_row(f"back at world size {full} (after a {args.node_restart_delay:g} s restart delay)",
                        f"{regrown['t'] - killed_at:.2f} s", "")
    console.print(figures)
    console.print(f"{recovery.lost_steps} steps redone (restored from "
                  + ("peer memory)" if recovery.source == "memory" else f"storage: {recovery.why or 'snapshots off'})"))
    console.print(f"world sizes, generation by generation: {' -> '.join(map(str, sizes))}")
    if (returncode == 0 and regrown is not None and sizes[:1] == [full]
            and recovery.world_size == full - WORKERS_PER_NODE and sizes[-1] == full):
        console.print(f"[bold green]the run survived the loss of a node[/]: it went on at world size "
                      f"{recovery.world_size} and grew back to {full} when {KILLED_NODE} returned; every rank "
                      f"finished step {args.elastic_steps}")
        return True
    console.print(f"[bold red]FAILED[/]: the elastic run (exit status {returncode}) did not shrink to "
                  f"{full - WORKERS_PER_NODE} and grow back to {full} as planned; its log is {log_path}")
    return False


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase == "elastic":
        return run_elastic_phase(args)
    if args.phase:
        return run_phase(args)

    from rich.console import Console

    console = Console()
    os.makedirs(args.output, exist_ok=True)
    ok = True
    if args.scene in ("all", "resume"):
        ok &= crash_and_resume_scene(args, console)
    if args.scene in ("all", "elastic"):
        ok &= elastic_scene(args, console)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
