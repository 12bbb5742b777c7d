"""The checkpoint coordinator: periodic, asynchronous, crash-consistent saves of a training state, with
retention, and `latest()` / `restore()` of the newest step that validates.

Modules (each imports only those before it):

    plan        pure: tensors cut into pieces, packed into staging buffers, the manifest's contents
    retention   pure: when to save, which steps to keep
    timeline    pure: the fence a restore to an older step makes, and its record
    group       the Group protocol: the ranks that save and restore together (a ProcessGroup fits)
    state       the user's state flattened on save and rebuilt on restore; Shard
    steps       the root's steps as both threads see them: current timeline, validation, read retries
    staging     the staging pool: bounded host buffers, and what each still holds after a committed save
    increments  incremental saves: the chain a save may reference, and when a piece is referenced
    job         one save as save() and the writer share it
    upkeep      the root's upkeep: fences applied, invalid steps set aside, retention planned and applied
    engine      the background writer thread: the save protocol of a group of ranks, the commit
    snapshot    save()'s half on the caller's thread: the state planned and copied into staging buffers
    manager     CheckpointCoordinator, the public API
"""

from SneppX_ALG.coordinator.group import Group
from SneppX_ALG.coordinator.manager import CheckpointCoordinator, CheckpointInfo, SkippedCheckpoint
from SneppX_ALG.coordinator.state import Shard

__all__ = ["CheckpointCoordinator", "CheckpointInfo", "Group", "Shard", "SkippedCheckpoint"]
