"""One SNPX checkpoint file, written and read: where callers import CheckpointWriter and its Sink (writer.py),
and CheckpointReader, read_layout and the tensor checks (reader.py) from, as they did before the writer and
the reader became modules of their own (they share nothing but the format).
"""

from __future__ import annotations

from SneppX_ALG.checkpoint.reader import (  # noqa: F401 - re-exported
    CheckpointReader,
    Layout,
    check_tensor,
    check_tensors,
    read_layout,
    tensor_errors,
)
from SneppX_ALG.checkpoint.writer import CheckpointWriter, Sink  # noqa: F401 - re-exported
