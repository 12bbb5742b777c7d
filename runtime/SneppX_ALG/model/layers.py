"""The pieces of the reference model's forward and backward passes, in plain numpy: LayerNorm, tanh-GELU, the
embedding gradient, the causal mask, softmax cross-entropy, and the workspace their batch-sized results live in.

Why a module of its own: each piece is a function of arrays with its hand-written gradient beside it (the
finite-difference check tests them); the model (transformer.py) only wires them into blocks.
"""

from __future__ import annotations

import math

import numpy as np

LAYERNORM_EPS = 1e-5
_GELU_C = math.sqrt(2.0 / math.pi)


class Workspace:
    """Batch-sized buffers kept from one training step to the next, by name.

    Why: one step of the recipe-1 model at batch 16 makes ~40 MB of temporaries. Freed, glibc returns them to the
    kernel, and the next step pays a page fault per 4 KiB to touch them again: measured at half of the step time
    on these VMs. Writing every batch-sized result into a named buffer (`out=`) makes a step allocation-free
    except for the gradients it returns. Not thread-safe: one forward/backward at a time per model.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def __call__(self, key: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
            buffer = self._buffers[key] = np.empty(shape, dtype)
        return buffer

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, ws: Workspace,
               key: str) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """LayerNorm over the last axis of a 2-D array; returns (y, cache for layer_norm_backward)."""
    xhat = ws(key + ".xhat", x.shape, x.dtype)
    np.subtract(x, x.mean(axis=-1, keepdims=True), out=xhat)
    square = ws("ln.scratch", x.shape, x.dtype)
    np.multiply(xhat, xhat, out=square)
    rstd = square.mean(axis=-1, keepdims=True)
    rstd += LAYERNORM_EPS
    np.sqrt(rstd, out=rstd)
    np.reciprocal(rstd, out=rstd)
    xhat *= rstd
    y = ws(key + ".y", x.shape, x.dtype)
    np.multiply(xhat, weight, out=y)
    y += bias
    return y, (xhat, rstd, weight)


def layer_norm_backward(dy: np.ndarray, cache: tuple[np.ndarray, ...],
                        ws: Workspace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Returns (dx, dweight, dbias); dx is computed in place in dy's memory."""
    xhat, rstd, weight = cache
    scratch = ws("ln.scratch", dy.shape, dy.dtype)
    dweight = np.multiply(dy, xhat, out=scratch).sum(axis=0)
    dbias = dy.sum(axis=0)
    dxhat = np.multiply(dy, weight, out=dy)
    mean_dxhat = dxhat.mean(axis=-1, keepdims=True)
    mean_dxhat_xhat = np.multiply(dxhat, xhat, out=scratch).mean(axis=-1, keepdims=True)
    dx = dxhat
    dx -= mean_dxhat
    dx -= np.multiply(xhat, mean_dxhat_xhat, out=scratch)
    dx *= rstd
    return dx, dweight, dbias


def gelu(u: np.ndarray, out: np.ndarray, tanh_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """tanh-approximate GELU (as in GPT-2) into `out`; the tanh term goes to `tanh_out` for the backward pass."""
    t = np.multiply(u, u, out=tanh_out)
    t *= 0.044715
    t += 1.0
    t *= u
    t *= _GELU_C
    np.tanh(t, out=t)
    np.add(t, 1.0, out=out)
    out *= u
    out *= 0.5
    return out, t


def gelu_backward(dout: np.ndarray, u: np.ndarray, tanh_term: np.ndarray, ws: Workspace) -> np.ndarray:
    """d gelu(u) / du times dout, from the forward's tanh term; computed in place in dout's memory."""
    # d/du [0.5 u (1 + t)] = 0.5 (1 + t) + 0.5 u (1 - t^2) c (1 + 3 * 0.044715 u^2)
    inner = np.multiply(u, u, out=ws("gelu.scratch1", u.shape, u.dtype))
    inner *= 3 * 0.044715
    inner += 1.0
    inner *= _GELU_C
    sech2 = np.multiply(tanh_term, tanh_term, out=ws("gelu.scratch2", u.shape, u.dtype))
    np.subtract(1.0, sech2, out=sech2)
    inner *= sech2
    inner *= u
    inner += tanh_term
    inner += 1.0
    inner *= 0.5
    dout *= inner
    return dout


def embedding_grad(table: np.ndarray, ids: np.ndarray, grad_rows: np.ndarray) -> np.ndarray:
    """d loss / d table for rows gathered by `ids`: each row's gradients summed into its id's row. By sorting
    the ids and summing runs (np.add.reduceat): np.add.at, the obvious way, took ~1 ms a step (~3%)."""
    grad = np.zeros_like(table)
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_ids[1:] != sorted_ids[:-1])))
    if starts.size:
        grad[sorted_ids[starts]] = np.add.reduceat(grad_rows[order], starts, axis=0)
    return grad


def causal_mask(seq_len: int, dtype: np.dtype) -> np.ndarray:
    """Additive (T, T) mask: 0 on and below the diagonal, -inf above it (a token never sees the future)."""
    mask = np.zeros((seq_len, seq_len), dtype)
    mask[np.triu_indices(seq_len, k=1)] = -np.inf
    return mask


def softmax_cross_entropy(logits: np.ndarray, targets: np.ndarray, total: int | None = None,
                          ) -> tuple[float, np.ndarray]:
    """Next-token cross-entropy of (N, V) logits summed and divided by `total` tokens (default N: the mean; a
    part of a batch passes the batch's count); returns (loss, dloss/dlogits), the latter in logits' memory."""
    n = logits.shape[0]
    total = n if total is None else total
    rows = np.arange(n)
    logits -= logits.max(axis=-1, keepdims=True)
    target_logits = logits[rows, targets]
    probs = np.exp(logits, out=logits)
    sums = probs.sum(axis=-1, keepdims=True)
    loss = -float(np.sum(target_logits - np.log(sums[:, 0]), dtype=np.float64)) / total
    sums *= total
    probs /= sums  # softmax / total
    probs[rows, targets] -= probs.dtype.type(1.0 / total)
    return loss, probs
