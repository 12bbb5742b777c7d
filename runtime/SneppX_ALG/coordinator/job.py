"""One save as both of its threads see it: what save() planned and staged, what the writer wrote, and how
this rank's part of the step ended.

Why a module of its own: a Job is the one object save() (coordinator/manager.py) and the writer thread
(coordinator/engine.py) share for a step; its fields are the contract between them.
"""

from __future__ import annotations

import dataclasses
import threading
import traceback
from typing import Any

from SneppX_ALG import storage
from SneppX_ALG.checkpoint import file
from SneppX_ALG.coordinator import plan
from SneppX_ALG.coordinator.increments import Chain


@dataclasses.dataclass
class Job:
    step: int
    kind: str = "mapping"
    specs: list[plan.TensorSpec] = dataclasses.field(default_factory=list)  # the tensors this rank writes
    declared: str = ""  # plan.replicated_declaration of this rank's state
    pieces: list[plan.Piece] = dataclasses.field(default_factory=list)
    values: list[tuple[tuple[str, ...], Any]] = dataclasses.field(default_factory=list)
    training_state: Any = None
    # This rank can't contribute the step (its own error, raised once the group has the step's outcome).
    failed: bool = False
    error: BaseException | None = None
    raised: bool = False  # save() raised `error` itself: the writer reports it to the group, never raises it again
    # The group agreed that the step began (rank 0 claimed it): every rank then takes part in its end.
    began: bool = False
    committed: bool = False
    # Set when the snapshot is done, or when it waits for a buffer: until then the writer stays idle, so on
    # a small machine it doesn't compete with the copy that save() is blocked on.
    may_write: threading.Event = dataclasses.field(default_factory=threading.Event)
    pending: storage.PendingStep | None = None
    writer: file.CheckpointWriter | None = None
    # CRC32C of every piece as it was staged; the writer checks its own against it, so on success these
    # are also the CRCs in the shard, and the manifest lists them.
    snapshot_crcs: dict[str, int] = dataclasses.field(default_factory=dict)
    # Each written piece as a manifest chunk (plan.chunk_record), by entry name.
    records: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # Producer streams (of CUDA tensors) the copier's stream was already ordered after during this snapshot.
    ordered_streams: set[int] = dataclasses.field(default_factory=set)
    # Incremental saves: the chain this save may reference (None: a full save), whether it hashes every block
    # with BLAKE3 (to be compared now, or next time), and the bytes it referenced instead of writing.
    base: Chain | None = None
    hashing: bool = False
    # The checksum block size of this save's chunks (the engine's, or one for the state's size: same on every rank).
    block_bytes: int = 0
    reused_bytes: int = 0
    state_bytes: int = 0
    # The staging slots this save filled, with their pieces (what they hold once it commits), and the pieces the
    # snapshot found equal, byte for byte, to what a slot held since committed step S (entry -> S): not copied.
    slots: list[tuple[int, list[plan.Piece]]] = dataclasses.field(default_factory=list)
    same: dict[str, int] = dataclasses.field(default_factory=dict)
    token: object = dataclasses.field(default_factory=object)  # this save, as the owner of staging slots

    def fail(self, error: BaseException) -> None:
        """This rank's part of the step failed: kept, the writer dropped; the step's end still runs."""
        # The error outlives the call that raised it: its frames must not keep staging views and the arrays over
        # them (a memoryview with an array exporting from it, freed by the cycle collector, crashed CPython 3.11
        # in _memory_release: seen when a write failed inside _write_buffer).
        traceback.clear_frames(error.__traceback__)
        if self.error is None:
            self.error = error
        self.failed = True
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.abort()
