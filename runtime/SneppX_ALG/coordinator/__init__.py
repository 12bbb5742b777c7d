"""The checkpoint coordinator: periodic, asynchronous, crash-consistent saves of a training state, with
retention, and `latest()` / `restore()` of the newest step that validates.

Modules (each imports only those before it):

    plan        pure: tensors cut into pieces, packed into staging buffers, the manifest's contents
    retention   pure: when to save, which steps to keep
    timeline    pure: the fence a restore to an older step makes, and its record
    state       the user's state flattened on save and rebuilt on restore
    steps       the root's steps as both threads see them: current timeline, validation, read retries
    engine      staging buffers and the background writer thread: commit, fencing, retention
    manager     CheckpointCoordinator, the public API
"""

from SneppX_ALG.coordinator.manager import CheckpointCoordinator, CheckpointInfo, SkippedCheckpoint

__all__ = ["CheckpointCoordinator", "CheckpointInfo", "SkippedCheckpoint"]
