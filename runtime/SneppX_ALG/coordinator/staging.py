"""The staging pool: the bounded host buffers a snapshot copies the state into and the writer drains.

Why a module of its own: the buffers are shared by save() (which fills them, coordinator/manager.py) and the
writer thread (which drains them, coordinator/engine.py), and what a buffer still holds after a committed save
is what an incremental snapshot compares with; none of that depends on how a step is written or committed.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np

from SneppX_ALG import _native
from SneppX_ALG.coordinator import plan


def host_piece(leaf: np.ndarray, piece: plan.Piece) -> np.ndarray:
    """The bytes of one piece of a host tensor, little-endian and in C order, as uint8: a view when the tensor
    is already both, else a copy of the piece's box alone (never of the whole tensor)."""
    little = leaf.dtype.newbyteorder("<") if leaf.dtype.byteorder == ">" else leaf.dtype
    if leaf.flags.c_contiguous and little == leaf.dtype:
        return leaf.reshape(-1).view(np.uint8)[piece.start:piece.start + piece.nbytes]
    block = np.ascontiguousarray(leaf[piece.box.slices()], dtype=little)
    return block.reshape(-1).view(np.uint8)


@dataclasses.dataclass(frozen=True)
class Held:
    """What a staging buffer still holds after the save that filled it committed: step `step`'s bytes of these
    pieces, by entry name: (offset in the buffer, length, CRC32C). An incremental save compares a host piece
    with them byte for byte, instead of hashing it, to learn that it did not change."""

    step: int
    pieces: dict[str, tuple[int, int, int]]


class StagingPool:
    """At most `limit` buffers of `size` bytes, allocated on first use and reused (pinned on a GPU copier).

    Each buffer has a slot number. An incremental save whose state fits the pool takes slot i for its i-th
    buffer every time, so each buffer still holds, at the next save, what the last one staged there: `held`,
    recorded once that save committed, and only while no later save has taken the slot since."""

    def __init__(self, copier: _native.Copier, size: int, limit: int):
        self.copier, self.size, self.limit = copier, size, max(2, limit)
        self._buffers: list[Any] = [None] * self.limit  # by slot; None until first used
        self._free = set(range(self.limit))
        self._owner: dict[int, object] = {}  # the save that last took each slot
        self._held: dict[int, Held] = {}
        self._cond = threading.Condition()

    def acquire(self, owner: object, on_wait: Any = None, slot: int | None = None) -> tuple[int, Held | None]:
        """A free slot (`slot`: that one; None: any, an allocated one first) for `owner`, and what its buffer held
        (None: nothing known), which the owner now overwrites; blocks while it is taken (calling on_wait() first)."""
        with self._cond:
            def ready() -> bool:
                return slot in self._free if slot is not None else bool(self._free)

            if not ready() and on_wait is not None:
                on_wait()
            while not ready():
                self._cond.wait()
            if slot is None:
                allocated = [s for s in self._free if self._buffers[s] is not None]
                slot = max(allocated) if allocated else min(self._free)
            self._free.remove(slot)
            self._owner[slot] = owner
            held = self._held.pop(slot, None)
            if self._buffers[slot] is not None:
                return slot, held
        try:
            buffer = self.copier.alloc(self.size)
        except BaseException:
            self.release(slot)
            raise
        self._buffers[slot] = buffer  # only the slot's holder touches its entry
        return slot, None

    def buffer(self, slot: int) -> Any:
        return self._buffers[slot]

    def release(self, slot: int) -> None:
        with self._cond:
            self._free.add(slot)
            self._cond.notify_all()

    def settle(self, slot: int, owner: object, held: Held) -> None:
        """`owner`'s save committed: its slot holds `held`, unless a later save has taken the slot since."""
        with self._cond:
            if self._owner.get(slot) is owner:
                self._held[slot] = held

    def forget(self) -> None:
        """Nothing held is to be compared with any more (a restore starts another chain)."""
        with self._cond:
            self._held.clear()

    @property
    def allocated_bytes(self) -> int:
        return sum(b is not None for b in self._buffers) * self.size

    def clear(self) -> None:
        """Frees the buffers not in use."""
        with self._cond:
            for slot in self._free:
                self._buffers[slot] = None
                self._held.pop(slot, None)
