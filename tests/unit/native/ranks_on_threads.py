"""Ranks as threads of the test process (cffi releases the GIL, so their C calls really run at once), for the
tests of the collectives' C cores (test_comm_ring.py, test_comm_shm.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

NUMPY_OPS = {"sum": np.sum, "max": np.max, "min": np.min}


def run_ranks(comms: Sequence[Any], fn: Callable[[int, Any], Any]) -> list[Any]:
    """fn(rank, comm) on one thread per rank; returns each result or the exception it raised."""
    results: list[Any] = [None] * len(comms)

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, comms[rank])
        except Exception as e:  # noqa: BLE001 - handed back to the test to assert on
            results[rank] = e

    threads = [threading.Thread(target=body, args=(rank,)) for rank in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def inputs(world: int, count: int, dtype: str, seed: int) -> list[np.ndarray]:
    """Each rank's data: integers small enough that sums don't wrap, floats normal."""
    rng = np.random.default_rng(seed)
    if dtype.startswith("int"):
        return [rng.integers(-1000, 1000, count).astype(dtype) for _ in range(world)]
    return [rng.standard_normal(count).astype(dtype) for _ in range(world)]
