"""SneppX runtime: fast, safe, verifiable checkpoints and elastic training.

This module only re-exports the public API; each name lives in the subpackage of its concept (the layers
are drawn in README.md, "Layout").
"""

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

__all__ = [
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
