"""The ranks that save and restore one checkpoint together, as the coordinator sees them: a small Protocol.

Why a Protocol, not the ProcessGroup: the coordinator needs very little of a group: who this rank is, and two
collectives over small messages (who wrote what, and what rank 0 decided). `collectives.ProcessGroup` has exactly this shape, so it is passed as it is
(`CheckpointCoordinator(..., group=pg)`); a test or another runtime can pass anything else that has it.

Without a group the coordinator is one rank of one (`SOLO`): the same code path, no collectives.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Group(Protocol):
    """What the coordinator needs of a process group. Every rank of the group calls the coordinator's
    collective methods (save, restore) in the same order; the coordinator calls these in that order too.

    `allgather(array)`: `array` has a first axis of world_size; row r ends up holding rank r's row, on every
    rank (in place). `broadcast(array, root)`: root's `array` is copied into every rank's, in place. Both raise
    on a failed or timed-out peer (the group is then unusable: a new generation makes a new one)."""

    rank: int
    world_size: int
    generation: int

    def allgather(self, array: np.ndarray, timeout: float | None = None) -> np.ndarray: ...

    def broadcast(self, array: np.ndarray, root: int = 0, timeout: float | None = None) -> np.ndarray: ...


class Solo:
    """The group of one: a coordinator without a group."""

    rank = 0
    world_size = 1
    generation = 0

    def allgather(self, array: np.ndarray, timeout: float | None = None) -> np.ndarray:
        return array

    def broadcast(self, array: np.ndarray, root: int = 0, timeout: float | None = None) -> np.ndarray:
        return array


SOLO = Solo()


def allgather_json(group: Group, value: Any) -> list[Any]:
    """Every rank's JSON-safe `value`, in rank order, on every rank (two allgathers: the lengths, then the
    bytes padded to the longest)."""
    if group.world_size == 1:
        return [value]
    data = json.dumps(value, separators=(",", ":")).encode()
    lengths = np.zeros((group.world_size, 1), np.int64)
    lengths[group.rank, 0] = len(data)
    group.allgather(lengths)
    rows = np.zeros((group.world_size, max(1, int(lengths.max()))), np.uint8)
    rows[group.rank, :len(data)] = np.frombuffer(data, np.uint8)
    group.allgather(rows)
    return [json.loads(rows[r, :int(lengths[r, 0])].tobytes()) for r in range(group.world_size)]


def broadcast_json(group: Group, value: Any, root: int = 0) -> Any:
    """Root's JSON-safe `value` on every rank (the others pass anything, e.g. None)."""
    if group.world_size == 1:
        return value
    data = json.dumps(value, separators=(",", ":")).encode() if group.rank == root else b""
    length = np.array([len(data)], np.int64)
    group.broadcast(length, root)
    buffer = np.zeros(max(1, int(length[0])), np.uint8)
    if group.rank == root:
        buffer[:len(data)] = np.frombuffer(data, np.uint8)
    group.broadcast(buffer, root)
    return json.loads(buffer[:int(length[0])].tobytes())
