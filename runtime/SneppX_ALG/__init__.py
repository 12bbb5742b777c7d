"""SneppX runtime: fast, safe, verifiable checkpoints and elastic training.

This module only re-exports the public API; each name lives in the subpackage of its concept (the layers
are drawn in README.md, "Layout"). The names are imported on first use (PEP 562), so importing one submodule
(the operator imports `SneppX_ALG.contract` and `SneppX_ALG.errors`) loads nothing else: not numpy, not the
native library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each public name, and the module it lives in.
_EXPORTS = {
    "CheckpointReader": "SneppX_ALG.checkpoint",
    "CheckpointWriter": "SneppX_ALG.checkpoint",
    "SignedUpdateManager": "SneppX_ALG.checkpoint",
    "generate_keypair": "SneppX_ALG.checkpoint",
    "sign_checkpoint": "SneppX_ALG.checkpoint",
    "validate_checkpoint": "SneppX_ALG.checkpoint",
    "verify_checkpoint": "SneppX_ALG.checkpoint",
    "CheckpointCoordinator": "SneppX_ALG.coordinator",
    "FaultToleranceManager": "SneppX_ALG.elastic.fault_tolerance",
    "HeartbeatMonitor": "SneppX_ALG.elastic.heartbeat",
    "ElasticTrainer": "SneppX_ALG.elastic.trainer",
    "SneppXError": "SneppX_ALG.errors",
    "SyntheticLanguage": "SneppX_ALG.model",
    "Trainer": "SneppX_ALG.model",
    "Transformer": "SneppX_ALG.model",
}

__all__ = [  # the same names (a test checks it), as a literal: what tools read
    "CheckpointCoordinator",
    "CheckpointReader",
    "CheckpointWriter",
    "ElasticTrainer",
    "FaultToleranceManager",
    "HeartbeatMonitor",
    "SignedUpdateManager",
    "SneppXError",
    "SyntheticLanguage",
    "Trainer",
    "Transformer",
    "generate_keypair",
    "sign_checkpoint",
    "validate_checkpoint",
    "verify_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'SneppX_ALG' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once: later lookups don't come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:
    from SneppX_ALG.checkpoint import (
        CheckpointReader,
        CheckpointWriter,
        SignedUpdateManager,
        generate_keypair,
        sign_checkpoint,
        validate_checkpoint,
        verify_checkpoint,
    )
    from SneppX_ALG.coordinator import CheckpointCoordinator
    from SneppX_ALG.elastic.fault_tolerance import FaultToleranceManager
    from SneppX_ALG.elastic.heartbeat import HeartbeatMonitor
    from SneppX_ALG.elastic.trainer import ElasticTrainer
    from SneppX_ALG.errors import SneppXError
    from SneppX_ALG.model import SyntheticLanguage, Trainer, Transformer
