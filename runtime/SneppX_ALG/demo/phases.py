"""The demo's training processes, and the command lines that start them: scene 1's `first` and `resume` runs of
the recipe-1 Transformer with an asynchronous CheckpointCoordinator, and scene 2's ElasticTrainer run (its train
loop, run by every rank of each generation), all children of the orchestrator (scenario.py).

Why a module of its own: this is what runs inside the child processes (`--phase first|resume|elastic`), agents
and workers included; it never watches or displays a run.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from SneppX_ALG import coordinator, errors
from SneppX_ALG.elastic import trainer as elastic_trainer
from SneppX_ALG.elastic import worker
from SneppX_ALG.model import data, data_parallel, training
from SneppX_ALG.model import transformer as model_lib


def _package_doc() -> str:
    """The demo's own description: the package docstring (python -m SneppX_ALG.demo --help prints its first
    paragraph)."""
    return importlib.import_module(__package__ or "SneppX_ALG.demo").__doc__ or ""


# The recipe-1 model, and a tiny one for quick runs (tests).
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "recipe": {"vocab_size": 1000, "dim": 128, "num_heads": 4, "num_layers": 2, "ffn_dim": 512, "max_seq_len": 64},
    "small": {"vocab_size": 64, "dim": 32, "num_heads": 4, "num_layers": 2, "ffn_dim": 64, "max_seq_len": 16},
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m SneppX_ALG.demo", description=_package_doc().split("\n\n")[0])
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
