"""`make demo`: train the reference model, lose the process, resume from the latest checkpoint, check the files.

Why it exists: it shows the one promise SneppX makes, on real training a person can watch. A first process trains
the recipe-1 Transformer with a progress bar, saving a checkpoint every K steps through the asynchronous
CheckpointCoordinator (save() returns after a memory copy; a background thread writes and commits), and is then
killed with SIGKILL (a node failure, so the steps since the last checkpoint are lost; the demo lets its saves
commit first so that the story is the same on a busy machine: a kill during a save is the kill harness's job,
tests/integration/test_crash_kill.py). A new process resumes from the latest valid checkpoint and retrains the lost steps; their losses match the
first run's exactly, because parameters, optimizer moments, data position and RNG state all came back bitwise.
Finally every committed checkpoint is validated.

    python -m SneppX_ALG.demo [--output demo-output] [--steps 125] [--every 25] [--crash-at 85] [--small]

The orchestrator (`main`) runs both training phases as child processes of itself (`--phase first|resume`), with
one BLAS thread unless OPENBLAS_NUM_THREADS says otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from SneppX_ALG import coordinator
from SneppX_ALG.model import data, training
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
    parser.add_argument("--phase", choices=("first", "resume"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < args.every <= args.crash_at < args.steps:
        parser.error("need 0 < --every <= --crash-at < --steps (a checkpoint before the crash, steps after it)")
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


def _child(args: argparse.Namespace, phase: str, *extra: str) -> subprocess.CompletedProcess[Any]:
    argv = [sys.executable, "-m", "SneppX_ALG.demo", "--phase", phase, "--output", args.output,
            "--steps", str(args.steps), "--every", str(args.every), "--crash-at", str(args.crash_at),
            "--batch-size", str(args.batch_size), "--lr", repr(args.lr), *(["--small"] if args.small else []),
            *extra]
    # One BLAS thread unless the user chose: this model's matmuls are small, and on a busy 2-core machine
    # OpenBLAS's second thread spin-waits for a core (measured: 42 s instead of 75 s for the whole demo).
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return subprocess.run(argv, env=env, check=False)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase:
        return run_phase(args)

    from rich.console import Console
    from rich.table import Table

    console = Console()
    os.makedirs(args.output, exist_ok=True)
    shutil.rmtree(os.path.join(args.output, "ckpts"), ignore_errors=True)  # a previous demo's steps
    trainer = build_trainer(args)
    config = trainer.model.config
    console.rule("SneppX demo: train, crash, resume, validate")
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
        return 1
    resume_step = latest.step
    console.print(f"\nlatest valid checkpoint: {latest.location} (step {resume_step}); starting a new process\n")
    second = _child(args, "resume")
    if second.returncode != 0:
        console.print(f"[bold red]FAILED[/]: the resumed run exited with status {second.returncode}")
        return 1

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

    results = Table(title="every committed checkpoint, validated byte by byte")
    for column in ("step", "location", "size", "valid", "errors"):
        results.add_column(column)
    all_valid = True
    checkpoints = open_checkpoints(args)
    for step in checkpoints.committed_steps():
        problems = checkpoints.validate(step)
        all_valid &= not problems
        location = os.path.relpath(checkpoints.storage.step_path(step))  # the demo's root is local
        size = sum(os.path.getsize(os.path.join(location, f)) for f in os.listdir(location))
        results.add_row(str(step), location, f"{size / 2**20:.1f} MiB", "yes" if not problems else "NO",
                        "; ".join(problems))
    console.print(results)
    return 0 if continued and all_valid else 1


if __name__ == "__main__":
    sys.exit(main())
