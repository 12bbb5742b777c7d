"""Training the reference model: a generated data set, a resumable data position, and the train loop.

Why it exists: SneppX's claims (a resumed job continues exactly where it stopped) need training whose whole state
can be saved and restored. Everything here is deterministic and seeded, so "resume in a new process" can be
checked bitwise against "never stopped":

- `SyntheticLanguage` generates the data set (no download): a seeded tiny grammar in which every token has a
  few possible successors with fixed probabilities. A small model visibly learns it, and its entropy is the
  lowest loss any model can reach (`loss_floor`), so a learning curve has a known target.
- `DataStream` hands out batches in a shuffled order per epoch. Its position (epoch, cursor, the epoch's order)
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

from SneppX_ALG import _native, errors
from SneppX_ALG import model as model_lib

# Successor probabilities of the grammar: a few likely continuations, like word choice in a sentence.
SUCCESSOR_PROBS = (0.6, 0.25, 0.1, 0.05)


# --- the data set -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SyntheticLanguage:
    """A seeded synthetic language: `num_sequences` windows of `seq_len + 1` token ids.

    Each token id has len(SUCCESSOR_PROBS) successors drawn at random once per seed; a sentence starts at a random
    token and picks each next token among its predecessor's successors with SUCCESSOR_PROBS. Generation is
    vectorised over sequences (one step per position), so the data set costs milliseconds to make.
    """

    vocab_size: int = 1000
    seq_len: int = 64
    num_sequences: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        for field in ("vocab_size", "seq_len", "num_sequences"):
            if getattr(self, field) < 1:
                raise errors.ModelConfigError(f"SyntheticLanguage.{field} must be >= 1, got {getattr(self, field)}")
        if self.vocab_size < len(SUCCESSOR_PROBS):
            raise errors.ModelConfigError(f"vocab_size must be >= {len(SUCCESSOR_PROBS)} for the grammar")

    @property
    def loss_floor(self) -> float:
        """The entropy of the next token (nats): no model can do better on average."""
        probs = np.array(SUCCESSOR_PROBS)
        return float(-(probs * np.log(probs)).sum())

    def successors(self) -> np.ndarray:
        """(vocab, branching) table: the possible next tokens of each token, distinct within a row."""
        rng = np.random.Generator(np.random.PCG64([self.seed, 1]))
        table = rng.integers(0, self.vocab_size, (self.vocab_size, len(SUCCESSOR_PROBS)), dtype=np.int32)
        while True:  # redraw rows that picked a successor twice (few, and fewer each round)
            ordered = np.sort(table, axis=1)
            repeated = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
            if not repeated.size:
                return table
            table[repeated] = rng.integers(0, self.vocab_size, (repeated.size, table.shape[1]), dtype=np.int32)

    def generate(self) -> np.ndarray:
        """(num_sequences, seq_len + 1) int32 token ids; the same array for the same fields, in any process."""
        rng = np.random.Generator(np.random.PCG64([self.seed, 2]))
        table = self.successors()
        cumulative = np.cumsum(SUCCESSOR_PROBS)
        tokens = np.empty((self.num_sequences, self.seq_len + 1), np.int32)
        tokens[:, 0] = rng.integers(0, self.vocab_size, self.num_sequences)
        choices = np.searchsorted(cumulative, rng.random((self.num_sequences, self.seq_len)), side="right")
        choices = np.minimum(choices, len(SUCCESSOR_PROBS) - 1)  # guards the float edge of the last bucket
        for position in range(self.seq_len):  # one vectorised step per position, over all sequences
            tokens[:, position + 1] = table[tokens[:, position], choices[:, position]]
        return tokens


def fingerprint(tokens: np.ndarray) -> int:
    """CRC32C of a data set's bytes: a resumed run checks it trains on the same data."""
    return _native.crc32c(np.ascontiguousarray(tokens))


# --- the data position ----------------------------------------------------------------------------------------------


class DataStream:
    """Batches of rows from a (rows, seq) token array, reshuffled every epoch, with a saveable position.

    The order of each epoch is drawn from the stream's own RNG when the epoch starts; the position is (epoch,
    cursor into that order). `state_dict()` holds all of it, so a restored stream yields the same batches.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seed: int = 0):
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise errors.ModelInputError(f"tokens must be a 2-D integer array, got {tokens.dtype}{tokens.shape}")
        if not 1 <= batch_size <= tokens.shape[0]:
            raise errors.ModelConfigError(f"batch_size {batch_size} must be in 1..{tokens.shape[0]} (rows)")
        self.tokens = tokens
        self.batch_size = batch_size
        self.fingerprint = fingerprint(tokens)
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.epoch = 0
        self.cursor = 0
        self.order = self.rng.permutation(tokens.shape[0])

    @property
    def batches_per_epoch(self) -> int:
        return self.tokens.shape[0] // self.batch_size

    def next_batch(self) -> np.ndarray:
        """The next (batch_size, seq) batch; a new shuffled epoch starts when the current one can't fill one."""
        if self.cursor + self.batch_size > len(self.order):
            self.epoch += 1
            self.cursor = 0
            self.order = self.rng.permutation(self.tokens.shape[0])
        rows = self.order[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return self.tokens[rows]

    def state_dict(self) -> dict[str, np.ndarray]:
        return {
            "data/epoch": np.array(self.epoch, np.int64),
            "data/cursor": np.array(self.cursor, np.int64),
            "data/order": self.order.astype(np.int64),
            "data/batch_size": np.array(self.batch_size, np.int64),
            "data/fingerprint": np.array(self.fingerprint, np.uint32),
            "rng/pcg64": encode_pcg64(self.rng.bit_generator.state),
        }

    def check_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Raises TrainingStateError unless `state` is a position in this same data set with this batch size."""
        for name, shape in (("data/epoch", ()), ("data/cursor", ()), ("data/batch_size", ()),
                            ("data/fingerprint", ()), ("data/order", (self.tokens.shape[0],)), ("rng/pcg64", (6,))):
            value = state.get(name)
            if value is None or value.shape != shape:
                found = "missing" if value is None else f"of shape {list(value.shape)}"
                raise errors.TrainingStateError(f"training state tensor {name} is {found}, needs shape {list(shape)}")
        if int(state["data/fingerprint"]) != self.fingerprint:
            raise errors.TrainingStateError(
                f"the checkpoint was trained on a different data set (fingerprint {int(state['data/fingerprint']):#010x}"
                f", this one {self.fingerprint:#010x}): resuming would not continue the same run")
        if int(state["data/batch_size"]) != self.batch_size:
            raise errors.TrainingStateError(
                f"the checkpoint used batch_size {int(state['data/batch_size'])}, this run {self.batch_size}")
        order = state["data/order"]
        if not np.array_equal(np.sort(order), np.arange(self.tokens.shape[0])):
            raise errors.TrainingStateError("data/order is not a permutation of the data set's rows")
        if not 0 <= int(state["data/cursor"]) <= len(order) or int(state["data/epoch"]) < 0:
            raise errors.TrainingStateError("data/cursor or data/epoch is out of range")
        decode_pcg64(state["rng/pcg64"])  # raises on a malformed RNG state

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self.check_state_dict(state)
        self.epoch = int(state["data/epoch"])
        self.cursor = int(state["data/cursor"])
        self.order = np.array(state["data/order"], np.int64)
        self.rng.bit_generator.state = decode_pcg64(state["rng/pcg64"])


_U64 = (1 << 64) - 1


def encode_pcg64(state: Mapping[str, Any]) -> np.ndarray:
    """numpy's PCG64 state (two 128-bit ints and a buffered 32-bit value) as six uint64s."""
    inner = state["state"]
    return np.array([inner["state"] & _U64, inner["state"] >> 64, inner["inc"] & _U64, inner["inc"] >> 64,
                     state["has_uint32"], state["uinteger"]], np.uint64)


def decode_pcg64(words: np.ndarray) -> dict[str, Any]:
    """The inverse of encode_pcg64; TrainingStateError for anything numpy's PCG64 would not accept."""
    if words.shape != (6,) or words.dtype != np.uint64:
        raise errors.TrainingStateError(f"rng/pcg64 must be 6 uint64 words, got {words.dtype}{list(words.shape)}")
    w = [int(x) for x in words]
    if w[4] not in (0, 1) or w[5] > 0xFFFFFFFF or not w[2] & 1:
        raise errors.TrainingStateError("rng/pcg64 is not a valid PCG64 state (bad flag, buffer or increment)")
    return {"bit_generator": "PCG64", "state": {"state": w[0] | w[1] << 64, "inc": w[2] | w[3] << 64},
            "has_uint32": w[4], "uinteger": w[5]}


# --- the train loop -------------------------------------------------------------------------------------------------


def learning_rate(step: int, base_lr: float, warmup_steps: int) -> float:
    """Linear warmup to base_lr over warmup_steps, then constant. step counts from 1."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return base_lr
    return base_lr * step / warmup_steps


def clip_by_global_norm(grads: Mapping[str, np.ndarray], max_norm: float) -> float:
    """Scales grads in place so their global L2 norm is at most max_norm; returns the norm before clipping."""
    norm = math.sqrt(sum(float(np.vdot(g, g)) for g in grads.values()))
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
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


class Trainer:
    """Trains a Transformer on a token array (or a SyntheticLanguage) with AdamW.

    Creating a Trainer attaches it to the model (`model.trainer`), so `model.save_checkpoint(path,
    include_optimizer=True)` saves parameters, optimizer moments and step, data position and RNG state, and
    `model.load_checkpoint(path)` restores them all: the next `train_step` is the one the saved run would have made.
    """

    def __init__(self, model: model_lib.Transformer, data: SyntheticLanguage | np.ndarray, *, batch_size: int = 8,
                 lr: float = 3e-3, warmup_steps: int = 10, weight_decay: float = 0.01,
                 betas: tuple[float, float] = (0.9, 0.95), clip_norm: float = 1.0, seed: int = 0):
        tokens = data.generate() if isinstance(data, SyntheticLanguage) else np.asarray(data)
        if tokens.ndim == 2 and tokens.shape[1] - 1 > model.config.max_seq_len:
            raise errors.ModelConfigError(
                f"data rows hold {tokens.shape[1]} tokens; the model takes at most max_seq_len + 1 = "
                f"{model.config.max_seq_len + 1}")
        self.model = model
        self.stream = DataStream(tokens, batch_size, seed=seed)
        self.optimizer = model_lib.AdamW(model.params, lr=lr, betas=betas, weight_decay=weight_decay)
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
        losses = []
        for _ in range(num_steps):
            result = self.train_step()
            losses.append(result.loss)
            if on_step is not None:
                on_step(result)
        return losses

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

