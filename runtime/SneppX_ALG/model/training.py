"""Training the reference model: a generated data set, a resumable data position, and the train loop.

Why it exists: SneppX's claims (a resumed job continues exactly where it stopped) need training whose whole state
can be saved and restored. Everything here is deterministic and seeded, so "resume in a new process" can be
checked bitwise against "never stopped":

- `data_lib.SyntheticLanguage` generates the data set (no download): a seeded tiny grammar in which every token has a
  few possible successors with fixed probabilities. A small model visibly learns it, and its entropy is the
  lowest loss any model can reach (`loss_floor`), so a learning curve has a known target.
- `data_lib.DataStream` hands out batches in a shuffled order per epoch. Its position (epoch, cursor, the epoch's order)
  and its RNG state are tensors in the training state.
- `Trainer` runs forward, backward, gradient clipping and AdamW with warmup, and attaches itself to the model so
  `model.save_checkpoint(path, include_optimizer=True)` writes the complete training state.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, Self

import numpy as np

from SneppX_ALG import errors
from SneppX_ALG.model import data as data_lib
from SneppX_ALG.model import optimizer
from SneppX_ALG.model import transformer as model_lib

# Successor probabilities of the grammar: a few likely continuations, like word choice in a sentence.
SUCCESSOR_PROBS = (0.6, 0.25, 0.1, 0.05)


# --- the train loop -------------------------------------------------------------------------------------------------


def learning_rate(step: int, base_lr: float, warmup_steps: int) -> float:
    """Linear warmup to base_lr over warmup_steps, then constant. step counts from 1."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return base_lr
    return base_lr * step / warmup_steps


def clip_scale(norm: float, max_norm: float) -> float | None:
    """The factor that brings a gradient of L2 norm `norm` down to max_norm, or None when it needs none."""
    return max_norm / (norm + 1e-6) if max_norm > 0 and norm > max_norm else None


def clip_by_global_norm(grads: Mapping[str, np.ndarray], max_norm: float) -> float:
    """Scales grads in place so their global L2 norm is at most max_norm; returns the norm before clipping."""
    norm = math.sqrt(sum(float(np.vdot(g, g)) for g in grads.values()))
    scale = clip_scale(norm, max_norm)
    if scale is not None:
        for g in grads.values():
            g *= g.dtype.type(scale)
    return norm


@dataclasses.dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    seconds: float


def run_steps(train_step: Callable[[], StepResult], num_steps: int,
              on_step: Callable[[StepResult], None] | None = None) -> list[float]:
    """Calls train_step num_steps times and on_step after each; returns the losses. Every trainer's train()."""
    losses = []
    for _ in range(num_steps):
        result = train_step()
        losses.append(result.loss)
        if on_step is not None:
            on_step(result)
    return losses


class Trainer:
    """Trains a Transformer on a token array (or a data_lib.SyntheticLanguage) with AdamW.

    Creating a Trainer attaches it to the model (`model.trainer`), so `model.save_checkpoint(path,
    include_optimizer=True)` saves parameters, optimizer moments and step, data position and RNG state, and
    `model.load_checkpoint(path)` restores them all: the next `train_step` is the one the saved run would have made.
    """

    def __init__(self, model: model_lib.Transformer, data: data_lib.SyntheticLanguage | np.ndarray, *, batch_size: int = 8,
                 lr: float = 3e-3, warmup_steps: int = 10, weight_decay: float = 0.01,
                 betas: tuple[float, float] = (0.9, 0.95), clip_norm: float = 1.0, seed: int = 0):
        tokens = data.generate() if isinstance(data, data_lib.SyntheticLanguage) else np.asarray(data)
        if tokens.ndim == 2 and tokens.shape[1] - 1 > model.config.max_seq_len:
            raise errors.ModelConfigError(
                f"data rows hold {tokens.shape[1]} tokens; the model takes at most max_seq_len + 1 = "
                f"{model.config.max_seq_len + 1}")
        self.model = model
        self.stream = data_lib.DataStream(tokens, batch_size, seed=seed)
        self.optimizer = optimizer.AdamW(model.params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.warmup_steps = warmup_steps
        self.clip_norm = clip_norm
        model.trainer = self

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored from a checkpoint)."""
        return self.optimizer.step_count

    def train_step(self) -> StepResult:
        """One batch: forward, backward, clip, AdamW update."""
        started = time.perf_counter()
        batch = self.stream.next_batch()
        loss, grads = self.model.loss_and_grads(batch)
        grad_norm = clip_by_global_norm(grads, self.clip_norm)
        lr = learning_rate(self.step + 1, self.optimizer.lr, self.warmup_steps)
        self.optimizer.step(self.model.params, grads, lr=lr)
        tokens = batch.shape[0] * (batch.shape[1] - 1)
        return StepResult(self.step, loss, grad_norm, lr, tokens, time.perf_counter() - started)

    def train(self, num_steps: int, on_step: Callable[[StepResult], None] | None = None) -> list[float]:
        """Runs num_steps steps; calls on_step after each (for progress bars and periodic checkpoints)."""
        return run_steps(self.train_step, num_steps, on_step)

    # --- the TrainingStateOwner protocol the model calls ---

    def training_state_dict(self) -> dict[str, np.ndarray]:
        return {**self.optimizer.state_dict(), **self.stream.state_dict()}

    def check_training_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        known = set(self.training_state_dict())
        unknown = sorted(set(state) - known)
        if unknown:
            raise errors.TrainingStateError(f"training state has tensors this trainer does not know: {unknown[:5]}")
        self.optimizer.check_state_dict(state)
        self.stream.check_state_dict(state)

    def load_training_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self.check_training_state_dict(state)
        self.optimizer.load_state_dict(state)
        self.stream.load_state_dict(state)


class ProgressBar:
    """A rich progress bar for training: step, loss and tokens/s. Use as `on_step` inside a `with` block."""

    def __init__(self, total_steps: int, *, start_step: int = 0, description: str = "training",
                 console: Any = None):
        from rich import progress

        self._progress = progress.Progress(
            progress.TextColumn("[bold]{task.description}"), progress.BarColumn(),
            progress.TextColumn("step {task.completed:>4.0f}/{task.total:.0f}"),
            progress.TextColumn("loss {task.fields[loss]:.4f}"),
            progress.TextColumn("{task.fields[tokens_per_s]:>8,.0f} tok/s"),
            progress.TimeElapsedColumn(), console=console, transient=False)
        self._task = self._progress.add_task(description, total=total_steps, completed=start_step,
                                             loss=float("nan"), tokens_per_s=0.0)
        self._tokens = 0
        self._seconds = 0.0

    def __enter__(self) -> Self:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def __call__(self, result: StepResult) -> None:
        self._tokens += result.tokens
        self._seconds += result.seconds
        self._progress.update(self._task, completed=result.step, loss=result.loss,
                              tokens_per_s=self._tokens / max(self._seconds, 1e-9))

    def log(self, message: str) -> None:
        self._progress.console.print(message)
