"""The reference model's architecture: its configuration (what a checkpoint's JSON config holds), the name and
shape of every parameter, and their initialisation.

Why a module of its own: a checkpoint is matched to a model by its config and parameter shapes alone
(`Transformer.from_checkpoint`, the data-parallel trainer's shards), without the forward and backward passes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from SneppX_ALG import errors

MODEL_KIND = "sneppx.Transformer"
_DTYPES = ("float32", "float64")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture: everything needed to rebuild a model that a checkpoint's parameters fit."""

    vocab_size: int = 1000
    dim: int = 128
    num_heads: int = 4
    num_layers: int = 2
    ffn_dim: int = 512
    max_seq_len: int = 64
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "dim", "num_heads", "num_layers", "ffn_dim", "max_seq_len"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise errors.ModelConfigError(f"{field} must be a positive int, got {value!r}")
        if self.dim % self.num_heads:
            raise errors.ModelConfigError(
                f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads}) so heads have equal width")
        if self.dtype not in _DTYPES:
            raise errors.ModelConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def to_json(self) -> dict[str, Any]:
        """The JSON config stored in a checkpoint."""
        return {"kind": MODEL_KIND, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, value: Any, *, source: str = "checkpoint") -> ModelConfig:
        """Parses a checkpoint's config; a config that isn't a Transformer's is a ModelConfigError."""
        if not isinstance(value, dict) or value.get("kind") != MODEL_KIND:
            kind = value.get("kind") if isinstance(value, dict) else type(value).__name__
            raise errors.ModelConfigError(
                f"{source}: config is not a {MODEL_KIND} config (kind {kind!r}); it was not written by "
                "Transformer.save_checkpoint")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields - {"kind"})
        missing = sorted(fields - set(value))
        if unknown or missing:
            raise errors.ModelConfigError(f"{source}: config has unknown keys {unknown} / lacks keys {missing}")
        return cls(**{name: value[name] for name in fields})

    def differences(self, other: ModelConfig) -> list[tuple[str, Any, Any]]:
        """(field, self's value, other's value) for each field that differs; empty when the configs match."""
        return [(f.name, getattr(self, f.name), getattr(other, f.name))
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in the model's canonical order (the order checkpoints are written in)."""
    d, f = config.dim, config.ffn_dim
    shapes: dict[str, tuple[int, ...]] = {
        "tok_emb": (config.vocab_size, d),
        "pos_emb": (config.max_seq_len, d),
    }
    for i in range(config.num_layers):
        p = f"blocks.{i}."
        shapes.update({
            p + "ln1.weight": (d,), p + "ln1.bias": (d,),
            p + "attn.qkv.weight": (d, 3 * d), p + "attn.qkv.bias": (3 * d,),
            p + "attn.out.weight": (d, d), p + "attn.out.bias": (d,),
            p + "ln2.weight": (d,), p + "ln2.bias": (d,),
            p + "ffn.in.weight": (d, f), p + "ffn.in.bias": (f,),
            p + "ffn.out.weight": (f, d), p + "ffn.out.bias": (d,),
        })
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,), "head.weight": (d, config.vocab_size)})
    return shapes


def init_params(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """GPT-2 initialisation: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2 * layers), LN = identity."""
    rng = np.random.Generator(np.random.PCG64(seed))
    dtype = np.dtype(config.dtype)
    residual_std = 0.02 / math.sqrt(2 * config.num_layers)
    params: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(config).items():
        if name.endswith(".bias"):
            value = np.zeros(shape, dtype)
        elif name.endswith((".ln1.weight", ".ln2.weight")) or name == "ln_f.weight":
            value = np.ones(shape, dtype)
        else:
            std = residual_std if name.endswith(("attn.out.weight", "ffn.out.weight")) else 0.02
            value = rng.standard_normal(shape).astype(dtype) * dtype.type(std)
        params[name] = np.ascontiguousarray(value)
    return params
