"""The reference model and its training: a numpy decoder-only Transformer with hand-written gradients,
AdamW, generated data with a saveable position, and the train loop.

Modules (each imports only those before it):

    transformer   ModelConfig, Transformer (forward, backward, SNPX checkpoints)
    optimizer     AdamW
    data          SyntheticLanguage, DataStream
    training      Trainer, ProgressBar
"""

from SneppX_ALG.model.data import SyntheticLanguage
from SneppX_ALG.model.optimizer import AdamW
from SneppX_ALG.model.training import Trainer
from SneppX_ALG.model.transformer import Transformer

__all__ = ["AdamW", "SyntheticLanguage", "Trainer", "Transformer"]
