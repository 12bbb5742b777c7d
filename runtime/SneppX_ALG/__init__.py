"""SneppX runtime: fast, safe, verifiable checkpoints and elastic training.

This module only re-exports the public API; each name lives in the module of
its concept (see the layout in README.md).
"""

from SneppX_ALG.checkpoint import CheckpointReader, CheckpointWriter, validate_checkpoint
from SneppX_ALG.coordinator import CheckpointCoordinator
from SneppX_ALG.errors import SneppXError
from SneppX_ALG.model import Transformer
from SneppX_ALG.signing import generate_keypair, sign_checkpoint, verify_checkpoint
from SneppX_ALG.training import SyntheticLanguage, Trainer
from SneppX_ALG.updates import SignedUpdateManager

__all__ = [
    "CheckpointCoordinator",
    "CheckpointReader",
    "CheckpointWriter",
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
