"""The demo's two scenes, as the orchestrator (`main`) plays them: scene 1 starts a training process, sees it
SIGKILLed, resumes in a new one and compares the losses; scene 2 starts an ElasticTrainer run, kills a node at the
planned step and waits for the world to shrink and grow back. Each ends by validating every committed checkpoint.

Why a module of its own: the story (what is started, killed and checked, and when) apart from the processes
that train (phases.py), the events it watches (events.py) and what it shows (display.py).
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from SneppX_ALG import coordinator
from SneppX_ALG.demo.display import RunDisplay, print_elastic_story, validate_checkpoints
from SneppX_ALG.demo.events import EventLog, kill_node, run_processes
from SneppX_ALG.demo.phases import (
    KILLED_NODE,
    NODES,
    WORKERS_PER_NODE,
    build_trainer,
    child_command,
    child_environment,
    elastic_paths,
    open_checkpoints,
    parse_args,
    read_losses,
    run_elastic_phase,
    run_phase,
)
from SneppX_ALG.model import data


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
