"""The training script the ElasticTrainer tests run as a real program (python elastic_script.py OUT CKPT), and
the helpers that drive it: find its agents and workers by the role variables the launcher and agents set, wait
for its progress, kill parts of it with real signals.

The script trains the reference Transformer with DataParallelTrainer (ZeRO-1) through recipe 3's API. Rank 0
writes OUT/progress.json after each step and OUT/params.npz at the end; the launcher writes OUT/result.json
(generations, failures, events, or the error and its history). Knobs come from the environment (E_*).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

MODEL = {"vocab_size": 64, "dim": 16, "num_heads": 2, "num_layers": 1, "max_seq_len": 16, "seed": 0}
DATA = {"vocab_size": 64, "seq_len": 16, "num_sequences": 256, "seed": 1}
BATCH = 8


def knob(name: str, default: str) -> str:
    return os.environ.get(f"E_{name}", default)


def train_loop(ctx: Any) -> None:
    from SneppX_ALG.model import DataParallelTrainer, SyntheticLanguage, Transformer

    out = Path(knob("OUT", "."))
    steps, every, pause = int(knob("STEPS", "30")), int(knob("EVERY", "3")), float(knob("SLEEP", "0.05"))
    oom_at = int(knob("OOM_AT_STEP", "0"))  # rank 1 then takes memory until the OOM killer ends it, once a run
    model = Transformer(**MODEL)
    trainer = DataParallelTrainer(model, SyntheticLanguage(**DATA), ctx.group, batch_size=BATCH)
    ctx.restore(trainer)
    while trainer.step < steps:
        result = trainer.train_step()
        ctx.report(trainer.step, loss=result.loss)
        if ctx.rank == 0:
            write_json(out / "progress.json", {"step": trainer.step, "generation": ctx.generation,
                                               "world_size": ctx.world_size, "pid": os.getpid()})
        if trainer.step % every == 0:
            ctx.save(trainer, trainer.step)
        if trainer.step == oom_at and ctx.rank == 1:
            exhaust_memory(out / "oom-once")
        time.sleep(pause)
    if ctx.rank == 0:
        np.savez(out / "params.npz", **model.params)
        write_json(out / "final.json", {"step": trainer.step, "generation": ctx.generation,
                                        "world_size": ctx.world_size,
                                        "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                           "MASTER_ADDR", "MASTER_PORT")}})


def exhaust_memory(marker: Path) -> None:
    """Once per run (the marker is on the shared volume): take memory, touched, until the OOM killer ends us."""
    if marker.exists():
        return
    marker.write_text(str(os.getpid()))
    hoard = []
    while True:
        hoard.append(np.ones(16 << 20, dtype=np.uint8))


def write_json(path: Path, value: Any) -> None:
    temporary = path.with_suffix(f".tmp{os.getpid()}")
    temporary.write_text(json.dumps(value))
    os.replace(temporary, path)


def main() -> None:
    from SneppX_ALG import ElasticTrainer

    out, checkpoint_dir = Path(sys.argv[1]), sys.argv[2]
    out.mkdir(parents=True, exist_ok=True)
    os.environ["E_OUT"] = str(out)  # the agents and workers run this script again: they inherit it
    trainer = ElasticTrainer(
        train_fn=train_loop, checkpoint_dir=checkpoint_dir, max_restarts=int(knob("MAX_RESTARTS", "5")),
        restart_delay=float(knob("RESTART_DELAY", "0.2")), join_timeout=120,
        node_restart_delay=float(knob("NODE_RESTART_DELAY", "0.2")), last_call=5,
        # 5 s unless a test sets it, as recovery_script: at the default 1 s a loaded 2-core box killed every worker
        # of an S3 run as hung, again and again, until the restart budget was spent
        hang_timeout=float(knob("HANG_TIMEOUT", "5")))
    report_run(out, lambda: trainer.run(num_nodes=int(knob("NODES", "2")), num_gpus=int(knob("GPUS", "2"))))


def report_run(out: Path, run: Any) -> None:
    """Calls `run()` (an ElasticTrainer's run) and writes what came of it to OUT/result.json: the generations,
    failures and events, or the error, its type and the history (exit status 1)."""
    from SneppX_ALG import errors

    try:
        result = run()
    except (errors.RestartBudgetExhaustedError, errors.ElasticRunError) as e:
        history = [h if isinstance(h, dict) else {"reason": getattr(h, "reason", str(h))} for h in e.history]
        write_json(out / "result.json", {"error": type(e).__name__, "message": str(e), "history": history})
        sys.exit(1)
    write_json(out / "result.json", {"generations": result.generations, "failures": result.failures,
                                     "events": result.events})


# ---- driving it from a test ------------------------------------------------------------------------------------


class Run:
    """One run of this script as a child process (a subclass names another script and its knobs' prefix)."""

    SCRIPT = __file__
    KNOB_PREFIX = "E_"

    def __init__(self, out: Path, checkpoint_dir: str, run_id: str | None = None, **knobs: Any):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id or f"test-{secrets.token_hex(6)}"  # the launcher's run id: how its processes are found
        env = {**os.environ, **{f"{self.KNOB_PREFIX}{k.upper()}": str(v) for k, v in knobs.items()},
               "SNEPPX_RUN_ID": self.run_id}
        self.log = open(out / "log.txt", "wb")  # noqa: SIM115 - the child writes to it until stop() closes it
        self.proc = subprocess.Popen([sys.executable, self.SCRIPT, str(out), checkpoint_dir], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def final(self) -> dict[str, Any]:
        return json.loads((self.out / "final.json").read_text())

    def progress(self) -> dict[str, Any]:
        try:
            return json.loads((self.out / "progress.json").read_text())
        except (FileNotFoundError, ValueError):
            return {"step": 0, "generation": -1, "world_size": 0}

    def wait_for(self, predicate: Any, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            progress = self.progress()
            if predicate(progress):
                return progress
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended (code {self.proc.returncode}) before {predicate}: {self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"not reached within {timeout}s: {predicate}, at {progress}: {self.tail()}")
            time.sleep(0.02)

    def processes(self) -> list[tuple[int, str, str, str]]:
        """(pid, role, agent id, local rank) of this run's live agents and workers."""
        from SneppX_ALG import demo  # the test's side only: the script's own processes never need it

        return demo.run_processes(self.run_id)

    def worker(self, agent_id: str, local_rank: int) -> int:
        return self._find("worker", agent_id, str(local_rank))

    def agent(self, agent_id: str) -> int:
        return self._find("agent", agent_id, "")

    def _find(self, role: str, agent_id: str, local_rank: str, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pid, r, a, lr in self.processes():
                if (r, a, lr) == (role, agent_id, local_rank) and process_state(pid) not in ("Z", "T", None):
                    return pid
            time.sleep(0.05)
        raise AssertionError(f"no live {role} {agent_id}/{local_rank}: {self.processes()}")

    def finish(self, timeout: float = 240) -> dict[str, Any]:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the run did not finish within {timeout}s: {self.tail()}") from None
        return json.loads((self.out / "result.json").read_text())

    def tail(self) -> str:
        self.log.flush()
        return (self.out / "log.txt").read_text(errors="replace")[-3000:]

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid, *_ in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.log.close()


def params_in(out: Path) -> dict[str, np.ndarray]:
    """The final parameters rank 0 wrote."""
    with np.load(out / "params.npz", allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def process_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def assert_params_match(out: Path, steps: int) -> None:
    """The run that wrote to `out` ended at the parameters of the same training uninterrupted in one process.

    Measured against one step's movement there (the L2 distance from step `steps - 1` to `steps`, all parameters
    together): world sizes and transports differ in summation order only, float noise that training amplifies
    to about 0.001 of a step by step 200; an update lost or repeated anywhere in the run ends 0.9-7 steps away.
    A per-element tolerance cannot split the two: AdamW's normalised update lifts the noise on elements near zero
    to the size of the elements themselves."""
    before, expected = reference_params(steps)
    got = params_in(out)
    assert set(got) == set(expected)
    one_step = distance(expected, before)
    off = distance(got, expected)
    worst = max(expected, key=lambda name: float(np.abs(got[name] - expected[name]).max()))
    assert off <= 0.05 * one_step, (f"{off / one_step:.3f} steps from the uninterrupted run's step {steps} "
                                    f"(noise is ~0.001); furthest: {worst}")


def distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum((a[k].astype(np.float64) - b[k]) ** 2)) for k in a))


def reference_params(steps: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The same training, uninterrupted, in one process (world size 1): its parameters after `steps - 1` steps
    and after `steps`, where every run must end."""
    import tempfile

    from directory_store import DirectoryStore

    from SneppX_ALG import collectives
    from SneppX_ALG.model import DataParallelTrainer, SyntheticLanguage, Transformer

    model = Transformer(**MODEL)
    with tempfile.TemporaryDirectory() as scratch:
        group = collectives.ProcessGroup(DirectoryStore(scratch), 0, 1)
        trainer = DataParallelTrainer(model, SyntheticLanguage(**DATA), group, batch_size=BATCH)
        trainer.train(steps - 1)
        before = {k: np.array(v) for k, v in model.params.items()}
        trainer.train(1)
        group.close()
    return before, {k: np.array(v) for k, v in model.params.items()}


if __name__ == "__main__":
    main()
