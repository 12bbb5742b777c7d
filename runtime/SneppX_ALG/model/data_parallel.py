"""Data-parallel training of the reference model, with AdamW's moments sharded across the ranks (ZeRO stage 1).

Why: elastic training runs the same model on N ranks that must stay identical, and must be able to stop at one
world size and go on at another. So the result must not depend on N, and each rank's state must be a piece of a
whole whose place in that whole is known:

- The global batch and its order come from one `data.DataStream` that every rank holds whole (the same seed, the
  same position); rank r trains on rows `shard_range(B, N, r)` of each global batch of B rows. The data position is
  therefore the same on every rank and at every world size.
- Each rank's gradient (of the mean loss over its rows) is scaled by rows / B, so the sum over the ranks is the
  gradient of the mean over the global batch; the loss likewise. Float sums in another order round differently, so
  world sizes agree to float tolerance, not bitwise; at world size 1 the step is bitwise `training.Trainer`'s.
- Parameters live in one flat vector (`FlatLayout`: the model's canonical order, cut into buckets of whole tensors
  of up to `bucket_bytes`). Every bucket is split across the ranks by the ring's own rule (`shard_range`), so a rank
  owns one contiguous range of each bucket, and so at most one flat `Piece` of each tensor, with its offsets.
- One step: gradients into the flat buffer, reduce-scattered bucket by bucket (each rank receives the summed
  gradient of its ranges only: half the traffic of an allreduce); the global gradient norm from each rank's sum of
  squares, allreduced with the loss, so clipping scales the same everywhere; AdamW on the rank's pieces only (its
  moments exist for those alone); then the parameters allgathered bucket by bucket.

A sharded checkpoint of rank r is `sharded_state_dict()`: the parameters (identical on all ranks: replicated),
this rank's pieces of the moments as `coordinator.Shard`s of each flattened tensor ([start, stop) of it), the
optimizer step, and the data position and RNG (identical on all ranks). `CheckpointCoordinator(...,
group=...).save(trainer, step)` writes it; `restore(trainer)` at any world size reads each rank's new pieces
and hands them to `load_sharded_state_dict()`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from SneppX_ALG import _native, collectives, coordinator, errors
from SneppX_ALG.model import data as data_lib
from SneppX_ALG.model import optimizer as optimizer_lib
from SneppX_ALG.model import training
from SneppX_ALG.model import transformer as model_lib

DEFAULT_BUCKET_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Whole tensors `names`, at [start, stop) of the flat vector: the unit of one reduce-scatter / allgather."""

    start: int
    stop: int
    names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One rank's part of one tensor: elements [start, stop) of the flattened tensor of `shape`, held at
    [flat_start, flat_start + stop - start) of the flat vector."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int
    flat_start: int

    @property
    def flat_stop(self) -> int:
        return self.flat_start + self.stop - self.start


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where every parameter sits in the flat vector, and how the vector is cut into buckets. Depends only on the
    shapes and bucket_bytes, never on the world size."""

    offsets: Mapping[str, int]
    shapes: Mapping[str, tuple[int, ...]]
    buckets: tuple[Bucket, ...]
    size: int

    @classmethod
    def build(cls, shapes: Mapping[str, tuple[int, ...]], itemsize: int, bucket_bytes: int) -> FlatLayout:
        if bucket_bytes < 1:
            raise errors.ModelConfigError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        offsets: dict[str, int] = {}
        buckets: list[Bucket] = []
        size, bucket_start = 0, 0
        names: list[str] = []
        for name, shape in shapes.items():
            count = math.prod(shape)
            if names and (size + count - bucket_start) * itemsize > bucket_bytes:
                buckets.append(Bucket(bucket_start, size, tuple(names)))
                bucket_start, names = size, []
            offsets[name] = size
            names.append(name)
            size += count
        if names:
            buckets.append(Bucket(bucket_start, size, tuple(names)))
        return cls(offsets, dict(shapes), tuple(buckets), size)

    def pieces(self, world_size: int, rank: int) -> list[Piece]:
        """The pieces `rank` owns among `world_size` ranks, in flat order."""
        owned = []
        for bucket in self.buckets:
            lo, hi = _native.shard_range(bucket.stop - bucket.start, world_size, rank)
            lo, hi = bucket.start + lo, bucket.start + hi
            for name in bucket.names:
                offset, count = self.offsets[name], math.prod(self.shapes[name])
                start, stop = max(lo, offset), min(hi, offset + count)
                if start < stop:
                    owned.append(Piece(name, self.shapes[name], start - offset, stop - offset, start))
        return owned


class DataParallelTrainer:
    """Trains a Transformer on the ranks of a ProcessGroup (see the module docstring); every rank constructs one
    with the same arguments and calls `train_step` in lockstep.

    The model's parameters are moved into one flat buffer (`model.params` then maps names to views of it) and
    broadcast from rank 0, so every rank starts from the same values. Hyperparameters mean what they mean in
    `training.Trainer`; `batch_size` is the global batch.
    """

    def __init__(self, model: model_lib.Transformer, data: data_lib.SyntheticLanguage | np.ndarray,
                 group: collectives.ProcessGroup, *, batch_size: int = 8, lr: float = 3e-3, warmup_steps: int = 10,
                 weight_decay: float = 0.01, betas: tuple[float, float] = (0.9, 0.95), clip_norm: float = 1.0,
                 seed: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        tokens = data.generate() if isinstance(data, data_lib.SyntheticLanguage) else np.asarray(data)
        if tokens.ndim == 2 and tokens.shape[1] - 1 > model.config.max_seq_len:
            raise errors.ModelConfigError(
                f"data rows hold {tokens.shape[1]} tokens; the model takes at most max_seq_len + 1 = "
                f"{model.config.max_seq_len + 1}")
        self.model, self.group = model, group
        self.stream = data_lib.DataStream(tokens, batch_size, seed=seed)
        dtype = np.dtype(model.config.dtype)
        self.layout = FlatLayout.build(model_lib.param_shapes(model.config), dtype.itemsize, bucket_bytes)
        self.flat_params = np.empty(self.layout.size, dtype)
        self.flat_grads = np.empty(self.layout.size, dtype)
        for name, value in model.params.items():
            view = self._view(self.flat_params, name)
            view[...] = value
            model.params[name] = view
        group.broadcast(self.flat_params, root=0)
        self.pieces = self.layout.pieces(group.world_size, group.rank)
        self.optimizer = optimizer_lib.AdamW(
            {p.name: self.flat_params[p.flat_start:p.flat_stop] for p in self.pieces}, lr=lr, betas=betas,
            weight_decay=weight_decay, decayed=[p.name for p in self.pieces if len(p.shape) >= 2])
        self.warmup_steps = warmup_steps
        self.clip_norm = clip_norm

    def _view(self, flat: np.ndarray, name: str) -> np.ndarray:
        offset, shape = self.layout.offsets[name], self.layout.shapes[name]
        return flat[offset:offset + math.prod(shape)].reshape(shape)

    @property
    def step(self) -> int:
        """Optimizer steps taken so far."""
        return self.optimizer.step_count

    def train_step(self) -> training.StepResult:
        """One global batch on every rank: forward and backward on this rank's rows, reduce-scatter, clip by the
        global norm, AdamW on this rank's pieces, allgather. Raises CollectiveError if the group fails."""
        started = time.perf_counter()
        group, world = self.group, self.group.world_size
        batch = self.stream.next_batch()
        lo, hi = _native.shard_range(batch.shape[0], world, group.rank)
        share = (hi - lo) / batch.shape[0]  # this rank's part of the global mean
        if hi > lo:
            loss, grads = self.model.loss_and_grads(batch[lo:hi])
            for name, grad in grads.items():
                np.multiply(grad, grad.dtype.type(share), out=self._view(self.flat_grads, name))
        else:
            loss = 0.0
            self.flat_grads.fill(0)
        for bucket in self.layout.buckets:
            group.reduce_scatter(self.flat_grads[bucket.start:bucket.stop])
        mine = {p.name: self.flat_grads[p.flat_start:p.flat_stop] for p in self.pieces}
        totals = np.array([loss * share, sum(float(np.vdot(g, g)) for g in mine.values())])
        group.allreduce(totals)
        global_loss, grad_norm = float(totals[0]), math.sqrt(totals[1])
        scale = training.clip_scale(grad_norm, self.clip_norm)
        if scale is not None:
            for g in mine.values():
                g *= g.dtype.type(scale)
        lr = training.learning_rate(self.step + 1, self.optimizer.lr, self.warmup_steps)
        self.optimizer.step({p.name: self.flat_params[p.flat_start:p.flat_stop] for p in self.pieces}, mine, lr=lr)
        for bucket in self.layout.buckets:
            group.allgather(self.flat_params[bucket.start:bucket.stop])
        tokens = batch.shape[0] * (batch.shape[1] - 1)
        return training.StepResult(self.step, global_loss, grad_norm, lr, tokens, time.perf_counter() - started)

    def train(self, num_steps: int, on_step: Callable[[training.StepResult], None] | None = None) -> list[float]:
        """Runs num_steps steps; calls on_step after each. Returns the global losses (the same on every rank)."""
        return training.run_steps(self.train_step, num_steps, on_step)

    # --- sharded checkpoints (CheckpointCoordinator with a group) ---

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's training state, every array a live one: `model/<name>` the parameters (replicated),
        `optim/m|v/<name>` this rank's piece of each moment as a Shard of the flattened tensor, `optim/step`, and
        the data position and RNG (`data/...`, `rng/pcg64`: replicated). Saved as it is, and filled in place by
        a restore at any world size (then call load_sharded_state_dict, which the coordinator does)."""
        moments: dict[str, dict[str, coordinator.Shard]] = {"m": {}, "v": {}}
        for piece in self.pieces:
            total = (math.prod(piece.shape),)
            moments["m"][piece.name] = coordinator.Shard(self.optimizer.m[piece.name], total, (piece.start,))
            moments["v"][piece.name] = coordinator.Shard(self.optimizer.v[piece.name], total, (piece.start,))
        return {"model": dict(self.model.params),
                "optim": {"step": np.array(self.optimizer.step_count, np.int64), **moments},
                **self.stream.state_dict()}

    def load_sharded_state_dict(self, state: Mapping[str, Any]) -> None:
        """Takes a state that sharded_state_dict() gave and a restore filled: the arrays are in place already;
        the optimizer step and the data position are applied here (TrainingStateError for another data set)."""
        step = np.asarray(state["optim"]["step"])
        if step.shape != () or int(step) < 0:
            raise errors.TrainingStateError("optim/step must be a scalar >= 0")
        self.stream.load_state_dict({k: np.asarray(v) for k, v in state.items() if k.startswith(("data/", "rng/"))})
        self.optimizer.step_count = int(step)
