"""Running a training step on several cores: the batch cut into parts, one per BLAS thread, each part run on a
thread of its own with single-threaded BLAS (Transformer's class docstring says why).

Why a module of its own: how many threads BLAS may use, and how a batch is cut for them, is a property of the
process (OPENBLAS_NUM_THREADS, threadpoolctl limits), not of the model.
"""

from __future__ import annotations

import itertools
from typing import Any

import threadpoolctl


def _blas() -> Any:
    """threadpoolctl's controller of the BLAS libraries numpy loaded, made once (finding them costs ~1 ms)."""
    global _BLAS
    if _BLAS is None:
        _BLAS = threadpoolctl.ThreadpoolController().select(user_api="blas")
    return _BLAS


_BLAS: Any = None


def blas_threads() -> int:
    """How many threads BLAS may use now (OPENBLAS_NUM_THREADS, threadpoolctl limits): the cores a step uses."""
    counts = [lib.num_threads for lib in _blas().lib_controllers]
    return max(counts) if counts else 1


def one_blas_thread() -> Any:
    """A context in which BLAS uses one thread (process-wide): the parts of a batch run inside it, each on a
    thread of its own."""
    return _blas().limit(limits=1)


# A part of a batch gets at least this many tokens: below it, handing a part to a thread costs about what
# running it there saves (and tiny test batches keep the numerics of one part).
MIN_PART_TOKENS = 256


def batch_parts(batch: int, seq: int, threads: int) -> list[tuple[int, int]]:
    """The (start, stop) rows of each part a (batch, seq) batch is split into, at most one part per thread and
    at least MIN_PART_TOKENS tokens a part: as equal as can be."""
    parts = max(1, min(batch, threads, batch * seq // MIN_PART_TOKENS))
    bounds = [batch * i // parts for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))
