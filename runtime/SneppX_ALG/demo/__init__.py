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

Modules (each imports only those before it), none imported by the library: phases (what the child processes
run, and their command lines), events (a run's event files read, its processes found and killed), display (what
rich shows), scenario (the two scenes and `main`); `__main__` runs `main`. Every name is importable from here.
"""

from __future__ import annotations

from SneppX_ALG.demo.display import RunDisplay, print_elastic_story, validate_checkpoints
from SneppX_ALG.demo.events import EventLog, Recovery, kill_node, recovery_after, run_processes
from SneppX_ALG.demo.phases import (
    KILLED_NODE,
    MODEL_SIZES,
    NODES,
    WORKERS_PER_NODE,
    build_trainer,
    child_command,
    child_environment,
    elastic_paths,
    elastic_train_loop,
    open_checkpoints,
    parse_args,
    read_losses,
    run_elastic_phase,
    run_phase,
)
from SneppX_ALG.demo.scenario import crash_and_resume_scene, elastic_scene, main

__all__ = [
    "KILLED_NODE",
    "MODEL_SIZES",
    "NODES",
    "WORKERS_PER_NODE",
    "EventLog",
    "Recovery",
    "RunDisplay",
    "build_trainer",
    "child_command",
    "child_environment",
    "crash_and_resume_scene",
    "elastic_paths",
    "elastic_scene",
    "elastic_train_loop",
    "kill_node",
    "main",
    "open_checkpoints",
    "parse_args",
    "print_elastic_story",
    "read_losses",
    "recovery_after",
    "run_elastic_phase",
    "run_phase",
    "run_processes",
    "validate_checkpoints",
]
