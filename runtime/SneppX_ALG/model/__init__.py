"""The reference model and its training: a numpy decoder-only Transformer with hand-written gradients,
AdamW, generated data with a saveable position, and the train loop.

Modules (each imports only those before it):

    config        ModelConfig: the architecture, every parameter's name and shape, their initialisation
    layers        the pieces of the forward and backward passes (LayerNorm, GELU, cross-entropy, ...), Workspace
    parts         a batch cut into parts, one per BLAS thread
    transformer   Transformer (forward, backward, SNPX checkpoints)
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
