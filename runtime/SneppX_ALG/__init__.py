"""SneppX runtime: fast, safe, verifiable checkpoints and elastic training.

This module only re-exports the public API; each name lives in the module of
its concept (see the layout in README.md).
"""

from SneppX_ALG.checkpoint import CheckpointReader, CheckpointWriter, validate_checkpoint
from SneppX_ALG.errors import SneppXError

__all__ = [
    "CheckpointReader",
    "CheckpointWriter",
    "SneppXError",
    "validate_checkpoint",
]
