"""The reference model and its training: a numpy decoder-only Transformer with hand-written gradients,
AdamW, generated data with a saveable position, and the train loop.

Modules (each imports only those before it):

    transformer   ModelConfig, Transformer (forward, backward, SNPX checkpoints)
    optimizer     AdamW
    data          SyntheticLanguage, DataStream
    training      Trainer, ProgressBar
    data_parallel DataParallelTrainer: the same training on the ranks of a ProcessGroup, ZeRO-1 sharded AdamW
"""

from SneppX_ALG.model.data import SyntheticLanguage
from SneppX_ALG.model.data_parallel import DataParallelTrainer
from SneppX_ALG.model.optimizer import AdamW
from SneppX_ALG.model.training import Trainer
from SneppX_ALG.model.transformer import Transformer

__all__ = ["AdamW", "DataParallelTrainer", "SyntheticLanguage", "Trainer", "Transformer"]
