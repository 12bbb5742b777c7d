"""SneppX runtime: fast, safe, verifiable checkpoints and elastic training.

This module only re-exports the public API; each name lives in the module of
its concept (see the layout in README.md).
"""

from SneppX_ALG.checkpoint import CheckpointReader, CheckpointWriter, validate_checkpoint
from SneppX_ALG.coordinator import CheckpointCoordinator
from SneppX_ALG.errors import SneppXError
from SneppX_ALG.model import Transformer
from SneppX_ALG.training import SyntheticLanguage, Trainer

__all__ = [
    "CheckpointCoordinator",
    "CheckpointReader",
    "CheckpointWriter",
    "SneppXError",
    "SyntheticLanguage",
    "Trainer",
    "Transformer",
    "validate_checkpoint",
]
