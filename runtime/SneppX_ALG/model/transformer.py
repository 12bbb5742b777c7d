"""The reference model: a decoder-only Transformer in plain numpy, with hand-written gradients and AdamW.

Why it exists: every SneppX feature (async saves, elastic restarts, re-sharding, signed updates) has to be shown on
real training rather than on random arrays, on a CPU, with no ML framework installed. This is that training: a
small GPT-style model whose whole state (parameters, optimizer moments, step) is a flat dict of numpy arrays, so a
checkpoint of it is exactly what SneppX saves for a real job.

Shape of the model (pre-LayerNorm, as in GPT-2): token + position embeddings, `num_layers` blocks of
`x += attn(ln1(x))`, `x += ffn(ln2(x))` with multi-head causal self-attention and a tanh-GELU feed-forward, a final
LayerNorm and an untied LM head. The backward pass is written out by hand and vectorised: heads are stacked on a
batch axis and go through `np.matmul` together, so no Python loop runs over tokens or heads.

Determinism: parameters come from a seeded generator, and every operation is plain numpy on the same shapes in the
same order, so the same inputs give bitwise the same parameters in any process on the same machine (the resume
tests rely on it). float64 mode (`dtype="float64"`) exists for the finite-difference gradient check.

Checkpoints use the SNPX format (`SneppX_ALG.checkpoint`), never pickle: tensors `params/<name>` plus, when a
`training.Trainer` is attached and asked for, its optimizer, data-position and RNG tensors; the model config is the
file's JSON config, so `Transformer.from_checkpoint` can rebuild the right model.

Beside it: the architecture and its initialisation (config.py), the pieces of the forward and backward passes
(layers.py), and the batch cut into parts for the cores (parts.py); the names moved there are still importable
from here.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from SneppX_ALG import errors
from SneppX_ALG.checkpoint import file
from SneppX_ALG.model.config import MODEL_KIND, ModelConfig, init_params, param_shapes
from SneppX_ALG.model.layers import (  # noqa: F401 - LAYERNORM_EPS: re-exported
    LAYERNORM_EPS,
    Workspace,
    causal_mask,
    embedding_grad,
    gelu,
    gelu_backward,
    layer_norm,
    layer_norm_backward,
    softmax_cross_entropy,
)
from SneppX_ALG.model.parts import (  # noqa: F401 - MIN_PART_TOKENS: re-exported
    MIN_PART_TOKENS,
    batch_parts,
    blas_threads,
    one_blas_thread,
)

PARAM_PREFIX = "params/"


class TrainingStateOwner(Protocol):
    """What `training.Trainer` gives the model so one checkpoint holds the whole training state.

    `load_training_state_dict` checks everything before it changes anything, and raises TrainingStateError.
    """

    def training_state_dict(self) -> dict[str, np.ndarray]: ...

    def check_training_state_dict(self, state: Mapping[str, np.ndarray]) -> None: ...

    def load_training_state_dict(self, state: Mapping[str, np.ndarray]) -> None: ...


class Transformer:
    """A decoder-only causal Transformer language model in numpy (see the module docstring).

    `forward(tokens)` gives logits, `loss(tokens)` the mean next-token cross-entropy, `loss_and_grads(tokens)` the
    loss and the gradient of every parameter. `params` maps names to arrays; `state_dict()` / `load_state_dict()`
    are the flat `name -> ndarray` view of the model (and, when asked, of the attached trainer) that checkpointing
    uses, and `save_checkpoint` / `load_checkpoint` / `from_checkpoint` read and write SNPX files.

    Cores: `loss` and `loss_and_grads` split the batch into one part per BLAS thread (blas_threads(): the
    default, OPENBLAS_NUM_THREADS, or a threadpoolctl limit; parts of MIN_PART_TOKENS tokens at least) and run
    the parts on that many threads at once,
    each with single-threaded BLAS. The small matmuls and the elementwise work of a step then both use every
    core, where BLAS threads alone spread only the matmuls, and each of ~60 small matmuls waits for its
    threads (measured: 0.27x of a plain matmul's FLOP/s with two BLAS threads, docs/BENCHMARKS.md). The
    parts' losses and gradients are summed in part order, so the same machine and thread count give the same
    bits; a different thread count rounds differently (within float tolerance).
    """

    def __init__(self, vocab_size: int = 1000, dim: int = 128, num_heads: int = 4, num_layers: int = 2,
                 ffn_dim: int = 512, max_seq_len: int = 64, *, seed: int = 0, dtype: str = "float32"):
        self.config = ModelConfig(vocab_size=vocab_size, dim=dim, num_heads=num_heads, num_layers=num_layers,
                                  ffn_dim=ffn_dim, max_seq_len=max_seq_len, dtype=str(np.dtype(dtype)))
        self.params: dict[str, np.ndarray] = init_params(self.config, seed)
        # Set by training.Trainer: with it, checkpoints can carry optimizer, data position and RNG too.
        self.trainer: TrainingStateOwner | None = None
        self._mask = causal_mask(self.config.max_seq_len, np.dtype(self.config.dtype))
        self._workspaces = [Workspace()]  # one per part of a batch (one per thread)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # threads for parts 1.., made on first use
        self._pool_threads = 0

    @classmethod
    def from_config(cls, config: ModelConfig, *, seed: int = 0) -> Transformer:
        fields = dataclasses.asdict(config)
        return cls(**fields, seed=seed)

    @property
    def num_params(self) -> int:
        return sum(p.size for p in self.params.values())

    def __repr__(self) -> str:
        c = self.config
        return (f"Transformer(vocab_size={c.vocab_size}, dim={c.dim}, num_heads={c.num_heads}, "
                f"num_layers={c.num_layers}, ffn_dim={c.ffn_dim}, max_seq_len={c.max_seq_len}, dtype={c.dtype!r})")

    # --- forward / backward ---

    def _check_tokens(self, tokens: Any, what: str, max_len: int) -> np.ndarray:
        array = np.asarray(tokens)
        if array.ndim == 1:
            array = array[None, :]
        if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
            raise errors.ModelInputError(
                f"{what} must be a 1-D or 2-D (batch, seq) integer array, got {array.dtype} of shape {array.shape}")
        if not 1 <= array.shape[1] <= max_len:
            raise errors.ModelInputError(f"{what} length {array.shape[1]} is outside 1..{max_len}")
        if array.size and (array.min() < 0 or array.max() >= self.config.vocab_size):
            raise errors.ModelInputError(
                f"{what} holds ids outside 0..{self.config.vocab_size - 1} "
                f"(min {array.min()}, max {array.max()})")
        return array

    def _forward(self, tokens: np.ndarray, ws: Workspace) -> tuple[np.ndarray, list[Any]]:
        """(B, T) ids -> (B*T, V) logits and the activations the backward pass needs, all in `ws`'s buffers."""
        c, p = self.config, self.params
        dtype = np.dtype(c.dtype)
        batch, seq = tokens.shape
        n, h, hd = batch * seq, c.num_heads, c.head_dim
        scale = dtype.type(1.0 / math.sqrt(hd))
        mask = self._mask[:seq, :seq]
        x = ws("residual", (n, c.dim), dtype)  # the residual stream, updated in place block after block
        np.take(p["tok_emb"], tokens.reshape(-1), axis=0, out=x)
        x.reshape(batch, seq, c.dim)[...] += p["pos_emb"][:seq]
        projected = ws("projected", (n, c.dim), dtype)
        cache: list[Any] = []
        for i in range(c.num_layers):
            b = f"blocks.{i}."
            a, ln1 = layer_norm(x, p[b + "ln1.weight"], p[b + "ln1.bias"], ws, b + "ln1")
            qkv = np.matmul(a, p[b + "attn.qkv.weight"], out=ws("qkv", (n, 3 * c.dim), dtype))
            qkv += p[b + "attn.qkv.bias"]
            # (B, T, 3, H, hd) -> (3, B, H, T, hd): heads become a batch axis of one stacked matmul.
            qkv_heads = ws(b + "qkv_heads", (3, batch, h, seq, hd), dtype)
            np.copyto(qkv_heads, qkv.reshape(batch, seq, 3, h, hd).transpose(2, 0, 3, 1, 4))
            q, k, v = qkv_heads[0], qkv_heads[1], qkv_heads[2]
            probs = np.matmul(q, k.transpose(0, 1, 3, 2), out=ws(b + "probs", (batch, h, seq, seq), dtype))
            probs *= scale
            probs += mask
            probs -= probs.max(axis=-1, keepdims=True)
            np.exp(probs, out=probs)
            probs /= probs.sum(axis=-1, keepdims=True)
            heads_out = np.matmul(probs, v, out=ws("heads_out", (batch, h, seq, hd), dtype))
            attn = ws(b + "attn", (n, c.dim), dtype)
            np.copyto(attn.reshape(batch, seq, h, hd), heads_out.transpose(0, 2, 1, 3))
            x += np.matmul(attn, p[b + "attn.out.weight"], out=projected)
            x += p[b + "attn.out.bias"]
            a2, ln2 = layer_norm(x, p[b + "ln2.weight"], p[b + "ln2.bias"], ws, b + "ln2")
            u = np.matmul(a2, p[b + "ffn.in.weight"], out=ws(b + "ffn.u", (n, c.ffn_dim), dtype))
            u += p[b + "ffn.in.bias"]
            g, tanh_term = gelu(u, ws(b + "ffn.g", u.shape, dtype), ws(b + "ffn.tanh", u.shape, dtype))
            x += np.matmul(g, p[b + "ffn.out.weight"], out=projected)
            x += p[b + "ffn.out.bias"]
            cache.append((a, ln1, qkv_heads, probs, attn, a2, ln2, u, tanh_term, g))
        xf, lnf = layer_norm(x, p["ln_f.weight"], p["ln_f.bias"], ws, "ln_f")
        logits = np.matmul(xf, p["head.weight"], out=ws("logits", (n, c.vocab_size), dtype))
        cache.append((xf, lnf))
        return logits, cache

    def forward(self, tokens: Any) -> np.ndarray:
        """Logits of shape (batch, seq, vocab) for integer ids of shape (batch, seq) or (seq,)."""
        ids = self._check_tokens(tokens, "tokens", self.config.max_seq_len)
        logits, _ = self._forward(ids, self._workspaces[0])
        return logits.reshape(ids.shape[0], ids.shape[1], self.config.vocab_size).copy()  # not the workspace

    def _split_targets(self, tokens: Any, targets: Any) -> tuple[np.ndarray, np.ndarray]:
        if targets is None:
            # Next-token prediction: a (batch, seq + 1) window gives seq inputs and seq targets.
            ids = self._check_tokens(tokens, "tokens", self.config.max_seq_len + 1)
            if ids.shape[1] < 2:
                raise errors.ModelInputError("tokens need at least 2 positions to predict a next token")
            return ids[:, :-1], ids[:, 1:]
        ids = self._check_tokens(tokens, "tokens", self.config.max_seq_len)
        tgt = self._check_tokens(targets, "targets", self.config.max_seq_len)
        if tgt.shape != ids.shape:
            raise errors.ModelInputError(f"targets shape {tgt.shape} differs from tokens shape {ids.shape}")
        return ids, tgt

    def loss(self, tokens: Any, targets: Any = None) -> float:
        """Mean cross-entropy (nats/token). Without targets, predicts tokens[:, 1:] from tokens[:, :-1]."""
        ids, tgt = self._split_targets(tokens, targets)
        return sum(self._in_parts(ids, tgt, self._part_loss))

    def loss_and_grads(self, tokens: Any, targets: Any = None) -> tuple[float, dict[str, np.ndarray]]:
        """The loss (as `loss`) and d loss / d param for every parameter, by a hand-written backward pass.

        The returned gradients are new arrays the caller owns; activations live in the model's workspaces.
        """
        ids, tgt = self._split_targets(tokens, targets)
        results = self._in_parts(ids, tgt, self._part_loss_and_grads)
        loss, grads = results[0]
        for part_loss, part_grads in results[1:]:
            loss += part_loss
            for name, grad in part_grads.items():
                grads[name] += grad
        return loss, grads

    def _in_parts(self, ids: np.ndarray, tgt: np.ndarray, work: Callable[..., Any]) -> list[Any]:
        """work(ids part, targets part, token total, workspace) for each part of the batch, the parts on their
        own threads with single-threaded BLAS (see the class docstring); the results in part order."""
        parts = batch_parts(ids.shape[0], ids.shape[1], blas_threads())
        total = tgt.size
        while len(self._workspaces) < len(parts):
            self._workspaces.append(Workspace())
        jobs = [(ids[lo:hi], tgt[lo:hi], total, self._workspaces[i]) for i, (lo, hi) in enumerate(parts)]
        if len(jobs) == 1:
            return [work(*jobs[0])]
        if self._pool_threads < len(jobs) - 1:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = concurrent.futures.ThreadPoolExecutor(len(jobs) - 1, thread_name_prefix="sneppx-model")
            self._pool_threads = len(jobs) - 1
        pool = self._pool
        assert pool is not None
        with one_blas_thread():
            futures = [pool.submit(work, *job) for job in jobs[1:]]
            first = work(*jobs[0])  # this thread takes the first part
            return [first] + [f.result() for f in futures]

    def _part_loss(self, ids: np.ndarray, tgt: np.ndarray, total: int, ws: Workspace) -> float:
        logits, _ = self._forward(ids, ws)
        loss, _ = softmax_cross_entropy(logits, tgt.reshape(-1), total)
        return loss

    def _part_loss_and_grads(self, ids: np.ndarray, tgt: np.ndarray, total: int,
                             ws: Workspace) -> tuple[float, dict[str, np.ndarray]]:
        """One part's share of the batch's loss and gradients (its tokens' terms over the batch's `total`)."""
        c, p = self.config, self.params
        dtype = np.dtype(c.dtype)
        batch, seq = ids.shape
        n, h, hd = batch * seq, c.num_heads, c.head_dim
        scale = dtype.type(1.0 / math.sqrt(hd))
        logits, cache = self._forward(ids, ws)
        loss, dlogits = softmax_cross_entropy(logits, tgt.reshape(-1), total)
        grads: dict[str, np.ndarray] = {}
        d_ln_in = ws("d_ln_in", (n, c.dim), dtype)  # the gradient arriving at a LayerNorm's output

        xf, lnf = cache.pop()
        grads["head.weight"] = xf.T @ dlogits
        np.matmul(dlogits, p["head.weight"].T, out=d_ln_in)
        dx_ln, grads["ln_f.weight"], grads["ln_f.bias"] = layer_norm_backward(d_ln_in, lnf, ws)
        dx = ws("d_residual", (n, c.dim), dtype)  # gradient of the residual stream, accumulated in place
        np.copyto(dx, dx_ln)

        for i in reversed(range(c.num_layers)):
            b = f"blocks.{i}."
            a, ln1, qkv_heads, probs, attn, a2, ln2, u, tanh_term, g = cache.pop()
            # Feed-forward: x_out = x_mid + gelu(ln2(x_mid) W1 + b1) W2 + b2
            grads[b + "ffn.out.weight"] = g.T @ dx
            grads[b + "ffn.out.bias"] = dx.sum(axis=0)
            du = np.matmul(dx, p[b + "ffn.out.weight"].T, out=ws("d_ffn", (n, c.ffn_dim), dtype))
            gelu_backward(du, u, tanh_term, ws)
            grads[b + "ffn.in.weight"] = a2.T @ du
            grads[b + "ffn.in.bias"] = du.sum(axis=0)
            np.matmul(du, p[b + "ffn.in.weight"].T, out=d_ln_in)
            dx_ln, grads[b + "ln2.weight"], grads[b + "ln2.bias"] = layer_norm_backward(d_ln_in, ln2, ws)
            dx += dx_ln
            # Attention: x_mid = x_in + concat_heads(softmax(q k^T * scale + mask) v) Wo + bo
            grads[b + "attn.out.weight"] = attn.T @ dx
            grads[b + "attn.out.bias"] = dx.sum(axis=0)
            dattn = np.matmul(dx, p[b + "attn.out.weight"].T, out=ws("d_attn", (n, c.dim), dtype))
            dheads = dattn.reshape(batch, seq, h, hd).transpose(0, 2, 1, 3)
            q, k, v = qkv_heads[0], qkv_heads[1], qkv_heads[2]
            dqkv = ws("d_qkv_heads", qkv_heads.shape, dtype)
            np.matmul(probs.transpose(0, 1, 3, 2), dheads, out=dqkv[2])
            dscores = np.matmul(dheads, v.transpose(0, 1, 3, 2), out=ws("d_scores", probs.shape, dtype))
            # softmax backward; masked entries have probs == 0 and so get no gradient.
            row_dot = np.multiply(dscores, probs, out=ws("scores.scratch", probs.shape, dtype)).sum(
                axis=-1, keepdims=True)
            dscores -= row_dot
            dscores *= probs
            dscores *= scale
            np.matmul(dscores, k, out=dqkv[0])
            np.matmul(dscores.transpose(0, 1, 3, 2), q, out=dqkv[1])
            dqkv_rows = ws("d_qkv", (n, 3 * c.dim), dtype)
            np.copyto(dqkv_rows.reshape(batch, seq, 3, h, hd), dqkv.transpose(1, 3, 0, 2, 4))
            grads[b + "attn.qkv.weight"] = a.T @ dqkv_rows
            grads[b + "attn.qkv.bias"] = dqkv_rows.sum(axis=0)
            np.matmul(dqkv_rows, p[b + "attn.qkv.weight"].T, out=d_ln_in)
            dx_ln, grads[b + "ln1.weight"], grads[b + "ln1.bias"] = layer_norm_backward(d_ln_in, ln1, ws)
            dx += dx_ln

        grads["pos_emb"] = np.zeros_like(p["pos_emb"])
        grads["pos_emb"][:seq] = dx.reshape(batch, seq, c.dim).sum(axis=0)
        grads["tok_emb"] = embedding_grad(p["tok_emb"], ids.reshape(-1), dx)
        return loss, {name: grads[name] for name in p}

    # --- state as flat dicts of arrays (what checkpoints hold) ---

    def state_dict(self, include_optimizer: bool | None = None) -> dict[str, np.ndarray]:
        """`params/<name> -> array` (live arrays, not copies), plus the trainer's optimizer, data-position and RNG
        tensors: with include_optimizer=True, or by default (None) whenever a trainer is attached, so that
        `CheckpointCoordinator.save(model, step)` captures everything a resume needs.

        Callers that keep the result while training goes on must copy it (the async coordinator snapshots it).
        """
        state = {PARAM_PREFIX + name: value for name, value in self.params.items()}
        if include_optimizer is None:
            include_optimizer = self.trainer is not None
        if include_optimizer:
            if self.trainer is None:
                raise errors.TrainingStateError(
                    "include_optimizer=True but no trainer is attached to this model: create "
                    "training.Trainer(model, ...) first, or save the parameters only")
            state.update(self.trainer.training_state_dict())
        return state

    def _check_params(self, state: Mapping[str, np.ndarray], source: str) -> None:
        expected = param_shapes(self.config)
        dtype = np.dtype(self.config.dtype)
        present = {name[len(PARAM_PREFIX):] for name in state if name.startswith(PARAM_PREFIX)}
        missing = [name for name in expected if name not in present]
        unknown = sorted(present - set(expected))
        if missing or unknown:
            raise errors.ConfigMismatchError(
                f"{source}: parameters do not fit {self!r}: missing {missing[:5]}, unknown {unknown[:5]}")
        for name, shape in expected.items():
            value = state[PARAM_PREFIX + name]
            if tuple(value.shape) != shape or value.dtype != dtype:
                raise errors.ConfigMismatchError(
                    f"{source}: parameter {name} is {value.dtype}{list(value.shape)}, this model needs "
                    f"{dtype}{list(shape)}")

    def load_state_dict(self, state: Mapping[str, np.ndarray], *, include_optimizer: bool | None = None,
                        source: str = "state dict") -> None:
        """Copies `params/*` (and the trainer's tensors) from `state` into this model, bitwise.

        include_optimizer: None restores the training state when both the state and a trainer have it; True
        requires it (TrainingStateError otherwise); False loads parameters only. Everything is checked before
        anything changes, so a failed load leaves the model and trainer as they were.
        """
        self._check_params(state, source)
        has_training_state = any(not name.startswith(PARAM_PREFIX) for name in state)
        restore_training = bool(include_optimizer) or (include_optimizer is None and has_training_state
                                                       and self.trainer is not None)
        if restore_training:
            if self.trainer is None:
                raise errors.TrainingStateError(
                    f"{source}: include_optimizer=True but no trainer is attached to this model")
            if not has_training_state:
                raise errors.TrainingStateError(
                    f"{source}: holds parameters only (saved without include_optimizer=True); there is no "
                    "optimizer, data position or RNG state to resume from")
            training_state = {k: v for k, v in state.items() if not k.startswith(PARAM_PREFIX)}
            self.trainer.check_training_state_dict(training_state)
        for name, value in self.params.items():
            # In place, so arrays the optimizer or others hold stay the model's arrays.
            np.copyto(value, state[PARAM_PREFIX + name], casting="no")
        if restore_training:
            assert self.trainer is not None
            self.trainer.load_training_state_dict(training_state)

    # --- SNPX checkpoints ---

    def save_checkpoint(self, path: str | os.PathLike[str], include_optimizer: bool = False,
                        metadata: Mapping[str, str] | None = None) -> None:
        """Writes the model to an SNPX file at `path`, atomically (the file appears whole or not at all).

        Holds every parameter and the config; with include_optimizer=True also the attached trainer's optimizer
        moments and step, data position and RNG state, so training resumes bitwise where it stopped.
        """
        state = self.state_dict(include_optimizer=include_optimizer)
        meta = {"sneppx.kind": MODEL_KIND, "sneppx.training_state": "true" if include_optimizer else "false"}
        meta.update(metadata or {})
        with file.CheckpointWriter(os.fspath(path), metadata=meta, config=self.config.to_json()) as writer:
            for name, value in state.items():
                writer.write(name, value)

    def load_checkpoint(self, path: str | os.PathLike[str], include_optimizer: bool | None = None) -> None:
        """Loads an SNPX checkpoint written by `save_checkpoint` into this model, bitwise.

        Raises CheckpointNotFoundError, UnsafeFormatError for a pickle (refused, never loaded), another
        CheckpointFormatError for a damaged file, ConfigMismatchError when the checkpoint is for a different
        architecture (use `Transformer.from_checkpoint`), and TrainingStateError as `load_state_dict` says.
        """
        source = os.fspath(path)
        with file.CheckpointReader(source) as reader:
            theirs = ModelConfig.from_json(reader.config, source=source)
            if theirs != self.config:
                diff = ", ".join(f"{field}={saved!r} (this model: {ours!r})"
                                 for field, saved, ours in theirs.differences(self.config))
                raise errors.ConfigMismatchError(
                    f"{source}: checkpoint is for a different model: {diff}; build the matching model with "
                    "Transformer.from_checkpoint(path)")
            want_training = include_optimizer is not False and (include_optimizer or self.trainer is not None)
            names = [n for n in reader.names() if want_training or n.startswith(PARAM_PREFIX)]
            # Zero-copy views over the file; load_state_dict copies them into our arrays before the file closes.
            state = {name: reader.read(name) for name in names}
            self.load_state_dict(state, include_optimizer=include_optimizer, source=source)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str]) -> Transformer:
        """Builds the model a checkpoint was saved from and loads its parameters."""
        source = os.fspath(path)
        with file.CheckpointReader(source) as reader:
            config = ModelConfig.from_json(reader.config, source=source)
            model = cls.from_config(config)
            state = {name: reader.read(name) for name in reader.names() if name.startswith(PARAM_PREFIX)}
            model.load_state_dict(state, include_optimizer=False, source=source)
        return model
